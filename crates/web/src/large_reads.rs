//! A memory budget for serving large stored results (inventories, specviews): each read of one
//! is weighed first and waits for its share of `HTTP_LARGE_READ_MEMORY`, held until its answer
//! has been sent, so concurrent reads of tens of megabytes each cannot take the process past its
//! memory limit (a few polls of one large result could get the pod killed, for every user).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::IntoResponse as _;
use axum::response::Response;
use bytes::Bytes;
use http::StatusCode;
use http_body::{Frame, SizeHint};
use serde::Serialize;
use sqlx::PgPool;
use sqlx::postgres::PgRow;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use uuid::Uuid;

use crate::conditional::{IfNoneMatch, ROW_VERSION_COLUMN, entity_tag};
use crate::problem::Problem;

/// The budget's unit.
const MIB: u64 = 1024 * 1024;

/// A `jsonb` value stored in at most this many bytes (`pg_column_size`: TOAST-compressed) is
/// read with its row, unweighed. Compression can shrink repetitive JSON many times, so this is
/// kept small: what it lets through is a few megabytes of text at the very most.
pub const UNWEIGHED_STORED_JSON_BYTES: i64 = 16 * 1024;

/// A text value (Markdown) of at most this many bytes (`octet_length`, exact) is read with its
/// row, unweighed.
pub const UNWEIGHED_TEXT_BYTES: i64 = 1024 * 1024;

/// What serving a result of `text_bytes` takes at its peak, in bytes: the connection's read
/// buffer, the decoded text and the response body (`a_large_result_is_served_without_parsing_it`
/// measures under four times the text).
pub fn peak_bytes(text_bytes: u64) -> u64 {
    text_bytes.saturating_mul(3)
}

/// A row as its first statement reads it: with its large values when they are small enough
/// to read unweighed, else without them (NULL) and with their size as text.
#[derive(Debug, sqlx::FromRow)]
pub struct Weighed<T> {
    #[sqlx(flatten)]
    pub row: T,
    /// The text bytes of the values left out of `row`; NULL when nothing was left out.
    pub large_text_bytes: Option<i64>,
    /// [`crate::conditional::ROW_VERSION_COLUMN`].
    pub row_version: String,
}

/// A row read whole, with its version.
#[derive(Debug, sqlx::FromRow)]
struct Versioned<T> {
    #[sqlx(flatten)]
    row: T,
    row_version: String,
}

/// What a request asks of [`LargeReads::read_record`] besides the row.
#[derive(Debug, Clone, Copy)]
pub struct Asked<'a, T> {
    /// Its `If-None-Match`, if any.
    pub condition: Option<&'a IfNoneMatch>,
    /// The representation it gets (`""` JSON, `".md"` Markdown), which the tag names.
    pub representation: &'a str,
    /// Whether a row has that representation, given the row and whether large values were
    /// left out of it (without one the answer is no 2xx, and a condition does not apply).
    pub served: fn(&T, bool) -> bool,
}

impl<'a, T> Asked<'a, T> {
    /// The JSON, which every row has.
    pub fn json(condition: Option<&'a IfNoneMatch>) -> Self {
        Asked {
            condition,
            representation: "",
            served: |_, _| true,
        }
    }
}

/// What [`LargeReads::read_record`] found.
#[derive(Debug)]
pub enum Read<T> {
    /// The row, let in ([`Admitted`]), and the entity tag of the representation asked for.
    Found {
        row: T,
        admitted: Admitted,
        tag: String,
    },
    /// The condition named the current tag: nothing more was read.
    NotModified { tag: String },
}

impl<T: Serialize + Send + 'static> Read<T> {
    /// The answer as JSON: `200` with the row, or `304`, with the entity tag (the `200` is not
    /// tagged yet: a caller that answers a `POST` with it leaves it so).
    pub async fn json_answer(self) -> (Response, String) {
        match self {
            Read::NotModified { tag } => (crate::conditional::not_modified(&tag), tag),
            Read::Found { row, admitted, tag } => (admitted.json(StatusCode::OK, row).await, tag),
        }
    }
}

/// The budget, in MiB permits.
#[derive(Debug, Clone)]
pub struct LargeReads {
    permits: Arc<Semaphore>,
    total: u32,
}

