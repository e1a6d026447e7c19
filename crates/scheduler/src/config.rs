//! The scheduler's settings, each named after its environment variable (`REANALYZE_AFTER` sets
//! `reanalyze_after`), loaded by `common::config::load` (defaults < `--config` file < env).

use std::time::Duration;

use queue::EngineConfig;
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgConnectOptions;
use telemetry::TelemetryConfig;

use crate::schedule::{InvalidSchedule, Schedule};

/// Everything the scheduler reads. `Default` is production.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct Config {
    pub database_url: String,
    pub database_max_connections: u32,
    /// Where `/healthz`, `/readyz`, `/status` and `/metrics` are served.
    pub http_addr: String,
    /// Lifetime of the `scheduler` lease, renewed every third of it. A dead leader is replaced
    /// within [`Config::takeover_bound`] of its last renewal.
    #[serde(with = "humantime_serde")]
    pub scheduler_lease_ttl: Duration,
    /// Whether stale repositories are re-analysed.
    pub reanalyze_enabled: bool,
    /// When to look for stale repositories (cron, UTC; 5 fields, or 6 with seconds first).
    pub reanalyze_schedule: String,
    /// A repository whose newest completed analysis is older than this is re-analysed.
    #[serde(with = "humantime_serde")]
    pub reanalyze_after: Duration,
    /// At most this many repositories are queued per tick (stalest first).
    pub reanalyze_batch: u32,
    /// Attempts of one re-analysis job before it is discarded.
    pub reanalyze_max_attempts: u16,
    /// When quota reservations of finished or missing jobs are removed (cron, UTC).
    pub reservation_cleanup_schedule: String,
    /// A reservation that never got a job is removed once older than this (seed ADR-21's TTL,
    /// kept only as a safety net: the reservation of a live job is never removed).
    #[serde(with = "humantime_serde")]
    pub quota_reservation_ttl: Duration,
    /// How often the leader counts non-final jobs per queue and state for `fairlane_queue_jobs`.
    #[serde(with = "humantime_serde")]
    pub queue_depth_interval: Duration,
    /// How often it also counts final jobs (a pass over every retained final row, so rarer).
    #[serde(with = "humantime_serde")]
    pub queue_depth_final_interval: Duration,
    #[serde(flatten)]
    pub maintenance: MaintenanceSettings,
    #[serde(flatten)]
    pub telemetry: TelemetryConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            database_url: "postgres://postgres@127.0.0.1:5432/postgres".into(),
            database_max_connections: 10,
            http_addr: "0.0.0.0:9093".into(),
            scheduler_lease_ttl: Duration::from_secs(10),
            reanalyze_enabled: true,
            reanalyze_schedule: "0 * * * *".into(),
            reanalyze_after: Duration::from_secs(7 * 24 * 3600),
            reanalyze_batch: 100,
            reanalyze_max_attempts: 5,
            reservation_cleanup_schedule: "*/5 * * * *".into(),
            quota_reservation_ttl: Duration::from_secs(3600),
            queue_depth_interval: Duration::from_secs(15),
            queue_depth_final_interval: Duration::from_secs(300),
            maintenance: MaintenanceSettings::default(),
            telemetry: TelemetryConfig::for_service(
                "fairlane-scheduler",
                env!("CARGO_PKG_VERSION"),
            ),
        }
    }
}

/// Queue maintenance settings, under the same `QUEUE_*` names the worker services read (set them
/// to the same values: `QUEUE_RESCUE_AFTER` in particular must match the workers' heartbeats).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct MaintenanceSettings {
    /// Whether the scheduler takes part in the `queue-maintenance` election.
    pub queue_maintenance: bool,
    #[serde(with = "humantime_serde")]
    pub queue_leader_ttl: Duration,
    #[serde(with = "humantime_serde")]
    pub queue_promote_interval: Duration,
    #[serde(with = "humantime_serde")]
    pub queue_rescue_after: Duration,
    #[serde(with = "humantime_serde")]
    pub queue_rescue_interval: Duration,
    /// How often the scheduler checks that the database answers (the rescuer waits for a whole
    /// `QUEUE_RESCUE_AFTER` of answers after an outage).
    #[serde(with = "humantime_serde")]
    pub queue_heartbeat_interval: Duration,
    #[serde(with = "humantime_serde")]
    pub queue_clean_interval: Duration,
    #[serde(with = "humantime_serde")]
    pub queue_retention_completed: Duration,
    /// Retention of cancelled and discarded jobs.
    #[serde(with = "humantime_serde")]
    pub queue_retention_failed: Duration,
}

