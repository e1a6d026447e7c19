//! Fleet-wide upkeep, done only by the holder of the `queue-maintenance` lease:
//!
//! - promoter: due `scheduled`/`retryable` jobs become `available` (and their queues are notified);
//! - rescuer: `running` jobs whose worker stopped heartbeating are made runnable again (or final if
//!   out of attempts or cancel-requested), and dead worker rows are removed;
//! - cleaner: final jobs past their retention are deleted, in batches.
//!
//! Every [`Engine`](crate::Engine) with `maintenance` on takes part in the election. A process that
//! works no queue (the scheduler) takes part through a [`Maintainer`], with the same tasks, the same
//! lease and the same transition hooks, so whoever wins does exactly the same work.
//!
//! The rescuer only acts once this process has seen the database answer for a whole rescue window:
//! after a database outage every worker's heartbeat is stale, and rescuing at once would re-run
//! every job in flight.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::client::Client;
use crate::config::EngineConfig;
use crate::error::QueueError;
use crate::hooks::{Transition, TransitionHook, begin_ordered_scan, run_hooks, wakes_after_commit};
use crate::insert::INSERT_CHANNEL;
use crate::job::{JobId, JobState};
use crate::leader::{LeaderElector, LeaderHandle, duration_millis};
use crate::notifier::Notifier;
use crate::runtime::DbHealth;
use crate::wake::Waker;

/// The lease name for queue maintenance.
pub const MAINTENANCE_LEASE: &str = "queue-maintenance";
const BATCH: i64 = 10_000;

/// What the maintenance tasks need from the process running them.
pub(crate) struct MaintenanceContext {
    pub(crate) pool: PgPool,
    pub(crate) config: EngineConfig,
    pub(crate) hooks: Arc<[Arc<dyn TransitionHook>]>,
    /// Since when this process has seen the database answer (the rescuer waits for a whole
    /// rescue window of answers).
    pub(crate) db_health: Arc<DbHealth>,
    /// Wakes producers after a rescue made jobs runnable (or freed slots) again.
    pub(crate) waker: Arc<Waker>,
}

/// Queue maintenance for a process that works no queue (the scheduler): it campaigns for the
/// `queue-maintenance` lease like every engine does and, while it holds it, promotes, rescues and
/// cleans on `config`'s intervals, running the [`Client`]'s transition hooks in the rescue
/// transaction exactly as an engine would (quota release, fairness wake-up).
///
/// Of `config` it uses `leader_ttl`, `promote_interval`, `rescue_interval`, `rescue_after`,
/// `clean_interval`, the retentions, and `heartbeat_interval` (how often it checks that the
/// database answers, which the rescuer needs); `rescue_after` must be the workers' value.
pub struct Maintainer {
    ctx: Arc<MaintenanceContext>,
    elector: LeaderElector,
    leader: LeaderHandle,
}

impl std::fmt::Debug for Maintainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Maintainer")
            .field("elector", &self.elector)
            .finish_non_exhaustive()
    }
}

impl Maintainer {
    /// Validates `config` and registers the election's wake-up (resignations of the lease) on
    /// `notifier`, which the caller runs. Returns the maintainer and a handle that tells whether
    /// this process currently holds the maintenance lease.
    pub fn new(
        client: &Client,
        config: EngineConfig,
        candidate_id: impl Into<String>,
        notifier: &mut Notifier,
    ) -> Result<(Maintainer, LeaderHandle), QueueError> {
        config.validate().map_err(QueueError::Config)?;
        let pool = client.pool().clone();
        let (elector, leader) = LeaderElector::new(
            pool.clone(),
            MAINTENANCE_LEASE,
            candidate_id,
            config.leader_ttl,
            notifier,
        );
        let ctx = Arc::new(MaintenanceContext {
            pool,
            config,
            hooks: client.hooks(),
            db_health: Arc::new(DbHealth::default()),
            waker: Arc::clone(client.waker()),
        });
        Ok((
            Maintainer {
                ctx,
                elector,
                leader: leader.clone(),
            },
            leader,
        ))
    }