impl LargeReads {
    /// A budget of `bytes` (at least 1 MiB).
    pub fn new(bytes: u64) -> LargeReads {
        let total = u32::try_from((bytes / MIB).max(1)).unwrap_or(u32::MAX);
        LargeReads {
            permits: Arc::new(Semaphore::new(total as usize)),
            total,
        }
    }

    /// The share of the budget a read of `text_bytes` waits for: its peak in whole MiB, at
    /// least 1 and at most the whole budget (a read larger than the budget runs alone).
    pub fn share(&self, text_bytes: u64) -> u32 {
        let mib = peak_bytes(text_bytes).div_ceil(MIB);
        u32::try_from(mib).unwrap_or(u32::MAX).clamp(1, self.total)
    }

    /// Reads the row of `table` (a table, or what to read it from as that name, such as
    /// [`crate::routes::ANALYSES_READ`]) with `id` belonging to `user`: in one statement of
    /// `weighed_columns` (a [`Weighed`] row) when its large values are small, else, once their
    /// share of the budget is free, again with `columns`, whole. Each statement runs on a
    /// connection that gives back the buffers it grew ([`records::with_buffers_given_back`]).
    /// The request's own timeout bounds the wait.
    ///
    /// The answer is tagged for the representation `asked` ([`crate::conditional::entity_tag`]);
    /// if its condition names the tag the first statement read, and the row has the
    /// representation, that is the answer ([`Read::NotModified`]), before any large value is
    /// read or waited for.
    pub async fn read_record<T>(
        &self,
        pool: &PgPool,
        table: &'static str,
        (columns, weighed_columns): (&'static str, &'static str),
        (id, user): (Uuid, Uuid),
        asked: Asked<'_, T>,
    ) -> Result<Option<Read<T>>, sqlx::Error>
    where
        T: for<'r> sqlx::FromRow<'r, PgRow> + Send + Unpin,
    {
        let select = |columns: &str| {
            sqlx::AssertSqlSafe(format!(
                "SELECT {columns}, {ROW_VERSION_COLUMN} FROM {table} WHERE id = $1 AND user_id = $2"
            ))
        };
        let first: Option<Weighed<T>> = records::with_buffers_given_back(pool, async |conn| {
            sqlx::query_as(select(weighed_columns))
                .bind(id)
                .bind(user)
                .fetch_optional(conn)
                .await
        })
        .await?;
        let Some(first) = first else {
            return Ok(None);
        };
        let tag = entity_tag(&first.row_version, asked.representation);
        if asked.condition.is_some_and(|c| c.matches(&tag))
            && (asked.served)(&first.row, first.large_text_bytes.is_some())
        {
            return Ok(Some(Read::NotModified { tag }));
        }
        let Some(text_bytes) = first.large_text_bytes else {
            return Ok(Some(Read::Found {
                row: first.row,
                admitted: Admitted { permit: None },
                tag,
            }));
        };
        let share = self.share(u64::try_from(text_bytes).unwrap_or(0));
        // The semaphore is never closed.
        let permit = Arc::clone(&self.permits)
            .acquire_many_owned(share)
            .await
            .ok();
        let whole: Option<Versioned<T>> = records::with_buffers_given_back(pool, async |conn| {
            sqlx::query_as(select(columns))
                .bind(id)
                .bind(user)
                .fetch_optional(conn)
                .await
        })
        .await?;
        Ok(whole.map(|whole| Read::Found {
            tag: entity_tag(&whole.row_version, asked.representation),
            row: whole.row,
            admitted: Admitted { permit },
        }))
    }

    /// Permits free now.
    #[cfg(test)]
    fn available(&self) -> usize {
        self.permits.available_permits()
    }
}

/// A read let in: its share of the budget, if it was large.
#[derive(Debug)]
pub struct Admitted {
    permit: Option<OwnedSemaphorePermit>,
}

impl Admitted {
    /// `status` with `body` as JSON, serialised on a blocking thread that holds the share (a
    /// request cut short meanwhile does not give back memory still in use); then only the
    /// body's own size of it is kept, until the body has been sent or dropped with its
    /// connection.
    pub async fn json<B: Serialize + Send + 'static>(
        self,
        status: StatusCode,
        body: B,
    ) -> Response {
        let permit = self.permit;
        let serialised =
            tokio::task::spawn_blocking(move || (serde_json::to_vec(&body), permit)).await;
        match serialised {
            Ok((Ok(bytes), permit)) => {
                let permit = permit.map(|p| keep_for(p, bytes.len()));
                holding(crate::routes::json_response(status, bytes), permit)
            }
            Ok((Err(e), _)) => Problem::internal(&e).into_response(),
            Err(e) => Problem::internal(&e).into_response(),
        }
    }

    /// `text` as `content_type`, holding the share its size needs until it has been sent.
    pub fn text(self, text: String, content_type: &'static str) -> Response {
        let permit = self.permit.map(|p| keep_for(p, text.len()));
        let mut response = text.into_response();
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static(content_type),
        );
        holding(response, permit)
    }
}

