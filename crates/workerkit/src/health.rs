//! The small HTTP surface of a background service: `/healthz` (the process is alive), `/readyz`
//! (the database answers and carries every migration), `/metrics` (Prometheus text). The worker
//! services serve exactly these; the scheduler adds its own routes to [`routes`].

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// `/healthz`, `/readyz` and `/metrics`, ready to be extended with more routes.
pub fn routes(pool: PgPool) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .with_state(pool)
}

/// Serves `app` on `listener` until `done` is cancelled.
pub async fn serve(listener: tokio::net::TcpListener, app: Router, done: CancellationToken) {
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(async move { done.cancelled().await })
        .await
    {
        tracing::error!(error = %e, "health server failed");
    }
}

/// Answered within [`READY_CHECK_BOUND`]: a probe gives up sooner than the pool's acquire
/// timeout, and a shutdown waits for the checks in flight.
async fn ready(State(pool): State<PgPool>) -> impl IntoResponse {
    match tokio::time::timeout(READY_CHECK_BOUND, schema::check_applied(&pool)).await {
        Ok(Ok(())) => (StatusCode::OK, "ready".to_owned()),
        Ok(Err(e)) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {e}")),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: the database did not answer within {READY_CHECK_BOUND:?}"),
        ),
    }
}

/// How long `/readyz` waits for the database.
pub const READY_CHECK_BOUND: std::time::Duration = std::time::Duration::from_secs(2);

async fn metrics() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, telemetry::PROMETHEUS_CONTENT_TYPE)],
        telemetry::render_prometheus(),
    )
}
