//! [`RecordHook`]: settles analysis and specview records in the same transaction as their job's
//! final state.

use std::collections::BTreeSet;

use async_trait::async_trait;
use common::{AnalysisArgs, JobArgs, SpecviewArgs};
use queue::{BoxError, JobId, JobState, Transition, TransitionHook};
use sqlx::PgConnection;
use uuid::Uuid;

/// A [`TransitionHook`] for jobs of kind `analysis` and `specview`:
///
/// - `completed`: the record becomes `completed` (its result was staged by the handler). An
///   analysis of a (repository, commit) that already has a completed original is stored as a
///   copy of it (`cached_from`), so the unique index `analyses_cache` always holds; concurrent
///   completions of the same commit are serialized by a transaction-scoped advisory lock. A
///   completion whose record holds no result is refused ([`SettleError::NoResult`]): the whole
///   transaction rolls back, so the job is not completed and not billed, and the queue records
///   the attempt as failed (retried, then discarded, which fails the record unbilled).
/// - `cancelled` / `discarded`: the record becomes `failed`, its staged result is dropped and
///   `error` says why (the handler's cancel reason, "cancelled by the user", or the last attempt's
///   error after attempts ran out).
/// - anything else (retry, snooze, rescue to `available`): nothing changes.
///
/// Only records still `pending` or `running` change, so the hook is idempotent. Register it on
/// every [`queue::Client`] whose engine, rescuer or cancel can move these jobs to a final state —
/// the maintenance leader may be any process, so both worker services register it.
#[derive(Debug, Clone, Copy, Default)]
pub struct RecordHook {
    _private: (),
}

impl RecordHook {
    pub fn new() -> Self {
        RecordHook { _private: () }
    }
}

#[async_trait]
impl TransitionHook for RecordHook {
    async fn on_transitions(
        &self,
        conn: &mut PgConnection,
        transitions: &[Transition],
    ) -> Result<(), BoxError> {
        match settle(conn, transitions).await {
            Ok(()) => Ok(()),
            // The database's own error, so that the queue still tells a lost connection (retried)
            // from a refusal.
            Err(SettleError::Database(e)) => Err(Box::new(e)),
            Err(refused) => Err(Box::new(refused)),
        }
    }
}

/// Why records could not be settled with their jobs.
#[derive(Debug, thiserror::Error)]
pub enum SettleError {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// Jobs completed while their records held no result (a handler succeeded without staging).
    /// Completing them would bill the user for nothing, so their completion is refused.
    #[error("{NO_RESULT} ({table} {records:?})")]
    NoResult {
        table: &'static str,
        records: Vec<Uuid>,
    },
}

/// The hook's work as a function, for callers that finish jobs by hand.
pub async fn settle(
    conn: &mut PgConnection,
    transitions: &[Transition],
) -> Result<(), SettleError> {
    let mut analyses_done: Vec<JobId> = Vec::new();
    let mut analyses_ended: Vec<JobId> = Vec::new();
    let mut specviews_done: Vec<JobId> = Vec::new();
    let mut specviews_ended: Vec<JobId> = Vec::new();
    let mut analyses_waiting: Vec<JobId> = Vec::new();
    let mut specviews_waiting: Vec<JobId> = Vec::new();
    for t in transitions {
        let (done, ended, waiting) = match t.kind.as_str() {
            AnalysisArgs::KIND => (
                &mut analyses_done,
                &mut analyses_ended,
                &mut analyses_waiting,
            ),
            SpecviewArgs::KIND => (
                &mut specviews_done,
                &mut specviews_ended,
                &mut specviews_waiting,
            ),
            _ => continue,
        };
        match t.state {
            JobState::Completed => done.push(t.job_id),
            JobState::Cancelled | JobState::Discarded => ended.push(t.job_id),
            JobState::Available | JobState::Scheduled | JobState::Retryable => {
                waiting.push(t.job_id);
            }
            JobState::Running => {}
        }
    }
    // Back to waiting (a retry to come, a rescue, a hand-back, a snooze): `pending` until the
    // next attempt claims the record, not `running` for the hours a retry may wait.
    for (table, waiting) in [
        ("analyses", &analyses_waiting),
        ("specviews", &specviews_waiting),
    ] {
        if !waiting.is_empty() {
            sqlx::query(sqlx::AssertSqlSafe(waiting_statement(table)))
                .bind(waiting)
                .execute(&mut *conn)
                .await?;
        }
    }
    if !analyses_ended.is_empty() {
        sqlx::query(sqlx::AssertSqlSafe(fail_statement(
            "analyses",
            "result = NULL",
        )))
        .bind(&analyses_ended)
        .execute(&mut *conn)
        .await?;
    }
    if !specviews_ended.is_empty() {
        sqlx::query(sqlx::AssertSqlSafe(fail_statement(
            "specviews",
            "result = NULL, markdown = NULL",
        )))
        .bind(&specviews_ended)
        .execute(&mut *conn)
        .await?;
    }
    if !analyses_done.is_empty() {
        complete_analyses(conn, &analyses_done).await?;
    }
    if !specviews_done.is_empty() {
        complete_specviews(conn, &specviews_done).await?;
    }
    Ok(())
}

