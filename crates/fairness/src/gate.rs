//! The fetch gate: admits jobs to start inside the queue's fetch transaction, so a user's
//! limit is checked and taken atomically with their jobs becoming `running`, fleet-wide.

use std::collections::HashMap;

use async_trait::async_trait;
use common::{QueueName, Tier};
use queue::{BoxError, FetchGate, JobId};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::config::FairnessConfig;
use crate::decision;
use crate::store;

/// Admits jobs within each user's limit, counted over all queues of one worker service.
#[derive(Debug)]
pub struct FairnessGate {
    service: String,
    queues: Vec<String>,
    config: FairnessConfig,
    tier_limits: store::TierLimits,
}

impl FairnessGate {
    /// `queues` are all queues of the worker service (a user's limit spans them).
    pub fn new(service: impl Into<String>, queues: &[QueueName], config: FairnessConfig) -> Self {
        let service = service.into();
        let tier_limits = store::TierLimits::from_config(&config);
        FairnessGate {
            service,
            queues: queues.iter().map(ToString::to_string).collect(),
            config,
            tier_limits,
        }
    }
}

#[async_trait]
impl FetchGate for FairnessGate {
    async fn select(
        &self,
        conn: &mut PgConnection,
        queue: &QueueName,
        limit: usize,
    ) -> Result<Vec<JobId>, BoxError> {
        if !self.config.fairness_enabled {
            return Ok(store::lock_any(conn, queue.as_str(), limit).await?);
        }
        // 1. Candidates in fetch order, skipping users already at their limit (their backlog
        //    never occupies a worker) and users another fetch is admitting right now; the
        //    users of the candidates stay locked until this transaction ends.
        let scan = limit.saturating_mul(2).min(limit + 100).max(1);
        let candidates = store::lock_candidates(
            conn,
            &self.service,
            queue.as_str(),
            &self.queues,
            &self.tier_limits,
            scan,
        )
        .await?;
        let mut users: Vec<Uuid> = candidates.iter().filter_map(|c| c.user_id).collect();
        users.sort_unstable();
        users.dedup();
        if users.is_empty() {
            return Ok(candidates.iter().take(limit).map(|c| c.job_id).collect());
        }

        // 2. Count under those locks: this statement sees every admission of these users
        //    committed before, and none can happen elsewhere until we commit.
        let counted = store::counts_and_tiers(conn, &self.queues, &users).await?;

        // 3. Decide (pure).
        let running: HashMap<Uuid, u32> = counted.iter().map(|(u, (n, _))| (*u, *n)).collect();
        let config = &self.config;
        Ok(decision::admit(
            &candidates,
            &running,
            |user| config.limit(counted.get(user).map_or(Tier::Free, |(_, t)| *t)),
            limit,
        ))
    }
}
