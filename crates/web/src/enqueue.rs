//! Enqueueing users' work: the cache look-up, the quota check and reservation, the job and its
//! record — for every request of a batch ([`crate::batch`]) in one transaction of three round
//! trips and a commit, however many requests it holds, on a connection kept between batches
//! ([`crate::held`]):
//! 1. `BEGIN` and the lock of the users' rows ([`quota::CheckPlan::lock_sql`]), one simple
//!    query;
//! 2. one statement for the cache look-up and the quota standings, read after the locks are
//!    held; the requests are then decided in Rust ([`quota::Quota::decide`]);
//! 3. one statement that writes the jobs, reservations and records together.
//!
//! Per request the outcome is what it would be had the batch's requests come one after another:
//! a cache hit (analyses), the caller's work of the same request already in flight (an earlier
//! request's, or one accepted earlier in the same batch: no second job), a refusal
//! (`quota_exceeded`, decided in arrival order under the users' locks, so the limit holds
//! exactly), or an accepted job whose reservation and record commit with it. If the batch's
//! transaction fails before its commit, nothing of it exists and each request is retried alone,
//! so one bad request fails only itself. If it failed because its connection, kept from an
//! earlier batch and untested since, had died (a restart, an idle kill), the whole batch first
//! runs again on a fresh connection. A failed commit is not retried, not even when the
//! connection was lost on the way: whether it took effect is unknown, and a retry could enqueue
//! twice. A request whose caller stopped waiting (it timed out and was told nothing changed) is
//! left out: if that happens while its batch runs, the batch rolls back and runs again without
//! it.

use std::sync::Arc;

use axum::Extension;
use chrono::Utc;
use common::{AnalysisArgs, Service, SpecviewArgs, Tier};
use inventory::RepoUrl;
use queue::{ComposedJob, NewJob};
use sqlx::postgres::PgArguments;
use sqlx::{Arguments, FromRow, PgConnection, Row};
use uuid::Uuid;

use crate::batch::{BatchFailed, BatchRun, Batcher, Pending};
use crate::commit_claim::{self, CommitClaim};
use crate::held::HeldConnections;
use crate::middleware::TimeoutWatch;
use crate::problem::Problem;
use crate::routes::{ANALYSIS_COLUMNS_WITHOUT_RESULT, AnalysisView};

/// The record a job fills, created in the job's transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NewRecord {
    Analysis {
        analysis_id: Uuid,
        /// The repository: its normalised URL is stored and fetched, its cache key finds
        /// earlier analyses of it however they spelled it.
        repository: RepoUrl,
        /// The ref as the user gave it (`None`: the default branch).
        requested_ref: Option<String>,
        /// The commit it resolved to.
        commit: String,
    },
    Specview {
        specview_id: Uuid,
        /// A completed analysis of the same user.
        analysis_id: Uuid,
    },
}

/// One user's request to enqueue work.
#[derive(Debug, Clone)]
pub struct EnqueueRequest {
    pub user_id: Uuid,
    pub record: NewRecord,
    /// The W3C trace context the job carries to its worker.
    pub trace: Option<serde_json::Value>,
    /// Decides between the batch committing the request and its caller giving up ([`enqueue`]).
    pub claim: Arc<CommitClaim>,
}

/// What became of a request.
#[derive(Debug, Clone)]
pub enum Enqueued {
    /// The same repository and commit were already analysed (a completed record: the caller's,
    /// or a copy of another's): no job, no quota.
    Cached(AnalysisView),
    /// The caller's own work of the same request is in flight: an earlier request's, or one
    /// accepted in the same batch (docs/web.md, "Sent again"). No new job, no quota.
    InFlight(InFlight),
    /// The job, enqueued with its reservation and record.
    Accepted(ComposedJob),
}

/// The caller's record whose work a request joined, and that record's job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InFlight {
    pub record_id: Uuid,
    pub job_id: i64,
}

/// What makes two requests the same work: one user's analysis of one repository (by cache key:
/// either spelling) at one commit, or one user's specview of one analysis.
#[derive(Debug, PartialEq, Eq, Hash)]
enum SameWork<'a> {
    Analysis(Uuid, &'a str, &'a str),
    Specview(Uuid, Uuid),
}

/// For each of `items` at `pending` (in arrival order), the earlier one of them it is the same
/// work as, if any: `(later, earlier)` pairs. The earlier request decides; the later ones join
/// its outcome instead of each enqueuing and paying for a job.
fn repeated_requests(items: &[&EnqueueRequest], pending: &[usize]) -> Vec<(usize, usize)> {
    let mut first = std::collections::HashMap::new();
    let mut repeats = Vec::new();
    for &index in pending {
        let item = items[index];
        let work = match &item.record {
            NewRecord::Analysis {
                repository, commit, ..
            } => SameWork::Analysis(item.user_id, repository.cache_key(), commit),
            NewRecord::Specview { analysis_id, .. } => {
                SameWork::Specview(item.user_id, *analysis_id)
            }
        };
        match first.entry(work) {
            std::collections::hash_map::Entry::Occupied(earlier) => {
                repeats.push((index, *earlier.get()));
            }
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(index);
            }
        }
    }
    repeats
}

