//! The queue with real worker processes: many at once, `kill -9`, SIGTERM.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use queue::{Client, EngineConfig, JobState, NewJob, QueueName, RetryPolicy};
use testkit::TestDb;
use testkit::process::ChildProcess;

/// One row of `test_runs`: job, attempt, worker, started, finished.
type RunRow = (
    i64,
    i32,
    String,
    chrono::DateTime<chrono::Utc>,
    Option<chrono::DateTime<chrono::Utc>>,
);

const WORKER: &str = env!("CARGO_BIN_EXE_fairlane-testworker");

fn engine(overrides: impl FnOnce(&mut EngineConfig)) -> String {
    let mut c = EngineConfig {
        poll_interval: Duration::from_millis(500),
        heartbeat_interval: Duration::from_millis(300),
        rescue_after: Duration::from_secs(2),
        orphan_grace: Duration::from_secs(1),
        promote_interval: Duration::from_millis(100),
        rescue_interval: Duration::from_millis(300),
        leader_ttl: Duration::from_secs(1),
        cancel_grace: Duration::from_millis(300),
        shutdown_timeout: Duration::from_secs(2),
        retry: RetryPolicy {
            base: Duration::from_millis(20),
            ..RetryPolicy::default()
        },
        ..EngineConfig::default()
    };
    overrides(&mut c);
    serde_json::to_string(&c).unwrap()
}

fn spawn_worker(db: &TestDb, name: &str, queues: &str, engine: &str) -> ChildProcess {
    ChildProcess::spawn(
        name,
        WORKER,
        &[],
        &[
            ("DATABASE_URL", db.url()),
            ("TESTWORKER_QUEUES", queues.to_owned()),
            ("TESTWORKER_ENGINE", engine.to_owned()),
            ("TESTWORKER_NAME", name.to_owned()),
        ],
    )
}

