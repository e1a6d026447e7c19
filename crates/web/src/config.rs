//! The web service's settings: flat fields named after their environment variables
//! (`HTTP_ADDR` sets `http_addr`), with the quota and telemetry settings embedded, loaded by
//! `common::config::load` (defaults < `--config` file < environment).

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Everything `web` reads at start-up.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct WebConfig {
    /// PostgreSQL URL.
    pub database_url: String,
    /// Most pooled database connections. The batch thread opens its own besides: one for API-key
    /// look-ups and one per enqueue collector, plus one spare each (ADR 0012).
    pub database_max_connections: u32,
    /// Address the HTTP server listens on.
    pub http_addr: String,
    /// Bearer token of the admin API; unset disables it (every admin call is refused).
    pub admin_token: Option<String>,
    /// Redis for the shared rate limiter; unset uses an in-memory limiter per process.
    pub redis_url: Option<String>,
    /// Rate limit rules file (Envoy format, see docs/ratelimit.md).
    pub ratelimit_rules: String,
    /// Turns rate limiting off altogether (benchmarks, local debugging).
    pub ratelimit_enabled: bool,
    /// Longest wait for Redis per decision before the in-memory fallback decides.
    #[serde(with = "humantime_serde")]
    pub ratelimit_deadline: Duration,
    /// Accept `file://` repositories (tests and local development only).
    pub analyzer_allow_file_urls: bool,
    /// Accept hosts that are or resolve to loopback, private, link-local … addresses (an
    /// internal git server; the analyzer reads the same variable).
    pub analyzer_allow_private_hosts: bool,
    /// Longest time one request may take before it is answered with 503 and rolled back.
    #[serde(with = "humantime_serde")]
    pub http_request_timeout: Duration,
    /// Largest request body accepted, in bytes.
    pub http_body_limit: usize,
    /// Cap on resolving a branch or tag to a commit (`git ls-remote`), DNS included.
    #[serde(with = "humantime_serde")]
    pub resolve_timeout: Duration,
    /// Most `POST` requests enqueued together in one transaction (docs/web.md, ADR 0007).
    pub enqueue_batch_max: usize,
    /// Enqueue transactions running at once, each for its own share of the users (each with a
    /// connection of its own on the batch thread, outside `database_max_connections`).
    pub enqueue_batch_concurrency: usize,
    /// `QUOTA_*` settings.
    #[serde(flatten)]
    pub quota: quota::QuotaConfig,
    /// `RUST_LOG`, `LOG_FORMAT`, `OTEL_*` …
    #[serde(flatten)]
    pub telemetry: telemetry::TelemetryConfig,
}

fn web_telemetry() -> telemetry::TelemetryConfig {
    telemetry::TelemetryConfig::for_service("fairlane-web", env!("CARGO_PKG_VERSION"))
}

impl Default for WebConfig {
    fn default() -> Self {
        WebConfig {
            database_url: "postgres://postgres@127.0.0.1:5432/fairlane".to_owned(),
            database_max_connections: 20,
            http_addr: "0.0.0.0:8080".to_owned(),
            admin_token: None,
            redis_url: None,
            ratelimit_rules: "deploy/ratelimit/rules.yaml".to_owned(),
            ratelimit_enabled: true,
            ratelimit_deadline: Duration::from_millis(20),
            analyzer_allow_file_urls: false,
            analyzer_allow_private_hosts: false,
            http_request_timeout: Duration::from_secs(30),
            http_body_limit: 16 * 1024,
            resolve_timeout: Duration::from_secs(10),
            enqueue_batch_max: 64,
            enqueue_batch_concurrency: 1,
            quota: quota::QuotaConfig::default(),
            telemetry: web_telemetry(),
        }
    }
}

/// The shortest `ADMIN_TOKEN` accepted: the admin API is not rate limited, so its token must be
/// too long to guess.
pub const ADMIN_TOKEN_MIN_CHARS: usize = 16;

