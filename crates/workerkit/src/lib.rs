//! What every Fairlane worker service shares. A worker binary describes itself (its service, its
//! three lanes' worker counts, its handlers and hooks) and calls [`run`]: this crate connects to
//! PostgreSQL, waits for the schema, assembles the queue engine with fleet-wide fairness, serves
//! `/healthz`, `/readyz` and `/metrics`, continues request traces into jobs, and drains on
//! SIGTERM/SIGINT.

pub mod config;
pub mod health;
pub mod sleep;
pub mod tracing_mw;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::{Lane, Service};
use fairness::gauges::GAUGE_INTERVAL;
use fairness::store::TierLimits;
use fairness::{FairnessGate, FairnessGauges, FairnessHook, FairnessMiddleware, TierCache};
use queue::{Client, Engine, TransitionHook, Workers};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;

pub use config::{
    EngineSettings, MAX_LANE_WORKERS, MIN_DATABASE_CONNECTIONS, WorkerConfig, check_lanes,
    lane_variable,
};

/// A worker service: what differs between `analyzer-worker` and `specgen-worker`.
pub struct WorkerSpec {
    /// The binary's name (worker ids, logs).
    pub name: &'static str,
    pub service: Service,
    /// The prefix of its lane-size variables: `ANALYZER` for `ANALYZER_QUEUE_PRIORITY_WORKERS` …
    pub lane_prefix: &'static str,
    /// Workers of the priority, default and scheduled lanes, in that order; 0 leaves a lane to
    /// other processes (see [`check_lanes`]).
    pub lane_workers: [usize; 3],
    pub workers: Workers,
    /// Hooks beyond fairness's own (quota billing).
    pub hooks: Vec<Arc<dyn TransitionHook>>,
}

/// Why a worker service could not run.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("could not listen on {addr}: {source}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Queue(#[from] queue::QueueError),
}

/// Runs the worker service until `shutdown`, then drains gracefully.
pub async fn run(
    config: &WorkerConfig,
    spec: WorkerSpec,
    pool: PgPool,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    config.validate().map_err(WorkerError::Config)?;
    check_lanes(spec.lane_prefix, spec.lane_workers).map_err(WorkerError::Config)?;
    let engine_config = config.engine.to_engine_config();

    let addr: SocketAddr = config
        .http_addr
        .parse()
        .map_err(|e| WorkerError::Config(format!("HTTP_ADDR `{}`: {e}", config.http_addr)))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| WorkerError::Listen {
            addr: config.http_addr.clone(),
            source,
        })?;
    let http_done = CancellationToken::new();
    let http = tokio::spawn(health::serve(
        listener,
        health::routes(pool.clone()),
        http_done.clone(),
    ));

    let ready = wait_for_schema(&pool, &shutdown).await;
    let result = if ready {
        run_engine(config, engine_config, spec, pool, shutdown).await
    } else {
        Ok(())
    };
    http_done.cancel();
    // In-flight `/readyz` checks end within their own bound; this one only guards against a
    // connection that never lets the server finish.
    join_within(http).await;
    result
}

/// Waits for `task` for up to [`STOP_BOUND`], then aborts it.
async fn join_within<T>(mut task: tokio::task::JoinHandle<T>) {
    if tokio::time::timeout(STOP_BOUND, &mut task).await.is_err() {
        task.abort();
    }
}

/// How long a shutdown waits for each of the health server and the fairness gauge's count, on
/// top of the engine's own bound ([`queue::EngineConfig::shutdown_bound`]).
const STOP_BOUND: Duration = Duration::from_secs(3);

/// What a worker service's shutdown may take beyond its engine's and its telemetry's bounds:
/// the health server, the gauge, and the end of the runtime.
pub const SHUTDOWN_OVERHEAD_BOUND: Duration = STOP_BOUND
    .saturating_mul(2)
    .saturating_add(telemetry::runtime::LEFTOVER_BLOCKING_WAIT);

