//! Settings shared by the worker services, named after their environment variables.

use std::time::Duration;

use fairness::FairnessConfig;
use queue::EngineConfig;
use serde::{Deserialize, Serialize};
use telemetry::TelemetryConfig;

/// The common part of a worker service's configuration (each binary adds its lane sizes).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct WorkerConfig {
    pub database_url: String,
    pub database_max_connections: u32,
    /// Where `/healthz`, `/readyz` and `/metrics` are served.
    pub http_addr: String,
    /// `WORKER_SLEEP_JOBS`: also run the diagnostic `sleep` job kind (smoke and load tests).
    pub worker_sleep_jobs: bool,
    #[serde(flatten)]
    pub engine: EngineSettings,
    #[serde(flatten)]
    pub fairness: FairnessConfig,
    #[serde(flatten)]
    pub telemetry: TelemetryConfig,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            database_url: "postgres://postgres@127.0.0.1:5432/postgres".into(),
            database_max_connections: 20,
            http_addr: "0.0.0.0:9090".into(),
            worker_sleep_jobs: false,
            engine: EngineSettings::default(),
            fairness: FairnessConfig::default(),
            telemetry: TelemetryConfig::default(),
        }
    }
}

impl WorkerConfig {
    /// The defaults of one worker service: its own HTTP address and OpenTelemetry service name.
    pub fn for_service(http_addr: &str, otel_service_name: &str) -> Self {
        let defaults = WorkerConfig::default();
        WorkerConfig {
            http_addr: http_addr.to_owned(),
            telemetry: TelemetryConfig {
                otel_service_name: otel_service_name.to_owned(),
                ..defaults.telemetry.clone()
            },
            ..defaults
        }
    }
}

/// Queue engine tunables exposed as `QUEUE_*` variables (the rest keep the engine's defaults).
/// The maintenance ones (promote, rescue, clean, retention, lease) are the scheduler's too: any
/// of these processes may hold the maintenance lease, so they must match across services.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct EngineSettings {
    #[serde(with = "humantime_serde")]
    pub queue_poll_interval: Duration,
    #[serde(with = "humantime_serde")]
    pub queue_job_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub queue_shutdown_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub queue_cancel_grace: Duration,
    #[serde(with = "humantime_serde")]
    pub queue_heartbeat_interval: Duration,
    #[serde(with = "humantime_serde")]
    pub queue_rescue_after: Duration,
    #[serde(with = "humantime_serde")]
    pub queue_rescue_interval: Duration,
    #[serde(with = "humantime_serde")]
    pub queue_promote_interval: Duration,
    #[serde(with = "humantime_serde")]
    pub queue_leader_ttl: Duration,
    /// Cleaner period (when this process holds the maintenance lease).
    #[serde(with = "humantime_serde")]
    pub queue_clean_interval: Duration,
    #[serde(with = "humantime_serde")]
    pub queue_retention_completed: Duration,
    #[serde(with = "humantime_serde")]
    pub queue_retention_failed: Duration,
    /// Whether this process takes part in fleet-wide queue maintenance.
    pub queue_maintenance: bool,
}

impl Default for EngineSettings {
    fn default() -> Self {
        let e = EngineConfig::default();
        EngineSettings {
            queue_poll_interval: e.poll_interval,
            queue_job_timeout: e.job_timeout,
            queue_shutdown_timeout: e.shutdown_timeout,
            queue_cancel_grace: e.cancel_grace,
            queue_heartbeat_interval: e.heartbeat_interval,
            queue_rescue_after: e.rescue_after,
            queue_rescue_interval: e.rescue_interval,
            queue_promote_interval: e.promote_interval,
            queue_leader_ttl: e.leader_ttl,
            queue_clean_interval: e.clean_interval,
            queue_retention_completed: e.retention_completed,
            queue_retention_failed: e.retention_discarded,
            queue_maintenance: e.maintenance,
        }
    }
}

impl EngineSettings {
    pub fn to_engine_config(&self) -> EngineConfig {
        EngineConfig {
            poll_interval: self.queue_poll_interval,
            job_timeout: self.queue_job_timeout,
            shutdown_timeout: self.queue_shutdown_timeout,
            cancel_grace: self.queue_cancel_grace,
            heartbeat_interval: self.queue_heartbeat_interval,
            rescue_after: self.queue_rescue_after,
            rescue_interval: self.queue_rescue_interval,
            promote_interval: self.queue_promote_interval,
            leader_ttl: self.queue_leader_ttl,
            clean_interval: self.queue_clean_interval,
            retention_completed: self.queue_retention_completed,
            retention_cancelled: self.queue_retention_failed,
            retention_discarded: self.queue_retention_failed,
            maintenance: self.queue_maintenance,
            ..EngineConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(env: &[(&str, &str)]) -> WorkerConfig {
        common::config::load_from(
            None,
            env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        )
        .expect("valid settings")
    }

    #[test]
    fn every_queue_maintenance_setting_the_scheduler_reads_reaches_the_engine() {
        // Workers take part in the same maintenance election as the scheduler, so whichever
        // wins must run with the same QUEUE_* values.
        let engine = load(&[
            ("QUEUE_CLEAN_INTERVAL", "7m"),
            ("QUEUE_PROMOTE_INTERVAL", "3s"),
            ("QUEUE_RESCUE_AFTER", "40s"),
            ("QUEUE_RESCUE_INTERVAL", "9s"),
            ("QUEUE_LEADER_TTL", "12s"),
            ("QUEUE_HEARTBEAT_INTERVAL", "4s"),
            ("QUEUE_RETENTION_COMPLETED", "2days"),
            ("QUEUE_RETENTION_FAILED", "9days"),
            ("QUEUE_MAINTENANCE", "false"),
        ])
        .engine
        .to_engine_config();
        assert_eq!(engine.clean_interval, Duration::from_secs(7 * 60));
        assert_eq!(engine.promote_interval, Duration::from_secs(3));
        assert_eq!(engine.rescue_after, Duration::from_secs(40));
        assert_eq!(engine.rescue_interval, Duration::from_secs(9));
        assert_eq!(engine.leader_ttl, Duration::from_secs(12));
        assert_eq!(engine.heartbeat_interval, Duration::from_secs(4));
        assert_eq!(engine.retention_completed, Duration::from_secs(2 * 86_400));
        assert_eq!(engine.retention_discarded, Duration::from_secs(9 * 86_400));
        assert_eq!(engine.retention_cancelled, Duration::from_secs(9 * 86_400));
        assert!(!engine.maintenance);
        assert_eq!(
            WorkerConfig::default()
                .engine
                .to_engine_config()
                .clean_interval,
            EngineConfig::default().clean_interval
        );
    }
}
