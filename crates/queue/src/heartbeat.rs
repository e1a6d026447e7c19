//! This process's proof of life (`fairlane_worker.heartbeat_at`), and the repairs that run at the
//! same interval in a task of their own: handing back `running` jobs attributed to this process
//! that it never received (a fetch whose reply was lost with its connection), handing back runs
//! whose end the database refused, catching cancel requests whose NOTIFY was missed, and stopping
//! runs whose rows were taken from this worker.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::config::EngineConfig;
use crate::context::CancelReason;
use crate::error::QueueError;
use crate::hooks::{Transition, run_hooks, wakes_after_commit};
use crate::job::JobId;
use crate::leader::duration_millis;
use crate::maintenance::{decide_used_attempt, end_used_attempt, move_one_by_one};
use crate::runtime::{RunStart, Runtime};

pub(crate) async fn register(
    conn: impl sqlx::PgExecutor<'_>,
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
    .execute(conn)
    .await?;
    Ok(())
}

/// How long one heartbeat may wait for its answer: a heartbeat interval (at least a second), and
/// at most half of what `rescue_after` leaves after an interval. A beat that stalls starts an
/// interval after the last good one and gives up at this deadline; the retry on a fresh
/// connection then still lands before the rescuer looks.
pub(crate) fn heartbeat_deadline(config: &EngineConfig) -> Duration {
    config.heartbeat_interval.max(Duration::from_secs(1)).min(
        config
            .rescue_after
            .saturating_sub(config.heartbeat_interval)
            / 2,
    )
}

/// The heartbeat's own connection, outside any pool: made when needed, and dropped after any
/// failure or a heartbeat that got no answer within its deadline. One that stalls without an
/// error (a black-holed network path) would otherwise hold every later heartbeat until the
/// kernel gives up on it, some 15 minutes, while the rescuer takes this live worker's runs after
/// `rescue_after`. (A pool would not do: returning a connection pings it, and a ping on a
/// stalled connection holds the pool's only slot past any deadline of ours.)
pub(crate) struct HeartbeatConnection {
    options: PgConnectOptions,
    conn: Option<PgConnection>,
    deadline: Duration,
}

impl HeartbeatConnection {
    pub(crate) fn new(options: PgConnectOptions, deadline: Duration) -> Self {
        HeartbeatConnection {
            options,
            conn: None,
            deadline,
        }
    }

    /// Says goodbye to the server (within a second: the engine's shutdown waits at most
    /// `STALLED_STATEMENT_BOUND` for its background tasks), so a shutdown leaves no "unexpected
    /// EOF" in the server's log.
    pub(crate) async fn close(mut self) {
        if let Some(conn) = self.conn.take() {
            let _ = tokio::time::timeout(Duration::from_secs(1), conn.close()).await;
        }
    }

    /// One heartbeat, connecting first if need be, all within the deadline. A kept connection
    /// that fails (the server restarted, a failover, an idle cut) is replaced and the heartbeat
    /// tried once more on the new one, as a pool's ping before use would have.
    pub(crate) async fn beat(
        &mut self,
        worker_id: &str,
        queues: &[String],
    ) -> Result<(), QueueError> {
        let attempt = async {
            if let Some(kept) = &mut self.conn {
                match register(kept, worker_id, queues).await {
                    Ok(()) => return Ok(()),
                    Err(e) if !e.is_connection_error() => return Err(e),
                    Err(_) => self.conn = None,
                }
            }
            let fresh = self
                .conn
                .insert(PgConnection::connect_with(&self.options).await?);
            register(fresh, worker_id, queues).await
        };
        let outcome = tokio::time::timeout(self.deadline, attempt).await;
        let result = outcome.unwrap_or_else(|_| {
            Err(QueueError::Database(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the heartbeat got no answer within {:?}", self.deadline),
            ))))
        });
        if result.is_err() {
            // Closed by dropping: a graceful close would wait on the same silent path.
            self.conn = None;
        }
        result
    }
}

pub(crate) async fn deregister(pool: &PgPool, worker_id: &str) -> Result<(), QueueError> {
    sqlx::query("DELETE FROM fairlane_worker WHERE id = $1")
        .bind(worker_id)
        .execute(pool)
        .await?;
    Ok(())
}

