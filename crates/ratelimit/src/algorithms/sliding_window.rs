//! Sliding window counter: the current aligned window's count plus the previous window's count
//! weighted by how much of it the sliding window still overlaps.
//!
//! At time `t`, `e` µs into the current window: `estimate = prev * (W - e) / W + cur`, and the
//! request passes if `estimate + 1 <= N`. The arithmetic is done in integers scaled by `W`
//! (`prev * (W - e) + (cur + 1) * W <= N * W`), so there is no rounding.
//!
//! Error bound (see docs/ratelimit.md): the real number allowed in any window `(t - W, t]` is at
//! most `N + prev * e / W` where `prev` is what the previous aligned window allowed; hence
//! always below `2N`, and exactly at most N per aligned window. It reaches `2N` only in the
//! pathological case of a full previous window whose requests all came at its very end.

use super::Verdict;

/// Counters of the current and previous aligned windows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlidingWindowState {
    /// Index of the current window (`now / W`).
    pub window: u64,
    /// Requests allowed in the current window.
    pub current: u64,
    /// Requests allowed in the window before it.
    pub previous: u64,
}

/// Allow if the weighted estimate plus this request stays within `n` per `w`.
///
/// A clock that stepped back into an older window stays in the stored one, at its start (the
/// latest time the state is known to be at or after, and the most conservative weighting of
/// the previous window); `reset_us` and `retry_after_us` are still measured from `now`, so
/// they include the step.
pub fn decide(n: u64, w: u64, state: &mut SlidingWindowState, now: u64) -> Verdict {
    let window = (now / w).max(state.window);
    if window != state.window {
        state.previous = if window == state.window + 1 {
            state.current
        } else {
            0
        };
        state.current = 0;
        state.window = window;
    }
    let window_start = window * w;
    let at = now.max(window_start);
    let elapsed = at - window_start;
    let prev = u128::from(state.previous);
    let scaled_weighted_prev = prev * u128::from(w - elapsed);
    let cur = u128::from(state.current);
    let (n128, w128) = (u128::from(n), u128::from(w));
    let allowed = scaled_weighted_prev + (cur + 1) * w128 <= n128 * w128;
    if allowed {
        state.current += 1;
    }
    let cur = u128::from(state.current);
    let used = scaled_weighted_prev + cur * w128;
    let remaining = u64::try_from((n128 * w128).saturating_sub(used) / w128).unwrap_or(0);
    let reset_us = if state.current > 0 {
        window_start + 2 * w - now
    } else if state.previous > 0 {
        window_start + w - now
    } else {
        0
    };
    let retry_after_us = if allowed {
        0
    } else {
        (at - now) + retry_after(n, w, state, elapsed)
    };
    Verdict {
        allowed,
        remaining,
        reset_us,
        retry_after_us,
    }
}

/// Earliest µs offset from now at which `prev' * (W - e') + (cur' + 1) * W <= N * W` holds.
fn retry_after(n: u64, w: u64, state: &SlidingWindowState, elapsed: u64) -> u64 {
    let (w128, cur, prev) = (
        u128::from(w),
        u128::from(state.current),
        u128::from(state.previous),
    );
    let n128 = u128::from(n);
    if cur < n128 && prev > 0 {
        // Still within this window: need prev * (W - e') <= (N - 1 - cur) * W, i.e.
        // e' >= W - floor((N - 1 - cur) * W / prev).
        let spare = (n128 - 1 - cur) * w128;
        let e_needed = w128 - (spare / prev).min(w128);
        let e_needed = u64::try_from(e_needed).unwrap_or(w);
        return e_needed.saturating_sub(elapsed).max(1);
    }
    // The current window is full by itself: wait for the next one, where this window's count
    // becomes `prev` and must have decayed enough: cur * (W - e') <= (N - 1) * W.
    let to_next = w - elapsed;
    let spare = (n128 - 1) * w128;
    let e_needed = w128 - (spare / cur.max(1)).min(w128);
    to_next + u64::try_from(e_needed).unwrap_or(w)
}
