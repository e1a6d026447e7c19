//! The five rate-limiting algorithms as pure functions of (policy, state, now).
//!
//! Every algorithm takes the time explicitly (microseconds since the Unix epoch) and returns a
//! [`Verdict`]. The Redis Lua scripts in `backend/lua/` implement the same arithmetic; the two
//! are tested against the same definitions.
//!
//! `retry_after_us` of a denial is the exact earliest time (on the microsecond grid) at which the
//! same request could be allowed if nothing else happened: never later than necessary, so it is
//! safe for a local deny cache (other traffic can only push the real time later).

pub mod fixed_window;
pub mod leaky_bucket;
pub mod sliding_log;
pub mod sliding_window;
pub mod token_bucket;

pub use fixed_window::FixedWindowState;
pub use leaky_bucket::LeakyBucketState;
pub use sliding_log::SlidingLogState;
pub use sliding_window::SlidingWindowState;
pub use token_bucket::TokenBucketState;

use crate::policy::{Algorithm, Policy};

/// The outcome of one decision by an algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Whether the request may pass (it has been counted if so).
    pub allowed: bool,
    /// How many more requests would pass right now.
    pub remaining: u64,
    /// Microseconds until the state is fully reset (window over, bucket full/empty, log empty).
    pub reset_us: u64,
    /// When denied: microseconds until the earliest moment a retry could pass. 0 when allowed.
    pub retry_after_us: u64,
}

/// The per-key state of whichever algorithm a policy uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CounterState {
    FixedWindow(FixedWindowState),
    SlidingLog(SlidingLogState),
    SlidingWindow(SlidingWindowState),
    TokenBucket(TokenBucketState),
    LeakyBucket(LeakyBucketState),
}

impl CounterState {
    /// The state of a key never seen before.
    pub fn fresh(algorithm: Algorithm) -> Self {
        match algorithm {
            Algorithm::FixedWindow => CounterState::FixedWindow(FixedWindowState::default()),
            Algorithm::SlidingLog => CounterState::SlidingLog(SlidingLogState::default()),
            Algorithm::SlidingWindow => CounterState::SlidingWindow(SlidingWindowState::default()),
            Algorithm::TokenBucket => CounterState::TokenBucket(TokenBucketState::default()),
            Algorithm::LeakyBucket => CounterState::LeakyBucket(LeakyBucketState::default()),
        }
    }

    /// The algorithm this state belongs to.
    pub fn algorithm(&self) -> Algorithm {
        match self {
            CounterState::FixedWindow(_) => Algorithm::FixedWindow,
            CounterState::SlidingLog(_) => Algorithm::SlidingLog,
            CounterState::SlidingWindow(_) => Algorithm::SlidingWindow,
            CounterState::TokenBucket(_) => Algorithm::TokenBucket,
            CounterState::LeakyBucket(_) => Algorithm::LeakyBucket,
        }
    }
}

/// Decide one request under `policy` at `now_us`, updating `state`.
///
/// A state of another algorithm (the rules changed) is replaced by a fresh one first.
pub fn decide(policy: &Policy, state: &mut CounterState, now_us: u64) -> Verdict {
    if state.algorithm() != policy.algorithm {
        *state = CounterState::fresh(policy.algorithm);
    }
    let n = policy.requests_per_unit;
    let w = policy.window_micros();
    if n == 0 || policy.capacity() == 0 {
        // Nothing ever passes; check again after one unit.
        return Verdict {
            allowed: false,
            remaining: 0,
            reset_us: w,
            retry_after_us: w,
        };
    }
    match state {
        CounterState::FixedWindow(s) => fixed_window::decide(n, w, s, now_us),
        CounterState::SlidingLog(s) => sliding_log::decide(n, w, s, now_us),
        CounterState::SlidingWindow(s) => sliding_window::decide(n, w, s, now_us),
        CounterState::TokenBucket(s) => token_bucket::decide(n, w, policy.burst, s, now_us),
        CounterState::LeakyBucket(s) => leaky_bucket::decide(n, w, policy.burst, s, now_us),
    }
}

/// `ceil(a / b)` for `b > 0`.
pub(crate) const fn div_ceil(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}
