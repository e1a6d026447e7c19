//! The record life cycle against real PostgreSQL: claim, stage, and the hook settling records
//! with their job's final state (completion, copies of an existing original, handler cancel,
//! user cancel, attempts running out, a rescue after a crash), including two completions of the
//! same commit at once.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use common::{Service, Tier, select_queue};
use queue::{JobState, NewJob, Transition, TransitionHook};
use records::{RecordHook, Refusal, WorkState, analyses, specviews};
use serde_json::{Value, json};
use sqlx::PgPool;
use testkit::TestDb;
use uuid::Uuid;

const REPO: &str = "https://example.com/org/repo.git";

fn sha(n: u64) -> String {
    format!("{n:040x}")
}

async fn user(pool: &PgPool) -> Uuid {
    sqlx::query_scalar("INSERT INTO users (name, tier) VALUES ('u', 'pro') RETURNING id")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A running job of `kind` (attempt 1 of `max_attempts`, run by a worker that does not exist).
async fn running_job(pool: &PgPool, kind: &str, max_attempts: i16) -> i64 {
    let service = if kind == "analysis" {
        Service::Analysis
    } else {
        Service::Specview
    };
    let job = NewJob::from_json(kind, select_queue(service, Tier::Pro, false), json!({}))
        .unwrap()
        .max_attempts(max_attempts);
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::insert::insert(&mut conn, job).await.unwrap().job.id;
    sqlx::query(
        "UPDATE fairlane_job SET state = 'running', attempt = 1, \
         attempted_at = now() - interval '1 minute', attempted_by = ARRAY['gone-worker'] \
         WHERE id = $1",
    )
    .bind(id)
    .execute(pool)
    .await
    .unwrap();
    id
}

async fn analysis(pool: &PgPool, user: Option<Uuid>, commit: Option<&str>, job: i64) -> Uuid {
    // The job's arguments name the record, as every job the services enqueue does.
    sqlx::query_scalar(
        "WITH r AS (INSERT INTO analyses (user_id, repository, commit, job_id) \
                    VALUES ($1, $2, $3, $4) RETURNING id), \
              j AS (UPDATE fairlane_job \
                    SET args = args || jsonb_build_object('analysis_id', (SELECT id FROM r)) \
                    WHERE id = $4) \
         SELECT id FROM r",
    )
    .bind(user)
    .bind(REPO)
    .bind(commit)
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A specview record of `user` from `analysis`, filled by `job`, whose arguments name it.
async fn specview(pool: &PgPool, user: Uuid, analysis: Uuid, job: i64) -> Uuid {
    sqlx::query_scalar(
        "WITH r AS (INSERT INTO specviews (user_id, analysis_id, job_id) \
                    VALUES ($1, $2, $3) RETURNING id), \
              j AS (UPDATE fairlane_job \
                    SET args = args || jsonb_build_object('specview_id', (SELECT id FROM r)) \
                    WHERE id = $3) \
         SELECT id FROM r",
    )
    .bind(user)
    .bind(analysis)
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Moves the job to `state` the way the queue does (with `metadata`/`errors` as given) and runs
/// the hook in the same transaction.
async fn finish(pool: &PgPool, job: i64, state: JobState, metadata: Value, errors: Value) {
    let mut tx = pool.begin().await.unwrap();
    let t: Transition = sqlx::query_as(
        "UPDATE fairlane_job SET state = $2, \
                finalized_at = CASE WHEN $2 IN ('completed', 'cancelled', 'discarded') \
                                    THEN now() END, \
                metadata = metadata || $3, errors = $4 \
         WHERE id = $1 RETURNING id, queue, kind, user_id, state",
    )
    .bind(job)
    .bind(state)
    .bind(metadata)
    .bind(errors)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    RecordHook::new()
        .on_transitions(&mut tx, &[t])
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

#[derive(Debug, PartialEq)]
struct Row {
    state: WorkState,
    commit: Option<String>,
    cached_from: Option<Uuid>,
    error: Option<String>,
    has_result: bool,
    completed: bool,
}

async fn row(pool: &PgPool, id: Uuid) -> Row {
    let (state, commit, cached_from, error, has_result, completed): (
        WorkState,
        Option<String>,
        Option<Uuid>,
        Option<String>,
        bool,
        bool,
    ) = sqlx::query_as(
        "SELECT state, commit, cached_from, error, result IS NOT NULL, completed_at IS NOT NULL \
         FROM analyses WHERE id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap();
    Row {
        state,
        commit,
        cached_from,
        error,
        has_result,
        completed,
    }
}

#[tokio::test]
async fn a_completed_job_completes_its_staged_analysis_and_a_second_original_becomes_a_copy() {
    let db = TestDb::new().await;
    let u = user(&db.pool).await;
    let first_job = running_job(&db.pool, "analysis", 3).await;
    let first = analysis(&db.pool, Some(u), Some(&sha(1)), first_job).await;

    let claimed = analyses::claim(&db.pool, first, first_job)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(claimed.state, WorkState::Running);
    assert_eq!(claimed.commit.as_deref(), Some(sha(1).as_str()));
    // Another job may not claim it, and a different commit may not be staged on a user's record.
    assert_eq!(
        analyses::claim(&db.pool, first, first_job + 1000)
            .await
            .unwrap(),
        Err(Refusal::OtherJob(first_job))
    );
    assert!(
        !analyses::stage(
            &db.pool,
            first,
            first_job,
            &sha(2),
            &json!({"n": 1}).to_string()
        )
        .await
        .unwrap()
    );
    assert!(
        analyses::stage(
            &db.pool,
            first,
            first_job,
            &sha(1),
            &json!({"n": 1}).to_string()
        )
        .await
        .unwrap()
    );
    // Staged is not completed: the record waits for its job.
    let staged = row(&db.pool, first).await;
    assert_eq!(
        (staged.state, staged.has_result, staged.completed),
        (WorkState::Running, true, false)
    );

    finish(
        &db.pool,
        first_job,
        JobState::Completed,
        json!({}),
        json!([]),
    )
    .await;
    let done = row(&db.pool, first).await;
    assert_eq!(
        done,
        Row {
            state: WorkState::Completed,
            commit: Some(sha(1)),
            cached_from: None,
            error: None,
            has_result: true,
            completed: true,
        }
    );

    // Another user asked before the first finished: their job completes the same commit.
    let v = user(&db.pool).await;
    let second_job = running_job(&db.pool, "analysis", 3).await;
    let second = analysis(&db.pool, Some(v), Some(&sha(1)), second_job).await;
    analyses::claim(&db.pool, second, second_job)
        .await
        .unwrap()
        .unwrap();
    assert!(
        analyses::stage(
            &db.pool,
            second,
            second_job,
            &sha(1),
            &json!({"n": 1}).to_string()
        )
        .await
        .unwrap()
    );
    finish(
        &db.pool,
        second_job,
        JobState::Completed,
        json!({}),
        json!([]),
    )
    .await;
    let copy = row(&db.pool, second).await;
    assert_eq!(
        (copy.state, copy.cached_from),
        (WorkState::Completed, Some(first))
    );
    // Finished records are not claimed again.
    assert_eq!(
        analyses::claim(&db.pool, first, first_job).await.unwrap(),
        Err(Refusal::Finished(WorkState::Completed))
    );
    assert_eq!(
        analyses::claim(&db.pool, Uuid::new_v4(), first_job)
            .await
            .unwrap(),
        Err(Refusal::Missing)
    );
}

#[tokio::test]
async fn a_system_analysis_stores_the_commit_it_resolved() {
    let db = TestDb::new().await;
    let job = running_job(&db.pool, "analysis", 3).await;
    let id = analysis(&db.pool, None, None, job).await;
    let claimed = analyses::claim(&db.pool, id, job).await.unwrap().unwrap();
    assert_eq!((claimed.user_id, claimed.commit), (None, None));
    assert!(
        analyses::stage(&db.pool, id, job, &sha(9), &json!({}).to_string())
            .await
            .unwrap()
    );
    // A retry resolved the branch again, and it had moved: the newer commit is the one kept.
    assert!(
        analyses::stage(&db.pool, id, job, &sha(10), &json!({}).to_string())
            .await
            .unwrap()
    );
    finish(&db.pool, job, JobState::Completed, json!({}), json!([])).await;
    let done = row(&db.pool, id).await;
    assert_eq!(
        (done.state, done.commit),
        (WorkState::Completed, Some(sha(10)))
    );
}

/// A record whose job goes back to waiting (a failed attempt with a retry to come, a rescue, a
/// hand-back, a snooze) is `pending` again, not `running` for the hours its retry may wait; the
/// next attempt claims it as the first did.
#[tokio::test]
async fn a_record_whose_job_waits_again_is_pending_until_the_next_attempt_claims_it() {
    let db = TestDb::new().await;
    let u = user(&db.pool).await;
    for (n, waiting) in [
        JobState::Retryable,
        JobState::Available,
        JobState::Scheduled,
    ]
    .into_iter()
    .enumerate()
    {
        let job = running_job(&db.pool, "analysis", 3).await;
        let id = analysis(&db.pool, Some(u), Some(&sha(900 + n as u64)), job).await;
        analyses::claim(&db.pool, id, job).await.unwrap().unwrap();
        assert_eq!(row(&db.pool, id).await.state, WorkState::Running);
        finish(&db.pool, job, waiting, json!({}), json!([])).await;
        assert_eq!(
            row(&db.pool, id).await.state,
            WorkState::Pending,
            "{waiting:?}"
        );
        analyses::claim(&db.pool, id, job).await.unwrap().unwrap();
        assert_eq!(row(&db.pool, id).await.state, WorkState::Running);
    }
}

/// Job ids are not unique over time: after `fairlane_job` is restored apart from the records, a
/// new job can take the id a stale record still links to. Its completion settles its own record
/// (the one its arguments name), not the stale one, which used to refuse the completion for
/// want of a result, and its failure fails only its own.
#[tokio::test]
async fn a_job_settles_only_the_record_its_arguments_name() {
    let db = TestDb::new().await;
    let u = user(&db.pool).await;
    for end in [JobState::Completed, JobState::Discarded] {
        let job = running_job(&db.pool, "analysis", 3).await;
        // A record left by a job of the same id before the restore.
        let stale: Uuid = sqlx::query_scalar(
            "INSERT INTO analyses (user_id, repository, commit, job_id) \
             VALUES ($1, $2, $3, $4) RETURNING id",
        )
        .bind(u)
        .bind(REPO)
        .bind(sha(700))
        .bind(job)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        let own = analysis(&db.pool, Some(u), Some(&sha(701)), job).await;
        analyses::claim(&db.pool, own, job).await.unwrap().unwrap();
        analyses::stage(&db.pool, own, job, &sha(701), &json!({}).to_string())
            .await
            .unwrap();
        finish(&db.pool, job, end, json!({}), json!([])).await;
        let expected = if end == JobState::Completed {
            WorkState::Completed
        } else {
            WorkState::Failed
        };
        assert_eq!(row(&db.pool, own).await.state, expected);
        assert_eq!(row(&db.pool, stale).await.state, WorkState::Pending);
    }
}

#[tokio::test]
async fn jobs_that_end_without_success_fail_their_records_with_the_reason() {
    let db = TestDb::new().await;
    let u = user(&db.pool).await;
    let error = |n: i16, text: &str| json!({"attempt": n, "at": "2026-01-01T00:00:00Z", "kind": "error", "error": text});

    // The handler gave up for good: its reason.
    let job = running_job(&db.pool, "analysis", 3).await;
    let id = analysis(&db.pool, Some(u), Some(&sha(1)), job).await;
    analyses::claim(&db.pool, id, job).await.unwrap().unwrap();
    analyses::stage(&db.pool, id, job, &sha(1), &json!({}).to_string())
        .await
        .unwrap();
    let reason = "the repository is too large: more than 1024 bytes while fetching";
    finish(
        &db.pool,
        job,
        JobState::Cancelled,
        json!({"cancel_reason": reason}),
        json!([]),
    )
    .await;
    let r = row(&db.pool, id).await;
    assert_eq!(
        (r.state, r.error.as_deref(), r.has_result),
        (WorkState::Failed, Some(reason), false)
    );

    // The user cancelled it while it ran.
    let job = running_job(&db.pool, "analysis", 3).await;
    let id = analysis(&db.pool, Some(u), Some(&sha(2)), job).await;
    finish(
        &db.pool,
        job,
        JobState::Cancelled,
        json!({"cancel_attempted_at": "2026-01-01T00:00:00Z", "cancel_reason": "cancelled while running"}),
        json!([]),
    )
    .await;
    assert_eq!(
        row(&db.pool, id).await.error.as_deref(),
        Some("cancelled by the user")
    );

    // Attempts ran out: the last error, with the count.
    let job = running_job(&db.pool, "analysis", 3).await;
    sqlx::query("UPDATE fairlane_job SET attempt = 3 WHERE id = $1")
        .bind(job)
        .execute(&db.pool)
        .await
        .unwrap();
    let id = analysis(&db.pool, Some(u), Some(&sha(3)), job).await;
    finish(
        &db.pool,
        job,
        JobState::Discarded,
        json!({}),
        json!([
            error(1, "first"),
            error(2, "second"),
            error(3, "host unreachable")
        ]),
    )
    .await;
    assert_eq!(
        row(&db.pool, id).await.error.as_deref(),
        Some("failed after 3 attempts: host unreachable")
    );

    // A completed record is never turned into a failure by a late hook call.
    let job = running_job(&db.pool, "analysis", 3).await;
    let id = analysis(&db.pool, Some(u), Some(&sha(4)), job).await;
    analyses::claim(&db.pool, id, job).await.unwrap().unwrap();
    analyses::stage(&db.pool, id, job, &sha(4), &json!({}).to_string())
        .await
        .unwrap();
    finish(&db.pool, job, JobState::Completed, json!({}), json!([])).await;
    let t = Transition {
        job_id: job,
        queue: "analysis_priority".into(),
        kind: "analysis".into(),
        user_id: Some(u),
        state: JobState::Cancelled,
    };
    let mut conn = db.pool.acquire().await.unwrap();
    records::settle(&mut conn, &[t]).await.unwrap();
    assert_eq!(row(&db.pool, id).await.state, WorkState::Completed);

    // A completion without a staged result is refused, not turned into an empty success.
    let job = running_job(&db.pool, "analysis", 3).await;
    let id = analysis(&db.pool, Some(u), Some(&sha(5)), job).await;
    analyses::claim(&db.pool, id, job).await.unwrap().unwrap();
    let refused = settle_completion(&db.pool, job, "analysis").await;
    assert!(
        matches!(&refused, records::SettleError::NoResult { table: "analyses", records } if records == &[id]),
        "{refused:?}"
    );
    assert_eq!(row(&db.pool, id).await.state, WorkState::Running);
}

/// Runs the hook for `job` completing, as the queue would, and returns the refusal it must give.
async fn settle_completion(pool: &PgPool, job: i64, kind: &str) -> records::SettleError {
    let t = Transition {
        job_id: job,
        queue: "q".into(),
        kind: kind.into(),
        user_id: None,
        state: JobState::Completed,
    };
    let mut tx = pool.begin().await.unwrap();
    let refused = records::settle(&mut tx, &[t]).await.unwrap_err();
    tx.rollback().await.unwrap();
    refused
}

#[tokio::test]
async fn a_crashed_job_out_of_attempts_fails_its_record_through_the_rescuer() {
    let db = TestDb::new().await;
    let u = user(&db.pool).await;
    let last_try = running_job(&db.pool, "analysis", 1).await;
    let failed = analysis(&db.pool, Some(u), Some(&sha(1)), last_try).await;
    analyses::claim(&db.pool, failed, last_try)
        .await
        .unwrap()
        .unwrap();
    let retried_job = running_job(&db.pool, "analysis", 3).await;
    let retried = analysis(&db.pool, Some(u), Some(&sha(2)), retried_job).await;
    analyses::claim(&db.pool, retried, retried_job)
        .await
        .unwrap()
        .unwrap();

    let hooks: Vec<Arc<dyn TransitionHook>> = vec![Arc::new(RecordHook::new())];
    let waker = queue::wake::Waker::new(db.pool.clone());
    let rescued =
        queue::maintenance::rescue_dead_workers(&db.pool, &hooks, &waker, Duration::from_secs(1))
            .await
            .unwrap();
    assert_eq!(rescued.len(), 2);
    let r = row(&db.pool, failed).await;
    assert_eq!(r.state, WorkState::Failed);
    assert_eq!(
        r.error.as_deref(),
        Some("failed after 1 attempt: the worker running it stopped heartbeating; job rescued")
    );
    // The other job runs again: its record waits with it, pending until the next attempt.
    assert_eq!(row(&db.pool, retried).await.state, WorkState::Pending);
}

#[tokio::test]
async fn heavy_concurrent_completions_of_one_commit_leave_one_original() {
    let db = TestDb::new().await;
    for round in 0..10u64 {
        let mut ids = Vec::new();
        let mut jobs = Vec::new();
        for _ in 0..4 {
            let u = user(&db.pool).await;
            let job = running_job(&db.pool, "analysis", 3).await;
            let id = analysis(&db.pool, Some(u), Some(&sha(round)), job).await;
            analyses::claim(&db.pool, id, job).await.unwrap().unwrap();
            analyses::stage(&db.pool, id, job, &sha(round), &json!({}).to_string())
                .await
                .unwrap();
            ids.push(id);
            jobs.push(job);
        }
        let tasks: Vec<_> = jobs
            .iter()
            .map(|&job| {
                let pool = db.pool.clone();
                tokio::spawn(async move {
                    finish(&pool, job, JobState::Completed, json!({}), json!([])).await;
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let (originals, copies): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE cached_from IS NULL), \
                    count(*) FILTER (WHERE cached_from IS NOT NULL) \
             FROM analyses WHERE id = ANY($1) AND state = 'completed'",
        )
        .bind(&ids)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!((originals, copies), (1, 3), "round {round}");
    }
}

#[tokio::test]
async fn specview_records_follow_their_jobs() {
    let db = TestDb::new().await;
    let u = user(&db.pool).await;
    let analysis_job = running_job(&db.pool, "analysis", 3).await;
    let analysis_id = analysis(&db.pool, Some(u), Some(&sha(1)), analysis_job).await;
    let job = running_job(&db.pool, "specview", 3).await;
    let id = specview(&db.pool, u, analysis_id, job).await;
    // The analysis is not completed yet: its result is not handed out.
    let claimed = specviews::claim(&db.pool, id, job).await.unwrap().unwrap();
    assert_eq!(claimed.analysis_state, WorkState::Pending);
    assert_eq!(claimed.analysis_result, None);

    analyses::claim(&db.pool, analysis_id, analysis_job)
        .await
        .unwrap()
        .unwrap();
    analyses::stage(
        &db.pool,
        analysis_id,
        analysis_job,
        &sha(1),
        &json!({"inventory": 1}).to_string(),
    )
    .await
    .unwrap();
    finish(
        &db.pool,
        analysis_job,
        JobState::Completed,
        json!({}),
        json!([]),
    )
    .await;
    let claimed = specviews::claim(&db.pool, id, job).await.unwrap().unwrap();
    assert_eq!(claimed.analysis_state, WorkState::Completed);
    let result: Option<Value> = claimed
        .analysis_result
        .as_deref()
        .map(|text| serde_json::from_str(text).unwrap());
    assert_eq!(result, Some(json!({"inventory": 1})));
    assert_eq!(claimed.repository, REPO);
    assert!(
        specviews::stage(
            &db.pool,
            id,
            job,
            &json!({"files": []}).to_string(),
            "# Spec\n"
        )
        .await
        .unwrap()
    );
    finish(&db.pool, job, JobState::Completed, json!({}), json!([])).await;
    let (state, markdown, completed): (WorkState, Option<String>, bool) = sqlx::query_as(
        "SELECT state, markdown, completed_at IS NOT NULL FROM specviews WHERE id = $1",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (state, markdown.as_deref(), completed),
        (WorkState::Completed, Some("# Spec\n"), true)
    );

    let job = running_job(&db.pool, "specview", 3).await;
    let id = specview(&db.pool, u, analysis_id, job).await;
    specviews::claim(&db.pool, id, job).await.unwrap().unwrap();
    specviews::stage(&db.pool, id, job, &json!({}).to_string(), "# Spec\n")
        .await
        .unwrap();
    finish(
        &db.pool,
        job,
        JobState::Cancelled,
        json!({"cancel_reason": "analysis result unreadable"}),
        json!([]),
    )
    .await;
    let (state, markdown, error): (WorkState, Option<String>, Option<String>) =
        sqlx::query_as("SELECT state, markdown, error FROM specviews WHERE id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (state, markdown, error.as_deref()),
        (WorkState::Failed, None, Some("analysis result unreadable"))
    );

    // A specview completed without its Markdown is refused, like an analysis without a result.
    let job = running_job(&db.pool, "specview", 3).await;
    let id = specview(&db.pool, u, analysis_id, job).await;
    specviews::claim(&db.pool, id, job).await.unwrap().unwrap();
    let refused = settle_completion(&db.pool, job, "specview").await;
    assert!(
        matches!(&refused, records::SettleError::NoResult { table: "specviews", records } if records == &[id]),
        "{refused:?}"
    );
}

/// A handler that succeeds without staging its result, run by a real engine with both hooks (as
/// the worker services register them): the user is never billed for the empty record. Each
/// attempt's end is refused and recorded as a failure; when attempts run out the job is
/// discarded, the record fails with the reason, and the reservation is released unbilled.
#[tokio::test]
async fn a_job_that_succeeds_without_a_result_is_not_billed_and_fails_its_record() {
    use queue::{Client, Engine, EngineConfig, RetryPolicy, Workers};

    let db = TestDb::new().await;
    let u = user(&db.pool).await;
    let client = Client::new(db.pool.clone()).with_hooks(vec![
        Arc::new(quota::QuotaHook::new()),
        Arc::new(RecordHook::new()),
    ]);
    let quota = quota::Quota::new(quota::QuotaConfig::default()).unwrap();
    let queue = select_queue(Service::Analysis, Tier::Pro, false);
    let mut tx = db.pool.begin().await.unwrap();
    let grant = quota
        .check(&mut tx, u, Service::Analysis, chrono::Utc::now())
        .await
        .unwrap();
    let analysis_id: Uuid = sqlx::query_scalar(
        "INSERT INTO analyses (user_id, repository, commit) VALUES ($1, $2, $3) RETURNING id",
    )
    .bind(u)
    .bind(REPO)
    .bind(sha(9))
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    let args = common::AnalysisArgs {
        user_id: Some(u),
        analysis_id,
        repository: REPO.into(),
        git_ref: None,
    };
    let job = queue::insert::insert(
        &mut tx,
        NewJob::new(queue.clone(), &args).unwrap().max_attempts(2),
    )
    .await
    .unwrap()
    .job;
    sqlx::query("UPDATE analyses SET job_id = $2 WHERE id = $1")
        .bind(analysis_id)
        .bind(job.id)
        .execute(&mut *tx)
        .await
        .unwrap();
    grant.reserve(&mut tx, Some(job.id)).await.unwrap();
    tx.commit().await.unwrap();

    let mut workers = Workers::new();
    {
        let pool = db.pool.clone();
        workers.register_fn::<common::AnalysisArgs, _, _>(move |job, args| {
            let pool = pool.clone();
            async move {
                // Claims the record and succeeds: the result is never stored.
                analyses::claim(&pool, args.analysis_id, job.id())
                    .await?
                    .map_err(|r| queue::JobError::msg(format!("record {r}")))?;
                Ok(())
            }
        });
    }
    let config = EngineConfig {
        poll_interval: Duration::from_millis(100),
        retry: RetryPolicy {
            base: Duration::from_millis(10),
            factor: 2.0,
            max: Duration::from_millis(100),
            jitter: 0.1,
        },
        ..EngineConfig::default()
    };
    let engine = Engine::builder(client.clone())
        .name("records-test")
        .config(config)
        .workers(workers)
        .queue(queue, 2)
        .build()
        .unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(engine.run(shutdown.clone()));
    let discarded = testkit::eventually(Duration::from_secs(30), "the job discarded", || async {
        let j = client.job(job.id).await.unwrap().unwrap();
        (j.state == JobState::Discarded).then_some(j)
    })
    .await;
    shutdown.cancel();
    running.await.unwrap().unwrap();

    let errors = discarded.attempt_errors();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(
        errors[1]
            .error
            .contains("the job succeeded without storing a result"),
        "{}",
        errors[1].error
    );
    let r = row(&db.pool, analysis_id).await;
    assert_eq!(r.state, WorkState::Failed);
    assert!(
        r.error
            .as_deref()
            .is_some_and(|e| e.starts_with("failed after 2 attempts: ")
                && e.contains("without storing a result")),
        "{:?}",
        r.error
    );
    let (billed, reserved): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM usage_events), (SELECT count(*) FROM quota_reservations)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (billed, reserved),
        (0, 0),
        "nothing billed, nothing left reserved"
    );
}

/// A result the database refuses (a `\u0000` that `jsonb` cannot hold) cancels the job instead of
/// being retried; a lost connection is retried.
#[tokio::test]
async fn a_result_the_database_refuses_cancels_the_job_and_a_lost_connection_retries_it() {
    let db = TestDb::new().await;
    let u = user(&db.pool).await;
    let job = running_job(&db.pool, "analysis", 3).await;
    let id = analysis(&db.pool, Some(u), Some(&sha(1)), job).await;
    analyses::claim(&db.pool, id, job).await.unwrap().unwrap();
    let refused = analyses::stage(
        &db.pool,
        id,
        job,
        &sha(1),
        &json!({"test": "a\u{0}b"}).to_string(),
    )
    .await
    .unwrap_err();
    match records::stage_failure(refused) {
        queue::JobError::Cancel(reason) => assert!(
            reason.starts_with("the database refuses this result: "),
            "{reason}"
        ),
        other => panic!("expected a cancel, got {other:?}"),
    }
    assert!(!row(&db.pool, id).await.has_result, "nothing was stored");

    let closed = PgPool::connect(&db.url()).await.unwrap();
    closed.close().await;
    let lost = analyses::stage(&closed, id, job, &sha(1), &json!({}).to_string())
        .await
        .unwrap_err();
    assert!(
        matches!(records::stage_failure(lost), queue::JobError::Failed(_)),
        "a lost connection is retried"
    );
}

/// A specview made outside the API (which only creates them for the caller's own analyses)
/// never renders another user's analysis: its claim is refused.
#[tokio::test]
async fn a_specview_of_another_users_analysis_is_refused() {
    let db = TestDb::new().await;
    let owner = user(&db.pool).await;
    let other = user(&db.pool).await;
    let analysis_job = running_job(&db.pool, "analysis", 3).await;
    let analysis_id = analysis(&db.pool, Some(owner), Some(&sha(1)), analysis_job).await;
    let job = running_job(&db.pool, "specview", 3).await;
    let id = specview(&db.pool, other, analysis_id, job).await;
    let refused = specviews::claim(&db.pool, id, job).await.unwrap();
    assert_eq!(refused.unwrap_err(), Refusal::OtherUsersAnalysis);
    let state: WorkState = sqlx::query_scalar("SELECT state FROM specviews WHERE id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(state, WorkState::Pending, "not claimed");
}

/// The process's resident memory now (`VmRSS`), in bytes.
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .map(|v| v.trim().parse().unwrap())
        .unwrap();
    kib * 1024
}

/// Four connections that each staged a 40 MB inventory, and then read it back for a specview,
/// keep none of that memory: sqlx kept a connection's buffers at the largest message they had
/// held, so a worker's pool came to hold tens of megabytes per connection for good (160 MB here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_carried_a_large_result_give_its_memory_back() {
    let db = TestDb::new().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&db.url())
        .await
        .unwrap();
    let owner = user(&db.pool).await;
    let mut records = Vec::new();
    for n in 0..4u64 {
        let job = running_job(&db.pool, "analysis", 3).await;
        let commit = sha(900 + n);
        let id = analysis(&db.pool, Some(owner), Some(&commit), job).await;
        analyses::claim(&db.pool, id, job).await.unwrap().unwrap();
        records.push((id, job, commit));
    }
    let large = json!({"tests": "x".repeat(40 << 20)}).to_string();
    let before = resident_bytes();
    // At once, so that each takes a connection of its own.
    let staged = futures_util::future::join_all(
        records
            .iter()
            .map(|(id, job, commit)| analyses::stage(&pool, *id, *job, commit, &large)),
    )
    .await;
    assert!(staged.into_iter().all(|s| s.unwrap()));
    let after_writes = resident_bytes().saturating_sub(before);
    for (id, job, _) in &records {
        sqlx::query("UPDATE analyses SET state = 'completed', completed_at = now() WHERE id = $1")
            .bind(id)
            .execute(&db.pool)
            .await
            .unwrap();
        sqlx::query(
            "UPDATE fairlane_job SET state = 'completed', finalized_at = now() WHERE id = $1",
        )
        .bind(job)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let mut claims = Vec::new();
    for (id, _, _) in &records {
        let job = running_job(&db.pool, "specview", 3).await;
        claims.push((specview(&db.pool, owner, *id, job).await, job));
    }
    let claimed = futures_util::future::join_all(
        claims
            .iter()
            .map(|(specview, job)| specviews::claim(&pool, *specview, *job)),
    )
    .await;
    for claim in claimed {
        let record = claim.unwrap().unwrap();
        // As jsonb prints it: `{"tests": "x…"}`, a space after the colon.
        assert_eq!(
            record.analysis_result.map(|r| r.len()),
            Some(large.len() + 1)
        );
    }
    let after_reads = resident_bytes().saturating_sub(before);
    eprintln!(
        "resident memory grew by {} MB after the writes, {} MB after the reads",
        after_writes >> 20,
        after_reads >> 20
    );
    assert!(
        after_writes < 80 << 20,
        "{after_writes} bytes kept after the writes"
    );
    assert!(
        after_reads < 80 << 20,
        "{after_reads} bytes kept after the reads"
    );
}

/// Work on a large value cut short (a request's timeout, a cancelled job) closes its connection
/// rather than pooling it: sqlx would read the rest of the message and pool the connection with
/// its buffers grown.
#[tokio::test]
async fn a_large_read_cut_short_closes_its_connection() {
    let db = TestDb::new().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url())
        .await
        .unwrap();
    let (pid_tx, pid_rx) = tokio::sync::oneshot::channel();
    let cut = tokio::time::timeout(
        Duration::from_millis(300),
        records::with_buffers_given_back(&pool, async |conn| {
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *conn)
                .await?;
            let _ = pid_tx.send(pid);
            sqlx::query("SELECT pg_sleep(30)")
                .execute(&mut *conn)
                .await?;
            Ok(())
        }),
    )
    .await;
    assert!(cut.is_err(), "the work was not cut short");
    let first = pid_rx.await.unwrap();
    let started = std::time::Instant::now();
    let next: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_ne!(next, first, "the cut connection went back to the pool");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}
