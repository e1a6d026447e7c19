//! The worker's small HTTP surface: `/healthz` (the process is alive), `/readyz` (the database
//! answers and carries every migration), `/metrics` (Prometheus text).

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    pool: PgPool,
    done: CancellationToken,
) {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .with_state(pool);
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(async move { done.cancelled().await })
        .await
    {
        tracing::error!(error = %e, "health server failed");
    }
}

async fn ready(State(pool): State<PgPool>) -> impl IntoResponse {
    match schema::check_applied(&pool).await {
        Ok(()) => (StatusCode::OK, "ready".to_owned()),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {e}")),
    }
}

async fn metrics() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, telemetry::PROMETHEUS_CONTENT_TYPE)],
        telemetry::render_prometheus(),
    )
}
