//! Token bucket: `burst` tokens of capacity, refilled continuously at N per unit; a request takes
//! one token.
//!
//! Tokens are kept scaled by `W` (one token = `W` units, refill = N units per µs) so refilling is
//! exact integer arithmetic.

use super::{Verdict, div_ceil};

/// Scaled token count and when it was last brought up to date.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenBucketState {
    /// Whether the bucket has been used (a fresh bucket is full).
    pub initialized: bool,
    /// Tokens × W.
    pub tokens_scaled: u64,
    /// Time (µs) `tokens_scaled` was computed at.
    pub updated_us: u64,
}

/// Refill, then take one token if there is one.
pub fn decide(n: u64, w: u64, burst: u64, state: &mut TokenBucketState, now: u64) -> Verdict {
    let capacity = burst.saturating_mul(w);
    if !state.initialized {
        state.initialized = true;
        state.tokens_scaled = capacity;
        state.updated_us = now;
    }
    // Time never goes backwards for one key (a wall clock may step back): decide at the stored
    // time. `reset_us` and `retry_after_us` are measured from `now`, so they include the step.
    let at = now.max(state.updated_us);
    let skew = at - now;
    let refill = (at - state.updated_us).saturating_mul(n);
    state.tokens_scaled = state.tokens_scaled.saturating_add(refill).min(capacity);
    state.updated_us = at;
    let allowed = state.tokens_scaled >= w;
    if allowed {
        state.tokens_scaled -= w;
    }
    let tokens = state.tokens_scaled;
    Verdict {
        allowed,
        remaining: tokens / w,
        reset_us: skew + div_ceil(capacity - tokens, n),
        retry_after_us: if allowed {
            0
        } else {
            skew + div_ceil(w - tokens, n)
        },
    }
}
