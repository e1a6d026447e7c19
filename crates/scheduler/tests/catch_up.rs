//! A leader catching up missed ticks stops between them on shutdown: it resigns at once instead
//! of running up to a minute's worth of ticks first. With a shutdown already requested, a leader
//! with thirty seconds of missed ticks runs none; without one, it runs them all.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use queue::LeaderElector;
use queue::notifier::Notifier;
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
    let background = CancellationToken::new();
    let mut notifier = Notifier::new();
    let (elector, leader) = LeaderElector::new(
        db.pool.clone(),
        SCHEDULER_LEASE,
        "catch-up-test",
        Duration::from_secs(10),
        &mut notifier,
    );
    tokio::spawn(notifier.run(db.pool.clone(), background.clone()));
    tokio::spawn(elector.run(background.clone()));
    testkit::eventually(Duration::from_secs(10), "leadership", || async {
        leader.is_leader().then_some(())
    })
    .await;
    let task = Periodic {
        task: CronTask::ReservationCleanup {
            ttl: Duration::from_secs(3600),
        },
        schedule: Schedule::parse("* * * * * *").unwrap(),
        store: TickStore::new(db.pool.clone(), "catch-up-test", Duration::from_secs(10)),
        metrics: scheduler::metrics::SchedulerMetrics::new(),
    };
    let running = tokio::spawn(task.run(leader, shutdown.clone()));
    if !shutdown.is_cancelled() {
        testkit::eventually(Duration::from_secs(20), "the missed ticks run", || async {
            (ticks(db).await >= 31).then_some(())
        })
        .await;
        shutdown.cancel();
    }
    tokio::time::timeout(Duration::from_secs(10), running)
        .await
        .expect("the task stops on shutdown")
        .unwrap();
    background.cancel();
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
