//! The HTTP/1 accept loop: `axum::serve` without its two gaps for a public port. It gives hyper
//! no timer, so hyper drops its header-read timeout and a client that sends a byte of headers now
//! and then holds a connection (and its task) for as long as it likes; and it accepts without
//! limit. Here every connection must deliver a request's headers within `header_read_timeout`
//! (also when idle between keep-alive requests), at most `max_connections` are open at once (the
//! next waits in the kernel's backlog), and shutdown stops accepting, lets each connection finish
//! the request it is serving within `drain_timeout` (a client still sending headers is not waited
//! for longer), and waits for them.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
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

/// Serves `app` on `listener` until `shutdown` fires, then lets the requests in progress finish.
/// Each request carries the peer's address as `ConnectInfo<SocketAddr>`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
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
                .serve_connection(TokioIo::new(stream), service);
            let mut connection = std::pin::pin!(connection);
            tokio::select! {
                served = connection.as_mut() => log_end(served, peer),
                () = shutdown.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    match tokio::time::timeout(limits.drain_timeout, connection.as_mut()).await {
                        Ok(served) => log_end(served, peer),
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

fn log_end(served: Result<(), hyper::Error>, peer: SocketAddr) {
    if let Err(e) = served {
        tracing::debug!(error = %e, %peer, "connection ended with an error");
    }
}
