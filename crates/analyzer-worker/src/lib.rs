//! The `analyzer-worker` service: works the analysis queues: inventories the tests of git
//! repositories. It works `analysis_priority`, `analysis_default` and `analysis_scheduled` with
//! `ANALYZER_QUEUE_{PRIORITY,DEFAULT,SCHEDULED}_WORKERS` workers (5/3/2 by default), behind
//! fleet-wide per-user fairness. The `analysis` handler is in [`analysis`]; its settings
//! (`ANALYZER_*`) in [`settings`]; docs/analysis.md describes both.

pub mod analysis;
pub mod settings;

use std::sync::Arc;

use common::Service;
use queue::{TransitionHook, Workers};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use workerkit::{WorkerConfig, WorkerError, WorkerSpec};

pub use analysis::{AnalysisOutput, AnalysisWorker};
pub use settings::AnalysisSettings;

/// The service's configuration: its lane sizes, the analyzer's settings, plus what every worker
/// service reads.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct Config {
    pub analyzer_queue_priority_workers: usize,
    pub analyzer_queue_default_workers: usize,
    pub analyzer_queue_scheduled_workers: usize,
    #[serde(flatten)]
    pub analysis: AnalysisSettings,
    #[serde(flatten)]
    pub worker: WorkerConfig,
}

impl Default for Config {
    fn default() -> Self {
        let worker = WorkerConfig::for_service("0.0.0.0:9091", "fairlane-analyzer-worker");
        Config {
            analyzer_queue_priority_workers: 5,
            analyzer_queue_default_workers: 3,
            analyzer_queue_scheduled_workers: 2,
            analysis: AnalysisSettings::default(),
            worker,
        }
    }
}

/// The prefix of the lane-size variables (`ANALYZER_QUEUE_PRIORITY_WORKERS` …).
pub const LANE_PREFIX: &str = "ANALYZER";

impl Config {
    /// Workers of the priority, default and scheduled lanes.
    pub fn lane_workers(&self) -> [usize; 3] {
        [
            self.analyzer_queue_priority_workers,
            self.analyzer_queue_default_workers,
            self.analyzer_queue_scheduled_workers,
        ]
    }

    /// Checks every setting (analysis settings, lane sizes, what every worker reads), naming its
    /// variable; `main` calls it before anything starts.
    pub fn validate(&self) -> Result<(), WorkerError> {
        self.worker.validate().map_err(WorkerError::Config)?;
        workerkit::check_lanes(LANE_PREFIX, self.lane_workers()).map_err(WorkerError::Config)?;
        self.analysis.validate().map_err(WorkerError::Config)
    }
}

/// The hooks every analysis job transition runs with: quota billing/release and the record's
/// settlement, in the job's own transaction. (Both worker services register both: the fleet's
/// maintenance leader, whichever process it is, may rescue or discard any job.)
pub fn hooks() -> Vec<Arc<dyn TransitionHook>> {
    vec![
        Arc::new(quota::QuotaHook::new()),
        Arc::new(records::RecordHook::new()),
    ]
}

/// Creates the work directory if needed and checks that a checkout folder can be made in it (a
/// directory that cannot be created or written is a configuration error, reported at start
/// rather than by every job, each retried for hours), and removes checkout folders left there by
/// processes that no longer run (a `kill -9`, an OOM kill, a node restart). Runs at start, before
/// any job is fetched.
pub async fn prepare_work_dir(settings: &AnalysisSettings) -> Result<(), WorkerError> {
    let root = settings.analyzer_work_dir.clone();
    let prepared = tokio::task::spawn_blocking(move || {
        let unusable = |e: std::io::Error| {
            WorkerError::Config(format!("ANALYZER_WORK_DIR `{}`: {e}", root.display()))
        };
        std::fs::create_dir_all(&root).map_err(unusable)?;
        // A checkout folder as a job makes one, removed at once: an existing folder owned by
        // another user, or on a read-only mount, passes `create_dir_all`.
        drop(inventory::fetch::WorkDir::create(&root).map_err(unusable)?);
        Ok::<_, WorkerError>(inventory::sweep_stale(&root))
    })
    .await
    .map_err(|e| WorkerError::Config(format!("preparing ANALYZER_WORK_DIR: {e}")))?;
    match prepared? {
        Ok(report) if !report.removed.is_empty() => tracing::info!(
            removed = report.removed.len(),
            kept = report.kept.len(),
            work_dir = %settings.analyzer_work_dir.display(),
            "removed checkout folders of processes that no longer run"
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!(
            error = %e,
            work_dir = %settings.analyzer_work_dir.display(),
            "could not sweep stale checkout folders"
        ),
    }
    Ok(())
}

/// Runs the service until `shutdown`, then drains.
pub async fn run(
    config: &Config,
    pool: PgPool,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    config.validate()?;
    prepare_work_dir(&config.analysis).await?;
    let mut workers = Workers::new();
    workers.register(AnalysisWorker::new(pool.clone(), config.analysis.clone()));
    if config.worker.worker_sleep_jobs {
        workerkit::sleep::register(&mut workers);
    }
    let spec = WorkerSpec {
        name: "analyzer-worker",
        lane_prefix: LANE_PREFIX,
        service: Service::Analysis,
        lane_workers: config.lane_workers(),
        workers,
        hooks: hooks(),
    };
    workerkit::run(&config.worker, spec, pool, shutdown).await
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[tokio::test]
    async fn a_work_dir_that_cannot_be_created_is_a_configuration_error() {
        let file = std::env::temp_dir().join(format!(
            "fairlane-analyzer-workdir-test-{}",
            std::process::id()
        ));
        std::fs::write(&file, "not a directory").unwrap();
        let settings = AnalysisSettings {
            analyzer_work_dir: file.join("checkouts"),
            ..AnalysisSettings::default()
        };
        let err = prepare_work_dir(&settings).await.unwrap_err().to_string();
        std::fs::remove_file(&file).unwrap();
        assert!(
            err.starts_with("invalid configuration: ANALYZER_WORK_DIR `"),
            "{err}"
        );

        let dir = file.with_extension("dir");
        let fine = AnalysisSettings {
            analyzer_work_dir: dir.join("nested/checkouts"),
            ..AnalysisSettings::default()
        };
        prepare_work_dir(&fine).await.unwrap();
        assert!(dir.join("nested/checkouts").is_dir());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    use super::*;

    #[test]
    fn one_flat_environment_configures_lanes_analysis_and_worker() {
        let env = [
            ("ANALYZER_QUEUE_DEFAULT_WORKERS", "7"),
            ("ANALYZER_FETCH_TIMEOUT", "45s"),
            ("ANALYZER_WORK_DIR", "/srv/checkouts"),
            ("DATABASE_URL", "postgres://db/fairlane"),
            ("QUEUE_POLL_INTERVAL", "250ms"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        let config: Config = common::config::load_from(None, env).unwrap();
        assert_eq!(config.analyzer_queue_default_workers, 7);
        assert_eq!(config.analyzer_queue_priority_workers, 5);
        assert_eq!(
            config.analysis.analyzer_fetch_timeout,
            Duration::from_secs(45)
        );
        assert_eq!(
            config.analysis.analyzer_work_dir,
            std::path::PathBuf::from("/srv/checkouts")
        );
        assert!(!config.analysis.analyzer_allow_file_urls);
        assert_eq!(config.worker.database_url, "postgres://db/fairlane");
        assert_eq!(
            config.worker.engine.queue_poll_interval,
            Duration::from_millis(250)
        );
    }
}
