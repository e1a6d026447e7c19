//! Tunables of the queue runtime, with production defaults. Every duration is configurable so tests
//! can run the same code paths in milliseconds.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::postgres::PgConnectOptions;

use crate::backoff::RetryPolicy;

/// How a process fetches, runs, completes and maintains jobs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EngineConfig {
    /// Fetch this often even without a notification (the LISTEN/NOTIFY fallback).
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// Least time between two fetches of one queue while it has a backlog, so that slots freed
    /// together are refilled by one query instead of one query each.
    #[serde(with = "humantime_serde")]
    pub fetch_cooldown: Duration,
    /// Most jobs taken by one fetch.
    pub fetch_limit: usize,
    /// Fetches of one queue in flight at once (more keep the database busy while a backlog
    /// drains; the worker count still bounds running jobs).
    pub fetch_concurrency: usize,
    /// Default handler timeout (a handler may set its own).
    #[serde(with = "humantime_serde")]
    pub job_timeout: Duration,
    /// How long a running job may keep going after it was told to stop (cancel or shutdown
    /// deadline) before it is abandoned.
    #[serde(with = "humantime_serde")]
    pub cancel_grace: Duration,
    /// On shutdown, how long running jobs may take to finish before they are interrupted and
    /// handed back to the queue.
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Duration,
    /// How often this process proves it is alive.
    #[serde(with = "humantime_serde")]
    pub heartbeat_interval: Duration,
    /// A process whose last heartbeat is older than this is presumed dead and its running jobs are
    /// rescued. Together with `rescue_interval` this bounds how long a dead worker's job waits.
    #[serde(with = "humantime_serde")]
    pub rescue_after: Duration,
    /// A running job attributed to this process that it does not know about (its fetch result was
    /// lost with a connection) is handed back after this long.
    #[serde(with = "humantime_serde")]
    pub orphan_grace: Duration,
    /// The longest a fetch or a completion waits for the database, from asking for a
    /// connection to the commit's answer. Past it the connection is closed, not pooled, and the
    /// work tried again on another: a connection whose path went silent (a failover to another
    /// host, a dropped route) would otherwise hold it until the kernel gives up, about 15
    /// minutes, while the heartbeat, on a connection of its own, keeps its jobs from the rescuer.
    #[serde(with = "humantime_serde")]
    pub database_timeout: Duration,
    /// Whether this process takes part in the election for fleet-wide maintenance.
    pub maintenance: bool,
    /// How often the maintenance leader makes due scheduled/retryable jobs available.
    #[serde(with = "humantime_serde")]
    pub promote_interval: Duration,
    /// How often the maintenance leader looks for jobs of dead workers.
    #[serde(with = "humantime_serde")]
    pub rescue_interval: Duration,
    /// How often the maintenance leader deletes old final jobs.
    #[serde(with = "humantime_serde")]
    pub clean_interval: Duration,
    #[serde(with = "humantime_serde")]
    pub retention_completed: Duration,
    #[serde(with = "humantime_serde")]
    pub retention_cancelled: Duration,
    #[serde(with = "humantime_serde")]
    pub retention_discarded: Duration,
    /// Lifetime of the maintenance leader's lease; it is renewed at a third of this.
    #[serde(with = "humantime_serde")]
    pub leader_ttl: Duration,
    /// Most completions persisted by one transaction.
    pub completer_batch: usize,
    /// Completion transactions in flight at once.
    pub completer_concurrency: usize,
    /// Backoff between attempts of a failing job.
    pub retry: RetryPolicy,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            poll_interval: Duration::from_secs(1),
            fetch_cooldown: Duration::from_millis(2),
            fetch_limit: 1000,
            fetch_concurrency: 2,
            job_timeout: Duration::from_secs(300),
            cancel_grace: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(25),
            heartbeat_interval: Duration::from_secs(5),
            rescue_after: Duration::from_secs(20),
            orphan_grace: Duration::from_secs(10),
            database_timeout: Duration::from_secs(60),
            maintenance: true,
            promote_interval: Duration::from_secs(1),
            rescue_interval: Duration::from_secs(5),
            clean_interval: Duration::from_secs(60),
            retention_completed: Duration::from_secs(24 * 3600),
            retention_cancelled: Duration::from_secs(7 * 24 * 3600),
            retention_discarded: Duration::from_secs(7 * 24 * 3600),
            leader_ttl: Duration::from_secs(10),
            completer_batch: 1000,
            completer_concurrency: 2,
            retry: RetryPolicy::default(),
        }
    }
}