/// Why a job ended without success, in words for the record's `error` (`j` is the job row).
const FAILURE_MESSAGE: &str = "CASE \
      WHEN j.state = 'cancelled' AND (j.metadata ->> 'cancel_attempted_at') IS NOT NULL \
        THEN 'cancelled by the user' \
      WHEN j.state = 'cancelled' \
        THEN coalesce(nullif(j.metadata ->> 'cancel_reason', ''), j.errors -> -1 ->> 'error', 'cancelled') \
      ELSE 'failed after ' || j.attempt || CASE WHEN j.attempt = 1 THEN ' attempt: ' ELSE ' attempts: ' END \
           || coalesce(j.errors -> -1 ->> 'error', 'no error was recorded') \
    END";

/// The condition that record `r` of `table` is the one a job of `$1` fills: linked to the job,
/// and named by the job's arguments. Job ids are not unique over time (a `fairlane_job` restored
/// apart from the records starts its identity over), so a link alone could make a new job settle
/// an old job's stale record. Compared as text: a malformed id in a job's arguments matches
/// nothing instead of failing the statement.
///
/// The records are found by their link (`analyses_job`, `specviews_job`) and each job by its
/// primary key in a scalar subquery, never joined: a completion's statements are planned
/// generically (ADR 0014) and kept until an `ANALYZE`, and a join of the jobs planned while the
/// tables were nearly empty hashed a scan of both tables for every batch.
fn records_of_jobs(table: &str) -> String {
    let id_argument = if table == "specviews" {
        "specview_id"
    } else {
        "analysis_id"
    };
    format!(
        "r.job_id = ANY($1) AND r.id::text = \
         (SELECT j.args ->> '{id_argument}' FROM fairlane_job j WHERE j.id = r.job_id)"
    )
}

/// Puts the `running` records of `table` whose jobs are in `$1` back to `pending`.
fn waiting_statement(table: &str) -> String {
    format!(
        "UPDATE {table} r SET state = 'pending', updated_at = now() \
         WHERE {} AND r.state = 'running'",
        records_of_jobs(table)
    )
}

/// Fails the `pending`/`running` records of `table` whose jobs are in `$1`.
fn fail_statement(table: &str, cleared: &str) -> String {
    format!(
        "UPDATE {table} r SET state = 'failed', {cleared}, updated_at = now(), \
                error = (SELECT {FAILURE_MESSAGE} FROM fairlane_job j WHERE j.id = r.job_id) \
         WHERE {} AND r.state IN ('pending', 'running')",
        records_of_jobs(table)
    )
}

/// Why a completion is refused when its record was never given a result (a handler must stage
/// before succeeding).
const NO_RESULT: &str = "the job succeeded without storing a result";

/// The `pending`/`running` analyses whose jobs are in `$1`, locked in id order: id, repository,
/// commit, whether a result was staged.
fn completing_analyses_statement() -> String {
    format!(
        "SELECT r.id, r.repository, r.commit, r.result IS NOT NULL \
         FROM analyses r \
         WHERE {} AND r.state IN ('pending', 'running') \
         ORDER BY r.id FOR UPDATE OF r",
        records_of_jobs("analyses")
    )
}

