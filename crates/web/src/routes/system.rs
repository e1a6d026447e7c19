//! Operational endpoints: liveness, readiness, Prometheus metrics, the OpenAPI document and the
//! docs page rendered from it.

use axum::Json;
use axum::extract::State;
use axum::response::{Html, IntoResponse, Response};
use http::{HeaderValue, StatusCode};
use serde::Serialize;
use utoipa::ToSchema;

use crate::problem::Problem;
use crate::state::AppState;

/// Health status.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Status {
    /// `ok` or `ready`.
    pub status: String,
}

/// Liveness: the process serves HTTP.
#[utoipa::path(get, path = "/healthz", tag = "system",
    responses((status = 200, description = "Alive", body = Status)))]
pub async fn healthz() -> Json<Status> {
    Json(Status {
        status: "ok".into(),
    })
}

/// Readiness: the database is reachable and every migration is applied.
#[utoipa::path(get, path = "/readyz", tag = "system",
    responses((status = 200, description = "Ready", body = Status)))]
pub async fn readyz(State(state): State<AppState>) -> Result<Json<Status>, Problem> {
    let not_ready =
        |detail: String| Problem::new(StatusCode::SERVICE_UNAVAILABLE, "not_ready", detail);
    // Answered within 2 s in all (a probe gives up sooner than the pool's 10 s acquire
    // timeout). The driver's words can name the database user or host: they go to the log, the
    // caller hears only what is wrong.
    let unreachable = || not_ready("the database is not reachable".to_owned());
    let checked = tokio::time::timeout(std::time::Duration::from_secs(2), async {
        sqlx::query("SELECT 1").execute(&state.pool).await?;
        schema::check_applied(&state.pool).await
    })
    .await;
    match checked {
        Ok(Ok(())) => {}
        Ok(Err(e @ schema::SchemaError::Behind { .. })) => return Err(not_ready(e.to_string())),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "readiness: the database is not reachable");
            return Err(unreachable());
        }
        Err(_) => {
            tracing::warn!("readiness: the database did not answer within 2 s");
            return Err(unreachable());
        }
    }
    Ok(Json(Status {
        status: "ready".into(),
    }))
}

/// Prometheus metrics (text format 0.0.4).
#[utoipa::path(get, path = "/metrics", tag = "system",
    responses((status = 200, description = "Metrics", body = String, content_type = "text/plain")))]
pub async fn metrics() -> Response {
    let mut response = telemetry::render_prometheus().into_response();
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(telemetry::PROMETHEUS_CONTENT_TYPE),
    );
    response
}

/// This API's OpenAPI 3.1 document.
#[utoipa::path(get, path = "/openapi.json", tag = "system",
    responses((status = 200, description = "The OpenAPI document", body = Object)))]
pub async fn openapi(State(state): State<AppState>) -> Response {
    let mut response = state.openapi_json.clone().into_response();
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// The API documentation page (self-contained HTML rendered from the OpenAPI document).
#[utoipa::path(get, path = "/docs", tag = "system",
    responses((status = 200, description = "HTML", body = String, content_type = "text/html")))]
pub async fn docs(State(state): State<AppState>) -> Html<String> {
    Html(state.docs_html.clone())
}
