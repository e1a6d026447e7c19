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
/// After a failed tick (database unreachable), try again this soon.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// How a catch-up ended.
#[derive(Debug, Clone, Copy)]
struct CaughtUp {
    /// How far the database's clock is ahead of this replica's.
    clock_offset: chrono::TimeDelta,
    /// The database's time the catch-up read its due ticks at, when it ran them all (`None` when
    /// it stopped early: leadership lost or a shutdown).
    done_up_to: Option<chrono::DateTime<Utc>>,
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
        loop {
            let mut failed = false;
            // Up to when every due tick ran, by the database's clock, when a catch-up ran them
            // all: a tick that fell due while they ran is run next, not a period late.
            let mut done_up_to = None;
            if leader.is_leader() {
                match self.catch_up(&leader, &shutdown).await {
                    Ok(caught_up) => {
                        clock_offset = caught_up.clock_offset;
                        done_up_to = caught_up.done_up_to;
                    }
                    Err(e) => {
                        tracing::warn!(task = name, error = %e, "scheduler tick failed; retrying");
                        self.metrics.tick(name, "failed");
                        failed = true;
                    }
                }
            }
            let now = Utc::now() + clock_offset;
            let until_next = self
                .schedule
                .until_next_after(done_up_to.unwrap_or(now), now)
                .unwrap_or(Duration::from_secs(3600));
            let wait = if failed {
                until_next.min(RETRY_AFTER)
            } else {
                until_next
            };
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
                return Ok(stopped);
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
