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
        let frees_a_slot = transitions
            .iter()
            .any(|t| t.user_id.is_some() && self.queues.contains(&t.queue));
        if frees_a_slot {
            // Delivered at commit, i.e. exactly when the slot is free.
            sqlx::query("SELECT pg_notify($1, q) FROM unnest($2::text[]) AS q")
                .bind(INSERT_CHANNEL)
                .bind(&self.queues)
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }
}
