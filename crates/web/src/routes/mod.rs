//! The HTTP endpoints, grouped by resource, and the JSON shapes they return.

pub mod admin;
pub mod analyses;
pub mod jobs;
pub mod listing;
pub mod specviews;
pub mod system;
pub mod usage;

use axum::Json;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use http::{HeaderValue, StatusCode};
use queue::{ComposedJob, JobRow, JobState};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::problem::Problem;

/// A job's state (SPEC §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum JobStateName {
    Available,
    Scheduled,
    Running,
    Retryable,
    Completed,
    Cancelled,
    Discarded,
}

impl From<JobState> for JobStateName {
    fn from(s: JobState) -> Self {
        match s {
            JobState::Available => JobStateName::Available,
            JobState::Scheduled => JobStateName::Scheduled,
            JobState::Running => JobStateName::Running,
            JobState::Retryable => JobStateName::Retryable,
            JobState::Completed => JobStateName::Completed,
            JobState::Cancelled => JobStateName::Cancelled,
            JobState::Discarded => JobStateName::Discarded,
        }
    }
}

/// The state of an analysis or specview record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum WorkState {
    Pending,
    Running,
    Completed,
    Failed,
}

impl WorkState {
    pub fn parse(s: &str) -> WorkState {
        match s {
            "running" => WorkState::Running,
            "completed" => WorkState::Completed,
            "failed" => WorkState::Failed,
            _ => WorkState::Pending,
        }
    }
}

/// The database's name of the state (`fairlane_work_state`), for binding.
impl From<WorkState> for records::WorkState {
    fn from(state: WorkState) -> Self {
        match state {
            WorkState::Pending => records::WorkState::Pending,
            WorkState::Running => records::WorkState::Running,
            WorkState::Completed => records::WorkState::Completed,
            WorkState::Failed => records::WorkState::Failed,
        }
    }
}

/// A job as just enqueued.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct JobSummary {
    pub id: i64,
    pub state: JobStateName,
    /// The queue it waits in (`analysis_priority`, `analysis_default`, …).
    pub queue: String,
}

impl From<ComposedJob> for JobSummary {
    fn from(j: ComposedJob) -> Self {
        JobSummary {
            id: j.id,
            state: j.state.into(),
            queue: j.queue,
        }
    }
}

/// One failed attempt.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct JobErrorView {
    pub attempt: i16,
    pub at: DateTime<Utc>,
    /// `error`, `panic`, `timeout`, `unknown_kind`, `invalid_args`, `rescued` or `interrupted`.
    pub kind: String,
    pub error: String,
}

/// A job, as its owner sees it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct JobView {
    pub id: i64,
    /// `analysis` or `specview`.
    pub kind: String,
    pub queue: String,
    pub state: JobStateName,
    /// Attempts started so far.
    pub attempt: i16,
    pub max_attempts: i16,
    pub created_at: DateTime<Utc>,
    /// When the job is (or was) due to run.
    pub scheduled_at: DateTime<Utc>,
    pub attempted_at: Option<DateTime<Utc>>,
    pub finalized_at: Option<DateTime<Utc>>,
    /// A cancel was requested (`DELETE`), whether the job was waiting or running then; a running
    /// job stops at its handler's next check, so it may still complete.
    pub cancel_requested: bool,
    /// What the job's handler returned, once completed.
    #[schema(value_type = Option<Object>)]
    pub result: Option<serde_json::Value>,
    /// The most recent failed attempt, if any.
    pub last_error: Option<JobErrorView>,
    /// The analysis the job fills (`analysis` jobs), or reads (`specview` jobs): its record
    /// outlives the job, which is deleted some time after it ends (a day after it completed).
    pub analysis_id: Option<Uuid>,
    /// The specview the job fills (`specview` jobs).
    pub specview_id: Option<Uuid>,
}

