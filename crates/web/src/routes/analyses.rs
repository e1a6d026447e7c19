//! `POST /v1/analyses` (cache-first, then quota reservation + analysis row + job in one
//! transaction, batched with concurrent requests by [`crate::enqueue`]) and
//! `GET /v1/analyses/{id}`, and the caller's list, `GET /v1/analyses`.

use axum::extract::State;
use axum::response::Response;
use axum::{Extension, Json};
use http::StatusCode;
use inventory::{FetchError, RepoUrl, UrlError};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use super::listing::{self, Cursor, Filter};
use super::{
    ANALYSES_READ, ANALYSIS_COLUMNS, ANALYSIS_COLUMNS_WEIGHED, AnalysisSummary, AnalysisView,
    JobSummary, WorkState, is_object_id,
};
use crate::auth::AuthUser;
use crate::conditional::{self, IfNoneMatch};
use crate::enqueue::{EnqueueRequest, Enqueued, NewRecord, enqueue};
use crate::extract::{ApiJson, ApiQuery, IdPath};
use crate::large_reads::{Asked, Read};
use crate::middleware::TimeoutWatch;
use crate::problem::Problem;
use crate::state::AppState;

/// Request body of `POST /v1/analyses`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateAnalysis {
    /// The repository: `https://host/owner/repository` (public hosts only, port 443 unless the
    /// service allows others: `ANALYZER_ALLOWED_PORTS`).
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
    let unreachable = |detail: String| {
        Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "repository_unreachable",
            detail,
        )
        .with("field", "repository")
    };
    match e {
        // One answer for a name that does not exist, has no address, or has a private one:
        // told apart, they would let anyone find which internal names the web host's resolver
        // knows. The log keeps which it was.
        UrlError::UnknownHost { host }
        | UrlError::NoAddresses { host }
        | UrlError::ResolvesToForbiddenAddress { host, .. } => {
            tracing::info!(error = %e, "refused a repository host");
            unreachable(format!(
                "repository: host `{host}` has no public address (it does not exist, has no \
                 address, or resolves to an address that is not public)"
            ))
        }
        // No answer about the name (the resolver failed or was slow): a retry may get one, so
        // it is not answered like a name the DNS says does not exist.
        UrlError::Resolution { .. } | UrlError::ResolutionTimedOut { .. } => {
            tracing::warn!(error = %e, "looking up a repository host failed");
            Problem::dns_unavailable(format!(
                "repository: {e}; nothing was changed, retry shortly"
            ))
        }
        _ => Problem::validation(format!("repository: {e}")).with("field", "repository"),
    }
}

