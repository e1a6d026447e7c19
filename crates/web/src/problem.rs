//! RFC 9457 problem details: every error this service returns is `application/problem+json`
//! with `type`, `title`, `status`, `detail` and a stable machine-readable `code`.

use axum::response::{IntoResponse, Response};
use http::header::{CONTENT_TYPE, HeaderName};
use http::{HeaderMap, HeaderValue, StatusCode};
use serde::Serialize;
use serde_json::{Map, Value};
use utoipa::ToSchema;

/// The media type of every error body.
pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// Every stable error code, with its title and HTTP status (listed on the docs page).
pub const CODES: &[(&str, u16, &str)] = &[
    (
        "unauthorized",
        401,
        "Missing, malformed, unknown or revoked credentials",
    ),
    ("forbidden", 403, "The credentials do not allow this"),
    ("not_found", 404, "No such resource (or not yours)"),
    (
        "method_not_allowed",
        405,
        "The route does not support this method",
    ),
    (
        "conflict",
        409,
        "The resource is not in a state that allows this",
    ),
    (
        "payload_too_large",
        413,
        "The request body is larger than the limit",
    ),
    (
        "unsupported_media_type",
        415,
        "The request body must be application/json",
    ),
    (
        "invalid_json",
        400,
        "The request body is not well-formed JSON",
    ),
    (
        "validation_failed",
        422,
        "The request is well-formed but a value is not acceptable",
    ),
    (
        "repository_not_found",
        422,
        "The repository does not exist or is not public",
    ),
    (
        "ref_not_found",
        422,
        "The repository has no such branch, tag or commit",
    ),
    (
        "repository_unreachable",
        422,
        "The repository host could not be reached (no such name, no address, or no answer in time)",
    ),
    (
        "quota_exceeded",
        429,
        "The billing period's quota is used up",
    ),
    (
        "rate_limited",
        429,
        "Too many requests; retry after the indicated time",
    ),
    (
        "request_timeout",
        408,
        "The request body did not arrive within the server's limit; nothing was changed",
    ),
    (
        "timeout",
        503,
        "The request took longer than the server's limit and was rolled back",
    ),
    (
        "timeout_outcome_unknown",
        503,
        "The request took longer than the server's limit while its writes were being committed; \
         they may have taken effect",
    ),
    (
        "commit_outcome_unknown",
        503,
        "The database failed while committing the request's writes; they may have taken effect",
    ),
    (
        "committed_unread",
        503,
        "The request's writes were committed, but reading back what they created failed",
    ),
    (
        "dns_unavailable",
        503,
        "The repository host's name could not be looked up just now (the resolver failed or did \
         not answer in time); nothing was changed",
    ),
    ("not_ready", 503, "The service cannot serve requests yet"),
    (
        "database_busy",
        503,
        "The data this request needs is held by another session too long; nothing was changed",
    ),
    (
        "database_unavailable",
        503,
        "The database could not be reached, or the connection to it was lost; nothing was changed",
    ),
    ("internal", 500, "An unexpected error on the server"),
];

/// The title of `code` (the code itself if unknown).
pub fn title_of(code: &str) -> &'static str {
    CODES
        .iter()
        .find(|(c, _, _)| *c == code)
        .map_or("Error", |(_, _, t)| t)
}

/// An error response (boxed: it travels in every handler's `Err`).
#[derive(Debug, Clone)]
pub struct Problem(Box<ProblemInner>);

#[derive(Debug, Clone)]
struct ProblemInner {
    status: StatusCode,
    code: &'static str,
    detail: String,
    extra: Map<String, Value>,
    headers: HeaderMap,
}