impl EnqueueRequest {
    /// `problem` naming the record this request creates (`analysis_id` or `specview_id`).
    fn with_record_id(&self, problem: Problem) -> Problem {
        let (member, id) = self.record_id();
        problem.with(member, id.to_string())
    }

    /// The record this request creates, with the member naming it (in answers and job args).
    fn record_id(&self) -> (&'static str, Uuid) {
        match &self.record {
            NewRecord::Analysis { analysis_id, .. } => ("analysis_id", *analysis_id),
            NewRecord::Specview { specview_id, .. } => ("specview_id", *specview_id),
        }
    }

    /// A request carrying the current span's trace context.
    pub fn new(user_id: Uuid, record: NewRecord) -> Self {
        EnqueueRequest {
            user_id,
            record,
            trace: telemetry::current_trace_context().and_then(|c| serde_json::to_value(c).ok()),
            claim: Arc::default(),
        }
    }

    pub fn service(&self) -> Service {
        match self.record {
            NewRecord::Analysis { .. } => Service::Analysis,
            NewRecord::Specview { .. } => Service::Specview,
        }
    }

    /// The job, in the lane of `tier`.
    fn job(&self, tier: Tier) -> Result<NewJob, queue::QueueError> {
        let queue = common::select_queue(self.service(), tier, false);
        let job = match &self.record {
            NewRecord::Analysis {
                analysis_id,
                repository,
                commit,
                ..
            } => NewJob::new(
                queue,
                &AnalysisArgs {
                    user_id: Some(self.user_id),
                    analysis_id: *analysis_id,
                    repository: repository.as_str().to_owned(),
                    git_ref: Some(commit.clone()),
                },
            )?,
            NewRecord::Specview {
                specview_id,
                analysis_id,
            } => NewJob::new(
                queue,
                &SpecviewArgs {
                    user_id: Some(self.user_id),
                    specview_id: *specview_id,
                    analysis_id: *analysis_id,
                },
            )?,
        };
        Ok(match &self.trace {
            Some(trace) => job.metadata(telemetry::JOB_METADATA_TRACE_KEY, trace.clone()),
            None => job,
        })
    }
}

/// Serves batches of [`EnqueueRequest`]s.
pub struct EnqueueRunner {
    /// With the quota hook: cancelling a waiting job releases its reservation.
    pub queue: queue::Client,
    pub quota: quota::Quota,
    /// The connections batches run on, held between batches.
    pub connections: HeldConnections,
}

/// The batching enqueuer every `POST` that creates work goes through.
pub type Enqueuer = Batcher<EnqueueRunner>;

/// Submits `request` and waits for its outcome. If the caller stops waiting (the request timeout
/// drops this future), the request is left out of its batch, unless the batch has already
/// claimed it for commit ([`CommitClaim`]): then `watch` (the request's, from the timeout layer)
/// learns that the outcome is unknown, and the timeout's answer says so instead of "nothing was
/// changed".
pub async fn enqueue(
    enqueuer: &Enqueuer,
    request: EnqueueRequest,
    watch: Option<Extension<TimeoutWatch>>,
) -> Outcome {
    let mut giving_up = GivingUp {
        claim: Arc::clone(&request.claim),
        watch: watch.map(|Extension(watch)| watch),
        answered: false,
    };
    let outcome = enqueuer.submit(request).await;
    giving_up.answered = true;
    outcome.map_err(|e: BatchFailed| Problem::internal(&e))?
}

/// Gives the request up when dropped before its answer came.
struct GivingUp {
    claim: Arc<CommitClaim>,
    watch: Option<TimeoutWatch>,
    answered: bool,
}

impl Drop for GivingUp {
    fn drop(&mut self) {
        if !self.answered
            && !self.claim.abandon()
            && let Some(watch) = &self.watch
        {
            watch.outcome_unknown();
        }
    }
}

type Outcome = Result<Enqueued, Problem>;

/// How a request run alone (after its batch failed) ended.
enum Solo {
    /// With its answer.
    Answered,
    /// With `database_busy`: its user's row is held elsewhere.
    Busy,
    /// With this problem, because the database could not be reached: so will the next ones.
    Unreachable(Problem),
}

/// Why a batch did not commit.
enum BatchError {
    /// A statement failed: nothing happened, so a retry is safe.
    BeforeCommit(Problem),
    /// The connection failed before `COMMIT` was sent: nothing happened, and the batch may run
    /// again on another connection.
    ConnectionLost(sqlx::Error),
    /// The commit failed: whether it took effect is unknown. One answer per request, each naming
    /// the record to look up.
    AtCommit(Vec<Problem>),
    /// A caller stopped waiting before the commit: rolled back, to run again without it.
    Abandoned,
}

impl From<Problem> for BatchError {
    fn from(p: Problem) -> Self {
        BatchError::BeforeCommit(p)
    }
}

impl From<sqlx::Error> for BatchError {
    fn from(e: sqlx::Error) -> Self {
        if queue::error::is_connection_error(&e) {
            BatchError::ConnectionLost(e)
        } else {
            BatchError::BeforeCommit(e.into())
        }
    }
}

impl From<quota::QuotaError> for BatchError {
    fn from(e: quota::QuotaError) -> Self {
        match e {
            quota::QuotaError::Database(e) => e.into(),
            e => BatchError::BeforeCommit(crate::quota_problem(e)),
        }
    }
}

