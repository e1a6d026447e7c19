//! The quota check itself, as a pure function: `used + reserved + requested <= limit`, and the
//! [`Ledger`] that decides a sequence of requests against the same standings.

use std::collections::HashMap;
use std::hash::Hash;

/// What the database says about one user, event type and billing period.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standing {
    /// Units billed in the period (usage events).
    pub used: i64,
    /// Units held by live reservations.
    pub reserved: i64,
    /// Units allowed in the period.
    pub limit: i64,
}

/// The outcome of a check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// The request fits; `remaining` units are left after it.
    Allow { remaining: i64 },
    /// The request does not fit; only `available` units are left (possibly 0).
    Deny { available: i64 },
}

impl Decision {
    pub fn is_allowed(self) -> bool {
        matches!(self, Decision::Allow { .. })
    }
}

impl Standing {
    /// Units still available, never negative (a lowered limit can leave a user above it).
    pub fn available(&self) -> i64 {
        self.limit
            .saturating_sub(self.used)
            .saturating_sub(self.reserved)
            .max(0)
    }

    /// Whether `requested` more units fit. A request of zero or fewer units is refused: every
    /// request costs something, and a non-positive cost would be a configuration error.
    pub fn decide(&self, requested: i64) -> Decision {
        let total = self
            .used
            .checked_add(self.reserved)
            .and_then(|t| t.checked_add(requested));
        match total {
            Some(total) if requested > 0 && total <= self.limit => Decision::Allow {
                remaining: self.limit - total,
            },
            _ => Decision::Deny {
                available: self.available(),
            },
        }
    }
}

/// Standings that requests are decided against one after another, as if each had been reserved
/// before the next was checked: an allowed request adds to `reserved` for every later request of
/// the same key. This is how a batch decided under one lock stays exact.
#[derive(Debug, Clone)]
pub struct Ledger<K> {
    standings: HashMap<K, Standing>,
}

impl<K: Eq + Hash> Ledger<K> {
    pub fn new(standings: impl IntoIterator<Item = (K, Standing)>) -> Self {
        Ledger {
            standings: standings.into_iter().collect(),
        }
    }

    /// Decides `requested` units for `key`; returns the standing before the request and the
    /// decision, or `None` for a key the ledger does not hold. An allowed request is counted as
    /// reserved from then on.
    pub fn take(&mut self, key: &K, requested: i64) -> Option<(Standing, Decision)> {
        let standing = self.standings.get_mut(key)?;
        let before = *standing;
        let decision = before.decide(requested);
        if decision.is_allowed() {
            standing.reserved += requested;
        }
        Some((before, decision))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(used: i64, reserved: i64, limit: i64) -> Standing {
        Standing {
            used,
            reserved,
            limit,
        }
    }

    #[test]
    fn exactly_at_the_limit_is_allowed_one_more_is_not() {
        assert_eq!(s(4998, 1, 5000).decide(1), Decision::Allow { remaining: 0 });
        assert_eq!(s(4998, 2, 5000).decide(1), Decision::Deny { available: 0 });
        assert_eq!(s(4998, 0, 5000).decide(2), Decision::Allow { remaining: 0 });
        assert_eq!(s(4998, 0, 5000).decide(3), Decision::Deny { available: 2 });
    }

    #[test]
    fn reservations_count_like_usage() {
        assert!(s(0, 50, 50).decide(1) == Decision::Deny { available: 0 });
        assert!(s(25, 24, 50).decide(1).is_allowed());
    }

    #[test]
    fn over_the_limit_after_a_downgrade_reports_zero_available() {
        assert_eq!(s(900, 10, 50).decide(1), Decision::Deny { available: 0 });
    }

    #[test]
    fn non_positive_requests_and_overflow_are_refused() {
        assert!(!s(0, 0, 10).decide(0).is_allowed());
        assert!(!s(0, 0, 10).decide(-1).is_allowed());
        assert!(!s(i64::MAX, i64::MAX, i64::MAX).decide(1).is_allowed());
        assert!(!s(0, 0, 0).decide(1).is_allowed());
    }

    #[test]
    fn exhaustive_small_grid_matches_the_formula() {
        for used in 0..8 {
            for reserved in 0..8 {
                for requested in 1..4 {
                    for limit in 0..12 {
                        let d = s(used, reserved, limit).decide(requested);
                        assert_eq!(
                            d.is_allowed(),
                            used + reserved + requested <= limit,
                            "{used}+{reserved}+{requested} vs {limit}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_ledger_counts_earlier_grants_of_the_same_key_only() {
        let mut ledger = Ledger::new([("a", s(4998, 0, 5000)), ("b", s(0, 0, 1))]);
        assert_eq!(
            ledger.take(&"a", 1),
            Some((s(4998, 0, 5000), Decision::Allow { remaining: 1 }))
        );
        assert_eq!(ledger.take(&"b", 1).map(|t| t.1.is_allowed()), Some(true));
        assert_eq!(
            ledger.take(&"a", 1),
            Some((s(4998, 1, 5000), Decision::Allow { remaining: 0 }))
        );
        // Refusals reserve nothing: a later, smaller request could still fit, but none does here.
        assert_eq!(
            ledger.take(&"a", 1),
            Some((s(4998, 2, 5000), Decision::Deny { available: 0 }))
        );
        assert_eq!(ledger.take(&"b", 1).map(|t| t.1.is_allowed()), Some(false));
        assert_eq!(ledger.take(&"c", 1), None);
    }

    #[test]
    fn a_ledger_allows_exactly_what_one_by_one_checks_would() {
        // Any order of requests of mixed sizes: the ledger's total grant never exceeds the
        // limit, and equals what sequential check-then-reserve would grant.
        for limit in 0..20 {
            for used in 0..5 {
                let mut ledger = Ledger::new([((), s(used, 0, limit))]);
                let mut sequential = s(used, 0, limit);
                for requested in [1, 3, 2, 1, 5, 1, 1, 2, 4, 1, 1, 1] {
                    let (_, d) = ledger.take(&(), requested).unwrap();
                    let expected = sequential.decide(requested);
                    assert_eq!(d, expected);
                    if expected.is_allowed() {
                        sequential.reserved += requested;
                    }
                }
                assert!(sequential.used + sequential.reserved <= limit.max(used));
            }
        }
    }
}
