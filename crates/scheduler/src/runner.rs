//! The loop that drives one cron task: sleep until the next tick (or a leadership change), and,
//! while leader, run every tick due since the task's frontier (the newest tick anyone did), in
//! order, each claimed in the database. A replica that just became leader therefore acts at once
//! on the ticks its predecessor missed; a replica that lost leadership stops before its next tick.

use std::time::Duration;

use chrono::Utc;
use queue::LeaderHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::cleanup;
use crate::error::SchedulerError;
use crate::metrics::SchedulerMetrics;
use crate::reanalyze::{self, ReanalyzeSettings, TickOutcome};
use crate::schedule::Schedule;
use crate::ticks::TickStore;

/// At most this many missed ticks are caught up at once (the newest ones).
pub const MAX_CATCH_UP: usize = 60;
/// After a failed tick (database unreachable), try again this soon; each further failure in a
/// row waits twice as long, up to [`MAX_RETRY_AFTER`], so a tick that keeps failing (a query
/// that times out) does not run its work once a second.
const RETRY_AFTER: Duration = Duration::from_secs(1);
/// The longest wait between two tries of a failing tick.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// How long the loop sleeps before it looks at its ticks again: until the next tick, but sooner
/// after a failure (`retry`, the backoff's current wait) or when the claim's fence refused a
/// replica that still believes it leads (its view of the lease and the database's disagree, as
/// after a failover to a primary whose clock is ahead: the tick is retried soon, not a whole
/// period later).
fn wait_before_next(until_next: Duration, retry: Option<Duration>, fenced: bool) -> Duration {
    match retry {
        Some(retry) => until_next.min(retry),
        None if fenced => until_next.min(RETRY_AFTER),
        None => until_next,
    }
}

/// The backoff's next wait after `previous` (none yet: [`RETRY_AFTER`]).
fn next_retry(previous: Option<Duration>) -> Duration {
    previous.map_or(RETRY_AFTER, |d| (d * 2).min(MAX_RETRY_AFTER))
}

/// How a catch-up ended.
#[derive(Debug, Clone, Copy)]
struct CaughtUp {
    /// How far the database's clock is ahead of this replica's.
    clock_offset: chrono::TimeDelta,
    /// The database's time the catch-up read its due ticks at, when it ran them all (`None` when
    /// it stopped early: leadership lost or a shutdown).
    done_up_to: Option<chrono::DateTime<Utc>>,
    /// The claim's fence said this replica does not lead.
    fenced: bool,
}

/// What a cron task does on each tick.
#[derive(Debug, Clone)]
pub enum CronTask {
    Reanalyze(ReanalyzeSettings),
    ReservationCleanup { ttl: Duration },
}

impl CronTask {
    pub fn name(&self) -> &'static str {
        match self {
            CronTask::Reanalyze(_) => reanalyze::TASK,
            CronTask::ReservationCleanup { .. } => cleanup::TASK,
        }
    }
}

/// One cron task with its schedule.
#[derive(Debug, Clone)]
pub struct Periodic {
    pub task: CronTask,
    pub schedule: Schedule,
    pub store: TickStore,
    pub metrics: SchedulerMetrics,
}