impl From<queue::QueueError> for BatchError {
    fn from(e: queue::QueueError) -> Self {
        match e {
            queue::QueueError::Database(e) => e.into(),
            e => BatchError::BeforeCommit(e.into()),
        }
    }
}

/// Answers every request of `batch` with `problem`.
fn answer_all(batch: Vec<Pending<EnqueueRunner>>, problem: &Problem) {
    for pending in batch {
        pending.answer(Err(problem.clone()));
    }
}

impl BatchRun for EnqueueRunner {
    type Item = EnqueueRequest;
    type Output = Outcome;

    /// By user: one user's requests are decided in arrival order, and batches running side by
    /// side lock disjoint users.
    fn shard_key(item: &EnqueueRequest) -> u64 {
        item.user_id.as_u64_pair().0
    }

    async fn run(&self, mut batch: Vec<Pending<Self>>) {
        loop {
            // A request that timed out was answered 503 "nothing was changed": keep it so.
            batch.retain(|p| !(p.is_abandoned() || p.item.claim.is_abandoned()));
            if batch.is_empty() {
                return;
            }
            let items: Vec<&EnqueueRequest> = batch.iter().map(|p| &p.item).collect();
            let outcome = self.enqueue_all(&items).await;
            match outcome {
                Ok(outcomes) => {
                    for (pending, outcome) in batch.into_iter().zip(outcomes) {
                        pending.answer(outcome);
                    }
                    return;
                }
                Err(BatchError::Abandoned) => continue,
                Err(BatchError::BeforeCommit(_) | BatchError::ConnectionLost(_))
                    if batch.len() > 1 =>
                {
                    tracing::warn!(
                        requests = batch.len(),
                        "an enqueue batch failed before committing; retrying its requests one by one"
                    );
                    // A user whose row another session holds past the lock timeout keeps the
                    // others waiting once per request: their next requests are answered at once.
                    // And once the database is out of reach, the rest are answered with that at
                    // once, rather than each waiting for a connection in turn.
                    let mut busy_users = std::collections::HashSet::new();
                    let mut unreachable: Option<Problem> = None;
                    for pending in batch {
                        let user = pending.item.user_id;
                        if let Some(problem) = &unreachable {
                            pending.answer(Err(problem.clone()));
                        } else if busy_users.contains(&user) {
                            pending.answer(Err(Problem::database_busy()));
                        } else {
                            match self.run_alone(pending).await {
                                Solo::Answered => {}
                                Solo::Busy => {
                                    busy_users.insert(user);
                                }
                                Solo::Unreachable(problem) => unreachable = Some(problem),
                            }
                        }
                    }
                    return;
                }
                // At the commit, whose effect is unknown: never retried; each request is told
                // its record's id, to look it up.
                Err(BatchError::AtCommit(problems)) => {
                    for (pending, problem) in batch.into_iter().zip(problems) {
                        pending.answer(Err(problem));
                    }
                    return;
                }
                // Alone: the problem is the answer.
                Err(BatchError::BeforeCommit(problem)) => {
                    answer_all(batch, &problem);
                    return;
                }
                Err(BatchError::ConnectionLost(e)) => {
                    answer_all(batch, &Problem::from(e));
                    return;
                }
            }
        }
    }
}

impl EnqueueRunner {
    /// One request in a transaction of its own.
    async fn run_alone(&self, pending: Pending<Self>) -> Solo {
        loop {
            if pending.is_abandoned() || pending.item.claim.is_abandoned() {
                return Solo::Answered;
            }
            let outcome = self.enqueue_all(&[&pending.item]).await;
            let (outcome, solo) = match outcome {
                Ok(mut outcomes) => (
                    outcomes
                        .pop()
                        .unwrap_or_else(|| Err(Problem::internal(&"an enqueue gave no outcome"))),
                    Solo::Answered,
                ),
                Err(BatchError::Abandoned) => continue,
                Err(BatchError::BeforeCommit(p)) if p.code() == "database_busy" => {
                    (Err(p), Solo::Busy)
                }
                Err(BatchError::BeforeCommit(p)) => (Err(p), Solo::Answered),
                Err(BatchError::AtCommit(mut problems)) => (
                    Err(problems
                        .pop()
                        .unwrap_or_else(|| Problem::internal(&"a failed commit gave no answer"))),
                    Solo::Answered,
                ),
                Err(BatchError::ConnectionLost(e)) => {
                    let problem = Problem::from(e);
                    (Err(problem.clone()), Solo::Unreachable(problem))
                }
            };
            pending.answer(outcome);
            return solo;
        }
    }

    /// The whole batch in one transaction on a held connection, which is kept for the next
    /// batch unless a statement failed on it. If the connection was kept from an earlier batch
    /// and failed before the commit was sent (nothing of the batch happened), the batch runs once
    /// more on a fresh connection.
    async fn enqueue_all(&self, items: &[&EnqueueRequest]) -> Result<Vec<Outcome>, BatchError> {
        // No connection to be had (the pool timed out, the server refuses): `ConnectionLost`.
        let no_connection = BatchError::from;
        let mut conn = self.connections.take().await.map_err(no_connection)?;
        let mut outcome = self.enqueue_on(&mut conn, items).await;
        if let Err(BatchError::ConnectionLost(e)) = &outcome
            && conn.may_retry_after(e)
        {
            tracing::warn!(
                error = %e,
                requests = items.len(),
                "an enqueue batch's kept connection failed before the commit; running the batch \
                 again on a fresh one"
            );
            drop(conn);
            conn = self.connections.take_fresh().await.map_err(no_connection)?;
            outcome = self.enqueue_on(&mut conn, items).await;
        }
        if matches!(outcome, Ok(_) | Err(BatchError::Abandoned)) {
            self.connections.keep(conn);
        }
        outcome
    }

