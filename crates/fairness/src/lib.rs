//! Per-user concurrency limits by tier (seed ADR-10), enforced across every process of a worker
//! service.
//!
//! ADR-10 kept a per-process, in-memory count, so three replicas gave a Free user three slots; an
//! over-limit job waited a blind 30–40 s; and workers churned through a heavy user's backlog
//! (fetch → run → snooze) before reaching anyone else. Fairlane keeps ADR-10's rules — user from
//! `args.user_id`, tier from the database, limits by tier, jobs delayed not rejected, idempotent
//! acquire/release, system jobs exempt — and changes where they are enforced:
//!
//! - A user's slot *is* a `running` job of that user in the service's queues. Acquiring a slot is
//!   the job becoming `running`; releasing it is the job leaving `running`, in the same
//!   transaction as its new state; a crashed worker's slots come back when the queue rescues its
//!   jobs. Nothing is counted in memory.
//! - [`FairnessGate`] admits jobs at fetch time, inside the fetch transaction: users already at
//!   their limit are skipped by the candidate query (their backlog never occupies a worker), each
//!   remaining candidate's user is try-locked (a transaction-scoped advisory lock, one of
//!   [`store::USER_LOCK_STRIPES`] per service, taken as the scan meets the user; a user another
//!   fetch is admitting is left to the next fetch, never waited for) and re-counted, and only
//!   jobs within each user's limit start.
//! - [`FairnessHook`] notifies the service's queues when a user's job leaves `running`, so that
//!   user's next waiting job starts within milliseconds instead of after a snooze.
//! - [`FairnessMiddleware`] is ADR-10's mechanism, kept for jobs that did not come through the
//!   gate: it checks the same fleet-wide count, without a lock (a job checks after its own fetch
//!   committed, so of two racing for a last slot at least one sees the other), and snoozes
//!   over-limit jobs (30 s + up to 10 s jitter, never consuming an attempt).
//!
//! The decisions are pure functions in [`decision`]; the SQL lives in [`store`].

pub mod config;
pub mod decision;
pub mod gate;
pub mod gauges;
pub mod hook;
pub mod metrics;
pub mod middleware;
pub mod store;
pub mod tiers;

pub use config::FairnessConfig;
pub use gate::FairnessGate;
pub use gauges::FairnessGauges;
pub use hook::FairnessHook;
pub use middleware::FairnessMiddleware;
pub use tiers::TierCache;

/// Failures of the fairness store.
#[derive(Debug, thiserror::Error)]
pub enum FairnessError {
    #[error("fairness store: {0}")]
    Database(#[from] sqlx::Error),
}