impl From<&JobRow> for JobView {
    fn from(j: &JobRow) -> Self {
        let last_error = j.attempt_errors().pop().map(|e| JobErrorView {
            attempt: e.attempt,
            at: e.at,
            kind: serde_json::to_value(e.kind)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default(),
            error: e.error,
        });
        JobView {
            id: j.id,
            kind: j.kind.clone(),
            queue: j.queue.clone(),
            state: j.state.into(),
            attempt: j.attempt,
            max_attempts: j.max_attempts,
            created_at: j.created_at,
            scheduled_at: j.scheduled_at,
            attempted_at: j.attempted_at,
            finalized_at: j.finalized_at,
            cancel_requested: j.metadata.get("cancel_attempted_at").is_some(),
            result: j.output.clone().filter(|v| v.is_object()),
            last_error,
            analysis_id: record_id(&j.args, "analysis_id"),
            specview_id: record_id(&j.args, "specview_id"),
        }
    }
}

/// The record id a job's `args` name under `member` (`AnalysisArgs`, `SpecviewArgs`).
fn record_id(args: &serde_json::Value, member: &str) -> Option<Uuid> {
    args.get(member)?.as_str()?.parse().ok()
}

/// A stored JSON document (`jsonb`, read as text) passed through as it is: an inventory of a
/// large repository is tens of megabytes of JSON, and parsing it into a tree for each read (a map
/// per test, several times the text's size) and serialising that again let a few concurrent
/// reads of one large result take gigabytes.
///
/// Reading it only takes the text; checking that it is JSON (it is: PostgreSQL wrote it from a
/// `jsonb`) and copying it into a response happen when it is serialised, which
/// [`crate::large_reads::Admitted::json`] does on a blocking thread: for a result of 100 MB that
/// is a fraction of a second of CPU that would otherwise stall every request sharing the
/// runtime's thread.
#[derive(Debug, Clone)]
pub struct StoredJson(String);

impl Serialize for StoredJson {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let raw: &serde_json::value::RawValue =
            serde_json::from_str(&self.0).map_err(serde::ser::Error::custom)?;
        raw.serialize(serializer)
    }
}

impl sqlx::Type<sqlx::Postgres> for StoredJson {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        <String as sqlx::Type<sqlx::Postgres>>::type_info()
    }

    fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
        <String as sqlx::Type<sqlx::Postgres>>::compatible(ty)
    }
}

impl<'r> sqlx::Decode<'r, sqlx::Postgres> for StoredJson {
    fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
        Ok(StoredJson(
            <String as sqlx::Decode<sqlx::Postgres>>::decode(value)?,
        ))
    }
}

