//! State shared by the tasks of one running engine: the jobs this process holds, the handler
//! registry and middleware chain, the completion channel, and database health as seen from here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::completer::Completion;
use crate::config::EngineConfig;
use crate::context::{CancelReason, JobControl};
use crate::handler::Workers;
use crate::hooks::{FetchGate, TransitionHook};
use crate::job::JobId;
use crate::metrics::QueueMetrics;
use crate::middleware::Middleware;

/// Jobs fetched by this process and not yet persisted as finished: running, or finished and
/// waiting in the completer. The heartbeat hands back `running` rows of this worker that are not
/// in here (their fetch result never arrived).
///
/// Runs whose end the database refused (even as a failure) are kept apart as *unsaved*: they
/// ran, so the heartbeat hands them back without giving their attempt back, and a job whose
/// every end is refused uses up its attempts instead of running for ever.
#[derive(Debug, Default)]
pub(crate) struct Inflight {
    jobs: Mutex<HashMap<JobId, (RunStart, Arc<JobControl>)>>,
    unsaved: Mutex<HashMap<JobId, RunStart>>,
}

/// When an attempt was fetched (`attempted_at`): with the job id, what tells one run of a job
/// from another. The attempt number does not: a job handed back is fetched again with the same
/// number.
pub(crate) type RunStart = Option<chrono::DateTime<chrono::Utc>>;

impl Inflight {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<JobId, (RunStart, Arc<JobControl>)>> {
        self.jobs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Holds run `(id, started)`. An earlier run of the same job still held here was taken from
    /// this worker (the job was rescued, and is fetched here again): it is told to stop, as
    /// `stop_taken_runs` would, since it could not be reached once replaced.
    pub(crate) fn insert(&self, id: JobId, started: RunStart, control: Arc<JobControl>) {
        let replaced = self.lock().insert(id, (started, control));
        if let Some((earlier, control)) = replaced
            && earlier != started
        {
            control.cancel(CancelReason::Taken);
            tracing::warn!(
                job_id = id,
                "this worker's earlier run of the job was taken from it (the job was rescued and \
                 fetched here again); stopping it"
            );
        }
    }

    /// Removes a batch of runs under one lock. A job held by a later run of this process (it was
    /// rescued, then fetched here again while the old run went on) stays: the old run's end must
    /// not make the new one look unknown, which would hand it back while it runs.
    pub(crate) fn remove_all(&self, runs: impl IntoIterator<Item = (JobId, RunStart)>) {
        let mut jobs = self.lock();
        for (id, started) in runs {
            if jobs.get(&id).is_some_and(|(held, _)| *held == started) {
                jobs.remove(&id);
            }
        }
    }

    /// The jobs this process holds: running, waiting in the completer, or unsaved.
    pub(crate) fn ids(&self) -> Vec<JobId> {
        let mut ids: Vec<JobId> = self.lock().keys().copied().collect();
        ids.extend(self.lock_unsaved().keys().copied());
        ids
    }

    fn lock_unsaved(&self) -> std::sync::MutexGuard<'_, HashMap<JobId, RunStart>> {
        self.unsaved
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Moves a run whose end the database refused from the held jobs to the unsaved ones, for the
    /// heartbeat to hand back as a used attempt. A later run of the job held here stays held.
    pub(crate) fn mark_unsaved(&self, (id, started): (JobId, RunStart)) {
        let mut jobs = self.lock();
        if jobs.get(&id).is_some_and(|(held, _)| *held == started) {
            jobs.remove(&id);
            self.lock_unsaved().insert(id, started);
        }
    }

    /// The runs whose end the database refused, not yet handed back.
    pub(crate) fn unsaved(&self) -> Vec<(JobId, RunStart)> {
        self.lock_unsaved()
            .iter()
            .map(|(id, started)| (*id, *started))
            .collect()
    }

    /// Forgets unsaved runs once handed back (or found no longer running as that run).
    pub(crate) fn forget_unsaved(&self, runs: impl IntoIterator<Item = (JobId, RunStart)>) {
        let mut unsaved = self.lock_unsaved();
        for (id, started) in runs {
            if unsaved.get(&id) == Some(&started) {
                unsaved.remove(&id);
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    /// The runs this process holds (not the unsaved ones), with when each was fetched.
    pub(crate) fn runs(&self) -> Vec<(JobId, RunStart)> {
        self.lock()
            .iter()
            .map(|(id, (started, _))| (*id, *started))
            .collect()
    }

    /// Tells run `(id, started)` to stop, if this process still holds that run of the job.
    pub(crate) fn cancel_run(&self, id: JobId, started: RunStart, reason: CancelReason) -> bool {
        let control = self
            .lock()
            .get(&id)
            .filter(|(held, _)| *held == started)
            .map(|(_, control)| Arc::clone(control));
        control.is_some_and(|c| {
            c.cancel(reason);
            true
        })
    }

    /// Tells one running job to stop; false if this process does not hold it.
    pub(crate) fn cancel(&self, id: JobId, reason: CancelReason) -> bool {
        let control = self.lock().get(&id).map(|(_, control)| Arc::clone(control));
        match control {
            Some(c) => {
                c.cancel(reason);
                true
            }
            None => false,
        }
    }

    pub(crate) fn cancel_all(&self, reason: CancelReason) {
        let controls: Vec<_> = self
            .lock()
            .values()
            .map(|(_, control)| Arc::clone(control))
            .collect();
        for c in controls {
            c.cancel(reason);
        }
    }
}

/// Since when the database has answered this process without interruption.
#[derive(Debug, Default)]
pub(crate) struct DbHealth {
    healthy_since: Mutex<Option<Instant>>,
}

impl DbHealth {
    pub(crate) fn record(&self, ok: bool) {
        let mut since = self
            .healthy_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match (ok, *since) {
            (true, None) => *since = Some(Instant::now()),
            (false, _) => *since = None,
            (true, Some(_)) => {}
        }
    }

    /// How long the database has been reachable without a failure, as seen here.
    pub(crate) fn healthy_for(&self) -> Option<std::time::Duration> {
        self.healthy_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .map(|s| s.elapsed())
    }
}

pub(crate) struct Runtime {
    pub(crate) pool: sqlx::PgPool,
    pub(crate) worker_id: Arc<str>,
    pub(crate) config: EngineConfig,
    pub(crate) workers: Workers,
    pub(crate) middleware: Arc<[Arc<dyn Middleware>]>,
    pub(crate) hooks: Arc<[Arc<dyn TransitionHook>]>,
    pub(crate) gate: Option<Arc<dyn FetchGate>>,
    pub(crate) job_span: Option<crate::engine::JobSpan>,
    pub(crate) inflight: Arc<Inflight>,
    pub(crate) completions: mpsc::Sender<Completion>,
    pub(crate) metrics: QueueMetrics,
    pub(crate) db_health: Arc<DbHealth>,
    pub(crate) waker: Arc<crate::wake::Waker>,
    /// The fetch transaction's `BEGIN` with its settings and the server's limits
    /// ([`crate::begin::with_server_limits`]).
    pub(crate) fetch_begin: String,
}
