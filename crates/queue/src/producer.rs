//! One producer per queue: keeps the queue's worker slots busy. It fetches as many jobs as there
//! are free slots (`FOR UPDATE SKIP LOCKED`, one statement, or a gated transaction when a
//! [`FetchGate`](crate::FetchGate) is installed), wakes on NOTIFY for its queue, on a freed slot
//! while a backlog exists, and on a poll timer as the fallback.

use std::sync::Arc;
use std::time::Duration;

use common::QueueName;
use opentelemetry::KeyValue;
use sqlx::PgConnection;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::QueueError;
use crate::executor::{self, Dispatch};
use crate::job::{JobId, JobRow};
use crate::runtime::Runtime;

/// What a fetch task hands back: the jobs (or the error), the slots it reserved, how many it
/// asked for, and how long it took.
type FetchResult = (
    Result<(Vec<JobRow>, bool), QueueError>,
    OwnedSemaphorePermit,
    usize,
    Duration,
);

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

/// `attempted_by` keeps the newest 100 workers (both statements below slice to them, as River
/// does): a job that snoozes for as long as fairness holds it back is fetched again and again,
/// and its row would otherwise grow with every fetch.
///
/// A run is dated (`attempted_at`) when the statement that starts it executes, once for all its
/// rows (an uncorrelated subquery is evaluated once per execution), not when the fetch's
/// transaction began: a fetch held up by a lock on the table (an index built by a migration)
/// would otherwise date its runs from before the wait, and a repair running just as it got
/// through would take them for runs whose fetch reply was lost and hand them back while this
/// worker starts them. The rows of one fetch still share their date (fairness tells a fetch's
/// own jobs apart by it: `fairness::store::other_running`).
///
/// Lock runnable rows in fetch order, then update exactly those row versions by their physical
/// address (`ctid`): the rows are locked by this statement, so their addresses cannot change, and
/// this spares a second index descent per row. A row updated by someone else between the
/// statement's snapshot and the lock is simply not fetched this time.
const FETCH_SQL: &str = "
UPDATE fairlane_job j
SET state = 'running', attempt = j.attempt + 1, attempted_at = (SELECT clock_timestamp()),
    attempted_by = (array_append(j.attempted_by, $3))[greatest(cardinality(j.attempted_by) - 98, 1):]
WHERE j.ctid = ANY(ARRAY(
    SELECT ctid FROM fairlane_job
    WHERE state = 'available' AND queue = $1
    ORDER BY priority, scheduled_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED))
RETURNING j.*";

/// The gate has locked these `available` rows in this transaction, so no state guard is needed
/// (and one would let the planner pick the fetch index over the primary key).
const START_SQL: &str = "
UPDATE fairlane_job j
SET state = 'running', attempt = j.attempt + 1, attempted_at = (SELECT clock_timestamp()),
    attempted_by = (array_append(j.attempted_by, $2))[greatest(cardinality(j.attempted_by) - 98, 1):]
