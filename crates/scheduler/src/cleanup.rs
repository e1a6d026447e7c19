//! Reservation cleanup (SPEC §5, seed ADR-21's TTL kept as a safety net): on each tick the
//! leader removes quota reservations whose job is final or gone, and reservations that never got
//! a job once older than `QUOTA_RESERVATION_TTL`. The reservation of a live job (waiting, running,
//! snoozed, retrying) is never removed, however old. The rules themselves live in
//! [`quota::cleanup`]; this module runs them once per tick and reports what they found.
//!
//! Every reservation removed here is an orphan: in a healthy system the job's own final
//! transaction ends its reservation (`quota::QuotaHook`). A rising count means some process
//! finishes or deletes jobs without the hook.

use std::time::Duration;

use chrono::{DateTime, Utc};
use quota::CleanupReport;

use crate::error::SchedulerError;
use crate::reanalyze::TickOutcome;
use crate::ticks::{Claim, TickStore};

/// The task name in `scheduler_ticks` and in metrics.
pub const TASK: &str = "reservation-cleanup";

/// One cleanup tick: fence and claim (committed), clean, record the counts.
///
/// The cleanup runs after the claim commits (it is idempotent: deleting orphans twice finds
/// nothing the second time). If it fails, the tick stays claimed without a result and the next
/// tick does the work. Once it has removed orphans, what it found is reported even if its record
/// on the tick cannot be written: the next tick would find nothing left to count.
pub async fn run_tick(
    store: &TickStore,
    ttl: Duration,
    tick: DateTime<Utc>,
) -> Result<TickOutcome<CleanupReport>, SchedulerError> {
    let mut tx = store.begin().await?;
    match store.claim(&mut tx, TASK, tick).await? {
        Claim::Claimed => {}
        Claim::AlreadyDone => return Ok(TickOutcome::AlreadyDone),
        Claim::NotLeader => return Ok(TickOutcome::NotLeader),
    }
    tx.commit().await?;
    let report = quota::cleanup(store.pool(), ttl).await?;
    let result = serde_json::json!({
        "final_job": report.final_job,
        "missing_job": report.missing_job,
        "expired_without_job": report.expired_without_job,
        "orphans": report.total(),
        "billed": report.billed,
    });
    let recorded = match store.pool().acquire().await {
        Ok(mut conn) => TickStore::record(&mut conn, TASK, tick, &result).await,
        Err(e) => Err(e),
    };
    if let Err(e) = recorded {
        tracing::warn!(task = TASK, tick_at = %tick, %result, error = %e,
            "the cleanup's counts were not recorded on its tick");
    }
    Ok(TickOutcome::Done(report))
}
