//! Re-analysis of stale repositories: on each tick, the repositories whose newest completed
//! analysis (by anyone, cache copies included) is older than `REANALYZE_AFTER` are queued as
//! system jobs (no user: no quota, no fairness limit) into `analysis_scheduled`, stalest first,
//! at most `REANALYZE_BATCH` per tick.
//!
//! Each re-analysis is an `analyses` row (no user, no requested ref, no commit: the worker
//! resolves the default branch) plus its job, unique key `reanalyze:<repository>`. The tick's
//! claim, the jobs and the rows commit in one transaction; the jobs go in first so that a key
//! already held by a pending re-analysis (a duplicate) never gets a row.
//!
//! A repository is skipped while a system analysis of it is younger than `REANALYZE_AFTER`
//! (pending, running, completed or failed), so a repository that cannot be analysed is tried
//! again once per `REANALYZE_AFTER`, not on every tick.

use std::time::Duration;

use chrono::{DateTime, Utc};
use common::{AnalysisArgs, Lane, Service};
use queue::NewJob;
use serde::Serialize;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::error::SchedulerError;
use crate::ticks::{Claim, TickStore};

/// The task name in `scheduler_ticks` and in metrics.
pub const TASK: &str = "reanalyze";
/// Unique-key prefix of re-analysis jobs.
pub const UNIQUE_KEY_PREFIX: &str = "reanalyze:";
/// Repositories whose unique key would exceed the queue's limit (1,024 bytes) are never chosen.
const MAX_REPOSITORY_LEN: i32 = 1000;

/// How re-analysis chooses and enqueues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReanalyzeSettings {
    pub after: Duration,
    pub batch: u32,
    pub max_attempts: i16,
}

/// What one tick did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ReanalyzeReport {
    /// Stale repositories found (at most the batch).
    pub candidates: u64,
    /// Jobs (and analyses rows) created.
    pub enqueued: u64,
    /// Repositories whose re-analysis was already pending (unique key hit).
    pub duplicates: u64,
}

/// What happened to a tick.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TickOutcome<R> {
    Done(R),
    AlreadyDone,
    NotLeader,
}

impl<R> TickOutcome<R> {
    pub fn label(&self) -> &'static str {
        match self {
            TickOutcome::Done(_) => "done",
            TickOutcome::AlreadyDone => "already_done",
            TickOutcome::NotLeader => "not_leader",
        }
    }
}

/// Failed re-analyses in a row after which a repository is no longer re-analysed, until an
/// analysis of it completes again (a user asks for it): a repository deleted or made private
/// would otherwise cost a job, and leave a failed record, every `REANALYZE_AFTER` for ever.
pub const GIVE_UP_AFTER_FAILURES: i64 = 3;

/// The unique key of `repository`'s re-analysis job.
pub fn unique_key(repository: &str) -> String {
    format!("{UNIQUE_KEY_PREFIX}{repository}")
}

/// Up to `limit` repositories due for re-analysis, stalest first.
///
/// A repository is its cache key (`inventory::RepoUrl::cache_key`): `…/o/r` and `…/o/r.git` are
/// one repository, fresh if either spelling was analysed recently, re-analysed once under the
/// spelling analysed last (for `file://`, every spelling is its own repository).
///
/// A repository whose last [`GIVE_UP_AFTER_FAILURES`] system re-analyses since its newest
/// completed analysis all failed is left alone.
///
/// Cost: one pass over the completed-analyses recency index (`analyses_repository_recency`,
/// an index-only scan grouped by repository), then three index probes per spelling of each
/// candidate (`analyses_system_recency` twice, `fairlane_job_unique_key`). It runs once per
/// tick.
pub async fn stale_repositories(
    conn: &mut PgConnection,
    after: Duration,
    limit: u32,
) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "WITH spelled AS ( \
             SELECT repository, max(completed_at) AS completed_at \
             FROM analyses WHERE state = 'completed' GROUP BY repository), \
         keyed AS ( \
             SELECT repository, completed_at, \
                    CASE WHEN repository LIKE 'https://%' \
                         THEN regexp_replace(repository, '([^/])\\.git$', '\\1') \
                         ELSE repository END AS key \
             FROM spelled), \
         latest AS ( \
             SELECT key, max(completed_at) AS completed_at, \
                    (array_agg(repository ORDER BY completed_at DESC, repository))[1] AS repository, \
                    CASE WHEN key LIKE 'https://%' THEN ARRAY[key, key || '.git'] \
                         ELSE ARRAY[key] END AS spellings \
             FROM keyed GROUP BY key) \
         SELECT l.repository FROM latest l \
         WHERE l.completed_at < now() - make_interval(secs => $1) \
           AND octet_length(l.repository) <= $3 \
           AND NOT EXISTS ( \
               SELECT 1 FROM analyses s \
               WHERE s.user_id IS NULL AND s.repository = ANY(l.spellings) \
                 AND s.created_at >= now() - make_interval(secs => $1)) \
           AND NOT EXISTS ( \
               SELECT 1 FROM fairlane_job j \
               WHERE j.unique_key IN (SELECT $4 || spelling FROM unnest(l.spellings) AS spelling) \
                 AND j.state IN ('available', 'scheduled', 'running', 'retryable')) \
           AND (SELECT count(*) FROM ( \
                  SELECT 1 FROM analyses f \
                  WHERE f.user_id IS NULL AND f.repository = ANY(l.spellings) \
                    AND f.created_at > l.completed_at AND f.state = 'failed' \
                  LIMIT $5) failures) < $5 \
         ORDER BY l.completed_at, l.repository \
         LIMIT $2",
    )
    .bind(after.as_secs_f64())
    .bind(i64::from(limit))
    .bind(MAX_REPOSITORY_LEN)
    .bind(UNIQUE_KEY_PREFIX)
    .bind(GIVE_UP_AFTER_FAILURES)
    .fetch_all(&mut *conn)
    .await
}

