//! Fairlane's rate limiter (SPEC §7): rules in the Envoy/Lyft ratelimit YAML format extended with
//! an algorithm per rule, five algorithms as pure logic, an in-memory and a Redis backend, and a
//! [`Limiter`] front with deadline, fail-open/fallback, circuit breaker, deny cache, shadow mode,
//! hot reload of the rules file and an OpenTelemetry decision counter.
//!
//! It knows nothing of HTTP: the web service turns a request into a [`RateLimitRequest`], calls
//! [`Limiter::check`], and turns the [`RateLimitOutcome`] into a response and headers.

pub mod algorithms;
pub mod backend;
mod circuit;
pub mod clock;
mod deny_cache;
pub mod limiter;
pub mod policy;
pub mod request;
pub mod rules;
mod yaml_locate;

pub use algorithms::{CounterState, Verdict};
pub use backend::{
    Backend, BackendDecision, BackendError, MemoryBackend, MemoryConfig, RedisBackend, RedisConfig,
};
pub use clock::{Clock, ManualClock, SystemClock};
pub use limiter::{
    Decision, DecisionKind, DecisionSource, FailureMode, LimitOutcome, Limiter, LimiterConfig,
    LimiterError, LimiterStats, RateLimitOutcome, ceil_seconds,
};
pub use policy::{Algorithm, Policy, Unit};
pub use request::{DescriptorKey, RateLimitRequest};
pub use rules::{MatchedRule, Rule, RuleLimit, RuleSet, RulesError};