/// `permit` cut down to what a body of `len` bytes holds (whole MiB, at least 1).
fn keep_for(mut permit: OwnedSemaphorePermit, len: usize) -> OwnedSemaphorePermit {
    let keep = u64::try_from(len).unwrap_or(u64::MAX).div_ceil(MIB).max(1);
    let keep = usize::try_from(keep).unwrap_or(usize::MAX);
    let held = permit.num_permits();
    if held > keep {
        drop(permit.split(held - keep));
    }
    permit
}

/// `response` with `permit` held by its body until the body has been sent (or dropped with its
/// connection).
fn holding(response: Response, permit: Option<OwnedSemaphorePermit>) -> Response {
    let Some(permit) = permit else {
        return response;
    };
    let (parts, body) = response.into_parts();
    Response::from_parts(
        parts,
        Body::new(HeldBody {
            inner: body,
            _permit: permit,
        }),
    )
}

/// A body that holds a permit for as long as it lives.
struct HeldBody {
    inner: Body,
    _permit: OwnedSemaphorePermit,
}

impl http_body::Body for HeldBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_weighed_columns_use_the_thresholds() {
        use crate::routes::{
            ANALYSIS_COLUMNS_WEIGHED, MARKDOWN_COLUMNS_WEIGHED, SPECVIEW_COLUMNS_WEIGHED,
        };
        let json = format!("pg_column_size(result), 0) <= {UNWEIGHED_STORED_JSON_BYTES}");
        let text = format!("octet_length(markdown), 0) <= {UNWEIGHED_TEXT_BYTES}");
        assert!(ANALYSIS_COLUMNS_WEIGHED.contains(&json));
        assert!(SPECVIEW_COLUMNS_WEIGHED.contains(&json));
        assert!(SPECVIEW_COLUMNS_WEIGHED.contains(&text));
        assert!(MARKDOWN_COLUMNS_WEIGHED.contains(&text));
    }

    #[tokio::test]
    async fn a_body_keeps_only_the_share_its_size_needs() {
        let reads = LargeReads::new(8 * MIB);
        let permit = Arc::clone(&reads.permits)
            .acquire_many_owned(reads.share(2 * MIB))
            .await
            .unwrap();
        assert_eq!(reads.available(), 2);
        let admitted = Admitted {
            permit: Some(permit),
        };
        let response = admitted.text("x".repeat(1_500_000), "text/plain");
        assert_eq!(reads.available(), 6, "2 MiB kept for a body of 1.5 MB");
        drop(response);
        assert_eq!(reads.available(), 8);
    }

    #[test]
    fn a_read_waits_for_its_peak_in_whole_mib_within_the_budget() {
        let reads = LargeReads::new(192 * MIB);
        assert_eq!(reads.share(1), 1);
        assert_eq!(reads.share(MIB), 3);
        assert_eq!(reads.share(10 * MIB + 1), 31);
        assert_eq!(reads.share(64 * MIB), 192);
        assert_eq!(reads.share(100 * MIB), 192, "at most the whole budget");
        assert_eq!(reads.share(u64::MAX), 192);
        assert_eq!(
            LargeReads::new(0).share(MIB),
            1,
            "a budget of at least 1 MiB"
        );
    }

    #[tokio::test]
    async fn the_permit_is_held_until_the_body_is_dropped() {
        let reads = LargeReads::new(4 * MIB);
        let permit = Arc::clone(&reads.permits)
            .acquire_many_owned(reads.share(MIB))
            .await
            .unwrap();
        assert_eq!(reads.available(), 1);
        let response = holding(Response::new(Body::from("x")), Some(permit));
        assert_eq!(reads.available(), 1);
        let bytes = axum::body::to_bytes(response.into_body(), 10)
            .await
            .unwrap();
        assert_eq!(&bytes[..], b"x");
        assert_eq!(reads.available(), 4, "given back once the body is gone");
    }
}
