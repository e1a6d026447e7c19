//! Redis backend: each decision is one `EVALSHA` of an algorithm's Lua script, atomic on the
//! server and timed by the server's clock (`TIME`), so every web replica shares one clock and
//! one counter.
//!
//! Keys are `<prefix>{<domain>|key=value|…}:<algorithm>:<unit>`: the braces are a Redis Cluster
//! hash tag, so any script touching several keys of one counter stays in one slot. Every
//! script sets a TTL equal to the time until the state is fresh again, so idle keys vanish.
//!
//! One multiplexed connection is shared by all callers. When it breaks it is dropped, and the
//! next call reconnects (the limiter's circuit breaker decides when that next call happens).

use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, Script};

use super::{Backend, BackendDecision, BackendError};
use crate::algorithms::Verdict;
use crate::policy::{Algorithm, Policy};

macro_rules! script {
    ($file:literal) => {
        concat!(include_str!("lua/prelude.lua"), include_str!($file))
    };
}

/// The script text of each algorithm (prelude + body), in [`Algorithm::ALL`] order.
pub const SCRIPTS: [&str; 5] = [
    script!("lua/fixed_window.lua"),
    script!("lua/sliding_log.lua"),
    script!("lua/sliding_window.lua"),
    script!("lua/token_bucket.lua"),
    script!("lua/leaky_bucket.lua"),
];

/// Where and how to reach Redis.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// `redis://host:port/db`.
    pub url: String,
    /// Prepended to every counter key; must not contain `{` or `}`. Tests use a unique prefix.
    pub key_prefix: String,
    /// Limit on establishing a connection (the limiter's deadline still bounds each decision).
    pub connect_timeout: Duration,
}

impl RedisConfig {
    /// Defaults for `url`: prefix `fairlane:rl:`, 1 s connect timeout.
    pub fn new(url: impl Into<String>) -> Self {
        RedisConfig {
            url: url.into(),
            key_prefix: "fairlane:rl:".to_owned(),
            connect_timeout: Duration::from_secs(1),
        }
    }

    /// The same config with another key prefix.
    pub fn with_key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }
}

/// Counters in Redis.
pub struct RedisBackend {
    client: Client,
    connection_config: AsyncConnectionConfig,
    prefix: String,
    connection: RwLock<Option<MultiplexedConnection>>,
    connecting: tokio::sync::Mutex<()>,
    scripts: [Script; 5],
    /// Unique request ids for sliding-log members: random per instance, then a counter.
    instance_id: u64,
    sequence: AtomicU64,
}

impl RedisBackend {
    /// A backend for `config`. Does not connect yet (so a web replica starts even while Redis
    /// is down); the first decision does.
    pub fn new(config: &RedisConfig) -> Result<Self, BackendError> {
        if config.key_prefix.contains(['{', '}']) {
            return Err(BackendError::Config(format!(
                "key prefix `{}` must not contain `{{` or `}}` (they delimit the hash tag)",
                config.key_prefix
            )));
        }
        let client = Client::open(config.url.as_str())?;
        Ok(RedisBackend {
            client,
            connection_config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(config.connect_timeout))
                // The limiter bounds every call with its own deadline.
                .set_response_timeout(None),
            prefix: config.key_prefix.clone(),
            connection: RwLock::new(None),
            connecting: tokio::sync::Mutex::new(()),
            scripts: SCRIPTS.map(Script::new),
            instance_id: rand::random(),
            sequence: AtomicU64::new(0),
        })
    }

    /// A backend that has already connected once (fails if Redis is unreachable).
    pub async fn connect(config: &RedisConfig) -> Result<Self, BackendError> {
        let backend = Self::new(config)?;
        backend.connection().await?;
        Ok(backend)
    }

    /// The Redis key of a counter.
    pub fn redis_key(&self, counter_key: &str) -> String {
        let mut key = String::with_capacity(self.prefix.len() + counter_key.len());
        key.push_str(&self.prefix);
        key.push_str(counter_key);
        key
    }

    async fn connection(&self) -> Result<MultiplexedConnection, BackendError> {
        if let Some(connection) = self.cached_connection() {
            return Ok(connection);
        }
        let _single_flight = self.connecting.lock().await;
        if let Some(connection) = self.cached_connection() {
            return Ok(connection);
        }
        let connection = self
            .client
            .get_multiplexed_async_connection_with_config(&self.connection_config)
            .await?;
        *self
            .connection
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(connection.clone());
        tracing::info!("rate limiter connected to redis");
        Ok(connection)
    }

    fn cached_connection(&self) -> Option<MultiplexedConnection> {
        self.connection
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn drop_connection(&self) {
        *self
            .connection
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }

    fn script(&self, algorithm: Algorithm) -> &Script {
        let index = Algorithm::ALL
            .iter()
            .position(|a| *a == algorithm)
            .unwrap_or(0);
        &self.scripts[index]
    }
}

#[async_trait]
impl Backend for RedisBackend {
    async fn decide(
        &self,
        counter_key: &str,
        policy: &Policy,
    ) -> Result<BackendDecision, BackendError> {
        let mut connection = self.connection().await?;
        let key = self.redis_key(counter_key);
        // Only the sliding log stores members; the other scripts ignore ARGV[4].
        let request_id = if policy.algorithm == Algorithm::SlidingLog {
            format!(
                "{:016x}-{}",
                self.instance_id,
                self.sequence.fetch_add(1, Ordering::Relaxed)
            )
        } else {
            String::new()
        };
        let reply: Result<Vec<i64>, _> = self
            .script(policy.algorithm)
            .key(&key)
            .arg(policy.requests_per_unit)
            .arg(policy.unit.seconds())
            .arg(policy.burst)
            .arg(request_id)
            .invoke_async(&mut connection)
            .await;
        let reply = match reply {
            Ok(reply) => reply,
            Err(err) => {
                if err.is_io_error()
                    || err.is_connection_dropped()
                    || err.is_unrecoverable_error()
                    || err.is_timeout()
                {
                    self.drop_connection();
                }
                return Err(err.into());
            }
        };
        let [allowed, remaining, reset_us, retry_after_us, now_us] = reply[..] else {
            return Err(BackendError::BadReply(format!("{reply:?}")));
        };
        let non_negative = |v: i64| u64::try_from(v).unwrap_or(0);
        Ok(BackendDecision {
            verdict: Verdict {
                allowed: allowed == 1,
                remaining: non_negative(remaining),
                reset_us: non_negative(reset_us),
                retry_after_us: non_negative(retry_after_us),
            },
            clock_us: non_negative(now_us),
        })
    }

    fn name(&self) -> &'static str {
        "redis"
    }

    fn reset_connection(&self) {
        self.drop_connection();
    }
}