fn fetch_problem(e: &FetchError) -> Problem {
    let (code, field) = match e {
        FetchError::InvalidRef { .. } => ("validation_failed", "ref"),
        FetchError::RefNotFound { .. } | FetchError::EmptyRepository => ("ref_not_found", "ref"),
        FetchError::RepositoryNotFound => ("repository_not_found", "repository"),
        FetchError::Refused { .. } => ("validation_failed", "repository"),
        // This server's own trouble (a local failure; its git killed, as by the out-of-memory
        // killer), not the repository's.
        FetchError::Io { .. } | FetchError::Killed { .. } => return Problem::internal(e),
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
    user: Uuid,
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
    // A bounded number of git processes at once, whatever the number of requests: each holds
    // memory and a process slot (`RESOLVE_CONCURRENCY`), and one user holds a few of them at most
    // (`RESOLVE_CONCURRENCY_PER_USER`). The waits count against the request's timeout.
    let _own = state.user_resolves.acquire(user).await;
    let _permit = state
        .resolves
        .acquire()
        .await
        .map_err(|_| Problem::internal(&"the resolve permits were closed"))?;
    let resolved = inventory::resolve_ref(&vetted, git_ref, &state.resolve_limits)
        .await
        .map_err(|e| fetch_problem(&e))?;
    Ok(resolved.commit)
}

/// Enqueue an analysis of a repository at a ref.
///
/// Cache-first: if this repository was already analysed at the same commit, the stored result is
/// returned with `200` and no job is created, no quota reserved or billed. If the caller's own
/// analysis of it is still in flight, that one and its job are the answer (`202`), so a request
/// sent again after a timeout starts no second, billed job. Otherwise one unit of `analysis`
/// quota is reserved and a job is enqueued (`202`); the unit is billed only when the job
/// completes.
#[utoipa::path(
    post,
    path = "/v1/analyses",
    tag = "analyses",
    request_body = CreateAnalysis,
    responses(
        (status = 200, description = "This commit was analysed already: the caller's own earlier analysis, or a copy of another's (`cached: true`); no job started, no quota used", body = AnalysisView),
        (status = 202, description = "Job enqueued; or the caller's own analysis of this commit is still in flight, and this is it and its job (nothing new enqueued or reserved)", body = AnalysisAccepted,
            headers(("Location" = String, description = "The job's URL"))),
    ),
    security(("api_key" = []))
)]
pub async fn create(
    State(state): State<AppState>,
    user: AuthUser,
    watch: Option<Extension<TimeoutWatch>>,
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
    let commit = resolve_commit(&state, user.user_id, &repo, git_ref).await?;
    let analysis_id = Uuid::now_v7();
    let record = NewRecord::Analysis {
        analysis_id,
        repository: repo,
        requested_ref: git_ref.map(str::to_owned),
        commit: commit.clone(),
    };
    let after_commit = watch.clone();
    match enqueue(
        &state.enqueuer,
        EnqueueRequest::new(user.user_id, record),
        watch,
    )
    .await?
    {
        // The batch answered without the inventory (see ANALYSIS_COLUMNS_WITHOUT_RESULT): it is
        // read here, after the commit. The copy is committed by now, so a timeout meanwhile must
        // not say "nothing was changed", and a failed read names the analysis to look up.
        Enqueued::Cached(view) => {
            if let Some(Extension(watch)) = &after_commit {
                watch.outcome_unknown();
            }
            let committed = |e: &dyn std::fmt::Display| {
                Problem::committed_unread(e, "analysis (served from the cache)")
                    .with("analysis_id", view.record.id.to_string())
            };
            read_analysis(&state, view.record.id, user.user_id, None)
                .await
                .map_err(|e| committed(&e))?
                .map(|(response, _)| response)
                .ok_or_else(|| committed(&"a cached analysis vanished after its commit"))
        }
        // The caller's own analysis of this commit, in flight: its job, as the request that
        // started it was answered.
        Enqueued::InFlight(work) => {
            let job = super::in_flight_job(&state, user.user_id, "analysis_id", work, after_commit)
                .await?;
            Ok(super::accepted_job(
                AnalysisAccepted {
                    analysis_id: work.record_id,
                    commit,
                    job,
                },
                work.job_id,
            ))
        }
        Enqueued::Accepted(job) => {
            let job_id = job.id;
            Ok(super::accepted_job(
                AnalysisAccepted {
                    analysis_id,
                    commit,
                    job: job.into(),
                },
                job_id,
            ))
        }
    }
}

/// An analysis of the caller's. The answer carries an `ETag`; a request whose `If-None-Match`
/// names it is answered `304 Not Modified` without the result (poll a large result cheaply).
#[utoipa::path(
    get,
    path = "/v1/analyses/{id}",
    tag = "analyses",
    params(
        ("id" = Uuid, Path, description = "The analysis id"),
        ("If-None-Match" = Option<String>, Header,
            description = "Entity tags of versions the client holds (`*` is not taken as a condition)"),
    ),
    responses(
        (status = 200, description = "The analysis", body = AnalysisView,
            headers(("ETag" = String, description = "This version's entity tag"))),
        (status = 304, description = "Not modified: `If-None-Match` names the current version",
            headers(("ETag" = String, description = "The current version's entity tag"))),
    ),
    security(("api_key" = []))
)]
pub async fn get(
    State(state): State<AppState>,
    user: AuthUser,
    headers: http::HeaderMap,
    IdPath(id): IdPath,
) -> Result<Response, Problem> {
    let not_found = || Problem::not_found(format!("no analysis `{id}`"));
    let Some(analysis_id) = super::path_uuid(&id) else {
        return Err(not_found());
    };
    let condition = IfNoneMatch::parse(&headers);
    let (response, tag) = read_analysis(&state, analysis_id, user.user_id, condition.as_ref())
        .await?
        .ok_or_else(not_found)?;
    Ok(conditional::tagged(response, &tag))
}

/// The query of `GET /v1/analyses`.
#[derive(Debug, Clone, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListAnalyses {
    /// Items per page, 1 to 100 (default 20).
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<u32>,
    /// Where the page starts: the `next_cursor` of the page before (omit for the newest).
    pub cursor: Option<String>,
    /// Only records in this state.
    pub state: Option<WorkState>,
    /// Only analyses of this repository, in any spelling `POST /v1/analyses` takes for it
    /// (`…/o/r` and `…/o/r.git` are one).
    pub repository: Option<String>,
}

/// A page of the caller's analyses.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AnalysisPage {
    /// Newest first, without their results (`GET /v1/analyses/{id}` has one).
    pub items: Vec<AnalysisSummary>,
    /// The `cursor` of the next page; `null` on the last one.
    pub next_cursor: Option<String>,
}

