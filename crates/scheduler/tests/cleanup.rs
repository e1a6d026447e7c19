//! Reservation cleanup by a real scheduler process (SPEC §5): reservations of completed,
//! discarded, cancelled and deleted jobs are removed, as is a reservation that never got a job
//! once past `QUOTA_RESERVATION_TTL`; the reservation of a live job (snoozed, retrying, running,
//! waiting) is kept however far past the TTL. Orphans are counted in the tick's result and in
//! `fairlane_scheduler_orphan_reservations_total`; a tick whose result cannot be written still
//! returns what it removed (the count the metric is fed from).

#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use common::{Service, select_queue};
use queue::{Client, Engine, EngineConfig, JobError, JobState, NewJob, RetryPolicy, Workers};
use quota::{Quota, QuotaConfig, QuotaHook};
use serde::{Deserialize, Serialize};
use support::*;
use testkit::TestDb;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Naps {
    user_id: Uuid,
}
impl queue::JobArgs for Naps {
    const KIND: &'static str = "naps";
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Fails {
    user_id: Uuid,
}
impl queue::JobArgs for Fails {
    const KIND: &'static str = "fails";
}

/// Inserts a job of `user` with a reservation linked to it, as the API does (one transaction).
async fn reserved_job(db: &TestDb, user: Uuid, job: NewJob) -> i64 {
    let quota = Quota::new(QuotaConfig::default()).unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let grant = quota
        .check(&mut tx, user, Service::Analysis, chrono::Utc::now())
        .await
        .unwrap();
    let id = queue::insert::insert(&mut tx, job).await.unwrap().job.id;
    grant.reserve(&mut tx, Some(id)).await.unwrap();
    tx.commit().await.unwrap();
    id
}

async fn state(db: &TestDb, id: i64) -> JobState {
    sqlx::query_scalar("SELECT state FROM fairlane_job WHERE id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn reserved_jobs(db: &TestDb) -> Vec<Option<i64>> {
    sqlx::query_scalar("SELECT job_id FROM quota_reservations ORDER BY job_id NULLS FIRST")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_removes_reservations_of_finished_and_deleted_jobs_and_keeps_live_ones() {
    let db = TestDb::new().await;
    let user: Uuid = sqlx::query_scalar(
        "INSERT INTO users (name, tier) VALUES ('u', 'enterprise') RETURNING id",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let queue = select_queue(Service::Analysis, common::Tier::Enterprise, false);
    let job = |kind: &str| {
        NewJob::from_json(kind, queue.clone(), serde_json::json!({ "user_id": user })).unwrap()
    };

    // Live jobs, made snoozed and retrying by a real engine whose handlers snooze and fail (the
    // quota hook keeps their reservations, as it must).
    let snoozed = reserved_job(&db, user, job("naps")).await;
    let retrying = reserved_job(&db, user, job("fails")).await;
    let waiting = reserved_job(&db, user, job("waits")).await;
    let hooked = Client::new(db.pool.clone()).with_hooks(vec![Arc::new(QuotaHook::new())]);
    let mut workers = Workers::new();
    workers.register_fn::<Naps, _, _>(|_, _| async {
        Err(JobError::Snooze(Duration::from_secs(3600)))
    });
    workers.register_fn::<Fails, _, _>(|_, _| async { Err(JobError::msg("boom")) });
    let engine = Engine::builder(hooked)
        .name("cleanup-test")
        .config(EngineConfig {
            poll_interval: Duration::from_millis(100),
            maintenance: false,
            retry: RetryPolicy {
                base: Duration::from_secs(3600),
                ..RetryPolicy::default()
            },
            ..EngineConfig::default()
        })
        .queue(queue.clone(), 2)
        .workers(workers)
        .build()
        .unwrap();
    // `waits` has no handler here: keep it waiting in another queue the engine does not work.
    sqlx::query("UPDATE fairlane_job SET queue = 'analysis_default' WHERE id = $1")
        .bind(waiting)
        .execute(&db.pool)
        .await
        .unwrap();
    let stop = CancellationToken::new();
    let running_engine = tokio::spawn(engine.run(stop.clone()));
    eventually(Duration::from_secs(20), "snoozed and retrying", || async {
        (state(&db, snoozed).await == JobState::Scheduled
            && state(&db, retrying).await == JobState::Retryable)
            .then_some(())
    })
    .await;
    stop.cancel();
    running_engine.await.unwrap().unwrap();
    let snoozes: i64 =
        sqlx::query_scalar("SELECT (metadata ->> 'snoozes')::int8 FROM fairlane_job WHERE id = $1")
            .bind(snoozed)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(snoozes, 1);

    // A job running on a live worker.
    let running = reserved_job(&db, user, job("runs")).await;
    sqlx::query(
        "INSERT INTO fairlane_worker (id, hostname, pid, heartbeat_at) \
         VALUES ('busy-worker', 'h', 1, now() + interval '1 hour')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE fairlane_job SET state = 'running', attempt = 1, attempted_at = now(), \
         attempted_by = '{busy-worker}' WHERE id = $1",
    )
    .bind(running)
    .execute(&db.pool)
    .await
    .unwrap();

    // Jobs finished by a process without the quota hook (orphans), and a deleted job.
    let completed = reserved_job(&db, user, job("done")).await;
    let discarded = reserved_job(&db, user, job("gave-up")).await;
    let cancelled = reserved_job(&db, user, job("stopped")).await;
    let deleted = reserved_job(&db, user, job("gone")).await;
    sqlx::query(
        "UPDATE fairlane_job SET state = CASE WHEN id = $1 THEN 'completed' ELSE 'discarded' END::fairlane_job_state, \
         finalized_at = now() WHERE id = ANY($2)",
    )
    .bind(completed)
    .bind(vec![completed, discarded])
    .execute(&db.pool)
    .await
    .unwrap();
    let unhooked = Client::new(db.pool.clone());
    assert!(matches!(
        unhooked.cancel(cancelled).await.unwrap(),
        Some(queue::CancelResult::Cancelled(_))
    ));
    sqlx::query("DELETE FROM fairlane_job WHERE id = $1")
        .bind(deleted)
        .execute(&db.pool)
        .await
        .unwrap();

    // Reservations without a job: one past the TTL, one fresh.
    let quota = Quota::new(QuotaConfig::default()).unwrap();
    let mut unlinked = Vec::new();
    for _ in 0..2 {
        let mut tx = db.pool.begin().await.unwrap();
        let r = quota
            .reserve(&mut tx, user, Service::Analysis, chrono::Utc::now())
            .await
            .unwrap();
        tx.commit().await.unwrap();
        unlinked.push(r.id);
    }
    // Everything is far past the one-hour TTL except the fresh unlinked reservation.
    sqlx::query(
        "UPDATE quota_reservations SET created_at = now() - interval '3 hours', \
         expires_at = now() - interval '2 hours' WHERE id <> $1",
    )
    .bind(unlinked[1])
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(reserved_jobs(&db).await.len(), 10);

    let mut s = Scheduler::spawn(
        "cleanup",
        &db.url(),
        &[
            ("REANALYZE_ENABLED", "false"),
            ("QUOTA_RESERVATION_TTL", "1h"),
        ],
    );
    s.wait_running().await;
    eventually(Duration::from_secs(30), "orphans removed", || async {
        (reserved_jobs(&db).await.len() == 5).then_some(())
    })
    .await;
    let mut kept = reserved_jobs(&db).await;
    kept.sort();
    let mut expected = vec![
        None,
        Some(snoozed),
        Some(retrying),
        Some(waiting),
        Some(running),
    ];
    expected.sort();
    assert_eq!(
        kept, expected,
        "live jobs keep their reservations past the TTL"
    );
    let fresh: i64 = sqlx::query_scalar("SELECT count(*) FROM quota_reservations WHERE id = $1")
        .bind(unlinked[1])
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(fresh, 1, "the unlinked reservation inside its TTL stays");
    for (id, expected) in [
        (snoozed, JobState::Scheduled),
        (retrying, JobState::Retryable),
        (waiting, JobState::Available),
        (running, JobState::Running),
    ] {
        assert_eq!(state(&db, id).await, expected, "job {id} untouched");
    }

    // Counted and reported.
    let totals: (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT coalesce(sum((result ->> 'final_job')::int8), 0)::int8, \
                coalesce(sum((result ->> 'missing_job')::int8), 0)::int8, \
                coalesce(sum((result ->> 'expired_without_job')::int8), 0)::int8, \
                coalesce(sum((result ->> 'orphans')::int8), 0)::int8 \
         FROM scheduler_ticks WHERE task = 'reservation-cleanup'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(totals, (3, 1, 1, 5));
    let metrics = eventually(Duration::from_secs(10), "orphan counters", || async {
        let m = s.metrics().await;
        m.iter()
            .any(|x| x.name == "fairlane_scheduler_orphan_reservations_total")
            .then_some(m)
    })
    .await;
    let orphans = |reason: &str| {
        metrics
            .iter()
            .find(|x| {
                x.name == "fairlane_scheduler_orphan_reservations_total"
                    && x.labels.get("reason").map(String::as_str) == Some(reason)
            })
            .map(|x| x.value)
    };
    assert_eq!(orphans("final_job"), Some(3.0));
    assert_eq!(orphans("missing_job"), Some(1.0));
    assert_eq!(orphans("expired_without_job"), Some(1.0));
    assert!(s.child.terminate(Duration::from_secs(20)).await.success());
}

/// A tick claimed in the future (by a replica whose clock had jumped ahead, before ticks were
/// reckoned by the database's clock) is not where the task resumes: the ticks due now still run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tick_claimed_in_the_future_does_not_stop_the_task() {
    let db = TestDb::new().await;
    sqlx::query(
        "INSERT INTO scheduler_ticks (task, tick_at, claimed_by) \
         VALUES ('reservation-cleanup', date_trunc('second', now()) + interval '1 day', 'skewed')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut s = Scheduler::spawn(
        "future-frontier",
        &db.url(),
        &[("REANALYZE_ENABLED", "false")],
    );
    let me = s.wait_running().await;
    eventually(
        Duration::from_secs(20),
        "a tick due now claimed",
        || async {
            let now = db_now(&db.pool).await;
            ticks(&db.pool, "reservation-cleanup")
                .await
                .iter()
                .any(|t| t.claimed_by == me && t.tick_at <= now)
                .then_some(())
        },
    )
    .await;
    assert!(s.child.terminate(Duration::from_secs(20)).await.success());
}

/// Once orphans are removed, what was found is reported even if the tick's result cannot be
/// written: the next tick would find nothing left to count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tick_whose_result_cannot_be_written_still_reports_its_orphans() {
    let db = TestDb::new().await;
    let user: Uuid =
        sqlx::query_scalar("INSERT INTO users (name, tier) VALUES ('u', 'pro') RETURNING id")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let queue = select_queue(Service::Analysis, common::Tier::Pro, false);
    let job = NewJob::from_json("done", queue, serde_json::json!({ "user_id": user })).unwrap();
    let completed = reserved_job(&db, user, job).await;
    sqlx::query("UPDATE fairlane_job SET state = 'completed', finalized_at = now() WHERE id = $1")
        .bind(completed)
        .execute(&db.pool)
        .await
        .unwrap();
    lease(&db.pool, "cleanup-test", true).await;
    sqlx::raw_sql(
        "CREATE FUNCTION refuse_results() RETURNS trigger LANGUAGE plpgsql AS \
           $$ BEGIN RAISE EXCEPTION 'results refused'; END $$; \
         CREATE TRIGGER refuse_results BEFORE UPDATE ON scheduler_ticks \
           FOR EACH ROW EXECUTE FUNCTION refuse_results();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let store =
        scheduler::ticks::TickStore::new(db.pool.clone(), "cleanup-test", Duration::from_secs(60));
    let outcome =
        scheduler::cleanup::run_tick(&store, Duration::from_secs(3600), db_now(&db.pool).await)
            .await
            .unwrap();
    let scheduler::reanalyze::TickOutcome::Done(report) = outcome else {
        panic!("the tick was not done: {outcome:?}");
    };
    assert_eq!((report.final_job, report.billed, report.total()), (1, 1, 1));
    assert!(reserved_jobs(&db).await.is_empty());
}
