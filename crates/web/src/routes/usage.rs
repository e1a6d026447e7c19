//! `GET /v1/usage`: the caller's quota in the current billing period.

use axum::Json;
use axum::extract::State;
use chrono::{DateTime, Utc};
use common::Service;
use serde::Serialize;
use utoipa::ToSchema;
use uuid::Uuid;

use crate::auth::AuthUser;
use crate::problem::Problem;
use crate::state::AppState;

/// A quota event type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum EventTypeName {
    Analysis,
    Specview,
}

impl From<Service> for EventTypeName {
    fn from(s: Service) -> Self {
        match s {
            Service::Analysis => EventTypeName::Analysis,
            Service::Specview => EventTypeName::Specview,
        }
    }
}

/// Usage of one event type in the current billing period.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct EventUsageView {
    pub event_type: EventTypeName,
    /// Units billed (completed jobs).
    pub used: i64,
    /// Units held by jobs that have not finished.
    pub reserved: i64,
    pub limit: i64,
    /// `limit - used - reserved`, never negative.
    pub remaining: i64,
    pub period_start: DateTime<Utc>,
    pub period_end: DateTime<Utc>,
}

/// Response of `GET /v1/usage`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct UsageView {
    pub user_id: Uuid,
    /// `free`, `pro`, `pro_plus` or `enterprise`.
    pub tier: String,
    pub usage: Vec<EventUsageView>,
}

/// The caller's usage, reservations and limits per event type in the current billing period.
#[utoipa::path(
    get,
    path = "/v1/usage",
    tag = "usage",
    responses((status = 200, description = "Usage per event type", body = UsageView)),
    security(("api_key" = []))
)]
pub async fn get(
    State(state): State<AppState>,
    user: AuthUser,
) -> Result<Json<UsageView>, Problem> {
    let mut conn = state.pool.acquire().await?;
    let usage = state
        .quota
        .current_usage(&mut conn, user.user_id, Utc::now())
        .await
        .map_err(crate::quota_problem)?;
    Ok(Json(UsageView {
        user_id: usage.user_id,
        tier: usage.tier.as_str().to_owned(),
        usage: usage
            .events
            .into_iter()
            .map(|e| EventUsageView {
                event_type: e.event_type.into(),
                used: e.used,
                reserved: e.reserved,
                limit: e.limit,
                remaining: (e.limit - e.used - e.reserved).max(0),
                period_start: e.period_start,
                period_end: e.period_end,
            })
            .collect(),
    }))
}