WHERE j.id = ANY($1)
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
        let mut fetches: JoinSet<FetchResult> = JoinSet::new();
        let mut backlog = true; // fetch once at start
        let mut runnable = false;
        let mut last_fetch: Option<Instant> = None;
        let mut next_poll = Instant::now() + rt.config.poll_interval;
        let mut error_backoff = Duration::from_millis(50);
        let mut retry_at: Option<Instant> = None;
        loop {
            if shutdown.is_cancelled() {
                break;
            }
            let free = self.slots.available_permits();
            let now = Instant::now();
            let poll_due = now >= next_poll;
            let backing_off = retry_at.is_some_and(|t| now < t);
            let wanted = free > 0 && !backing_off && (backlog || runnable || poll_due);
            // Up to `fetch_concurrency` fetches run at once. With a backlog, a fetch waits (at
            // most the cooldown) for a good batch of free slots: one fetch of many jobs costs
            // little more than a fetch of one.
            let batch_ready = !backlog
                || runnable
                || free >= self.refill_threshold(&rt)
                || last_fetch.is_none_or(|l| l.elapsed() >= rt.config.fetch_cooldown);
            if wanted && batch_ready && fetches.len() < rt.config.fetch_concurrency {
                let want = free.min(rt.config.fetch_limit);
                if let Ok(permits) = Arc::clone(&self.slots)
                    .try_acquire_many_owned(u32::try_from(want).unwrap_or(u32::MAX))
                {
                    runnable = false;
                    last_fetch = Some(now);
                    next_poll = now + rt.config.poll_interval;
                    let this = Arc::clone(&self);
                    let rt = Arc::clone(&rt);
                    fetches.spawn(async move {
                        let started = Instant::now();
                        let result = this.fetch(&rt, want).await;
                        (result, permits, want, started.elapsed())
                    });
                    continue;
                }
            }
            let cooldown_left = last_fetch
                .map(|l| rt.config.fetch_cooldown.saturating_sub(l.elapsed()))
                .unwrap_or_default();
            let wake_at = match retry_at {
                Some(t) if t > now => t,
                _ if wanted && !batch_ready => now + cooldown_left,
                _ if next_poll > now => next_poll,
                // A poll already due is held back by busy slots or by as many fetches as may
                // run: a freed slot or a finished fetch wakes the loop, and it polls then.
                // Sleeping until the past instant would spin; the timer is only a backstop.
                _ => now + rt.config.poll_interval,
            };
            tokio::select! {
                () = shutdown.cancelled() => break,
                Some(done) = fetches.join_next(), if !fetches.is_empty() => {
                    let Ok((result, permits, want, took)) = done else { continue };
                    match result {
                        Ok((jobs, gated)) => {
                            tracing::trace!(queue = %self.name, want, fetched = jobs.len(), ms = took.as_secs_f64() * 1000.0, "fetched");
                            rt.db_health.record(true);
                            error_backoff = Duration::from_millis(50);
                            retry_at = None;
                            // A short fetch is normal while others fetch too (SKIP LOCKED); only
                            // an empty one means the queue has nothing runnable for us.
                            backlog = !jobs.is_empty();
                            self.dispatch(&rt, &tracker, &label, jobs, gated, permits);
                        }
                        Err(e) => {
                            drop(permits);
                            if e.is_connection_error() {
                                rt.db_health.record(false);
                            }
                            tracing::warn!(queue = %self.name, error = %e, "fetch failed; retrying");
                            retry_at = Some(Instant::now() + error_backoff);
                            error_backoff = (error_backoff * 2).min(Duration::from_secs(5));
                            backlog = true;
                        }
                    }
                }
                () = self.runnable.notified() => runnable = true,
                () = self.slot_freed.notified() => {}
                () = tokio::time::sleep_until(wake_at) => {}
            }
        }
        // Jobs fetched by fetches still in flight are already `running`: run them (the drain
        // handles them like any other running job) rather than leave them to the rescuer.
        while let Some(done) = fetches.join_next().await {
            if let Ok((Ok((jobs, gated)), permits, _, _)) = done {
                self.dispatch(&rt, &tracker, &label, jobs, gated, permits);
            }
        }
    }

    /// Starts an executor per fetched job, each holding one of the fetch's reserved slots; the
    /// slots the fetch did not fill go back to the pool.
    fn dispatch(
        &self,
        rt: &Arc<Runtime>,
        tracker: &TaskTracker,
        label: &KeyValue,
        jobs: Vec<JobRow>,
        gated: bool,
        mut permits: OwnedSemaphorePermit,
    ) {
        for job in jobs {
            let Some(permit) = permits.split(1) else {
                // Cannot happen: a fetch returns at most the slots it reserved.
                tracing::error!(
                    job_id = job.id,
                    "fetch returned more jobs than it reserved slots"
                );
                continue;
            };
            executor::spawn(
                rt,
                tracker,
                Dispatch {
                    job,
                    gate_admitted: gated,
                    permit,
                    slot_freed: Arc::clone(&self.slot_freed),
                    queue_label: label.clone(),
                },
            );
        }
        drop(permits);
        self.slot_freed.notify_one();
    }

    /// Free slots worth a fetch while a backlog exists: half a full fetch.
    fn refill_threshold(&self, rt: &Runtime) -> usize {
        (self.max_workers.min(rt.config.fetch_limit) / 2).max(1)
    }

    /// One fetch, within the database timeout: past it, or on any error, the connection is
    /// closed rather than pooled ([`crate::begin::within`]). A fetch given up after its `COMMIT`
    /// was sent may have committed: its jobs are `running` here unreceived, and the heartbeat's
    /// repair hands them back after the orphan grace.
    async fn fetch(&self, rt: &Runtime, want: usize) -> Result<(Vec<JobRow>, bool), QueueError> {
        crate::begin::within(&rt.pool, rt.config.database_timeout, async |c| {
            self.fetch_on(rt, c, want).await
        })
        .await
    }

    async fn fetch_on(
        &self,
        rt: &Runtime,
        connection: &mut PgConnection,
        want: usize,
    ) -> Result<(Vec<JobRow>, bool), QueueError> {
        let limit = i64::try_from(want).unwrap_or(i64::MAX);
        let begin = sqlx::AssertSqlSafe(rt.fetch_begin.clone());
        let mut tx = sqlx::Connection::begin_with(connection, begin).await?;
        match &rt.gate {
            None => {
                let jobs = sqlx::query_as::<_, JobRow>(FETCH_SQL)
                    .bind(self.name.as_str())
                    .bind(limit)
                    .bind(&*rt.worker_id)
                    .fetch_all(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok((jobs, false))
            }
            Some(gate) => {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan_nodes::{analyzed_db, assert_walks_index};
    use serde_json::Value;

    /// With statistics that have seen the table (a backlog of 6,000 runnable jobs, 3,000 of them
    /// in the fetched lane), a fetch still walks the fetch index in order and stops at its limit,
    /// instead of reading the lane's whole backlog and sorting it.
    #[tokio::test]
    async fn a_fetch_from_an_analyzed_backlog_reads_only_what_it_takes() {
        let db = analyzed_db(
            "INSERT INTO fairlane_job (queue, kind, args) \
             SELECT CASE WHEN g % 2 = 0 THEN 'backlog' ELSE 'other' END, 'noop', '{}' \
             FROM generate_series(1, 6000) g",
        )
        .await;

        let mut tx = crate::hooks::begin_fetch(&db.pool).await.unwrap();
        let explained: Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "EXPLAIN (ANALYZE, FORMAT JSON) {FETCH_SQL}"
        )))
        .bind("backlog")
        .bind(100_i64)
        .bind("test-worker")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        tx.rollback().await.unwrap();

        assert_walks_index(&explained, "fairlane_job_fetch", 100);
    }
}
