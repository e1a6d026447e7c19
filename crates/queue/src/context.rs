//! What a handler and its middleware see of the job they run: the row, a cancellation signal, and a
//! place to put the job's output.

use std::sync::{Arc, Mutex, OnceLock};

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::job::{JobId, JobRow};
use crate::outcome::JobError;

/// Why a running job was told to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelReason {
    /// Someone cancelled the job (API `DELETE`, `Client::cancel`).
    Requested,
    /// The worker is shutting down and the job outlived the drain deadline.
    Shutdown,
    /// The run is no longer this worker's: its row left it while it ran (rescued while this
    /// worker's heartbeat could not reach the database, most likely), and another worker may run
    /// the job now. Whatever the handler does next is not saved.
    Taken,
}

/// The stop signal of one running job, shared by the executor, the notifier and the shutdown path.
#[derive(Debug, Default)]
pub(crate) struct JobControl {
    token: CancellationToken,
    reason: OnceLock<CancelReason>,
}

impl JobControl {
    pub(crate) fn cancel(&self, reason: CancelReason) {
        // The first reason wins: a job cancelled by a user stays cancelled even if shutdown follows.
        let _ = self.reason.set(reason);
        self.token.cancel();
    }

    pub(crate) fn reason(&self) -> Option<CancelReason> {
        self.reason.get().copied()
    }

    pub(crate) fn token(&self) -> &CancellationToken {
        &self.token
    }
}

/// The job being run, as handed to middleware and handlers. Cheap to clone.
#[derive(Debug, Clone)]
pub struct JobContext {
    inner: Arc<ContextInner>,
}

#[derive(Debug)]
struct ContextInner {
    job: JobRow,
    worker_id: Arc<str>,
    control: Arc<JobControl>,
    gate_admitted: bool,
    output: Mutex<Option<serde_json::Value>>,
}

impl JobContext {
    pub(crate) fn new(
        job: JobRow,
        worker_id: Arc<str>,
        control: Arc<JobControl>,
        gate_admitted: bool,
    ) -> Self {
        JobContext {
            inner: Arc::new(ContextInner {
                job,
                worker_id,
                control,
                gate_admitted,
                output: Mutex::new(None),
            }),
        }
    }

    /// The job row as fetched (state `running`, `attempt` already counting this attempt).
    pub fn job(&self) -> &JobRow {
        &self.inner.job
    }

    pub fn id(&self) -> JobId {
        self.inner.job.id
    }

    /// The user the job belongs to, if any (`args.user_id`).
    pub fn user_id(&self) -> Option<uuid::Uuid> {
        self.inner.job.user_id
    }

    /// The id of the worker process running the job.
    pub fn worker_id(&self) -> &str {
        &self.inner.worker_id
    }

    /// Whether a fetch gate admitted this job inside the fetch transaction (so whatever the gate
    /// guards, such as per-user concurrency, already holds for it).
    pub fn gate_admitted(&self) -> bool {
        self.inner.gate_admitted
    }

    /// Whether the job has been told to stop.
    pub fn is_cancelled(&self) -> bool {
        self.inner.control.token().is_cancelled()
    }

    /// Completes when the job is told to stop; long handlers should `select!` on it.
    pub async fn cancelled(&self) {
        self.inner.control.token().cancelled().await;
    }

    /// Runs `work` until it ends or the job is told to stop (a user's cancel, the job's timeout,
    /// a shutdown), whichever comes first; a stop drops `work` wherever it is and fails the
    /// attempt with `stopped` (the queue then records the cancel or hands the job back).
    pub async fn unless_stopped<T>(
        &self,
        stopped: &str,
        work: impl Future<Output = Result<T, JobError>>,
    ) -> Result<T, JobError> {
        tokio::select! {
            biased;
            () = self.cancelled() => Err(JobError::msg(stopped)),
            result = work => result,
        }
    }

    pub fn cancel_reason(&self) -> Option<CancelReason> {
        self.inner.control.reason()
    }

    /// Records what the job produced; stored in `fairlane_job.output` when it completes. An
    /// output of more than [`crate::MAX_OUTPUT_BYTES`] as JSON is refused (the job's row, with
    /// its output, travels with every read of the job): keep large results in a table of their
    /// own, as the analyses and specviews do.
    pub fn set_output<T: Serialize>(&self, output: &T) -> Result<(), serde_json::Error> {
        let value = serde_json::to_value(output)?;
        let bytes = serde_json::to_vec(&value)?.len();
        if bytes > crate::MAX_OUTPUT_BYTES {
            return Err(serde::ser::Error::custom(format!(
                "the job's output is {bytes} bytes of JSON, more than the {} a job may keep; \
                 store large results in a table of their own",
                crate::MAX_OUTPUT_BYTES
            )));
        }
        *self
            .inner
            .output
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(value);
        Ok(())
    }

    pub(crate) fn take_output(&self) -> Option<serde_json::Value> {
        self.inner
            .output
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    pub(crate) fn control(&self) -> &Arc<JobControl> {
        &self.inner.control
    }
}