/// The body schema of every error (documentation; the response is built by [`Problem`]).
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Problem)]
pub struct ProblemBody {
    /// A URI reference identifying the problem type (points into the docs page).
    #[serde(rename = "type")]
    pub problem_type: String,
    /// A short summary of the problem type.
    pub title: String,
    /// The HTTP status code.
    pub status: u16,
    /// What exactly is wrong with this request.
    pub detail: String,
    /// Stable machine-readable error code.
    #[schema(example = "validation_failed")]
    pub code: String,
    /// The request member or parameter at fault, where there is one (`validation_failed`, the
    /// repository and ref codes, `dns_unavailable`; some validation failures name it in
    /// `detail` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// `conflict` about a record: its state (`pending` or `running`: wait; `failed`: it never
    /// will be completed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// `quota_exceeded`: the event type (`analysis`, `specview`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_type: Option<String>,
    /// `quota_exceeded`: the caller's tier.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    /// `quota_exceeded`: units used in the billing period.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub used: Option<i64>,
    /// `quota_exceeded`: units reserved by jobs not yet finished.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved: Option<i64>,
    /// `quota_exceeded`: units this request asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requested: Option<i64>,
    /// `quota_exceeded`: the period's limit; `rate_limited`: the rule's requests per window.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<i64>,
    /// `quota_exceeded`: the billing period's start (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub period_start: Option<String>,
    /// `quota_exceeded`: the billing period's end (RFC 3339), when units are available again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub period_end: Option<String>,
    /// `rate_limited`: seconds until a request can succeed (as `Retry-After`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<i64>,
    /// The analysis a `commit_outcome_unknown` or `committed_unread` answer is about.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub analysis_id: Option<String>,
    /// The specview a `commit_outcome_unknown` answer is about.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub specview_id: Option<String>,
    /// The job a `commit_outcome_unknown` answer to a cancel is about.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job_id: Option<i64>,
}

impl Problem {
    pub fn new(status: StatusCode, code: &'static str, detail: impl Into<String>) -> Self {
        Problem(Box::new(ProblemInner {
            status,
            code,
            detail: detail.into(),
            extra: Map::new(),
            headers: HeaderMap::new(),
        }))
    }

    pub fn unauthorized(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", detail).header(
            http::header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer"),
        )
    }

    pub fn forbidden(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", detail)
    }

    pub fn not_found(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", detail)
    }

    pub fn validation(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation_failed",
            detail,
        )
    }

    pub fn conflict(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", detail)
    }

    /// A 500 for `error`, which is logged (its text is not shown to the client).
    pub fn internal(error: &dyn std::fmt::Display) -> Self {
        tracing::error!(%error, "request failed");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "an unexpected error occurred; it has been logged",
        )
    }

    pub fn status(&self) -> StatusCode {
        self.0.status
    }

    pub fn code(&self) -> &'static str {
        self.0.code
    }

    /// Adds a member to the body.
    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.0.extra.insert(key.to_owned(), value.into());
        self
    }

    /// Adds a response header.
    pub fn header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.0.headers.insert(name, value);
        self
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        let p = &self.0;
        let mut body = Map::new();
        body.insert("type".into(), format!("/docs#problem-{}", p.code).into());
        body.insert("title".into(), title_of(p.code).into());
        body.insert("status".into(), p.status.as_u16().into());
        body.insert("detail".into(), p.detail.clone().into());
        body.insert("code".into(), p.code.into());
        for (k, v) in &p.extra {
            body.insert(k.clone(), v.clone());
        }
        Value::Object(body)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self.body()).unwrap_or_default();
        let inner = *self.0;
        let mut response = (inner.status, body).into_response();
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_CONTENT_TYPE));
        for (name, value) in inner.headers {
            if let Some(name) = name {
                response.headers_mut().insert(name, value);
            }
        }
        // Every 503 says when to try again (the API document promises it): a second unless
        // the problem knows better.
        if inner.status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .entry(http::header::RETRY_AFTER)
                .or_insert(HeaderValue::from_static("1"));
        }
        response
    }
}

impl Problem {
    /// A 503 `commit_outcome_unknown` for `error`, which is logged (not shown): the `COMMIT` was
    /// sent and failed, so whether it took effect is unknown. The caller adds the record's id,
    /// so the client can look it up before sending the request again.
    pub fn commit_outcome_unknown(error: &dyn std::fmt::Display) -> Self {
        tracing::error!(%error, "a commit failed; its outcome is unknown");
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "commit_outcome_unknown",
            "the database failed while committing this request; it may have taken effect: look \
             it up by the id given here before sending it again",
        )
    }

    /// A 503 `committed_unread`: the request's writes are committed, and reading back what they
    /// created (named in `detail` and by the caller's id member) failed with `error`.
    pub fn committed_unread(error: &dyn std::fmt::Display, what: &str) -> Self {
        tracing::error!(%error, "reading back a committed request's record failed");
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "committed_unread",
            format!(
                "the request was carried out and its {what} saved, but reading it back failed; \
                 look it up by the id given here instead of sending the request again"
            ),
        )
        .header(http::header::RETRY_AFTER, HeaderValue::from_static("1"))
    }

    /// A 503 `database_busy`: a statement waited for a lock (`DATABASE_LOCK_TIMEOUT`), or ran,
    /// too long and was cancelled, so its transaction changed nothing.
    pub fn database_busy() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "database_busy",
            "the database kept this request waiting too long; nothing was changed, retry shortly",
        )
        .header(http::header::RETRY_AFTER, HeaderValue::from_static("1"))
    }

    /// A 503 `dns_unavailable`: looking up the repository's host failed without an answer about
    /// the name (the resolver failed or timed out), which a later try may get. Unlike a name the
    /// DNS says does not exist, this is not the request's fault.
    pub fn dns_unavailable(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "dns_unavailable", detail)
            .with("field", "repository")
            .header(http::header::RETRY_AFTER, HeaderValue::from_static("5"))
    }

    /// The database is out of reach (no connection within the pool's wait, a refused or lost
    /// one) for a request that changed nothing: a read, or a transaction that rolled back.
    pub fn database_unavailable() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "database_unavailable",
            "the database could not be reached; nothing was changed, retry shortly",
        )
        .header(http::header::RETRY_AFTER, HeaderValue::from_static("5"))
    }
}