impl Periodic {
    /// Runs until `shutdown` (a tick in progress finishes first: it is one short transaction).
    pub async fn run(self, leader: LeaderHandle, shutdown: CancellationToken) {
        let name = self.task.name();
        let mut changes = leader.clone();
        // How far the database's clock is ahead of this replica's, as last seen: the sleep to
        // the next tick is timed by the database's clock too.
        let mut clock_offset = chrono::TimeDelta::zero();
        // The backoff's current wait while ticks keep failing.
        let mut retry: Option<Duration> = None;
        loop {
            // Up to when every due tick ran, by the database's clock, when a catch-up ran them
            // all: a tick that fell due while they ran is run next, not a period late.
            let mut done_up_to = None;
            let mut fenced = false;
            if leader.is_leader() {
                match self.catch_up(&leader, &shutdown).await {
                    Ok(caught_up) => {
                        clock_offset = caught_up.clock_offset;
                        done_up_to = caught_up.done_up_to;
                        fenced = caught_up.fenced && leader.is_leader();
                        retry = None;
                    }
                    Err(e) => {
                        retry = Some(next_retry(retry));
                        tracing::warn!(
                            task = name,
                            error = %e,
                            retry_in = ?retry,
                            "scheduler tick failed; retrying"
                        );
                        self.metrics.tick(name, "failed");
                    }
                }
            }
            let now = Utc::now() + clock_offset;
            let until_next = self
                .schedule
                .until_next_after(done_up_to.unwrap_or(now), now)
                .unwrap_or(Duration::from_secs(3600));
            let wait = wait_before_next(until_next, retry, fenced);
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = changes.changed() => {}
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Runs the ticks due by the database's clock, in order, while this replica leads.
    async fn catch_up(
        &self,
        leader: &LeaderHandle,
        shutdown: &CancellationToken,
    ) -> Result<CaughtUp, SchedulerError> {
        let name = self.task.name();
        let frontier = self.store.frontier(name).await?;
        let stopped = CaughtUp {
            clock_offset: frontier.now - Utc::now(),
            done_up_to: None,
            fenced: false,
        };
        let due = self
            .schedule
            .due_ticks(frontier.last_done, frontier.now, MAX_CATCH_UP);
        if due.skipped_older {
            tracing::warn!(
                task = name,
                frontier = ?frontier.last_done,
                caught_up = due.ticks.len(),
                "more ticks were missed than are caught up; the older ones are skipped"
            );
        }
        for tick in due.ticks {
            // Checked right before acting; the claim's fence re-checks by the database's clock.
            // A shutdown stops a catch-up between ticks, so the replica resigns at once.
            if !leader.is_leader() || shutdown.is_cancelled() {
                return Ok(stopped);
            }
            let span = tracing::info_span!("scheduler.tick", task = name, tick_at = %tick);
            let outcome = self.run_tick(tick).instrument(span).await?;
            self.metrics.tick(name, outcome);
            if outcome == "not_leader" {
                return Ok(CaughtUp {
                    fenced: true,
                    ..stopped
                });
            }
        }
        Ok(CaughtUp {
            done_up_to: Some(frontier.now),
            ..stopped
        })
    }

    async fn run_tick(&self, tick: chrono::DateTime<Utc>) -> Result<&'static str, SchedulerError> {
        match &self.task {
            CronTask::Reanalyze(settings) => {
                let outcome = reanalyze::run_tick(&self.store, settings, tick).await?;
                if let TickOutcome::Done(report) = &outcome {
                    self.metrics.reanalyses(report);
                    tracing::info!(
                        task = reanalyze::TASK,
                        tick_at = %tick,
                        candidates = report.candidates,
                        enqueued = report.enqueued,
                        duplicates = report.duplicates,
                        "re-analysis of stale repositories enqueued"
                    );
                }
                Ok(outcome.label())
            }
            CronTask::ReservationCleanup { ttl } => {
                let outcome = cleanup::run_tick(&self.store, *ttl, tick).await?;
                if let TickOutcome::Done(report) = &outcome {
                    self.metrics.orphans(report);
                    let orphans = report.total();
                    if orphans > 0 {
                        tracing::warn!(
                            task = cleanup::TASK,
                            tick_at = %tick,
                            orphans,
                            final_job = report.final_job,
                            missing_job = report.missing_job,
                            expired_without_job = report.expired_without_job,
                            billed = report.billed,
                            "orphaned quota reservations removed (a rising count means workers \
                             are failing to release)"
                        );
                    } else {
                        tracing::info!(task = cleanup::TASK, tick_at = %tick, orphans, "reservation cleanup");
                    }
                }
                Ok(outcome.label())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_in_a_row_wait_longer_each_time_up_to_a_minute() {
        let mut waits = Vec::new();
        let mut retry = None;
        for _ in 0..9 {
            retry = Some(next_retry(retry));
            waits.push(retry.expect("set").as_secs());
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
    }

    #[test]
    fn the_loop_waits_for_the_next_tick_unless_a_tick_failed_or_was_fenced() {
        let hour = Duration::from_secs(3600);
        assert_eq!(wait_before_next(hour, None, false), hour);
        assert_eq!(
            wait_before_next(hour, Some(Duration::from_secs(8)), false),
            Duration::from_secs(8)
        );
        assert_eq!(wait_before_next(hour, None, true), RETRY_AFTER);
        // Never later than the next tick.
        let soon = Duration::from_millis(300);
        assert_eq!(
            wait_before_next(soon, Some(Duration::from_secs(8)), false),
            soon
        );
        assert_eq!(wait_before_next(soon, None, true), soon);
    }
}