impl WebConfig {
    /// Checks what loading cannot: an `ADMIN_TOKEN`, when set, is at least
    /// [`ADMIN_TOKEN_MIN_CHARS`] characters. (An empty one is unset: the admin API is off.)
    pub fn validate(&self) -> Result<(), String> {
        if let Some(token) = &self.admin_token
            && token.chars().count() < ADMIN_TOKEN_MIN_CHARS
        {
            return Err(format!(
                "ADMIN_TOKEN must be at least {ADMIN_TOKEN_MIN_CHARS} characters (it has {}); \
                 generate one with `openssl rand -hex 32`, or unset it to disable the admin API",
                token.chars().count()
            ));
        }
        Ok(())
    }

    /// Loads defaults, then `file` (if given), then the environment.
    pub fn load(file: Option<&Path>) -> Result<WebConfig, Box<common::config::ConfigError>> {
        Self::load_from(file, std::env::vars().collect())
    }

    /// [`WebConfig::load`] with an explicit environment.
    pub fn load_from(
        file: Option<&Path>,
        env: Vec<(String, String)>,
    ) -> Result<WebConfig, Box<common::config::ConfigError>> {
        common::config::load_from(file, env).map_err(Box::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn defaults() {
        let c = WebConfig::load_from(None, env(&[])).unwrap();
        assert_eq!(c.http_addr, "0.0.0.0:8080");
        assert_eq!(c.ratelimit_rules, "deploy/ratelimit/rules.yaml");
        assert_eq!(c.admin_token, None);
        assert_eq!(c.redis_url, None);
        assert!(!c.analyzer_allow_file_urls);
        assert!(!c.analyzer_allow_private_hosts);
        assert_eq!(c.quota, quota::QuotaConfig::default());
        assert_eq!(c.telemetry.otel_service_name, "fairlane-web");
    }

    #[test]
    fn flat_environment_names_set_everything() {
        let c = WebConfig::load_from(
            None,
            env(&[
                ("DATABASE_URL", "postgres://db/x"),
                ("HTTP_ADDR", "127.0.0.1:9000"),
                ("ADMIN_TOKEN", "0123456789abcdef"),
                ("REDIS_URL", "redis://127.0.0.1:6379"),
                ("RATELIMIT_RULES", "/etc/rules.yaml"),
                ("ANALYZER_ALLOW_FILE_URLS", "true"),
                ("ANALYZER_ALLOW_PRIVATE_HOSTS", "true"),
                ("HTTP_REQUEST_TIMEOUT", "5s"),
                ("QUOTA_ANALYSIS_ENTERPRISE_LIMIT", "7"),
                ("QUOTA_RESERVATION_TTL", "2h"),
                ("RUST_LOG", "debug"),
            ]),
        )
        .unwrap();
        assert_eq!(c.database_url, "postgres://db/x");
        assert_eq!(c.http_addr, "127.0.0.1:9000");
        assert_eq!(c.admin_token.as_deref(), Some("0123456789abcdef"));
        assert_eq!(c.redis_url.as_deref(), Some("redis://127.0.0.1:6379"));
        assert_eq!(c.ratelimit_rules, "/etc/rules.yaml");
        assert!(c.analyzer_allow_file_urls);
        assert!(c.analyzer_allow_private_hosts);
        assert_eq!(c.http_request_timeout, Duration::from_secs(5));
        assert_eq!(c.quota.quota_analysis_enterprise_limit, 7);
        assert_eq!(c.quota.quota_reservation_ttl, Duration::from_secs(7200));
        assert_eq!(c.telemetry.rust_log, "debug");
        c.validate().unwrap();
    }

    #[test]
    fn a_short_admin_token_is_refused_and_an_empty_one_turns_the_admin_api_off() {
        let c = WebConfig::load_from(None, env(&[("ADMIN_TOKEN", "0123456789abcde")])).unwrap();
        let e = c.validate().unwrap_err();
        assert!(
            e.starts_with("ADMIN_TOKEN must be at least 16 characters (it has 15)"),
            "{e}"
        );
        let c = WebConfig::load_from(None, env(&[("ADMIN_TOKEN", "")])).unwrap();
        assert_eq!(c.admin_token, None);
        c.validate().unwrap();
        let c = WebConfig::load_from(None, env(&[("ADMIN_TOKEN", "0123456789abcdef")])).unwrap();
        c.validate().unwrap();
        WebConfig::default().validate().unwrap();
    }
}
