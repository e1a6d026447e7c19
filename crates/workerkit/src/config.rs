//! Settings shared by the worker services, named after their environment variables.

use std::net::SocketAddr;
use std::time::Duration;

use common::Lane;
use fairness::FairnessConfig;
use queue::EngineConfig;
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgConnectOptions;
use telemetry::TelemetryConfig;

/// The fewest database connections a worker process accepts: the notification listener holds one
/// for good, and the heartbeat, the completer and the fetches each need one at the same time (a
/// heartbeat starved of connections gets a live worker's jobs rescued and run twice).
pub const MIN_DATABASE_CONNECTIONS: u32 = 4;

/// The most workers one lane may have in one process.
pub const MAX_LANE_WORKERS: usize = 10_000;

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
    /// Checks every setting every worker reads, naming its variable: called before anything
    /// starts (telemetry, the pool, the database).
    pub fn validate(&self) -> Result<(), String> {
        self.check_connections()?;
        self.http_addr
            .parse::<SocketAddr>()
            .map_err(|e| format!("HTTP_ADDR `{}`: {e}", self.http_addr))?;
        self.fairness.validate()?;
        self.engine.validate()?;
        self.telemetry.validate()
    }

    /// Refuses a pool smaller than [`MIN_DATABASE_CONNECTIONS`], and a `DATABASE_URL` that is
    /// not a PostgreSQL URL; returns its connect options.
    pub fn check_connections(&self) -> Result<PgConnectOptions, String> {
        if self.database_max_connections < MIN_DATABASE_CONNECTIONS {
            return Err(format!(
                "DATABASE_MAX_CONNECTIONS must be at least {MIN_DATABASE_CONNECTIONS} (the notification listener holds one for good; the heartbeat, the completer and the fetches need one each), got {}",
                self.database_max_connections
            ));
        }
        schema::database_url_options(&self.database_url)
    }

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
    /// The longest a fetch or a completion waits for the database before its connection is
    /// closed and the work tried again on another (`EngineConfig::database_timeout`).
    #[serde(with = "humantime_serde")]
    pub queue_database_timeout: Duration,
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
            queue_database_timeout: e.database_timeout,
        }
    }
}

impl EngineSettings {
    /// Checks the engine's settings, naming their `QUEUE_*` variables.
    pub fn validate(&self) -> Result<(), String> {
        self.to_engine_config().validate_named(engine_variable)
    }

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
            database_timeout: self.queue_database_timeout,
            ..EngineConfig::default()
        }
    }
}

/// The variable that sets the worker count of a service's `lane`: `ANALYZER` and
/// [`Lane::Priority`] give `ANALYZER_QUEUE_PRIORITY_WORKERS`.
pub fn lane_variable(prefix: &str, lane: Lane) -> String {
    format!(
        "{prefix}_QUEUE_{}_WORKERS",
        lane.as_str().to_ascii_uppercase()
    )
}

/// Checks a service's lane sizes (priority, default, scheduled; `prefix` names their variables).
/// A lane of 0 is one this process does not work; all three 0 is a process that works no queue,
/// and more than [`MAX_LANE_WORKERS`] is a mistake.
pub fn check_lanes(prefix: &str, lanes: [usize; 3]) -> Result<(), String> {
    for (lane, workers) in Lane::ALL.into_iter().zip(lanes) {
        if workers > MAX_LANE_WORKERS {
            return Err(format!(
                "{} must be at most {MAX_LANE_WORKERS}, got {workers}",
                lane_variable(prefix, lane)
            ));
        }
    }
    if lanes.iter().all(|&w| w == 0) {
        let [p, d, s] = Lane::ALL.map(|lane| lane_variable(prefix, lane));
        return Err(format!(
            "{p}, {d} and {s} are all 0: this process would work no queue"
        ));
    }
    Ok(())
}

