//! Retry delays: exponential in the attempt number, capped, with multiplicative jitter so that
//! jobs that failed together do not retry together.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How long a failed job waits before its next attempt.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RetryPolicy {
    /// Delay after the first failed attempt.
    #[serde(with = "humantime_serde")]
    pub base: Duration,
    /// Growth per attempt (2.0 doubles the delay each time).
    pub factor: f64,
    /// Upper bound on the delay before jitter.
    #[serde(with = "humantime_serde")]
    pub max: Duration,
    /// Jitter as a fraction: the delay is multiplied by a factor in `[1 - jitter, 1 + jitter)`.
    pub jitter: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            base: Duration::from_secs(1),
            factor: 2.0,
            max: Duration::from_secs(6 * 3600),
            jitter: 0.2,
        }
    }
}

impl RetryPolicy {
    /// The delay after `attempt` (1-based) failed, with `unit_random` in `[0, 1)` choosing the
    /// jitter. Pure, so the growth and bounds can be tested exactly.
    pub fn delay(&self, attempt: i16, unit_random: f64) -> Duration {
        let exponent = f64::from(attempt.max(1) - 1);
        let raw = self.base.as_secs_f64() * self.factor.max(1.0).powf(exponent);
        let capped = raw.min(self.max.as_secs_f64());
        let jitter = self.jitter.clamp(0.0, 1.0);
        let scale = 1.0 - jitter + 2.0 * jitter * unit_random.clamp(0.0, 1.0);
        Duration::from_secs_f64((capped * scale).max(0.0))
    }

    /// [`RetryPolicy::delay`] with a fresh random jitter.
    pub fn delay_for(&self, attempt: i16) -> Duration {
        self.delay(attempt, rand::random::<f64>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_per_attempt_even_with_worst_case_jitter() {
        let p = RetryPolicy::default();
        for attempt in 1..12 {
            let this_max = p.delay(attempt, 0.999_999);
            let next_min = p.delay(attempt + 1, 0.0);
            assert!(
                next_min > this_max,
                "attempt {attempt}: next min {next_min:?} <= this max {this_max:?}"
            );
        }
    }

    #[test]
    fn first_delay_is_base_within_jitter() {
        let p = RetryPolicy::default();
        assert_eq!(p.delay(1, 0.5), Duration::from_secs(1));
        assert_eq!(p.delay(1, 0.0), Duration::from_secs_f64(0.8));
        assert_eq!(p.delay(3, 0.5), Duration::from_secs(4));
    }

    #[test]
    fn capped_at_max() {
        let p = RetryPolicy {
            max: Duration::from_secs(60),
            jitter: 0.0,
            ..RetryPolicy::default()
        };
        assert_eq!(p.delay(25, 0.3), Duration::from_secs(60));
        assert_eq!(p.delay(i16::MAX, 0.3), Duration::from_secs(60));
    }

    #[test]
    fn degenerate_inputs_stay_sane() {
        let p = RetryPolicy {
            factor: 0.5,
            jitter: 7.0,
            ..RetryPolicy::default()
        };
        // factor < 1 is treated as 1 (no shrinking); jitter is clamped to [0, 1].
        assert_eq!(p.delay(5, 0.5), Duration::from_secs(1));
        assert_eq!(p.delay(0, 0.0), Duration::ZERO);
    }
}