    /// Campaigns and, while leader, maintains, until `shutdown`; then resigns the lease (at once,
    /// with a notification, so another candidate takes over without waiting for it to expire).
    pub async fn run(self, shutdown: CancellationToken) {
        let Maintainer {
            ctx,
            elector,
            leader,
        } = self;
        let tasks = CancellationToken::new();
        let probe = probe_database(Arc::clone(&ctx), tasks.clone());
        let work = run(ctx, leader, tasks.clone());
        let election = elector.run(shutdown.clone());
        let stop_tasks = async {
            shutdown.cancelled().await;
            tasks.cancel();
        };
        tokio::join!(probe, work, election, stop_tasks);
    }
}

/// Records whether the database answers, every heartbeat interval (an engine learns this from
/// its heartbeats and fetches; a [`Maintainer`] has neither).
async fn probe_database(ctx: Arc<MaintenanceContext>, shutdown: CancellationToken) {
    let mut ticker = tokio::time::interval(ctx.config.heartbeat_interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let ok = sqlx::query("SELECT 1").execute(&ctx.pool).await.is_ok();
        ctx.db_health.record(ok);
    }
}

pub(crate) async fn run(
    ctx: Arc<MaintenanceContext>,
    leader: LeaderHandle,
    shutdown: CancellationToken,
) {
    let promote = periodic(
        "promote",
        ctx.config.promote_interval,
        leader.clone(),
        shutdown.clone(),
        {
            let ctx = Arc::clone(&ctx);
            move || {
                let ctx = Arc::clone(&ctx);
                async move { promote_due(&ctx.pool).await.map(|_| ()) }
            }
        },
    );
    let rescue = periodic(
        "rescue",
        ctx.config.rescue_interval,
        leader.clone(),
        shutdown.clone(),
        {
            let ctx = Arc::clone(&ctx);
            move || {
                let ctx = Arc::clone(&ctx);
                async move {
                    let settled = ctx
                        .db_health
                        .healthy_for()
                        .is_some_and(|d| d >= ctx.config.rescue_after);
                    if settled {
                        rescue_dead_workers(
                            &ctx.pool,
                            &ctx.hooks,
                            &ctx.waker,
                            ctx.config.rescue_after,
                        )
                        .await?;
                    }
                    Ok(())
                }
            }
        },
    );
    let clean = periodic(
        "clean",
        ctx.config.clean_interval,
        leader,
        shutdown,
        move || {
            let ctx = Arc::clone(&ctx);
            async move { clean_finalized(&ctx.pool, &ctx.config).await.map(|_| ()) }
        },
    );
    tokio::join!(promote, rescue, clean);
}

async fn periodic<F, Fut>(
    name: &'static str,
    every: Duration,
    leader: LeaderHandle,
    shutdown: CancellationToken,
    task: F,
) where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<(), QueueError>>,
{
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        if !leader.is_leader() {
            continue;
        }
        if let Err(e) = task().await {
            tracing::warn!(task = name, error = %e, "queue maintenance failed");
        }
    }
}

/// One batch of the promoter: up to `$1` due jobs, oldest first, become `available`, and each
/// queue that got any is notified (`$2`). Returns how many moved.
const PROMOTE_SQL: &str = "WITH due AS ( \
         SELECT id FROM fairlane_job \
         WHERE state IN ('scheduled', 'retryable') AND scheduled_at <= now() \
         ORDER BY scheduled_at LIMIT $1 FOR UPDATE SKIP LOCKED), \
     moved AS ( \
         UPDATE fairlane_job j SET state = 'available' FROM due WHERE j.id = due.id \
         RETURNING j.queue), \
     notified AS ( \
         SELECT pg_notify($2, q.queue) FROM (SELECT DISTINCT queue FROM moved) q) \
     SELECT (SELECT count(*) FROM moved) + 0 * (SELECT count(*) FROM notified)";