/// The shortest poll, heartbeat and maintenance interval accepted.
pub const MIN_LOOP_INTERVAL: Duration = Duration::from_millis(10);
/// The shortest maintenance lease accepted.
pub const MIN_LEADER_TTL: Duration = Duration::from_millis(300);
/// The longest maintenance lease accepted (a killed leader's rescues wait up to this long).
pub const MAX_LEADER_TTL: Duration = Duration::from_secs(3600);

impl EngineConfig {
    /// The longest a dead worker's job can wait before it is runnable again.
    pub fn max_rescue_delay(&self) -> Duration {
        self.rescue_after + self.rescue_interval + self.leader_ttl
    }

    /// Checks relations between settings that would make the runtime misbehave. Messages name
    /// the fields; see [`EngineConfig::validate_named`].
    pub fn validate(&self) -> Result<(), String> {
        self.validate_named(str::to_owned)
    }

    /// [`EngineConfig::validate`], naming each field with `name(field)`, so a service reports
    /// the setting it reads (`poll_interval` → `QUEUE_POLL_INTERVAL`).
    pub fn validate_named(&self, name: impl Fn(&str) -> String) -> Result<(), String> {
        if self.heartbeat_interval.is_zero()
            || self.heartbeat_interval.saturating_mul(2) > self.rescue_after
        {
            return Err(format!(
                "{} ({:?}) must be non-zero and at most half of {} ({:?}), or live workers would be rescued",
                name("heartbeat_interval"),
                self.heartbeat_interval,
                name("rescue_after"),
                self.rescue_after
            ));
        }
        for (field, n) in [
            ("fetch_limit", self.fetch_limit),
            ("fetch_concurrency", self.fetch_concurrency),
            ("completer_batch", self.completer_batch),
            ("completer_concurrency", self.completer_concurrency),
        ] {
            if n == 0 {
                return Err(format!("{} must be at least 1", name(field)));
            }
        }
        for (field, d) in [
            ("poll_interval", self.poll_interval),
            ("promote_interval", self.promote_interval),
            ("rescue_interval", self.rescue_interval),
            ("clean_interval", self.clean_interval),
            ("leader_ttl", self.leader_ttl),
            ("job_timeout", self.job_timeout),
            ("database_timeout", self.database_timeout),
        ] {
            if d.is_zero() {
                return Err(format!("{} must be greater than zero", name(field)));
            }
        }
        // Timers that run in a loop: shorter than this they only burn CPU and connections.
        for (field, d) in [
            ("poll_interval", self.poll_interval),
            ("heartbeat_interval", self.heartbeat_interval),
            ("promote_interval", self.promote_interval),
            ("rescue_interval", self.rescue_interval),
            ("clean_interval", self.clean_interval),
        ] {
            if d < MIN_LOOP_INTERVAL {
                return Err(format!(
                    "{} must be at least {MIN_LOOP_INTERVAL:?}, got {d:?}",
                    name(field)
                ));
            }
        }
        // The lease is valid until the renewal's send time plus the TTL: a TTL within a round
        // trip leaves no one leader long enough to act, and maintenance stops fleet-wide. A long
        // one keeps a killed leader's lease, and so every rescue, waiting that long.
        if !(MIN_LEADER_TTL..=MAX_LEADER_TTL).contains(&self.leader_ttl) {
            return Err(format!(
                "{} must be between {MIN_LEADER_TTL:?} and 1h, got {:?}",
                name("leader_ttl"),
                self.leader_ttl
            ));
        }
        // Subtracted from or added to the database's clock: far beyond a century the timestamp
        // is out of range, and every clean-up (all states at once) or every retry would fail.
        for (field, d) in [
            ("retention_completed", self.retention_completed),
            ("retention_cancelled", self.retention_cancelled),
            ("retention_discarded", self.retention_discarded),
            ("retry_max", self.retry.max),
            ("retry_base", self.retry.base),
        ] {
            if d > common::config::MAX_DURATION {
                return Err(format!(
                    "{} must be at most 100 years, got {d:?}",
                    name(field)
                ));
            }
        }
        Ok(())
    }
}

