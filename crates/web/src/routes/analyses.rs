//! `POST /v1/analyses` (cache-first, then quota reservation + analysis row + job in one
//! transaction) and `GET /v1/analyses/{id}`.

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use common::{AnalysisArgs, Service};
use http::StatusCode;
use inventory::{FetchError, RepoUrl, UrlError};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use super::{ANALYSIS_COLUMNS, AnalysisView, JobSummary, is_object_id};
use crate::auth::AuthUser;
use crate::extract::{ApiJson, IdPath};
use crate::problem::Problem;
use crate::state::AppState;

/// Request body of `POST /v1/analyses`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateAnalysis {
    /// The repository: `https://host/owner/repository` (public hosts only).
    #[schema(example = "https://github.com/rust-lang/log.git")]
    pub repository: String,
    /// Branch, tag or full commit id; omitted or `null`: the default branch.
    #[serde(rename = "ref", default)]
    #[schema(example = "0123456789abcdef0123456789abcdef01234567")]
    pub git_ref: Option<String>,
}

/// Response of `POST /v1/analyses` when a job was enqueued.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AnalysisAccepted {
    /// The analysis record the job will fill (`GET /v1/analyses/{id}`).
    pub analysis_id: Uuid,
    /// The commit the ref resolved to.
    pub commit: String,
    pub job: JobSummary,
}

fn refused(e: &UrlError) -> Problem {
    match e {
        UrlError::Resolution { .. }
        | UrlError::ResolutionTimedOut { .. }
        | UrlError::NoAddresses { .. } => Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "repository_unreachable",
            format!("repository: {e}"),
        ),
        _ => Problem::validation(format!("repository: {e}")).with("field", "repository"),
    }
}

fn fetch_problem(e: &FetchError) -> Problem {
    let (code, field) = match e {
        FetchError::InvalidRef { .. } => ("validation_failed", "ref"),
        FetchError::RefNotFound { .. } | FetchError::EmptyRepository => ("ref_not_found", "ref"),
        FetchError::RepositoryNotFound => ("repository_not_found", "repository"),
        FetchError::Refused { .. } => ("validation_failed", "repository"),
        FetchError::Io { .. } => return Problem::internal(e),
        _ => ("repository_unreachable", "repository"),
    };
    Problem::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        code,
        format!("{field}: {e}"),
    )
    .with("field", field)
}

/// The commit `git_ref` names in `repo`: a full commit id as is (no network), anything else
/// through `git ls-remote` after the host passed the DNS check.
async fn resolve_commit(
    state: &AppState,
    repo: &RepoUrl,
    git_ref: Option<&str>,
) -> Result<String, Problem> {
    if let Some(r) = git_ref {
        if is_object_id(r) {
            return Ok(r.to_ascii_lowercase());
        }
        inventory::fetch::validate_ref_name(r).map_err(|e| fetch_problem(&e))?;
    }
    let vetted = repo
        .clone()
        .vet(&state.url_policy)
        .await
        .map_err(|e| refused(&e))?;
    let resolved = inventory::resolve_ref(&vetted, git_ref, &state.resolve_limits)
        .await
        .map_err(|e| fetch_problem(&e))?;
    Ok(resolved.commit)
}

/// The caller's own completed analysis of `repository` at `commit`, or a copy of anyone's (the
/// inventory of a public commit is the same for everybody), made for the caller in the same
/// statement. `None`: nothing cached.
async fn cached(
    state: &AppState,
    user_id: Uuid,
    repository: &str,
    commit: &str,
    git_ref: Option<&str>,
) -> Result<Option<AnalysisView>, Problem> {
    let sql = format!(
        "WITH own AS ( \
           SELECT {ANALYSIS_COLUMNS} FROM analyses \
           WHERE user_id = $1 AND repository = $2 AND commit = $3 AND state = 'completed' \
           ORDER BY completed_at DESC LIMIT 1 \
         ), source AS ( \
           SELECT id, result FROM analyses \
           WHERE repository = $2 AND commit = $3 AND state = 'completed' AND cached_from IS NULL \
             AND NOT EXISTS (SELECT 1 FROM own) \
         ), copied AS ( \
           INSERT INTO analyses (user_id, repository, requested_ref, commit, state, cached_from, \
                                 result, completed_at) \
           SELECT $1, $2, $4, $3, 'completed', s.id, s.result, now() FROM source s \
           RETURNING {ANALYSIS_COLUMNS} \
         ) \
         SELECT * FROM own UNION ALL SELECT * FROM copied"
    );
    let row: Option<AnalysisView> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(user_id)
        .bind(repository)
        .bind(commit)
        .bind(git_ref)
        .fetch_optional(&state.pool)
        .await?;
    Ok(row)
}

