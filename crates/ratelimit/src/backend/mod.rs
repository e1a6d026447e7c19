//! Where counter state lives: a small async trait with an in-memory and a Redis implementation.

pub mod memory;
pub mod redis;

use async_trait::async_trait;

use crate::algorithms::Verdict;
use crate::policy::Policy;

pub use self::memory::{MemoryBackend, MemoryConfig};
pub use self::redis::{RedisBackend, RedisConfig};

/// A decision made by a backend, with the clock reading it was made at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendDecision {
    pub verdict: Verdict,
    /// The backend's "now" (µs since the Unix epoch) used for the decision: the Redis server's
    /// `TIME` for Redis, the injected clock for memory.
    pub clock_us: u64,
}

/// A backend could not decide.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("redis: {0}")]
    Redis(#[from] ::redis::RedisError),
    #[error("could not connect to redis: {0}")]
    Connect(String),
    #[error("redis script returned an unexpected reply: {0}")]
    BadReply(String),
    #[error("invalid backend configuration: {0}")]
    Config(String),
}

/// Decides one request against one counter, atomically.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// Count one request against `counter_key` under `policy` and return the verdict.
    async fn decide(
        &self,
        counter_key: &str,
        policy: &Policy,
    ) -> Result<BackendDecision, BackendError>;

    /// A short name for logs and metrics (`memory`, `redis`).
    fn name(&self) -> &'static str;

    /// Whether the backend lives in this process and never fails or blocks; the limiter then
    /// skips the deadline, circuit breaker and deny cache.
    fn is_local(&self) -> bool {
        false
    }

    /// [`Backend::decide`] without a future, for a local backend that can answer at once
    /// (saves the boxed future on every decision); `None` where the answer must be awaited.
    fn decide_in_process(&self, counter_key: &str, policy: &Policy) -> Option<BackendDecision> {
        let _ = (counter_key, policy);
        None
    }
}
