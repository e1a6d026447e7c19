//! Extension points inside the queue's own transactions.
//!
//! - [`TransitionHook`] runs in the transaction that moves jobs out of `running` (completion,
//!   retry, snooze, cancel, rescue, hand-back) or cancels a waiting job: quota billing and
//!   reservation release plug in here, so they commit or roll back together with the job's state.
//! - [`FetchGate`] chooses which runnable jobs a fetch may start, inside the fetch transaction:
//!   per-user fairness plugs in here, so a user's limit is checked and taken atomically with the
//!   jobs becoming `running`.

use async_trait::async_trait;
use common::QueueName;
use sqlx::{PgConnection, PgPool, Postgres, Transaction};

use crate::error::BoxError;
use crate::job::{JobId, JobState};

/// A job's move to a new state, as seen by a [`TransitionHook`].
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Transition {
    #[sqlx(rename = "id")]
    pub job_id: JobId,
    pub queue: String,
    pub kind: String,
    pub user_id: Option<uuid::Uuid>,
    /// The state the job is in after the transition.
    pub state: JobState,
}

/// Code that must commit atomically with job state changes.
///
/// Completion hooks run in the completer's transaction, which plans every prepared statement
/// generically, without its parameters' values (ADR 0014). A hook's statements should be keyed
/// by the transitions' ids (`= ANY($1)`), which such plans look up through an index.
#[async_trait]
pub trait TransitionHook: Send + Sync + 'static {
    /// Called with every job the enclosing statement moved (never with stale no-ops). An error
    /// rolls the whole transaction back; the queue retries it.
    async fn on_transitions(
        &self,
        conn: &mut PgConnection,
        transitions: &[Transition],
    ) -> Result<(), BoxError>;

    /// Queues whose producers should be woken once the transaction has committed (for example
    /// because these transitions freed a slot that waiting jobs need). Sent through the
    /// [`Waker`](crate::wake::Waker), outside the transaction.
    fn wake_after_commit(&self, transitions: &[Transition]) -> Vec<String> {
        let _ = transitions;
        Vec::new()
    }
}

/// Bitmap scans and sorts off for the rest of the transaction: written once for the two
/// transactions below that open with them (ADR 0013).
macro_rules! ordered_scan_settings {
    () => {
        "SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off"
    };
}

/// The fetch transaction's `BEGIN` and settings, in one simple query (one round trip); the
/// settings end with the transaction.
///
/// - `synchronous_commit` off: a fetch lost in a server crash only puts its jobs back to
///   `available` (and the run that went on meanwhile is refused at completion: its
///   `attempted_at` is not the job's any more once it is fetched again), so it need not
///   wait for the WAL flush. Completions keep full durability.
/// - Bitmap scans and sorts off, so a statement ordered like `fairlane_job_fetch` walks that
///   index and stops at its `LIMIT` (ADR 0013). With no statistics on `state`
///   (docs/queue-storage.md) the planner takes 0.5 % of a lane's rows to be `available`. While
///   that guess is below the limit (a lane of fewer than 200 times the limit's rows), it reads
///   the lane's whole backlog through a bitmap and sorts it, on every fetch, and the fairness
///   gate tries its per-user advisory lock on every row it reads.
pub(crate) const FETCH_BEGIN_SQL: &str = concat!(
    "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL synchronous_commit = off; ",
    ordered_scan_settings!()
);

/// The promoter's batches' `BEGIN` with bitmap scans and sorts off, for the same reason as the
/// fetch's ([`FETCH_BEGIN_SQL`], ADR 0013), with the due index.
const ORDERED_SCAN_BEGIN_SQL: &str = concat!("BEGIN; ", ordered_scan_settings!());

/// Opens a fetch transaction on a connection of `pool`, with its settings
/// ([`FETCH_BEGIN_SQL`]) sent with the `BEGIN`. The engine opens every fetch this way; a
/// [`FetchGate`] runs inside it.
pub async fn begin_fetch(pool: &PgPool) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
    crate::begin::begin_with(pool, FETCH_BEGIN_SQL).await
}

/// Opens a transaction on a connection of `pool` with bitmap scans and sorts off
/// ([`ORDERED_SCAN_BEGIN_SQL`]), for the promoter's batches.
pub(crate) async fn begin_ordered_scan(
    pool: &PgPool,
) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
    crate::begin::begin_with(pool, ORDERED_SCAN_BEGIN_SQL).await
}

/// Chooses the jobs a fetch may start.
#[async_trait]
pub trait FetchGate: Send + Sync + 'static {
    /// Selects up to `limit` runnable (`available`) jobs of `queue` that may start now, locking
    /// them with `FOR UPDATE SKIP LOCKED`, and returns their ids. Runs inside the fetch
    /// transaction ([`begin_fetch`]); the transaction then marks exactly these jobs
    /// `running` and commits. A statement that reads runnable rows in fetch order should follow
    /// the fetch index (`ORDER BY priority, scheduled_at, id` within one queue) so that it stops
    /// at its limit.
    async fn select(
        &self,
        conn: &mut PgConnection,
        queue: &QueueName,
        limit: usize,
    ) -> Result<Vec<JobId>, BoxError>;
}

/// Every hook's after-commit wake-ups for `transitions`.
pub(crate) fn wakes_after_commit(
    hooks: &[std::sync::Arc<dyn TransitionHook>],
    transitions: &[Transition],
) -> Vec<String> {
    hooks
        .iter()
        .flat_map(|h| h.wake_after_commit(transitions))
        .collect()
}

/// Runs every hook, in registration order.
pub(crate) async fn run_hooks(
    hooks: &[std::sync::Arc<dyn TransitionHook>],
    conn: &mut PgConnection,
    transitions: &[Transition],
) -> Result<(), crate::error::QueueError> {
    if transitions.is_empty() {
        return Ok(());
    }
    for hook in hooks {
        hook.on_transitions(conn, transitions)
            .await
            .map_err(crate::error::QueueError::Hook)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use testkit::TestDb;

    /// The settings `tx` runs with, in the order asked.
    async fn settings(tx: &mut PgConnection, names: &[&str]) -> Vec<String> {
        let mut values = Vec::new();
        for name in names {
            let value: String = sqlx::query_scalar("SELECT current_setting($1)")
                .bind(*name)
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            values.push(value);
        }
        values
    }

    /// The settings sent with `BEGIN` hold inside the transaction and end with it: a later
    /// transaction on the same connection plans and commits as usual.
    #[tokio::test]
    async fn fetch_and_promoter_transactions_set_their_settings_for_themselves_only() {
        let db = TestDb::new().await;
        let names = ["synchronous_commit", "enable_bitmapscan", "enable_sort"];
        // One connection, so the later transaction runs where the settings were.
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with(db.pool.connect_options().as_ref().clone())
            .await
            .unwrap();

        let mut tx = begin_fetch(&pool).await.unwrap();
        assert_eq!(settings(&mut tx, &names).await, ["off", "off", "off"]);
        tx.commit().await.unwrap();

        let mut tx = begin_ordered_scan(&pool).await.unwrap();
        assert_eq!(settings(&mut tx, &names).await, ["on", "off", "off"]);
        tx.rollback().await.unwrap();

        let mut tx = pool.begin().await.unwrap();
        assert_eq!(settings(&mut tx, &names).await, ["on", "on", "on"]);
        tx.rollback().await.unwrap();
    }
}
