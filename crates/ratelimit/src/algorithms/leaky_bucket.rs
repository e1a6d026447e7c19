//! Leaky bucket as a meter (GCRA): each request pours one unit into a bucket of capacity
//! `burst` that leaks at N per unit; a request that would overflow it is refused.
//!
//! Not the seed's FIFO queue, which delays requests instead of answering them: an HTTP limiter
//! must answer now (429 or pass), so only the meter form fits. The meter makes the same decisions
//! as a token bucket with the same rate and capacity (level = capacity − tokens); it is offered
//! under its own name because operators think in both vocabularies. The level is kept scaled by
//! `W` (one request = `W` units, leak = N units per µs).

use super::{Verdict, div_ceil};

/// Scaled level and when it was last brought up to date.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeakyBucketState {
    /// Level × W (0 = empty; a fresh bucket is empty).
    pub level_scaled: u64,
    /// Time (µs) `level_scaled` was computed at.
    pub updated_us: u64,
}

/// Drain, then add one request if it fits.
pub fn decide(n: u64, w: u64, burst: u64, state: &mut LeakyBucketState, now: u64) -> Verdict {
    let capacity = burst.saturating_mul(w);
    // Time never goes backwards for one key (a wall clock may step back): decide at the stored
    // time. `reset_us` and `retry_after_us` are measured from `now`, so they include the step.
    let at = now.max(state.updated_us);
    let skew = at - now;
    let drained = (at - state.updated_us).saturating_mul(n);
    state.level_scaled = state.level_scaled.saturating_sub(drained);
    state.updated_us = at;
    let allowed = state.level_scaled + w <= capacity;
    if allowed {
        state.level_scaled += w;
    }
    let level = state.level_scaled;
    Verdict {
        allowed,
        // A rules reload that lowers the capacity can leave the level above it: nothing fits.
        remaining: capacity.saturating_sub(level) / w,
        reset_us: skew + div_ceil(level, n),
        retry_after_us: if allowed {
            0
        } else {
            skew + div_ceil(level + w - capacity, n)
        },
    }
}