    /// Cache hits and work in flight, then quota checks in arrival order, then jobs, reservations
    /// and records of the granted requests, a request repeated in the batch joining the outcome
    /// of its first; rolled back instead of committed if a caller stopped waiting meanwhile.
    async fn enqueue_on(
        &self,
        conn: &mut PgConnection,
        items: &[&EnqueueRequest],
    ) -> Result<Vec<Outcome>, BatchError> {
        let now = Utc::now();
        let requests: Vec<(Uuid, Service)> = items
            .iter()
            .map(|item| (item.user_id, item.service()))
            .collect();
        // Every request's user is locked and every pair's standing read, cache hits' too: the
        // hits are known only from the same statement as the standings, and a few rows more are
        // cheaper than a round trip more.
        let plan = self.quota.plan(requests.iter().copied(), now);
        let mut tx = self.queue.begin_on_with(conn, &plan.lock_sql()).await?;
        let read = cached_and_standings(&mut tx, items, &plan).await?;
        // At a period's end, or with the host's clock off, the standings are read again for the
        // database's period (same transaction, locks held).
        let (plan, standings) = self
            .quota
            .settle_period(&mut tx, plan, read.standings)
            .await?;
        let mut outcomes: Vec<Option<Outcome>> = items.iter().map(|_| None).collect();
        let answered = (read.hits.into_iter())
            .map(|(index, view)| (index, Enqueued::Cached(view)))
            .chain(
                (read.in_flight.into_iter()).map(|(index, work)| (index, Enqueued::InFlight(work))),
            );
        for (index, answer) in answered {
            if let Some(outcome) = outcomes.get_mut(index) {
                *outcome = Some(Ok(answer));
            }
        }
        let new: Vec<usize> = (0..items.len())
            .filter(|&i| outcomes[i].is_none())
            .collect();
        // A request the batch holds twice (sent again before the first was answered) is decided
        // once: the repeats join the first's outcome, as they would have after its commit.
        let repeats = repeated_requests(items, &new);
        let repeated: std::collections::HashSet<usize> =
            repeats.iter().map(|&(repeat, _)| repeat).collect();
        let pending: Vec<usize> = new.into_iter().filter(|i| !repeated.contains(i)).collect();
        let pending_requests: Vec<(Uuid, Service)> = pending.iter().map(|&i| requests[i]).collect();
        let checks = self
            .quota
            .decide(&plan, &standings, &pending_requests)
            .map_err(crate::quota_problem)?;
        let mut granted = Vec::new();
        let mut jobs = Vec::new();
        for (&index, check) in pending.iter().zip(checks) {
            match check {
                Ok(grant) => {
                    jobs.push(items[index].job(grant.tier)?);
                    granted.push((index, grant));
                }
                Err(e) => outcomes[index] = Some(Err(crate::quota_problem(e))),
            }
        }
        if !jobs.is_empty() {
            let inserted = insert_accepted(&mut tx, items, &granted, jobs).await?;
            for ((index, _), job) in granted.into_iter().zip(inserted) {
                outcomes[index] = Some(Ok(Enqueued::Accepted(job)));
            }
        }
        for &(repeat, first) in &repeats {
            outcomes[repeat] = Some(match &outcomes[first] {
                Some(Ok(Enqueued::Accepted(job))) => Ok(Enqueued::InFlight(InFlight {
                    record_id: items[first].record_id().1,
                    job_id: job.id,
                })),
                Some(Err(problem)) => Err(problem.clone()),
                _ => Err(Problem::internal(&"a repeated request's first got no job")),
            });
        }
        // Every caller must still be waiting, and none can give up as unchanged from here on.
        if !commit_claim::claim_all(items.iter().map(|item| &*item.claim)) {
            // A failed rollback leaves nothing either (the transaction never commits), but the
            // connection is then not kept.
            tx.rollback().await?;
            return Err(BatchError::Abandoned);
        }
        tx.commit().await.map_err(|e| {
            // Each request is told the record to look up: the one whose work it joined, or its
            // own.
            let problem = Problem::commit_outcome_unknown(&e);
            BatchError::AtCommit(
                (items.iter().zip(&outcomes))
                    .map(|(item, outcome)| match outcome {
                        Some(Ok(Enqueued::InFlight(work))) => problem
                            .clone()
                            .with(item.record_id().0, work.record_id.to_string()),
                        _ => item.with_record_id(problem.clone()),
                    })
                    .collect(),
            )
        })?;
        Ok(outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Err(Problem::internal(&"a request got no outcome"))))
            .collect())
    }
}

/// What the batch's second statement read: cache hits and work in flight by request index, and
/// the quota standings of the batch's plan.
struct BatchRead {
    hits: Vec<(usize, AnalysisView)>,
    in_flight: Vec<(usize, InFlight)>,
    standings: Vec<quota::StandingRow>,
}

