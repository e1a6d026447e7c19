//! The queue's front door for code that puts work in and manages it: insert (alone or inside the
//! caller's transaction), cancel, look up. Transition hooks registered here also run for the
//! transitions this client makes (a cancelled waiting job releases its quota reservation).

use std::collections::BTreeSet;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use sqlx::postgres::PgArguments;
use sqlx::{PgConnection, PgPool, Postgres};

use crate::compose::ComposedJob;
use crate::error::QueueError;
use crate::hooks::{Transition, TransitionHook, run_hooks};
use crate::insert::{self, Inserted, NewJob, Notify};
use crate::job::{JobId, JobRow, JobState};
use crate::wake::Waker;

/// The NOTIFY channel carrying control messages to workers (`cancel:<job id>`).
pub const CONTROL_CHANNEL: &str = "fairlane_control";

/// A handle on the queue. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    pool: PgPool,
    hooks: Arc<[Arc<dyn TransitionHook>]>,
    waker: Arc<Waker>,
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
            waker: Waker::new(pool.clone()),
            pool,
            hooks: Arc::from(Vec::new()),
        }
    }

    /// Wakes producers (here and, through NOTIFY, in every process) after commits.
    pub fn waker(&self) -> &Arc<Waker> {
        &self.waker
    }

    /// Starts a transaction for inserting jobs together with other writes. Unlike
    /// [`Client::insert_tx`] on a plain transaction, its inserts do not NOTIFY inside the
    /// transaction (PostgreSQL serializes notifying commits); [`QueueTx::commit`] wakes the
    /// producers after committing instead.
    pub async fn begin(&self) -> Result<QueueTx<'static>, QueueError> {
        Ok(self.queue_tx(crate::begin::begin(&self.pool).await?))
    }

    /// [`Client::begin`] on a connection the caller holds (one it keeps between transactions,
    /// sparing the pool's check-out and check-in round trips), READ COMMITTED whatever the
    /// session's default, whose first statement is
    /// `first`, sent with the `BEGIN` in one simple query (one round trip for both): `first` can
    /// take no parameters and its rows are discarded, so it suits a statement run for its
    /// effect, such as taking locks.
    ///
    /// If `first` fails, the error is returned and `conn` is left inside an aborted transaction
    /// that sqlx does not track (no rollback is queued): the caller must close the connection
    /// rather than reuse it. The same holds if the returned future is dropped before it
    /// completes (see [`crate::begin`]): a caller that may give up must close `conn` then.
    pub async fn begin_on_with<'c>(
        &self,
        conn: &'c mut PgConnection,
        first: &str,
    ) -> Result<QueueTx<'c>, QueueError> {
        // READ COMMITTED whatever the session's default: a `first` that takes locks is meant to
        // be followed by statements that see what the previous holder committed.
        let statement =
            sqlx::AssertSqlSafe(format!("BEGIN ISOLATION LEVEL READ COMMITTED; {first}"));
        Ok(self.queue_tx(sqlx::Connection::begin_with(conn, statement).await?))
    }

    fn queue_tx<'c>(&self, tx: sqlx::Transaction<'c, Postgres>) -> QueueTx<'c> {
        QueueTx {
            tx,
            queues: BTreeSet::new(),
            waker: Arc::clone(&self.waker),
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
        let inserted = insert::insert_with(&mut conn, job, Notify::AfterCommit).await?;
        self.wake_for(std::slice::from_ref(&inserted));
        Ok(inserted)
    }

    /// Starts sending wake-ups (NOTIFY) from the current runtime. Without it the sender starts
    /// on the runtime of the first commit that wakes producers.
    pub fn start_waker(&self) {
        self.waker.start();
    }

    fn wake_for(&self, inserted: &[Inserted]) {
        self.waker.wake(
            inserted
                .iter()
                .filter(|i| !i.duplicate && i.job.state == JobState::Available)
                .map(|i| i.job.queue.as_str()),
        );
    }

    /// Inserts inside the caller's transaction (`&mut *tx`): nothing exists unless it commits;
    /// the NOTIFY is part of the transaction. Prefer [`Client::begin`] when inserting at a high
    /// rate.
    pub async fn insert_tx(
        &self,
        conn: &mut PgConnection,
        job: NewJob,
    ) -> Result<Inserted, QueueError> {
        insert::insert(conn, job).await
    }

    /// Inserts `jobs` all or none: in one transaction, since unique keys can take a batch more
    /// than one statement (a duplicate whose holder finished meanwhile is inserted again).
    pub async fn insert_many(&self, jobs: Vec<NewJob>) -> Result<Vec<Inserted>, QueueError> {
        let mut tx = crate::begin::begin(&self.pool).await?;
        let inserted = insert::insert_many_with(&mut tx, jobs, Notify::AfterCommit).await?;
        tx.commit().await?;
        self.wake_for(&inserted);
        Ok(inserted)
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
        let mut tx = crate::begin::begin(&self.pool).await?;
        let (n, queues) = insert::insert_bulk_with(&mut tx, jobs, Notify::AfterCommit).await?;
        tx.commit().await?;
        self.waker.wake(queues.iter().map(String::as_str));
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
        let mut tx = crate::begin::begin(&self.pool).await?;
        let result = self.cancel_tx(&mut tx, id).await?;
        tx.commit().await?;
        if let Some(CancelResult::Cancelled(job)) = &result {
            let transition = Transition {
                job_id: job.id,
                queue: job.queue.clone(),
                kind: job.kind.clone(),
                user_id: job.user_id,
                state: job.state,
            };
            let wake = crate::hooks::wakes_after_commit(&self.hooks, &[transition]);
            self.waker.wake(wake.iter().map(String::as_str));
        }
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

/// A transaction that inserts jobs and wakes their producers after it commits. Derefs to the
/// connection, so any other statement can run in it (`&mut *tx`).
pub struct QueueTx<'c> {
    tx: sqlx::Transaction<'c, Postgres>,
    queues: BTreeSet<String>,
    waker: Arc<Waker>,
}

