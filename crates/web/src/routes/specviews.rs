//! `POST /v1/specviews` (reserve `specview` quota + specview row + job in one transaction) and
//! `GET /v1/specviews/{id}` (JSON, or Markdown with `Accept: text/markdown`), and the caller's
//! list, `GET /v1/specviews`.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use http::{HeaderMap, HeaderValue};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use super::listing::{self, Cursor, Filter};
use super::{
    JobSummary, MARKDOWN_COLUMNS, MARKDOWN_COLUMNS_WEIGHED, MarkdownRow, SPECVIEW_COLUMNS,
    SPECVIEW_COLUMNS_WEIGHED, SpecviewSummary, SpecviewView, WorkState,
};
use crate::auth::AuthUser;
use crate::conditional::{self, IfNoneMatch};
use crate::enqueue::{EnqueueRequest, Enqueued, NewRecord, enqueue};
use crate::extract::{ApiJson, ApiQuery, IdPath};
use crate::large_reads::{Asked, Read};
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

/// The query of `GET /v1/specviews`.
#[derive(Debug, Clone, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListSpecviews {
    /// Items per page, 1 to 100 (default 20).
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<u32>,
    /// Where the page starts: the `next_cursor` of the page before (omit for the newest).
    pub cursor: Option<String>,
    /// Only records in this state.
    pub state: Option<WorkState>,
    /// Only specviews of this analysis.
    pub analysis_id: Option<Uuid>,
}

/// A page of the caller's specviews.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SpecviewPage {
    /// Newest first, without their results (`GET /v1/specviews/{id}` has one).
    pub items: Vec<SpecviewSummary>,
    /// The `cursor` of the next page; `null` on the last one.
    pub next_cursor: Option<String>,
}

/// The caller's specviews, newest first, a page at a time (as `GET /v1/analyses` lists
/// analyses).
#[utoipa::path(
    get,
    path = "/v1/specviews",
    tag = "specviews",
    params(ListSpecviews),
    responses((status = 200, description = "A page of the caller's specviews", body = SpecviewPage)),
    security(("api_key" = []))
)]
pub async fn list(
    State(state): State<AppState>,
    user: AuthUser,
    ApiQuery(query): ApiQuery<ListSpecviews>,
) -> Result<Json<SpecviewPage>, Problem> {
    let size = listing::page_size(query.limit)?;
    let after = query.cursor.as_deref().map(Cursor::decode).transpose()?;
    let filters: Vec<Filter> = [
        query.state.map(Filter::State),
        query.analysis_id.map(Filter::Analysis),
    ]
    .into_iter()
    .flatten()
    .collect();
    let (items, next_cursor) =
        listing::page::<SpecviewSummary>(&state.pool, user.user_id, &filters, after, size).await?;
    Ok(Json(SpecviewPage { items, next_cursor }))
}

