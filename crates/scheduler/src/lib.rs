//! Fairlane's `scheduler` service (SPEC §1, seeds ADR-16 and ADR-21): the background work that
//! must happen once fleet-wide, however many replicas run.
//!
//! - Leadership: replicas campaign for the `scheduler` lease ([`queue::LeaderElector`]); only the
//!   holder acts, and it checks right before acting. SIGTERM resigns at once.
//! - Cron tasks ([`runner`]): re-analysis of stale repositories into `analysis_scheduled`
//!   ([`reanalyze`]) and quota reservation cleanup ([`cleanup`]), each tick claimed in
//!   `scheduler_ticks` inside the tick's own transaction, under a lease fence ([`ticks`]), so a
//!   tick commits at most once even across leader changes and paused leaders, and a new leader
//!   catches up the ticks its predecessor missed.
//! - Queue maintenance: the scheduler also campaigns for `queue-maintenance`
//!   ([`queue::Maintainer`]) with the quota and fairness hooks the workers use.
//! - Gauges ([`depth`]): jobs per queue and state, live reservations, exported by the leader.
//!
//! Design notes: `docs/scheduler.md`.

pub mod cleanup;
pub mod config;
pub mod depth;
pub mod error;
pub mod http;
pub mod metrics;
pub mod reanalyze;
pub mod runner;
pub mod schedule;
pub mod ticks;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use common::Service;
use fairness::FairnessHook;
use queue::notifier::Notifier;
use queue::{Client, LeaderElector, Maintainer, QueueName, TransitionHook};
use quota::QuotaHook;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;

pub use config::Config;
pub use error::SchedulerError;

use crate::config::Checked;
use crate::http::StatusState;
use crate::reanalyze::ReanalyzeSettings;
use crate::runner::{CronTask, Periodic};
use crate::ticks::{SCHEDULER_LEASE, TickStore};

/// How long shutdown waits for a tick in progress before resigning anyway.
const STOP_ACTING_TIMEOUT: Duration = Duration::from_secs(10);
/// Then how long the elections (and the queue maintenance one drives) get to finish a pass and
/// resign; past it they are aborted and their leases expire after their TTL.
const ELECTIONS_STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// Then how long the health server gets to stop.
const HTTP_STOP_TIMEOUT: Duration = Duration::from_secs(3);

/// The longest the scheduler takes to stop after SIGTERM, besides its telemetry flush
/// ([`telemetry::TelemetryConfig::shutdown_bound`]), the end of its runtime included: its grace
/// period must exceed the two.
pub const SHUTDOWN_BOUND: Duration = STOP_ACTING_TIMEOUT
    .saturating_add(ELECTIONS_STOP_TIMEOUT)
    .saturating_add(HTTP_STOP_TIMEOUT)
    .saturating_add(telemetry::runtime::LEFTOVER_BLOCKING_WAIT);

/// Runs the scheduler until `shutdown`: serves HTTP at once, waits for the database schema, then
/// campaigns and acts. On shutdown it stops acting, then resigns both leases (another replica
/// takes over within a round trip).
pub async fn run(
    config: &Config,
    pool: PgPool,
    shutdown: CancellationToken,
) -> Result<(), SchedulerError> {
    let checked = config.check()?;
    let candidate_id = candidate_id();
    let status = Arc::new(StatusState {
        candidate_id: candidate_id.clone(),
        tasks: vec![
            (
                reanalyze::TASK,
                config.reanalyze_enabled,
                checked.reanalyze.clone(),
            ),
            (cleanup::TASK, true, checked.reservation_cleanup.clone()),
        ],
        scheduler: OnceLock::new(),
        maintenance: OnceLock::new(),
    });
    let listener = tokio::net::TcpListener::bind(checked.http_addr)
        .await
        .map_err(|source| SchedulerError::Listen {
            addr: config.http_addr.clone(),
            source,
        })?;
    let local = listener.local_addr().ok();
    let app = workerkit::health::routes(pool.clone()).merge(http::routes(Arc::clone(&status)));
    let http_done = CancellationToken::new();
    let http_server = tokio::spawn(workerkit::health::serve(listener, app, http_done.clone()));
    tracing::info!(candidate_id = %candidate_id, http = ?local, "scheduler serving; waiting for the database schema");

    let result = if workerkit::wait_for_schema(&pool, &shutdown).await {
        run_ready(config, checked, pool, status, shutdown).await
    } else {
        Ok(())
    };
    http_done.cancel();
    if tokio::time::timeout(HTTP_STOP_TIMEOUT, http_server)
        .await
        .is_err()
    {
        tracing::warn!("the health server did not stop in time; leaving it");
    }
    result
}

