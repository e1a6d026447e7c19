//! A running queue engine: the queues a process works, with their handlers and middleware, and the
//! background tasks that keep it honest (notifier, completer, heartbeat, maintenance).
//!
//! `run` returns after a graceful shutdown: stop fetching; let running jobs finish up to
//! `shutdown_timeout`; tell the rest to stop and hand them back to the queue after `cancel_grace`;
//! persist every completion; deregister; resign leadership.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::QueueName;
use tokio::sync::{Notify, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::client::{CONTROL_CHANNEL, Client};
use crate::completer::Completer;
use crate::config::EngineConfig;
use crate::context::CancelReason;
use crate::error::QueueError;
use crate::handler::Workers;
use crate::heartbeat;
use crate::hooks::FetchGate;
use crate::insert::INSERT_CHANNEL;
use crate::leader::LeaderElector;
use crate::maintenance::{self, MAINTENANCE_LEASE};
use crate::metrics::QueueMetrics;
use crate::middleware::Middleware;
use crate::notifier::Notifier;
use crate::producer::QueueWorker;
use crate::runtime::{DbHealth, Inflight, Runtime};

/// Builds an [`Engine`].
pub struct EngineBuilder {
    client: Client,
    config: EngineConfig,
    name: String,
    queues: Vec<(QueueName, usize)>,
    workers: Workers,
    middleware: Vec<Arc<dyn Middleware>>,
    gate: Option<Arc<dyn FetchGate>>,
    job_span: Option<JobSpan>,
}

/// Makes the span an attempt runs in ([`EngineBuilder::job_span`]).
pub type JobSpan = Arc<dyn Fn(&crate::job::JobRow) -> tracing::Span + Send + Sync>;

impl EngineBuilder {
    pub fn new(client: Client) -> Self {
        EngineBuilder {
            client,
            config: EngineConfig::default(),
            name: "worker".into(),
            queues: Vec::new(),
            workers: Workers::new(),
            middleware: Vec::new(),
            gate: None,
            job_span: None,
        }
    }

    /// A label for this process in worker ids (`analyzer-worker-<host>-<pid>-<rand>`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    pub fn config(mut self, config: EngineConfig) -> Self {
        self.config = config;
        self
    }

    /// Works `queue` with at most `max_workers` of its jobs running at once in this process.
    pub fn queue(mut self, queue: QueueName, max_workers: usize) -> Self {
        self.queues.push((queue, max_workers));
        self
    }

    pub fn workers(mut self, workers: Workers) -> Self {
        self.workers = workers;
        self
    }

    /// Adds a middleware; the first added is the outermost.
    pub fn middleware(mut self, m: Arc<dyn Middleware>) -> Self {
        self.middleware.push(m);
        self
    }

    pub fn fetch_gate(mut self, gate: Arc<dyn FetchGate>) -> Self {
        self.gate = Some(gate);
        self
    }

    /// Makes the span each attempt runs in, its middleware and handler inside it, and its end
    /// logged in it (the default: a `job` span with the job's id, queue, kind and attempt). A
    /// service that continues the enqueuing request's trace sets the span's parent here, so the
    /// whole attempt is in that trace rather than in one of its own.
    pub fn job_span(mut self, make: JobSpan) -> Self {
        self.job_span = Some(make);
        self
    }

    pub fn build(self) -> Result<Engine, QueueError> {
        self.config.validate().map_err(QueueError::Config)?;
        let mut seen = std::collections::HashSet::new();
        for (q, n) in &self.queues {
            if *n == 0 {
                return Err(QueueError::Config(format!(
                    "queue {q} needs at least one worker"
                )));
            }
            if *n > Semaphore::MAX_PERMITS {
                return Err(QueueError::Config(format!(
                    "queue {q}: {n} workers is more than one process can run (at most {})",
                    Semaphore::MAX_PERMITS
                )));
            }
            if !seen.insert(q.clone()) {
                return Err(QueueError::Config(format!("queue {q} is configured twice")));
            }
        }
        let suffix: u32 = rand::random::<u32>() % 0x10000;
        let host = hostname::get()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "unknown".into());
        let worker_id = format!("{}-{host}-{}-{suffix:04x}", self.name, std::process::id());
        Ok(Engine {
            builder: self,
            worker_id,
        })
    }
}

