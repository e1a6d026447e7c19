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
    CheckPlan, CleanupReport, EventUsage, Grant, Quota, RESERVATIONS_CTE_PARAMS, Reservation,
    STANDINGS_CTE_PARAMS, StandingRow, UserUsage, active_reservations, bind_reservations, cleanup,
    reservations_cte, standings_cte,
};

/// The event types usage is counted in: the same names as the services (`analysis`, `specview`).
pub type EventType = common::Service;
