//! A leader catching up missed ticks stops between them on shutdown: it resigns at once instead
//! of running up to a minute's worth of ticks first. With a shutdown already requested, a leader
//! with thirty seconds of missed ticks runs none; without one, it runs them all. A tick that falls
//! due while an earlier one runs is run right after it, not a period late.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chrono::{DateTime, Utc};
use queue::notifier::Notifier;
use queue::{LeaderElector, LeaderHandle};
use scheduler::runner::{CronTask, Periodic};
use scheduler::schedule::Schedule;
use scheduler::ticks::{SCHEDULER_LEASE, TickStore};
use testkit::TestDb;
use tokio_util::sync::CancellationToken;

/// Ticks of the cleanup task claimed so far.
async fn ticks(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM scheduler_ticks WHERE task = $1")
        .bind(scheduler::cleanup::TASK)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

const LEASE_TTL: Duration = Duration::from_secs(10);

/// This test's replica, once it leads (with a lease of `ttl`); cancel the token to stop leading.
async fn leading(db: &TestDb, ttl: Duration) -> (LeaderHandle, CancellationToken) {
    let background = CancellationToken::new();
    let mut notifier = Notifier::new();
    let (elector, leader) = LeaderElector::new(
        db.pool.clone(),
        SCHEDULER_LEASE,
        "catch-up-test",
        ttl,
        &mut notifier,
    );
    tokio::spawn(notifier.run(db.pool.clone(), background.clone()));
    tokio::spawn(elector.run(background.clone()));
    testkit::eventually(Duration::from_secs(10), "leadership", || async {
        leader.is_leader().then_some(())
    })
    .await;
    (leader, background)
}

/// Waits for the task to stop (its shutdown already cancelled), then stops leading.
async fn stopped(running: tokio::task::JoinHandle<()>, background: CancellationToken) {
    tokio::time::timeout(Duration::from_secs(10), running)
        .await
        .expect("the task stops on shutdown")
        .unwrap();
    background.cancel();
}

/// The cleanup task on `schedule`, run by this test's replica.
fn cleanup_every(db: &TestDb, schedule: &str, lease_ttl: Duration) -> Periodic {
    Periodic {
        task: CronTask::ReservationCleanup {
            ttl: Duration::from_secs(3600),
        },
        schedule: Schedule::parse(schedule).unwrap(),
        store: TickStore::new(db.pool.clone(), "catch-up-test", lease_ttl),
        metrics: scheduler::metrics::SchedulerMetrics::new(),
    }
}

/// Runs the every-second cleanup task as leader, thirty seconds behind, until it returns or
/// `stop` is cancelled; `shutdown` is what the task is given.
async fn catch_up_with(db: &TestDb, shutdown: CancellationToken) {
    sqlx::query(
        "INSERT INTO scheduler_ticks (task, tick_at, claimed_by) \
         VALUES ($1, date_trunc('second', now()) - interval '30 seconds', 'earlier')",
    )
    .bind(scheduler::cleanup::TASK)
    .execute(&db.pool)
    .await
    .unwrap();
    let (leader, background) = leading(db, LEASE_TTL).await;
    let running =
        tokio::spawn(cleanup_every(db, "* * * * * *", LEASE_TTL).run(leader, shutdown.clone()));
    if !shutdown.is_cancelled() {
        testkit::eventually(Duration::from_secs(20), "the missed ticks run", || async {
            (ticks(db).await >= 31).then_some(())
        })
        .await;
        shutdown.cancel();
    }
    stopped(running, background).await;
}

#[tokio::test]
async fn a_shutdown_stops_a_catch_up_before_its_next_tick() {
    let db = TestDb::new().await;
    let shutdown = CancellationToken::new();
    shutdown.cancel();
    catch_up_with(&db, shutdown).await;
    assert_eq!(ticks(&db).await, 1, "only the earlier tick: none caught up");

    // The control: the same leader without a shutdown catches up every missed tick.
    let db = TestDb::new().await;
    catch_up_with(&db, CancellationToken::new()).await;
    assert!(ticks(&db).await >= 31);
}

/// Whether the cleanup task's tick at `tick` was claimed.
async fn claimed(db: &TestDb, tick: DateTime<Utc>) -> bool {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM scheduler_ticks WHERE task = $1 AND tick_at = $2)",
    )
    .bind(scheduler::cleanup::TASK)
    .bind(tick)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_tick_that_falls_due_while_the_one_before_runs_is_run_right_after_it() {
    let db = TestDb::new().await;
    // The lease outlives the slow tick, which holds back its renewals.
    let lease_ttl = Duration::from_secs(60);
    // The next tick of a ten-second schedule at least three seconds away.
    let slow: DateTime<Utc> =
        sqlx::query_scalar("SELECT to_timestamp(ceil((extract(epoch FROM now()) + 3) / 10) * 10)")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let next = slow + chrono::TimeDelta::seconds(10);
    // The slow tick's claim waits for this uncommitted claim of the same tick until the next
    // tick is a second overdue.
    let mut held = db.pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO scheduler_ticks (task, tick_at, claimed_by) VALUES ($1, $2, 'in the way')",
    )
    .bind(scheduler::cleanup::TASK)
    .bind(slow)
    .execute(&mut *held)
    .await
    .unwrap();
    let (leader, background) = leading(&db, lease_ttl).await;
    let shutdown = CancellationToken::new();
    let running =
        tokio::spawn(cleanup_every(&db, "*/10 * * * * *", lease_ttl).run(leader, shutdown.clone()));
    testkit::eventually(
        Duration::from_secs(30),
        "the next tick to be overdue",
        || async {
            let now: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
                .fetch_one(&db.pool)
                .await
                .unwrap();
            (now > next + chrono::TimeDelta::seconds(1)).then_some(())
        },
    )
    .await;
    assert!(!claimed(&db, slow).await);
    held.rollback().await.unwrap();

    // Nine seconds before the tick after it.
    testkit::eventually(
        Duration::from_secs(4),
        "the overdue tick to run",
        || async { (claimed(&db, slow).await && claimed(&db, next).await).then_some(()) },
    )
    .await;
    shutdown.cancel();
    stopped(running, background).await;
}
