//! Circuit breaker for the remote backend: after repeated failures, stop calling it for a short
//! cool-down, then let one probe through; its success closes the circuit again.
//!
//! Without it a down Redis would cost every request the full deadline.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Whether a call to the backend may be made now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Circuit closed: call.
    Call,
    /// Cool-down over: this call is the probe.
    Probe,
    /// Circuit open (or a probe is in flight): do not call.
    Skip,
}

/// State transitions reported to the caller, for logging.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transition {
    None,
    Opened,
    Closed,
}

#[derive(Debug, Clone, Copy)]
enum State {
    Closed { failures: u32 },
    Open { until: Instant },
    HalfOpen { probe_started: Instant },
}

#[derive(Debug)]
pub(crate) struct CircuitBreaker {
    state: Mutex<State>,
    threshold: u32,
    cooldown: Duration,
}

impl CircuitBreaker {
    /// Opens after `threshold` consecutive failures, for `cooldown`.
    pub(crate) fn new(threshold: u32, cooldown: Duration) -> Self {
        CircuitBreaker {
            state: Mutex::new(State::Closed { failures: 0 }),
            threshold: threshold.max(1),
            cooldown,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn admit(&self) -> Admission {
        let mut state = self.lock();
        match *state {
            State::Closed { .. } => Admission::Call,
            State::Open { until } => {
                let now = Instant::now();
                if now < until {
                    Admission::Skip
                } else {
                    *state = State::HalfOpen { probe_started: now };
                    Admission::Probe
                }
            }
            State::HalfOpen { probe_started } => {
                // A probe that never reported back (its caller was cancelled) is replaced.
                let now = Instant::now();
                if now.duration_since(probe_started) >= self.cooldown {
                    *state = State::HalfOpen { probe_started: now };
                    Admission::Probe
                } else {
                    Admission::Skip
                }
            }
        }
    }

    pub(crate) fn record_success(&self) -> Transition {
        let mut state = self.lock();
        let was_closed = matches!(*state, State::Closed { .. });
        *state = State::Closed { failures: 0 };
        if was_closed {
            Transition::None
        } else {
            Transition::Closed
        }
    }

    pub(crate) fn record_failure(&self) -> Transition {
        let mut state = self.lock();
        match *state {
            State::Closed { failures } if failures + 1 < self.threshold => {
                *state = State::Closed {
                    failures: failures + 1,
                };
                Transition::None
            }
            State::Closed { .. } | State::HalfOpen { .. } => {
                *state = State::Open {
                    until: Instant::now() + self.cooldown,
                };
                Transition::Opened
            }
            State::Open { .. } => Transition::None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_then_probes_after_cooldown() {
        // A cooldown no pause of a loaded machine between two lines outlasts.
        let breaker = CircuitBreaker::new(3, Duration::from_millis(500));
        assert_eq!(breaker.admit(), Admission::Call);
        assert_eq!(breaker.record_failure(), Transition::None);
        assert_eq!(breaker.record_failure(), Transition::None);
        assert_eq!(breaker.record_failure(), Transition::Opened);
        assert_eq!(breaker.admit(), Admission::Skip);
        std::thread::sleep(Duration::from_millis(550));
        assert_eq!(breaker.admit(), Admission::Probe);
        // Only one probe at a time.
        assert_eq!(breaker.admit(), Admission::Skip);
        assert_eq!(breaker.record_failure(), Transition::Opened);
        assert_eq!(breaker.admit(), Admission::Skip);
        std::thread::sleep(Duration::from_millis(550));
        assert_eq!(breaker.admit(), Admission::Probe);
        assert_eq!(breaker.record_success(), Transition::Closed);
        assert_eq!(breaker.admit(), Admission::Call);
    }

    #[test]
    fn a_success_resets_the_failure_count() {
        let breaker = CircuitBreaker::new(2, Duration::from_secs(60));
        breaker.record_failure();
        breaker.record_success();
        assert_eq!(breaker.record_failure(), Transition::None);
        assert_eq!(breaker.admit(), Admission::Call);
    }
}
