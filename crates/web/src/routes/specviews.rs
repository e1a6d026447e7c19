//! `POST /v1/specviews` (reserve `specview` quota + specview row + job in one transaction) and
//! `GET /v1/specviews/{id}` (JSON, or Markdown with `Accept: text/markdown`).

use axum::Extension;
use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, HeaderValue};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use super::{JobSummary, SPECVIEW_COLUMNS, SpecviewView};
use crate::auth::AuthUser;
use crate::enqueue::{EnqueueRequest, Enqueued, NewRecord, enqueue};
use crate::extract::{ApiJson, IdPath};
use crate::middleware::TimeoutWatch;
use crate::problem::Problem;
use crate::state::AppState;

/// Request body of `POST /v1/specviews`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSpecview {
    /// A completed analysis of the caller's.
    pub analysis_id: Uuid,
}

/// Response of `POST /v1/specviews`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SpecviewAccepted {
    /// The specview record the job will fill (`GET /v1/specviews/{id}`).
    pub specview_id: Uuid,
    pub analysis_id: Uuid,
    pub job: JobSummary,
}

/// Enqueue a behaviour specification of a completed analysis (one unit of `specview` quota).
#[utoipa::path(
    post,
    path = "/v1/specviews",
    tag = "specviews",
    request_body = CreateSpecview,
    responses(
        (status = 202, description = "Job enqueued", body = SpecviewAccepted,
            headers(("Location" = String, description = "The job's URL"))),
    ),
    security(("api_key" = []))
)]
pub async fn create(
    State(state): State<AppState>,
    user: AuthUser,
    watch: Option<Extension<TimeoutWatch>>,
    ApiJson(body): ApiJson<CreateSpecview>,
) -> Result<Response, Problem> {
    let analysis: Option<(String,)> =
        sqlx::query_as("SELECT state::text FROM analyses WHERE id = $1 AND user_id = $2")
            .bind(body.analysis_id)
            .bind(user.user_id)
            .fetch_optional(&state.pool)
            .await?;
    match analysis {
        None => {
            return Err(Problem::not_found(format!(
                "no analysis `{}`",
                body.analysis_id
            )));
        }
        Some((s,)) if s != "completed" => {
            return Err(Problem::conflict(format!(
                "analysis `{}` is {s}; a specview needs a completed analysis",
                body.analysis_id
            )));
        }
        Some(_) => {}
    }
    let specview_id = Uuid::now_v7();
    let record = NewRecord::Specview {
        specview_id,
        analysis_id: body.analysis_id,
    };
    match enqueue(
        &state.enqueuer,
        EnqueueRequest::new(user.user_id, record),
        watch,
    )
    .await?
    {
        Enqueued::Accepted(job) => {
            let job_id = job.id;
            Ok(super::accepted_job(
                SpecviewAccepted {
                    specview_id,
                    analysis_id: body.analysis_id,
                    job: job.into(),
                },
                job_id,
            ))
        }
        Enqueued::Cached(_) => Err(Problem::internal(&"a specview was answered from the cache")),
    }
}

fn wants_markdown(headers: &HeaderMap) -> bool {
    headers
        .get_all(http::header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|v| {
            v.split(';')
                .next()
                .is_some_and(|m| m.trim().eq_ignore_ascii_case("text/markdown"))
        })
}

/// A specview of the caller's, as JSON or (with `Accept: text/markdown`) as Markdown.
#[utoipa::path(
    get,
    path = "/v1/specviews/{id}",
    tag = "specviews",
    params(("id" = Uuid, Path, description = "The specview id")),
    responses(
        (status = 200, description = "The specview", content(
            (SpecviewView = "application/json"),
            (String = "text/markdown"),
        )),
    ),
    security(("api_key" = []))
)]
pub async fn get(
    State(state): State<AppState>,
    user: AuthUser,
    headers: HeaderMap,
    IdPath(id): IdPath,
) -> Result<Response, Problem> {
    let not_found = || Problem::not_found(format!("no specview `{id}`"));
    let Ok(specview_id) = id.parse::<Uuid>() else {
        return Err(not_found());
    };
    let sql = format!("SELECT {SPECVIEW_COLUMNS} FROM specviews WHERE id = $1 AND user_id = $2");
    let row: Option<SpecviewView> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(specview_id)
        .bind(user.user_id)
        .fetch_optional(&state.pool)
        .await?;
    let view = row.ok_or_else(not_found)?;
    if wants_markdown(&headers) {
        let Some(markdown) = view.markdown else {
            return Err(Problem::conflict(format!(
                "specview `{id}` has no Markdown yet (it is {})",
                serde_json::to_value(view.state)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default()
            )));
        };
        let mut response = markdown.into_response();
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/markdown; charset=utf-8"),
        );
        return Ok(response);
    }
    Ok(Json(view).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_negotiation() {
        let mut h = HeaderMap::new();
        assert!(!wants_markdown(&h));
        h.insert(
            http::header::ACCEPT,
            HeaderValue::from_static("application/json, text/markdown;q=0.5"),
        );
        assert!(wants_markdown(&h));
        h.insert(http::header::ACCEPT, HeaderValue::from_static("*/*"));
        assert!(!wants_markdown(&h));
    }
}
