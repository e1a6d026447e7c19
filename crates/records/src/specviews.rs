//! The `specviews` record as the specview handler sees it: claim it (with the analysis it is
//! generated from), then stage the specification.

use sqlx::PgPool;
use uuid::Uuid;

use crate::{Refusal, WorkState, read_refusal};

/// A specview record claimed by its job, with its analysis.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct SpecviewRecord {
    pub id: Uuid,
    pub user_id: Option<Uuid>,
    pub analysis_id: Uuid,
    pub job_id: Option<i64>,
    /// The analysis's state (a specview needs `completed`).
    pub analysis_state: WorkState,
    pub repository: String,
    pub commit: Option<String>,
    /// The analysis's stored result (`inventory::Analysis` as JSON text), once completed. Text,
    /// not a decoded value: an inventory can be tens of megabytes, and the caller parses it off
    /// the async workers, straight into its own type.
    pub analysis_result: Option<String>,
}

/// Marks the specview `running` for `job_id` and returns it with its analysis. A record without
/// a job is linked to this one; a record of another job, or one already `completed`/`failed`, is
/// refused.
pub async fn claim(
    pool: &PgPool,
    specview_id: Uuid,
    job_id: i64,
) -> Result<Result<SpecviewRecord, Refusal>, sqlx::Error> {
    // The analysis's inventory comes with it: up to 64 MiB.
    let claimed: Option<SpecviewRecord> = crate::with_buffers_given_back(pool, async |conn| {
        sqlx::query_as(concat!(
            "WITH claimed AS ( \
           UPDATE specviews s SET state = 'running', updated_at = now(), job_id = $2 \
           WHERE id = $1 AND state IN ('pending', 'running') \
             AND (job_id IS NULL OR job_id = $2) \
             AND EXISTS (SELECT 1 FROM analyses o \
                         WHERE o.id = s.analysis_id AND o.user_id IS NOT DISTINCT FROM s.user_id) \
           RETURNING id, user_id, analysis_id, job_id \
         ) \
         SELECT c.id, c.user_id, c.analysis_id, c.job_id, a.state AS analysis_state, \
                a.repository, a.commit, \
                CASE WHEN a.state = 'completed' THEN a.result::text END AS analysis_result \
         FROM claimed c JOIN ",
            crate::analyses_with_inventory!("a"),
            " ON a.id = c.analysis_id",
        ))
        .bind(specview_id)
        .bind(job_id)
        .fetch_optional(conn)
        .await
    })
    .await?;
    if let Some(record) = claimed {
        return Ok(Ok(record));
    }
    // Only the API creates specviews, of the caller's own analyses; a record made another way
    // never renders someone else's.
    let foreign: Option<bool> = sqlx::query_scalar(
        "SELECT a.user_id IS DISTINCT FROM s.user_id FROM specviews s \
         JOIN analyses a ON a.id = s.analysis_id WHERE s.id = $1",
    )
    .bind(specview_id)
    .fetch_optional(pool)
    .await?;
    if foreign == Some(true) {
        return Ok(Err(Refusal::OtherUsersAnalysis));
    }
    Ok(Err(
        read_refusal(pool, "specviews", specview_id, job_id).await?
    ))
}

/// Stores the specification (structured and as Markdown) on a `running` record of `job_id`,
/// which stays `running` until [`crate::RecordHook`] settles it with the job. Returns whether the
/// record was updated. `result` is JSON text, serialized by the caller off the async workers.
pub async fn stage(
    pool: &PgPool,
    specview_id: Uuid,
    job_id: i64,
    result: &str,
    markdown: &str,
) -> Result<bool, sqlx::Error> {
    let updated = crate::with_buffers_given_back(pool, async |conn| {
        sqlx::query(
            "UPDATE specviews SET result = $3::jsonb, markdown = $4, error = NULL, \
                    updated_at = now() \
             WHERE id = $1 AND job_id = $2 AND state = 'running'",
        )
        .bind(specview_id)
        .bind(job_id)
        .bind(result)
        .bind(markdown)
        .execute(conn)
        .await
    })
    .await?;
    Ok(updated.rows_affected() == 1)
}
