//! Wakes the service's producers when a user's job leaves `running`, so the user's next waiting
//! job (skipped by the gate while the user was full) starts within milliseconds, on any replica.
//! The wake-up is sent after the transition commits, i.e. exactly when the slot is free, through
//! the queue's waker (outside the transaction: notifying commits would be serialized).

use async_trait::async_trait;
use common::QueueName;
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
        _conn: &mut PgConnection,
        _transitions: &[Transition],
    ) -> Result<(), BoxError> {
        Ok(())
    }

    /// The lanes where user jobs just freed a slot: their users' next jobs wait there (users are
    /// routed to one lane by tier; system jobs never wait for a slot).
    fn wake_after_commit(&self, transitions: &[Transition]) -> Vec<String> {
        let mut lanes: Vec<String> = transitions
            .iter()
            .filter(|t| t.user_id.is_some() && self.queues.contains(&t.queue))
            .map(|t| t.queue.clone())
            .collect();
        lanes.sort_unstable();
        lanes.dedup();
        lanes
    }
}
