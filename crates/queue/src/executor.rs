//! Runs one fetched job: handler lookup, the middleware chain, timeout, panic capture and the stop
//! signal, then hands the result to the completer. Whatever the handler does — error, panic, hang
//! past its timeout — the worker survives and the attempt ends in a recorded outcome.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures_util::FutureExt;
use opentelemetry::KeyValue;
use tokio::sync::{Notify, OwnedSemaphorePermit};
use tokio::time::Instant;
use tracing::Instrument;

use crate::completer::{Completion, Resolution};
use crate::context::{CancelReason, JobContext, JobControl};
use crate::job::{FailureKind, JobRow};
use crate::middleware::Next;
use crate::outcome::JobOutcome;
use crate::runtime::Runtime;

/// A job handed from a producer to an executor task.
pub(crate) struct Dispatch {
    pub(crate) job: JobRow,
    pub(crate) gate_admitted: bool,
    pub(crate) permit: OwnedSemaphorePermit,
    pub(crate) slot_freed: Arc<Notify>,
    pub(crate) queue_label: KeyValue,
}

/// Registers the job as held by this process and spawns its execution on `tracker`.
pub(crate) fn spawn(rt: &Arc<Runtime>, tracker: &tokio_util::task::TaskTracker, d: Dispatch) {
    let control = Arc::new(JobControl::default());
    rt.inflight
        .insert(d.job.id, d.job.attempted_at, Arc::clone(&control));
    let wait = d
        .job
        .attempted_at
        .map(|a| (a - d.job.scheduled_at).as_seconds_f64())
        .unwrap_or(0.0);
    rt.metrics.started(&d.queue_label, wait);
    let span = match &rt.job_span {
        Some(make) => make(&d.job),
        None => tracing::info_span!(
            "job",
            job_id = d.job.id,
            queue = %d.job.queue,
            kind = %d.job.kind,
            attempt = d.job.attempt,
        ),
    };
    let ctx = JobContext::new(d.job, Arc::clone(&rt.worker_id), control, d.gate_admitted);
    let rt = Arc::clone(rt);
    tracker.spawn(
        async move {
            let started = Instant::now();
            let resolution = execute(&rt, &ctx).await;
            let elapsed = started.elapsed().as_secs_f64();
            rt.metrics
                .finished(&d.queue_label, &ctx.job().kind, elapsed);
            log_resolution(&resolution, elapsed);
            let completion = Completion {
                output: match resolution {
                    Resolution::Outcome(JobOutcome::Completed) => ctx.take_output(),
                    _ => None,
                },
                job: ctx,
                resolution,
            };
            // Waiting here (channel full) holds the slot: the completer's pace limits fetching.
            if rt.completions.send(completion).await.is_err() {
                tracing::error!("completer is gone; the job stays running and will be rescued");
            }
            drop(d.permit);
            d.slot_freed.notify_one();
        }
        .instrument(span),
    );
}

fn log_resolution(resolution: &Resolution, seconds: f64) {
    match resolution {
        Resolution::Outcome(JobOutcome::Completed) => {
            tracing::debug!(seconds, "job attempt succeeded");
        }
        Resolution::Outcome(JobOutcome::Failed { kind, message }) => {
            tracing::warn!(seconds, ?kind, error = %message, "job attempt failed");
        }
        Resolution::Outcome(JobOutcome::Snoozed(d)) => {
            tracing::debug!(seconds, snooze = ?d, "job snoozed");
        }
        Resolution::Outcome(JobOutcome::Cancelled(reason)) => {
            tracing::info!(seconds, reason = %reason, "job cancelled");
        }
        Resolution::Interrupted(reason) => {
            tracing::warn!(seconds, reason = %reason, "job interrupted; handing it back");
        }
    }
}

