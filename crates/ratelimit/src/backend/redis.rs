//! Redis backend: each decision is one `EVALSHA` of an algorithm's Lua script, atomic on the
//! server and timed by the server's clock (`TIME`), so every web replica shares one clock and
//! one counter.
//!
//! Keys are `<prefix>{<domain>|key=value|…}:<algorithm>:<unit>`: the braces are a Redis Cluster
//! hash tag, so any script touching several keys of one counter stays in one slot. Every
//! script sets a TTL equal to the time until the state is fresh again, so idle keys vanish.
//!
//! One multiplexed connection is shared by all callers. It is opened by a task of its own, bounded
//! by [`RedisConfig::connect_timeout`] and not by any caller's deadline: callers wait for it
//! while they may, and one that gives up leaves it opening for the next. When a call on it fails,
//! or is given up mid-reply (the limiter's deadline), that connection is dropped, and a later call
//! opens another (the limiter's circuit breaker decides when that call happens). A failure drops
//! only the connection it happened on, never a newer one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::FutureExt;
use futures_util::future::{BoxFuture, Shared};
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

/// A connection being opened, awaited by every caller that needs one meanwhile.
type Opening = Shared<BoxFuture<'static, Result<(u64, MultiplexedConnection), String>>>;

/// The shared connection and its generation, or the opening of the next one.
#[derive(Default)]
struct ConnectionSlot {
    open: Option<(u64, MultiplexedConnection)>,
    opening: Option<Opening>,
    generation: u64,
}

/// Counters in Redis.
pub struct RedisBackend {
    client: Client,
    connection_config: AsyncConnectionConfig,
    prefix: String,
    slot: Arc<Mutex<ConnectionSlot>>,
    scripts: [Script; 5],
    /// Unique request ids for sliding-log members: random per instance, then a counter.
    instance_id: u64,
    sequence: AtomicU64,
}

fn lock(slot: &Mutex<ConnectionSlot>) -> std::sync::MutexGuard<'_, ConnectionSlot> {
    slot.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Drops the connection of `generation` if the call using it ends without being disarmed: the
/// caller gave up mid-reply, and a connection that hangs must not be reused for ever.
struct DropUnlessFinished<'a> {
    slot: &'a Mutex<ConnectionSlot>,
    generation: u64,
    finished: bool,
}

impl Drop for DropUnlessFinished<'_> {
    fn drop(&mut self) {
        if !self.finished {
            drop_connection(self.slot, self.generation);
        }
    }
}

/// Forgets the connection of `generation`, if it is still the shared one.
fn drop_connection(slot: &Mutex<ConnectionSlot>, generation: u64) {
    let mut slot = lock(slot);
    if slot.open.as_ref().is_some_and(|(g, _)| *g == generation) {
        slot.open = None;
    }
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
            slot: Arc::default(),
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

    /// The shared connection and its generation, waiting for it to open if need be.
    async fn connection(&self) -> Result<(u64, MultiplexedConnection), BackendError> {
        let opening = {
            let mut slot = lock(&self.slot);
            if let Some(open) = &slot.open {
                return Ok(open.clone());
            }
            slot.opening
                .get_or_insert_with(|| self.open_in_background())
                .clone()
        };
        opening.await.map_err(BackendError::Connect)
    }

    /// Opens a connection in a task of its own, which stores it as the shared one.
    fn open_in_background(&self) -> Opening {
        let client = self.client.clone();
        let config = self.connection_config.clone();
        let slot = Arc::clone(&self.slot);
        let task = tokio::spawn(async move {
            let opened = client
                .get_multiplexed_async_connection_with_config(&config)
                .await;
            let mut slot = lock(&slot);
            slot.opening = None;
            match opened {
                Ok(connection) => {
                    slot.generation += 1;
                    let open = (slot.generation, connection);
                    slot.open = Some(open.clone());
                    tracing::info!("rate limiter connected to redis");
                    Ok(open)
                }
                Err(e) => Err(e.to_string()),
            }
        });
        async move {
            task.await
                .map_err(|e| format!("the connecting task ended: {e}"))?
        }
        .boxed()
        .shared()
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
        let (generation, mut connection) = self.connection().await?;
        let mut in_flight = DropUnlessFinished {
            slot: &self.slot,
            generation,
            finished: false,
        };
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
        in_flight.finished = true;
        let reply = match reply {
            Ok(reply) => reply,
            Err(err) => {
                if err.is_io_error()
                    || err.is_connection_dropped()
                    || err.is_unrecoverable_error()
                    || err.is_timeout()
                    || wrong_server(&err)
                {
                    drop_connection(&self.slot, generation);
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
}

/// Whether `err` says the connection reaches a server that can no longer take the limiter's
/// writes: demoted to a replica (`READONLY`), or a replica cut off from its primary
/// (`MASTERDOWN`). A failover that does not close its clients' connections leaves them on the
/// old primary while `REDIS_URL` names the new one; only a new connection reaches it.
fn wrong_server(err: &redis::RedisError) -> bool {
    matches!(
        err.kind(),
        redis::ErrorKind::Server(
            redis::ServerErrorKind::ReadOnly | redis::ServerErrorKind::MasterDown
        )
    )
}
