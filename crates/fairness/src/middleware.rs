//! ADR-10's fairness middleware, for jobs that did not come through the [`FairnessGate`]
//! (the gate switched off with `FAIRNESS_FETCH_GATE=false`, or an engine without it): if the
//! user's other running jobs already fill the limit, the job is snoozed 30 s + jitter (never
//! consuming an attempt, never discarded).
//!
//! The count is fleet-wide: a job starts only if, when it checks, fewer than `limit` *other* jobs
//! of its user are running. Each check is one statement that sees
//! every fetch committed before it, and each job checks after its own fetch committed; so of two
//! jobs racing for the last slot at least one sees the other and waits. (Both may wait; the jitter
//! then separates them.) Jobs of one user taken by the same fetch commit together and cannot
//! race: they are ranked by id, and a job does not count those after it (`store::other_running`),
//! so with free slots the first of them run instead of all of them snoozing each other. Among
//! middleware checks alone that needs no lock; but a replica with the gate may be admitting a
//! job of the same user while this one counts (a fleet part-way through switching the gate on or
//! off), so the count is taken under the user's lock, the one the gate holds while it admits.
//!
//! [`FairnessGate`]: crate::FairnessGate

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use common::{QueueName, Tier};
use queue::{JobContext, JobOutcome, Middleware, Next};
use sqlx::PgPool;

use crate::config::FairnessConfig;
use crate::decision;
use crate::metrics::FairnessMetrics;
use crate::store;
use crate::tiers::TierCache;

/// A snooze used when the fairness check itself cannot run (database trouble): short, and like
/// every snooze it does not consume an attempt.
const CHECK_FAILED_SNOOZE: Duration = Duration::from_secs(1);

/// The check's `BEGIN`, with its isolation and its bound on waiting for the user's lock.
const CHECK_BEGIN_SQL: &str = "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL lock_timeout = '1s'";

#[derive(Debug)]
pub struct FairnessMiddleware {
    pool: PgPool,
    service: String,
    queues: Vec<String>,
    config: FairnessConfig,
    tiers: Arc<TierCache>,
    metrics: FairnessMetrics,
}

impl FairnessMiddleware {
    /// The middleware of `service`'s `queues` (the service names the users' locks, as for the
    /// [`crate::FairnessGate`]).
    pub fn new(
        pool: PgPool,
        service: impl Into<String>,
        queues: &[QueueName],
        config: FairnessConfig,
        tiers: Arc<TierCache>,
    ) -> Self {
        FairnessMiddleware {
            pool,
            service: service.into(),
            queues: queues.iter().map(ToString::to_string).collect(),
            config,
            tiers,
            metrics: FairnessMetrics::new(),
        }
    }

    /// The user's tier and whether this job must wait.
    async fn check(
        &self,
        ctx: &JobContext,
        user: uuid::Uuid,
    ) -> Result<(Tier, bool), crate::FairnessError> {
        // READ COMMITTED and a bounded wait for the lock: a gated fetch holds it for
        // milliseconds, but a replica frozen mid-fetch holds it until its session ends, and this
        // check holds a connection and a worker slot while it waits. Past the bound the check
        // fails, and the job snoozes briefly like after any failed check.
        let mut tx = queue::begin::begin_with(&self.pool, CHECK_BEGIN_SQL).await?;
        let tier = self
            .tiers
            .tiers(&mut tx, [user])
            .await?
            .get(&user)
            .copied()
            .unwrap_or(Tier::Free);
        // A gated fetch of another replica may be admitting this user's job right now, under the
        // user's lock; counted before it commits, that job would be missed.
        store::lock_user(&mut tx, &self.service, user).await?;
        let others = store::other_running(&mut tx, &self.queues, user, ctx.id()).await?;
        tx.commit().await?;
        Ok((tier, decision::over_limit(others, self.config.limit(tier))))
    }
}

#[async_trait]
impl Middleware for FairnessMiddleware {
    async fn handle(&self, ctx: &JobContext, next: Next<'_>) -> JobOutcome {
        let Some(user) = ctx.user_id() else {
            return next.run(ctx).await; // system job: no limit
        };
        if !self.config.fairness_enabled || ctx.gate_admitted() {
            return next.run(ctx).await;
        }
        match self.check(ctx, user).await {
            Ok((_, false)) => next.run(ctx).await,
            Ok((tier, true)) => {
                self.metrics.snoozed(tier);
                let snooze = decision::snooze_for(
                    self.config.fairness_snooze_duration,
                    self.config.fairness_snooze_jitter,
                    rand::random::<f64>(),
                );
                tracing::debug!(job_id = ctx.id(), %user, %tier, ?snooze, "user at limit; snoozing");
                JobOutcome::Snoozed(snooze)
            }
            Err(e) => {
                tracing::warn!(job_id = ctx.id(), error = %e, "fairness check failed; snoozing briefly");
                JobOutcome::Snoozed(CHECK_FAILED_SNOOZE)
            }
        }
    }
}
