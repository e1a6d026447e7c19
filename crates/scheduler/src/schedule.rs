//! Cron schedules and the pure tick arithmetic of periodic tasks: when the next tick is, and which
//! ticks are due now given the newest tick already done (the task's "frontier" in
//! `scheduler_ticks`).
//!
//! Expressions are read by `croner` (POSIX/Vixie cron plus an optional leading seconds field, so
//! `*/5 * * * * *` ticks every five seconds), always in UTC.

use chrono::{DateTime, Utc};
use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};

/// A parsed cron expression.
#[derive(Debug, Clone)]
pub struct Schedule {
    cron: Cron,
    expression: String,
}

/// A cron expression that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid cron expression `{expression}`: {reason}")]
pub struct InvalidSchedule {
    pub expression: String,
    pub reason: String,
}

/// Which ticks a task should run now, oldest first.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DueTicks {
    pub ticks: Vec<DateTime<Utc>>,
    /// Older missed ticks beyond the catch-up limit were left out.
    pub skipped_older: bool,
}

impl Schedule {
    /// Parses a 5-field (minutes) or 6-field (seconds first) cron expression.
    pub fn parse(expression: &str) -> Result<Schedule, InvalidSchedule> {
        let invalid = |reason: String| InvalidSchedule {
            expression: expression.to_owned(),
            reason,
        };
        if expression.trim().is_empty() {
            return Err(invalid("it is empty".into()));
        }
        // No seventh (year) field: a schedule bounded to a year would stop for good once the
        // year is over, with nothing said.
        let cron = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .build()
            .parse(expression)
            .map_err(|e| invalid(e.to_string()))?;
        let schedule = Schedule {
            cron,
            expression: expression.trim().to_owned(),
        };
        // An expression that parses but never fires (`0 0 30 2 *`) is a mistake, not a schedule.
        if schedule.next_after(Utc::now()).is_none() {
            return Err(invalid("it never fires".into()));
        }
        Ok(schedule)
    }

    pub fn as_str(&self) -> &str {
        &self.expression
    }

