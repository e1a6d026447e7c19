//! The `analyses` and `specviews` records that worker jobs fill in (columns: docs/web.md;
//! life cycle: docs/analysis.md).
//!
//! A record's life follows its job, and its end is decided in the job's own final transaction:
//!
//! 1. the API (or the scheduler) inserts the record `pending` together with its job, `job_id` set;
//! 2. the handler [`claims`](analyses::claim) it (`running`), does the work and
//!    [`stages`](analyses::stage) the result on the record, still `running`;
//! 3. [`RecordHook`], a [`queue::TransitionHook`], runs inside the transaction that moves the job to
//!    a final state: `completed` makes the record `completed` (an analysis of a commit that already
//!    has a completed original becomes a copy of it, `cached_from`), `cancelled` or `discarded`
//!    makes it `failed` with a message taken from the job. A completion whose record holds no
//!    result is refused, so the attempt counts as failed instead of billing an empty record.
//!
//! So a record is `completed` exactly when its job is, which is exactly when the quota hook bills
//! it, whatever path ends the job (handler outcome, user cancel, rescue after a crash).

pub mod analyses;
mod hook;
pub mod specviews;

pub use hook::{RecordHook, SettleError, settle};

use sqlx::{Connection as _, PgConnection, PgPool};

/// Runs `work`, which reads or writes a large value (an inventory, a specview: up to 64 MiB), on
/// a connection of `pool`, then gives back the memory the connection's buffers grew to for it.
/// sqlx keeps a connection's read and write buffers at the largest message they held, so every
/// pooled connection that once carried a large value would hold that much for good: a service's
/// pool of 20 connections could come to hold more than a gigabyte. If `work` is cut short (a
/// request's timeout, a cancelled job), the connection is closed instead: sqlx would read the
/// rest of the message and pool it with its buffers grown.
pub async fn with_buffers_given_back<T>(
    pool: &PgPool,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
) -> Result<T, sqlx::Error> {
    let mut connection = queue::begin::ClosedUnlessReleased::acquire(pool).await?;
    let result = work(&mut connection).await;
    connection.shrink_buffers();
    connection.release();
    result
}

/// What to read analyses from when their inventory is wanted: a `FROM` item named `$alias`
/// with the columns of `analyses` (and `xmin`) whose `result` is the record's own inventory or,
/// for a cache copy that shares it, its original's (`cached_from`, ADR 0020). Each original is
/// found by its primary key. A string literal, for `concat!`.
#[macro_export]
macro_rules! analyses_with_inventory {
    ($alias:literal) => {
        concat!(
            "(SELECT a.id, a.user_id, a.repository, a.requested_ref, a.commit, a.state, \
             a.job_id, a.cached_from, a.error, a.created_at, a.updated_at, a.completed_at, \
             a.xmin, coalesce(a.result, o.result) AS result \
             FROM analyses a LEFT JOIN analyses o ON a.result IS NULL AND o.id = a.cached_from) \
             AS ",
            $alias
        )
    };
}

/// The state of an analysis or specview record (`fairlane_work_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::Type)]
#[sqlx(type_name = "fairlane_work_state", rename_all = "snake_case")]
pub enum WorkState {
    Pending,
    Running,
    Completed,
    Failed,
}

impl WorkState {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkState::Pending => "pending",
            WorkState::Running => "running",
            WorkState::Completed => "completed",
            WorkState::Failed => "failed",
        }
    }
}

impl std::fmt::Display for WorkState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a handler returns when staging its result failed. A value the database refuses (SQLSTATE
/// class 22, data exception, such as a `\u0000` in `jsonb`; class 54, program limit exceeded,
/// such as a `jsonb` too large) would be refused again on every retry: the job is cancelled with
/// the reason. Anything else (a lost connection, a timeout) is an ordinary failure and retried.
pub fn stage_failure(e: sqlx::Error) -> queue::JobError {
    if refuses_value(&e) {
        queue::JobError::Cancel(format!("the database refuses this result: {e}"))
    } else {
        queue::JobError::Failed(Box::new(e))
    }
}

/// Whether `e` is the database refusing the values of a statement (SQLSTATE class 22 or 54),
/// which no retry of the same values can change.
fn refuses_value(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|db| db.code())
        .is_some_and(|code| code.starts_with("22") || code.starts_with("54"))
}

/// Why a handler may not work on a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No such record.
    Missing,
    /// The record is already `completed` or `failed`.
    Finished(WorkState),
    /// The record belongs to another job.
    OtherJob(i64),
    /// A specview of an analysis that is not its user's.
    OtherUsersAnalysis,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Missing => f.write_str("does not exist"),
            Refusal::Finished(state) => write!(f, "is already {state}"),
            Refusal::OtherJob(job) => write!(f, "is filled by job {job}"),
            Refusal::OtherUsersAnalysis => f.write_str("renders an analysis of another user"),
        }
    }
}

/// Why record `id` of `table` (`analyses` or `specviews`) could not be claimed by `job_id`,
/// read right after the claim found nothing to update.
async fn read_refusal(
    pool: &PgPool,
    table: &'static str,
    id: uuid::Uuid,
    job_id: i64,
) -> Result<Refusal, sqlx::Error> {
    let found: Option<(WorkState, Option<i64>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT state, job_id FROM {table} WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(pool)
    .await?;
    Ok(refusal(found, job_id))
}

/// Why a record cannot be claimed, from what the database holds (`None` = no such record).
fn refusal(found: Option<(WorkState, Option<i64>)>, job_id: i64) -> Refusal {
    match found {
        None => Refusal::Missing,
        Some((state @ (WorkState::Completed | WorkState::Failed), _)) => Refusal::Finished(state),
        Some((_, Some(other))) if other != job_id => Refusal::OtherJob(other),
        // Claimable after all (changed between the two statements): report it as finished
        // with its state so the caller gives up cleanly rather than looping.
        Some((state, _)) => Refusal::Finished(state),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_name_the_reason() {
        assert_eq!(refusal(None, 1), Refusal::Missing);
        assert_eq!(
            refusal(Some((WorkState::Completed, Some(1))), 1),
            Refusal::Finished(WorkState::Completed)
        );
        assert_eq!(
            refusal(Some((WorkState::Failed, None)), 1),
            Refusal::Finished(WorkState::Failed)
        );
        assert_eq!(
            refusal(Some((WorkState::Running, Some(7))), 1),
            Refusal::OtherJob(7)
        );
        assert_eq!(Refusal::OtherJob(7).to_string(), "is filled by job 7");
        assert_eq!(
            Refusal::Finished(WorkState::Failed).to_string(),
            "is already failed"
        );
    }
}
