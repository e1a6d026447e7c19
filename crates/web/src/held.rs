//! Connections that batch collectors keep between batches instead of returning them to the pool.
//!
//! sqlx tests a connection with a round trip when it leaves the pool and again when it comes
//! back. A collector runs hundreds of short batches a second one after the other, so those two
//! pings were two of an enqueue batch's ten round trips (ADR 0009). A collector takes its
//! connection from here and puts it back only after the connection served a batch without
//! error; a connection that failed is dropped into the pool, whose check-in test closes it if it
//! is broken, and the next batch gets a fresh one.

use std::sync::Mutex;

use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};

/// At most this many connections stay held (one per concurrently running batch is enough).
const MOST_HELD: usize = 16;

/// Connections held out of `pool` for batches.
#[derive(Debug)]
pub struct HeldConnections {
    pool: PgPool,
    idle: Mutex<Vec<PoolConnection<Postgres>>>,
}

impl HeldConnections {
    pub fn new(pool: PgPool) -> Self {
        HeldConnections {
            pool,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// A held connection, or one from the pool if none is idle.
    pub async fn take(&self) -> Result<PoolConnection<Postgres>, sqlx::Error> {
        let held = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match held {
            Some(conn) => Ok(conn),
            None => self.pool.acquire().await,
        }
    }

    /// Keeps `conn` for the next batch. Call only when it just served one without error (a
    /// committed or rolled-back transaction), so that it is idle and alive.
    pub fn keep(&self, conn: PoolConnection<Postgres>) {
        if self.pool.is_closed() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < MOST_HELD {
            idle.push(conn);
        }
    }
}
