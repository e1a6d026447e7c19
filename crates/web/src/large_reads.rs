//! A memory budget for serving large stored results (inventories, specviews): each read of one
//! is weighed first and waits for its share of `HTTP_LARGE_READ_MEMORY`, held until its answer
//! has been sent, so concurrent reads of tens of megabytes each cannot take the process past its
//! memory limit (a few polls of one large result could get the pod killed, for every user).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use sqlx::{PgConnection, PgPool};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use uuid::Uuid;

/// The budget's unit.
const MIB: u64 = 1024 * 1024;

/// A stored value at most this large (as stored: TOAST-compressed) is served without weighing:
/// a few megabytes of text at most.
pub const UNWEIGHED_STORED_BYTES: i64 = 256 * 1024;

/// What serving a result of `text_bytes` takes at its peak, in bytes: the connection's read
/// buffer, the decoded text and the response body (`a_large_result_is_served_without_parsing_it`
/// measures under four times the text).
pub fn peak_bytes(text_bytes: u64) -> u64 {
    text_bytes.saturating_mul(3)
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

    /// Weighs the row `weigh_sql` selects for `id` of `user` (one `bigint`: the text bytes of
    /// what will be read, 0 when small or absent) and, if it is large, waits for its share. The
    /// request's own timeout bounds the wait (503 `timeout`, nothing changed).
    pub async fn admit(
        &self,
        pool: &PgPool,
        weigh_sql: &'static str,
        id: Uuid,
        user: Uuid,
    ) -> Result<Admitted, sqlx::Error> {
        let text_bytes: Option<i64> = sqlx::query_scalar(weigh_sql)
            .bind(id)
            .bind(user)
            .fetch_optional(pool)
            .await?;
        let text_bytes = text_bytes.map_or(0, |b| u64::try_from(b).unwrap_or(0));
        if text_bytes == 0 {
            return Ok(Admitted { permit: None });
        }
        let share = self.share(text_bytes);
        // The semaphore is never closed.
        let permit = Arc::clone(&self.permits)
            .acquire_many_owned(share)
            .await
            .ok();
        Ok(Admitted { permit })
    }

    /// Permits free now (for tests).
    pub fn available(&self) -> usize {
        self.permits.available_permits()
    }
}

/// A read let in: its share of the budget, if it was large.
#[derive(Debug)]
pub struct Admitted {
    permit: Option<OwnedSemaphorePermit>,
}

impl Admitted {
    /// Runs `read` on a connection of `pool`, then gives back the memory the connection's
    /// buffers grew to for it: sqlx keeps them, so every pooled connection that once read a
    /// large result would hold tens of megabytes for good, outside any budget.
    pub async fn read<T>(
        &self,
        pool: &PgPool,
        read: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        records::with_buffers_given_back(pool, read).await
    }

    /// `response` with the share held by its body until the body has been sent (or dropped
    /// with its connection): the memory is in use until then.
    pub fn holding(self, response: Response) -> Response {
        holding(response, self.permit)
    }
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
    fn the_weighing_statements_use_the_threshold() {
        for sql in [
            crate::routes::analyses::WEIGH_ANALYSIS_SQL,
            crate::routes::specviews::WEIGH_SPECVIEW_SQL,
            crate::routes::specviews::WEIGH_MARKDOWN_SQL,
        ] {
            assert!(
                sql.contains(&format!("> {UNWEIGHED_STORED_BYTES} ")),
                "{sql}"
            );
        }
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
