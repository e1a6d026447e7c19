//! What a rate limit is: the algorithm, the unit of time, the rate and the burst capacity.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

/// Microseconds in one second; every time in this crate is an integer count of microseconds.
pub const MICROS_PER_SECOND: u64 = 1_000_000;

/// The unit a `requests_per_unit` rate is expressed in (Envoy's `unit`).
///
/// Read in any case: Envoy's ratelimit service upper-cases the configured unit, so its files
/// may say `MINUTE` or `Minute` as well as `minute`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
}

impl Unit {
    /// Every unit, shortest first.
    pub const ALL: [Unit; 4] = [Unit::Second, Unit::Minute, Unit::Hour, Unit::Day];

    /// The unit named `name` (`second`, `minute`, `hour` or `day`), in any case.
    pub fn from_name(name: &str) -> Option<Unit> {
        Unit::ALL
            .into_iter()
            .find(|unit| unit.as_str().eq_ignore_ascii_case(name))
    }

    /// Length of the unit in whole seconds.
    pub const fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
        }
    }

    /// Length of the unit in microseconds (the window length `W` of the window algorithms).
    pub const fn micros(self) -> u64 {
        self.seconds() * MICROS_PER_SECOND
    }

    /// Length of the unit as a [`Duration`].
    pub const fn duration(self) -> Duration {
        Duration::from_secs(self.seconds())
    }

    /// The configuration name (`second`, `minute`, `hour`, `day`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
        }
    }
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Unit {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct UnitVisitor;
        impl serde::de::Visitor<'_> for UnitVisitor {
            type Value = Unit;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a unit: `second`, `minute`, `hour` or `day` (in any case)")
            }
            fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<Unit, E> {
                Unit::from_name(name).ok_or_else(|| {
                    E::custom(format_args!(
                        "unknown unit `{name}`, expected one of `second`, `minute`, `hour`, \
                         `day` (in any case)"
                    ))
                })
            }
        }
        deserializer.deserialize_str(UnitVisitor)
    }
}

/// Which algorithm enforces a limit (Fairlane's extension of the Envoy format).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Counter per aligned window; what Envoy's ratelimit service does, so the default.
    #[default]
    FixedWindow,
    /// Log of allowed request times; exact: never more than N in any window of length W.
    SlidingLog,
    /// Current and previous window counters, previous weighted by its overlap; approximate.
    SlidingWindow,
    /// Bucket of `burst` tokens refilled continuously at N per unit.
    TokenBucket,
    /// Meter (GCRA) whose level drains at N per unit, capacity `burst`.
    LeakyBucket,
}

impl Algorithm {
    /// Every algorithm.
    pub const ALL: [Algorithm; 5] = [
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingWindow,
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket,
    ];

    /// The configuration name (`fixed_window`, …).
    pub const fn as_str(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::LeakyBucket => "leaky_bucket",
        }
    }

    /// Short tag used in counter keys so that state of different algorithms never collides.
    pub const fn key_tag(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fw",
            Algorithm::SlidingLog => "sl",
            Algorithm::SlidingWindow => "sw",
            Algorithm::TokenBucket => "tb",
            Algorithm::LeakyBucket => "lb",
        }
    }

    /// Whether `burst` means something for this algorithm (the two buckets).
    pub const fn has_burst(self) -> bool {
        matches!(self, Algorithm::TokenBucket | Algorithm::LeakyBucket)
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A fully resolved limit: `requests_per_unit` per `unit`, enforced by `algorithm`, with `burst`
/// capacity for the buckets (equal to `requests_per_unit` for the window algorithms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Policy {
    pub algorithm: Algorithm,
    pub unit: Unit,
    pub requests_per_unit: u64,
    pub burst: u64,
}

impl Policy {
    /// A policy with the default burst (`requests_per_unit`).
    pub const fn new(algorithm: Algorithm, unit: Unit, requests_per_unit: u64) -> Self {
        Policy {
            algorithm,
            unit,
            requests_per_unit,
            burst: requests_per_unit,
        }
    }

    /// Zero requests per `unit`: what a blocked rule (`requests_per_unit: 0`) enforces, so that
    /// its denials describe their limit like any other (a fixed window that admits nothing).
    pub const fn blocked(unit: Unit) -> Self {
        Policy::new(Algorithm::FixedWindow, unit, 0)
    }

    /// The same policy with another burst capacity (meaningful for the buckets only).
    pub const fn with_burst(mut self, burst: u64) -> Self {
        self.burst = burst;
        self
    }

    /// The window length `W` in microseconds.
    pub const fn window_micros(&self) -> u64 {
        self.unit.micros()
    }

    /// How many requests can pass at once from a fresh state: `burst` for the buckets, N otherwise.
    pub const fn capacity(&self) -> u64 {
        if self.algorithm.has_burst() {
            self.burst
        } else {
            self.requests_per_unit
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_are_named_in_any_case() {
        for unit in Unit::ALL {
            assert_eq!(Unit::from_name(unit.as_str()), Some(unit));
            assert_eq!(Unit::from_name(&unit.as_str().to_uppercase()), Some(unit));
        }
        assert_eq!(Unit::from_name("Minute"), Some(Unit::Minute));
        assert_eq!(Unit::from_name("week"), None);
        assert_eq!(Unit::from_name("minutes"), None);
        assert_eq!(Unit::from_name(""), None);
    }
}