/// The environment variable that sets the queue engine's `field`: `QUEUE_*` for those the
/// services read (the worker services and the scheduler), the field itself for the rest, which
/// keep the engine's defaults.
pub fn engine_variable(field: &str) -> String {
    match field {
        "poll_interval"
        | "job_timeout"
        | "shutdown_timeout"
        | "cancel_grace"
        | "heartbeat_interval"
        | "rescue_after"
        | "rescue_interval"
        | "promote_interval"
        | "leader_ttl"
        | "clean_interval"
        | "retention_completed"
        | "maintenance"
        | "database_timeout" => {
            format!("QUEUE_{}", field.to_ascii_uppercase())
        }
        "retention_cancelled" | "retention_discarded" => "QUEUE_RETENTION_FAILED".to_owned(),
        other => other.to_owned(),
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
    fn too_few_connections_are_refused_before_a_pool_is_built() {
        for n in ["0", "3"] {
            let c = load(&[("DATABASE_MAX_CONNECTIONS", n)]);
            let e = c.validate().unwrap_err();
            assert!(
                e.starts_with("DATABASE_MAX_CONNECTIONS must be at least 4 ")
                    && e.ends_with(&format!("got {n}")),
                "{e}"
            );
            let Err(e) = crate::lazy_pool(&c) else {
                panic!("a pool of {n} connections was built");
            };
            assert!(e.to_string().contains("DATABASE_MAX_CONNECTIONS"), "{e}");
        }
        load(&[("DATABASE_MAX_CONNECTIONS", "4")])
            .validate()
            .unwrap();
        WorkerConfig::default().validate().unwrap();
        assert!(
            load(&[("HTTP_ADDR", "nowhere")])
                .validate()
                .unwrap_err()
                .starts_with("HTTP_ADDR `nowhere`")
        );
        assert!(
            load(&[("OTLP_EXPORT_TIMEOUT", "0s")])
                .validate()
                .unwrap_err()
                .starts_with("OTLP_EXPORT_TIMEOUT")
        );
        assert!(
            load(&[("FAIRNESS_SNOOZE_JITTER", "2h")])
                .validate()
                .unwrap_err()
                .starts_with("FAIRNESS_SNOOZE_JITTER")
        );
    }

    #[test]
    fn lanes_may_be_zero_but_not_all_and_not_absurd() {
        check_lanes("ANALYZER", [5, 3, 2]).unwrap();
        check_lanes("ANALYZER", [5, 0, 0]).unwrap();
        check_lanes("ANALYZER", [0, 0, MAX_LANE_WORKERS]).unwrap();
        assert_eq!(
            check_lanes("SPECGEN", [0, 0, 0]).unwrap_err(),
            "SPECGEN_QUEUE_PRIORITY_WORKERS, SPECGEN_QUEUE_DEFAULT_WORKERS and SPECGEN_QUEUE_SCHEDULED_WORKERS are all 0: this process would work no queue"
        );
        assert_eq!(
            check_lanes("ANALYZER", [1, 1 << 61, 1]).unwrap_err(),
            "ANALYZER_QUEUE_DEFAULT_WORKERS must be at most 10000, got 2305843009213693952"
        );
    }

    #[test]
    fn engine_settings_are_refused_by_their_variable() {
        let err = |env: &[(&str, &str)]| load(env).engine.validate().unwrap_err();
        assert_eq!(
            err(&[("QUEUE_POLL_INTERVAL", "0s")]),
            "QUEUE_POLL_INTERVAL must be greater than zero"
        );
        assert_eq!(
            err(&[("QUEUE_JOB_TIMEOUT", "0s")]),
            "QUEUE_JOB_TIMEOUT must be greater than zero"
        );
        assert!(
            err(&[("QUEUE_HEARTBEAT_INTERVAL", "15s")]).starts_with(
                "QUEUE_HEARTBEAT_INTERVAL (15s) must be non-zero and at most half of QUEUE_RESCUE_AFTER (20s)"
            )
        );
        WorkerConfig::default().engine.validate().unwrap();
        assert_eq!(
            err(&[("QUEUE_DATABASE_TIMEOUT", "0s")]),
            "QUEUE_DATABASE_TIMEOUT must be greater than zero"
        );
    }

    #[test]
    fn the_database_timeout_reaches_the_engine() {
        let engine = |env: &[(&str, &str)]| load(env).engine.to_engine_config();
        assert_eq!(engine(&[]).database_timeout, Duration::from_secs(60));
        assert_eq!(
            engine(&[("QUEUE_DATABASE_TIMEOUT", "90s")]).database_timeout,
            Duration::from_secs(90)
        );
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
