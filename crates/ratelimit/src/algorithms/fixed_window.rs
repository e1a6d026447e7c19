//! Fixed window counter: one counter per window aligned to the epoch, reset at each boundary.
//!
//! Cheap and what Envoy does, but a client can pass up to 2N within a short span around a
//! boundary (N at the end of one window, N at the start of the next).

use super::Verdict;

/// Which window the counter belongs to and how many requests it has allowed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FixedWindowState {
    /// Index of the window (`now / W`).
    pub window: u64,
    /// Requests allowed in that window.
    pub count: u64,
}

/// Allow if fewer than `n` requests passed in the current aligned window of length `w`.
///
/// A clock that stepped back into an older window stays in the stored one (its count is kept),
/// as the other algorithms never let a key's time go backwards; `reset_us` and `retry_after_us`
/// are still measured from `now`, so they include the step.
pub fn decide(n: u64, w: u64, state: &mut FixedWindowState, now: u64) -> Verdict {
    let window = (now / w).max(state.window);
    if state.window != window {
        state.window = window;
        state.count = 0;
    }
    let window_end = (window + 1) * w;
    let reset_us = window_end - now;
    let allowed = state.count < n;
    if allowed {
        state.count += 1;
    }
    Verdict {
        allowed,
        remaining: n.saturating_sub(state.count),
        reset_us,
        // The next window starts empty, and nothing earlier can pass.
        retry_after_us: if allowed { 0 } else { reset_us },
    }
}