/// Enqueue a behaviour specification of a completed analysis (one unit of `specview` quota).
///
/// If the caller already has a specview of this analysis in flight (`pending` or `running`),
/// that one and its job are the answer: nothing new is enqueued or reserved.
#[utoipa::path(
    post,
    path = "/v1/specviews",
    tag = "specviews",
    request_body = CreateSpecview,
    responses(
        (status = 202, description = "Job enqueued; or the caller's own specview of this analysis is still in flight, and this is it and its job (nothing new enqueued or reserved)", body = SpecviewAccepted,
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
    // The analysis must be the caller's and completed. Whether a specview of it is in flight is
    // the batch's to find, under the caller's lock.
    let analysis: Option<String> =
        sqlx::query_scalar("SELECT state::text FROM analyses WHERE id = $1 AND user_id = $2")
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
        Some(s) if s != "completed" => {
            // `state` tells waiting (pending, running) from never (failed).
            let detail = if s == "failed" {
                format!(
                    "analysis `{}` failed; a specview needs a completed analysis (request a new \
                     analysis)",
                    body.analysis_id
                )
            } else {
                format!(
                    "analysis `{}` is {s}; a specview needs a completed analysis (wait for it)",
                    body.analysis_id
                )
            };
            return Err(Problem::conflict(detail).with("state", s));
        }
        Some(_) => {}
    }
    let specview_id = Uuid::now_v7();
    let record = NewRecord::Specview {
        specview_id,
        analysis_id: body.analysis_id,
    };
    let after_commit = watch.clone();
    match enqueue(
        &state.enqueuer,
        EnqueueRequest::new(user.user_id, record),
        watch,
    )
    .await?
    {
        // A request sent again (after a timeout, say) gets the job it started, not a second,
        // billed one.
        Enqueued::InFlight(work) => {
            let job = super::in_flight_job(&state, user.user_id, "specview_id", work, after_commit)
                .await?;
            Ok(super::accepted_job(
                SpecviewAccepted {
                    specview_id: work.record_id,
                    analysis_id: body.analysis_id,
                    job,
                },
                work.job_id,
            ))
        }
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

/// Whether the caller's `Accept` prefers Markdown to JSON (RFC 9110 §12.5.1): `text/markdown`
/// named, with a weight above zero and at least that of JSON. JSON is weighed by its most
/// specific range (`application/json` over `application/*` over `*/*`); it has weight 1 when
/// nothing names it and 0 when something else is named but not it. `*/*` or `text/*` alone
/// get the default, JSON.
fn wants_markdown(headers: &HeaderMap) -> bool {
    let mut markdown: Option<f32> = None;
    // (specificity, weight) of the most specific range matching JSON.
    let mut json: Option<(u8, f32)> = None;
    let mut any_range = false;
    for range in headers
        .get_all(http::header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
    {
        let mut parts = range.split(';');
        let media = parts.next().unwrap_or("").trim().to_ascii_lowercase();
        if media.is_empty() {
            continue;
        }
        any_range = true;
        let weight = parts
            .filter_map(|p| p.split_once('='))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
            // A weight outside 0–1 (`q=2`, `q=inf`) is not one (RFC 9110 §12.4.2): not
            // acceptable, rather than preferred.
            .map_or(1.0, |(_, v)| {
                v.trim()
                    .parse::<f32>()
                    .ok()
                    .filter(|q| (0.0..=1.0).contains(q))
                    .unwrap_or(0.0)
            });
        let specificity = match media.as_str() {
            "text/markdown" => {
                markdown.get_or_insert(weight);
                continue;
            }
            "application/json" => 2,
            "application/*" => 1,
            "*/*" => 0,
            _ => continue,
        };
        if json.is_none_or(|(s, _)| specificity > s) {
            json = Some((specificity, weight));
        }
    }
    let Some(markdown_weight) = markdown else {
        return false;
    };
    let json_weight = json.map_or(if any_range { 0.0 } else { 1.0 }, |(_, w)| w);
    markdown_weight > 0.0 && markdown_weight >= json_weight
}

/// A specview of the caller's, as JSON or (with `Accept: text/markdown`) as Markdown. The
/// answer carries an `ETag` (one per representation); a request whose `If-None-Match` names it
/// is answered `304 Not Modified` without the result.
#[utoipa::path(
    get,
    path = "/v1/specviews/{id}",
    tag = "specviews",
    params(
        ("id" = Uuid, Path, description = "The specview id"),
        ("If-None-Match" = Option<String>, Header,
            description = "Entity tags of versions the client holds (`*` is not taken as a condition)"),
    ),
    responses(
        (status = 200, description = "The specview", content(
            (SpecviewView = "application/json"),
            (String = "text/markdown"),
        ), headers(("ETag" = String, description = "This version's entity tag, per representation"))),
        (status = 304, description = "Not modified: `If-None-Match` names the current version",
            headers(("ETag" = String, description = "The current version's entity tag"))),
    ),
    security(("api_key" = []))
)]
pub async fn get(
    State(state): State<AppState>,
    user: AuthUser,
    headers: HeaderMap,
    IdPath(id): IdPath,
) -> Response {
    // The representation depends on `Accept`: a cache in front must not hand one client's
    // Markdown to another that asked for JSON (RFC 9110 §12.5.5).
    let mut response = match representation(&state, &user, &headers, &id).await {
        Ok(response) => response,
        Err(problem) => problem.into_response(),
    };
    response
        .headers_mut()
        .insert(http::header::VARY, HeaderValue::from_static("accept"));
    response
}

/// The specview `id` of `user`, as `headers` ask for it, tagged.
async fn representation(
    state: &AppState,
    user: &AuthUser,
    headers: &HeaderMap,
    id: &str,
) -> Result<Response, Problem> {
    let not_found = || Problem::not_found(format!("no specview `{id}`"));
    let Some(specview_id) = super::path_uuid(id) else {
        return Err(not_found());
    };
    let condition = IfNoneMatch::parse(headers);
    if wants_markdown(headers) {
        // The Markdown alone: the structured result beside it can be as large again (up to
        // 64 MiB together), and would be read and dropped.
        let read: Option<Read<MarkdownRow>> = state
            .large_reads
            .read_record(
                &state.pool,
                "specviews",
                (MARKDOWN_COLUMNS, MARKDOWN_COLUMNS_WEIGHED),
                (specview_id, user.user_id),
                Asked {
                    condition: condition.as_ref(),
                    representation: ".md",
                    // Only a specview with Markdown has it (else the answer is a 409).
                    served: |row: &MarkdownRow, left_out| row.markdown.is_some() || left_out,
                },
            )
            .await?;
        let (row, admitted, tag) = match read.ok_or_else(not_found)? {
            Read::NotModified { tag } => return Ok(conditional::not_modified(&tag)),
            Read::Found { row, admitted, tag } => (row, admitted, tag),
        };
        let Some(markdown) = row.markdown else {
            let detail = if row.state == "failed" {
                format!("specview `{id}` failed; it has no Markdown")
            } else {
                format!("specview `{id}` has no Markdown yet (it is {})", row.state)
            };
            return Err(Problem::conflict(detail).with("state", row.state));
        };
        return Ok(conditional::tagged(
            admitted.text(markdown, "text/markdown; charset=utf-8"),
            &tag,
        ));
    }
    let read: Option<Read<SpecviewView>> = state
        .large_reads
        .read_record(
            &state.pool,
            "specviews",
            (SPECVIEW_COLUMNS, SPECVIEW_COLUMNS_WEIGHED),
            (specview_id, user.user_id),
            Asked::json(condition.as_ref()),
        )
        .await?;
    let (response, tag) = read.ok_or_else(not_found)?.json_answer().await;
    Ok(conditional::tagged(response, &tag))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_negotiation() {
        let mut h = HeaderMap::new();
        assert!(!wants_markdown(&h));
        let accept = |h: &mut HeaderMap, value: &'static str| {
            h.insert(http::header::ACCEPT, HeaderValue::from_static(value));
        };
        for markdown in [
            "text/markdown",
            "TEXT/Markdown; charset=utf-8",
            "text/markdown, application/json",
            "application/json;q=0.5, text/markdown",
            "text/markdown;q=0.3, */*;q=0.1",
            "text/html, text/markdown;q=0.8",
        ] {
            accept(&mut h, markdown);
            assert!(wants_markdown(&h), "{markdown}");
        }
        for json in [
            "*/*",
            "text/*",
            "application/json",
            "application/json, text/markdown;q=0.5",
            "text/markdown;q=0, application/json",
            "text/markdown;q=0",
            "text/markdown;q=0.5, */*",
            "text/markdown;q=0.5, application/*;q=0.9",
            "text/markdown;q=nonsense",
            "application/json, text/markdown;q=2",
            "text/markdown;q=inf, application/json;q=0.1",
        ] {
            accept(&mut h, json);
            assert!(!wants_markdown(&h), "{json}");
        }
    }
}
