//! [`QuotaHook`]: ends reservations in the same transaction as their job's final state.

use async_trait::async_trait;
use queue::{BoxError, JobId, JobState, Transition, TransitionHook};
use sqlx::PgConnection;

/// A [`TransitionHook`] that bills completed jobs and releases the reservations of failed and
/// cancelled ones, atomically with the state change:
///
/// - `completed`: the reservation is deleted and, in the same statement, billed as one usage
///   event (amount = its `reserved_amount`). Only the statement that deletes a reservation bills
///   it, and the event names it (`reservation_id` is unique), so a job is never billed twice. A
///   job whose id an older event holds (`job_id` is still unique) is billed with `job_id` NULL;
/// - `cancelled` / `discarded`: the reservation is deleted, nothing is billed;
/// - anything else (retry, snooze, rescue): the reservation stays.
///
/// Idempotent: a job without a reservation (a system job, or one already ended) changes nothing.
/// Register it on every [`queue::Client`] that finishes or cancels user jobs:
/// `Client::new(pool).with_hooks(vec![Arc::new(QuotaHook::new())])`.
#[derive(Debug, Clone, Copy, Default)]
pub struct QuotaHook {
    _private: (),
}

impl QuotaHook {
    pub fn new() -> Self {
        QuotaHook { _private: () }
    }
}

/// What one call of the hook did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HookEffect {
    /// Reservations removed (billed or not).
    pub released: u64,
    /// Usage events written.
    pub billed: u64,
}

/// The hook's work as a function, for callers that finish jobs by hand.
pub async fn end_reservations(
    conn: &mut PgConnection,
    transitions: &[Transition],
) -> Result<HookEffect, sqlx::Error> {
    let mut ended: Vec<JobId> = Vec::new();
    let mut completed: Vec<JobId> = Vec::new();
    for t in transitions {
        match t.state {
            JobState::Completed => {
                ended.push(t.job_id);
                completed.push(t.job_id);
            }
            JobState::Cancelled | JobState::Discarded => ended.push(t.job_id),
            JobState::Available | JobState::Scheduled | JobState::Running | JobState::Retryable => {
            }
        }
    }
    if ended.is_empty() {
        return Ok(HookEffect::default());
    }
    let (released, billed, billed_without_job_id, released_completed): (i64, i64, i64, i64) =
        sqlx::query_as(concat!(
            "WITH ended AS ( \
               DELETE FROM quota_reservations WHERE job_id = ANY($1) \
               RETURNING id, user_id, event_type, reserved_amount, job_id \
             ), to_bill AS (SELECT * FROM ended WHERE job_id = ANY($2)), ",
            billing_ctes!("to_bill", "now()"),
            " SELECT (SELECT count(*) FROM ended), (SELECT count(*) FROM billed), \
                    (SELECT count(*) FROM billed_without_job_id), (SELECT count(*) FROM to_bill)",
        ))
        .bind(&ended)
        .bind(&completed)
        .fetch_one(&mut *conn)
        .await?;
    if billed_without_job_id > 0 {
        // An older usage event holds these jobs' ids (imported usage, ids handed out again after
        // a restore, `UNIQUE (job_id)` kept for the previous release's binaries): the bill stands,
        // named by its reservation.
        tracing::warn!(
            billed_without_job_id,
            jobs = ?completed,
            "completed jobs billed without their job id: an older usage event holds it"
        );
    }
    if billed < released_completed {
        // A usage event naming the reservation existed already: it cannot, as only the statement
        // that deletes a reservation bills it, but if it did, billing it again would be wrong.
        tracing::error!(
            released_completed,
            billed,
            jobs = ?completed,
            "completed jobs released their reservations without a usage event of their own"
        );
    }
    let effect = HookEffect {
        released: u64::try_from(released).unwrap_or(0),
        billed: u64::try_from(billed).unwrap_or(0),
    };
    if effect.released > 0 {
        tracing::debug!(
            released = effect.released,
            billed = effect.billed,
            "quota reservations ended"
        );
    }
    Ok(effect)
}

#[async_trait]
impl TransitionHook for QuotaHook {
    async fn on_transitions(
        &self,
        conn: &mut PgConnection,
        transitions: &[Transition],
    ) -> Result<(), BoxError> {
        end_reservations(conn, transitions).await?;
        Ok(())
    }
}