/// Makes due scheduled and retryable jobs available; returns how many. Each batch walks the due
/// index in order and stops at its limit (`begin_ordered_scan`), instead of reading and
/// sorting every due job for every batch.
pub async fn promote_due(pool: &PgPool) -> Result<u64, QueueError> {
    let mut total = 0u64;
    loop {
        let mut tx = begin_ordered_scan(pool).await?;
        let (moved,): (i64,) = sqlx::query_as(PROMOTE_SQL)
            .bind(BATCH)
            .bind(INSERT_CHANNEL)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        let moved = u64::try_from(moved).unwrap_or(0);
        total += moved;
        if moved < BATCH as u64 {
            return Ok(total);
        }
    }
}

/// The running jobs [`rescue_dead_workers`] looks at: those fetched at least `$1` ms ago whose
/// worker has not heartbeated for `$1` ms.
///
/// The age of the run matters as much as the worker's: a worker cut off from the database for
/// longer than `$1` is rescued and its row deleted, and when the database comes back its
/// producers may fetch before its heartbeat has registered it again. Such a run is live; within
/// `$1` of its fetch its worker is back (a heartbeat is due every `heartbeat_interval`, which is
/// shorter) or really gone, and only then is it rescued.
macro_rules! dead_worker_condition {
    () => {
        "j.state = 'running' AND cardinality(j.attempted_by) > 0 \
         AND (j.attempted_at IS NULL OR j.attempted_at < now() - $1 * interval '1 millisecond') \
         AND NOT EXISTS ( \
             SELECT 1 FROM fairlane_worker w \
             WHERE w.id = j.attempted_by[cardinality(j.attempted_by)] \
               AND w.heartbeat_at > now() - $1 * interval '1 millisecond')"
    };
}

/// The opening of a statement that ends runs with their attempt used, deciding each job's next
/// state in its locking read: `cancelled` if a cancel was requested, `discarded` after the last
/// attempt, `available` otherwise. The statement goes on with the rows' condition, then
/// `FOR UPDATE OF j …) UPDATE fairlane_job j SET` [`end_used_attempt!`]`, errors = …`.
///
/// The locking read sees the row as locked (a cancel committed after the statement's snapshot
/// included), where a second read of the table would see the snapshot's version and make a
/// cancelled job runnable again.
macro_rules! decide_used_attempt {
    () => {
        "WITH decided AS ( \
             SELECT j.id, CASE \
                 WHEN (j.metadata ->> 'cancel_attempted_at') IS NOT NULL THEN 'cancelled' \
                 WHEN j.attempt >= j.max_attempts THEN 'discarded' \
                 ELSE 'available' END::fairlane_job_state AS next \
             FROM fairlane_job j \
             WHERE "
    };
}
pub(crate) use decide_used_attempt;

/// The state, end and schedule that [`decide_used_attempt!`] decided, for the `SET` clause.
macro_rules! end_used_attempt {
    () => {
        "state = d.next, \
         finalized_at = CASE WHEN d.next = 'available' THEN NULL ELSE now() END, \
         scheduled_at = CASE WHEN d.next = 'available' THEN now() ELSE j.scheduled_at END"
    };
}
pub(crate) use end_used_attempt;

/// Rescues the dead workers' jobs among `$2` (all of them if NULL).
const RESCUE_SQL: &str = concat!(
    decide_used_attempt!(),
    dead_worker_condition!(),
    " AND ($2::bigint[] IS NULL OR j.id = ANY($2)) \
         FOR UPDATE OF j SKIP LOCKED) \
     UPDATE fairlane_job j SET ",
    end_used_attempt!(),
    ", ",
    errors_appended!(),
    "jsonb_build_object( \
             'attempt', j.attempt, 'at', now(), 'kind', 'rescued', \
             'error', 'the worker running it stopped heartbeating; job rescued', \
             'worker', j.attempted_by[cardinality(j.attempted_by)])) \
     FROM decided d WHERE j.id = d.id \
     RETURNING j.id, j.queue, j.kind, j.user_id, j.state"
);

const DELETE_DEAD_WORKERS_SQL: &str =
    "DELETE FROM fairlane_worker WHERE heartbeat_at < now() - $1 * interval '1 millisecond'";