/// The batch's second statement, the first after its locks were taken (so its snapshot sees what
/// earlier lock holders committed, as the quota check needs): the standings of `plan`
/// ([`quota::standings_cte`]) and, for each analysis request, the caller's own completed
/// analysis of the repository at the commit, or else a copy of anyone's (the inventory of a
/// public commit is the same for everybody) made for the caller in the same statement, which
/// shares the original's inventory rather than storing it again
/// ([`records::analyses_with_inventory`]; the original is locked `FOR KEY SHARE`, as a foreign
/// key would, so that a deletion of it waits for the copy to commit and then writes its
/// inventory into it: ADR 0020), or else the caller's own analysis of it still in flight
/// (`pending` or `running`, its job not final and no cancel asked of it, the newest of them if
/// there are several: a request sent again, after a timeout say, gets the job it started instead
/// of a second, billed one); and for each specview request, the caller's own specview of the
/// analysis in flight. The repository is matched by its cache key, so an analysis of
/// `…/o/r.git` serves `…/o/r`; the copy stores the caller's spelling, and its inventory names
/// the one that was fetched. The three row sets come back side by side (`FULL JOIN … ON
/// false`), each row filled from one of them.
async fn cached_and_standings(
    conn: &mut PgConnection,
    items: &[&EnqueueRequest],
    plan: &quota::CheckPlan,
) -> Result<BatchRead, BatchError> {
    let mut ords = Vec::new();
    let mut users = Vec::new();
    let mut repositories = Vec::new();
    let mut keyed_bare = Vec::new();
    let mut keyed_git = Vec::new();
    let mut commits = Vec::new();
    let mut refs = Vec::new();
    let (mut s_ords, mut s_users, mut s_analyses) = (Vec::new(), Vec::new(), Vec::new());
    for (index, item) in items.iter().enumerate() {
        let ord = i64::try_from(index).unwrap_or(i64::MAX);
        if let NewRecord::Specview { analysis_id, .. } = &item.record {
            s_ords.push(ord);
            s_users.push(item.user_id);
            s_analyses.push(*analysis_id);
        }
        if let NewRecord::Analysis {
            repository,
            requested_ref,
            commit,
            ..
        } = &item.record
        {
            ords.push(ord);
            users.push(item.user_id);
            repositories.push(repository.as_str());
            let [bare, git] = repository.cache_spellings();
            keyed_bare.push(bare);
            keyed_git.push(git);
            commits.push(commit.as_str());
            refs.push(requested_ref.as_deref());
        }
    }
    let mut args = PgArguments::default();
    bind(&mut args, |args| {
        args.add(ords)?;
        args.add(users)?;
        args.add(repositories)?;
        args.add(keyed_bare)?;
        args.add(keyed_git)?;
        args.add(commits)?;
        args.add(refs)?;
        args.add(s_ords)?;
        args.add(s_users)?;
        args.add(s_analyses)
    })?;
    plan.bind_standings(&mut args)
        .map_err(crate::quota_problem)?;
    let rows = sqlx::query_with(sqlx::AssertSqlSafe(cached_and_standings_sql()), args)
        .fetch_all(&mut *conn)
        .await?;
    let mut read = BatchRead {
        hits: Vec::new(),
        in_flight: Vec::new(),
        standings: Vec::with_capacity(rows.len()),
    };
    let index = |ord: i64| usize::try_from(ord).ok();
    for row in rows {
        let standing: Option<i64> = row.try_get("standing_ord")?;
        let flight: Option<i64> = row.try_get("flight_ord")?;
        if let Some(ord) = standing {
            read.standings.push(quota::StandingRow {
                ord,
                tier: row.try_get("standing_tier")?,
                used: row.try_get("standing_used")?,
                reserved: row.try_get("standing_reserved")?,
                read_at: row.try_get("standing_read_at")?,
            });
        } else if let Some(index) = flight.and_then(index) {
            let work = InFlight {
                record_id: row.try_get("flight_id")?,
                job_id: row.try_get("flight_job_id")?,
            };
            read.in_flight.push((index, work));
        } else if let Some(index) = index(row.try_get("ord")?) {
            read.hits.push((index, AnalysisView::from_row(&row)?));
        }
    }
    Ok(read)
}

/// Adds parameters to `args` with `add`; a value that cannot be encoded is an internal problem,
/// found before anything was sent.
fn bind(
    args: &mut PgArguments,
    add: impl FnOnce(&mut PgArguments) -> Result<(), sqlx::error::BoxDynError>,
) -> Result<(), BatchError> {
    add(args).map_err(|e| BatchError::BeforeCommit(Problem::internal(&e)))
}

/// Whether the work of a record is in flight, as SQL over the record's row `$record` (its `id`
/// and `job_id`) whose job names it in its args under `$member`: that job exists, is not final
/// and has no cancel asked of it. NULL (not true) when there is no such job. A request sent
/// again answers with such work (docs/web.md, "Sent again"); analyses and specviews share the
/// rule.
macro_rules! job_in_flight {
    ($record:literal, $member:literal) => {
        concat!(
            "(SELECT j.finalized_at IS NULL AND NOT j.metadata ? 'cancel_attempted_at' \
             FROM fairlane_job j WHERE j.id = ",
            $record,
            ".job_id AND j.args ->> '",
            $member,
            "' = ",
            $record,
            ".id::text)"
        )
    };
}

