//! Leader election against real PostgreSQL: what a holder's handle tells when a renewal is late.

#![allow(clippy::unwrap_used)]

mod support;

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
