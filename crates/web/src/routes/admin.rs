//! Admin endpoints (`Authorization: Bearer <ADMIN_TOKEN>`): users, tiers, API keys.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use http::StatusCode;
use serde::Deserialize;
use utoipa::ToSchema;
use uuid::Uuid;

use crate::admin::{self, AdminError, IssuedKeyView, RevokedKeyView, TierName, UserView};
use crate::auth::Admin;
use crate::extract::{ApiJson, IdPath};
use crate::middleware::{self, TimeoutWatch};
use crate::problem::Problem;
use crate::state::AppState;

impl From<AdminError> for Problem {
    fn from(e: AdminError) -> Self {
        match e {
            AdminError::Invalid(m) => Problem::validation(m),
            AdminError::NotFound(m) => Problem::not_found(m),
            // Every admin route writes with autocommit statements: a connection lost while one
            // was in flight leaves its effect unknown; one never had (the pool's wait ran out)
            // changed nothing.
            AdminError::Database(e @ (sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed)) => {
                Problem::from(e)
            }
            AdminError::Database(e) if queue::error::is_connection_error(&e) => {
                tracing::warn!(error = %e, "the connection was lost during an admin write");
                Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "commit_outcome_unknown",
                    "the connection to the database was lost while the change was being made; \
                     it may have taken effect: look before sending it again",
                )
            }
            AdminError::Database(e) => Problem::from(e),
            AdminError::Randomness(e) => Problem::internal(&e),
        }
    }
}

/// Request body of `POST /admin/users`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateUser {
    /// Display name, 1 to 200 characters.
    #[schema(min_length = 1, max_length = 200, example = "Ada")]
    pub name: String,
    #[schema(value_type = TierName)]
    pub tier: String,
}

/// Request body of `PATCH /admin/users/{id}`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateUser {
    #[schema(value_type = TierName)]
    pub tier: String,
}

fn user_id(id: &str) -> Result<Uuid, Problem> {
    super::path_uuid(id).ok_or_else(|| Problem::not_found(format!("no user `{id}`")))
}

/// Create a user with a tier.
#[utoipa::path(
    post,
    path = "/admin/users",
    tag = "admin",
    request_body = CreateUser,
    responses((status = 201, description = "The user", body = UserView)),
    security(("admin_token" = []))
)]
pub async fn create_user(
    State(state): State<AppState>,
    _admin: Admin,
    watch: Option<Extension<TimeoutWatch>>,
    ApiJson(body): ApiJson<CreateUser>,
) -> Result<Response, Problem> {
    let tier = admin::parse_tier(&body.tier)?;
    let user = middleware::committing(
        watch.as_ref(),
        admin::create_user(&state.pool, &body.name, tier),
    )
    .await?;
    Ok((StatusCode::CREATED, Json(user)).into_response())
}

/// Change a user's tier.
#[utoipa::path(
    patch,
    path = "/admin/users/{id}",
    tag = "admin",
    params(("id" = Uuid, Path, description = "The user id")),
    request_body = UpdateUser,
    responses((status = 200, description = "The user", body = UserView)),
    security(("admin_token" = []))
)]
pub async fn update_user(
    State(state): State<AppState>,
    _admin: Admin,
    IdPath(id): IdPath,
    watch: Option<Extension<TimeoutWatch>>,
    ApiJson(body): ApiJson<UpdateUser>,
) -> Result<Json<UserView>, Problem> {
    let id = user_id(&id)?;
    let tier = admin::parse_tier(&body.tier)?;
    Ok(Json(
        middleware::committing(watch.as_ref(), admin::set_tier(&state.pool, id, tier)).await?,
    ))
}

/// Issue an API key for a user. The key is in this response only.
#[utoipa::path(
    post,
    path = "/admin/users/{id}/keys",
    tag = "admin",
    params(("id" = Uuid, Path, description = "The user id")),
    responses((status = 201, description = "The new key", body = IssuedKeyView)),
    security(("admin_token" = []))
)]
pub async fn issue_key(
    State(state): State<AppState>,
    _admin: Admin,
    IdPath(id): IdPath,
    watch: Option<Extension<TimeoutWatch>>,
) -> Result<Response, Problem> {
    let id = user_id(&id)?;
    let key = middleware::committing(watch.as_ref(), admin::issue_key(&state.pool, id)).await?;
    Ok((StatusCode::CREATED, Json(key)).into_response())
}

/// Revoke an API key (idempotent).
#[utoipa::path(
    delete,
    path = "/admin/keys/{key_id}",
    tag = "admin",
    params(("key_id" = String, Path, description = "The key's public id")),
    responses((status = 200, description = "The revoked key", body = RevokedKeyView)),
    security(("admin_token" = []))
)]
pub async fn revoke_key(
    State(state): State<AppState>,
    _admin: Admin,
    IdPath(key_id): IdPath,
    watch: Option<Extension<TimeoutWatch>>,
) -> Result<Json<RevokedKeyView>, Problem> {
    Ok(Json(
        middleware::committing(watch.as_ref(), admin::revoke_key(&state.pool, &key_id)).await?,
    ))
}
