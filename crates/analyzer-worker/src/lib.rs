//! The `analyzer-worker` service: works the analysis queues: inventories the tests of git repositories. It works `analysis_priority`,
//! `analysis_default` and `analysis_scheduled` with
//! `ANALYZER_QUEUE_{PRIORITY,DEFAULT,SCHEDULED}_WORKERS` workers (5/3/2 by default), behind
//! fleet-wide per-user fairness.

use common::Service;
use queue::Workers;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use workerkit::{WorkerConfig, WorkerError, WorkerSpec};

/// The service's configuration: its lane sizes plus what every worker service reads.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct Config {
    pub analyzer_queue_priority_workers: usize,
    pub analyzer_queue_default_workers: usize,
    pub analyzer_queue_scheduled_workers: usize,
    #[serde(flatten)]
    pub worker: WorkerConfig,
}

impl Default for Config {
    fn default() -> Self {
        let defaults = WorkerConfig::default();
        let worker = WorkerConfig {
            http_addr: "0.0.0.0:9091".into(),
            telemetry: telemetry::TelemetryConfig {
                otel_service_name: "fairlane-analyzer-worker".into(),
                ..defaults.telemetry.clone()
            },
            ..defaults
        };
        Config {
            analyzer_queue_priority_workers: 5,
            analyzer_queue_default_workers: 3,
            analyzer_queue_scheduled_workers: 2,
            worker,
        }
    }
}

/// Runs the service until `shutdown`, then drains.
pub async fn run(
    config: &Config,
    pool: PgPool,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    let mut workers = Workers::new();
    if config.worker.worker_sleep_jobs {
        workerkit::sleep::register(&mut workers);
    }
    let spec = WorkerSpec {
        name: "analyzer-worker",
        service: Service::Analysis,
        lane_workers: [
            config.analyzer_queue_priority_workers,
            config.analyzer_queue_default_workers,
            config.analyzer_queue_scheduled_workers,
        ],
        workers,
        // Bill on success, release on final failure or cancel, in the job's own transaction.
        hooks: vec![std::sync::Arc::new(quota::QuotaHook::new())],
    };
    workerkit::run(&config.worker, spec, pool, shutdown).await
}
