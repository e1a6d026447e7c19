//! The web service's settings: flat fields named after their environment variables
//! (`HTTP_ADDR` sets `http_addr`), with the quota and telemetry settings embedded, loaded by
//! `common::config::load` (defaults < `--config` file < environment).

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::postgres::PgConnectOptions;

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
    /// The ports a repository URL may name (`443, 8443`); the analyzer reads the same variable.
    pub analyzer_allowed_ports: String,
    /// Longest time one request may take before it is answered with 503 and rolled back.
    #[serde(with = "humantime_serde")]
    pub http_request_timeout: Duration,
    /// Longest a statement of the API waits for a row lock (a user's row held by a stuck
    /// session elsewhere) before the request is answered 503 `database_busy`, nothing changed.
    /// At or above `HTTP_REQUEST_TIMEOUT`, the request's own timeout answers first (503
    /// `timeout`, rolled back).
    #[serde(with = "humantime_serde")]
    pub database_lock_timeout: Duration,
    /// Largest request body accepted, in bytes.
    pub http_body_limit: usize,
    /// Memory, in bytes, that reads of large stored results (inventories, specviews) share at
    /// once: each waits for its peak (about three times its text) and holds it until its answer
    /// is sent; one larger than this runs alone. See [`crate::large_reads`].
    pub http_large_read_memory: u64,
    /// A request's headers must arrive within this, counted from when the connection is ready
    /// for them (an idle keep-alive connection is closed after it too, so it is longer than the
    /// usual proxies' idle timeout of 60 s: a proxy must never reuse a connection web is closing).
    #[serde(with = "humantime_serde")]
    pub http_header_read_timeout: Duration,
    /// Connections open at once; further ones wait in the listen backlog.
    pub http_max_connections: usize,
    /// Proxies whose `X-Forwarded-For` names the client (comma-separated addresses and ranges,
    /// `10.0.0.0/8, fd00::/8`); empty: the TCP peer is the client. See
    /// [`crate::client_addr::TrustedProxies::client`].
    pub http_trusted_proxies: String,
    /// Cap on resolving a branch or tag to a commit (`git ls-remote`), DNS included.
    #[serde(with = "humantime_serde")]
    pub resolve_timeout: Duration,
    /// Most `git ls-remote` processes at once (requests naming a branch or tag); more wait.
    pub resolve_concurrency: usize,
    /// Most of them for one user at once; that user's further requests wait for their own, so
    /// one user's slow repositories cannot hold every slot (a host that stalls each resolve
    /// until `RESOLVE_TIMEOUT`). At most `RESOLVE_CONCURRENCY` in effect.
    pub resolve_concurrency_per_user: usize,
    /// Most `POST` requests enqueued together in one transaction (docs/web.md, ADR 0007).
    pub enqueue_batch_max: usize,
    /// Enqueue transactions running at once, each for its own share of the users (each with a
    /// connection of its own on the batch thread, outside `database_max_connections`).
    pub enqueue_batch_concurrency: usize,
    /// `web migrate`: the longest a statement of a migration waits for a lock, and the first
    /// pause before the next attempt (each further pause doubles, up to a minute). A migration
    /// waiting for a table holds up every later statement on it (job fetches, completions,
    /// enqueues), so it gives up and tries again rather than wait behind a long transaction.
    #[serde(with = "humantime_serde")]
    pub migration_lock_timeout: Duration,
    /// `web migrate`: how long it goes on trying a migration that cannot take its locks before
    /// it fails (exit 1, that migration not applied).
    #[serde(with = "humantime_serde")]
    pub migration_give_up_after: Duration,
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
            analyzer_allowed_ports: inventory::url_policy::HTTPS_DEFAULT_PORT.to_string(),
            http_request_timeout: Duration::from_secs(30),
            database_lock_timeout: Duration::from_secs(5),
            http_body_limit: 16 * 1024,
            http_large_read_memory: 192 * 1024 * 1024,
            http_header_read_timeout: Duration::from_secs(75),
            http_max_connections: 4096,
            http_trusted_proxies: String::new(),
            resolve_timeout: Duration::from_secs(10),
            resolve_concurrency: 8,
            resolve_concurrency_per_user: 2,
            enqueue_batch_max: 64,
            enqueue_batch_concurrency: 1,
            migration_lock_timeout: Duration::from_secs(5),
            migration_give_up_after: Duration::from_secs(600),
            quota: quota::QuotaConfig::default(),
            telemetry: web_telemetry(),
        }
    }
}

