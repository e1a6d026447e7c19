//! The queue's front door for code that puts work in and manages it: insert (alone or inside the
//! caller's transaction), cancel, look up. Transition hooks registered here also run for the
//! transitions this client makes (a cancelled waiting job releases its quota reservation).

use std::sync::Arc;

use sqlx::{PgConnection, PgPool};

use crate::error::QueueError;
use crate::hooks::{Transition, TransitionHook, run_hooks};
use crate::insert::{self, Inserted, NewJob};
use crate::job::{JobId, JobRow, JobState};

/// The NOTIFY channel carrying control messages to workers (`cancel:<job id>`).
pub const CONTROL_CHANNEL: &str = "fairlane_control";

/// A handle on the queue. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    pool: PgPool,
    hooks: Arc<[Arc<dyn TransitionHook>]>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("hooks", &self.hooks.len())
            .finish_non_exhaustive()
    }
}

/// What a cancel request did.
#[derive(Debug, Clone, PartialEq)]
pub enum CancelResult {
    /// The job was waiting and is now `cancelled`.
    Cancelled(JobRow),
    /// The job is running; its worker was told to stop. It ends `cancelled` unless it completes
    /// first.
    Requested(JobRow),
    /// The job had already finished; nothing changed.
    AlreadyFinal(JobRow),
}

impl CancelResult {
    pub fn job(&self) -> &JobRow {
        match self {
            CancelResult::Cancelled(j)
            | CancelResult::Requested(j)
            | CancelResult::AlreadyFinal(j) => j,
        }
    }
}

impl Client {
    pub fn new(pool: PgPool) -> Self {
        Client {
            pool,
            hooks: Arc::from(Vec::new()),
        }
    }

    /// Adds hooks that run in every transaction that moves a job out of `running` or cancels it.
    pub fn with_hooks(mut self, hooks: Vec<Arc<dyn TransitionHook>>) -> Self {
        let mut all: Vec<_> = self.hooks.iter().cloned().collect();
        all.extend(hooks);
        self.hooks = Arc::from(all);
        self
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub(crate) fn hooks(&self) -> Arc<[Arc<dyn TransitionHook>]> {
        Arc::clone(&self.hooks)
    }

    pub async fn insert(&self, job: NewJob) -> Result<Inserted, QueueError> {
        let mut conn = self.pool.acquire().await?;
        insert::insert(&mut conn, job).await
    }

    /// Inserts inside the caller's transaction (`&mut *tx`): nothing exists unless it commits.
    pub async fn insert_tx(
        &self,
        conn: &mut PgConnection,
        job: NewJob,
    ) -> Result<Inserted, QueueError> {
        insert::insert(conn, job).await
    }

    pub async fn insert_many(&self, jobs: Vec<NewJob>) -> Result<Vec<Inserted>, QueueError> {
        let mut conn = self.pool.acquire().await?;
        insert::insert_many(&mut conn, jobs).await
    }

    pub async fn insert_many_tx(
        &self,
        conn: &mut PgConnection,
        jobs: Vec<NewJob>,
    ) -> Result<Vec<Inserted>, QueueError> {
        insert::insert_many(conn, jobs).await
    }

    /// Bulk-loads jobs with COPY in one transaction.
    pub async fn insert_bulk(&self, jobs: &[NewJob]) -> Result<u64, QueueError> {
        let mut tx = self.pool.begin().await?;
        let n = insert::insert_bulk(&mut tx, jobs).await?;
        tx.commit().await?;
        Ok(n)
    }

    pub async fn job(&self, id: JobId) -> Result<Option<JobRow>, QueueError> {
        Ok(
            sqlx::query_as::<_, JobRow>("SELECT * FROM fairlane_job WHERE id = $1")
                .bind(id)
                .fetch_optional(&self.pool)
                .await?,
        )
    }

    /// Cancels a job; `None` if it does not exist.
    pub async fn cancel(&self, id: JobId) -> Result<Option<CancelResult>, QueueError> {
        let mut tx = self.pool.begin().await?;
        let result = self.cancel_tx(&mut tx, id).await?;
        tx.commit().await?;
        Ok(result)
    }

    /// Cancels a job inside the caller's transaction. A waiting job becomes `cancelled` (and the
    /// hooks run); a running one is flagged and its worker notified at commit.
    pub async fn cancel_tx(
        &self,
        conn: &mut PgConnection,
        id: JobId,
    ) -> Result<Option<CancelResult>, QueueError> {
        let Some(job) =
            sqlx::query_as::<_, JobRow>("SELECT * FROM fairlane_job WHERE id = $1 FOR UPDATE")
                .bind(id)
                .fetch_optional(&mut *conn)
                .await?
        else {
            return Ok(None);
        };
        match job.state {
            s if s.is_final() => Ok(Some(CancelResult::AlreadyFinal(job))),
            JobState::Running => {
                let job = sqlx::query_as::<_, JobRow>(
                    "UPDATE fairlane_job SET metadata = metadata || \
                         jsonb_build_object('cancel_attempted_at', now()) \
                     WHERE id = $1 RETURNING *",
                )
                .bind(id)
                .fetch_one(&mut *conn)
                .await?;
                sqlx::query("SELECT pg_notify($1, $2)")
                    .bind(CONTROL_CHANNEL)
                    .bind(format!("cancel:{id}"))
                    .execute(&mut *conn)
                    .await?;
                Ok(Some(CancelResult::Requested(job)))
            }
            _ => {
                let job = sqlx::query_as::<_, JobRow>(
                    "UPDATE fairlane_job SET state = 'cancelled', finalized_at = now(), \
                         metadata = metadata || jsonb_build_object('cancel_attempted_at', now()) \
                     WHERE id = $1 RETURNING *",
                )
                .bind(id)
                .fetch_one(&mut *conn)
                .await?;
                let transition = Transition {
                    job_id: job.id,
                    queue: job.queue.clone(),
                    kind: job.kind.clone(),
                    user_id: job.user_id,
                    state: job.state,
                };
                run_hooks(&self.hooks, conn, std::slice::from_ref(&transition)).await?;
                Ok(Some(CancelResult::Cancelled(job)))
            }
        }
    }
}
