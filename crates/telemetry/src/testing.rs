//! An in-process OTLP/HTTP receiver for integration tests (cargo feature `test-receiver`): it
//! binds a random loopback port, accepts `POST /v1/traces` and `POST /v1/metrics` with protobuf
//! bodies, decodes them with `opentelemetry-proto` and keeps what it received.
//!
//! It serves on the Tokio runtime that starts it, so that runtime must keep running while the
//! code under test exports: use a multi-thread runtime, and shut the [`crate::TelemetryGuard`]
//! down inside `spawn_blocking` (shutdown blocks while it flushes).

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use prost::Message;

pub use opentelemetry_proto::tonic as proto;
use proto::collector::metrics::v1::{ExportMetricsServiceRequest, ExportMetricsServiceResponse};
use proto::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use proto::common::v1::{AnyValue, KeyValue, any_value};
use proto::resource::v1::Resource;

/// Largest request body accepted (the OTLP default limit is far above what tests send).
const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;

/// One span as received, with the ids as lower-case hex (empty parent id for a root span).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedSpan {
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    /// The `service.name` attribute of the resource the span was exported under.
    pub service_name: Option<String>,
}

#[derive(Default)]
struct Received {
    traces: Vec<ExportTraceServiceRequest>,
    metrics: Vec<ExportMetricsServiceRequest>,
    /// Requests answered with an error status, as "METHOD /path: reason".
    rejected: Vec<String>,
}

struct Shared {
    received: Mutex<Received>,
    changed: tokio::sync::Notify,
}

impl Shared {
    fn received(&self) -> MutexGuard<'_, Received> {
        // A panic while holding the lock cannot leave `Received` half-updated (pushes only).
        self.received
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A running receiver. Dropping it stops accepting connections.
pub struct OtlpReceiver {
    address: SocketAddr,
    shared: Arc<Shared>,
    accept_loop: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for OtlpReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OtlpReceiver")
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

impl OtlpReceiver {
    /// Binds `127.0.0.1:0` and starts serving on the current Tokio runtime.
    pub async fn start() -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let address = listener.local_addr()?;
        let shared = Arc::new(Shared {
            received: Mutex::new(Received::default()),
            changed: tokio::sync::Notify::new(),
        });
        let accept_shared = Arc::clone(&shared);
        let accept_loop = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let connection_shared = Arc::clone(&accept_shared);
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request| {
                        let shared = Arc::clone(&connection_shared);
                        async move { Ok::<_, Infallible>(handle(&shared, request).await) }
                    });
                    // A client that goes away mid-request is not the receiver's problem.
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(OtlpReceiver {
            address,
            shared,
            accept_loop,
        })
    }

    /// The base URL to configure as `OTEL_EXPORTER_OTLP_ENDPOINT`, e.g. `http://127.0.0.1:41234`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Every trace export request received so far, in arrival order.
    pub fn trace_requests(&self) -> Vec<ExportTraceServiceRequest> {
        self.shared.received().traces.clone()
    }

    /// Every metrics export request received so far, in arrival order.
    pub fn metric_requests(&self) -> Vec<ExportMetricsServiceRequest> {
        self.shared.received().metrics.clone()
    }

    /// Requests that were answered with an error, as `"POST /v1/traces: reason"`.
    pub fn rejected(&self) -> Vec<String> {
        self.shared.received().rejected.clone()
    }

    /// All spans received so far, flattened out of their resource and scope groups.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        let received = self.shared.received();
        let mut spans = Vec::new();
        for request in &received.traces {
            for resource_spans in &request.resource_spans {
                let service_name = service_name(resource_spans.resource.as_ref());
                for scope_spans in &resource_spans.scope_spans {
                    for span in &scope_spans.spans {
                        spans.push(ReceivedSpan {
                            name: span.name.clone(),
                            trace_id: hex(&span.trace_id),
                            span_id: hex(&span.span_id),
                            parent_span_id: hex(&span.parent_span_id),
                            service_name: service_name.clone(),
                        });
                    }
                }
            }
        }
        spans
    }

    /// Names of all metrics received so far (OpenTelemetry names, e.g. `fairlane.jobs`).
    pub fn metric_names(&self) -> BTreeSet<String> {
        let received = self.shared.received();
        received
            .metrics
            .iter()
            .flat_map(|r| &r.resource_metrics)
            .flat_map(|rm| &rm.scope_metrics)
            .flat_map(|sm| &sm.metrics)
            .map(|m| m.name.clone())
            .collect()
    }

    /// `service.name` of every resource that sent metrics.
    pub fn metric_service_names(&self) -> BTreeSet<String> {
        let received = self.shared.received();
        received
            .metrics
            .iter()
            .flat_map(|r| &r.resource_metrics)
            .filter_map(|rm| service_name(rm.resource.as_ref()))
            .collect()
    }

    /// Waits until `condition` holds (checked on every received request) or `timeout` passes;
    /// returns whether it held.
    pub async fn wait_until(&self, timeout: Duration, condition: impl Fn(&Self) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let changed = self.shared.changed.notified();
            if condition(self) {
                return true;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return condition(self);
            }
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.accept_loop.abort();
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn service_name(resource: Option<&Resource>) -> Option<String> {
    resource?
        .attributes
        .iter()
        .find(|kv: &&KeyValue| kv.key == "service.name")
        .and_then(|kv| match kv.value.as_ref() {
            Some(AnyValue {
                value: Some(any_value::Value::StringValue(s)),
            }) => Some(s.clone()),
            _ => None,
        })
}

fn reply(status: StatusCode, body: Vec<u8>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/x-protobuf"),
    );
    response
}

