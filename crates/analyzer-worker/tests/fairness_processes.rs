//! Fleet-wide fairness with real `analyzer-worker` processes (SPEC §4): limits hold across
//! replicas, freed slots are reused within a second, a heavy backlog does not delay others, a
//! killed replica's slots come back with the rescue, tier changes apply without restarts.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use testkit::TestDb;
use testkit::process::ChildProcess;
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_analyzer-worker");

/// Fast maintenance so crash tests finish in seconds; a 5 s poll so wake-ups must come from
/// NOTIFY.
fn env(db: &TestDb, extra: &[(&str, &str)]) -> Vec<(&'static str, String)> {
    let mut env: Vec<(&'static str, String)> = vec![
        ("DATABASE_URL", db.url()),
        ("HTTP_ADDR", "127.0.0.1:0".into()),
        ("WORKER_SLEEP_JOBS", "true".into()),
        ("LOG_FORMAT", "pretty".into()),
        ("RUST_LOG", "warn".into()),
        ("QUEUE_POLL_INTERVAL", "5s".into()),
        ("QUEUE_HEARTBEAT_INTERVAL", "300ms".into()),
        ("QUEUE_RESCUE_AFTER", "2s".into()),
        ("QUEUE_RESCUE_INTERVAL", "300ms".into()),
        ("QUEUE_PROMOTE_INTERVAL", "100ms".into()),
        ("QUEUE_LEADER_TTL", "1s".into()),
        ("QUEUE_SHUTDOWN_TIMEOUT", "5s".into()),
        ("FAIRNESS_SNOOZE_DURATION", "50ms".into()),
        ("FAIRNESS_SNOOZE_JITTER", "30ms".into()),
        ("FAIRNESS_TIER_CACHE_TTL", "1s".into()),
    ];
    for (k, v) in extra {
        let key: &'static str = Box::leak((*k).to_owned().into_boxed_str());
        env.retain(|(existing, _)| *existing != key);
        env.push((key, (*v).to_owned()));
    }
    env
}

fn spawn(db: &TestDb, name: &str, extra: &[(&str, &str)]) -> ChildProcess {
    let env = env(db, extra);
    ChildProcess::spawn(name, BIN, &[], &env)
}

async fn user(db: &TestDb, tier: &str) -> Uuid {
    sqlx::query_scalar(
        "INSERT INTO users (name, tier) VALUES ('u', $1::fairlane_tier) RETURNING id",
    )
    .bind(tier)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

async fn enqueue(db: &TestDb, queue: &str, user: Option<Uuid>, ms: u64, n: usize) -> Vec<i64> {
    let args: Vec<serde_json::Value> = (0..n)
        .map(|_| match user {
            Some(u) => serde_json::json!({"user_id": u, "ms": ms}),
            None => serde_json::json!({"ms": ms}),
        })
        .collect();
    let jobs: Vec<queue::NewJob> = args
        .into_iter()
        .map(|a| {
            queue::NewJob::from_json("sleep", queue::QueueName::new(queue).unwrap(), a)
                .unwrap()
                .max_attempts(3)
        })
        .collect();
    let mut conn = db.pool.acquire().await.unwrap();
    if n > 1000 {
        queue::insert::insert_bulk(&mut conn, &jobs).await.unwrap();
        return Vec::new();
    }
    queue::insert::insert_many(&mut conn, jobs)
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.job.id)
        .collect()
}

async fn wait_completed(db: &TestDb, ids: &[i64], timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let done: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM fairlane_job WHERE id = ANY($1) AND state = 'completed'",
        )
        .bind(ids)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if done == ids.len() as i64 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{done} of {} completed",
            ids.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[derive(Debug, Clone)]
struct Run {
    start: DateTime<Utc>,
    end: DateTime<Utc>,
    worker: String,
}

async fn runs(db: &TestDb, ids: &[i64]) -> Vec<Run> {
    let outputs: Vec<serde_json::Value> = sqlx::query_scalar(
        "SELECT output FROM fairlane_job WHERE id = ANY($1) AND output IS NOT NULL",
    )
    .bind(ids)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let mut runs: Vec<Run> = outputs
        .into_iter()
        .map(|o| Run {
            start: o["started_at"].as_str().unwrap().parse().unwrap(),
            end: o["finished_at"].as_str().unwrap().parse().unwrap(),
            worker: o["worker"].as_str().unwrap().to_owned(),
        })
        .collect();
    runs.sort_by_key(|r| r.start);
    runs
}