/// Enqueue an analysis of a repository at a ref.
///
/// Cache-first: if this repository was already analysed at the same commit, the stored result is
/// returned with `200` and no job is created, no quota reserved or billed. Otherwise one unit of
/// `analysis` quota is reserved and a job is enqueued (`202`); the unit is billed only when the
/// job completes.
#[utoipa::path(
    post,
    path = "/v1/analyses",
    tag = "analyses",
    request_body = CreateAnalysis,
    responses(
        (status = 200, description = "Served from the cache: no job, no quota used", body = AnalysisView),
        (status = 202, description = "Job enqueued", body = AnalysisAccepted,
            headers(("Location" = String, description = "The job's URL"))),
    ),
    security(("api_key" = []))
)]
pub async fn create(
    State(state): State<AppState>,
    user: AuthUser,
    ApiJson(body): ApiJson<CreateAnalysis>,
) -> Result<Response, Problem> {
    let repo =
        inventory::check_url(&body.repository, &state.url_policy).map_err(|e| refused(&e))?;
    let git_ref = match body.git_ref.as_deref().map(str::trim) {
        Some("") => {
            return Err(Problem::validation(
                "ref: must not be empty; omit it (or send null) for the default branch",
            )
            .with("field", "ref"));
        }
        other => other,
    };
    let commit = resolve_commit(&state, &repo, git_ref).await?;
    let repository = repo.as_str().to_owned();
    if let Some(view) = cached(&state, user.user_id, &repository, &commit, git_ref).await? {
        return Ok((StatusCode::OK, Json(view)).into_response());
    }

    let analysis_id = Uuid::new_v4();
    let args = AnalysisArgs {
        user_id: Some(user.user_id),
        analysis_id,
        repository: repository.clone(),
        git_ref: Some(commit.clone()),
    };
    let (mut tx, inserted) =
        crate::enqueue_reserved(&state, user.user_id, Service::Analysis, &args).await?;
    sqlx::query(
        "INSERT INTO analyses (id, user_id, repository, requested_ref, commit, job_id) \
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(analysis_id)
    .bind(user.user_id)
    .bind(&repository)
    .bind(git_ref)
    .bind(&commit)
    .bind(inserted.job.id)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;

    let accepted = AnalysisAccepted {
        analysis_id,
        commit,
        job: JobSummary::from(&inserted.job),
    };
    Ok(super::accepted_job(accepted, inserted.job.id))
}

/// An analysis of the caller's.
#[utoipa::path(
    get,
    path = "/v1/analyses/{id}",
    tag = "analyses",
    params(("id" = Uuid, Path, description = "The analysis id")),
    responses((status = 200, description = "The analysis", body = AnalysisView)),
    security(("api_key" = []))
)]
pub async fn get(
    State(state): State<AppState>,
    user: AuthUser,
    IdPath(id): IdPath,
) -> Result<Json<AnalysisView>, Problem> {
    let not_found = || Problem::not_found(format!("no analysis `{id}`"));
    let Ok(analysis_id) = id.parse::<Uuid>() else {
        return Err(not_found());
    };
    let sql = format!("SELECT {ANALYSIS_COLUMNS} FROM analyses WHERE id = $1 AND user_id = $2");
    let row: Option<AnalysisView> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(analysis_id)
        .bind(user.user_id)
        .fetch_optional(&state.pool)
        .await?;
    row.map(Json).ok_or_else(not_found)
}
