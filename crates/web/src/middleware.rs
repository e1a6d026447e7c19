//! Cross-cutting request handling: the `http.server.request.duration` histogram with the route
//! template, a request span continuing the caller's W3C trace, and the request timeout.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
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
pub async fn timeout(limit: Duration, mut req: Request, next: Next) -> Response {
    let watch = TimeoutWatch::default();
    req.extensions_mut().insert(watch.clone());
    // The handler's future is dropped at the end of this statement, before the watch is read.
    let finished = tokio::time::timeout(limit, next.run(req)).await;
    match finished {
        Ok(response) => response,
        Err(_) if watch.is_outcome_unknown() => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "timeout_outcome_unknown",
            format!(
                "the request took longer than {} s and was abandoned while its writes were being \
                 committed: they may have taken effect; look at what it changes (for new work, \
                 GET /v1/usage and your jobs) before sending it again",
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