fn peak(runs: &[Run]) -> usize {
    let mut events: Vec<(DateTime<Utc>, i32)> = runs
        .iter()
        .flat_map(|r| [(r.start, 1), (r.end, -1)])
        .collect();
    events.sort_by_key(|(t, d)| (*t, *d));
    let (mut now, mut peak) = (0, 0);
    for (_, d) in events {
        now += d;
        peak = peak.max(now);
    }
    peak as usize
}

async fn stop_all(workers: &mut [ChildProcess]) {
    for w in workers {
        let status = w.terminate(Duration::from_secs(20)).await;
        assert!(status.success(), "worker exited with {status:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_limits_hold_across_three_replicas() {
    let db = TestDb::new().await;
    let free = user(&db, "free").await;
    let enterprise = user(&db, "enterprise").await;
    // Two priority workers per replica: Enterprise's limit of 5 can only be reached with jobs
    // running on all three replicas at once, so reaching it proves admission is fleet-wide.
    let mut workers: Vec<_> = (0..3)
        .map(|i| {
            spawn(
                &db,
                &format!("aw{i}"),
                &[("ANALYZER_QUEUE_PRIORITY_WORKERS", "2")],
            )
        })
        .collect();
    wait_for_replicas(&db, 3).await;
    let free_jobs = enqueue(&db, "analysis_default", Some(free), 200, 20).await;
    let ent_jobs = enqueue(&db, "analysis_priority", Some(enterprise), 300, 20).await;
    wait_completed(&db, &free_jobs, Duration::from_secs(60)).await;
    wait_completed(&db, &ent_jobs, Duration::from_secs(60)).await;
    stop_all(&mut workers).await;

    let free_runs = runs(&db, &free_jobs).await;
    assert_eq!(free_runs.len(), 20);
    assert_eq!(
        peak(&free_runs),
        1,
        "a Free user never runs two jobs at once, fleet-wide"
    );
    let ent_runs = runs(&db, &ent_jobs).await;
    assert_eq!(ent_runs.len(), 20);
    assert_eq!(peak(&ent_runs), 5, "Enterprise reaches and never exceeds 5");
    let replicas: std::collections::HashSet<&str> =
        ent_runs.iter().map(|r| r.worker.as_str()).collect();
    assert_eq!(
        replicas.len(),
        3,
        "Enterprise's jobs ran on every replica: {replicas:?}"
    );
}

/// Waits until `n` worker processes have registered (so none gets a head start on the jobs).
async fn wait_for_replicas(db: &TestDb, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let registered: i64 = sqlx::query_scalar("SELECT count(*) FROM fairlane_worker")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        if registered >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "only {registered} of {n} replicas registered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until job `id` is running.
/// Waits until job `id` is running past its fairness check: fetched at least 500 ms ago and still
/// running. A job is `running` from its fetch, before the check at its start; a job of the same
/// user fetched in between is counted by that check, and both snooze (the test's "second" job
/// could then run first).
async fn wait_running(db: &TestDb, id: i64, timeout: Duration) {
    testkit::eventually(timeout, &format!("job {id} to start"), || async {
        let admitted: bool = sqlx::query_scalar(
            "SELECT state = 'running' AND attempted_at < now() - interval '500 milliseconds' \
             FROM fairlane_job WHERE id = $1",
        )
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .expect("job state");
        admitted.then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_freed_slot_is_reused_within_a_second_across_replicas() {
    let db = TestDb::new().await;
    let free = user(&db, "free").await;
    let mut workers: Vec<_> = (0..3).map(|i| spawn(&db, &format!("aw{i}"), &[])).collect();
    wait_for_replicas(&db, 3).await;
    let ids = enqueue(&db, "analysis_default", Some(free), 1000, 2).await;
    wait_completed(&db, &ids, Duration::from_secs(30)).await;
    stop_all(&mut workers).await;
    let r = runs(&db, &ids).await;
    let gap = (r[1].start - r[0].end).to_std().expect("no overlap");
    assert!(
        gap < Duration::from_secs(1),
        "second job started {gap:?} after the first ended"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_backlog_of_ten_thousand_does_not_delay_another_user() {
    let db = TestDb::new().await;
    let a = user(&db, "free").await;
    let b = user(&db, "free").await;
    enqueue(&db, "analysis_default", Some(a), 200, 10_000).await;
    let mut workers = vec![spawn(&db, "aw", &[])];
    wait_for_replicas(&db, 1).await;
    let submitted = Utc::now();
    let mine = enqueue(&db, "analysis_default", Some(b), 10, 1).await;
    wait_completed(&db, &mine, Duration::from_secs(10)).await;
    stop_all(&mut workers).await;
    let started = runs(&db, &mine).await[0].start;
    let waited = (started - submitted).to_std().unwrap_or_default();
    assert!(waited < Duration::from_secs(1), "B waited {waited:?}");
    let churned: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM fairlane_job WHERE user_id = $1 AND (attempt > 0 OR state <> 'available')",
    )
    .bind(a)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        churned < 20,
        "A's backlog was not churned through ({churned} touched)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_killed_replica_gives_back_its_slot_within_the_rescue_time() {
    let db = TestDb::new().await;
    let free = user(&db, "free").await;
    let mut victim = spawn(&db, "victim", &[]);
    let first = enqueue(&db, "analysis_default", Some(free), 60_000, 1).await;
    // Wait until the victim runs it.
    wait_running(&db, first[0], Duration::from_secs(20)).await;
    let mut survivor = spawn(&db, "survivor", &[]);
    let next = enqueue(&db, "analysis_default", Some(free), 100, 3).await;
    // The survivor is up before the kill, so its start-up is not counted in the restart.
    wait_for_replicas(&db, 2).await;
    victim.kill_9().await;
    let killed = Utc::now();
    wait_completed(&db, &next, Duration::from_secs(30)).await;
    let r = runs(&db, &next).await;
    let restart = (r[0].start - killed).to_std().unwrap_or_default();
    // Rescue after 2 s + a 300 ms sweep + up to a 1 s lease takeover.
    assert!(
        restart < Duration::from_millis(4300),
        "next job ran {restart:?} after the kill"
    );
    assert_eq!(peak(&r), 1, "the slot was not leaked, nor doubled");
    survivor.terminate(Duration::from_secs(20)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_gate_jobs_snooze_twenty_times_and_still_complete() {
    let db = TestDb::new().await;
    let free = user(&db, "free").await;
    let mut workers = vec![
        spawn(&db, "aw0", &[("FAIRNESS_FETCH_GATE", "false")]),
        spawn(&db, "aw1", &[("FAIRNESS_FETCH_GATE", "false")]),
    ];
    let long = enqueue(&db, "analysis_default", Some(free), 4000, 1).await;
    wait_running(&db, long[0], Duration::from_secs(20)).await;
    let snoozer = enqueue(&db, "analysis_default", Some(free), 10, 1).await;
    let both: Vec<i64> = long.iter().chain(&snoozer).copied().collect();
    wait_completed(&db, &both, Duration::from_secs(40)).await;
    stop_all(&mut workers).await;
    let (snoozes, attempt): (i64, i16) = sqlx::query_as(
        "SELECT (metadata->>'snoozes')::int8, attempt FROM fairlane_job WHERE id = $1",
    )
    .bind(snoozer[0])
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(snoozes >= 20, "snoozed {snoozes} times");
    assert_eq!(attempt, 1);
    assert_eq!(peak(&runs(&db, &both).await), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tier_changes_apply_without_restart_and_disabling_removes_limits() {
    let db = TestDb::new().await;
    let u = user(&db, "free").await;
    let mut workers = vec![spawn(&db, "aw", &[])];
    let before = enqueue(&db, "analysis_default", Some(u), 300, 3).await;
    wait_completed(&db, &before, Duration::from_secs(30)).await;
    assert_eq!(peak(&runs(&db, &before).await), 1);
    sqlx::query("UPDATE users SET tier = 'pro' WHERE id = $1")
        .bind(u)
        .execute(&db.pool)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await; // FAIRNESS_TIER_CACHE_TTL=1s
    let after = enqueue(&db, "analysis_default", Some(u), 300, 3).await;
    wait_completed(&db, &after, Duration::from_secs(30)).await;
    assert_eq!(
        peak(&runs(&db, &after).await),
        3,
        "Pro's limit applies without a restart"
    );
    stop_all(&mut workers).await;

    sqlx::query("UPDATE users SET tier = 'free' WHERE id = $1")
        .bind(u)
        .execute(&db.pool)
        .await
        .unwrap();
    let mut unlimited = vec![spawn(&db, "aw-off", &[("FAIRNESS_ENABLED", "false")])];
    let free_for_all = enqueue(&db, "analysis_default", Some(u), 300, 3).await;
    wait_completed(&db, &free_for_all, Duration::from_secs(30)).await;
    stop_all(&mut unlimited).await;
    assert_eq!(
        peak(&runs(&db, &free_for_all).await),
        3,
        "no limit when disabled"
    );
}