async fn run_engine(
    config: &WorkerConfig,
    engine_config: queue::EngineConfig,
    spec: WorkerSpec,
    pool: PgPool,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    let queues = spec.service.queues();
    let tiers = Arc::new(TierCache::new(config.fairness.fairness_tier_cache_ttl));
    let mut hooks: Vec<Arc<dyn TransitionHook>> = vec![Arc::new(FairnessHook::new(&queues))];
    hooks.extend(spec.hooks);
    let client = Client::new(pool.clone()).with_hooks(hooks);
    // Jobs held back by the limits and slots in use, counted fleet-wide
    // (`fairlane_fairness_waiting`, `fairlane_fairness_running`).
    let waiting_done = CancellationToken::new();
    let waiting = config.fairness.fairness_enabled.then(|| {
        let names: Vec<String> = queues.iter().map(ToString::to_string).collect();
        tokio::spawn(FairnessGauges::register(spec.service.as_str(), &names).run(
            pool.clone(),
            TierLimits::from_config(&config.fairness),
            GAUGE_INTERVAL,
            waiting_done.clone(),
        ))
    });
    let mut builder = Engine::builder(client)
        .name(spec.name)
        .config(engine_config)
        .workers(spec.workers)
        .job_span(Arc::new(tracing_mw::job_span))
        .middleware(Arc::new(FairnessMiddleware::new(
            pool,
            spec.service.as_str(),
            &queues,
            config.fairness.clone(),
            tiers.clone(),
        )));
    if config.fairness.fairness_fetch_gate {
        builder = builder.fetch_gate(Arc::new(FairnessGate::new(
            spec.service.as_str(),
            &queues,
            config.fairness.clone(),
        )));
    }
    for (lane, workers) in Lane::ALL.into_iter().zip(spec.lane_workers) {
        let queue = spec.service.queue(lane);
        if workers > 0 {
            builder = builder.queue(queue, workers);
        } else {
            let variable = lane_variable(spec.lane_prefix, lane);
            tracing::warn!(
                %queue,
                variable,
                "{variable}=0: this process does not work {queue}; other processes must"
            );
        }
    }
    let engine = builder.build()?;
    tracing::info!(
        service = spec.name,
        worker_id = engine.worker_id(),
        lanes = ?spec.lane_workers,
        fairness = config.fairness.fairness_enabled,
        gate = config.fairness.fairness_fetch_gate,
        "worker service starting"
    );
    let ran = engine.run(shutdown).await;
    waiting_done.cancel();
    if let Some(waiting) = waiting {
        join_within(waiting).await;
    }
    ran?;
    Ok(())
}

/// A lazily connecting pool: the service starts (and answers `/healthz`) even while the
/// database is unreachable, and reports not-ready until it is. Refuses fewer than
/// [`MIN_DATABASE_CONNECTIONS`] connections (sqlx panics on a pool of 0).
pub fn lazy_pool(config: &WorkerConfig) -> Result<PgPool, WorkerError> {
    let options = config.check_connections().map_err(WorkerError::Config)?;
    Ok(PgPoolOptions::new()
        .max_connections(config.database_max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(queue::config::session_settings(options)))
}

/// Waits until the database is reachable and fully migrated; false if shut down first (a
/// shutdown does not wait for a check in progress). Logs the reason it waits, and again each
/// time the reason changes: a pod stuck on "migrations behind" says so, not only the
/// "connection refused" of its first try.
pub async fn wait_for_schema(pool: &PgPool, shutdown: &CancellationToken) -> bool {
    let mut delay = Duration::from_millis(200);
    let mut last_reason: Option<String> = None;
    loop {
        let checked = tokio::select! {
            () = shutdown.cancelled() => return false,
            checked = schema::check_applied(pool) => checked,
        };
        match checked {
            Ok(()) => {
                if last_reason.is_some() {
                    tracing::info!("the database is reachable and migrated");
                }
                return true;
            }
            Err(e) => {
                let reason = e.to_string();
                if last_reason.as_deref() != Some(reason.as_str()) {
                    tracing::warn!(error = %reason, "waiting for the database and its migrations");
                    last_reason = Some(reason);
                }
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return false,
            () = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

/// Why a worker binary stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("telemetry: {0}")]
    Telemetry(#[from] telemetry::TelemetryError),
    #[error("installing the SIGTERM/SIGINT handlers: {0}")]
    Signals(#[source] std::io::Error),
    #[error(transparent)]
    Worker(#[from] WorkerError),
}

/// The body of a worker binary's `main` once its configuration is loaded: starts telemetry,
/// cancels on SIGTERM/SIGINT (listening before anything else runs), builds the lazy pool, runs
/// the service until it drains, then flushes telemetry (off the async workers: flushing blocks,
/// boundedly).
pub async fn serve<F, Fut>(worker: &WorkerConfig, run: F) -> Result<(), ServeError>
where
    F: FnOnce(PgPool, CancellationToken) -> Fut,
    Fut: Future<Output = Result<(), WorkerError>>,
{
    let telemetry = telemetry::init(&worker.telemetry)?;
    let shutdown = telemetry::shutdown_on_signals().map_err(ServeError::Signals)?;
    let result = match lazy_pool(worker) {
        Ok(pool) => run(pool, shutdown).await,
        Err(e) => Err(e),
    };
    match tokio::task::spawn_blocking(move || telemetry.shutdown()).await {
        Ok(Err(e)) => tracing::warn!(error = %e, "telemetry shutdown"),
        Err(e) => tracing::warn!(error = %e, "telemetry shutdown task failed"),
        Ok(Ok(())) => {}
    }
    Ok(result?)
}