/// Heartbeats every `heartbeat_interval` until `shutdown`, on a connection of its own
/// ([`HeartbeatConnection`]).
///
/// The heartbeat is apart from the repairs ([`run_repairs`]), in a task and on a connection of its
/// own. The repairs update job rows and wait for their locks, and so does nearly everything else
/// that holds the engine's connections (fetches, completions, maintenance): a lock on the job
/// table (an index built, a `VACUUM FULL`) held longer than `rescue_after` would otherwise hold
/// the heartbeat back too, and the rescuer would take this live worker's runs once the lock went.
/// And a hook that panics in a repair ends the repairs' task, not the heartbeat.
pub(crate) async fn run_heartbeats(
    rt: Arc<Runtime>,
    options: PgConnectOptions,
    queues: Vec<String>,
    shutdown: CancellationToken,
) {
    let mut connection = HeartbeatConnection::new(options, heartbeat_deadline(&rt.config));
    let mut ticks = Ticks::new(&rt, &shutdown);
    while ticks.next().await {
        let result = connection.beat(&rt.worker_id, &queues).await;
        rt.db_health.record(result.is_ok());
        if let Err(e) = result {
            tracing::warn!(error = %e, "heartbeat failed");
        }
    }
    connection.close().await;
}

/// Repairs this worker's runs every `heartbeat_interval` until `shutdown`.
pub(crate) async fn run_repairs(rt: Arc<Runtime>, shutdown: CancellationToken) {
    let mut ticks = Ticks::new(&rt, &shutdown);
    while ticks.next().await {
        if let Err(e) = repair(&rt).await {
            tracing::warn!(error = %e, "repairing this worker's runs failed");
        }
    }
}

/// The instants a heartbeat or repair step is due: every `heartbeat_interval` (a late step
/// delays the next) until `shutdown`. The caller runs each step between calls to
/// [`Ticks::next`], so a step under way is finished before shutdown ends the loop.
struct Ticks<'a> {
    ticker: tokio::time::Interval,
    shutdown: &'a CancellationToken,
}

