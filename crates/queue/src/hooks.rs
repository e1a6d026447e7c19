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
use sqlx::PgConnection;

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

/// Chooses the jobs a fetch may start.
#[async_trait]
pub trait FetchGate: Send + Sync + 'static {
    /// Selects up to `limit` runnable (`available`) jobs of `queue` that may start now, locking
    /// them with `FOR UPDATE SKIP LOCKED`, and returns their ids. Runs inside the fetch
    /// transaction, which then marks exactly these jobs `running` and commits.
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
