//! Cross-cutting request handling: the `http.server.request.duration` histogram with the route
//! template, a request span continuing the caller's W3C trace, and the request timeout.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::StatusCode;
use http_body::{Frame, SizeHint};
use opentelemetry::KeyValue;
use tracing::Instrument;

use crate::problem::Problem;
use crate::state::AppState;

/// Records the request's duration and runs it inside a span that continues an incoming
/// `traceparent`, so jobs enqueued by the request carry the caller's trace.
pub async fn observe(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |m| m.as_str())
        .to_owned();
    let method = method_label(req.method());
    // OpenTelemetry HTTP server conventions: a server span named "{method} {route}".
    let span = tracing::info_span!(
        "http.request",
        otel.name = %format!("{method} {route}"),
        otel.kind = "server",
        http.request.method = %method,
        http.route = %route,
        http.response.status_code = tracing::field::Empty,
    );
    let mut carrier = BTreeMap::new();
    for name in ["traceparent", "tracestate"] {
        if let Some(v) = req.headers().get(name).and_then(|v| v.to_str().ok()) {
            carrier.insert(name.to_owned(), v.to_owned());
        }
    }
    if carrier.contains_key("traceparent") {
        // A malformed traceparent is ignored: the request starts a new trace.
        let _ = telemetry::set_parent_from(&span, &carrier);
    }
    let response = next.run(req).instrument(span.clone()).await;
    span.record("http.response.status_code", response.status().as_u16());
    state.request_duration.record(
        started.elapsed().as_secs_f64(),
        &[
            KeyValue::new("route", route),
            KeyValue::new("method", method),
            KeyValue::new("status", i64::from(response.status().as_u16())),
        ],
    );
    response
}

/// The request's method as a metric label and span name: one of the standard methods, or
/// `_OTHER` (OpenTelemetry's HTTP conventions). hyper accepts any token as a method, so the raw
/// one would let a client mint label sets until the SDK's cardinality limit folds every later
/// series, the real 5xx ones included, into one overflow series.
fn method_label(method: &http::Method) -> &'static str {
    match method.as_str() {
        "GET" => "GET",
        "HEAD" => "HEAD",
        "POST" => "POST",
        "PUT" => "PUT",
        "DELETE" => "DELETE",
        "CONNECT" => "CONNECT",
        "OPTIONS" => "OPTIONS",
        "TRACE" => "TRACE",
        "PATCH" => "PATCH",
        _ => "_OTHER",
    }
}

/// Answers 503 `timeout` when the handler takes longer than `limit`; the handler's future is
/// dropped, which rolls back any open transaction. A handler whose writes were already being
/// committed when it was dropped says so through the request's [`TimeoutWatch`], and the answer
/// is then 503 `timeout_outcome_unknown`: "nothing was changed" is said only when it is true.
///
/// A handler still waiting for the request's body when the time runs out was held up by the
/// client, not by this server: that is a 408 `request_timeout`, which does not count against
/// the server's error rate.
pub async fn timeout(limit: Duration, req: Request, next: Next) -> Response {
    let watch = TimeoutWatch::default();
    let body = BodyProgress::default();
    let mut req = req.map(|inner| {
        Body::new(WatchedBody {
            inner,
            progress: body.clone(),
        })
    });
    req.extensions_mut().insert(watch.clone());
    // The handler's future is dropped at the end of this statement, before the watch is read.
    let finished = tokio::time::timeout(limit, next.run(req)).await;
    match finished {
        Ok(response) => response,
        // Writes may have committed: that is the answer, whatever else held the request up.
        Err(_) if watch.is_outcome_unknown() => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "timeout_outcome_unknown",
            format!(
                "the request took longer than {} s and was abandoned while its writes were being \
                 committed: they may have taken effect; an analysis or specview request sent \
                 again answers with the work this one started if it did; for anything else, \
                 look at what it changes before sending it again",
                limit.as_secs_f64()
            ),
        )
        .into_response(),
        Err(_) if body.is_partly_read() => Problem::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            format!(
                "the request body did not arrive within {} s; nothing was changed",
                limit.as_secs_f64()
            ),
        )
        .into_response(),
        Err(_) => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "timeout",
            format!(
                "the request took longer than {} s and was abandoned; nothing was changed",
                limit.as_secs_f64()
            ),
        )
        .into_response(),
    }
}

/// How far a request's body has been read: not at all, partly, or to its end.
#[derive(Debug, Clone, Default)]
struct BodyProgress(Arc<AtomicU8>);

impl BodyProgress {
    const READING: u8 = 1;
    const READ: u8 = 2;

    fn reading(&self) {
        let _ = self
            .0
            .compare_exchange(0, Self::READING, Ordering::AcqRel, Ordering::Acquire);
    }

    fn read(&self) {
        self.0.store(Self::READ, Ordering::Release);
    }

    /// The handler asked for the body and it has not all arrived.
    fn is_partly_read(&self) -> bool {
        self.0.load(Ordering::Acquire) == Self::READING
    }
}

/// A request body that reports its [`BodyProgress`].
struct WatchedBody {
    inner: Body,
    progress: BodyProgress,
}

impl http_body::Body for WatchedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        this.progress.reading();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) || this.inner.is_end_stream() {
            this.progress.read();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request extension the [`timeout`] layer reads after dropping a handler that ran out of
/// time: a handler that learns, as it is dropped, that its writes may have committed calls
/// [`TimeoutWatch::outcome_unknown`].
#[derive(Debug, Clone, Default)]
pub struct TimeoutWatch(Arc<AtomicBool>);

impl TimeoutWatch {
    /// The request's writes may have committed although its handler did not finish.
    pub fn outcome_unknown(&self) {
        self.0.store(true, Ordering::Release);
    }

    fn is_outcome_unknown(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Awaits `write`, a statement whose effect stands once it has been sent: an autocommit write, or
/// a transaction's `COMMIT`. If the timeout drops the handler while `write` is in flight (the
/// server may still be waiting for a lock or flushing the commit), the request's `watch` learns
/// that its outcome is unknown, so the answer is `timeout_outcome_unknown`, never "nothing was
/// changed".
pub async fn committing<F: IntoFuture>(
    watch: Option<&axum::Extension<TimeoutWatch>>,
    write: F,
) -> F::Output {
    /// Marks the watch unless `answered` was set before it was dropped.
    struct InFlight<'a> {
        watch: Option<&'a TimeoutWatch>,
        answered: bool,
    }
    impl Drop for InFlight<'_> {
        fn drop(&mut self) {
            if !self.answered
                && let Some(watch) = self.watch
            {
                watch.outcome_unknown();
            }
        }
    }
    let mut in_flight = InFlight {
        watch: watch.map(|axum::Extension(watch)| watch),
        answered: false,
    };
    let output = write.await;
    in_flight.answered = true;
    output
}
