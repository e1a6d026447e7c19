//! The `analyses` record as the analysis handler sees it: claim it, then stage the result.

use sqlx::PgPool;
use uuid::Uuid;

use crate::{Refusal, WorkState, read_refusal};

/// An analysis record claimed by its job.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct AnalysisRecord {
    pub id: Uuid,
    /// `None` for a system (scheduler) re-analysis.
    pub user_id: Option<Uuid>,
    /// The normalised repository URL.
    pub repository: String,
    /// The ref as requested (`None` = the default branch).
    pub requested_ref: Option<String>,
    /// The commit to analyse; `None` for a system re-analysis (the handler resolves it).
    pub commit: Option<String>,
    pub state: WorkState,
    pub job_id: Option<i64>,
}

const COLUMNS: &str = "id, user_id, repository, requested_ref, commit, state, job_id";

/// Marks the analysis `running` for `job_id` and returns it. A record without a job is linked to
/// this one; a record of another job, or one already `completed`/`failed`, is refused.
pub async fn claim(
    pool: &PgPool,
    analysis_id: Uuid,
    job_id: i64,
) -> Result<Result<AnalysisRecord, Refusal>, sqlx::Error> {
    let claimed: Option<AnalysisRecord> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "UPDATE analyses SET state = 'running', updated_at = now(), job_id = $2 \
         WHERE id = $1 AND state IN ('pending', 'running') \
           AND (job_id IS NULL OR job_id = $2) \
         RETURNING {COLUMNS}"
    )))
    .bind(analysis_id)
    .bind(job_id)
    .fetch_optional(pool)
    .await?;
    if let Some(record) = claimed {
        return Ok(Ok(record));
    }
    Ok(Err(
        read_refusal(pool, "analyses", analysis_id, job_id).await?
    ))
}

/// Stores the analysed commit and the result on a `running` record of `job_id`, which stays
/// `running` until [`crate::RecordHook`] settles it with the job. A user's record keeps its
/// commit: staging a different one is refused. A system re-analysis's takes the commit its
/// latest attempt resolved. Returns whether the record was updated.
/// `result` is JSON text, serialized by the caller off the async workers (an inventory can be
/// tens of megabytes).
pub async fn stage(
    pool: &PgPool,
    analysis_id: Uuid,
    job_id: i64,
    commit: &str,
    result: &str,
) -> Result<bool, sqlx::Error> {
    let updated = crate::with_buffers_given_back(pool, async |conn| {
        sqlx::query(
            "UPDATE analyses SET commit = $3, result = $4::jsonb, error = NULL, \
                    updated_at = now() \
             WHERE id = $1 AND job_id = $2 AND state = 'running' \
               AND (commit IS NULL OR commit = $3 OR user_id IS NULL)",
        )
        .bind(analysis_id)
        .bind(job_id)
        .bind(commit)
        .bind(result)
        .execute(conn)
        .await
    })
    .await?;
    Ok(updated.rows_affected() == 1)
}
