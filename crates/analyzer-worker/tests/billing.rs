//! Exactly-once billing with real worker processes (SPEC §5): a job's quota reservation ends in
//! the same transaction as its final state — success writes one usage event, final failure or
//! cancel writes none — and a worker killed mid-job never bills twice.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use common::{Service, select_queue};
use queue::{JobState, NewJob};
use quota::{Quota, QuotaConfig};
use testkit::TestDb;
use testkit::process::ChildProcess;
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_analyzer-worker");

fn spawn(db: &TestDb, name: &str) -> ChildProcess {
    let env: Vec<(&str, String)> = vec![
        ("DATABASE_URL", db.url()),
        ("HTTP_ADDR", "127.0.0.1:0".into()),
        ("WORKER_SLEEP_JOBS", "true".into()),
        ("LOG_FORMAT", "pretty".into()),
        ("RUST_LOG", "warn".into()),
        ("QUEUE_HEARTBEAT_INTERVAL", "300ms".into()),
        ("QUEUE_RESCUE_AFTER", "2s".into()),
        ("QUEUE_RESCUE_INTERVAL", "300ms".into()),
        ("QUEUE_PROMOTE_INTERVAL", "100ms".into()),
        ("QUEUE_LEADER_TTL", "1s".into()),
    ];
    ChildProcess::spawn(name, BIN, &[], &env)
}

/// Enqueues a `sleep` job with a quota reservation, as the API does: check, job insert and
/// reservation in one transaction.
async fn enqueue_reserved(db: &TestDb, user: Uuid, ms: u64, fail: bool, max_attempts: i16) -> i64 {
    let quota = Quota::new(QuotaConfig::default()).unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let grant = quota
        .check(&mut tx, user, Service::Analysis, chrono::Utc::now())
        .await
        .unwrap();
    let job = NewJob::from_json(
        "sleep",
        select_queue(Service::Analysis, grant.tier, false),
        serde_json::json!({"user_id": user, "ms": ms, "fail": fail}),
    )
    .unwrap()
    .max_attempts(max_attempts);
    let job = queue::insert::insert(&mut tx, job).await.unwrap().job;
    grant.reserve(&mut tx, Some(job.id)).await.unwrap();
    tx.commit().await.unwrap();
    job.id
}

async fn user(db: &TestDb) -> Uuid {
    sqlx::query_scalar("INSERT INTO users (name, tier) VALUES ('u', 'pro') RETURNING id")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn wait_final(db: &TestDb, id: i64, timeout: Duration) -> JobState {
    let deadline = Instant::now() + timeout;
    loop {
        let state: JobState = sqlx::query_scalar("SELECT state FROM fairlane_job WHERE id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        if state.is_final() {
            return state;
        }
        assert!(Instant::now() < deadline, "job {id} still {state}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn counts(db: &TestDb, id: i64) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM usage_events WHERE job_id = $1), \
                (SELECT count(*) FROM quota_reservations WHERE job_id = $1)",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn success_bills_once_and_failure_bills_nothing() {
    let db = TestDb::new().await;
    let u = user(&db).await;
    let ok = enqueue_reserved(&db, u, 50, false, 3).await;
    let failing = enqueue_reserved(&db, u, 10, true, 2).await;
    assert_eq!(counts(&db, ok).await, (0, 1), "reserved, not yet billed");
    let mut worker = spawn(&db, "billing");
    assert_eq!(
        wait_final(&db, ok, Duration::from_secs(20)).await,
        JobState::Completed
    );
    assert_eq!(
        wait_final(&db, failing, Duration::from_secs(20)).await,
        JobState::Discarded
    );
    assert!(worker.terminate(Duration::from_secs(20)).await.success());
    assert_eq!(
        counts(&db, ok).await,
        (1, 0),
        "one usage event, reservation gone"
    );
    assert_eq!(
        counts(&db, failing).await,
        (0, 0),
        "nothing billed, reservation gone"
    );
    let amount: i32 = sqlx::query_scalar("SELECT amount FROM usage_events WHERE job_id = $1")
        .bind(ok)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(amount, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_worker_killed_mid_job_never_bills_twice() {
    let db = TestDb::new().await;
    let u = user(&db).await;
    let mut victim = spawn(&db, "victim");
    let id = enqueue_reserved(&db, u, 1500, false, 5).await;
    // Wait until the victim is running it.
    let deadline = Instant::now() + Duration::from_secs(20);
    while sqlx::query_scalar::<_, JobState>("SELECT state FROM fairlane_job WHERE id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap()
        != JobState::Running
    {
        assert!(Instant::now() < deadline, "job never started");
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let mut survivor = spawn(&db, "survivor");
    victim.kill_9().await;
    assert_eq!(
        counts(&db, id).await,
        (0, 1),
        "a crashed attempt bills nothing"
    );
    assert_eq!(
        wait_final(&db, id, Duration::from_secs(30)).await,
        JobState::Completed
    );
    assert!(survivor.terminate(Duration::from_secs(20)).await.success());
    assert_eq!(
        counts(&db, id).await,
        (1, 0),
        "billed exactly once after the rescue"
    );
    let attempt: i16 = sqlx::query_scalar("SELECT attempt FROM fairlane_job WHERE id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(attempt, 2, "the killed attempt and the one that completed");
}
