//! The HTTP/1 accept loop: `axum::serve` without its two gaps for a public port. It gives hyper
//! no timer, so hyper drops its header-read timeout and a client that sends a byte of headers now
//! and then holds a connection (and its task) for as long as it likes; and it accepts without
//! limit. Here every connection must deliver a request's headers within `header_read_timeout`
//! (also when idle between keep-alive requests), and must take what it is sent: a response whose
//! writing makes no progress for `header_read_timeout` (a client that stopped reading, its
//! window shut) closes the connection, where hyper alone would wait on the socket for ever. At
//! most `max_connections` are open at once (the next waits in the kernel's backlog), and shutdown
//! stops accepting, lets each connection finish the request it is serving within `drain_timeout`
//! (a client still sending headers is not waited for longer), and waits for them.

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::Sleep;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

/// How the accept loop bounds its clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// A request's headers must arrive within this, counted from when the connection is ready
    /// for them (so an idle keep-alive connection is closed after it too).
    pub header_read_timeout: Duration,
    /// Connections open at once; further ones wait to be accepted.
    pub max_connections: usize,
    /// On shutdown, how long a connection may take to finish what it is doing (a request in
    /// progress, or headers a client is still sending) before it is closed regardless.
    pub drain_timeout: Duration,
}

/// How many connections may be open at once with `open_file_limit` descriptors: at most
/// `configured`, leaving a quarter of the limit (at least 64) to everything else a request needs
/// (the database pools and the batch thread's connections, Redis, DNS, `git ls-remote`). Idle
/// clients beyond that wait in the backlog, instead of taking the descriptors a database
/// connection needs and turning healthy requests into errors.
pub fn connection_cap(configured: usize, open_file_limit: u64) -> usize {
    let reserve = (open_file_limit / 4).max(64);
    let room = usize::try_from(open_file_limit.saturating_sub(reserve)).unwrap_or(usize::MAX);
    configured.min(room).max(1)
}

/// Raises this process's soft limit of open files to its hard limit (as Go's runtime does at
/// start), and returns the soft limit in force; `None` if it cannot be read.
pub fn raise_open_file_limit() -> Option<u64> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).ok()?;
    if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
        return Some(hard);
    }
    Some(soft)
}

/// Serves `app` on `listener` until `shutdown` fires, then lets the requests in progress finish.
/// Each request carries the peer's address as `ConnectInfo<SocketAddr>`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let errors = ConnectionErrors::register();
    let connections = TaskTracker::new();
    loop {
        let slot = tokio::select! {
            () = shutdown.cancelled() => break,
            slot = Arc::clone(&slots).acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let app = app.clone();
        let shutdown = shutdown.clone();
        let errors = errors.clone();
        connections.spawn(async move {
            let _slot = slot;
            let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
                let mut request = request.map(Body::new);
                request.extensions_mut().insert(ConnectInfo(peer));
                let app = app.clone();
                async move {
                    let Ok(response) = app.oneshot(request).await;
                    Ok::<_, Infallible>(response)
                }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .serve_connection(
                    TokioIo::new(StalledWritesEnd::new(stream, limits.header_read_timeout)),
                    service,
                );
            let mut connection = std::pin::pin!(connection);
            tokio::select! {
                served = connection.as_mut() => log_end(served, peer, &errors),
                () = shutdown.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    match tokio::time::timeout(limits.drain_timeout, connection.as_mut()).await {
                        Ok(served) => log_end(served, peer, &errors),
                        Err(_) => tracing::debug!(%peer, "connection closed at the drain bound"),
                    }
                }
            }
        });
    }
    drop(listener);
    connections.close();
    connections.wait().await;
}

/// Why connections ended in an error before a request reached the API (hyper answers those
/// itself, with a bare status line: 400 for a malformed request, 431 for headers beyond its
/// buffer), counted as `fairlane.http.connection_errors{reason}`
/// (`fairlane_http_connection_errors_total`), since no request metric sees them.
#[derive(Debug, Clone)]
pub struct ConnectionErrors(opentelemetry::metrics::Counter<u64>);

/// The `reason` values of [`ConnectionErrors`], in [`connection_error_reason`]'s order.
pub const CONNECTION_ERROR_REASONS: [&str; 5] = [
    "headers_too_large",
    "malformed",
    "header_timeout",
    "incomplete",
    "other",
];

impl ConnectionErrors {
    /// The counter on the global `fairlane` meter, every reason's series at 0 from the start.
    pub fn register() -> ConnectionErrors {
        let counter = opentelemetry::global::meter("fairlane")
            .u64_counter("fairlane.http.connection_errors")
            .with_unit("{connection}")
            .with_description(
                "Connections ended by an error before a request reached the API, by reason",
            )
            .build();
        for reason in CONNECTION_ERROR_REASONS {
            counter.add(0, &[opentelemetry::KeyValue::new("reason", reason)]);
        }
        ConnectionErrors(counter)
    }

    fn count(&self, error: &hyper::Error) {
        self.0.add(
            1,
            &[opentelemetry::KeyValue::new(
                "reason",
                connection_error_reason(error),
            )],
        );
    }
}

/// The [`CONNECTION_ERROR_REASONS`] entry of `error`.
fn connection_error_reason(error: &hyper::Error) -> &'static str {
    if error.is_parse_too_large() {
        "headers_too_large"
    } else if error.is_parse() || error.is_parse_status() {
        "malformed"
    } else if error.is_timeout() {
        "header_timeout"
    } else if error.is_incomplete_message() {
        "incomplete"
    } else {
        "other"
    }
}

fn log_end(served: Result<(), hyper::Error>, peer: SocketAddr, errors: &ConnectionErrors) {
    if let Err(e) = served {
        errors.count(&e);
        tracing::debug!(error = %e, %peer, "connection ended with an error");
    }
}

/// A connection's socket whose writes fail with `TimedOut` once one has waited `bound` without
/// any progress: the client stopped reading. Reads pass through (hyper times those itself).
struct StalledWritesEnd<S> {
    inner: S,
    bound: Duration,
    /// Set while a write waits on the socket; cleared by any progress.
    stalled_since: Option<Pin<Box<Sleep>>>,
}

impl<S> StalledWritesEnd<S> {
    fn new(inner: S, bound: Duration) -> Self {
        StalledWritesEnd {
            inner,
            bound,
            stalled_since: None,
        }
    }

    /// What a write that returned `polled` means, with the stall timer kept up to date.
    fn watch<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.stalled_since = None;
            return polled;
        }
        let bound = self.bound;
        let timer = self
            .stalled_since
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(bound)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client took nothing of the response within the bound",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for StalledWritesEnd<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for StalledWritesEnd<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    /// Passed through: a socket's flush is done at once and says nothing of the client's
    /// progress, so it must not reset a write's stall.
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_connection_cap_leaves_descriptors_for_everything_else() {
        // Plenty: the configured cap stands.
        assert_eq!(connection_cap(4096, 1_048_576), 4096);
        assert_eq!(connection_cap(4096, 20_000), 4096);
        // A common default soft limit: a quarter is kept back.
        assert_eq!(connection_cap(4096, 1024), 768);
        // Small limits keep at least 64 back, and at least one connection is served.
        assert_eq!(connection_cap(4096, 200), 136);
        assert_eq!(connection_cap(4096, 10), 1);
        assert_eq!(connection_cap(10, 1024), 10);
    }
}