impl Default for MaintenanceSettings {
    fn default() -> Self {
        let e = EngineConfig::default();
        MaintenanceSettings {
            queue_maintenance: e.maintenance,
            queue_leader_ttl: e.leader_ttl,
            queue_promote_interval: e.promote_interval,
            queue_rescue_after: e.rescue_after,
            queue_rescue_interval: e.rescue_interval,
            queue_heartbeat_interval: e.heartbeat_interval,
            queue_clean_interval: e.clean_interval,
            queue_retention_completed: e.retention_completed,
            queue_retention_failed: e.retention_discarded,
        }
    }
}

impl MaintenanceSettings {
    pub fn to_engine_config(&self) -> EngineConfig {
        EngineConfig {
            maintenance: self.queue_maintenance,
            leader_ttl: self.queue_leader_ttl,
            promote_interval: self.queue_promote_interval,
            rescue_after: self.queue_rescue_after,
            rescue_interval: self.queue_rescue_interval,
            heartbeat_interval: self.queue_heartbeat_interval,
            clean_interval: self.queue_clean_interval,
            retention_completed: self.queue_retention_completed,
            retention_cancelled: self.queue_retention_failed,
            retention_discarded: self.queue_retention_failed,
            ..EngineConfig::default()
        }
    }
}

/// The configuration with its schedules parsed: what [`crate::run`] works from.
#[derive(Debug, Clone)]
pub struct Checked {
    pub reanalyze: Schedule,
    pub reservation_cleanup: Schedule,
    pub engine: EngineConfig,
    pub http_addr: std::net::SocketAddr,
}

/// The fewest database connections the scheduler accepts. The notification listener keeps one
/// for good; the two elections' renewals, the two cron tasks' ticks (on the hour both start),
/// the queue maintenance, the gauges and the probes each need one at once. With fewer, a renewal
/// can wait for a connection past its lease's TTL and leadership lapses.
pub const MIN_DATABASE_CONNECTIONS: u32 = 8;

/// A setting that makes no sense, named by its environment variable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid scheduler configuration: {0}")]
pub struct InvalidConfig(pub String);

/// The shortest `QUEUE_DEPTH_INTERVAL`.
pub const MIN_QUEUE_DEPTH_INTERVAL: Duration = Duration::from_millis(100);

/// The longest `SCHEDULER_LEASE_TTL`.
const MAX_LEASE_TTL: Duration = Duration::from_secs(3600);

impl Config {
    /// Checks every setting and parses the schedules.
    pub fn check(&self) -> Result<Checked, InvalidConfig> {
        let schedule = |name: &str, expr: &str| {
            Schedule::parse(expr)
                .map_err(|e: InvalidSchedule| InvalidConfig(format!("{name}: {e}")))
        };
        let reanalyze = schedule("REANALYZE_SCHEDULE", &self.reanalyze_schedule)?;
        let reservation_cleanup = schedule(
            "RESERVATION_CLEANUP_SCHEDULE",
            &self.reservation_cleanup_schedule,
        )?;
        let http_addr = self
            .http_addr
            .parse()
            .map_err(|e| InvalidConfig(format!("HTTP_ADDR `{}`: {e}", self.http_addr)))?;
        // The TTL is also each tick transaction's idle timeout, an `int` of milliseconds in
        // PostgreSQL; a lease of an hour already means an hour without a scheduler.
        if self.scheduler_lease_ttl < Duration::from_millis(300)
            || self.scheduler_lease_ttl > MAX_LEASE_TTL
        {
            return Err(InvalidConfig(format!(
                "SCHEDULER_LEASE_TTL must be between 300ms and 1h, got {:?}",
                self.scheduler_lease_ttl
            )));
        }
        for (name, d) in [
            ("REANALYZE_AFTER", self.reanalyze_after),
            ("QUOTA_RESERVATION_TTL", self.quota_reservation_ttl),
        ] {
            if d.is_zero() {
                return Err(InvalidConfig(format!("{name} must be longer than zero")));
            }
        }
        // Each live count is a statement on the primary; below this the leader would be counting
        // all the time for a gauge scraped every few seconds at best.
        if self.queue_depth_interval < MIN_QUEUE_DEPTH_INTERVAL {
            return Err(InvalidConfig(format!(
                "QUEUE_DEPTH_INTERVAL must be at least {MIN_QUEUE_DEPTH_INTERVAL:?}, got {:?}",
                self.queue_depth_interval
            )));
        }
        // Final states are counted in a live round that finds them due, so a shorter final
        // period would silently mean the live one; say so instead.
        if self.queue_depth_final_interval < self.queue_depth_interval {
            return Err(InvalidConfig(format!(
                "QUEUE_DEPTH_FINAL_INTERVAL ({:?}) must be at least QUEUE_DEPTH_INTERVAL ({:?})",
                self.queue_depth_final_interval, self.queue_depth_interval
            )));
        }
        if !(1..=10_000).contains(&self.reanalyze_batch) {
            return Err(InvalidConfig(format!(
                "REANALYZE_BATCH must be between 1 and 10000, got {}",
                self.reanalyze_batch
            )));
        }
        if self.reanalyze_max_attempts == 0 || i16::try_from(self.reanalyze_max_attempts).is_err() {
            return Err(InvalidConfig(format!(
                "REANALYZE_MAX_ATTEMPTS must be between 1 and {}, got {}",
                i16::MAX,
                self.reanalyze_max_attempts
            )));
        }
        self.check_connections()?;
        let engine = self.maintenance.to_engine_config();
        engine
            .validate_named(workerkit::config::engine_variable)
            .map_err(InvalidConfig)?;
        self.telemetry.validate().map_err(InvalidConfig)?;
        Ok(Checked {
            reanalyze,
            reservation_cleanup,
            engine,
            http_addr,
        })
    }

