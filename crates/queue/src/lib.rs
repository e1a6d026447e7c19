//! Fairlane's PostgreSQL job queue.
//!
//! - Put work in with [`Client`] (or the free functions in [`insert`]), alone or inside your own
//!   transaction; bulk loads use binary `COPY`; optional uniqueness among non-final jobs.
//! - Work queues with an [`Engine`]: one producer per queue fills that queue's worker slots with
//!   `FOR UPDATE SKIP LOCKED` fetches, woken by LISTEN/NOTIFY with polling as the fallback;
//!   handlers run behind a [`Middleware`] chain with timeouts, panic capture and cancellation;
//!   completions are persisted in batches, each guarded so no attempt is completed twice.
//! - Dead workers are found by heartbeat and their jobs rescued; final jobs are cleaned after a
//!   retention; both run once fleet-wide under a PostgreSQL lease ([`leader`]), held by an engine
//!   or by a [`Maintainer`] in a process that works no queue.
//! - [`TransitionHook`] and [`FetchGate`] let other crates act inside the queue's transactions
//!   (quota billing, per-user fairness).
//!
//! The schema lives in the workspace's `migrations/` folder; why it looks the way it does is in
//! `docs/queue-storage.md`.

/// The state a job starts in, in an insert that selects its rows from a source aliased `n`
/// with a `scheduled_at` column: runnable now unless scheduled for later. One definition for
/// the insert statements ([`insert::insert_many`], [`compose::JobsCte`]); the binary `COPY`
/// path decides the same in Rust, against the `now()` it reads from the database first.
macro_rules! new_job_state_sql {
    () => {
        "CASE WHEN n.scheduled_at IS NULL OR n.scheduled_at <= now() \
         THEN 'available'::fairlane_job_state ELSE 'scheduled'::fairlane_job_state END"
    };
}

/// The most attempt errors a job keeps (the newest).
pub const MAX_ATTEMPT_ERRORS: usize = 50;

/// The most bytes of JSON a job's output may hold ([`context::JobContext::set_output`]).
pub const MAX_OUTPUT_BYTES: usize = 1024 * 1024;

/// The most bytes of an attempt error's message that are stored (then `…`): a handler's error
/// chain or panic text can be any length, and a job carries its errors through every fetch and
/// `GET /v1/jobs`.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 2048;

/// The start of `j.errors` with one more entry: this, then the entry's `jsonb_build_object(…)`
/// and a closing `)`. The oldest entry is dropped once the list holds [`MAX_ATTEMPT_ERRORS`].
/// Runs handed back (interrupted, never started, snoozed) give their attempt back, so without a
/// cap a long job interrupted at every deploy would carry an ever longer list through every
/// fetch and `GET /v1/jobs`.
macro_rules! errors_appended {
    () => {
        "errors = CASE WHEN jsonb_array_length(j.errors) >= 50 THEN j.errors - 0 \
         ELSE j.errors END || jsonb_build_array("
    };
}

pub mod backoff;
pub mod begin;
pub mod client;
mod completer;
pub mod compose;
pub mod config;
pub mod context;
mod copy;
pub mod engine;
pub mod error;
mod executor;
pub mod handler;
mod heartbeat;
pub mod hooks;
pub mod insert;
pub mod job;
pub mod leader;
pub mod maintenance;
pub mod metrics;
pub mod middleware;
pub mod notifier;
pub mod outcome;
#[cfg(test)]
mod plan_nodes;
mod producer;
mod runtime;
pub mod wake;

pub use backoff::RetryPolicy;
pub use client::{CancelResult, Client, QueueTx};
pub use common::{JobArgs, QueueName};
pub use compose::{ComposedJob, JobsCte};
pub use config::EngineConfig;
pub use context::{CancelReason, JobContext};
pub use engine::{Engine, EngineBuilder, JobSpan};
pub use error::{BoxError, QueueError};
pub use handler::{FnWorker, Worker, Workers};
pub use hooks::{FetchGate, Transition, TransitionHook, begin_fetch};
pub use insert::{Inserted, NewJob};
pub use job::{AttemptError, FailureKind, JobId, JobRow, JobState};
pub use leader::{LeaderElector, LeaderHandle};
pub use maintenance::Maintainer;
pub use middleware::{Middleware, Next};
pub use outcome::{JobError, JobOutcome, MAX_SNOOZE, from_anyhow};