/// Queues a re-analysis of each repository inside the caller's transaction: jobs first (unique
/// per repository), then an `analyses` row for each job actually inserted.
pub async fn enqueue(
    conn: &mut PgConnection,
    repositories: &[String],
    max_attempts: i16,
    tick: DateTime<Utc>,
) -> Result<ReanalyzeReport, SchedulerError> {
    let mut report = ReanalyzeReport {
        candidates: repositories.len() as u64,
        ..ReanalyzeReport::default()
    };
    if repositories.is_empty() {
        return Ok(report);
    }
    let queue = Service::Analysis.queue(Lane::Scheduled);
    let trace = telemetry::current_trace_context().and_then(|c| serde_json::to_value(c).ok());
    let mut analysis_ids = Vec::with_capacity(repositories.len());
    let mut jobs = Vec::with_capacity(repositories.len());
    for repository in repositories {
        let analysis_id = Uuid::now_v7();
        let args = AnalysisArgs {
            user_id: None,
            analysis_id,
            repository: repository.clone(),
            git_ref: None,
        };
        let mut job = NewJob::new(queue.clone(), &args)?
            .unique_key(unique_key(repository))
            .max_attempts(max_attempts)
            .metadata(
                "scheduler",
                serde_json::json!({ "task": TASK, "tick_at": tick }),
            );
        if let Some(trace) = &trace {
            job = job.metadata(telemetry::JOB_METADATA_TRACE_KEY, trace.clone());
        }
        analysis_ids.push(analysis_id);
        jobs.push(job);
    }
    let inserted = queue::insert::insert_many(&mut *conn, jobs).await?;
    let mut ids = Vec::new();
    let mut repos = Vec::new();
    let mut job_ids = Vec::new();
    for ((inserted, analysis_id), repository) in
        inserted.iter().zip(&analysis_ids).zip(repositories)
    {
        if inserted.duplicate {
            report.duplicates += 1;
            continue;
        }
        ids.push(*analysis_id);
        repos.push(repository.as_str());
        job_ids.push(inserted.job.id);
    }
    if !ids.is_empty() {
        sqlx::query(
            "INSERT INTO analyses (id, user_id, repository, requested_ref, commit, state, job_id) \
             SELECT id, NULL, repository, NULL, NULL, 'pending', job_id \
             FROM unnest($1::uuid[], $2::text[], $3::int8[]) AS t(id, repository, job_id)",
        )
        .bind(&ids)
        .bind(&repos)
        .bind(&job_ids)
        .execute(&mut *conn)
        .await?;
    }
    report.enqueued = ids.len() as u64;
    Ok(report)
}

/// One re-analysis tick: choose, fence and claim, enqueue, record; one transaction.
pub async fn run_tick(
    store: &TickStore,
    settings: &ReanalyzeSettings,
    tick: DateTime<Utc>,
) -> Result<TickOutcome<ReanalyzeReport>, SchedulerError> {
    let mut tx = store.begin().await?;
    if store.is_done(&mut tx, TASK, tick).await? {
        return Ok(TickOutcome::AlreadyDone);
    }
    // Chosen before the claim: the claim's share lock on the lease is then held only for the
    // inserts, never for the (longer) search.
    let repositories = stale_repositories(&mut tx, settings.after, settings.batch).await?;
    match store.claim(&mut tx, TASK, tick).await? {
        Claim::Claimed => {}
        Claim::AlreadyDone => return Ok(TickOutcome::AlreadyDone),
        Claim::NotLeader => return Ok(TickOutcome::NotLeader),
    }
    let report = enqueue(&mut tx, &repositories, settings.max_attempts, tick).await?;
    let result = serde_json::to_value(&report).unwrap_or_default();
    TickStore::record(&mut tx, TASK, tick, &result).await?;
    tx.commit().await?;
    Ok(TickOutcome::Done(report))
}
