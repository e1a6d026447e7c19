//! Persists the ends of job attempts in batches: every completion waiting in the channel goes into
//! one transaction (one `UPDATE … FROM unnest(…)` per kind of ending, plus the transition hooks).
//!
//! Each update is guarded by `state = 'running' AND attempt = <the attempt that ran> AND
//! attempted_at = <when that run was fetched>`, so a run whose job was meanwhile rescued or handed
//! back and run again can never complete or fail it a second time. The attempt alone would not
//! do: a job handed back is fetched again with the same attempt number. Nothing
//! is reported (metrics, logs) before the transaction commits. A batch that fails is retried —
//! first whole, then job by job — until it commits or the process is told to abandon it; abandoned
//! jobs stay `running` and are rescued once this process stops heartbeating. A completion the
//! database keeps refusing (not a lost connection or conflict) is recorded as a failed attempt
//! instead, so one job can never stall the completions behind it.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use sqlx::{PgConnection, PgPool};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backoff::RetryPolicy;
use crate::context::JobContext;
use crate::error::QueueError;
use crate::hooks::{Transition, TransitionHook, run_hooks, wakes_after_commit};
use crate::job::{FailureKind, JobId};
use crate::metrics::QueueMetrics;
use crate::outcome::JobOutcome;
use crate::runtime::{Inflight, RunStart};
use crate::wake::Waker;

/// How an attempt ended, including the runtime's own "handed back on shutdown".
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Resolution {
    Outcome(JobOutcome),
    /// The worker is shutting down; give the attempt back without counting it.
    Interrupted(String),
}

impl Resolution {
    fn label(&self) -> &'static str {
        match self {
            Resolution::Outcome(o) => o.label(),
            Resolution::Interrupted(_) => "interrupted",
        }
    }
}

/// One finished attempt, waiting to be persisted. Holds the job's context (shared, not copied).
#[derive(Debug, Clone)]
pub(crate) struct Completion {
    pub(crate) job: JobContext,
    pub(crate) resolution: Resolution,
    pub(crate) output: Option<serde_json::Value>,
}

impl Completion {
    fn id(&self) -> JobId {
        self.job.id()
    }
    fn attempt(&self) -> i16 {
        self.job.job().attempt
    }
    /// The run this completion ends (see [`RunStart`]).
    fn run(&self) -> (JobId, RunStart) {
        (self.id(), self.job.job().attempted_at)
    }
}

pub(crate) struct Completer {
    pub(crate) pool: PgPool,
    pub(crate) rx: mpsc::Receiver<Completion>,
    pub(crate) hooks: Arc<[Arc<dyn TransitionHook>]>,
    pub(crate) retry: RetryPolicy,
    pub(crate) batch_size: usize,
    /// Batches persisted at once: while one transaction commits, the next is already running.
    pub(crate) concurrency: usize,
    pub(crate) metrics: QueueMetrics,
    pub(crate) inflight: Arc<Inflight>,
    /// Fired when the process gives up on persisting (hard shutdown with the database away).
    pub(crate) abandon: CancellationToken,
    pub(crate) waker: Arc<Waker>,
    /// The longest one try of a batch waits for the database (`EngineConfig::database_timeout`).
    pub(crate) database_timeout: Duration,
}

/// The part of the completer that persisting tasks share.
struct Persister {
    pool: PgPool,
    database_timeout: Duration,
    /// [`COMPLETION_BEGIN_SQL`] with the server's limits ([`crate::begin::with_server_limits`]).
    begin: String,
    hooks: Arc<[Arc<dyn TransitionHook>]>,
    retry: RetryPolicy,
    metrics: QueueMetrics,
    inflight: Arc<Inflight>,
    abandon: CancellationToken,
    waker: Arc<Waker>,
}