/// The shortest `ADMIN_TOKEN` accepted: wrong tokens are rate limited per address only (an
/// attacker with many addresses has many budgets), so the token must be too long to guess.
pub const ADMIN_TOKEN_MIN_CHARS: usize = 16;

/// The largest `ENQUEUE_BATCH_MAX` accepted.
pub const MAX_ENQUEUE_BATCH: usize = 10_000;

/// The largest `ENQUEUE_BATCH_CONCURRENCY` accepted: each collector holds a database connection
/// of its own, outside `DATABASE_MAX_CONNECTIONS`.
pub const MAX_ENQUEUE_BATCH_CONCURRENCY: usize = 64;

/// The largest `HTTP_MAX_CONNECTIONS` accepted (a permit of a semaphore each).
pub const MAX_HTTP_CONNECTIONS: usize = 1_000_000;

/// The largest `RESOLVE_CONCURRENCY` accepted: each is a git process of up to 256 MiB.
pub const MAX_RESOLVE_CONCURRENCY: usize = 256;

impl WebConfig {
    /// How the accept loop bounds its clients.
    pub fn connection_limits(&self) -> crate::serve::ConnectionLimits {
        crate::serve::ConnectionLimits {
            header_read_timeout: self.http_header_read_timeout,
            max_connections: self.http_max_connections,
            // A request in progress at shutdown ends within its own timeout, and is answered
            // within the margin.
            drain_timeout: self
                .http_request_timeout
                .saturating_add(crate::DRAIN_ANSWER_MARGIN),
        }
    }