/// Rescues running jobs whose worker has not heartbeated for `stale_after`, and forgets such
/// workers; returns the transitions made.
///
/// All of it goes in one transaction. If the database refuses it for a reason other than a lost
/// connection or conflict (a hook that fails on one job), each job is rescued in a transaction
/// of its own, so one job the hooks refuse does not hold every dead worker's jobs back; it stays
/// `running` and is tried again at the next rescue.
pub async fn rescue_dead_workers(
    pool: &PgPool,
    hooks: &[Arc<dyn TransitionHook>],
    waker: &Arc<Waker>,
    stale_after: Duration,
) -> Result<Vec<Transition>, QueueError> {
    let stale_after = duration_millis(stale_after);
    let (rescued, dead) = match rescue_among(pool, hooks, stale_after, None).await {
        Ok(done) => done,
        Err(e) if e.is_transient() => return Err(e),
        Err(e) => {
            tracing::warn!(error = %e, "rescuing dead workers' jobs together was refused; rescuing them one by one");
            let candidates: Vec<JobId> = sqlx::query_scalar(concat!(
                "SELECT j.id FROM fairlane_job j WHERE ",
                dead_worker_condition!()
            ))
            .bind(stale_after)
            .fetch_all(pool)
            .await?;
            let rescued = move_one_by_one(candidates, "rescue", |id| async move {
                Ok(rescue_among(pool, hooks, stale_after, Some(&[id])).await?.0)
            })
            .await?;
            let dead = sqlx::query(DELETE_DEAD_WORKERS_SQL)
                .bind(stale_after)
                .execute(pool)
                .await?
                .rows_affected();
            (rescued, dead)
        }
    };
    let mut wake = wakes_after_commit(hooks, &rescued);
    wake.extend(rescued.iter().map(|t| t.queue.clone()));
    waker.wake(wake.iter().map(String::as_str));
    // No completer ends these attempts (their worker died, perhaps killed by them): counted
    // here, or `fairlane_jobs_total` would never show a job that kills its workers.
    if !rescued.is_empty() {
        let metrics = crate::metrics::QueueMetrics::new();
        for t in &rescued {
            metrics.outcome(&t.queue, &t.kind, "rescued");
        }
    }
    if !rescued.is_empty() || dead > 0 {
        tracing::warn!(
            jobs = rescued.len(),
            workers = dead,
            "rescued jobs of workers that stopped heartbeating"
        );
    }
    Ok(rescued)
}

/// Moves each of `candidates` in a transaction of its own (`move_one`), once the database has
/// refused to move them together: a job it refuses again (a hook that fails on it) stays
/// `running`, logged, and is tried again at the next pass of `what`; the others go on. A lost
/// connection or conflict ends the pass with its error.
pub(crate) async fn move_one_by_one<F, Fut>(
    candidates: Vec<JobId>,
    what: &'static str,
    mut move_one: F,
) -> Result<Vec<Transition>, QueueError>
where
    F: FnMut(JobId) -> Fut,
    Fut: Future<Output = Result<Vec<Transition>, QueueError>>,
{
    let mut moved = Vec::new();
    for id in candidates {
        match move_one(id).await {
            Ok(transitions) => moved.extend(transitions),
            Err(e) if e.is_transient() => return Err(e),
            Err(e) => tracing::error!(job_id = id, error = %e, pass = what,
                "the database refuses to move this job; it stays running and is tried again at the next pass"),
        }
    }
    Ok(moved)
}

/// One transaction of [`rescue_dead_workers`]: rescues the dead workers' jobs among `only` (all
/// if `None`) and runs their hooks; when rescuing all, also deletes the dead workers. Returns the
/// transitions and how many workers were deleted.
async fn rescue_among(
    pool: &PgPool,
    hooks: &[Arc<dyn TransitionHook>],
    stale_after_ms: f64,
    only: Option<&[JobId]>,
) -> Result<(Vec<Transition>, u64), QueueError> {
    let mut tx = crate::begin::begin(pool).await?;
    let rescued: Vec<Transition> = sqlx::query_as(RESCUE_SQL)
        .bind(stale_after_ms)
        .bind(only)
        .fetch_all(&mut *tx)
        .await?;
    run_hooks(hooks, &mut tx, &rescued).await?;
    let dead = if only.is_none() {
        sqlx::query(DELETE_DEAD_WORKERS_SQL)
            .bind(stale_after_ms)
            .execute(&mut *tx)
            .await?
            .rows_affected()
    } else {
        0
    };
    tx.commit().await?;
    Ok((rescued, dead))
}