impl<'a> Ticks<'a> {
    fn new(rt: &Runtime, shutdown: &'a CancellationToken) -> Self {
        let mut ticker = tokio::time::interval(rt.config.heartbeat_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Ticks { ticker, shutdown }
    }

    /// Waits for the next step: `true` when it is due, `false` once shutdown was asked for.
    async fn next(&mut self) -> bool {
        tokio::select! {
            () = self.shutdown.cancelled() => false,
            _ = self.ticker.tick() => true,
        }
    }
}

/// The condition that job `j` is running, fetched last by the worker whose id is `$worker` (the
/// SQL of a parameter): one of this worker's runs, as every repair looks for them.
macro_rules! running_for_worker {
    ($worker:literal) => {
        concat!(
            "j.state = 'running' AND cardinality(j.attempted_by) > 0 \
             AND j.attempted_by[cardinality(j.attempted_by)] = ",
            $worker
        )
    };
}

/// Hands back this worker's unsaved runs and the jobs it never received, and passes on the
/// cancels requested for its runs.
async fn repair(rt: &Runtime) -> Result<(), QueueError> {
    hand_back_unsaved(rt).await?;
    hand_back_orphans(rt).await?;
    let cancel_requested: Vec<(JobId,)> = sqlx::query_as(concat!(
        "SELECT j.id FROM fairlane_job j WHERE ",
        running_for_worker!("$1"),
        " AND (j.metadata ->> 'cancel_attempted_at') IS NOT NULL"
    ))
    .bind(&*rt.worker_id)
    .fetch_all(&rt.pool)
    .await?;
    for (id,) in cancel_requested {
        rt.inflight.cancel(id, CancelReason::Requested);
    }
    stop_taken_runs(rt).await
}

/// Stops the runs of this process whose row is no longer running as that run of this worker:
/// rescued while this worker's heartbeat could not reach the database (the worker looked dead),
/// and maybe running elsewhere now. Their ends would be refused anyway; stopping them ends the
/// double run, and frees the user's slot this worker still used, at the first repair after the
/// database is back. A run whose end is committed and not yet forgotten here is told too, which
/// changes nothing.
async fn stop_taken_runs(rt: &Runtime) -> Result<(), QueueError> {
    let runs = rt.inflight.runs();
    if runs.is_empty() {
        return Ok(());
    }
    let (ids, starts): (Vec<JobId>, Vec<RunStart>) = runs.into_iter().unzip();
    let taken: Vec<(JobId, RunStart)> = sqlx::query_as(concat!(
        "SELECT r.id, r.started FROM unnest($1::bigint[], $2::timestamptz[]) AS r(id, started) \
             WHERE NOT EXISTS ( \
               SELECT 1 FROM fairlane_job j \
               WHERE j.id = r.id AND j.attempted_at IS NOT DISTINCT FROM r.started AND ",
        running_for_worker!("$3"),
        ")"
    ))
    .bind(&ids)
    .bind(&starts)
    .bind(&*rt.worker_id)
    .fetch_all(&rt.pool)
    .await?;
    for (id, started) in taken {
        if rt.inflight.cancel_run(id, started, CancelReason::Taken) {
            tracing::warn!(
                job_id = id,
                "this worker's run of the job was taken from it (rescued while its heartbeat \
                 could not reach the database); stopping it"
            );
        }
    }
    Ok(())
}

/// The rows [`hand_back_orphans`] looks at: this worker's `running` jobs that it does not hold
/// (`$2`), fetched longer than the orphan grace ago (`$3` ms).
macro_rules! orphan_condition {
    () => {
        concat!(
            running_for_worker!("$1"),
            " AND NOT (j.id = ANY($2)) \
             AND j.attempted_at < now() - $3 * interval '1 millisecond'"
        )
    };
}

/// Hands back the orphans among `$4` (all of them if NULL): to `available` with the attempt
/// given back, since no handler ever started them, or `cancelled` if a cancel was requested
/// meanwhile.
const HAND_BACK_ORPHANS_SQL: &str = concat!(
    "UPDATE fairlane_job j SET \
         state = CASE WHEN (j.metadata ->> 'cancel_attempted_at') IS NOT NULL THEN 'cancelled' \
                      ELSE 'available' END::fairlane_job_state, \
         finalized_at = CASE WHEN (j.metadata ->> 'cancel_attempted_at') IS NOT NULL THEN now() END, \
         attempt = greatest(j.attempt - 1, 0), scheduled_at = now(), ",
    errors_appended!(),
    "jsonb_build_object( \
             'attempt', j.attempt, 'at', now(), 'kind', 'interrupted', \
             'error', 'fetched but never started (the fetch reply was lost)', 'worker', $1)) \
     WHERE ",
    orphan_condition!(),
    " AND ($4::bigint[] IS NULL OR j.id = ANY($4)) \
     RETURNING j.id, j.queue, j.kind, j.user_id, j.state"
);

/// Hands back one run of this worker whose end the database refused (`$2`, fetched at `$3`), as
/// an attempt used: `cancelled` if a cancel was requested, `discarded` if it was the last
/// attempt, `available` otherwise ([`decide_used_attempt!`]), as the rescue does.
const HAND_BACK_UNSAVED_SQL: &str = concat!(
    decide_used_attempt!(),
    "j.id = $2 AND j.attempted_at IS NOT DISTINCT FROM $3 AND ",
    running_for_worker!("$1"),
    " FOR UPDATE OF j) \
     UPDATE fairlane_job j SET ",
    end_used_attempt!(),
    ", ",
    errors_appended!(),
    "jsonb_build_object( \
         'attempt', j.attempt, 'at', now(), 'kind', 'error', \
         'error', 'the worker could not save the end of this attempt; handed back with the attempt used', \
         'worker', $1)) \
     FROM decided d WHERE j.id = d.id \
     RETURNING j.id, j.queue, j.kind, j.user_id, j.state"
);

/// Hands back this process's `running` jobs that it never received, or cancels those whose
/// cancel was requested meanwhile (no handler has started them, so the cancel holds).
///
/// All of them go in one transaction. If the database refuses it for a reason other than a lost
/// connection or conflict (a hook that fails on one job), each goes in a transaction of its own,
/// so one job the hooks refuse does not hold the others back; it stays `running` and is tried
/// again at the next repair.
async fn hand_back_orphans(rt: &Runtime) -> Result<(), QueueError> {
    let handed_back = match hand_back_orphans_among(rt, None).await {
        Ok(handed_back) => handed_back,
        Err(e) if e.is_transient() => return Err(e),
        Err(e) => {
            tracing::warn!(error = %e, "handing back orphaned jobs together was refused; handing them back one by one");
            let known = rt.inflight.ids();
            let candidates: Vec<JobId> = sqlx::query_scalar(concat!(
                "SELECT j.id FROM fairlane_job j WHERE ",
                orphan_condition!()
            ))
            .bind(&*rt.worker_id)
            .bind(&known)
            .bind(duration_millis(rt.config.orphan_grace))
            .fetch_all(&rt.pool)
            .await?;
            move_one_by_one(candidates, "orphan hand-back", |id| async move {
                hand_back_orphans_among(rt, Some(&[id])).await
            })
            .await?
        }
    };
    if !handed_back.is_empty() {
        tracing::warn!(
            jobs = handed_back.len(),
            "handed back jobs whose fetch reply was lost"
        );
    }
    Ok(())
}

/// One transaction of [`hand_back_orphans`]: the orphans among `only` (all if `None`), their
/// hooks, the commit, then the wake-ups.
async fn hand_back_orphans_among(
    rt: &Runtime,
    only: Option<&[JobId]>,
) -> Result<Vec<Transition>, QueueError> {
    let mut tx = crate::begin::begin(&rt.pool).await?;
    // Read after the connection is in hand: waiting for one can take seconds under load, and a
    // job fetched and started during that wait must count as received.
    let known = rt.inflight.ids();
    let orphans: Vec<Transition> = sqlx::query_as(HAND_BACK_ORPHANS_SQL)
        .bind(&*rt.worker_id)
        .bind(&known)
        .bind(duration_millis(rt.config.orphan_grace))
        .bind(only)
        .fetch_all(&mut *tx)
        .await?;
    if orphans.is_empty() {
        return Ok(orphans);
    }
    commit_and_wake(rt, tx, &orphans).await?;
    Ok(orphans)
}

/// Hands back the runs whose end the database refused ([`Inflight::mark_unsaved`]), each in a
/// transaction of its own. A run the database still refuses stays `running` and unsaved, and is
/// tried again at the next repair; one no longer running as that run (rescued or cancelled
/// meanwhile) is forgotten.
///
/// [`Inflight::mark_unsaved`]: crate::runtime::Inflight::mark_unsaved
async fn hand_back_unsaved(rt: &Runtime) -> Result<(), QueueError> {
    for (id, started) in rt.inflight.unsaved() {
        let attempt = async {
            let mut tx = crate::begin::begin(&rt.pool).await?;
            let moved: Vec<Transition> = sqlx::query_as(HAND_BACK_UNSAVED_SQL)
                .bind(&*rt.worker_id)
                .bind(id)
                .bind(started)
                .fetch_all(&mut *tx)
                .await?;
            if !moved.is_empty() {
                commit_and_wake(rt, tx, &moved).await?;
            }
            Ok::<_, QueueError>(moved)
        };
        match attempt.await {
            Ok(moved) => {
                rt.inflight.forget_unsaved([(id, started)]);
                if let Some(t) = moved.first() {
                    tracing::warn!(job_id = id, state = ?t.state,
                        "handed back a job whose end could not be saved, with its attempt used");
                }
            }
            Err(e) if e.is_transient() => return Err(e),
            Err(e) => tracing::error!(job_id = id, error = %e,
                "the database refuses to hand back this job whose end could not be saved; it stays running and is tried again at the next repair"),
        }
    }
    Ok(())
}

/// Runs the hooks for `moved` in `tx`, commits, and wakes the queues that may now have work.
async fn commit_and_wake(
    rt: &Runtime,
    mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
    moved: &[Transition],
) -> Result<(), QueueError> {
    run_hooks(&rt.hooks, &mut tx, moved).await?;
    tx.commit().await?;
    let mut wake = wakes_after_commit(&rt.hooks, moved);
    wake.extend(moved.iter().map(|t| t.queue.clone()));
    rt.waker.wake(wake.iter().map(String::as_str));
    Ok(())
}

#[cfg(test)]
mod tests {
    use testkit::TestDb;
    use testkit::proxy::TcpProxy;