async fn handle(shared: &Shared, request: Request<Incoming>) -> Response<Full<Bytes>> {
    let what = format!("{} {}", request.method(), request.uri().path());
    let result = accept(shared, request).await;
    match result {
        Ok(response_body) => {
            shared.changed.notify_waiters();
            reply(StatusCode::OK, response_body)
        }
        Err((status, reason)) => {
            shared.received().rejected.push(format!("{what}: {reason}"));
            shared.changed.notify_waiters();
            reply(status, Vec::new())
        }
    }
}

async fn accept(
    shared: &Shared,
    request: Request<Incoming>,
) -> Result<Vec<u8>, (StatusCode, String)> {
    if request.method() != Method::POST {
        return Err((StatusCode::METHOD_NOT_ALLOWED, "only POST".to_owned()));
    }
    let path = request.uri().path().to_owned();
    if path != "/v1/traces" && path != "/v1/metrics" {
        return Err((StatusCode::NOT_FOUND, "unknown path".to_owned()));
    }
    let content_type = request
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if content_type != "application/x-protobuf" {
        return Err((
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("content-type {content_type:?}"),
        ));
    }
    if request
        .headers()
        .contains_key(http::header::CONTENT_ENCODING)
    {
        return Err((
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "compressed bodies are not supported".to_owned(),
        ));
    }
    let body = Limited::new(request.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
        .map_err(|e| (StatusCode::BAD_REQUEST, format!("reading body: {e}")))?
        .to_bytes();
    let bad = |e: prost::DecodeError| (StatusCode::BAD_REQUEST, format!("decoding: {e}"));
    if path == "/v1/traces" {
        let decoded = ExportTraceServiceRequest::decode(body).map_err(bad)?;
        shared.received().traces.push(decoded);
        Ok(ExportTraceServiceResponse::default().encode_to_vec())
    } else {
        let decoded = ExportMetricsServiceRequest::decode(body).map_err(bad)?;
        shared.received().metrics.push(decoded);
        Ok(ExportMetricsServiceResponse::default().encode_to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::trace::v1::{ResourceSpans, ScopeSpans, Span};

    async fn post(
        endpoint: &str,
        path: &str,
        content_type: &str,
        body: Vec<u8>,
    ) -> (StatusCode, Bytes) {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<Full<Bytes>>();
        let request = Request::post(format!("{endpoint}{path}"))
            .header("content-type", content_type)
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let response = client.request(request).await.unwrap();
        let status = response.status();
        (
            status,
            response.into_body().collect().await.unwrap().to_bytes(),
        )
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn decodes_and_keeps_what_it_is_sent() {
        let receiver = OtlpReceiver::start().await.unwrap();
        let request = ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(Resource {
                    attributes: vec![KeyValue {
                        key: "service.name".into(),
                        value: Some(AnyValue {
                            value: Some(any_value::Value::StringValue("svc".into())),
                        }),
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
                scope_spans: vec![ScopeSpans {
                    spans: vec![Span {
                        name: "hello".into(),
                        trace_id: vec![0xab; 16],
                        span_id: vec![0x01; 8],
                        ..Default::default()
                    }],
                    ..Default::default()
                }],
                ..Default::default()
            }],
        };
        let endpoint = receiver.endpoint();
        let (status, body) = post(
            &endpoint,
            "/v1/traces",
            "application/x-protobuf",
            request.encode_to_vec(),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        ExportTraceServiceResponse::decode(body).unwrap();
        assert_eq!(
            receiver.spans(),
            vec![ReceivedSpan {
                name: "hello".into(),
                trace_id: "ab".repeat(16),
                span_id: "01".repeat(8),
                parent_span_id: String::new(),
                service_name: Some("svc".into()),
            }]
        );

        let (status, _) = post(&endpoint, "/v1/traces", "application/json", b"{}".to_vec()).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        let (status, _) = post(
            &endpoint,
            "/v1/metrics",
            "application/x-protobuf",
            vec![0xff, 0xff, 0xff],
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let (status, _) = post(&endpoint, "/v1/logs", "application/x-protobuf", vec![]).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(receiver.rejected().len(), 3, "{:?}", receiver.rejected());
        assert!(receiver.metric_requests().is_empty());
        assert!(
            receiver
                .wait_until(Duration::from_secs(5), |r| r.trace_requests().len() == 1)
                .await
        );
        assert!(
            !receiver
                .wait_until(Duration::from_millis(50), |r| !r.metric_names().is_empty())
                .await
        );
    }
}
