//! The HTTP client the OTLP exporters send through: hyper (HTTP/1.1, plain `http://`) driven by
//! a one-thread Tokio runtime owned by telemetry.
//!
//! The SDK's batch span processor and periodic metric reader export from their own OS threads
//! with a bare `block_on`, where no Tokio reactor exists. Running the request on a runtime of our
//! own makes the exporters independent of the application's runtime (current-thread or
//! multi-thread, or none at all) and lets shutdown block without deadlocking the application.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use opentelemetry_http::{HttpClient, HttpError};

/// Largest collector response we read; OTLP responses are tiny.
const MAX_RESPONSE_BYTES: usize = 1024 * 1024;

/// The runtime that performs OTLP requests. Stopping it (explicitly or on drop) abandons any
/// request still in flight; exporters that try to send afterwards get an error, not a hang.
pub(crate) struct TransportRuntime {
    runtime: Option<tokio::runtime::Runtime>,
}

impl TransportRuntime {
    pub(crate) fn start() -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fairlane-otlp-http")
            .enable_all()
            .build()?;
        Ok(TransportRuntime {
            runtime: Some(runtime),
        })
    }

    /// A client whose every request (connect, send, read response) is bounded by `timeout`.
    pub(crate) fn client(&self, timeout: Duration) -> Option<OtlpHttpClient> {
        let handle = self.runtime.as_ref()?.handle().clone();
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Some(OtlpHttpClient {
            handle,
            client,
            timeout,
        })
    }

    /// Stops the runtime without waiting for in-flight requests. Safe to call from async code.
    pub(crate) fn stop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Drop for TransportRuntime {
    fn drop(&mut self) {
        self.stop();
    }
}

/// [`HttpClient`] for `opentelemetry-otlp`: hands each request to the transport runtime.
#[derive(Clone)]
pub(crate) struct OtlpHttpClient {
    handle: tokio::runtime::Handle,
    client: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
}

impl fmt::Debug for OtlpHttpClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OtlpHttpClient")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// A request that did not finish within the client's deadline.
#[derive(Debug, thiserror::Error)]
#[error("OTLP request timed out after {0:?}")]
struct RequestTimedOut(Duration);

#[async_trait]
impl HttpClient for OtlpHttpClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let client = self.client.clone();
        let timeout = self.timeout;
        let task = self.handle.spawn(async move {
            match tokio::time::timeout(timeout, send(&client, request)).await {
                Ok(result) => result,
                Err(_) => Err(Box::new(RequestTimedOut(timeout)) as HttpError),
            }
        });
        // A JoinError means the transport runtime was stopped: report it, never wait.
        task.await?
    }
}

async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    request: Request<Bytes>,
) -> Result<Response<Bytes>, HttpError> {
    let (parts, body) = request.into_parts();
    let response = client
        .request(Request::from_parts(parts, Full::new(body)))
        .await?;
    let (parts, body) = response.into_parts();
    let body = Limited::new(body, MAX_RESPONSE_BYTES).collect().await?;
    Ok(Response::from_parts(parts, body.to_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// A one-shot HTTP/1.1 server on a plain thread: reads one request, answers 200 "ok".
    fn serve_once() -> (String, std::thread::JoinHandle<String>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/v1/traces", listener.local_addr().unwrap());
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut seen = Vec::new();
            let mut buf = [0u8; 1024];
            while !seen.ends_with(b"payload") {
                let n = stream.read(&mut buf).unwrap();
                assert!(n > 0, "client closed early");
                seen.extend_from_slice(&buf[..n]);
            }
            stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                .unwrap();
            String::from_utf8(seen).unwrap()
        });
        (url, server)
    }

    #[test]
    fn sends_from_a_thread_without_any_runtime() {
        let transport = TransportRuntime::start().unwrap();
        let client = transport.client(Duration::from_secs(10)).unwrap();
        let (url, server) = serve_once();
        let request = Request::post(url)
            .header("content-type", "application/x-protobuf")
            .body(Bytes::from_static(b"payload"))
            .unwrap();
        // The SDK's export threads do exactly this: a bare executor, no Tokio context.
        let response = block_on_here(client.send_bytes(request)).unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.body().as_ref(), b"ok");
        let seen = server.join().unwrap();
        assert!(seen.starts_with("POST /v1/traces HTTP/1.1"), "{seen}");
        assert!(
            seen.contains("content-type: application/x-protobuf"),
            "{seen}"
        );
    }

    #[test]
    fn a_silent_server_times_out_instead_of_hanging() {
        let transport = TransportRuntime::start().unwrap();
        let client = transport.client(Duration::from_millis(200)).unwrap();
        // Accepts the connection (the kernel does, via the backlog) but never answers.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/v1/traces", listener.local_addr().unwrap());
        let request = Request::post(url).body(Bytes::new()).unwrap();
        let err = block_on_here(client.send_bytes(request)).unwrap_err();
        assert!(err.to_string().contains("timed out"), "{err}");
        drop(listener);
    }

    #[test]
    fn a_stopped_transport_fails_fast() {
        let mut transport = TransportRuntime::start().unwrap();
        let client = transport.client(Duration::from_secs(60)).unwrap();
        transport.stop();
        let request = Request::post("http://127.0.0.1:9/v1/traces")
            .body(Bytes::new())
            .unwrap();
        assert!(block_on_here(client.send_bytes(request)).is_err());
    }

    /// Polls a future to completion on the current thread, as `futures_executor::block_on` does.
    fn block_on_here<F: Future>(future: F) -> F::Output {
        use std::sync::Arc;
        use std::task::{Context, Poll, Wake, Waker};

        struct ThreadWaker(std::thread::Thread);
        impl Wake for ThreadWaker {
            fn wake(self: Arc<Self>) {
                self.0.unpark();
            }
        }
        let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        let mut future = std::pin::pin!(future);
        loop {
            if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
                return out;
            }
            std::thread::park();
        }
    }
}
