//! `Maintainer`: queue maintenance in a process that works no queue. It must do what an engine's
//! maintenance does (promote, rescue with the client's hooks, clean), take part in the same
//! election, and hand the lease over at once when it shuts down.

#![allow(clippy::unwrap_used)]

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use queue::maintenance::MAINTENANCE_LEASE;
use queue::notifier::Notifier;
use queue::{
    BoxError, Client, FailureKind, JobState, Maintainer, NewJob, Transition, TransitionHook,
};
use sqlx::PgConnection;
use support::*;
use testkit::TestDb;
use tokio_util::sync::CancellationToken;

/// Records every transition it is shown.
#[derive(Default)]
struct Recorder(Mutex<Vec<Transition>>);

#[async_trait]
impl TransitionHook for Recorder {
    async fn on_transitions(
        &self,
        _conn: &mut PgConnection,
        transitions: &[Transition],
    ) -> Result<(), BoxError> {
        self.0.lock().unwrap().extend_from_slice(transitions);
        Ok(())
    }
}

struct RunningMaintainer {
    shutdown: CancellationToken,
    handle: tokio::task::JoinHandle<()>,
    leader: queue::LeaderHandle,
}

impl RunningMaintainer {
    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), self.handle)
            .await
            .expect("maintainer did not stop")
            .unwrap();
    }
}

fn start_maintainer(client: &Client, id: &str) -> RunningMaintainer {
    let mut notifier = Notifier::new();
    let (maintainer, leader) = Maintainer::new(client, fast_config(), id, &mut notifier).unwrap();
    let shutdown = CancellationToken::new();
    let pool = client.pool().clone();
    let notifier_stop = shutdown.clone();
    let run_stop = shutdown.clone();
    let handle = tokio::spawn(async move {
        tokio::join!(notifier.run(pool, notifier_stop), maintainer.run(run_stop));
    });
    RunningMaintainer {
        shutdown,
        handle,
        leader,
    }
}

async fn lease_holder(pool: &sqlx::PgPool) -> Option<String> {
    sqlx::query_scalar("SELECT leader_id FROM fairlane_leader WHERE name = $1")
        .bind(MAINTENANCE_LEASE)
        .fetch_optional(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_maintainer_promotes_rescues_with_the_clients_hooks_and_cleans() {
    let db = TestDb::new().await;
    let recorder = Arc::new(Recorder::default());
    let client = Client::new(db.pool.clone()).with_hooks(vec![recorder.clone()]);
    // A worker that died holding a job.
    sqlx::query(
        "INSERT INTO fairlane_worker (id, hostname, pid, heartbeat_at) \
         VALUES ('dead-worker', 'h', 1, now() - interval '1 hour')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let stuck = client
        .insert(NewJob::new(q("q"), &Noop {}).unwrap())
        .await
        .unwrap()
        .job;
    sqlx::query(
        "UPDATE fairlane_job SET state = 'running', attempt = 1, attempted_at = now(), \
         attempted_by = '{dead-worker}' WHERE id = $1",
    )
    .bind(stuck.id)
    .execute(&db.pool)
    .await
    .unwrap();
    // A snoozed job that is due, and a completed job past its retention.
    let due = client
        .insert(
            NewJob::new(q("q"), &Noop {})
                .unwrap()
                .scheduled_at(chrono::Utc::now() + chrono::Duration::hours(1)),
        )
        .await
        .unwrap()
        .job;
    assert_eq!(due.state, JobState::Scheduled);
    sqlx::query("UPDATE fairlane_job SET scheduled_at = now() - interval '1 second' WHERE id = $1")
        .bind(due.id)
        .execute(&db.pool)
        .await
        .unwrap();
    let old = client
        .insert(NewJob::new(q("q"), &Noop {}).unwrap())
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

    let m = start_maintainer(&client, "maintainer-a");
    let rescued = job_in_state(
        &client,
        stuck.id,
        JobState::Available,
        Duration::from_secs(15),
        "stuck job rescued",
    )
    .await;
    assert_eq!(rescued.attempt_errors()[0].kind, FailureKind::Rescued);
    eventually(Duration::from_secs(5), "due job promoted", || async {
        (client.job(due.id).await.unwrap().unwrap().state == JobState::Available).then_some(())
    })
    .await;
    eventually(Duration::from_secs(5), "old job cleaned", || async {
        client.job(old.id).await.unwrap().is_none().then_some(())
    })
    .await;
    assert!(m.leader.is_leader());
    let seen = recorder.0.lock().unwrap().clone();
    assert!(
        seen.iter()
            .any(|t| t.job_id == stuck.id && t.state == JobState::Available),
        "the rescue ran the client's hooks: {seen:?}"
    );
    assert_eq!(
        lease_holder(&db.pool).await.as_deref(),
        Some("maintainer-a")
    );
    m.stop().await;
    assert_eq!(lease_holder(&db.pool).await, None, "resigned on shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_maintainers_elect_one_leader_and_hand_over_on_shutdown() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let a = start_maintainer(&client, "maintainer-a");
    eventually(Duration::from_secs(5), "a leads", || async {
        a.leader.is_leader().then_some(())
    })
    .await;
    let b = start_maintainer(&client, "maintainer-b");
    // b campaigns for a while without winning.
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!b.leader.is_leader(), "two leaders at once");
    }
    a.stop().await;
    // The resignation is announced: b takes over without waiting for the 1 s lease to expire
    // (the bound here only guards against a hang; hand-over speed is asserted in the scheduler's
    // process tests).
    eventually(
        Duration::from_secs(5),
        "b leads after a resigned",
        || async { b.leader.is_leader().then_some(()) },
    )
    .await;
    assert_eq!(
        lease_holder(&db.pool).await.as_deref(),
        Some("maintainer-b")
    );
    b.stop().await;
}

#[tokio::test]
async fn an_invalid_config_is_refused() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let config = queue::EngineConfig {
        heartbeat_interval: Duration::from_secs(30),
        ..fast_config()
    };
    let err = Maintainer::new(&client, config, "m", &mut Notifier::new()).unwrap_err();
    assert!(err.to_string().contains("heartbeat_interval"), "{err}");
}