impl Completer {
    pub(crate) async fn run(self) {
        let Completer {
            pool,
            mut rx,
            hooks,
            retry,
            batch_size,
            concurrency,
            metrics,
            inflight,
            abandon,
            waker,
            database_timeout,
        } = self;
        let persister = Arc::new(Persister {
            pool,
            database_timeout,
            begin: crate::begin::with_server_limits(COMPLETION_BEGIN_SQL, database_timeout),
            hooks,
            retry,
            metrics,
            inflight,
            abandon,
            waker,
        });
        let mut running = tokio::task::JoinSet::new();
        let mut abandoned = false;
        let abandon = persister.abandon.clone();
        loop {
            let mut batch = Vec::with_capacity(batch_size);
            tokio::select! {
                // A handler that ignores cancellation keeps the channel's sender alive, so the
                // channel alone might never end.
                () = abandon.cancelled() => {
                    abandoned = true;
                    break;
                }
                received = rx.recv_many(&mut batch, batch_size), if running.len() < concurrency.max(1) => {
                    if received == 0 {
                        break;
                    }
                    let persister = Arc::clone(&persister);
                    running.spawn(async move { persister.persist_until_done(&batch).await });
                }
                Some(done) = running.join_next(), if !running.is_empty() => {
                    if !matches!(done, Ok(true)) {
                        abandoned = true;
                        break;
                    }
                }
            }
        }
        while let Some(done) = running.join_next().await {
            abandoned |= !matches!(done, Ok(true));
        }
        if abandoned {
            tracing::error!("abandoning completions; their jobs stay running and will be rescued");
            // Drain without persisting so that senders do not block forever.
            rx.close();
            while rx.recv().await.is_some() {}
        }
    }
}

/// How a batch's tries ended.
enum Tried {
    Committed,
    /// The process gave up on persisting (hard shutdown with the database away).
    Abandoned,
    /// The database refused the batch this many times, with this last error.
    Refused(QueueError),
}

/// Refusals of a batch before its completions are persisted one by one, so that the rest are not
/// held hostage by one the database will not take.
const REFUSALS_BEFORE_SPLITTING: u32 = 2;

/// Refusals of a single completion before its fallback is tried, and of the fallback before the
/// job is left to the heartbeat's hand-back.
const REFUSALS_BEFORE_FALLBACK: u32 = 3;

impl Persister {
    /// Returns false if abandoned before committing.
    async fn persist_until_done(&self, batch: &[Completion]) -> bool {
        if let [one] = batch {
            return self.persist_one(one).await;
        }
        match self.try_until(batch, REFUSALS_BEFORE_SPLITTING).await {
            Tried::Committed => true,
            Tried::Abandoned => false,
            Tried::Refused(_) => {
                for one in batch {
                    if !self.persist_one(one).await {
                        return false;
                    }
                }
                true
            }
        }
    }

    /// Persists one completion. If the database keeps refusing it (an output `jsonb` cannot hold,
    /// a hook that fails on this job), the attempt is recorded as failed with the reason instead,
    /// so the job is retried or discarded by its own rules and never stays `running` behind a
    /// completion that cannot be saved. If even that is refused, the run is marked unsaved, so the
    /// heartbeat hands the job back as an attempt used (never given back, so a job whose every end
    /// is refused runs out of attempts instead of running for ever), and the completer goes on.
    async fn persist_one(&self, completion: &Completion) -> bool {
        let refusal = match self
            .try_until(std::slice::from_ref(completion), REFUSALS_BEFORE_FALLBACK)
            .await
        {
            Tried::Committed => return true,
            Tried::Abandoned => return false,
            Tried::Refused(e) => e,
        };
        let job = completion.job.job();
        tracing::error!(job_id = job.id, attempt = job.attempt, outcome = completion.resolution.label(), error = %refusal,
            "the database refuses this attempt's end; recording the attempt as failed instead");
        let fallback = Completion {
            job: completion.job.clone(),
            resolution: Resolution::Outcome(JobOutcome::Failed {
                kind: FailureKind::Error,
                message: format!(
                    "the end of this attempt ({}) could not be saved: {refusal}",
                    completion.resolution.label()
                ),
            }),
            output: None,
        };
        let refusal = match self
            .try_until(std::slice::from_ref(&fallback), REFUSALS_BEFORE_FALLBACK)
            .await
        {
            Tried::Committed => return true,
            Tried::Abandoned => return false,
            Tried::Refused(e) => e,
        };
        tracing::error!(job_id = job.id, attempt = job.attempt, error = %refusal,
            "the database refuses to record this attempt as failed too; leaving the job to be handed back");
        self.inflight.mark_unsaved(completion.run());
        self.metrics.outcome(&job.queue, &job.kind, "unsaved");
        true
    }