    use super::*;

    /// A heartbeat whose connection goes silent gives up at its deadline and drops that
    /// connection, so the next one connects anew instead of waiting behind it.
    #[tokio::test]
    async fn a_heartbeat_on_a_stalled_connection_gives_up_and_the_next_reconnects() {
        let db = TestDb::new().await;
        let proxy = TcpProxy::start(db.server_address()).await;
        let options: PgConnectOptions = db.url_through(proxy.addr()).parse().unwrap();
        let mut heartbeat = HeartbeatConnection::new(options, Duration::from_millis(500));
        let queues = vec!["default".to_owned()];
        let mut beat_within_5s = async || {
            tokio::time::timeout(
                Duration::from_secs(5),
                heartbeat.beat("stalled-worker", &queues),
            )
            .await
            .expect("the heartbeat returned")
        };
        beat_within_5s().await.unwrap();
        beat_within_5s().await.unwrap();

        proxy.stall();
        let stalled = beat_within_5s().await.unwrap_err();
        assert!(stalled.is_connection_error(), "{stalled}");

        proxy.forward_to(db.server_address());
        beat_within_5s().await.unwrap();

        // A kept connection the server ended (a restart, a failover) is replaced within the
        // same heartbeat.
        db.terminate_connections().await;
        beat_within_5s().await.unwrap();
        let beats: i64 =
            sqlx::query_scalar("SELECT count(*) FROM fairlane_worker WHERE id = 'stalled-worker'")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert_eq!(beats, 1);
    }
}