async fn run_ready(
    config: &Config,
    checked: Checked,
    pool: PgPool,
    status: Arc<StatusState>,
    shutdown: CancellationToken,
) -> Result<(), SchedulerError> {
    let candidate_id = status.candidate_id.clone();
    let mut notifier = Notifier::new();
    let (elector, leader) = LeaderElector::new(
        pool.clone(),
        SCHEDULER_LEASE,
        candidate_id.clone(),
        config.scheduler_lease_ttl,
        &mut notifier,
    );
    let maintainer = if checked.engine.maintenance {
        let client = Client::new(pool.clone()).with_hooks(maintenance_hooks());
        Some(Maintainer::new(
            &client,
            checked.engine.clone(),
            candidate_id.clone(),
            &mut notifier,
        )?)
    } else {
        None
    };
    let mut leases = vec![(SCHEDULER_LEASE, leader.clone())];
    if let Some((_, handle)) = &maintainer {
        leases.push((queue::maintenance::MAINTENANCE_LEASE, handle.clone()));
    }
    let _leader_gauge = metrics::leader_gauge(leases);
    let gauges = Arc::new(depth::DepthGauges::register(&leader));
    let metrics = metrics::SchedulerMetrics::new();

    // Elections and notifications stop last, after every actor: the leases are resigned only
    // once nothing acts on them any more.
    let background = CancellationToken::new();
    let mut elections = tokio::task::JoinSet::new();
    let maintenance_handle = maintainer.as_ref().map(|(_, h)| h.clone());
    if let Some((maintainer, _)) = maintainer {
        elections.spawn(maintainer.run(background.clone()));
    }
    elections.spawn(elector.run(background.clone()));
    elections.spawn(notifier.run(pool.clone(), background.clone()));
    let _ = status.scheduler.set(leader.clone());
    let _ = status.maintenance.set(maintenance_handle);

    let store = TickStore::new(
        pool.clone(),
        candidate_id.clone(),
        config.scheduler_lease_ttl,
    );
    let mut actors = tokio::task::JoinSet::new();
    if config.reanalyze_enabled {
        let settings = ReanalyzeSettings {
            after: config.reanalyze_after,
            batch: config.reanalyze_batch,
            max_attempts: i16::try_from(config.reanalyze_max_attempts).unwrap_or(i16::MAX),
        };
        actors.spawn(
            Periodic {
                task: CronTask::Reanalyze(settings),
                schedule: checked.reanalyze.clone(),
                store: store.clone(),
                metrics: metrics.clone(),
            }
            .run(leader.clone(), shutdown.clone()),
        );
    }
    actors.spawn(
        Periodic {
            task: CronTask::ReservationCleanup {
                ttl: config.quota_reservation_ttl,
            },
            schedule: checked.reservation_cleanup.clone(),
            store,
            metrics,
        }
        .run(leader.clone(), shutdown.clone()),
    );
    actors.spawn(depth::run(
        pool,
        gauges,
        leader,
        config.queue_depth_interval,
        config.queue_depth_final_interval,
        shutdown.clone(),
    ));
    tracing::info!(
        candidate_id = %candidate_id,
        reanalyze = config.reanalyze_enabled.then_some(config.reanalyze_schedule.as_str()),
        reservation_cleanup = %config.reservation_cleanup_schedule,
        queue_maintenance = checked.engine.maintenance,
        "scheduler started"
    );

    shutdown.cancelled().await;
    tracing::info!("shutting down: stop acting, then resign");
    let stopped = tokio::time::timeout(STOP_ACTING_TIMEOUT, async {
        while actors.join_next().await.is_some() {}
    })
    .await;
    if stopped.is_err() {
        tracing::warn!("a tick did not finish in time; abandoning it (its transaction rolls back)");
        actors.abort_all();
    }
    background.cancel();
    let resigned = tokio::time::timeout(ELECTIONS_STOP_TIMEOUT, async {
        while elections.join_next().await.is_some() {}
    })
    .await;
    if resigned.is_err() {
        tracing::warn!(
            "the elections did not resign in time (the database is slow or away); their leases expire by themselves"
        );
        elections.abort_all();
    }
    tracing::info!("scheduler stopped");
    Ok(())
}

/// The hooks every process that finishes or rescues jobs runs: quota billing/release, the
/// analysis/specview records' final state, and the fairness wake-up, for the queues of both worker
/// services. (The maintenance leader may be this process; a job it discards must end exactly as
/// in a worker.)
fn maintenance_hooks() -> Vec<Arc<dyn TransitionHook>> {
    let queues: Vec<QueueName> = Service::ALL.iter().flat_map(|s| s.queues()).collect();
    vec![
        Arc::new(FairnessHook::new(&queues)),
        Arc::new(QuotaHook::new()),
        Arc::new(records::RecordHook::new()),
    ]
}

/// `scheduler-<host>-<pid>-<random>`: unique per process, readable in `fairlane_leader`.
fn candidate_id() -> String {
    let host = hostname::get()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unknown".into());
    let suffix: u32 = rand::random::<u32>() % 0x10000;
    format!("scheduler-{host}-{}-{suffix:04x}", std::process::id())
}

/// A lazily connecting pool: the scheduler starts (and answers `/healthz`) while the database is
/// unreachable, and reports not ready until it is. Refuses fewer than
/// [`config::MIN_DATABASE_CONNECTIONS`] connections (sqlx panics on a pool of 0).
pub fn lazy_pool(config: &Config) -> Result<PgPool, SchedulerError> {
    let options = config.check_connections()?;
    Ok(PgPoolOptions::new()
        .max_connections(config.database_max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(queue::config::session_settings(options)))
}
