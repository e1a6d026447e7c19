//! `GET /v1/jobs/{id}` and `DELETE /v1/jobs/{id}` (cancel) for the caller's own jobs.

use axum::extract::State;
use axum::{Extension, Json};
use queue::{CancelResult, JobRow};
use serde::Serialize;
use utoipa::ToSchema;

use super::JobView;
use crate::auth::AuthUser;
use crate::extract::IdPath;
use crate::middleware::{self, TimeoutWatch};
use crate::problem::Problem;
use crate::state::AppState;

/// What a cancel request did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Cancellation {
    /// The job was waiting and is now cancelled; its quota reservation was released.
    Cancelled,
    /// The job is running and was told to stop; it ends `cancelled` unless it finishes first.
    Requested,
    /// The job had already finished; nothing changed.
    AlreadyFinal,
}

/// Response of `DELETE /v1/jobs/{id}`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CancelResponse {
    pub cancellation: Cancellation,
    pub job: JobView,
}

fn parse_id(id: &str) -> Result<i64, Problem> {
    super::path_job_id(id).ok_or_else(|| Problem::not_found(format!("no job `{id}`")))
}

/// The job `id` if it is the caller's.
async fn owned_job(state: &AppState, user: &AuthUser, id: i64) -> Result<JobRow, Problem> {
    super::users_job(state, user.user_id, id)
        .await?
        .ok_or_else(|| Problem::not_found(format!("no job `{id}`")))
}

/// A job of the caller's: state, queue, attempts, timestamps, and its result or last error.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}",
    tag = "jobs",
    params(("id" = i64, Path, description = "The job id")),
    responses((status = 200, description = "The job", body = JobView)),
    security(("api_key" = []))
)]
pub async fn get(
    State(state): State<AppState>,
    user: AuthUser,
    IdPath(id): IdPath,
) -> Result<Json<JobView>, Problem> {
    let job = owned_job(&state, &user, parse_id(&id)?).await?;
    Ok(Json(JobView::from(&job)))
}

/// Cancel a job of the caller's. A waiting job is cancelled at once and its quota reservation
/// released in the same transaction; a running job is told to stop.
#[utoipa::path(
    delete,
    path = "/v1/jobs/{id}",
    tag = "jobs",
    params(("id" = i64, Path, description = "The job id")),
    responses((status = 200, description = "What the cancel did", body = CancelResponse)),
    security(("api_key" = []))
)]
pub async fn cancel(
    State(state): State<AppState>,
    user: AuthUser,
    IdPath(id): IdPath,
    watch: Option<Extension<TimeoutWatch>>,
) -> Result<Json<CancelResponse>, Problem> {
    let id = parse_id(&id)?;
    let mut tx = queue::begin::begin(&state.pool).await?;
    let owned: Option<(i64,)> =
        sqlx::query_as("SELECT id FROM fairlane_job WHERE id = $1 AND user_id = $2")
            .bind(id)
            .bind(user.user_id)
            .fetch_optional(&mut *tx)
            .await?;
    if owned.is_none() {
        return Err(Problem::not_found(format!("no job `{id}`")));
    }
    let result = state
        .queue
        .cancel_tx(&mut tx, id)
        .await?
        .ok_or_else(|| Problem::not_found(format!("no job `{id}`")))?;
    let cancellation = match &result {
        // Nobody will run the job now: the client's hooks released its reservation and failed
        // the record it would have filled (dropping any staged result), in this transaction.
        CancelResult::Cancelled(_) => Cancellation::Cancelled,
        CancelResult::Requested(_) => Cancellation::Requested,
        CancelResult::AlreadyFinal(_) => Cancellation::AlreadyFinal,
    };
    // A failed COMMIT may have taken effect: the answer says so, and names the job to look up,
    // as for an enqueue batch's (docs/web.md).
    middleware::committing(watch.as_ref(), tx.commit())
        .await
        .map_err(|e| Problem::commit_outcome_unknown(&e).with("job_id", id))?;
    Ok(Json(CancelResponse {
        cancellation,
        job: JobView::from(result.job()),
    }))
}
