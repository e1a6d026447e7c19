//! One producer per queue: keeps the queue's worker slots busy. It fetches as many jobs as there
//! are free slots (`FOR UPDATE SKIP LOCKED`, one statement, or a gated transaction when a
//! [`FetchGate`](crate::FetchGate) is installed), wakes on NOTIFY for its queue, on a freed slot
//! while a backlog exists, and on a poll timer as the fallback.

use std::sync::Arc;
use std::time::Duration;

use common::QueueName;
use opentelemetry::KeyValue;
use sqlx::PgConnection;
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::QueueError;
use crate::executor::{self, Dispatch};
use crate::job::{JobId, JobRow};
use crate::runtime::Runtime;

/// A queue this process works, with its slot count.
pub(crate) struct QueueWorker {
    pub(crate) name: QueueName,
    pub(crate) slots: Arc<Semaphore>,
    /// Jobs may have become runnable (insert, promotion, another worker's hand-back).
    pub(crate) runnable: Arc<Notify>,
    /// An executor finished and gave its slot back.
    pub(crate) slot_freed: Arc<Notify>,
    pub(crate) max_workers: usize,
}

const FETCH_SQL: &str = "
WITH picked AS (
    SELECT id FROM fairlane_job
    WHERE state = 'available' AND queue = $1
    ORDER BY priority, scheduled_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE fairlane_job j
SET state = 'running', attempt = j.attempt + 1, attempted_at = now(),
    attempted_by = array_append(j.attempted_by, $3)
FROM picked WHERE j.id = picked.id
RETURNING j.*";

const START_SQL: &str = "
UPDATE fairlane_job j
SET state = 'running', attempt = j.attempt + 1, attempted_at = now(),
    attempted_by = array_append(j.attempted_by, $2)
WHERE j.id = ANY($1) AND j.state = 'available'
RETURNING j.*";

impl QueueWorker {
    pub(crate) async fn run(
        self: Arc<Self>,
        rt: Arc<Runtime>,
        tracker: TaskTracker,
        shutdown: CancellationToken,
    ) {
        let label = KeyValue::new("queue", self.name.to_string());
        rt.metrics.record_max(&label, self.max_workers);
        let mut backlog = true; // fetch once at start
        let mut runnable = false;
        let mut last_fetch: Option<Instant> = None;
        let mut next_poll = Instant::now() + rt.config.poll_interval;
        let mut error_backoff = Duration::from_millis(50);
        loop {
            if shutdown.is_cancelled() {
                return;
            }
            let free = self.slots.available_permits();
            let poll_due = Instant::now() >= next_poll;
            if free > 0 && (backlog || runnable || poll_due) {
                if let Some(last) = last_fetch {
                    let since = last.elapsed();
                    if backlog && !runnable && since < rt.config.fetch_cooldown {
                        tokio::select! {
                            () = shutdown.cancelled() => return,
                            () = tokio::time::sleep(rt.config.fetch_cooldown - since) => {}
                        }
                    }
                }
                let free = self.slots.available_permits();
                let want = free.min(rt.config.fetch_limit);
                runnable = false;
                last_fetch = Some(Instant::now());
                next_poll = Instant::now() + rt.config.poll_interval;
                match self.fetch(&rt, want).await {
                    Ok((jobs, gated)) => {
                        rt.db_health.record(true);
                        error_backoff = Duration::from_millis(50);
                        backlog = jobs.len() >= want;
                        for job in jobs {
                            let Ok(permit) = Arc::clone(&self.slots).try_acquire_owned() else {
                                // Cannot happen: only this task takes permits. Hand the job back
                                // through the heartbeat's orphan reconciliation rather than run it
                                // over the limit.
                                tracing::error!(job_id = job.id, "no free slot for a fetched job");
                                continue;
                            };
                            executor::spawn(
                                &rt,
                                &tracker,
                                Dispatch {
                                    job,
                                    gate_admitted: gated,
                                    permit,
                                    slot_freed: Arc::clone(&self.slot_freed),
                                    queue_label: label.clone(),
                                },
                            );
                        }
                    }
                    Err(e) => {
                        if e.is_connection_error() {
                            rt.db_health.record(false);
                        }
                        tracing::warn!(queue = %self.name, error = %e, "fetch failed; retrying");
                        tokio::select! {
                            () = shutdown.cancelled() => return,
                            () = tokio::time::sleep(error_backoff) => {}
                        }
                        error_backoff = (error_backoff * 2).min(Duration::from_secs(5));
                        backlog = true;
                    }
                }
                continue;
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = self.runnable.notified() => runnable = true,
                () = self.slot_freed.notified() => {}
                () = tokio::time::sleep_until(next_poll) => {}
            }
        }
    }

    async fn fetch(&self, rt: &Runtime, want: usize) -> Result<(Vec<JobRow>, bool), QueueError> {
        let limit = i64::try_from(want).unwrap_or(i64::MAX);
        match &rt.gate {
            None => {
                let jobs = sqlx::query_as::<_, JobRow>(FETCH_SQL)
                    .bind(self.name.as_str())
                    .bind(limit)
                    .bind(&*rt.worker_id)
                    .fetch_all(&rt.pool)
                    .await?;
                Ok((jobs, false))
            }
            Some(gate) => {
                let mut tx = rt.pool.begin().await?;
                let ids = gate
                    .select(&mut tx, &self.name, want)
                    .await
                    .map_err(QueueError::Gate)?;
                let jobs = if ids.is_empty() {
                    Vec::new()
                } else {
                    start(&mut tx, &ids, &rt.worker_id).await?
                };
                tx.commit().await?;
                Ok((jobs, true))
            }
        }
    }
}

async fn start(
    conn: &mut PgConnection,
    ids: &[JobId],
    worker_id: &str,
) -> Result<Vec<JobRow>, QueueError> {
    let mut jobs = sqlx::query_as::<_, JobRow>(START_SQL)
        .bind(ids)
        .bind(worker_id)
        .fetch_all(&mut *conn)
        .await?;
    // Keep the gate's order (it decides who goes first).
    jobs.sort_by_key(|j| ids.iter().position(|id| *id == j.id));
    Ok(jobs)
}
