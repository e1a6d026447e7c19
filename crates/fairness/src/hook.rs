//! Wakes the service's producers when a user's job leaves `running`, so the user's next waiting
//! job (skipped by the gate while the user was full) starts within milliseconds, on any replica.

use async_trait::async_trait;
use common::QueueName;
use queue::insert::INSERT_CHANNEL;
use queue::{BoxError, Transition, TransitionHook};
use sqlx::PgConnection;

#[derive(Debug, Clone)]
pub struct FairnessHook {
    queues: Vec<String>,
}

impl FairnessHook {
    /// `queues` are the worker service's queues (the ones a user's limit spans).
    pub fn new(queues: &[QueueName]) -> Self {
        FairnessHook {
            queues: queues.iter().map(ToString::to_string).collect(),
        }
    }
}

#[async_trait]
impl TransitionHook for FairnessHook {
    async fn on_transitions(
        &self,
        conn: &mut PgConnection,
        transitions: &[Transition],
    ) -> Result<(), BoxError> {
        // The lanes where user jobs just freed a slot: their users' next jobs wait there (users
        // are routed to one lane by tier; system jobs never wait for a slot).
        let mut lanes: Vec<&str> = transitions
            .iter()
            .filter(|t| t.user_id.is_some() && self.queues.contains(&t.queue))
            .map(|t| t.queue.as_str())
            .collect();
        lanes.sort_unstable();
        lanes.dedup();
        if !lanes.is_empty() {
            // Delivered at commit, i.e. exactly when the slots are free.
            sqlx::query("SELECT pg_notify($1, q) FROM unnest($2::text[]) AS q")
                .bind(INSERT_CHANNEL)
                .bind(&lanes)
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }
}