    /// Refuses a pool smaller than [`MIN_DATABASE_CONNECTIONS`].
    pub fn check_connections(&self) -> Result<PgConnectOptions, InvalidConfig> {
        if self.database_max_connections < MIN_DATABASE_CONNECTIONS {
            return Err(InvalidConfig(format!(
                "DATABASE_MAX_CONNECTIONS must be at least {MIN_DATABASE_CONNECTIONS} (the listener, elections, ticks, maintenance, metrics, probes), got {}",
                self.database_max_connections
            )));
        }
        schema::database_url_options(&self.database_url).map_err(InvalidConfig)
    }

    /// The longest a dead or partitioned leader can keep the other replicas from acting,
    /// counted from its last renewal: its lease's TTL, plus a follower's retry period (they
    /// retry every third of the TTL, at most every 2 s). A new leader acts at once: it catches up
    /// the ticks it missed. SIGTERM skips all of this: the leader resigns and notifies.
    pub fn takeover_bound(&self) -> Duration {
        self.scheduler_lease_ttl + (self.scheduler_lease_ttl / 3).min(Duration::from_secs(2))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(env: &[(&str, &str)]) -> Config {
        common::config::load_from(
            None,
            env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        )
        .unwrap()
    }

    #[test]
    fn defaults_check_and_a_dead_leader_is_replaced_within_fifteen_seconds() {
        let c = Config::default();
        let checked = c.check().unwrap();
        assert_eq!(c.http_addr, "0.0.0.0:9093");
        assert_eq!(c.quota_reservation_ttl, Duration::from_secs(3600));
        assert_eq!(c.reanalyze_after, Duration::from_secs(7 * 24 * 3600));
        assert_eq!(c.queue_depth_interval, Duration::from_secs(15));
        assert_eq!(checked.reanalyze.as_str(), "0 * * * *");
        assert!(c.takeover_bound() <= Duration::from_secs(15));
        assert_eq!(c.telemetry.otel_service_name, "fairlane-scheduler");
    }

    #[test]
    fn env_names_are_flat() {
        let c = load(&[
            ("SCHEDULER_LEASE_TTL", "3s"),
            ("REANALYZE_SCHEDULE", "*/2 * * * * *"),
            ("REANALYZE_AFTER", "7d"),
            ("REANALYZE_BATCH", "5"),
            ("REANALYZE_ENABLED", "false"),
            ("RESERVATION_CLEANUP_SCHEDULE", "* * * * * *"),
            ("QUOTA_RESERVATION_TTL", "15m"),
            ("QUEUE_DEPTH_INTERVAL", "200ms"),
            ("QUEUE_RESCUE_AFTER", "2s"),
            ("QUEUE_HEARTBEAT_INTERVAL", "500ms"),
            ("HTTP_ADDR", "127.0.0.1:0"),
            ("OTEL_SERVICE_NAME", "s"),
        ]);
        assert_eq!(c.scheduler_lease_ttl, Duration::from_secs(3));
        assert_eq!(c.reanalyze_schedule, "*/2 * * * * *");
        assert_eq!(c.reanalyze_after, Duration::from_secs(7 * 86400));
        assert_eq!(c.reanalyze_batch, 5);
        assert!(!c.reanalyze_enabled);
        assert_eq!(c.quota_reservation_ttl, Duration::from_secs(900));
        assert_eq!(c.queue_depth_interval, Duration::from_millis(200));
        assert_eq!(c.maintenance.queue_rescue_after, Duration::from_secs(2));
        assert_eq!(c.telemetry.otel_service_name, "s");
        let checked = c.check().unwrap();
        assert_eq!(checked.engine.rescue_after, Duration::from_secs(2));
        assert_eq!(
            checked.engine.heartbeat_interval,
            Duration::from_millis(500)
        );
    }

    #[test]
    fn bad_settings_name_their_variable() {
        let err = |env: &[(&str, &str)]| load(env).check().unwrap_err().to_string();
        assert!(err(&[("REANALYZE_SCHEDULE", "hourly")]).contains("REANALYZE_SCHEDULE"));
        assert!(
            err(&[("RESERVATION_CLEANUP_SCHEDULE", "* * *")])
                .contains("RESERVATION_CLEANUP_SCHEDULE")
        );
        assert!(err(&[("REANALYZE_BATCH", "0")]).contains("REANALYZE_BATCH"));
        assert!(err(&[("REANALYZE_MAX_ATTEMPTS", "40000")]).contains("REANALYZE_MAX_ATTEMPTS"));
        assert!(err(&[("QUEUE_DEPTH_INTERVAL", "0s")]).contains("QUEUE_DEPTH_INTERVAL"));
        assert_eq!(
            err(&[("QUEUE_DEPTH_INTERVAL", "1ms")]),
            "invalid scheduler configuration: QUEUE_DEPTH_INTERVAL must be at least 100ms, got 1ms"
        );
        assert_eq!(
            err(&[
                ("QUEUE_DEPTH_INTERVAL", "1m"),
                ("QUEUE_DEPTH_FINAL_INTERVAL", "30s")
            ]),
            "invalid scheduler configuration: QUEUE_DEPTH_FINAL_INTERVAL (30s) must be at least QUEUE_DEPTH_INTERVAL (60s)"
        );
        assert!(
            load(&[
                ("QUEUE_DEPTH_INTERVAL", "100ms"),
                ("QUEUE_DEPTH_FINAL_INTERVAL", "100ms")
            ])
            .check()
            .is_ok()
        );
        assert!(err(&[("SCHEDULER_LEASE_TTL", "10ms")]).contains("SCHEDULER_LEASE_TTL"));
        assert!(err(&[("SCHEDULER_LEASE_TTL", "30d")]).contains("SCHEDULER_LEASE_TTL"));
        assert!(err(&[("HTTP_ADDR", "nowhere")]).contains("HTTP_ADDR"));
        assert!(err(&[("QUEUE_HEARTBEAT_INTERVAL", "30s")]).contains("QUEUE_"));
    }

    #[test]
    fn queue_and_telemetry_settings_are_named_by_their_variable() {
        let err = |env: &[(&str, &str)]| load(env).check().unwrap_err().to_string();
        assert!(
            err(&[("QUEUE_HEARTBEAT_INTERVAL", "30s")]).starts_with(
                "invalid scheduler configuration: QUEUE_HEARTBEAT_INTERVAL (30s) must be non-zero and at most half of QUEUE_RESCUE_AFTER (20s)"
            )
        );
        assert_eq!(
            err(&[("QUEUE_PROMOTE_INTERVAL", "0s")]),
            "invalid scheduler configuration: QUEUE_PROMOTE_INTERVAL must be greater than zero"
        );
        assert!(err(&[("METRICS_EXPORT_INTERVAL", "0s")]).contains("METRICS_EXPORT_INTERVAL"));
        for n in ["0", "3", "7"] {
            let e = err(&[("DATABASE_MAX_CONNECTIONS", n)]);
            assert!(
                e.contains("DATABASE_MAX_CONNECTIONS must be at least 8"),
                "{e}"
            );
            let Err(e) = crate::lazy_pool(&load(&[("DATABASE_MAX_CONNECTIONS", n)])) else {
                panic!("a pool of {n} connections was built");
            };
            assert!(e.to_string().contains("DATABASE_MAX_CONNECTIONS"), "{e}");
        }
    }
}
