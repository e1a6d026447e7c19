//! Fairlane's usage quota (SPEC §5, seed ADR-21 with its race closed).
//!
//! - [`QuotaConfig`]: limits per tier and event type, cost per request, reservation TTL and
//!   billing cycle, from `QUOTA_*` settings.
//! - [`period`]: billing periods (calendar months in UTC by default).
//! - [`decision`]: the check `used + reserved + requested <= limit` and the [`Ledger`] that
//!   decides a batch of requests in order, pure.
//! - [`Quota::check`]: the check inside the caller's transaction, serialized per user, giving a
//!   [`Grant`] (with the user's tier, for routing); [`Grant::reserve`] inserts the reservation,
//!   linked to the job inserted in that transaction. [`Quota::check_many`] and
//!   [`reservations_cte`] do the same for a batch in a constant number of statements;
//!   [`CheckPlan`] gives a caller its parts to send inside statements of its own.
//!   [`Quota::reserve`] +
//!   [`Reservation::attach_job`] is the same in ADR-21's order (reserve first, link later).
//! - [`QuotaHook`]: a queue transition hook that bills a completed job exactly once and releases
//!   the reservation of a cancelled or discarded one, in the queue's own transaction.
//! - [`Quota::usage`], [`cleanup`] (scheduler safety net), [`active_reservations`].
//!
//! No HTTP here: the web service maps [`QuotaError::Exceeded`] to its 429.

/// The CTEs (without a leading `WITH` or comma) that bill the reservations of `$source`, a
/// relation with their columns `id`, `user_id`, `event_type`, `reserved_amount` and `job_id`, as
/// usage events dated `$occurred_at` (SQL over those columns): the one statement that deletes
/// reservations bills them, whichever of the hook and cleanup it is. A reservation whose job id
/// an older event holds (ids repeat after a restore; `UNIQUE (job_id)` stays for the previous
/// release's binaries) is billed with `job_id` NULL, named by the reservation. `billed` lists the
/// reservations billed, `billed_without_job_id` those billed so.
macro_rules! billing_ctes {
    ($source:literal, $occurred_at:literal) => {
        concat!(
            "billed_with_job_id AS ( \
               INSERT INTO usage_events \
                 (user_id, event_type, amount, job_id, reservation_id, occurred_at) \
               SELECT user_id, event_type, reserved_amount, job_id, id, ",
            $occurred_at,
            " FROM ",
            $source,
            " ON CONFLICT DO NOTHING \
               RETURNING reservation_id \
             ), billed_without_job_id AS ( \
               INSERT INTO usage_events \
                 (user_id, event_type, amount, job_id, reservation_id, occurred_at) \
               SELECT user_id, event_type, reserved_amount, NULL, id, ",
            $occurred_at,
            " FROM ",
            $source,
            " WHERE id NOT IN (SELECT reservation_id FROM billed_with_job_id) \
               ON CONFLICT DO NOTHING \
               RETURNING reservation_id \
             ), billed AS ( \
               SELECT reservation_id FROM billed_with_job_id \
               UNION ALL SELECT reservation_id FROM billed_without_job_id \
             )"
        )
    };
}

pub mod config;
pub mod decision;
pub mod error;
pub mod hook;
pub mod period;
pub mod store;

pub use config::{InvalidQuotaConfig, QuotaConfig};
pub use decision::{Decision, Ledger, Standing};
pub use error::{QuotaError, QuotaExceeded};
pub use hook::{HookEffect, QuotaHook, end_reservations};
pub use period::{BillingCycle, BillingPeriod};
pub use store::{
    CLEANUP_BATCH, CheckPlan, CleanupReport, EventUsage, Grant, Quota, RESERVATIONS_CTE_PARAMS,
    Reservation, STANDINGS_CTE_PARAMS, StandingRow, UserUsage, active_reservations,
    bind_reservations, cleanup, cleanup_in_batches, reservations_cte, standings_cte,
};

/// The event types usage is counted in: the same names as the services (`analysis`, `specview`).
pub type EventType = common::Service;