    /// Tries `batch` until it commits, the process abandons it, or the database has refused it
    /// `refusals` times. Connection errors and lost conflicts are not refusals: they are retried
    /// for as long as it takes; so is a statement timeout, unless the batch holds several jobs.
    async fn try_until(&self, batch: &[Completion], refusals: u32) -> Tried {
        let mut delay = Duration::from_millis(20);
        let mut failures = 0u32;
        let mut refused = 0u32;
        // Whether a try was given up while waiting for its answer (it may have committed).
        let mut unanswered = false;
        loop {
            let started = std::time::Instant::now();
            match self.persist(batch).await {
                Ok(applied) => {
                    tracing::trace!(
                        jobs = batch.len(),
                        ms = started.elapsed().as_secs_f64() * 1000.0,
                        "completions persisted"
                    );
                    if unanswered {
                        // A try given up while waiting for its answer may have committed these
                        // ends, and its wake-ups were never sent: this try found nothing to
                        // change and has none. Their queues are woken anyway (a spare fetch
                        // costs little); another lane whose user a hook freed waits for its poll.
                        self.waker
                            .wake(batch.iter().map(|c| c.job.job().queue.as_str()));
                    }
                    self.after_commit(batch, &applied, unanswered);
                    return Tried::Committed;
                }
                Err(e) => {
                    failures += 1;
                    unanswered |= matches!(e, QueueError::Unanswered(_));
                    // A batch of several jobs cut short (the server's statement timeout, or no
                    // answer within the engine's) will most likely be cut short again: too many
                    // rows, or hooks too slow for so many. That counts towards splitting it. A
                    // single completion cut short is tried again, since recording it as failed
                    // would throw away a run that succeeded.
                    if !e.is_transient() || (batch.len() > 1 && e.is_cut_short()) {
                        refused += 1;
                    }
                    tracing::warn!(error = %e, jobs = batch.len(), failures, refused, "persisting completions failed");
                    if refused >= refusals {
                        return Tried::Refused(e);
                    }
                }
            }
            tokio::select! {
                () = self.abandon.cancelled() => return Tried::Abandoned,
                () = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(Duration::from_secs(5));
        }
    }

    /// Books a committed batch: every run ends here, and the jobs the commit did not change are
    /// counted `stale` (rescued or cancelled meanwhile, or, after a try given up while waiting
    /// for its answer, maybe ended by that try).
    fn after_commit(&self, batch: &[Completion], applied: &HashSet<JobId>, unanswered: bool) {
        self.inflight.remove_all(batch.iter().map(Completion::run));
        for c in batch {
            let job = c.job.job();
            if applied.contains(&job.id) {
                self.metrics
                    .outcome(&job.queue, &job.kind, c.resolution.label());
                tracing::debug!(job_id = job.id, queue = %job.queue, kind = %job.kind, attempt = job.attempt, outcome = c.resolution.label(), "job attempt persisted");
            } else {
                self.metrics.outcome(&job.queue, &job.kind, "stale");
                if unanswered {
                    tracing::info!(
                        job_id = job.id,
                        attempt = job.attempt,
                        "completion found nothing to change: an earlier try, given up while waiting for its answer, most likely committed it"
                    );
                } else {
                    tracing::warn!(
                        job_id = job.id,
                        attempt = job.attempt,
                        "completion ignored: the job was no longer running this attempt (rescued or cancelled meanwhile)"
                    );
                }
            }
        }
    }

    /// One try of `batch`, within the database timeout: past it, or on any error, the
    /// connection is closed rather than pooled ([`crate::begin::within`]). A try given up after
    /// its `COMMIT` was sent may have committed; the next finds its jobs no longer running this
    /// attempt and changes nothing.
    async fn persist(&self, batch: &[Completion]) -> Result<HashSet<JobId>, QueueError> {
        let transitions = crate::begin::within(&self.pool, self.database_timeout, async |c| {
            self.persist_on(c, batch).await
        })
        .await?;
        // After commit: jobs handed back are runnable again, and hooks may want producers woken
        // (a freed fairness slot).
        let mut wake: Vec<String> = wakes_after_commit(&self.hooks, &transitions);
        wake.extend(
            transitions
                .iter()
                .filter(|t| t.state == crate::job::JobState::Available)
                .map(|t| t.queue.clone()),
        );
        self.waker.wake(wake.iter().map(String::as_str));
        Ok(transitions.into_iter().map(|t| t.job_id).collect())
    }

    /// The completion transaction of `batch` on `connection`, committed.
    async fn persist_on(
        &self,
        connection: &mut PgConnection,
        batch: &[Completion],
    ) -> Result<Vec<Transition>, QueueError> {
        let begin = sqlx::AssertSqlSafe(self.begin.clone());
        let mut tx = sqlx::Connection::begin_with(connection, begin).await?;
        let transitions = persist_batch(&mut tx, batch, &self.retry).await?;
        run_hooks(&self.hooks, &mut tx, &transitions).await?;
        tx.commit().await?;
        Ok(transitions)
    }
}

/// Opens a completion transaction whose statements are planned generically (ADR 0014).
///
/// Every statement in it is keyed by the batch's job ids: the updates below look each id up by
/// primary key, and the transition hooks do the same with their own tables. A custom plan, which
/// knows how many ids the batch holds, takes a whole-table scan and a hash join to be cheaper than
/// that many index look-ups unless the table holds over a hundred times the batch's rows, and
/// PostgreSQL plans a prepared statement's first five executions on each connection that way.
/// A generic plan counts an array of unknown length as a few rows and always takes the index.
const COMPLETION_BEGIN_SQL: &str = "BEGIN; SET LOCAL plan_cache_mode = force_generic_plan";

/// The update for attempts that completed: `$1` job ids, `$2` the attempts that ran, `$3` outputs,
/// `$4` when each run was fetched.
const COMPLETED_SQL: &str = "UPDATE fairlane_job j SET state = 'completed', finalized_at = now(), output = u.output \
     FROM unnest($1::int8[], $2::int2[], $3::jsonb[], $4::timestamptz[]) AS u(id, attempt, output, attempted_at) \
     WHERE j.id = u.id AND j.state = 'running' AND j.attempt = u.attempt AND j.attempted_at = u.attempted_at RETURNING j.id, j.queue, j.kind, j.user_id, j.state";

/// Writes every completion of `batch`; returns the transitions that applied.
async fn persist_batch(
    conn: &mut PgConnection,
    batch: &[Completion],
    retry: &RetryPolicy,
) -> Result<Vec<Transition>, QueueError> {
    let mut done = Columns::default();
    let mut failed = Columns::default();
    let mut snoozed = Columns::default();
    let mut cancelled = Columns::default();
    let mut interrupted = Columns::default();
    for c in batch {
        match &c.resolution {
            Resolution::Outcome(JobOutcome::Completed) => done.push(c, None, 0.0, "", ""),
            Resolution::Outcome(JobOutcome::Failed { kind, message }) => {
                let job = c.job.job();
                let (state, delay) = if job.attempt >= job.max_attempts {
                    ("discarded", 0.0)
                } else {
                    ("retryable", retry.delay_for(job.attempt).as_secs_f64())
                };
                failed.push(c, Some(state), delay, failure_label(*kind), message);
            }
            Resolution::Outcome(JobOutcome::Snoozed(d)) => {
                // Cut here, where every snooze ends (a handler's, or a middleware's own
                // outcome): a longer one would overflow the timestamp and fail the job's end.
                let d = (*d).min(crate::outcome::MAX_SNOOZE);
                snoozed.push(c, None, d.as_secs_f64(), "", "");
            }
            Resolution::Outcome(JobOutcome::Cancelled(reason)) => {
                cancelled.push(c, None, 0.0, "", reason);
            }
            Resolution::Interrupted(reason) => {
                interrupted.push(
                    c,
                    None,
                    0.0,
                    failure_label(FailureKind::Interrupted),
                    reason,
                );
            }
        }
    }
    let mut transitions = Vec::with_capacity(batch.len());
    if !done.ids.is_empty() {
        transitions.extend(
            sqlx::query_as::<_, Transition>(COMPLETED_SQL)
                .bind(&done.ids)
                .bind(&done.attempts)
                .bind(&done.outputs)
                .bind(&done.started)
                .fetch_all(&mut *conn)
                .await?,
        );
    }
    if !failed.ids.is_empty() {
        let sql = concat!(
            "UPDATE fairlane_job j SET \
                 state = CASE WHEN (j.metadata ->> 'cancel_attempted_at') IS NOT NULL THEN 'cancelled' ELSE u.state END::fairlane_job_state, \
                 scheduled_at = CASE WHEN u.state = 'retryable' AND NOT (j.metadata ->> 'cancel_attempted_at') IS NOT NULL \
                                     THEN now() + u.delay * interval '1 second' ELSE j.scheduled_at END, \
                 finalized_at = CASE WHEN u.state = 'discarded' OR (j.metadata ->> 'cancel_attempted_at') IS NOT NULL THEN now() END, ",
            errors_appended!(),
            "jsonb_build_object( \
                     'attempt', u.attempt, 'at', now(), 'kind', u.kind, 'error', u.message, \
                     'worker', j.attempted_by[cardinality(j.attempted_by)])) \
             FROM unnest($1::int8[], $2::int2[], $3::text[], $4::float8[], $5::text[], $6::text[], $7::timestamptz[]) \
                  AS u(id, attempt, state, delay, kind, message, attempted_at) \
             WHERE j.id = u.id AND j.state = 'running' AND j.attempt = u.attempt AND j.attempted_at = u.attempted_at RETURNING j.id, j.queue, j.kind, j.user_id, j.state"
        );
        transitions.extend(
            sqlx::query_as::<_, Transition>(sql)
                .bind(&failed.ids)
                .bind(&failed.attempts)
                .bind(&failed.states)
                .bind(&failed.delays)
                .bind(&failed.kinds)
                .bind(&failed.messages)
                .bind(&failed.started)
                .fetch_all(&mut *conn)
                .await?,
        );
    }
    if !snoozed.ids.is_empty() {
        // A snooze gives the attempt back, so snoozing can never exhaust max_attempts.
        let sql = "UPDATE fairlane_job j SET \
                 state = CASE WHEN (j.metadata ->> 'cancel_attempted_at') IS NOT NULL THEN 'cancelled' ELSE 'scheduled' END::fairlane_job_state, \
                 finalized_at = CASE WHEN (j.metadata ->> 'cancel_attempted_at') IS NOT NULL THEN now() END, \
                 scheduled_at = now() + u.delay * interval '1 second', \
                 attempt = j.attempt - 1, \
                 metadata = jsonb_set(j.metadata, '{snoozes}', \
                     to_jsonb(coalesce((j.metadata ->> 'snoozes')::int, 0) + 1)) \
             FROM unnest($1::int8[], $2::int2[], $3::float8[], $4::timestamptz[]) AS u(id, attempt, delay, attempted_at) \
             WHERE j.id = u.id AND j.state = 'running' AND j.attempt = u.attempt AND j.attempted_at = u.attempted_at RETURNING j.id, j.queue, j.kind, j.user_id, j.state";
        transitions.extend(
            sqlx::query_as::<_, Transition>(sql)
                .bind(&snoozed.ids)
                .bind(&snoozed.attempts)
                .bind(&snoozed.delays)
                .bind(&snoozed.started)
                .fetch_all(&mut *conn)
                .await?,
        );
    }
    if !cancelled.ids.is_empty() {
        let sql = "UPDATE fairlane_job j SET state = 'cancelled', finalized_at = now(), \
                 metadata = j.metadata || jsonb_build_object('cancel_reason', u.reason) \
             FROM unnest($1::int8[], $2::int2[], $3::text[], $4::timestamptz[]) AS u(id, attempt, reason, attempted_at) \
             WHERE j.id = u.id AND j.state = 'running' AND j.attempt = u.attempt AND j.attempted_at = u.attempted_at RETURNING j.id, j.queue, j.kind, j.user_id, j.state";
        transitions.extend(
            sqlx::query_as::<_, Transition>(sql)
                .bind(&cancelled.ids)
                .bind(&cancelled.attempts)
                .bind(&cancelled.messages)
                .bind(&cancelled.started)
                .fetch_all(&mut *conn)
                .await?,
        );
    }
    if !interrupted.ids.is_empty() {
        // Handed back: runnable at once elsewhere, and the attempt does not count.
        let sql = concat!(
            "UPDATE fairlane_job j SET \
                 state = CASE WHEN (j.metadata ->> 'cancel_attempted_at') IS NOT NULL THEN 'cancelled' ELSE 'available' END::fairlane_job_state, \
                 finalized_at = CASE WHEN (j.metadata ->> 'cancel_attempted_at') IS NOT NULL THEN now() END, \
                 scheduled_at = now(), \
                 attempt = j.attempt - 1, ",
            errors_appended!(),
            "jsonb_build_object( \
                     'attempt', u.attempt, 'at', now(), 'kind', u.kind, 'error', u.message, \
                     'worker', j.attempted_by[cardinality(j.attempted_by)])) \
             FROM unnest($1::int8[], $2::int2[], $3::text[], $4::text[], $5::timestamptz[]) AS u(id, attempt, kind, message, attempted_at) \
             WHERE j.id = u.id AND j.state = 'running' AND j.attempt = u.attempt AND j.attempted_at = u.attempted_at RETURNING j.id, j.queue, j.kind, j.user_id, j.state"
        );
        transitions.extend(
            sqlx::query_as::<_, Transition>(sql)
                .bind(&interrupted.ids)
                .bind(&interrupted.attempts)
                .bind(&interrupted.kinds)
                .bind(&interrupted.messages)
                .bind(&interrupted.started)
                .fetch_all(&mut *conn)
                .await?,
        );
    }
    Ok(transitions)
}

/// Column vectors for one `unnest` update.
#[derive(Default)]
struct Columns {
    ids: Vec<JobId>,
    attempts: Vec<i16>,
    outputs: Vec<Option<serde_json::Value>>,
    states: Vec<&'static str>,
    delays: Vec<f64>,
    kinds: Vec<&'static str>,
    messages: Vec<String>,
    /// Each run's `attempted_at`, with the attempt the guard of every update.
    started: Vec<RunStart>,
}

impl Columns {
    fn push(
        &mut self,
        c: &Completion,
        state: Option<&'static str>,
        delay: f64,
        kind: &'static str,
        message: &str,
    ) {
        self.ids.push(c.id());
        self.attempts.push(c.attempt());
        self.outputs.push(c.output.clone());
        self.states.push(state.unwrap_or(""));
        self.delays.push(delay);
        self.kinds.push(kind);
        self.messages.push(stored_message(message));
        self.started.push(c.job.job().attempted_at);
    }
}

/// `message` as stored: NUL (which PostgreSQL's text cannot hold, refusing the whole message)
/// replaced, and cut at a character boundary after [`crate::MAX_ERROR_MESSAGE_BYTES`].
fn stored_message(message: &str) -> String {
    let mut end = message.len().min(crate::MAX_ERROR_MESSAGE_BYTES);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    let mut stored = message[..end].replace('\0', "\u{fffd}");
    if end < message.len() {
        stored.push('…');
    }
    stored
}

fn failure_label(kind: FailureKind) -> &'static str {
    match kind {
        FailureKind::Error => "error",
        FailureKind::Panic => "panic",
        FailureKind::Timeout => "timeout",
        FailureKind::UnknownKind => "unknown_kind",
        FailureKind::InvalidArgs => "invalid_args",
        FailureKind::Rescued => "rescued",
        FailureKind::Interrupted => "interrupted",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan_nodes::{analyzed_db, assert_looks_jobs_up_by};
    use serde_json::Value;

    #[test]
    fn messages_are_stored_without_nul_and_cut_at_a_character() {
        assert_eq!(stored_message("a\0b"), "a\u{fffd}b");
        let short = "x".repeat(crate::MAX_ERROR_MESSAGE_BYTES);
        assert_eq!(stored_message(&short), short);
        // Two-byte characters straddling the limit: cut before the one that does not fit.
        let long = format!("a{}", "é".repeat(crate::MAX_ERROR_MESSAGE_BYTES));
        let stored = stored_message(&long);
        assert!(stored.ends_with('…'));
        assert_eq!(
            stored.trim_end_matches('…').len(),
            crate::MAX_ERROR_MESSAGE_BYTES - 1
        );
    }

    #[test]
    fn the_errors_kept_are_the_constant() {
        assert!(errors_appended!().contains(&format!(
            "jsonb_array_length(j.errors) >= {} ",
            crate::MAX_ATTEMPT_ERRORS
        )));
    }

    /// On an analysed table of 20,000 jobs, 2,000 of them running, a batch completing 1,000 of
    /// them looks each up by primary key, even in the statement's first execution on a
    /// connection, which PostgreSQL would otherwise plan for these values as a scan of the whole
    /// table and a hash join (ADR 0014).
    #[tokio::test]
    async fn a_completion_batch_looks_its_jobs_up_by_primary_key() {
        let db = analyzed_db(
            "INSERT INTO fairlane_job (queue, kind, args, state, attempt, attempted_at, attempted_by) \
             SELECT 'q', 'noop', '{}', \
                    CASE WHEN g <= 2000 THEN 'running' ELSE 'available' END::fairlane_job_state, \
                    CASE WHEN g <= 2000 THEN 1 ELSE 0 END, \
                    CASE WHEN g <= 2000 THEN now() END, \
                    CASE WHEN g <= 2000 THEN '{w}'::text[] ELSE '{}'::text[] END \
             FROM generate_series(1, 20000) g",
        )
        .await;

        let mut tx = db.pool.begin_with(COMPLETION_BEGIN_SQL).await.unwrap();
        let ids: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM fairlane_job WHERE state = 'running' ORDER BY id LIMIT 1000",
        )
        .fetch_all(&mut *tx)
        .await
        .unwrap();
        // Every running job was fetched by the same statement: one `attempted_at`.
        let attempted_at: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
            "SELECT DISTINCT attempted_at FROM fairlane_job WHERE state = 'running'",
        )
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "PREPARE fairlane_completed (int8[], int2[], jsonb[], timestamptz[]) AS {COMPLETED_SQL}"
        )))
        .execute(&mut *tx)
        .await
        .unwrap();
        let id_list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
        let explained: Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE fairlane_completed( \
               '{{{id_list}}}', array_fill(1::int2, ARRAY[{n}]), array_fill(NULL::jsonb, ARRAY[{n}]), \
               array_fill('{started}'::timestamptz, ARRAY[{n}]))",
            n = ids.len(),
            started = attempted_at.to_rfc3339()
        )))
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        tx.rollback().await.unwrap();

        assert_eq!(
            explained[0]["Plan"]["Actual Rows"], 1000,
            "every job completed"
        );
        assert_looks_jobs_up_by(&explained, "fairlane_job_pkey");
    }
}