/// A configured engine, ready to [`run`](Engine::run).
pub struct Engine {
    builder: EngineBuilder,
    worker_id: String,
}

impl Engine {
    pub fn builder(client: Client) -> EngineBuilder {
        EngineBuilder::new(client)
    }

    /// This process's worker id (as recorded in `attempted_by` and `fairlane_worker`).
    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    /// Works the queues until `shutdown` is cancelled, then drains gracefully.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), QueueError> {
        let b = self.builder;
        let pool = b.client.pool().clone();
        let config = b.config;
        let queue_names: Vec<String> = b.queues.iter().map(|(q, _)| q.to_string()).collect();
        heartbeat::register(&pool, &self.worker_id, &queue_names).await?;

        let (tx, rx) = mpsc::channel(config.completer_batch.max(64) * 4);
        let inflight = Arc::new(Inflight::default());
        let metrics = QueueMetrics::new();
        let rt = Arc::new(Runtime {
            pool: pool.clone(),
            worker_id: Arc::from(self.worker_id.as_str()),
            config: config.clone(),
            workers: b.workers,
            middleware: Arc::from(b.middleware),
            hooks: b.client.hooks(),
            gate: b.gate,
            job_span: b.job_span,
            inflight: Arc::clone(&inflight),
            completions: tx,
            metrics: metrics.clone(),
            db_health: Arc::new(DbHealth::default()),
            waker: Arc::clone(b.client.waker()),
            fetch_begin: crate::begin::with_server_limits(
                crate::hooks::FETCH_BEGIN_SQL,
                config.database_timeout,
            ),
        });
        rt.db_health.record(true);

        // Producers and their wake-ups.
        let queues: Vec<Arc<QueueWorker>> = b
            .queues
            .iter()
            .map(|(name, max)| {
                Arc::new(QueueWorker {
                    name: name.clone(),
                    slots: Arc::new(Semaphore::new(*max)),
                    runnable: Arc::new(Notify::new()),
                    slot_freed: Arc::new(Notify::new()),
                    max_workers: *max,
                })
            })
            .collect();
        for q in &queues {
            b.client
                .waker()
                .subscribe_local(q.name.as_str(), Arc::clone(&q.runnable));
        }
        let mut notifier = Notifier::new();
        let by_name: HashMap<String, Arc<Notify>> = queues
            .iter()
            .map(|q| (q.name.to_string(), Arc::clone(&q.runnable)))
            .collect();
        notifier.subscribe(
            INSERT_CHANNEL,
            Arc::new(move |payload| match payload {
                Some(queue) => {
                    if let Some(n) = by_name.get(queue) {
                        n.notify_one();
                    }
                }
                None => by_name.values().for_each(|n| n.notify_one()),
            }),
        );
        let control_inflight = Arc::clone(&inflight);
        notifier.subscribe(
            CONTROL_CHANNEL,
            Arc::new(move |payload| {
                if let Some(id) = payload
                    .and_then(|p| p.strip_prefix("cancel:"))
                    .and_then(|id| id.parse().ok())
                    && control_inflight.cancel(id, CancelReason::Requested)
                {
                    tracing::info!(job_id = id, "cancel requested for a running job");
                }
            }),
        );