/// The element types of the cache look-up's parameters in [`cached_and_standings_sql`], in
/// [`cached_and_standings`]'s order: request ordinal, user, repository (normalised URL, what a
/// copy stores), the two normalised URLs with its cache key
/// ([`inventory::RepoUrl::cache_spellings`]: `o/r` and `o/r.git` are one repository), commit,
/// requested ref.
const CACHE_TYPES: [&str; 7] = ["int8", "uuid", "text", "text", "text", "text", "text"];

/// The element types of the specview requests' parameters in [`cached_and_standings_sql`], after
/// [`CACHE_TYPES`]: request ordinal, user, analysis.
const SPECVIEW_TYPES: [&str; 3] = ["int8", "uuid", "uuid"];

/// The statement of [`cached_and_standings`], built once: the cache look-up's parameters first,
/// then the specview look-up's, then the standings'. It is public for the plan tests
/// (`tests/plans.rs`). Each look-up is a lateral subquery per request with one branch per
/// spelling of the repository, matched by equality (ADR 0019): `= ANY (ARRAY[…])` was left out
/// of the index condition by a generic plan made while the tables were small, and an `IN (…)`
/// becomes an `OR` no index takes. The caller's own analysis, completed (a hit) or else in
/// flight, is one look-up (`mine`) over the states that answer, which no partial index's
/// predicate matches (a plan made before the first `ANALYZE` preferred a partial index of
/// completed analyses whose key is the repository alone): `analyses_user` (user, repository,
/// commit) is left, its whole key the condition. Likewise anyone's original (`original`) is
/// one look-up, serving both the copy and the rule that a completed original is preferred to
/// work in flight. Anyone's original to copy still goes through that partial index on such
/// a plan, with the commit as a filter, until an `ANALYZE` (ADR 0019's addendum). A specview's
/// user is compared with `IS NOT DISTINCT FROM`, no index condition, so the specview look-up
/// reads the analysis's specviews (`specviews_analysis`) rather than intersecting them with all
/// the user's. Records are read in the look-ups themselves, not joined again by id (a join
/// planned as a scan of `analyses`).
pub fn cached_and_standings_sql() -> &'static str {
    static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SQL.get_or_init(|| {
        format!(
            "WITH input AS ( \
               SELECT * FROM {requests} \
                 AS t(ord, user_id, repository, keyed_bare, keyed_git, commit, requested_ref) \
             ), specview_input AS ( \
               SELECT * FROM {specview_requests} AS t(ord, user_id, analysis_id) \
             ), mine AS ( \
               SELECT i.ord, f.* FROM input i \
               CROSS JOIN LATERAL ( \
                 SELECT * FROM ( \
                   SELECT {ANALYSIS_COLUMNS_WITHOUT_RESULT} FROM analyses a \
                   WHERE a.user_id = i.user_id AND a.repository = i.keyed_bare \
                     AND a.commit = i.commit AND a.state IN ('completed', 'pending', 'running') \
                   UNION ALL \
                   SELECT {ANALYSIS_COLUMNS_WITHOUT_RESULT} FROM analyses a \
                   WHERE a.user_id = i.user_id AND a.repository = i.keyed_git \
                     AND a.commit = i.commit AND a.state IN ('completed', 'pending', 'running') \
                 ) b \
                 ORDER BY b.state = 'completed' DESC, \
                          CASE WHEN b.state = 'completed' THEN b.completed_at END DESC NULLS LAST, \
                          CASE WHEN b.state <> 'completed' THEN {mine_job_in_flight} END \
                            DESC NULLS LAST, \
                          b.created_at DESC, b.id DESC \
                 LIMIT 1 \
               ) f \
             ), own AS ( \
               SELECT * FROM mine WHERE state = 'completed' \
             ), original AS ( \
               SELECT i.ord, f.id FROM input i \
               CROSS JOIN LATERAL ( \
                 SELECT a.id, a.completed_at FROM analyses a \
                 WHERE a.repository = i.keyed_bare AND a.commit = i.commit \
                   AND a.state = 'completed' AND a.cached_from IS NULL \
                 UNION ALL \
                 SELECT a.id, a.completed_at FROM analyses a \
                 WHERE a.repository = i.keyed_git AND a.commit = i.commit \
                   AND a.state = 'completed' AND a.cached_from IS NULL \
                 ORDER BY completed_at DESC LIMIT 1 \
               ) f \
               WHERE NOT EXISTS (SELECT 1 FROM own o WHERE o.ord = i.ord) \
             ), source AS ( \
               SELECT i.ord, gen_random_uuid() AS copy_id, i.user_id, i.repository, \
                      i.keyed_bare, i.commit, i.requested_ref, o.id AS source_id \
               FROM original o JOIN input i ON i.ord = o.ord \
               CROSS JOIN LATERAL ( \
                 SELECT 1 FROM analyses l WHERE l.id = o.id FOR KEY SHARE \
               ) kept \
               WHERE NOT EXISTS (SELECT 1 FROM input e WHERE e.user_id = i.user_id \
                                 AND e.keyed_bare = i.keyed_bare AND e.commit = i.commit \
                                 AND e.ord < i.ord) \
             ), in_flight AS ( \
               SELECT m.ord, m.id, m.job_id FROM mine m \
               WHERE m.state IN ('pending', 'running') AND {analysis_job_in_flight} \
                 AND NOT EXISTS (SELECT 1 FROM original o WHERE o.ord = m.ord) \
               UNION ALL \
               SELECT i.ord, f.id, f.job_id FROM specview_input i \
               CROSS JOIN LATERAL ( \
                 SELECT s.id, s.job_id FROM specviews s \
                 WHERE s.analysis_id = i.analysis_id AND s.user_id IS NOT DISTINCT FROM i.user_id \
                   AND s.state IN ('pending', 'running') AND {specview_job_in_flight} \
                 ORDER BY s.created_at DESC, s.id DESC LIMIT 1 \
               ) f \
             ), copied AS ( \
               INSERT INTO analyses (id, user_id, repository, requested_ref, commit, state, \
                                     cached_from, completed_at) \
               SELECT copy_id, user_id, repository, requested_ref, commit, 'completed', \
                      source_id, now() FROM source \
               RETURNING {ANALYSIS_COLUMNS_WITHOUT_RESULT} \
             ), cache_hit AS ( \
               SELECT * FROM own \
               UNION ALL \
               SELECT i.ord, copied.* FROM input i \
               JOIN source ON source.user_id = i.user_id AND source.keyed_bare = i.keyed_bare \
                          AND source.commit = i.commit \
               JOIN copied ON copied.id = source.copy_id \
               WHERE NOT EXISTS (SELECT 1 FROM own o WHERE o.ord = i.ord) \
             ), {standings} \
             SELECT s.ord AS standing_ord, s.tier AS standing_tier, s.used AS standing_used, \
                    s.reserved AS standing_reserved, s.read_at AS standing_read_at, \
                    v.ord AS flight_ord, v.id AS flight_id, v.job_id AS flight_job_id, h.* \
             FROM quota_standing s FULL JOIN cache_hit h ON false FULL JOIN in_flight v ON false",
            requests = queue::compose::unnest_params(1, &CACHE_TYPES),
            specview_requests =
                queue::compose::unnest_params(1 + CACHE_TYPES.len(), &SPECVIEW_TYPES),
            standings = quota::standings_cte(1 + CACHE_TYPES.len() + SPECVIEW_TYPES.len()),
            mine_job_in_flight = job_in_flight!("b", "analysis_id"),
            analysis_job_in_flight = job_in_flight!("m", "analysis_id"),
            specview_job_in_flight = job_in_flight!("s", "specview_id"),
        )
    })
}