/// `options` with the session settings Fairlane's statements rely on, whatever the database's or
/// the role's defaults: READ COMMITTED. The fetch gate counts a user's running jobs in a statement
/// of its own after taking the user's lock, and the quota check and the reservation cleanup decide
/// in a statement after their locks; each must see what was committed before it. Under a
/// `default_transaction_isolation` of `repeatable read` they would see the transaction's first
/// snapshot instead, and two replicas could both take a user's last slot.
pub fn session_settings(options: PgConnectOptions) -> PgConnectOptions {
    options.options([("default_transaction_isolation", "read committed")])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_rescue_within_thirty_seconds() {
        let c = EngineConfig::default();
        c.validate().unwrap();
        // A crashed worker's jobs: stale after 20 s, found within 5 s; the 30 s target holds
        // whenever a maintenance leader is in office.
        assert!(c.rescue_after + c.rescue_interval <= Duration::from_secs(30));
    }

    #[test]
    fn retentions_and_retry_delays_beyond_a_century_are_refused() {
        let thousand_years = Duration::from_secs(1000 * 365 * 24 * 3600);
        let long_retention = EngineConfig {
            retention_discarded: thousand_years,
            ..EngineConfig::default()
        };
        assert!(
            long_retention
                .validate()
                .unwrap_err()
                .contains("retention_discarded must be at most 100 years")
        );
        let long_retry = EngineConfig {
            retry: RetryPolicy {
                max: Duration::MAX,
                ..RetryPolicy::default()
            },
            ..EngineConfig::default()
        };
        assert!(long_retry.validate().unwrap_err().contains("retry_max"));
    }

    #[test]
    fn heartbeat_must_be_well_inside_rescue_window() {
        let c = EngineConfig {
            heartbeat_interval: Duration::from_secs(15),
            ..EngineConfig::default()
        };
        assert!(c.validate().unwrap_err().contains("heartbeat_interval"));
        let named = c
            .validate_named(|field| format!("QUEUE_{}", field.to_ascii_uppercase()))
            .unwrap_err();
        assert!(
            named.starts_with("QUEUE_HEARTBEAT_INTERVAL (15s) must be non-zero and at most half of QUEUE_RESCUE_AFTER (20s)"),
            "{named}"
        );
    }

    #[test]
    fn busy_loops_and_leases_shorter_than_a_round_trip_are_refused() {
        let busy = EngineConfig {
            promote_interval: Duration::from_nanos(1),
            ..EngineConfig::default()
        };
        assert_eq!(
            busy.validate().unwrap_err(),
            "promote_interval must be at least 10ms, got 1ns"
        );
        for ttl in [Duration::from_millis(1), Duration::from_secs(2 * 3600)] {
            let lease = EngineConfig {
                leader_ttl: ttl,
                ..EngineConfig::default()
            };
            assert!(
                lease
                    .validate()
                    .unwrap_err()
                    .starts_with("leader_ttl must be between 300ms and 1h"),
                "{ttl:?}"
            );
        }
    }

    #[test]
    fn durations_round_trip_as_humantime() {
        let c = EngineConfig::default();
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(v["poll_interval"], "1s");
        let back: EngineConfig = serde_json::from_value(v).unwrap();
        assert_eq!(back, c);
    }
}
