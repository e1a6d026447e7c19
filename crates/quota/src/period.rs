//! Billing periods: the half-open UTC interval `[start, end)` usage is counted in. Pure
//! arithmetic on timestamps, so the boundaries (month ends, leap years, year ends) are unit-tested.

use chrono::{DateTime, Datelike, Duration, NaiveDate, TimeZone, Utc};
use serde::{Deserialize, Serialize};

/// How usage periods are cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BillingCycle {
    /// Calendar months in UTC (the default, SPEC §5).
    #[default]
    Month,
    /// ISO weeks (Monday 00:00 UTC to the next Monday).
    Week,
    /// UTC days.
    Day,
}

/// One billing period: `start` inclusive, `end` exclusive. Both are UTC midnights, whatever the
/// cycle, so a period is a whole number of UTC days ([`BillingPeriod::days`]); only
/// [`BillingCycle::period_containing`] makes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[non_exhaustive]
pub struct BillingPeriod {
    pub start: DateTime<Utc>,
    pub end: DateTime<Utc>,
}

impl BillingPeriod {
    /// Whether `at` falls into the period.
    pub fn contains(&self, at: DateTime<Utc>) -> bool {
        self.start <= at && at < self.end
    }

    /// Time from `now` until the period ends (zero if it already has), for `Retry-After`.
    pub fn remaining(&self, now: DateTime<Utc>) -> std::time::Duration {
        (self.end - now).to_std().unwrap_or_default()
    }

    /// The period as UTC days: its first day and the day after its last (half-open, like the
    /// period), for the daily used totals.
    pub fn days(&self) -> (NaiveDate, NaiveDate) {
        (self.start.date_naive(), self.end.date_naive())
    }
}

fn midnight(date: NaiveDate) -> DateTime<Utc> {
    Utc.from_utc_datetime(&date.and_time(chrono::NaiveTime::MIN))
}

impl BillingCycle {
    /// The period that contains `at`.
    pub fn period_containing(self, at: DateTime<Utc>) -> BillingPeriod {
        let day = at.date_naive();
        match self {
            BillingCycle::Month => {
                let first = NaiveDate::from_ymd_opt(day.year(), day.month(), 1)
                    .expect("the first of an existing month is a valid date");
                let next = if day.month() == 12 {
                    NaiveDate::from_ymd_opt(day.year() + 1, 1, 1)
                } else {
                    NaiveDate::from_ymd_opt(day.year(), day.month() + 1, 1)
                }
                .expect("the first of the next month is a valid date");
                BillingPeriod {
                    start: midnight(first),
                    end: midnight(next),
                }
            }
            BillingCycle::Week => {
                let monday = day - Duration::days(i64::from(day.weekday().num_days_from_monday()));
                BillingPeriod {
                    start: midnight(monday),
                    end: midnight(monday) + Duration::days(7),
                }
            }
            BillingCycle::Day => BillingPeriod {
                start: midnight(day),
                end: midnight(day) + Duration::days(1),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn month_in_the_middle() {
        let p = BillingCycle::Month.period_containing(at("2026-03-15T12:34:56Z"));
        assert_eq!(p.start, at("2026-03-01T00:00:00Z"));
        assert_eq!(p.end, at("2026-04-01T00:00:00Z"));
    }

    #[test]
    fn month_across_the_year_boundary() {
        let p = BillingCycle::Month.period_containing(at("2026-12-31T23:59:59.999Z"));
        assert_eq!(p.start, at("2026-12-01T00:00:00Z"));
        assert_eq!(p.end, at("2027-01-01T00:00:00Z"));
        let p = BillingCycle::Month.period_containing(at("2027-01-01T00:00:00Z"));
        assert_eq!(p.start, at("2027-01-01T00:00:00Z"));
        assert_eq!(p.end, at("2027-02-01T00:00:00Z"));
    }

    #[test]
    fn month_boundaries_are_half_open() {
        let p = BillingCycle::Month.period_containing(at("2026-04-30T23:59:59Z"));
        assert!(p.contains(at("2026-04-01T00:00:00Z")));
        assert!(!p.contains(at("2026-05-01T00:00:00Z")));
        assert!(!p.contains(at("2026-03-31T23:59:59.999999Z")));
    }

    #[test]
    fn february_in_leap_and_common_years() {
        let p = BillingCycle::Month.period_containing(at("2028-02-29T10:00:00Z"));
        assert_eq!(p.end - p.start, Duration::days(29));
        let p = BillingCycle::Month.period_containing(at("2027-02-10T10:00:00Z"));
        assert_eq!(p.end - p.start, Duration::days(28));
        assert_eq!(p.end, at("2027-03-01T00:00:00Z"));
    }

    #[test]
    fn utc_not_local_offsets() {
        // 23:30 at -05:00 on Jan 31 is already Feb 1 in UTC.
        let t = DateTime::parse_from_rfc3339("2026-01-31T23:30:00-05:00")
            .unwrap()
            .with_timezone(&Utc);
        let p = BillingCycle::Month.period_containing(t);
        assert_eq!(p.start, at("2026-02-01T00:00:00Z"));
    }

    #[test]
    fn weeks_start_on_monday_and_cross_years() {
        // 2027-01-01 is a Friday; its ISO week starts Monday 2026-12-28.
        let p = BillingCycle::Week.period_containing(at("2027-01-01T08:00:00Z"));
        assert_eq!(p.start, at("2026-12-28T00:00:00Z"));
        assert_eq!(p.end, at("2027-01-04T00:00:00Z"));
        let monday = BillingCycle::Week.period_containing(at("2027-01-04T00:00:00Z"));
        assert_eq!(monday.start, at("2027-01-04T00:00:00Z"));
    }

    #[test]
    fn days_and_remaining() {
        let now = at("2026-12-31T18:00:00Z");
        let p = BillingCycle::Day.period_containing(now);
        assert_eq!(p.end, at("2027-01-01T00:00:00Z"));
        assert_eq!(p.remaining(now), std::time::Duration::from_secs(6 * 3600));
        assert_eq!(
            p.remaining(at("2027-02-01T00:00:00Z")),
            std::time::Duration::ZERO
        );
    }

    #[test]
    fn every_cycle_cuts_at_utc_midnight_so_days_cover_the_period_exactly() {
        let mut t = at("2023-12-25T13:45:10Z");
        let end = at("2025-03-10T00:00:00Z");
        while t < end {
            for cycle in [BillingCycle::Month, BillingCycle::Week, BillingCycle::Day] {
                let p = cycle.period_containing(t);
                for boundary in [p.start, p.end] {
                    assert_eq!(boundary.time(), chrono::NaiveTime::MIN, "{cycle:?} at {t}");
                }
                let (first, after_last) = p.days();
                assert!(first <= t.date_naive() && t.date_naive() < after_last);
                assert_eq!(midnight(first), p.start);
                assert_eq!(midnight(after_last), p.end);
            }
            t += Duration::hours(29) + Duration::minutes(7);
        }
    }

    #[test]
    fn every_day_of_a_long_span_lies_in_its_month() {
        let mut t = at("2023-11-15T06:00:00Z");
        let end = at("2029-03-01T00:00:00Z");
        while t < end {
            let p = BillingCycle::Month.period_containing(t);
            assert!(p.contains(t), "{t}");
            assert_eq!(p.start.day(), 1);
            assert_eq!(p.end.day(), 1);
            assert_eq!(BillingCycle::Month.period_containing(p.end).start, p.end);
            t += Duration::hours(37);
        }
    }
}
