//! The diagnostic `sleep` job kind (enabled with `WORKER_SLEEP_JOBS=true`): sleeps, optionally
//! fails, and records when and where it ran in its output. Operators use it for smoke and load
//! tests of a deployment; Fairlane's own tests use it to observe concurrency across processes.

use std::time::Duration;

use chrono::{DateTime, Utc};
use queue::{JobContext, JobError, Workers};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SleepArgs {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_id: Option<Uuid>,
    pub ms: u64,
    /// Fail instead of succeeding (exercises billing and retries).
    #[serde(default)]
    pub fail: bool,
}

impl queue::JobArgs for SleepArgs {
    const KIND: &'static str = "sleep";
}

/// What a `sleep` job records in its output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SleepOutput {
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    pub worker: String,
}

pub fn register(workers: &mut Workers) {
    workers.register_fn::<SleepArgs, _, _>(run);
}

async fn run(ctx: JobContext, args: SleepArgs) -> Result<(), JobError> {
    let started_at = Utc::now();
    tokio::select! {
        () = tokio::time::sleep(Duration::from_millis(args.ms)) => {}
        () = ctx.cancelled() => return Err(JobError::msg("stopped")),
    }
    if args.fail {
        return Err(JobError::msg("sleep job asked to fail"));
    }
    ctx.set_output(&SleepOutput {
        started_at,
        finished_at: Utc::now(),
        worker: ctx.worker_id().to_owned(),
    })
    .map_err(JobError::from)?;
    Ok(())
}