/// Whether `e` is PostgreSQL cancelling a statement for waiting on a lock (55P03) or running
/// past `statement_timeout` (57014).
fn kept_waiting(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|db| db.code())
        .is_some_and(|code| code == "55P03" || code == "57014")
}

/// Errors of a read, or of a transaction before its commit: a cancelled statement is
/// `database_busy`, a failed or refused connection `database_unavailable` (the transaction, if
/// any, rolled back with it), anything else `internal`. (At a commit, or in an autocommit write,
/// nothing is known: see the enqueue batch's and the admin writes' own answers.)
impl From<sqlx::Error> for Problem {
    fn from(e: sqlx::Error) -> Self {
        database_problem(&e)
    }
}

/// The answer to a database error: a lock held too long is `database_busy`, a lost connection
/// `database_unavailable`, anything else a 500.
fn database_problem(e: &sqlx::Error) -> Problem {
    if kept_waiting(e) {
        tracing::warn!(error = %e, "a statement was cancelled for waiting too long");
        Problem::database_busy()
    } else if queue::error::is_connection_error(e) {
        tracing::warn!(error = %e, "the database could not be reached");
        Problem::database_unavailable()
    } else {
        Problem::internal(e)
    }
}

impl From<queue::QueueError> for Problem {
    fn from(e: queue::QueueError) -> Self {
        // A hook's own database error (the record or quota hook in a cancel) is answered as the
        // database's, like the queue's statements' own.
        match e.database_error() {
            Some(database) => database_problem(database),
            None => Problem::internal(&e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hooks_database_error_is_answered_as_the_databases() {
        let lost = queue::QueueError::Hook(Box::new(sqlx::Error::PoolTimedOut));
        assert_eq!(Problem::from(lost).code(), "database_unavailable");
        let refused = queue::QueueError::Hook(Box::new(std::io::Error::other("no result")));
        assert_eq!(Problem::from(refused).code(), "internal");
    }

    #[test]
    fn body_has_the_rfc_members_and_extras() {
        let p = Problem::validation("repository: bad").with("field", "repository");
        let b = p.body();
        assert_eq!(b["status"], 422);
        assert_eq!(b["code"], "validation_failed");
        assert_eq!(b["detail"], "repository: bad");
        assert_eq!(b["type"], "/docs#problem-validation_failed");
        assert_eq!(b["field"], "repository");
        assert!(!b["title"].as_str().unwrap().is_empty());
    }

    /// The API document promises `Retry-After` on every 503: one the problem sets stays, and
    /// the others say a second.
    #[test]
    fn every_503_says_when_to_try_again() {
        let answer = |p: Problem| {
            let r = p.into_response();
            r.headers()
                .get(http::header::RETRY_AFTER)
                .map(|v| v.to_str().unwrap().to_owned())
        };
        assert_eq!(
            answer(Problem::database_unavailable()).as_deref(),
            Some("5")
        );
        assert_eq!(
            answer(Problem::commit_outcome_unknown(&"lost")).as_deref(),
            Some("1")
        );
        let timeout = Problem::new(StatusCode::SERVICE_UNAVAILABLE, "timeout", "took too long");
        assert_eq!(answer(timeout).as_deref(), Some("1"));
        assert_eq!(answer(Problem::validation("no")), None);
    }

    #[test]
    fn every_code_has_a_distinct_entry() {
        let mut codes: Vec<_> = CODES.iter().map(|(c, _, _)| *c).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), CODES.len());
    }
}
