//! This process's proof of life (`fairlane_worker.heartbeat_at`) and two repairs that piggyback on
//! it: handing back `running` jobs attributed to this process that it never received (a fetch
//! whose reply was lost with its connection), and catching cancel requests whose NOTIFY was missed.

use std::sync::Arc;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::context::CancelReason;
use crate::error::QueueError;
use crate::hooks::{Transition, run_hooks, wakes_after_commit};
use crate::job::JobId;
use crate::leader::duration_millis;
use crate::runtime::Runtime;

pub(crate) async fn register(
    pool: &PgPool,
    worker_id: &str,
    queues: &[String],
) -> Result<(), QueueError> {
    let host = hostname::get()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unknown".into());
    sqlx::query(
        "INSERT INTO fairlane_worker (id, hostname, pid, queues) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), queues = EXCLUDED.queues",
    )
    .bind(worker_id)
    .bind(host)
    .bind(i32::try_from(std::process::id()).unwrap_or(i32::MAX))
    .bind(queues)
    .execute(pool)
    .await?;
    Ok(())
}

pub(crate) async fn deregister(pool: &PgPool, worker_id: &str) -> Result<(), QueueError> {
    sqlx::query("DELETE FROM fairlane_worker WHERE id = $1")
        .bind(worker_id)
        .execute(pool)
        .await?;
    Ok(())
}

pub(crate) async fn run(rt: Arc<Runtime>, queues: Vec<String>, shutdown: CancellationToken) {
    let mut ticker = tokio::time::interval(rt.config.heartbeat_interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let result = beat(&rt, &queues).await;
        rt.db_health.record(result.is_ok());
        if let Err(e) = result {
            tracing::warn!(error = %e, "heartbeat failed");
        }
    }
}

async fn beat(rt: &Runtime, queues: &[String]) -> Result<(), QueueError> {
    register(&rt.pool, &rt.worker_id, queues).await?;
    hand_back_orphans(rt).await?;
    let cancel_requested: Vec<(JobId,)> = sqlx::query_as(
        "SELECT id FROM fairlane_job WHERE state = 'running' AND cardinality(attempted_by) > 0 \
           AND attempted_by[cardinality(attempted_by)] = $1 \
           AND (metadata ->> 'cancel_attempted_at') IS NOT NULL",
    )
    .bind(&*rt.worker_id)
    .fetch_all(&rt.pool)
    .await?;
    for (id,) in cancel_requested {
        rt.inflight.cancel(id, CancelReason::Requested);
    }
    Ok(())
}

/// Hands back this process's `running` jobs that it never received, or cancels those whose
/// cancel was requested meanwhile (no handler has started them, so the cancel holds).
async fn hand_back_orphans(rt: &Runtime) -> Result<(), QueueError> {
    let mut tx = rt.pool.begin().await?;
    // Read after the connection is in hand: waiting for one can take seconds under load, and a
    // job fetched and started during that wait must count as received.
    let known = rt.inflight.ids();
    let orphans: Vec<Transition> = sqlx::query_as(
        "UPDATE fairlane_job j SET \
             state = CASE WHEN (j.metadata ->> 'cancel_attempted_at') IS NOT NULL THEN 'cancelled' \
                          ELSE 'available' END::fairlane_job_state, \
             finalized_at = CASE WHEN (j.metadata ->> 'cancel_attempted_at') IS NOT NULL THEN now() END, \
             attempt = greatest(j.attempt - 1, 0), scheduled_at = now(), \
             errors = j.errors || jsonb_build_array(jsonb_build_object( \
                 'attempt', j.attempt, 'at', now(), 'kind', 'interrupted', \
                 'error', 'fetched by worker ' || $1 || ' but never started (the fetch reply was lost)')) \
         WHERE j.state = 'running' AND cardinality(j.attempted_by) > 0 \
           AND j.attempted_by[cardinality(j.attempted_by)] = $1 \
           AND NOT (j.id = ANY($2)) \
           AND j.attempted_at < now() - $3 * interval '1 millisecond' \
         RETURNING j.id, j.queue, j.kind, j.user_id, j.state",
    )
    .bind(&*rt.worker_id)
    .bind(&known)
    .bind(duration_millis(rt.config.orphan_grace))
    .fetch_all(&mut *tx)
    .await?;
    if orphans.is_empty() {
        return Ok(());
    }
    run_hooks(&rt.hooks, &mut tx, &orphans).await?;
    tx.commit().await?;
    let mut wake = wakes_after_commit(&rt.hooks, &orphans);
    wake.extend(orphans.iter().map(|t| t.queue.clone()));
    rt.waker.wake(wake.iter().map(String::as_str));
    tracing::warn!(
        jobs = orphans.len(),
        "handed back jobs whose fetch reply was lost"
    );
    Ok(())
}
