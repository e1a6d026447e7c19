//! Connections that batch collectors keep between batches instead of returning them to the pool.
//!
//! sqlx tests a connection with a round trip when it leaves the pool and again when it comes
//! back. A collector runs hundreds of short batches a second one after the other, so those two
//! pings were two of an enqueue batch's ten round trips (ADR 0009). A collector takes its
//! connection from here and gives it back only after the connection served a batch without
//! error. A connection not given back is closed when dropped, never returned to the pool: an
//! error may have left it inside a transaction sqlx does not know about (a failed
//! `BEGIN; …` in one simple query, see `queue::Client::begin_on_with`), and the next batch gets
//! a fresh one.
//!
//! Nothing tests a held connection before it serves the next batch, so one the server closed
//! meanwhile (a restart, an idle kill) fails that batch's first statement. A collector then
//! runs the batch once more on [`HeldConnections::take_fresh`] if it is safe to
//! ([`Held::may_retry_after`]).

use std::ops::{Deref, DerefMut};
use std::sync::Mutex;

use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres};

/// At most this many connections stay held (one per concurrently running batch is enough).
const MOST_HELD: usize = 16;

/// Connections held out of `pool` for batches.
#[derive(Debug)]
pub struct HeldConnections {
    pool: PgPool,
    idle: Mutex<Vec<PoolConnection<Postgres>>>,
}

/// A connection taken from [`HeldConnections`]: given back with [`HeldConnections::keep`], or
/// else closed when dropped.
#[derive(Debug)]
pub struct Held {
    conn: Option<PoolConnection<Postgres>>,
    /// It served an earlier batch and was kept since, untested (the pool tests those it hands
    /// out).
    reused: bool,
}

impl Held {
    /// Whether a batch that failed with `error` on this connection may run again on a fresh
    /// one: the connection was kept from an earlier batch, and `error` says the connection
    /// failed, not the statement. The caller must also know that nothing of the batch can have
    /// committed: a connection lost after `COMMIT` was sent leaves that unknown.
    pub fn may_retry_after(&self, error: &sqlx::Error) -> bool {
        self.reused && queue::error::is_connection_error(error)
    }
}

impl Deref for Held {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        self.conn
            .as_deref()
            .unwrap_or_else(|| unreachable!("a Held has its connection until drop"))
    }
}

impl DerefMut for Held {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.conn
            .as_deref_mut()
            .unwrap_or_else(|| unreachable!("a Held has its connection until drop"))
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.as_mut() {
            conn.close_on_drop();
        }
    }
}

impl HeldConnections {
    pub fn new(pool: PgPool) -> Self {
        HeldConnections {
            pool,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// A held connection, or one from the pool if none is idle.
    pub async fn take(&self) -> Result<Held, sqlx::Error> {
        let held = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match held {
            Some(conn) => Ok(Held {
                conn: Some(conn),
                reused: true,
            }),
            None => self.take_fresh().await,
        }
    }

    /// A connection from the pool (which tests an idle one before handing it out), never a held
    /// one: for a batch to run again after its held connection failed.
    pub async fn take_fresh(&self) -> Result<Held, sqlx::Error> {
        Ok(Held {
            conn: Some(self.pool.acquire().await?),
            reused: false,
        })
    }

    /// Keeps `conn` for the next batch. Call only when it just served one without error (a
    /// committed or rolled-back transaction), so that it is idle and alive.
    pub fn keep(&self, mut conn: Held) {
        let Some(conn) = conn.conn.take() else {
            return;
        };
        if self.pool.is_closed() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < MOST_HELD {
            idle.push(conn);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Duration;

    use super::*;

    async fn backend_pid(conn: &mut PgConnection) -> i32 {
        let (pid,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()")
            .fetch_one(conn)
            .await
            .unwrap();
        pid
    }

    /// Whether backend `pid` is still connected.
    pub(crate) async fn is_connected(pool: &PgPool, pid: i32) -> bool {
        let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM pg_stat_activity WHERE pid = $1")
            .bind(pid)
            .fetch_one(pool)
            .await
            .unwrap();
        n > 0
    }

    /// Waits up to 10 s for backend `pid` to leave (it does once it has read its connection's
    /// goodbye); fails with `message` if it stays.
    pub(crate) async fn wait_until_disconnected(pool: &PgPool, pid: i32, message: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while is_connected(pool, pid).await {
            assert!(std::time::Instant::now() < deadline, "{message}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn a_kept_connection_is_reused_and_one_not_kept_is_closed() {
        let db = testkit::TestDb::new().await;
        let held = HeldConnections::new(db.pool.clone());

        let mut conn = held.take().await.unwrap();
        let kept = backend_pid(&mut conn).await;
        held.keep(conn);
        let mut conn = held.take().await.unwrap();
        assert_eq!(backend_pid(&mut conn).await, kept);

        // Left inside an aborted transaction sqlx does not track, then dropped: closed, not
        // pooled.
        sqlx::raw_sql("BEGIN; SELECT 1 / 0")
            .execute(&mut *conn)
            .await
            .unwrap_err();
        drop(conn);
        wait_until_disconnected(&db.pool, kept, "the connection stayed open").await;
        let mut fresh = held.take().await.unwrap();
        assert_ne!(backend_pid(&mut fresh).await, kept);
        let (ok,): (i32,) = sqlx::query_as("SELECT 1")
            .fetch_one(&mut *fresh)
            .await
            .unwrap();
        assert_eq!(ok, 1);
    }

    /// The error of a statement PostgreSQL refuses (the connection stays fine).
    async fn division_by_zero(conn: &mut PgConnection) -> sqlx::Error {
        sqlx::query("SELECT 1 / 0").execute(conn).await.unwrap_err()
    }

    #[tokio::test]
    async fn only_a_kept_connection_that_died_may_be_retried_on_a_fresh_one() {
        let db = testkit::TestDb::new().await;
        let held = HeldConnections::new(db.pool.clone());
        let mut fresh = held.take().await.unwrap();
        let refused = division_by_zero(&mut fresh).await;
        assert!(!fresh.may_retry_after(&refused), "a fresh connection");
        assert!(
            !fresh.may_retry_after(&sqlx::Error::PoolClosed),
            "a fresh connection"
        );
        let pid = backend_pid(&mut fresh).await;
        held.keep(fresh);

        let mut kept = held.take().await.unwrap();
        let refused = division_by_zero(&mut kept).await;
        assert!(!kept.may_retry_after(&refused), "the statement failed");
        let (terminated,): (bool,) = sqlx::query_as("SELECT pg_terminate_backend($1, 10000)")
            .bind(pid)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert!(terminated);
        let lost = sqlx::query("SELECT 1")
            .execute(&mut *kept)
            .await
            .unwrap_err();
        assert!(kept.may_retry_after(&lost), "{lost:?}");
        drop(kept);
        let mut again = held.take_fresh().await.unwrap();
        assert_ne!(backend_pid(&mut again).await, pid);
    }
}
