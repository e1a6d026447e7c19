//! The fetch gate: admits jobs to start inside the queue's fetch transaction, so a user's
//! limit is checked and taken atomically with their jobs becoming `running`, fleet-wide.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use common::{QueueName, Tier};
use queue::{BoxError, FetchGate, JobId};
use sqlx::PgConnection;

use crate::config::FairnessConfig;
use crate::decision::{self, user_lock_key};
use crate::metrics::FairnessMetrics;
use crate::store;
use crate::tiers::TierCache;

/// Admits jobs within each user's limit, counted over all queues of one worker service.
#[derive(Debug)]
pub struct FairnessGate {
    service: String,
    queues: Vec<String>,
    config: FairnessConfig,
    tiers: Arc<TierCache>,
    metrics: FairnessMetrics,
}

impl FairnessGate {
    /// `queues` are all queues of the worker service (a user's limit spans them).
    pub fn new(
        service: impl Into<String>,
        queues: &[QueueName],
        config: FairnessConfig,
        tiers: Arc<TierCache>,
    ) -> Self {
        FairnessGate {
            service: service.into(),
            queues: queues.iter().map(ToString::to_string).collect(),
            config,
            tiers,
            metrics: FairnessMetrics::new(),
        }
    }

    fn limits(&self, tiers: &HashMap<String, Tier>) -> impl Fn(&str) -> u32 {
        let config = self.config.clone();
        let tiers = tiers.clone();
        move |user| config.limit(tiers.get(user).copied().unwrap_or(Tier::Free))
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
            let all = store::lock_candidates(conn, queue.as_str(), &[], limit).await?;
            return Ok(all.into_iter().map(|c| c.job_id).collect());
        }
        // 1. Who is already full? (A hint: re-checked under lock below.)
        let running = store::running_counts(conn, &self.queues, None).await?;
        let tiers = self
            .tiers
            .tiers(conn, running.keys().map(String::as_str))
            .await?;
        self.record_running(&running, &tiers);
        let full = decision::full_users(&running, self.limits(&tiers));

        // 2. Lock candidates, skipping full users: their backlog never blocks anyone.
        let scan = limit.saturating_mul(2).min(limit + 100).max(1);
        let candidates = store::lock_candidates(conn, queue.as_str(), &full, scan).await?;
        let mut users: Vec<String> = candidates
            .iter()
            .filter_map(|c| c.user_id.clone())
            .collect();
        users.sort();
        users.dedup();
        if users.is_empty() {
            return Ok(candidates.iter().take(limit).map(|c| c.job_id).collect());
        }

        // 3. Serialize with every other fetch of these users, fleet-wide, then count again: the
        //    statement after the lock sees every admission committed before it.
        let mut keys: Vec<i64> = users
            .iter()
            .map(|u| user_lock_key(&self.service, u))
            .collect();
        store::lock_keys(conn, &mut keys).await?;
        let running = store::running_counts(conn, &self.queues, Some(&users)).await?;
        let tiers = self
            .tiers
            .tiers(conn, users.iter().map(String::as_str))
            .await?;

        // 4. Decide.
        Ok(decision::admit(
            &candidates,
            &running,
            self.limits(&tiers),
            limit,
        ))
    }
}

impl FairnessGate {
    fn record_running(&self, running: &HashMap<String, u32>, tiers: &HashMap<String, Tier>) {
        let mut by_tier: Vec<(Tier, u64)> = Tier::ALL.iter().map(|t| (*t, 0)).collect();
        for (user, n) in running {
            let tier = tiers.get(user).copied().unwrap_or(Tier::Free);
            if let Some(slot) = by_tier.iter_mut().find(|(t, _)| *t == tier) {
                slot.1 += u64::from(*n);
            }
        }
        self.metrics.running(&self.service, &by_tier);
    }
}