    /// The first tick strictly after `t`.
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.cron.find_next_occurrence(&t, false).ok()
    }

    /// The newest tick at or before `t`.
    pub fn latest_at_or_before(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.cron.find_previous_occurrence(&t, true).ok()
    }

    /// The ticks to run at `now`: every tick after `frontier` (the newest tick already done) up to
    /// `now`, at most `max` of them (the newest ones). With no frontier (the task never ran) only
    /// the newest tick is due, so a first deployment does not replay history.
    pub fn due_ticks(
        &self,
        frontier: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
        max: usize,
    ) -> DueTicks {
        let mut due = DueTicks::default();
        if max == 0 {
            return due;
        }
        let Some(latest) = self.latest_at_or_before(now) else {
            return due;
        };
        let Some(frontier) = frontier else {
            due.ticks.push(latest);
            return due;
        };
        let mut tick = latest;
        while tick > frontier {
            if due.ticks.len() == max {
                due.skipped_older = true;
                break;
            }
            due.ticks.push(tick);
            match self.cron.find_previous_occurrence(&tick, false) {
                Ok(previous) if previous < tick => tick = previous,
                _ => break,
            }
        }
        due.ticks.reverse();
        due
    }

    /// How long to sleep at `now` until the first tick after `done_up_to` (the instant up to
    /// which every tick was run; `now` itself when none ran), a millisecond late rather than
    /// early, so the wake-up finds the tick due: no time at all if that tick came due meanwhile,
    /// as one that fell due while the ticks before it ran has. `None` if the schedule never
    /// fires again.
    pub fn until_next_after(
        &self,
        done_up_to: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Option<std::time::Duration> {
        let next = self.next_after(done_up_to)?;
        let wait = (next - now).to_std().unwrap_or_default();
        Some(wait + std::time::Duration::from_millis(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn five_fields_tick_on_minutes_six_on_seconds() {
        let hourly = Schedule::parse("0 * * * *").unwrap();
        assert_eq!(
            hourly.next_after(at("2026-11-24T10:15:42.5Z")),
            Some(at("2026-11-24T11:00:00Z"))
        );
        let every_two_seconds = Schedule::parse("*/2 * * * * *").unwrap();
        assert_eq!(
            every_two_seconds.next_after(at("2026-11-24T10:15:42.5Z")),
            Some(at("2026-11-24T10:15:44Z"))
        );
        assert_eq!(
            every_two_seconds.latest_at_or_before(at("2026-11-24T10:15:43.9Z")),
            Some(at("2026-11-24T10:15:42Z"))
        );
    }

    #[test]
    fn a_tick_exactly_now_is_due_now_and_not_next() {
        let s = Schedule::parse("* * * * * *").unwrap();
        let t = at("2026-11-24T10:15:42Z");
        assert_eq!(s.latest_at_or_before(t), Some(t));
        assert_eq!(s.next_after(t), Some(at("2026-11-24T10:15:43Z")));
    }

    #[test]
    fn first_run_does_only_the_newest_tick() {
        let s = Schedule::parse("*/5 * * * *").unwrap();
        let due = s.due_ticks(None, at("2026-11-24T10:17:00Z"), 10);
        assert_eq!(due.ticks, vec![at("2026-11-24T10:15:00Z")]);
        assert!(!due.skipped_older);
    }

    #[test]
    fn nothing_is_due_when_the_newest_tick_is_done() {
        let s = Schedule::parse("*/5 * * * *").unwrap();
        let due = s.due_ticks(
            Some(at("2026-11-24T10:15:00Z")),
            at("2026-11-24T10:19:59Z"),
            10,
        );
        assert_eq!(due, DueTicks::default());
        // A frontier ahead of this clock (another replica's clock runs fast): nothing either.
        let due = s.due_ticks(
            Some(at("2026-11-24T10:20:00Z")),
            at("2026-11-24T10:19:59Z"),
            10,
        );
        assert!(due.ticks.is_empty());
    }

    #[test]
    fn missed_ticks_are_caught_up_in_order() {
        let s = Schedule::parse("* * * * * *").unwrap();
        let due = s.due_ticks(
            Some(at("2026-11-24T10:15:40Z")),
            at("2026-11-24T10:15:43.2Z"),
            10,
        );
        assert_eq!(
            due.ticks,
            vec![
                at("2026-11-24T10:15:41Z"),
                at("2026-11-24T10:15:42Z"),
                at("2026-11-24T10:15:43Z"),
            ]
        );
        assert!(!due.skipped_older);
    }

    #[test]
    fn catch_up_is_bounded_to_the_newest_ticks() {
        let s = Schedule::parse("* * * * * *").unwrap();
        let due = s.due_ticks(
            Some(at("2026-11-24T09:00:00Z")),
            at("2026-11-24T10:00:00Z"),
            3,
        );
        assert_eq!(
            due.ticks,
            vec![
                at("2026-11-24T09:59:58Z"),
                at("2026-11-24T09:59:59Z"),
                at("2026-11-24T10:00:00Z"),
            ]
        );
        assert!(due.skipped_older);
        assert!(
            s.due_ticks(None, at("2026-11-24T10:00:00Z"), 0)
                .ticks
                .is_empty()
        );
    }

    #[test]
    fn sleeping_until_next_lands_just_after_the_tick() {
        let s = Schedule::parse("0 3 * * *").unwrap();
        let now = at("2026-11-24T02:59:59.5Z");
        let wait = s.until_next_after(now, now).unwrap();
        assert_eq!(wait, std::time::Duration::from_millis(501));
        let woke = at("2026-11-24T02:59:59.5Z") + chrono::Duration::from_std(wait).unwrap();
        assert_eq!(
            s.due_ticks(Some(at("2026-11-23T03:00:00Z")), woke, 10)
                .ticks,
            vec![at("2026-11-24T03:00:00Z")]
        );
    }

    #[test]
    fn a_tick_that_fell_due_while_others_ran_is_not_slept_past() {
        let s = Schedule::parse("0 * * * *").unwrap();
        // Every tick up to 10:59:59.9 ran; it is 11:00:00.02 now: 11:00 is due at once.
        let wait = s
            .until_next_after(at("2026-11-24T10:59:59.9Z"), at("2026-11-24T11:00:00.02Z"))
            .unwrap();
        assert_eq!(wait, std::time::Duration::from_millis(1));
        let wait = s
            .until_next_after(at("2026-11-24T11:00:00Z"), at("2026-11-24T11:00:00.02Z"))
            .unwrap();
        assert_eq!(wait, std::time::Duration::from_millis(3_599_981));
    }

    #[test]
    fn schedules_are_utc_whatever_the_host_says() {
        // Ticks are instants; the expression's hours are UTC hours.
        let s = Schedule::parse("0 3 * * *").unwrap();
        let next = s.next_after(at("2026-11-24T05:00:00+02:00")).unwrap();
        assert_eq!(next, at("2026-11-25T03:00:00Z"));
    }

    #[test]
    fn bad_expressions_say_what_is_wrong() {
        for bad in [
            "",
            "  ",
            "every hour",
            "61 * * * *",
            "* * * *",
            "0 0 30 2 *",
            "0 0 3 * * * 2099",
        ] {
            let err = Schedule::parse(bad).unwrap_err();
            assert!(
                err.to_string().starts_with("invalid cron expression"),
                "{bad}: {err}"
            );
        }
        assert!(
            Schedule::parse("0 0 30 2 *")
                .unwrap_err()
                .reason
                .contains("never fires")
        );
    }
}