/// Deletes up to `$3` jobs in final state `$1` finalized more than `$2` milliseconds ago. Keyed
/// by state, it reads `fairlane_job_finalized_state` from that state's oldest row and only as far
/// as it deletes.
const CLEAN_SQL: &str = "DELETE FROM fairlane_job WHERE id IN ( \
     SELECT id FROM fairlane_job \
     WHERE state = $1 AND finalized_at IS NOT NULL \
       AND finalized_at < now() - $2 * interval '1 millisecond' \
     LIMIT $3)";

/// Deletes final jobs older than their retention; returns how many.
pub async fn clean_finalized(pool: &PgPool, config: &EngineConfig) -> Result<u64, QueueError> {
    let mut total = 0u64;
    for (state, retention) in [
        (JobState::Completed, config.retention_completed),
        (JobState::Cancelled, config.retention_cancelled),
        (JobState::Discarded, config.retention_discarded),
    ] {
        loop {
            let deleted = sqlx::query(CLEAN_SQL)
                .bind(state)
                .bind(duration_millis(retention))
                .bind(BATCH)
                .execute(pool)
                .await?
                .rows_affected();
            total += deleted;
            if deleted < BATCH as u64 {
                break;
            }
        }
    }
    if total > 0 {
        tracing::info!(jobs = total, "cleaned finalized jobs past retention");
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan_nodes::{analyzed_db, assert_walks_index};
    use serde_json::Value;

    /// A week of cancelled jobs within their retention and a few past it, among a day of
    /// completed ones: the cancelled state's pass reads only the rows it deletes.
    #[tokio::test]
    async fn a_clean_pass_reads_only_what_it_deletes() {
        let db = analyzed_db(
            "INSERT INTO fairlane_job (queue, kind, args, state, finalized_at) \
             SELECT 'q', 'noop', '{}', \
                    CASE WHEN g % 2 = 0 THEN 'cancelled' ELSE 'completed' END::fairlane_job_state, \
                    CASE WHEN g <= 100 THEN now() - interval '8 days' \
                         WHEN g % 2 = 0 THEN now() - random() * interval '6 days' \
                         ELSE now() - random() * interval '20 hours' END \
             FROM generate_series(1, 30000) g",
        )
        .await;
        let mut tx = begin_ordered_scan(&db.pool).await.unwrap();
        let explained: Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "EXPLAIN (ANALYZE, FORMAT JSON) {CLEAN_SQL}"
        )))
        .bind(JobState::Cancelled)
        .bind(duration_millis(Duration::from_secs(7 * 24 * 3600)))
        .bind(BATCH)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        tx.rollback().await.unwrap();
        // The 50 cancelled rows past retention, and nothing else.
        assert_walks_index(&explained, "fairlane_job_finalized_state", 50);
    }

    /// With statistics that have seen the table (24,000 due jobs among 36,000, stored in no
    /// particular `scheduled_at` order, as retries and snoozes leave them), a promoter batch
    /// walks the due index in `scheduled_at` order and stops at its limit, instead of reading
    /// every due job and sorting them for each batch.
    #[tokio::test]
    async fn a_promoter_batch_reads_only_what_it_moves() {
        let db = analyzed_db(
            "INSERT INTO fairlane_job (queue, kind, args, state, scheduled_at) \
             SELECT 'q', 'noop', '{}', \
                    CASE WHEN g % 3 = 0 THEN 'available' ELSE 'scheduled' END::fairlane_job_state, \
                    now() - random() * interval '1 hour' \
             FROM generate_series(1, 36000) g",
        )
        .await;

        let mut tx = begin_ordered_scan(&db.pool).await.unwrap();
        let explained: Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "EXPLAIN (ANALYZE, FORMAT JSON) {PROMOTE_SQL}"
        )))
        .bind(BATCH)
        .bind(INSERT_CHANNEL)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        tx.rollback().await.unwrap();

        assert_walks_index(&explained, "fairlane_job_due", BATCH.unsigned_abs());
    }
}
