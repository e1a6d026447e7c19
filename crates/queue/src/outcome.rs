//! How a job attempt ended, as returned by handlers and middleware.

use std::time::Duration;

use crate::error::BoxError;
use crate::job::FailureKind;

/// The end of one attempt, decided by a handler or by a middleware that did not call the handler.
#[derive(Debug, Clone, PartialEq)]
pub enum JobOutcome {
    /// Done; the job becomes `completed`.
    Completed,
    /// The attempt failed; retried with backoff until `max_attempts`, then `discarded`.
    Failed { kind: FailureKind, message: String },
    /// Run again after this long, without using up an attempt (back to `scheduled`).
    Snoozed(Duration),
    /// Stop for good; the job becomes `cancelled`.
    Cancelled(String),
}

impl JobOutcome {
    pub fn failed(message: impl Into<String>) -> Self {
        JobOutcome::Failed {
            kind: FailureKind::Error,
            message: message.into(),
        }
    }

    /// The label used in metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            JobOutcome::Completed => "completed",
            JobOutcome::Failed {
                kind: FailureKind::Panic,
                ..
            } => "panicked",
            JobOutcome::Failed {
                kind: FailureKind::Timeout,
                ..
            } => "timed_out",
            JobOutcome::Failed { .. } => "failed",
            JobOutcome::Snoozed(_) => "snoozed",
            JobOutcome::Cancelled(_) => "cancelled",
        }
    }
}

/// The longest snooze: 100 years. PostgreSQL's timestamps end in the year 294276, and a
/// longer snooze would fail its end and be recorded as a failure.
pub const MAX_SNOOZE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// What a handler returns instead of success.
#[derive(Debug)]
pub enum JobError {
    /// A failure: retry by the normal rules.
    Failed(BoxError),
    /// Not now: try again after the duration, without consuming an attempt. A snooze longer
    /// than [`MAX_SNOOZE`] (`Duration::MAX` for "park it") is cut to it when the job's end is
    /// written.
    Snooze(Duration),
    /// Give up for good.
    Cancel(String),
}

impl JobError {
    pub fn msg(message: impl Into<String>) -> Self {
        JobError::Failed(message.into().into())
    }

    pub(crate) fn into_outcome(self) -> JobOutcome {
        match self {
            JobError::Failed(e) => JobOutcome::Failed {
                kind: FailureKind::Error,
                message: error_chain(&*e),
            },
            JobError::Snooze(d) => JobOutcome::Snoozed(d),
            JobError::Cancel(reason) => JobOutcome::Cancelled(reason),
        }
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for JobError {
    fn from(e: E) -> Self {
        JobError::Failed(Box::new(e))
    }
}

/// Lets handlers written with `anyhow` use `?`.
pub fn from_anyhow(e: anyhow::Error) -> JobError {
    JobError::Failed(e.into())
}

/// `error: cause: cause`, the way anyhow prints `{:#}`.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.ends_with(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn failures_keep_their_cause_chain() {
        let e: JobError = Outer(std::io::Error::other("disk full")).into();
        assert_eq!(
            e.into_outcome(),
            JobOutcome::Failed {
                kind: FailureKind::Error,
                message: "outer: disk full".into()
            }
        );
    }

    #[test]
    fn anyhow_errors_convert() {
        let e = from_anyhow(anyhow::anyhow!("root").context("while fetching"));
        match e.into_outcome() {
            JobOutcome::Failed { message, .. } => assert_eq!(message, "while fetching: root"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn labels() {
        assert_eq!(JobOutcome::Completed.label(), "completed");
        assert_eq!(
            JobOutcome::Failed {
                kind: FailureKind::Timeout,
                message: String::new()
            }
            .label(),
            "timed_out"
        );
        assert_eq!(JobOutcome::Snoozed(Duration::ZERO).label(), "snoozed");
    }
}