/// Writes the accepted requests in one statement: their jobs ([`queue::JobsCte`]), their
/// reservations ([`quota::reservations_cte`]) and their analysis or specview records, each
/// linked to its job — one round trip however many there are. Returns the jobs in the order of
/// `granted`.
async fn insert_accepted(
    tx: &mut queue::QueueTx<'_>,
    items: &[&EnqueueRequest],
    granted: &[(usize, quota::Grant)],
    jobs: Vec<NewJob>,
) -> Result<Vec<ComposedJob>, BatchError> {
    let jobs = queue::JobsCte::new(jobs)?;
    if jobs.len() != granted.len() {
        return Err(BatchError::BeforeCommit(Problem::internal(
            &"an accepted request has no job",
        )));
    }
    let expected = jobs.len();
    let (mut a_ids, mut a_users, mut a_repositories, mut a_refs, mut a_commits, mut a_ords) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    let (mut s_ids, mut s_users, mut s_analyses, mut s_ords) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (ord, (index, _)) in (1i64..).zip(granted) {
        let item = items[*index];
        match &item.record {
            NewRecord::Analysis {
                analysis_id,
                repository,
                requested_ref,
                commit,
            } => {
                a_ids.push(*analysis_id);
                a_users.push(item.user_id);
                a_repositories.push(repository.as_str());
                a_refs.push(requested_ref.as_deref());
                a_commits.push(commit.as_str());
                a_ords.push(ord);
            }
            NewRecord::Specview {
                specview_id,
                analysis_id,
            } => {
                s_ids.push(*specview_id);
                s_users.push(item.user_id);
                s_analyses.push(*analysis_id);
                s_ords.push(ord);
            }
        }
    }
    let mut args = PgArguments::default();
    jobs.bind(&mut args)?;
    let grants: Vec<&quota::Grant> = granted.iter().map(|(_, g)| g).collect();
    quota::bind_reservations(&grants, &mut args).map_err(crate::quota_problem)?;
    bind(&mut args, |args| {
        args.add(a_ids)?;
        args.add(a_users)?;
        args.add(a_repositories)?;
        args.add(a_refs)?;
        args.add(a_commits)?;
        args.add(a_ords)?;
        args.add(s_ids)?;
        args.add(s_users)?;
        args.add(s_analyses)?;
        args.add(s_ords)
    })?;
    Ok(tx.insert_composed(accepted_sql(), args, expected).await?)
}

/// The element types of the analysis records' parameters in [`accepted_sql`], in
/// [`insert_accepted`]'s order: id, user, repository, requested ref, commit, job ordinal.
const ANALYSIS_RECORD_TYPES: [&str; 6] = ["uuid", "uuid", "text", "text", "text", "int8"];

