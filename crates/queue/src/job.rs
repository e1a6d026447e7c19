//! The job row as stored in `fairlane_job`, its states, and the per-attempt error record.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// A job's id (the `fairlane_job.id` identity).
pub type JobId = i64;

/// Where a job is in its life. The last three are final.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type)]
#[sqlx(type_name = "fairlane_job_state", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Available,
    Scheduled,
    Running,
    Retryable,
    Completed,
    Cancelled,
    Discarded,
}

impl JobState {
    pub const ALL: [JobState; 7] = [
        JobState::Available,
        JobState::Scheduled,
        JobState::Running,
        JobState::Retryable,
        JobState::Completed,
        JobState::Cancelled,
        JobState::Discarded,
    ];

    /// Whether the job will never run again.
    pub const fn is_final(self) -> bool {
        matches!(
            self,
            JobState::Completed | JobState::Cancelled | JobState::Discarded
        )
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            JobState::Available => "available",
            JobState::Scheduled => "scheduled",
            JobState::Running => "running",
            JobState::Retryable => "retryable",
            JobState::Completed => "completed",
            JobState::Cancelled => "cancelled",
            JobState::Discarded => "discarded",
        }
    }
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One row of `fairlane_job`.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct JobRow {
    pub id: JobId,
    pub state: JobState,
    pub queue: String,
    pub kind: String,
    pub args: serde_json::Value,
    pub user_id: Option<Uuid>,
    pub priority: i16,
    pub attempt: i16,
    pub max_attempts: i16,
    pub scheduled_at: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    pub attempted_at: Option<DateTime<Utc>>,
    pub finalized_at: Option<DateTime<Utc>>,
    pub attempted_by: Vec<String>,
    pub errors: serde_json::Value,
    pub metadata: serde_json::Value,
    pub output: Option<serde_json::Value>,
    pub unique_key: Option<String>,
}

impl JobRow {
    /// The recorded per-attempt errors, oldest first. Entries that do not parse are skipped.
    pub fn attempt_errors(&self) -> Vec<AttemptError> {
        self.errors
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|e| serde_json::from_value(e.clone()).ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// How many times the job was snoozed (by its handler or by middleware such as fairness).
    pub fn snoozes(&self) -> i64 {
        self.metadata
            .get("snoozes")
            .and_then(serde_json::Value::as_i64)
            .unwrap_or(0)
    }

    /// The worker that ran (or runs) the latest attempt.
    pub fn last_worker(&self) -> Option<&str> {
        self.attempted_by.last().map(String::as_str)
    }
}

/// What kind of failure an attempt ended in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// The handler returned an error.
    Error,
    /// The handler panicked.
    Panic,
    /// The handler ran past its timeout.
    Timeout,
    /// No handler is registered for the job's kind in the worker that fetched it.
    UnknownKind,
    /// The job's arguments did not decode into the handler's argument type.
    InvalidArgs,
    /// The worker running it stopped heartbeating and the job was rescued.
    Rescued,
    /// The worker shut down before the job finished; the attempt was given back.
    Interrupted,
}

/// One failed attempt, as kept in `fairlane_job.errors`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptError {
    pub attempt: i16,
    pub at: DateTime<Utc>,
    pub kind: FailureKind,
    /// What went wrong, in words fit for the job's owner: no host or process names.
    pub error: String,
    /// The worker that ran (or fetched) the attempt, for operators; absent from errors recorded
    /// before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_states() {
        let finals: Vec<_> = JobState::ALL.iter().filter(|s| s.is_final()).collect();
        assert_eq!(
            finals,
            [
                &JobState::Completed,
                &JobState::Cancelled,
                &JobState::Discarded
            ]
        );
    }

    #[test]
    fn attempt_error_json_shape() {
        let e = AttemptError {
            attempt: 2,
            at: DateTime::from_timestamp(0, 0).unwrap(),
            kind: FailureKind::UnknownKind,
            error: "boom".into(),
            worker: Some("analysis-host-1-ab12".into()),
        };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["kind"], "unknown_kind");
        assert_eq!(v["attempt"], 2);
        assert_eq!(v["worker"], "analysis-host-1-ab12");
        assert_eq!(serde_json::from_value::<AttemptError>(v).unwrap(), e);
        // An error recorded before the worker was kept apart reads without one.
        let old: AttemptError = serde_json::from_value(serde_json::json!(
            {"attempt": 1, "at": "2026-01-01T00:00:00Z", "kind": "error", "error": "x"}
        ))
        .unwrap();
        assert_eq!(old.worker, None);
    }
}
