//! Sliding window log: the times of allowed requests; exact.
//!
//! A request at `t` passes if fewer than N allowed requests lie in `(t - W, t]`. That keeps every
//! window of length W (anywhere on the time line) at N or fewer. Unlike the seed's version only
//! allowed requests are logged: logging rejected ones too would keep a client that retries
//! aggressively locked out for ever, and costs memory proportional to the abuse.

use std::collections::VecDeque;

use super::Verdict;

/// Times (µs) of the allowed requests still inside the window, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlidingLogState {
    pub log: VecDeque<u64>,
}

/// Allow if fewer than `n` allowed requests happened in `(now - w, now]`.
pub fn decide(n: u64, w: u64, state: &mut SlidingLogState, now: u64) -> Verdict {
    // Time never goes backwards for one key (a wall clock may step back): decide at the newest
    // entry's time. `reset_us` and `retry_after_us` are measured from `now` (the step included).
    let at = state.log.back().map_or(now, |&last| now.max(last));
    while state.log.front().is_some_and(|&t| t + w <= at) {
        state.log.pop_front();
    }
    let count = state.log.len() as u64;
    let allowed = count < n;
    if allowed {
        state.log.push_back(at);
    }
    let count = state.log.len() as u64;
    let reset_us = state.log.back().map_or(0, |&last| last + w - now);
    let retry_after_us = if allowed {
        0
    } else {
        // The entry whose expiry brings the count below n: index count - n (count == n unless
        // the limit was lowered by a rules reload). n >= 1 here (see `algorithms::decide`).
        let index = usize::try_from(count - n).unwrap_or(usize::MAX);
        state.log.get(index).map_or(w, |&t| t + w - now)
    };
    Verdict {
        allowed,
        remaining: n.saturating_sub(count),
        reset_us,
        retry_after_us,
    }
}