async fn execute(rt: &Runtime, ctx: &JobContext) -> Resolution {
    let kind = ctx.job().kind.as_str();
    let Some(handler) = rt.workers.get(kind) else {
        return Resolution::Outcome(JobOutcome::Failed {
            kind: FailureKind::UnknownKind,
            message: format!(
                "no handler is registered for job kind `{kind}` in the worker that fetched it (it \
                 handles: {})",
                rt.workers.kinds().join(", ")
            ),
        });
    };
    let timeout = handler.timeout().unwrap_or(rt.config.job_timeout);
    let chain = Next::new(&rt.middleware, handler.as_ref()).run(ctx);
    let guarded = AssertUnwindSafe(chain).catch_unwind();
    let control = ctx.control();
    tokio::select! {
        biased;
        result = tokio::time::timeout(timeout, guarded) => match result {
            Ok(Ok(outcome)) => settle(outcome, control.reason()),
            Ok(Err(panic)) => settle(
                JobOutcome::Failed { kind: FailureKind::Panic, message: panic_message(&*panic) },
                control.reason(),
            ),
            Err(_) => settle(
                JobOutcome::Failed {
                    kind: FailureKind::Timeout,
                    message: format!("job timed out after {}", humantime_like(timeout)),
                },
                control.reason(),
            ),
        },
        () = stopped_past_grace(control, rt.config.cancel_grace) => match control.reason() {
            Some(CancelReason::Shutdown) => Resolution::Interrupted(
                "the worker shut down before the job finished".into(),
            ),
            _ => Resolution::Outcome(JobOutcome::Cancelled(
                "cancelled while running; the handler did not stop within the grace period".into(),
            )),
        },
    }
}

/// A failure after a stop request is the stop taking effect, not a failure of the job. So is a
/// cancel after a shutdown: a handler cannot tell the two stops apart (`ctx.cancelled()` fires
/// for both), and one that answers either with a cancel must not end the job for good on every
/// deploy. The job is handed back instead; if its user did ask for a cancel meanwhile, the
/// hand-back sees the request and cancels it.
fn settle(outcome: JobOutcome, reason: Option<CancelReason>) -> Resolution {
    match (outcome, reason) {
        (JobOutcome::Failed { .. }, Some(CancelReason::Requested)) => {
            Resolution::Outcome(JobOutcome::Cancelled("cancelled while running".into()))
        }
        (
            JobOutcome::Failed { message, .. } | JobOutcome::Cancelled(message),
            Some(CancelReason::Shutdown),
        ) => Resolution::Interrupted(format!("worker shut down while the job ran: {message}")),
        (outcome, _) => Resolution::Outcome(outcome),
    }
}

async fn stopped_past_grace(control: &JobControl, grace: std::time::Duration) {
    control.token().cancelled().await;
    tokio::time::sleep(grace).await;
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    format!("handler panicked: {}", panic_text(panic))
}

/// The message a panic carried (`panic!("…")`'s text), or a stand-in for another payload.
pub(crate) fn panic_text(panic: &(dyn std::any::Any + Send)) -> &str {
    common::report::panic_text(panic).unwrap_or("non-string panic payload")
}

fn humantime_like(d: std::time::Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_after_stop_requests_are_not_failures() {
        let failed = JobOutcome::failed("ctx cancelled");
        assert_eq!(
            settle(failed.clone(), Some(CancelReason::Requested)),
            Resolution::Outcome(JobOutcome::Cancelled("cancelled while running".into()))
        );
        assert!(matches!(
            settle(failed.clone(), Some(CancelReason::Shutdown)),
            Resolution::Interrupted(_)
        ));
        assert_eq!(settle(failed.clone(), None), Resolution::Outcome(failed));
        // A handler answering the stop with a cancel: for a user's cancel it is one, for a
        // shutdown the job is handed back.
        let cancel = JobOutcome::Cancelled("stopped".into());
        assert_eq!(
            settle(cancel.clone(), Some(CancelReason::Requested)),
            Resolution::Outcome(cancel.clone())
        );
        assert!(matches!(
            settle(cancel.clone(), Some(CancelReason::Shutdown)),
            Resolution::Interrupted(_)
        ));
        assert_eq!(settle(cancel.clone(), None), Resolution::Outcome(cancel));
        // Success stands even if a stop was requested meanwhile.
        assert_eq!(
            settle(JobOutcome::Completed, Some(CancelReason::Requested)),
            Resolution::Outcome(JobOutcome::Completed)
        );
    }

    #[test]
    fn panic_messages() {
        assert_eq!(panic_message(&"boom"), "handler panicked: boom");
        assert_eq!(panic_message(&String::from("bad")), "handler panicked: bad");
        assert_eq!(
            panic_message(&42_u8),
            "handler panicked: non-string panic payload"
        );
    }
}