/// The element types of the specview records' parameters in [`accepted_sql`], in
/// [`insert_accepted`]'s order: id, user, analysis, job ordinal.
const SPECVIEW_RECORD_TYPES: [&str; 4] = ["uuid", "uuid", "uuid", "int8"];

/// The whole statement of [`insert_accepted`], built once: the jobs' and the reservations'
/// CTEs, then the analysis and specview records, each linked to the job drawn for it, and the
/// jobs in input order. The records' parameters follow the other two parts'.
fn accepted_sql() -> &'static str {
    static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SQL.get_or_init(|| {
        let reservations = 1 + queue::compose::JOBS_CTE_PARAMS;
        let analyses = reservations + quota::RESERVATIONS_CTE_PARAMS;
        let specviews = analyses + ANALYSIS_RECORD_TYPES.len();
        format!(
            "WITH {jobs}, {reserved}, analysis_record AS ( \
               INSERT INTO analyses (id, user_id, repository, requested_ref, commit, job_id) \
               SELECT t.id, t.user_id, t.repository, t.requested_ref, t.commit, j.id \
               FROM {analysis_rows} AS t(id, user_id, repository, requested_ref, commit, job_ord) \
               JOIN fairlane_new_job j ON j.ord = t.job_ord \
             ), specview_record AS ( \
               INSERT INTO specviews (id, user_id, analysis_id, job_id) \
               SELECT t.id, t.user_id, t.analysis_id, j.id \
               FROM {specview_rows} AS t(id, user_id, analysis_id, job_ord) \
               JOIN fairlane_new_job j ON j.ord = t.job_ord \
             ) \
             SELECT j.* FROM fairlane_inserted_job j JOIN fairlane_new_job n USING (id) \
             ORDER BY n.ord",
            analysis_rows = queue::compose::unnest_params(analyses, &ANALYSIS_RECORD_TYPES),
            specview_rows = queue::compose::unnest_params(specviews, &SPECVIEW_RECORD_TYPES),
            jobs = queue::JobsCte::sql(1),
            reserved = quota::reservations_cte("fairlane_new_job", reservations),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The placeholders `$1`… a statement uses, sorted and distinct.
    fn placeholders(sql: &str) -> Vec<usize> {
        let mut found: Vec<usize> = sql
            .split('$')
            .skip(1)
            .filter_map(|rest| {
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                digits.parse().ok()
            })
            .collect();
        found.sort_unstable();
        found.dedup();
        found
    }

    fn analysis(user: Uuid, repository: &str, commit: &str) -> EnqueueRequest {
        let repository =
            inventory::check_url(repository, &inventory::UrlPolicy::default()).unwrap();
        EnqueueRequest::new(
            user,
            NewRecord::Analysis {
                analysis_id: Uuid::now_v7(),
                repository,
                requested_ref: None,
                commit: commit.to_owned(),
            },
        )
    }

    fn specview(user: Uuid, analysis_id: Uuid) -> EnqueueRequest {
        let specview_id = Uuid::now_v7();
        EnqueueRequest::new(
            user,
            NewRecord::Specview {
                specview_id,
                analysis_id,
            },
        )
    }

    #[test]
    fn a_request_repeated_in_a_batch_joins_the_first_of_the_same_work() {
        let (alice, bob, done) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        let requests = [
            analysis(alice, "https://github.com/o/r", "a1"),
            // Another user, another commit, another repository: other work.
            analysis(bob, "https://github.com/o/r", "a1"),
            analysis(alice, "https://github.com/o/r", "b2"),
            analysis(alice, "https://github.com/o/s", "a1"),
            // The other spelling of the first: the same.
            analysis(alice, "https://github.com/o/r.git", "a1"),
            specview(alice, done),
            specview(bob, done),
            specview(alice, done),
            analysis(alice, "https://github.com/o/r", "a1"),
        ];
        let items: Vec<&EnqueueRequest> = requests.iter().collect();
        let all: Vec<usize> = (0..items.len()).collect();
        assert_eq!(repeated_requests(&items, &all), [(4, 0), (7, 5), (8, 0)]);
        // Only the requests still to decide count: with the first answered otherwise (a cache
        // hit), its first repeat decides for the rest.
        let pending: Vec<usize> = (1..items.len()).collect();
        assert_eq!(repeated_requests(&items, &pending), [(7, 5), (8, 4)]);
        assert!(repeated_requests(&items, &[]).is_empty());
    }

    #[test]
    fn the_statements_use_every_parameter_their_parts_bind_and_no_other() {
        let accepted = queue::compose::JOBS_CTE_PARAMS
            + quota::RESERVATIONS_CTE_PARAMS
            + ANALYSIS_RECORD_TYPES.len()
            + SPECVIEW_RECORD_TYPES.len();
        assert_eq!(
            placeholders(accepted_sql()),
            (1..=accepted).collect::<Vec<_>>()
        );
        let read = CACHE_TYPES.len() + SPECVIEW_TYPES.len() + quota::STANDINGS_CTE_PARAMS;
        assert_eq!(
            placeholders(cached_and_standings_sql()),
            (1..=read).collect::<Vec<_>>()
        );
    }
}