/// The caller's analyses, newest first, a page at a time: what they asked for, cache hits
/// included, and each one's state. After an answer that left the outcome unknown (a
/// `timeout_outcome_unknown`), this says whether the analysis was created.
#[utoipa::path(
    get,
    path = "/v1/analyses",
    tag = "analyses",
    params(ListAnalyses),
    responses((status = 200, description = "A page of the caller's analyses", body = AnalysisPage)),
    security(("api_key" = []))
)]
pub async fn list(
    State(state): State<AppState>,
    user: AuthUser,
    ApiQuery(query): ApiQuery<ListAnalyses>,
) -> Result<Json<AnalysisPage>, Problem> {
    let size = listing::page_size(query.limit)?;
    let after = query.cursor.as_deref().map(Cursor::decode).transpose()?;
    let mut filters = Vec::new();
    if let Some(state) = query.state {
        filters.push(Filter::State(state));
    }
    if let Some(repository) = &query.repository {
        let repo = inventory::check_url(repository, &state.url_policy).map_err(|e| {
            Problem::validation(format!("repository: {e}")).with("field", "repository")
        })?;
        // Stored URLs keep the spelling asked for (`.git` or not); the cache key's two
        // spellings find both.
        filters.push(Filter::Repository(repo.cache_spellings().to_vec()));
    }
    let (items, next_cursor) =
        listing::page::<AnalysisSummary>(&state.pool, user.user_id, &filters, after, size).await?;
    Ok(Json(AnalysisPage { items, next_cursor }))
}

/// The analysis `id` of `user` as a `200` answer (or `304` if `condition` names its current
/// tag), with its entity tag, if there is one; a large result waits for its share of the memory
/// for large reads ([`crate::large_reads`]), held until the answer is sent.
async fn read_analysis(
    state: &AppState,
    id: Uuid,
    user: Uuid,
    condition: Option<&IfNoneMatch>,
) -> Result<Option<(Response, String)>, sqlx::Error> {
    let read: Option<Read<AnalysisView>> = state
        .large_reads
        .read_record(
            &state.pool,
            ANALYSES_READ,
            (ANALYSIS_COLUMNS, ANALYSIS_COLUMNS_WEIGHED),
            (id, user),
            Asked::json(condition),
        )
        .await?;
    Ok(match read {
        None => None,
        Some(read) => Some(read.json_answer().await),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_servers_own_failures_are_not_the_repositorys() {
        let killed = FetchError::Killed {
            stage: inventory::Stage::Resolve,
        };
        assert_eq!(
            fetch_problem(&killed).status(),
            StatusCode::INTERNAL_SERVER_ERROR
        );
        let unreachable = FetchError::Unreachable {
            detail: "connection refused".into(),
        };
        let problem = fetch_problem(&unreachable);
        assert_eq!(
            (problem.status(), problem.code()),
            (StatusCode::UNPROCESSABLE_ENTITY, "repository_unreachable")
        );
    }

    /// A name that resolves to a private address and a name that does not exist are answered
    /// alike, so the API cannot be used to find which internal names exist (a cluster's
    /// services, through the web host's resolver and its search domains).
    #[test]
    fn private_and_unknown_names_are_answered_alike() {
        let host = || "repo.internal.example".to_owned();
        let answers: Vec<serde_json::Value> = [
            UrlError::UnknownHost { host: host() },
            UrlError::NoAddresses { host: host() },
            UrlError::ResolvesToForbiddenAddress {
                host: host(),
                address: std::net::IpAddr::from([10, 0, 0, 7]),
                class: inventory::url_policy::AddressClass::Private,
            },
        ]
        .iter()
        .map(|e| refused(e).body())
        .collect();
        assert_eq!(answers[0], answers[1]);
        assert_eq!(answers[0], answers[2]);
        assert_eq!(answers[0]["code"], "repository_unreachable");
        assert_eq!(answers[0]["status"], 422);
        assert_eq!(answers[0]["field"], "repository");
    }

    /// A lookup that got no answer about the name is the moment's trouble, not the request's:
    /// 503 with a `Retry-After`, not the 422 of a name that does not exist.
    #[test]
    fn a_lookup_without_an_answer_is_worth_retrying() {
        for e in [
            UrlError::Resolution {
                host: "git.example.org".into(),
                reason: "failed to lookup address information: Temporary failure in name \
                         resolution"
                    .into(),
            },
            UrlError::ResolutionTimedOut {
                host: "git.example.org".into(),
                timeout: std::time::Duration::from_secs(20),
            },
        ] {
            let problem = refused(&e);
            assert_eq!(
                (problem.status(), problem.code()),
                (StatusCode::SERVICE_UNAVAILABLE, "dns_unavailable")
            );
            let body = problem.body();
            assert_eq!(body["field"], "repository");
            assert!(
                body["detail"].as_str().unwrap().contains("git.example.org"),
                "{body}"
            );
            let response = axum::response::IntoResponse::into_response(problem);
            assert_eq!(response.headers()[http::header::RETRY_AFTER], "5");
        }
    }
}