        let background = CancellationToken::new();
        // The election and maintenance stop at once when a background task panics (their lease
        // is then another replica's), the rest only after the drain.
        let maintaining = background.child_token();
        let mut tasks = tokio::task::JoinSet::new();
        let leader = if config.maintenance {
            let (elector, handle) = LeaderElector::new(
                pool.clone(),
                MAINTENANCE_LEASE,
                self.worker_id.clone(),
                config.leader_ttl,
                &mut notifier,
            );
            tasks.spawn(elector.run(maintaining.clone()));
            Some(handle)
        } else {
            None
        };
        tasks.spawn(notifier.run(pool.clone(), background.clone()));
        // The heartbeat's own connection: see `heartbeat::run_heartbeats`.
        tasks.spawn(heartbeat::run_heartbeats(
            Arc::clone(&rt),
            (*pool.connect_options()).clone(),
            queue_names.clone(),
            background.clone(),
        ));
        tasks.spawn(heartbeat::run_repairs(Arc::clone(&rt), background.clone()));
        if let Some(handle) = leader {
            let ctx = Arc::new(maintenance::MaintenanceContext {
                pool: pool.clone(),
                config: config.clone(),
                hooks: b.client.hooks(),
                db_health: Arc::clone(&rt.db_health),
                waker: Arc::clone(b.client.waker()),
            });
            tasks.spawn(maintenance::run(ctx, handle, maintaining.clone()));
        }
        let abandon = CancellationToken::new();
        let completer = tokio::spawn(
            Completer {
                pool: pool.clone(),
                rx,
                hooks: b.client.hooks(),
                retry: config.retry,
                batch_size: config.completer_batch,
                concurrency: config.completer_concurrency,
                metrics,
                inflight: Arc::clone(&inflight),
                abandon: abandon.clone(),
                waker: Arc::clone(b.client.waker()),
                database_timeout: config.database_timeout,
            }
            .run(),
        );

        let executors = TaskTracker::new();
        let mut producers = tokio::task::JoinSet::new();
        // The caller's shutdown, or the engine's own when its completer has stopped.
        let stop = shutdown.child_token();
        for q in &queues {
            producers.spawn(Arc::clone(q).run(Arc::clone(&rt), executors.clone(), stop.clone()));
        }
        tracing::info!(worker_id = %self.worker_id, queues = ?queue_names, "queue engine started");

        let mut completer = completer;
        // A completer that ends before shutdown (a hook panicked in it) can no longer save any
        // run's end. Fetching on would only pile up `running` jobs; the engine stops instead and
        // reports it, so that the process is restarted and the rescuer hands those jobs back.
        let mut completer_stopped = false;
        // The same for a background task that panicked (a hook, in a rescue or a hand-back):
        // without its heartbeat this worker's runs would all be rescued under it, and without
        // its maintenance the lease it holds would keep every other replica from maintaining.
        let mut background_panicked = false;
        tokio::select! {
            () = shutdown.cancelled() => {}
            _ = &mut completer => {
                completer_stopped = true;
                tracing::error!(
                    running = inflight.len(),
                    "the completer stopped; shutting the engine down, its running jobs will be rescued"
                );
            }
            () = first_panic(&mut tasks) => {
                background_panicked = true;
                tracing::error!(
                    running = inflight.len(),
                    "a background task panicked; shutting the engine down"
                );
                maintaining.cancel();
            }
        }
        stop.cancel();
        tracing::info!(
            running = inflight.len(),
            "shutting down: no new jobs will be fetched"
        );
        join_within(&mut producers, STALLED_STATEMENT_BOUND, "producers").await;
        executors.close();
        if tokio::time::timeout(config.shutdown_timeout, executors.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                running = inflight.len(),
                "shutdown deadline reached; telling running jobs to stop and handing them back"
            );
            inflight.cancel_all(CancelReason::Shutdown);
            let grace = config.cancel_grace + Duration::from_millis(500);
            if tokio::time::timeout(grace, executors.wait()).await.is_err() {
                tracing::error!(
                    "some handlers ignore cancellation; their jobs stay running and will be rescued"
                );
            }
        }
        // Every executor has sent (or given up sending) its completion. Stop the background tasks
        // (they hold the runtime, hence the channel's sender), then let the completer persist the
        // rest, within a bound in case the database is gone.
        background.cancel();
        join_within(&mut tasks, STALLED_STATEMENT_BOUND, "background tasks").await;
        drop(rt);
        if !completer_stopped
            && tokio::time::timeout(COMPLETER_DRAIN_BOUND, &mut completer)
                .await
                .is_err()
        {
            abandon.cancel();
            // The completer gives up between tries; one stuck in a statement is aborted, and
            // the jobs whose ends it held are the rescuer's once this worker is gone.
            if tokio::time::timeout(STALLED_STATEMENT_BOUND, &mut completer)
                .await
                .is_err()
            {
                tracing::error!(
                    "the completer is stuck in a statement; its unsaved ends will be rescued"
                );
                completer.abort();
            }
        }
        // Deregistered, this process's `running` jobs are the rescuer's at its next pass.
        match tokio::time::timeout(
            STALLED_STATEMENT_BOUND,
            heartbeat::deregister(&pool, &self.worker_id),
        )
        .await
        {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not deregister worker; it will be reaped as stale");
            }
            Err(_) => tracing::warn!(
                "deregistering the worker did not finish in time; it will be reaped as stale"
            ),
        }
        tracing::info!(worker_id = %self.worker_id, "queue engine stopped");
        if completer_stopped {
            return Err(QueueError::CompleterStopped);
        }
        if background_panicked {
            return Err(QueueError::BackgroundTaskPanicked);
        }
        Ok(())
    }
}