impl std::fmt::Debug for QueueTx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueTx")
            .field("queues", &self.queues)
            .finish_non_exhaustive()
    }
}

impl QueueTx<'_> {
    pub async fn insert(&mut self, job: NewJob) -> Result<Inserted, QueueError> {
        let inserted = insert::insert_with(&mut self.tx, job, Notify::AfterCommit).await?;
        self.remember(std::slice::from_ref(&inserted));
        Ok(inserted)
    }

    pub async fn insert_many(&mut self, jobs: Vec<NewJob>) -> Result<Vec<Inserted>, QueueError> {
        let inserted = insert::insert_many_with(&mut self.tx, jobs, Notify::AfterCommit).await?;
        self.remember(&inserted);
        Ok(inserted)
    }

    /// Runs a statement built around [`crate::compose::JobsCte`] (with `args` bound in its
    /// order) that returns the `expected` inserted jobs in input order, and wakes their
    /// producers after commit. A statement composed at run time is passed as
    /// [`sqlx::AssertSqlSafe`]; one built once can be a `&'static str`, sent without a copy.
    pub async fn insert_composed(
        &mut self,
        sql: impl sqlx::SqlSafeStr,
        args: PgArguments,
        expected: usize,
    ) -> Result<Vec<ComposedJob>, QueueError> {
        let rows: Vec<ComposedJob> = sqlx::query_as_with(sql, args)
            .fetch_all(&mut *self.tx)
            .await?;
        if rows.len() != expected {
            return Err(QueueError::InvalidJob(format!(
                "a composed insert returned {} jobs for {expected}",
                rows.len()
            )));
        }
        self.remember_queues(rows.iter().map(|j| (j.state, j.queue.as_str())));
        Ok(rows)
    }

    fn remember(&mut self, inserted: &[Inserted]) {
        self.remember_queues(
            inserted
                .iter()
                .filter(|i| !i.duplicate)
                .map(|i| (i.job.state, i.job.queue.as_str())),
        );
    }

    /// Notes the queues of jobs (by state and queue) that are runnable, to wake after commit.
    fn remember_queues<'j>(&mut self, jobs: impl IntoIterator<Item = (JobState, &'j str)>) {
        self.queues.extend(
            jobs.into_iter()
                .filter(|(state, _)| *state == JobState::Available)
                .map(|(_, queue)| queue.to_owned()),
        );
    }

    /// Commits, then wakes the producers of the queues that received runnable jobs.
    pub async fn commit(self) -> Result<(), QueueError> {
        self.tx.commit().await?;
        self.waker.wake(self.queues.iter().map(String::as_str));
        Ok(())
    }

    /// Rolls back: nothing inserted exists, nobody is woken.
    pub async fn rollback(self) -> Result<(), QueueError> {
        self.tx.rollback().await?;
        Ok(())
    }
}

impl Deref for QueueTx<'_> {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.tx
    }
}

impl DerefMut for QueueTx<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}
