//! Coordination through PostgreSQL: leader election and the notification listener: what a holder's
//! handle tells when a renewal is late, and what the listener tells once it listens.

#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use queue::LeaderElector;
use queue::notifier::Notifier;
use support::eventually;
use testkit::TestDb;
use tokio_util::sync::CancellationToken;

/// A renewal held up past the lease's validity (here by a lock on the lease row, as a long
/// fenced transaction holds it) leaves the handle not leader meanwhile; when it then succeeds,
/// whoever waits for a change is woken, so work skipped during the gap is done at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_renewal_that_restores_leadership_wakes_the_waiters() {
    let db = TestDb::new().await;
    let mut notifier = Notifier::new();
    let (elector, handle) = LeaderElector::new(
        db.pool.clone(),
        "late",
        "me",
        Duration::from_millis(600),
        &mut notifier,
    );
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(elector.run(shutdown.clone()));
    let mut waiter = handle.clone();
    let became = tokio::time::timeout(Duration::from_secs(10), waiter.changed())
        .await
        .expect("became leader");
    assert!(became && handle.is_leader());

    let mut blocker = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM fairlane_leader WHERE name = 'late' FOR UPDATE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    eventually(Duration::from_secs(10), "leadership lapsed", || async {
        (!handle.is_leader()).then_some(())
    })
    .await;
    let woken = tokio::spawn(async move { waiter.changed().await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    blocker.commit().await.unwrap();

    let leader = tokio::time::timeout(Duration::from_secs(5), woken)
        .await
        .expect("the waiter was woken when the renewal restored leadership")
        .unwrap();
    assert!(leader);
    assert!(handle.is_leader());
    shutdown.cancel();
    running.await.unwrap();
}

/// Notifications sent before the listener's LISTEN took effect are lost; the listener tells
/// every subscriber so once it listens, on its first connection too, so that a producer fetches
/// again instead of waiting for its poll.
#[tokio::test]
async fn the_listener_tells_its_subscribers_what_it_may_have_missed_once_it_listens() {
    let db = TestDb::new().await;
    let missed = Arc::new(AtomicUsize::new(0));
    let mut notifier = Notifier::new();
    {
        let missed = Arc::clone(&missed);
        notifier.subscribe(
            "some_queue",
            Arc::new(move |payload: Option<&str>| {
                if payload.is_none() {
                    missed.fetch_add(1, Ordering::SeqCst);
                }
            }),
        );
    }
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(notifier.run(db.pool.clone(), shutdown.clone()));
    eventually(
        Duration::from_secs(10),
        "told of missed notifications",
        || async { (missed.load(Ordering::SeqCst) >= 1).then_some(()) },
    )
    .await;
    let listening: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND query ILIKE 'LISTEN%'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(listening, 1, "told once it listens");
    shutdown.cancel();
    running.await.unwrap();
}