/// Waits until a task of `tasks` panics (after logging the panic); never returns otherwise. A
/// task that returns is let go: only a panic ends a background task that should still run.
async fn first_panic(tasks: &mut tokio::task::JoinSet<()>) {
    while let Some(ended) = tasks.join_next().await {
        if let Err(e) = ended
            && e.is_panic()
        {
            let payload = e.into_panic();
            let message = crate::executor::panic_text(&*payload);
            tracing::error!(panic = %message, "an engine background task panicked");
            return;
        }
    }
    std::future::pending::<()>().await;
}

/// How long shutdown waits for a step that is only waiting on the database (a producer's fetch,
/// a heartbeat or maintenance pass, the completer's last write, deregistering) before going on
/// without it. A statement has no timeout of its own: one stuck behind a lock, or on a
/// connection whose network has gone silent, would otherwise keep the process from exiting
/// until the orchestrator kills it. Every job left `running` by such a step is rescued once the
/// worker's heartbeat is stale, as after a crash.
const STALLED_STATEMENT_BOUND: Duration = Duration::from_secs(3);

/// How long a shutdown lets the completer persist the ends it still holds.
const COMPLETER_DRAIN_BOUND: Duration = Duration::from_secs(10);

/// What a shutdown may take beyond `shutdown_timeout + cancel_grace` when the database stops
/// answering: the producers, the background tasks, the completer (its drain, then an abort) and
/// the deregistration each within their bound, plus the half second of slack given to handlers
/// after their cancel. A deployment's grace period must cover [`EngineConfig::shutdown_bound`].
pub const SHUTDOWN_OVERHEAD_BOUND: Duration = STALLED_STATEMENT_BOUND
    .saturating_mul(4)
    .saturating_add(COMPLETER_DRAIN_BOUND)
    .saturating_add(Duration::from_millis(500));

impl EngineConfig {
    /// The longest an engine's shutdown can take with this configuration, however unresponsive
    /// the database or the handlers are.
    pub fn shutdown_bound(&self) -> Duration {
        self.shutdown_timeout + self.cancel_grace + SHUTDOWN_OVERHEAD_BOUND
    }
}

/// Waits for every task of `set`.
async fn drain<T: 'static>(set: &mut tokio::task::JoinSet<T>) {
    while set.join_next().await.is_some() {}
}

/// Waits for every task of `set` for up to `bound`, then aborts the rest (each stops at its
/// next await) and waits up to `bound` again for them to unwind.
async fn join_within<T: 'static>(
    set: &mut tokio::task::JoinSet<T>,
    bound: Duration,
    what: &'static str,
) {
    if tokio::time::timeout(bound, drain(set)).await.is_err() {
        tracing::warn!(
            tasks = set.len(),
            "shutdown: {what} did not stop in time (stuck on the database?); aborting them"
        );
        set.abort_all();
        let _ = tokio::time::timeout(bound, drain(set)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_lane_larger_than_a_semaphore_is_refused_before_anything_runs() {
        // Connected lazily: `build` must refuse without touching the database.
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://postgres@127.0.0.1:1/never")
            .expect("a valid URL");
        let queue = |n| {
            Engine::builder(Client::new(pool.clone()))
                .queue(QueueName::new("q").expect("a valid name"), n)
                .build()
        };
        let Err(e) = queue(Semaphore::MAX_PERMITS + 1) else {
            panic!("more workers than a semaphore holds were accepted");
        };
        assert!(
            e.to_string().contains("more than one process can run"),
            "{e}"
        );
        assert!(queue(Semaphore::MAX_PERMITS).is_ok());
    }
}
