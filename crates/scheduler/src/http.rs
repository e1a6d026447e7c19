//! `/status`: this replica's identity and leadership, and its tasks' schedules, as JSON. Next to
//! workerkit's `/healthz`, `/readyz` (database reachable and migrated; leadership is never a
//! readiness condition: followers are healthy standbys) and `/metrics`.

use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use chrono::Utc;
use queue::LeaderHandle;
use serde::Serialize;

use crate::schedule::Schedule;

/// What `/status` reports; leadership handles are filled in once the schema is ready.
#[derive(Debug)]
pub struct StatusState {
    pub candidate_id: String,
    pub tasks: Vec<(&'static str, bool, Schedule)>,
    pub scheduler: OnceLock<LeaderHandle>,
    pub maintenance: OnceLock<Option<LeaderHandle>>,
}

#[derive(Serialize)]
struct StatusBody<'a> {
    candidate_id: &'a str,
    /// The schema is there and the scheduler campaigns (false while waiting for migrations).
    running: bool,
    scheduler_leader: bool,
    /// `null` when this replica does not take part in queue maintenance.
    maintenance_leader: Option<bool>,
    tasks: Vec<TaskBody<'a>>,
}

#[derive(Serialize)]
struct TaskBody<'a> {
    task: &'a str,
    enabled: bool,
    schedule: &'a str,
    next_tick: Option<chrono::DateTime<Utc>>,
}

pub fn routes(state: Arc<StatusState>) -> Router {
    Router::new()
        .route("/status", get(status))
        .with_state(state)
}

async fn status(State(state): State<Arc<StatusState>>) -> impl IntoResponse {
    let now = Utc::now();
    let body = StatusBody {
        candidate_id: &state.candidate_id,
        running: state.scheduler.get().is_some(),
        scheduler_leader: state.scheduler.get().is_some_and(LeaderHandle::is_leader),
        maintenance_leader: state
            .maintenance
            .get()
            .and_then(|m| m.as_ref().map(LeaderHandle::is_leader)),
        tasks: state
            .tasks
            .iter()
            .map(|(task, enabled, schedule)| TaskBody {
                task,
                enabled: *enabled,
                schedule: schedule.as_str(),
                next_tick: schedule.next_after(now),
            })
            .collect(),
    };
    (
        [(header::CONTENT_TYPE, "application/json")],
        serde_json::to_string(&body).unwrap_or_default(),
    )
}
