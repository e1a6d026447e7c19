//! The `specgen-worker` service: works the specview queues: turns analyses into behaviour
//! specifications. It works `specview_priority`, `specview_default` and `specview_scheduled` with
//! `SPECGEN_QUEUE_{PRIORITY,DEFAULT,SCHEDULED}_WORKERS` workers (3/2/1 by default), behind
//! fleet-wide per-user fairness. The `specview` handler is in [`specview`] (docs/analysis.md).

pub mod specview;

use std::sync::Arc;

use common::Service;
use queue::{TransitionHook, Workers};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use workerkit::{WorkerConfig, WorkerError, WorkerSpec};

pub use specview::{SpecviewOutput, SpecviewResult, SpecviewWorker};

/// The service's configuration: its lane sizes plus what every worker service reads.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct Config {
    pub specgen_queue_priority_workers: usize,
    pub specgen_queue_default_workers: usize,
    pub specgen_queue_scheduled_workers: usize,
    #[serde(flatten)]
    pub worker: WorkerConfig,
}

impl Default for Config {
    fn default() -> Self {
        let worker = WorkerConfig::for_service("0.0.0.0:9092", "fairlane-specgen-worker");
        Config {
            specgen_queue_priority_workers: 3,
            specgen_queue_default_workers: 2,
            specgen_queue_scheduled_workers: 1,
            worker,
        }
    }
}

/// The prefix of the lane-size variables (`SPECGEN_QUEUE_PRIORITY_WORKERS` …).
pub const LANE_PREFIX: &str = "SPECGEN";

impl Config {
    /// Workers of the priority, default and scheduled lanes.
    pub fn lane_workers(&self) -> [usize; 3] {
        [
            self.specgen_queue_priority_workers,
            self.specgen_queue_default_workers,
            self.specgen_queue_scheduled_workers,
        ]
    }

    /// Checks every setting (lane sizes, what every worker reads), naming its
    /// variable; `main` calls it before anything starts.
    pub fn validate(&self) -> Result<(), WorkerError> {
        self.worker.validate().map_err(WorkerError::Config)?;
        workerkit::check_lanes(LANE_PREFIX, self.lane_workers()).map_err(WorkerError::Config)?;
        Ok(())
    }
}

/// The hooks every specview job transition runs with: quota billing/release and the record's
/// settlement, in the job's own transaction. ([`records::RecordHook`] settles analysis records
/// too: the fleet's maintenance leader, whichever process it is, may rescue or discard any job.)
pub fn hooks() -> Vec<Arc<dyn TransitionHook>> {
    vec![
        Arc::new(quota::QuotaHook::new()),
        Arc::new(records::RecordHook::new()),
    ]
}

/// Runs the service until `shutdown`, then drains.
pub async fn run(
    config: &Config,
    pool: PgPool,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    config.validate()?;
    let mut workers = Workers::new();
    workers.register(SpecviewWorker::new(pool.clone()));
    if config.worker.worker_sleep_jobs {
        workerkit::sleep::register(&mut workers);
    }
    let spec = WorkerSpec {
        name: "specgen-worker",
        lane_prefix: LANE_PREFIX,
        service: Service::Specview,
        lane_workers: config.lane_workers(),
        workers,
        hooks: hooks(),
    };
    workerkit::run(&config.worker, spec, pool, shutdown).await
}