async fn complete_analyses(conn: &mut PgConnection, jobs: &[JobId]) -> Result<(), SettleError> {
    let rows: Vec<(Uuid, String, Option<String>, bool)> =
        sqlx::query_as(sqlx::AssertSqlSafe(completing_analyses_statement()))
            .bind(jobs)
            .fetch_all(&mut *conn)
            .await?;
    let mut broken: Vec<Uuid> = Vec::new();
    let mut ready: Vec<(Uuid, String, String)> = Vec::new();
    for (id, repository, commit, has_result) in rows {
        match commit {
            Some(commit) if has_result => ready.push((id, repository, commit)),
            _ => broken.push(id),
        }
    }
    if !broken.is_empty() {
        return Err(SettleError::NoResult {
            table: "analyses",
            records: broken,
        });
    }
    // One original per (repository, commit): completions of the same commit take turns, in a
    // fixed key order so that two batches cannot deadlock.
    let keys: BTreeSet<String> = ready
        .iter()
        .map(|(_, repository, commit)| format!("fairlane-analysis-cache:{repository} {commit}"))
        .collect();
    for key in &keys {
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
            .bind(key)
            .execute(&mut *conn)
            .await?;
    }
    for (id, _, _) in &ready {
        sqlx::query(
            "UPDATE analyses a SET state = 'completed', completed_at = now(), updated_at = now(), \
                    error = NULL, \
                    cached_from = (SELECT o.id FROM analyses o \
                                   WHERE o.repository = a.repository AND o.commit = a.commit \
                                     AND o.state = 'completed' AND o.cached_from IS NULL \
                                     AND o.id <> a.id \
                                   LIMIT 1) \
             WHERE a.id = $1",
        )
        .bind(id)
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

/// The `pending`/`running` specviews whose jobs are in `$1` and which lack a staged result or
/// Markdown, in id order.
fn unstaged_specviews_statement() -> String {
    format!(
        "SELECT r.id FROM specviews r \
         WHERE {} AND r.state IN ('pending', 'running') \
           AND (r.result IS NULL OR r.markdown IS NULL) \
         ORDER BY r.id",
        records_of_jobs("specviews")
    )
}

/// Completes the `pending`/`running` specviews whose jobs are in `$1`.
fn complete_specviews_statement() -> String {
    format!(
        "UPDATE specviews r SET state = 'completed', completed_at = now(), error = NULL, \
                updated_at = now() \
         WHERE {} AND r.state IN ('pending', 'running')",
        records_of_jobs("specviews")
    )
}

async fn complete_specviews(conn: &mut PgConnection, jobs: &[JobId]) -> Result<(), SettleError> {
    let broken: Vec<Uuid> = sqlx::query_scalar(sqlx::AssertSqlSafe(unstaged_specviews_statement()))
        .bind(jobs)
        .fetch_all(&mut *conn)
        .await?;
    if !broken.is_empty() {
        return Err(SettleError::NoResult {
            table: "specviews",
            records: broken,
        });
    }
    sqlx::query(sqlx::AssertSqlSafe(complete_specviews_statement()))
        .bind(jobs)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use testkit::TestDb;
    use testkit::plan::{generic_plan, plan_nodes};

    /// Every statement the hook runs for a batch of job ids.
    fn statements() -> Vec<String> {
        let mut all = vec![
            completing_analyses_statement(),
            unstaged_specviews_statement(),
            complete_specviews_statement(),
        ];
        for table in ["analyses", "specviews"] {
            all.push(waiting_statement(table));
        }
        all.push(fail_statement("analyses", "result = NULL"));
        all.push(fail_statement(
            "specviews",
            "result = NULL, markdown = NULL",
        ));
        all
    }

    /// Workers plan a completion's statements generically (ADR 0014), and keep a plan until an
    /// `ANALYZE`: on a database fresh from its migrations, each must still find its records by
    /// their job's id and its jobs by primary key, never by reading a table whole.
    #[tokio::test]
    async fn a_generic_plan_made_on_a_fresh_database_probes_by_key() {
        let db = TestDb::new().await;
        for statement in statements() {
            let plan = generic_plan(&db, &statement, "'{1,2}'").await;
            for node in plan_nodes(&plan) {
                assert_ne!(
                    node["Node Type"], "Seq Scan",
                    "{statement}\nreads {} whole: {plan:#}",
                    node["Relation Name"]
                );
                assert_ne!(node["Node Type"], "Hash Join", "{statement}\n{plan:#}");
            }
            // Each job by its primary key.
            assert!(
                plan_nodes(&plan)
                    .iter()
                    .any(|n| n["Index Name"] == "fairlane_job_pkey"),
                "{statement}\n{plan:#}"
            );
        }
    }
}
