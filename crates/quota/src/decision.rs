//! The quota check itself, as a pure function: `used + reserved + requested <= limit`.

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
}