/// `status` with `bytes` as its `application/json` body.
pub fn json_response(status: StatusCode, bytes: Vec<u8>) -> Response {
    (
        status,
        [(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        bytes,
    )
        .into_response()
}

/// An analysis record without its result, as a list shows it.
#[derive(Debug, Clone, Serialize, ToSchema, sqlx::FromRow)]
pub struct AnalysisSummary {
    pub id: Uuid,
    /// The normalised repository URL.
    pub repository: String,
    /// The ref as requested (`null`: the default branch).
    #[serde(rename = "ref")]
    #[sqlx(rename = "requested_ref")]
    pub git_ref: Option<String>,
    /// The commit analysed.
    pub commit: String,
    #[sqlx(try_from = "String")]
    pub state: WorkState,
    /// The job that fills this record (`null` for a cache hit).
    pub job_id: Option<i64>,
    /// Whether this record is a copy served from the cache, without a job of its own (no quota
    /// used for it). The caller's own job-filled analysis, returned again for a repeated request,
    /// says `false`: it ran and was billed once, when it was first requested.
    pub cached: bool,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub completed_at: Option<DateTime<Utc>>,
}

/// An analysis record.
#[derive(Debug, Clone, Serialize, ToSchema, sqlx::FromRow)]
pub struct AnalysisView {
    #[serde(flatten)]
    #[sqlx(flatten)]
    pub record: AnalysisSummary,
    /// The test inventory, once completed (written by the analyzer).
    #[schema(value_type = Option<Object>)]
    pub result: Option<StoredJson>,
}

impl From<String> for WorkState {
    fn from(s: String) -> Self {
        WorkState::parse(&s)
    }
}

/// The columns of [`AnalysisView`], for `SELECT` and `RETURNING` lists. A worker stages its
/// result while the record is still `running`; it is shown once the record is `completed` (in the
/// job's final transaction, when it is also billed). `cached` means the record was filled from
/// the cache without a job of its own; a job that found its commit already analysed by someone
/// else stores a copy too (`cached_from`), but it ran and was billed.
pub const ANALYSIS_COLUMNS: &str = concat!(
    analysis_columns_but_result!(),
    ", CASE WHEN ",
    result_shown!(),
    " THEN result::text END AS result"
);

/// What an analysis is read from (`FROM`), as `analyses`: each record with its inventory as
/// `result`, a cache copy's being its original's, which the copy shares instead of storing it
/// again ([`records::analyses_with_inventory`], ADR 0020).
pub const ANALYSES_READ: &str = records::analyses_with_inventory!("analyses");

/// The columns of [`AnalysisView`] but `result`: an [`AnalysisSummary`].
macro_rules! analysis_columns_but_result {
    () => {
        "id, repository, requested_ref, commit, state::text AS state, job_id, \
         cached_from IS NOT NULL AND job_id IS NULL AS cached, error, created_at, updated_at, \
         completed_at"
    };
}
use analysis_columns_but_result;

/// When a record's `result` is shown: once `completed`, and if it is a JSON object.
macro_rules! result_shown {
    () => {
        "state = 'completed' AND jsonb_typeof(result) = 'object'"
    };
}
use result_shown;

/// When a `result` is read with its row, unweighed: stored in at most
/// [`crate::large_reads::UNWEIGHED_STORED_JSON_BYTES`] (compressed).
macro_rules! small_result {
    () => {
        "coalesce(pg_column_size(result), 0) <= 16384"
    };
}

/// When a `markdown` is read with its row, unweighed: at most
/// [`crate::large_reads::UNWEIGHED_TEXT_BYTES`].
macro_rules! small_markdown {
    () => {
        "coalesce(octet_length(markdown), 0) <= 1048576"
    };
}

/// [`ANALYSIS_COLUMNS`] for a [`crate::large_reads::Weighed`] read: a large result is left
/// out, its size as text in `large_text_bytes`.
pub const ANALYSIS_COLUMNS_WEIGHED: &str = concat!(
    analysis_columns_but_result!(),
    ", CASE WHEN ",
    result_shown!(),
    " AND ",
    small_result!(),
    " THEN result::text END AS result, CASE WHEN ",
    result_shown!(),
    " AND NOT (",
    small_result!(),
    ") THEN octet_length(result::text)::bigint END AS large_text_bytes"
);

/// [`ANALYSIS_COLUMNS`] with no result (`NULL`): for the enqueue batch's cache hits, whose
/// inventories (megabytes for a large repository) are read after the commit, on the request's
/// own task, not decoded on the batch thread while the batch holds its users' locks.
pub const ANALYSIS_COLUMNS_WITHOUT_RESULT: &str =
    concat!(analysis_columns_but_result!(), ", NULL::text AS result");

/// A specview record without its result and Markdown, as a list shows it.
#[derive(Debug, Clone, Serialize, ToSchema, sqlx::FromRow)]
pub struct SpecviewSummary {
    pub id: Uuid,
    pub analysis_id: Uuid,
    #[sqlx(try_from = "String")]
    pub state: WorkState,
    pub job_id: Option<i64>,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub completed_at: Option<DateTime<Utc>>,
}

/// A specview record.
#[derive(Debug, Clone, Serialize, ToSchema, sqlx::FromRow)]
pub struct SpecviewView {
    #[serde(flatten)]
    #[sqlx(flatten)]
    pub record: SpecviewSummary,
    /// The behaviour specification as structured data (written by the specgen worker).
    #[schema(value_type = Option<Object>)]
    pub result: Option<StoredJson>,
    /// The same specification as Markdown (also served with `Accept: text/markdown`).
    pub markdown: Option<String>,
}

/// The columns of [`SpecviewView`]; like analyses, results are shown once `completed`.
pub const SPECVIEW_COLUMNS: &str = concat!(
    specview_columns_but_values!(),
    ", CASE WHEN ",
    result_shown!(),
    " THEN result::text END AS result, CASE WHEN state = 'completed' THEN markdown END AS markdown"
);

/// The columns of [`SpecviewView`] but `result` and `markdown`: a [`SpecviewSummary`].
macro_rules! specview_columns_but_values {
    () => {
        "id, analysis_id, state::text AS state, job_id, error, created_at, updated_at, \
         completed_at"
    };
}
use specview_columns_but_values;

/// [`SPECVIEW_COLUMNS`] for a [`crate::large_reads::Weighed`] read: unless both the result
/// and the Markdown are small, both are left out, their size as text in `large_text_bytes`.
pub const SPECVIEW_COLUMNS_WEIGHED: &str = concat!(
    specview_columns_but_values!(),
    ", CASE WHEN ",
    result_shown!(),
    " AND ",
    small_result!(),
    " AND ",
    small_markdown!(),
    " THEN result::text END AS result, CASE WHEN state = 'completed' AND ",
    small_result!(),
    " AND ",
    small_markdown!(),
    " THEN markdown END AS markdown, CASE WHEN state = 'completed' AND NOT (",
    small_result!(),
    " AND ",
    small_markdown!(),
    ") THEN (coalesce(CASE WHEN jsonb_typeof(result) = 'object' THEN \
     octet_length(result::text) END, 0) + coalesce(octet_length(markdown), 0))::bigint END \
     AS large_text_bytes"
);

/// A specview's Markdown alone: its state, and the Markdown once `completed`.
#[derive(Debug, sqlx::FromRow)]
pub struct MarkdownRow {
    pub state: String,
    pub markdown: Option<String>,
}

/// The columns of [`MarkdownRow`].
pub const MARKDOWN_COLUMNS: &str =
    "state::text AS state, CASE WHEN state = 'completed' THEN markdown END AS markdown";

/// [`MARKDOWN_COLUMNS`] for a [`crate::large_reads::Weighed`] read.
pub const MARKDOWN_COLUMNS_WEIGHED: &str = concat!(
    "state::text AS state, CASE WHEN state = 'completed' AND ",
    small_markdown!(),
    " THEN markdown END AS markdown, CASE WHEN state = 'completed' AND NOT (",
    small_markdown!(),
    ") THEN octet_length(markdown)::bigint END AS large_text_bytes"
);

/// `user`'s job `id`, if there is one.
pub async fn users_job(
    state: &crate::state::AppState,
    user: Uuid,
    id: i64,
) -> Result<Option<JobRow>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM fairlane_job WHERE id = $1 AND user_id = $2")
        .bind(id)
        .bind(user)
        .fetch_optional(&state.pool)
        .await
}

/// The summary of the job of `user`'s work in flight, which fills the record `work.record_id`
/// (named in the job's args under `member`, `analysis_id` or `specview_id`): a job id alone could
/// name another job once ids start over (a `fairlane_job` restored apart from the records). The
/// batch found the job live; one gone since (cleaned long after it ended) is an internal problem.
/// The work may have been committed by the request's own batch (a request it repeated), so
/// `watch` learns that a timeout from here on must not say "nothing was changed".
pub async fn in_flight_job(
    state: &crate::state::AppState,
    user: Uuid,
    member: &str,
    work: crate::enqueue::InFlight,
    watch: Option<axum::Extension<crate::middleware::TimeoutWatch>>,
) -> Result<JobSummary, Problem> {
    if let Some(axum::Extension(watch)) = watch {
        watch.outcome_unknown();
    }
    // Compared as the job's args spell the id (as text, like the batch's look-up).
    let record = work.record_id.to_string();
    let job = users_job(state, user, work.job_id)
        .await?
        .filter(|job| job.args.get(member).and_then(serde_json::Value::as_str) == Some(&record));
    let job = job.ok_or_else(|| {
        Problem::internal(&format!(
            "{member} {} in flight has no job of its own",
            work.record_id
        ))
    })?;
    Ok(JobSummary {
        id: job.id,
        state: job.state.into(),
        queue: job.queue,
    })
}

/// `202 Accepted` with `body` and a `Location` header naming the enqueued job's URL.
pub fn accepted_job(body: impl Serialize, job_id: i64) -> Response {
    let mut response = (StatusCode::ACCEPTED, Json(body)).into_response();
    if let Ok(location) = HeaderValue::from_str(&format!("/v1/jobs/{job_id}")) {
        response
            .headers_mut()
            .insert(http::header::LOCATION, location);
    }
    response
}

/// A resource's UUID as a path segment names it only in the hyphenated form the API gives out
/// (either case): `{…}`, `urn:uuid:…` and the 32 digits without hyphens are other URLs, and one
/// resource with many URLs defeats caches and logs that key on the URL. Anything else is `None`
/// (a 404).
pub fn path_uuid(segment: &str) -> Option<Uuid> {
    if segment.len() != 36 {
        return None;
    }
    Uuid::try_parse(segment).ok()
}

/// A job id as a path segment: decimal digits as the API gives them out, without a sign or
/// leading zeros (`+7` and `007` are other URLs for job 7). Anything else is `None` (a 404).
pub fn path_job_id(segment: &str) -> Option<i64> {
    let canonical = !segment.is_empty()
        && segment.bytes().all(|b| b.is_ascii_digit())
        && (segment == "0" || !segment.starts_with('0'));
    canonical.then(|| segment.parse().ok()).flatten()
}

/// Whether `s` is a full commit id (SHA-1 or SHA-256 hex), which needs no network to resolve.
pub fn is_object_id(s: &str) -> bool {
    (s.len() == 40 || s.len() == 64) && s.bytes().all(|c| c.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_in_paths_have_one_spelling() {
        let id = "0192f0c4-8d7e-7c3a-9a5b-1c2d3e4f5a6b";
        assert!(path_uuid(id).is_some());
        assert_eq!(path_uuid(&id.to_uppercase()), path_uuid(id));
        for other in [
            "0192f0c48d7e7c3a9a5b1c2d3e4f5a6b",
            "{0192f0c4-8d7e-7c3a-9a5b-1c2d3e4f5a6b}",
            "urn:uuid:0192f0c4-8d7e-7c3a-9a5b-1c2d3e4f5a6b",
            "",
        ] {
            assert_eq!(path_uuid(other), None, "{other}");
        }
        assert_eq!(path_job_id("7"), Some(7));
        assert_eq!(path_job_id("0"), Some(0));
        assert_eq!(path_job_id("9223372036854775807"), Some(i64::MAX));
        for other in [
            "+7",
            "007",
            "-7",
            " 7",
            "7 ",
            "",
            "9223372036854775808",
            "1e3",
        ] {
            assert_eq!(path_job_id(other), None, "{other:?}");
        }
    }

    #[test]
    fn a_stored_document_is_passed_through_as_written() {
        let view = serde_json::json!({ "kept": "x" });
        let stored = StoredJson(r#"{"tests": [ {"name": "a\u00e9"} ], "n": 1e400}"#.to_owned());
        let out = serde_json::to_string(&(view, stored)).unwrap();
        assert_eq!(
            out,
            r#"[{"kept":"x"},{"tests": [ {"name": "a\u00e9"} ], "n": 1e400}]"#
        );
        assert!(serde_json::to_string(&StoredJson("{oops".to_owned())).is_err());
    }
}
