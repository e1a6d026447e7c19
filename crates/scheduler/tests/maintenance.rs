//! Queue maintenance in a real scheduler process: it wins the `queue-maintenance` election when
//! no worker runs, rescues a dead worker's jobs with the quota hook (a job out of attempts is
//! discarded and its reservation released in the same transaction; a job with attempts left keeps
//! it), promotes due jobs, cleans old final jobs, and resigns the lease on SIGTERM.

#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use common::Service;
use queue::{JobState, NewJob};
use quota::{Quota, QuotaConfig};
use support::*;
use testkit::TestDb;

async fn reserved_job(db: &TestDb, user: uuid::Uuid, max_attempts: i16) -> i64 {
    let quota = Quota::new(QuotaConfig::default()).unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let grant = quota
        .check(&mut tx, user, Service::Analysis, chrono::Utc::now())
        .await
        .unwrap();
    let job = NewJob::from_json(
        "k",
        Service::Analysis.queue(common::Lane::Priority),
        serde_json::json!({ "user_id": user }),
    )
    .unwrap()
    .max_attempts(max_attempts);
    let id = queue::insert::insert(&mut tx, job).await.unwrap().job.id;
    grant.reserve(&mut tx, Some(id)).await.unwrap();
    tx.commit().await.unwrap();
    id
}

async fn job_state(db: &TestDb, id: i64) -> Option<JobState> {
    sqlx::query_scalar("SELECT state FROM fairlane_job WHERE id = $1")
        .bind(id)
        .fetch_optional(&db.pool)
        .await
        .unwrap()
}

async fn reservation_of(db: &TestDb, id: i64) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM quota_reservations WHERE job_id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduler_maintains_the_queue_with_the_workers_hooks() {
    let db = TestDb::new().await;
    let user: uuid::Uuid =
        sqlx::query_scalar("INSERT INTO users (name, tier) VALUES ('u', 'pro') RETURNING id")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let exhausted = reserved_job(&db, user, 1).await;
    let retried = reserved_job(&db, user, 5).await;
    sqlx::query(
        "INSERT INTO fairlane_worker (id, hostname, pid, heartbeat_at) \
         VALUES ('dead-worker', 'h', 1, now() - interval '1 hour')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE fairlane_job SET state = 'running', attempt = 1, attempted_at = now(), \
         attempted_by = '{dead-worker}' WHERE id = ANY($1)",
    )
    .bind(vec![exhausted, retried])
    .execute(&db.pool)
    .await
    .unwrap();
    let client = queue::Client::new(db.pool.clone());
    let due = client
        .insert(
            NewJob::from_json(
                "k",
                queue::QueueName::new("q").unwrap(),
                serde_json::json!({}),
            )
            .unwrap()
            .scheduled_at(chrono::Utc::now() + chrono::Duration::milliseconds(500)),
        )
        .await
        .unwrap()
        .job;
    assert_eq!(due.state, JobState::Scheduled);
    let old = client
        .insert(
            NewJob::from_json(
                "k",
                queue::QueueName::new("q").unwrap(),
                serde_json::json!({}),
            )
            .unwrap(),
        )
        .await
        .unwrap()
        .job;
    sqlx::query(
        "UPDATE fairlane_job SET state = 'completed', finalized_at = now() - interval '25 hours' \
         WHERE id = $1",
    )
    .bind(old.id)
    .execute(&db.pool)
    .await
    .unwrap();

    let mut s = Scheduler::spawn(
        "maintainer",
        &db.url(),
        &[
            ("REANALYZE_ENABLED", "false"),
            // Cleanup runs once at start (its newest tick), before any rescue could happen.
            ("RESERVATION_CLEANUP_SCHEDULE", "0 0 1 1 *"),
            ("QUEUE_CLEAN_INTERVAL", "200ms"),
        ],
    );
    let id = s.wait_running().await;
    eventually(
        Duration::from_secs(30),
        "dead worker's jobs rescued",
        || async {
            (job_state(&db, exhausted).await == Some(JobState::Discarded)
                && job_state(&db, retried).await == Some(JobState::Available))
            .then_some(())
        },
    )
    .await;
    assert_eq!(
        reservation_of(&db, exhausted).await,
        0,
        "released in the rescue"
    );
    assert_eq!(reservation_of(&db, retried).await, 1, "kept for the retry");
    let billed: i64 = sqlx::query_scalar("SELECT count(*) FROM usage_events")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(billed, 0, "a discarded job is not billed");
    // The release came from the hook, not from reservation cleanup.
    let cleanup = ticks(&db.pool, "reservation-cleanup").await;
    assert_eq!(cleanup.len(), 1);
    assert_eq!(cleanup[0].result.as_ref().unwrap()["orphans"], 0);
    eventually(
        Duration::from_secs(10),
        "due job promoted, old job cleaned",
        || async {
            (job_state(&db, due.id).await == Some(JobState::Available)
                && job_state(&db, old.id).await.is_none())
            .then_some(())
        },
    )
    .await;
    let holder: Option<String> = sqlx::query_scalar(
        "SELECT leader_id FROM fairlane_leader WHERE name = 'queue-maintenance'",
    )
    .fetch_optional(&db.pool)
    .await
    .unwrap();
    assert_eq!(holder.as_deref(), Some(id.as_str()));
    assert_eq!(s.status().await["maintenance_leader"], true);

    assert!(s.child.terminate(Duration::from_secs(20)).await.success());
    let leases: i64 = sqlx::query_scalar("SELECT count(*) FROM fairlane_leader")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(leases, 0, "both leases resigned on SIGTERM");
}