    /// Checks what loading cannot, naming the variable: an `ADMIN_TOKEN`, when set, is at least
    /// [`ADMIN_TOKEN_MIN_CHARS`] characters (an empty one is unset: the admin API is off); no
    /// count or timeout is zero; `RATELIMIT_DEADLINE` is shorter than `HTTP_REQUEST_TIMEOUT`;
    /// the batch sizes are within [`MAX_ENQUEUE_BATCH`] and [`MAX_ENQUEUE_BATCH_CONCURRENCY`];
    /// the quota and telemetry settings pass their own checks.
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
        // A bearer token travels as visible ASCII and is trimmed on arrival: a token with a
        // space, a line break (`--from-file` of `openssl rand -hex 32`'s output) or any other
        // character could never be presented, and every admin call would be 401.
        if let Some(token) = &self.admin_token
            && let Some(bad) = token.chars().find(|c| !c.is_ascii_graphic())
        {
            return Err(format!(
                "ADMIN_TOKEN may hold only visible ASCII characters (no spaces or line breaks); \
                 it holds {bad:?}"
            ));
        }
        self.check_connections()?;
        for (name, d) in [
            ("HTTP_REQUEST_TIMEOUT", self.http_request_timeout),
            ("HTTP_HEADER_READ_TIMEOUT", self.http_header_read_timeout),
            ("RATELIMIT_DEADLINE", self.ratelimit_deadline),
            ("RESOLVE_TIMEOUT", self.resolve_timeout),
            ("DATABASE_LOCK_TIMEOUT", self.database_lock_timeout),
        ] {
            if d.is_zero() {
                return Err(format!("{name} must be longer than zero"));
            }
        }
        if self.ratelimit_deadline >= self.http_request_timeout {
            return Err(format!(
                "RATELIMIT_DEADLINE ({:?}) must be shorter than HTTP_REQUEST_TIMEOUT ({:?})",
                self.ratelimit_deadline, self.http_request_timeout
            ));
        }
        self.trusted_proxies()?;
        self.url_policy()?;
        self.check_migration()?;
        if self.http_body_limit == 0 {
            return Err("HTTP_BODY_LIMIT must be at least 1 byte".to_owned());
        }
        if self.http_large_read_memory < 1024 * 1024 {
            return Err(format!(
                "HTTP_LARGE_READ_MEMORY must be at least 1048576 bytes (1 MiB), got {}",
                self.http_large_read_memory
            ));
        }
        for (name, n, max) in [
            (
                "ENQUEUE_BATCH_MAX",
                self.enqueue_batch_max,
                MAX_ENQUEUE_BATCH,
            ),
            (
                "ENQUEUE_BATCH_CONCURRENCY",
                self.enqueue_batch_concurrency,
                MAX_ENQUEUE_BATCH_CONCURRENCY,
            ),
            (
                "HTTP_MAX_CONNECTIONS",
                self.http_max_connections,
                MAX_HTTP_CONNECTIONS,
            ),
            (
                "RESOLVE_CONCURRENCY",
                self.resolve_concurrency,
                MAX_RESOLVE_CONCURRENCY,
            ),
            (
                "RESOLVE_CONCURRENCY_PER_USER",
                self.resolve_concurrency_per_user,
                MAX_RESOLVE_CONCURRENCY,
            ),
        ] {
            if !(1..=max).contains(&n) {
                return Err(format!("{name} must be between 1 and {max}, got {n}"));
            }
        }
        self.quota.validate().map_err(|e| e.0)?;
        self.telemetry.validate()
    }

    /// `HTTP_TRUSTED_PROXIES`, parsed; the error names the variable and the entry.
    pub fn trusted_proxies(&self) -> Result<crate::client_addr::TrustedProxies, String> {
        crate::client_addr::TrustedProxies::parse(&self.http_trusted_proxies)
            .map_err(|e| format!("HTTP_TRUSTED_PROXIES: {e}"))
    }

    /// Checks the settings of `web migrate`, naming the variable: both durations are longer
    /// than zero, and a lock may be waited for at least once before giving up.
    pub fn check_migration(&self) -> Result<(), String> {
        for (name, d) in [
            ("MIGRATION_LOCK_TIMEOUT", self.migration_lock_timeout),
            ("MIGRATION_GIVE_UP_AFTER", self.migration_give_up_after),
        ] {
            if d.is_zero() {
                return Err(format!("{name} must be longer than zero"));
            }
        }
        if self.migration_give_up_after < self.migration_lock_timeout {
            return Err(format!(
                "MIGRATION_GIVE_UP_AFTER ({:?}) must be at least MIGRATION_LOCK_TIMEOUT ({:?})",
                self.migration_give_up_after, self.migration_lock_timeout
            ));
        }
        Ok(())
    }

    /// How `web migrate` waits for locks: lock waits of `MIGRATION_LOCK_TIMEOUT`, a first pause
    /// as long between attempts, for up to `MIGRATION_GIVE_UP_AFTER`.
    pub fn migration_patience(&self) -> schema::LockPatience {
        schema::LockPatience {
            lock_timeout: self.migration_lock_timeout,
            give_up_after: self.migration_give_up_after,
            pause: self.migration_lock_timeout,
        }
    }

    /// The repository URL policy: the `ANALYZER_*` URL settings, with DNS resolution bounded
    /// by `RESOLVE_TIMEOUT`; the error names the variable and the entry.
    pub fn url_policy(&self) -> Result<inventory::UrlPolicy, String> {
        let mut policy = inventory::UrlPolicy::from_settings(
            self.analyzer_allow_file_urls,
            self.analyzer_allow_private_hosts,
            &self.analyzer_allowed_ports,
        )?;
        policy.dns_timeout = self.resolve_timeout;
        Ok(policy)
    }

    /// Refuses a pool of no connections (sqlx panics on one), a `DATABASE_URL` that is not a
    /// PostgreSQL URL and an `HTTP_ADDR` that is not host:port; returns the URL's connect options.
    pub fn check_connections(&self) -> Result<PgConnectOptions, String> {
        if self.database_max_connections == 0 {
            return Err("DATABASE_MAX_CONNECTIONS must be at least 1, got 0".to_owned());
        }
        // Read here, before telemetry starts or anything connects, so a typo is one line on
        // stderr.
        let options = schema::database_url_options(&self.database_url)?;
        let port = self
            .http_addr
            .rsplit_once(':')
            .and_then(|(host, port)| (!host.is_empty()).then_some(port))
            .and_then(|port| port.parse::<u16>().ok());
        if port.is_none() {
            return Err(format!(
                "HTTP_ADDR must be host:port (e.g. 0.0.0.0:8080), got `{}`",
                self.http_addr.escape_debug()
            ));
        }
        Ok(options)
    }

    /// Loads defaults, then `file` (if given), then the environment (a variable that is not
    /// UTF-8 is left out, or refused by name when it is one of the settings).
    pub fn load(file: Option<&Path>) -> Result<WebConfig, Box<common::config::ConfigError>> {
        common::config::load(file).map_err(Box::new)
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
        assert_eq!(c.url_policy().map(|p| p.allowed_ports), Ok(vec![443]));
        assert_eq!(
            c.migration_patience(),
            schema::LockPatience {
                lock_timeout: Duration::from_secs(5),
                give_up_after: Duration::from_secs(600),
                pause: Duration::from_secs(5),
            }
        );
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
                ("ANALYZER_ALLOWED_PORTS", "443 8443"),
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
        assert_eq!(c.url_policy().map(|p| p.allowed_ports), Ok(vec![443, 8443]));
        assert_eq!(c.http_request_timeout, Duration::from_secs(5));
        assert_eq!(c.quota.quota_analysis_enterprise_limit, 7);
        assert_eq!(c.quota.quota_reservation_ttl, Duration::from_secs(7200));
        assert_eq!(c.telemetry.rust_log, "debug");
        c.validate().unwrap();
    }

    #[test]
    fn a_database_url_or_http_addr_that_cannot_be_used_is_refused_before_anything_starts() {
        let refused = |name: &str, value: &str| {
            WebConfig::load_from(None, env(&[(name, value)]))
                .unwrap()
                .validate()
                .unwrap_err()
        };
        for url in [
            "mysql://user:s3cret@db/x",
            "postgres://user:s3cret@db:notaport/x",
        ] {
            let e = refused("DATABASE_URL", url);
            assert!(
                e.starts_with("DATABASE_URL is not a PostgreSQL URL"),
                "{url}: {e}"
            );
            assert!(!e.contains("s3cret"), "the URL's password is repeated: {e}");
        }
        assert_eq!(
            refused("MIGRATION_LOCK_TIMEOUT", "0s"),
            "MIGRATION_LOCK_TIMEOUT must be longer than zero"
        );
        assert_eq!(
            refused("MIGRATION_GIVE_UP_AFTER", "1s"),
            "MIGRATION_GIVE_UP_AFTER (1s) must be at least MIGRATION_LOCK_TIMEOUT (5s)"
        );
        assert_eq!(
            refused("ANALYZER_ALLOWED_PORTS", "443,0"),
            "ANALYZER_ALLOWED_PORTS: `0` is not a port (a number from 1 to 65535)"
        );
        for addr in ["garbage", ":8080", "0.0.0.0:http", "0.0.0.0:70000"] {
            let e = refused("HTTP_ADDR", addr);
            assert!(e.starts_with("HTTP_ADDR must be host:port"), "{addr}: {e}");
        }
        for addr in ["127.0.0.1:0", "[::1]:8080", "localhost:8080"] {
            WebConfig::load_from(None, env(&[("HTTP_ADDR", addr)]))
                .unwrap()
                .validate()
                .unwrap();
        }
    }

    #[test]
    fn a_short_admin_token_is_refused_and_an_empty_one_turns_the_admin_api_off() {
        let c = WebConfig::load_from(None, env(&[("ADMIN_TOKEN", "0123456789abcde")])).unwrap();
        let e = c.validate().unwrap_err();
        assert!(
            e.starts_with("ADMIN_TOKEN must be at least 16 characters (it has 15)"),
            "{e}"
        );
        for unusable in [
            "0123456789abcdef\n",
            " 0123456789abcdef",
            "pässwort-lang-genug",
        ] {
            let c = WebConfig::load_from(None, env(&[("ADMIN_TOKEN", unusable)])).unwrap();
            let e = c.validate().unwrap_err();
            assert!(
                e.starts_with(
                    "ADMIN_TOKEN may hold only visible ASCII characters (no spaces or line \
                     breaks); it holds "
                ),
                "{unusable:?}: {e}"
            );
        }
        let c = WebConfig::load_from(None, env(&[("ADMIN_TOKEN", "")])).unwrap();
        assert_eq!(c.admin_token, None);
        c.validate().unwrap();
        // The same in a config file: an empty value is an unset one.
        let file = std::env::temp_dir().join(format!(
            "fairlane-web-empty-token-{}.toml",
            std::process::id()
        ));
        std::fs::write(&file, "admin_token = \"\"\n").unwrap();
        let c = WebConfig::load_from(Some(&file), Vec::new()).unwrap();
        std::fs::remove_file(&file).unwrap();
        assert_eq!(c.admin_token, None);
        c.validate().unwrap();
        let c = WebConfig::load_from(None, env(&[("ADMIN_TOKEN", "0123456789abcdef")])).unwrap();
        c.validate().unwrap();
        WebConfig::default().validate().unwrap();
    }

    fn refused(pairs: &[(&str, &str)]) -> String {
        WebConfig::load_from(None, env(pairs))
            .unwrap()
            .validate()
            .unwrap_err()
    }

    #[test]
    fn zeros_and_sizes_that_break_the_server_are_refused_by_name() {
        assert_eq!(
            refused(&[("DATABASE_MAX_CONNECTIONS", "0")]),
            "DATABASE_MAX_CONNECTIONS must be at least 1, got 0"
        );
        for name in [
            "HTTP_REQUEST_TIMEOUT",
            "HTTP_HEADER_READ_TIMEOUT",
            "RATELIMIT_DEADLINE",
            "RESOLVE_TIMEOUT",
        ] {
            assert_eq!(
                refused(&[(name, "0s")]),
                format!("{name} must be longer than zero")
            );
        }
        assert_eq!(
            refused(&[("HTTP_TRUSTED_PROXIES", "10.0.0.0/8, ingress")]),
            "HTTP_TRUSTED_PROXIES: `ingress` is not an IP address"
        );
        assert_eq!(
            refused(&[("HTTP_BODY_LIMIT", "0")]),
            "HTTP_BODY_LIMIT must be at least 1 byte"
        );
        assert_eq!(
            refused(&[("ENQUEUE_BATCH_MAX", "0")]),
            "ENQUEUE_BATCH_MAX must be between 1 and 10000, got 0"
        );
        assert_eq!(
            refused(&[("ENQUEUE_BATCH_MAX", "4611686018427387904")]),
            "ENQUEUE_BATCH_MAX must be between 1 and 10000, got 4611686018427387904"
        );
        assert_eq!(
            refused(&[("ENQUEUE_BATCH_CONCURRENCY", "0")]),
            "ENQUEUE_BATCH_CONCURRENCY must be between 1 and 64, got 0"
        );
        assert_eq!(
            refused(&[("ENQUEUE_BATCH_CONCURRENCY", "100000")]),
            "ENQUEUE_BATCH_CONCURRENCY must be between 1 and 64, got 100000"
        );
        assert_eq!(
            refused(&[("RESOLVE_CONCURRENCY", "0")]),
            "RESOLVE_CONCURRENCY must be between 1 and 256, got 0"
        );
        assert_eq!(
            refused(&[("RESOLVE_CONCURRENCY_PER_USER", "0")]),
            "RESOLVE_CONCURRENCY_PER_USER must be between 1 and 256, got 0"
        );
        assert_eq!(
            refused(&[("HTTP_MAX_CONNECTIONS", "0")]),
            "HTTP_MAX_CONNECTIONS must be between 1 and 1000000, got 0"
        );
        assert!(
            refused(&[("METRICS_EXPORT_INTERVAL", "0s")]).starts_with("METRICS_EXPORT_INTERVAL")
        );
        assert!(refused(&[("OTLP_EXPORT_TIMEOUT", "1000days")]).starts_with("OTLP_EXPORT_TIMEOUT"));
        assert!(refused(&[("QUOTA_ANALYSIS_COST", "0")]).contains("QUOTA_ANALYSIS_COST"));
        let fine = WebConfig::load_from(
            None,
            env(&[
                ("ENQUEUE_BATCH_MAX", "10000"),
                ("ENQUEUE_BATCH_CONCURRENCY", "64"),
                ("DATABASE_MAX_CONNECTIONS", "1"),
            ]),
        )
        .unwrap();
        fine.validate().unwrap();
    }

    #[test]
    fn the_rate_limit_deadline_must_end_before_the_request_does() {
        assert_eq!(
            refused(&[("RATELIMIT_DEADLINE", "30s")]),
            "RATELIMIT_DEADLINE (30s) must be shorter than HTTP_REQUEST_TIMEOUT (30s)"
        );
        assert_eq!(
            refused(&[("HTTP_REQUEST_TIMEOUT", "10ms")]),
            "RATELIMIT_DEADLINE (20ms) must be shorter than HTTP_REQUEST_TIMEOUT (10ms)"
        );
        WebConfig::load_from(
            None,
            env(&[("RATELIMIT_DEADLINE", "1s"), ("HTTP_REQUEST_TIMEOUT", "2s")]),
        )
        .unwrap()
        .validate()
        .unwrap();
    }
}