async fn prepare(db: &TestDb) {
    sqlx::query(
        "CREATE TABLE test_runs (id bigserial PRIMARY KEY, job_id bigint NOT NULL, \
         attempt int NOT NULL, worker text NOT NULL, \
         started_at timestamptz NOT NULL DEFAULT clock_timestamp(), finished_at timestamptz)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
}

fn record(sleep_ms: u64, cancellable: bool) -> NewJob {
    NewJob::from_json(
        "record",
        QueueName::new("q").unwrap(),
        serde_json::json!({"sleep_ms": sleep_ms, "cancellable": cancellable}),
    )
    .unwrap()
}

async fn wait_for<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn count(db: &TestDb, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_jobs_on_four_processes_complete_exactly_once() {
    let db = TestDb::new().await;
    prepare(&db).await;
    let client = Client::new(db.pool.clone());
    let jobs: Vec<NewJob> = (0..20_000).map(|_| record(0, false)).collect();
    client.insert_bulk(&jobs).await.unwrap();
    // Liveness as in production (the defaults). With this file's test timings (rescue after
    // 2 s, hand-back after 1 s), a host that stalls the processes for two seconds makes live
    // workers look dead, and their jobs run again: the at-least-once path (ADR 0002), which
    // the kill tests cover. Here no process dies, so every job must run exactly once.
    let defaults = EngineConfig::default();
    let config = engine(|c| {
        c.heartbeat_interval = defaults.heartbeat_interval;
        c.rescue_after = defaults.rescue_after;
        c.rescue_interval = defaults.rescue_interval;
        c.orphan_grace = defaults.orphan_grace;
    });
    let mut workers: Vec<ChildProcess> = (0..4)
        .map(|i| spawn_worker(&db, &format!("w{i}"), "q:25", &config))
        .collect();
    wait_for(
        Duration::from_secs(300),
        "20,000 jobs completed",
        || async {
            count(
                &db,
                "SELECT count(*) FROM fairlane_job WHERE state = 'completed'",
            )
            .await
                == 20_000
        },
    )
    .await;
    for w in &mut workers {
        let status = w.terminate(Duration::from_secs(20)).await;
        assert!(status.success(), "worker exit {status:?}");
    }
    assert_eq!(
        count(&db, "SELECT count(*) FROM fairlane_job").await,
        20_000
    );
    assert_eq!(
        count(&db, "SELECT count(*) FROM test_runs").await,
        20_000,
        "every job ran exactly once"
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(DISTINCT job_id) FROM test_runs WHERE finished_at IS NOT NULL"
        )
        .await,
        20_000
    );
    assert_eq!(
        count(&db, "SELECT count(*) FROM fairlane_job WHERE attempt <> 1").await,
        0,
        "no job needed a second attempt"
    );
    let per_worker: Vec<(String, i64)> =
        sqlx::query_as("SELECT worker, count(*) FROM test_runs GROUP BY worker")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        per_worker.len(),
        4,
        "all four processes worked: {per_worker:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_of_a_killed_worker_complete_on_another_within_the_rescue_time() {
    let db = TestDb::new().await;
    prepare(&db).await;
    let client = Client::new(db.pool.clone());
    let config = engine(|_| {});
    let rescue_budget = {
        let c: EngineConfig = serde_json::from_str(&config).unwrap();
        c.max_rescue_delay()
    };
    let mut victim = spawn_worker(&db, "victim", "q:3", &config);
    // Long enough that the victim cannot finish them before it is killed, however slowly the
    // survivor starts.
    let ids: Vec<i64> = client
        .insert_many((0..3).map(|_| record(10_000, false)).collect())
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.job.id)
        .collect();
    wait_for(
        Duration::from_secs(20),
        "three jobs running on the victim",
        || async { count(&db, "SELECT count(*) FROM test_runs").await == 3 },
    )
    .await;
    let mut survivor = spawn_worker(&db, "survivor", "q:3", &config);
    wait_for(
        Duration::from_secs(20),
        "the survivor registered",
        || async { count(&db, "SELECT count(*) FROM fairlane_worker").await == 2 },
    )
    .await;
    victim.kill_9().await;
    let killed_at = chrono::Utc::now();

    wait_for(
        Duration::from_secs(60),
        "rescued jobs completed",
        || async {
            count(
                &db,
                "SELECT count(*) FROM fairlane_job WHERE state = 'completed'",
            )
            .await
                == 3
        },
    )
    .await;
    let runs: Vec<RunRow> = sqlx::query_as(
        "SELECT job_id, attempt, worker, started_at, finished_at FROM test_runs ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    for id in &ids {
        let job_runs: Vec<_> = runs.iter().filter(|r| r.0 == *id).collect();
        assert_eq!(job_runs.len(), 2, "killed run + rescued run: {job_runs:?}");
        let (first, second) = (job_runs[0], job_runs[1]);
        assert!(
            first.2.starts_with("victim") && first.4.is_none(),
            "{first:?}"
        );
        assert!(
            second.2.starts_with("survivor") && second.4.is_some(),
            "{second:?}"
        );
        assert_eq!(second.1, 2, "the crash cost one attempt");
        let restart_after = (second.3 - killed_at).to_std().unwrap_or_default();
        assert!(
            restart_after <= rescue_budget + Duration::from_secs(1),
            "job {id} restarted {restart_after:?} after the kill; budget {rescue_budget:?}"
        );
        let job = client.job(*id).await.unwrap().unwrap();
        assert_eq!(job.state, JobState::Completed);
    }
    let status = survivor.terminate(Duration::from_secs(20)).await;
    assert!(status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_running_jobs_fetches_nothing_new_and_hands_back_overdue_ones() {
    let db = TestDb::new().await;
    prepare(&db).await;
    let client = Client::new(db.pool.clone());
    let config = engine(|c| c.shutdown_timeout = Duration::from_secs(2));
    let mut worker = spawn_worker(&db, "draining", "q:3", &config);
    let quick: Vec<i64> = client
        .insert_many(vec![record(800, false), record(800, false)])
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.job.id)
        .collect();
    let overdue = client.insert(record(4000, true)).await.unwrap().job.id;
    wait_for(Duration::from_secs(20), "three jobs running", || async {
        count(&db, "SELECT count(*) FROM test_runs").await == 3
    })
    .await;
    let waiting = client.insert(record(10, false)).await.unwrap().job.id;
    let signalled = Instant::now();
    let status = worker.terminate(Duration::from_secs(20)).await;
    assert!(status.success(), "exit status {status:?}");
    assert!(
        signalled.elapsed() < Duration::from_secs(5),
        "drain took {:?}",
        signalled.elapsed()
    );

    let mut by_id: HashMap<i64, queue::JobRow> = HashMap::new();
    for id in quick.iter().chain([&overdue, &waiting]) {
        by_id.insert(*id, client.job(*id).await.unwrap().unwrap());
    }
    for id in &quick {
        assert_eq!(by_id[id].state, JobState::Completed, "running job finished");
    }
    assert_eq!(
        by_id[&overdue].state,
        JobState::Available,
        "overdue job handed back"
    );
    assert_eq!(by_id[&overdue].attempt, 0);
    assert_eq!(
        by_id[&waiting].state,
        JobState::Available,
        "nothing new was fetched"
    );
    assert_eq!(by_id[&waiting].attempt, 0);
    assert_eq!(
        count(&db, "SELECT count(*) FROM fairlane_worker").await,
        0,
        "deregistered"
    );

    // The handed-back job runs again later, on the next worker.
    let mut next = spawn_worker(&db, "next", "q:3", &config);
    wait_for(
        Duration::from_secs(30),
        "handed-back job completed",
        || async { client.job(overdue).await.unwrap().unwrap().state == JobState::Completed },
    )
    .await;
    assert!(next.terminate(Duration::from_secs(20)).await.success());
}
