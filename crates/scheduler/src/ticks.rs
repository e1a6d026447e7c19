//! Claiming ticks in `scheduler_ticks`, so each periodic action commits at most once per tick
//! however many replicas believe they lead.
//!
//! A claim runs inside the transaction that does the tick's work and takes two steps:
//!
//! 1. **Fence**: the `scheduler` lease row must name this replica and be unexpired by the
//!    database's clock at the claim (`clock_timestamp()`, not the transaction's start: a
//!    transaction that did its reads first may have begun under a lease that has since lapsed),
//!    read `FOR SHARE`. The share lock keeps the lease from being taken over
//!    (or resigned) until the transaction ends, so the work commits only while this replica holds
//!    the lease, even if the process was paused between its own leadership check and the commit.
//! 2. **Claim**: `INSERT … ON CONFLICT DO NOTHING` on `(task, tick_at)`. A concurrent claimer of
//!    the same tick waits for the first one's transaction and then finds the row.
//!
//! Each tick transaction sets `idle_in_transaction_session_timeout` to a third of the lease TTL:
//! a replica frozen mid-transaction (SIGSTOP, a VM pause, a partition) is disconnected by the
//! server, which rolls its work back and releases its locks, instead of blocking the next leader.
//! The share lock holds back the leader's own renewals too, so the freeze may come up to a third
//! of the TTL after the last renewal: cut off a third of the TTL later, the lock is gone by the
//! time the lease expires, and the takeover bound holds (for ticks shorter than a third of the
//! TTL, which ticks are by far).

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool, Postgres, Transaction};

/// The lease that decides which scheduler replica acts.
pub const SCHEDULER_LEASE: &str = "scheduler";
/// Tick rows are kept this long after newer ticks of the same task (the newest is always kept:
/// it is where a new leader resumes).
pub const TICK_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The outcome of trying to claim a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// This transaction owns the tick: do the work and commit.
    Claimed,
    /// The tick was done (or is being done) by someone else.
    AlreadyDone,
    /// This replica does not hold the lease (by the database's clock): do nothing.
    NotLeader,
}

/// Where a task stands ([`TickStore::frontier`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frontier {
    /// The newest tick anyone did, up to `now`.
    pub last_done: Option<DateTime<Utc>>,
    /// The database's clock.
    pub now: DateTime<Utc>,
}

/// Claims ticks on behalf of one scheduler replica.
#[derive(Debug, Clone)]
pub struct TickStore {
    pool: PgPool,
    candidate_id: String,
    lease_ttl: Duration,
}

impl TickStore {
    pub fn new(pool: PgPool, candidate_id: impl Into<String>, lease_ttl: Duration) -> Self {
        TickStore {
            pool,
            candidate_id: candidate_id.into(),
            lease_ttl,
        }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub fn candidate_id(&self) -> &str {
        &self.candidate_id
    }

    /// Where `task` stands by the database's clock: the newest tick anyone did, and that clock.
    ///
    /// Ticks are reckoned against the database's clock, not the replica's, so that a replica
    /// whose clock is off (a bad NTP step, a VM restored with a stale clock) neither runs ticks
    /// early nor claims ticks of the future, which would leave nothing due anywhere until real
    /// time caught up with them. Rows of the future that such a replica left behind (before this
    /// rule) are not the frontier.
    pub async fn frontier(&self, task: &str) -> Result<Frontier, sqlx::Error> {
        let (last_done, now) = sqlx::query_as(
            "SELECT (SELECT max(tick_at) FROM scheduler_ticks \
                     WHERE task = $1 AND tick_at <= clock_timestamp()), \
                    clock_timestamp()",
        )
        .bind(task)
        .fetch_one(&self.pool)
        .await?;
        Ok(Frontier { last_done, now })
    }

    /// Begins a tick transaction (see the module docs for its session timeout).
    pub async fn begin(&self) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
        let mut tx = queue::begin::begin(&self.pool).await?;
        sqlx::query("SELECT set_config('idle_in_transaction_session_timeout', $1, true)")
            .bind(common::config::postgres_millis(self.lease_ttl / 3))
            .execute(&mut *tx)
            .await?;
        Ok(tx)
    }

    /// Whether `tick` of `task` is already done (a cheap look before expensive preparation; the
    /// claim itself is what decides).
    pub async fn is_done(
        &self,
        conn: &mut PgConnection,
        task: &str,
        tick: DateTime<Utc>,
    ) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM scheduler_ticks WHERE task = $1 AND tick_at = $2)",
        )
        .bind(task)
        .bind(tick)
        .fetch_one(&mut *conn)
        .await
    }

    /// Fences on the lease and claims `tick` of `task` inside the caller's transaction. Also
    /// prunes the task's ticks older than [`TICK_RETENTION`] before this one.
    pub async fn claim(
        &self,
        conn: &mut PgConnection,
        task: &str,
        tick: DateTime<Utc>,
    ) -> Result<Claim, sqlx::Error> {
        let holds_lease: Option<i32> = sqlx::query_scalar(
            "SELECT 1 FROM fairlane_leader \
             WHERE name = $1 AND leader_id = $2 AND expires_at > clock_timestamp() FOR SHARE",
        )
        .bind(SCHEDULER_LEASE)
        .bind(&self.candidate_id)
        .fetch_optional(&mut *conn)
        .await?;
        if holds_lease.is_none() {
            return Ok(Claim::NotLeader);
        }
        let claimed: Option<i32> = sqlx::query_scalar(
            "INSERT INTO scheduler_ticks (task, tick_at, claimed_by) VALUES ($1, $2, $3) \
             ON CONFLICT (task, tick_at) DO NOTHING RETURNING 1",
        )
        .bind(task)
        .bind(tick)
        .bind(&self.candidate_id)
        .fetch_optional(&mut *conn)
        .await?;
        if claimed.is_none() {
            return Ok(Claim::AlreadyDone);
        }
        sqlx::query(
            "DELETE FROM scheduler_ticks WHERE task = $1 \
             AND tick_at < $2 - make_interval(secs => $3)",
        )
        .bind(task)
        .bind(tick)
        .bind(TICK_RETENTION.as_secs_f64())
        .execute(&mut *conn)
        .await?;
        Ok(Claim::Claimed)
    }

    /// Stores what a claimed tick did.
    pub async fn record(
        conn: &mut PgConnection,
        task: &str,
        tick: DateTime<Utc>,
        result: &serde_json::Value,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("UPDATE scheduler_ticks SET result = $3 WHERE task = $1 AND tick_at = $2")
            .bind(task)
            .bind(tick)
            .bind(result)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}
