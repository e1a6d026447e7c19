//! One scheduler replica acts, with real processes: two schedulers enqueue each tick once; the
//! other replica takes over after `kill -9` of the leader within the takeover bound, after
//! SIGTERM within 2 s (plus slack; its lease is 30 s), and after a pause (SIGSTOP) without the
//! paused leader acting again; and a scheduler started before the migrations waits for them.
//! Every run checks that each tick was done exactly once (consecutive ticks, one job each).

#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use nix::sys::signal::Signal;
use support::*;
use testkit::TestDb;

/// A slow machine's scheduling noise on top of a bound (2 cores shared with builds).
const SLACK: Duration = Duration::from_secs(2);

async fn wait_ticks_by(db: &TestDb, candidate: &str, n: usize) {
    eventually(
        Duration::from_secs(30),
        &format!("{n} ticks by {candidate}"),
        || async {
            let done = ticks(&db.pool, "reanalyze")
                .await
                .iter()
                .filter(|t| t.claimed_by == candidate)
                .count();
            (done >= n).then_some(())
        },
    )
    .await;
}

/// The first re-analysis tick claimed by `candidate` after `since`, as (tick, claimed_at).
async fn first_claim_after(
    db: &TestDb,
    candidate: &str,
    since: chrono::DateTime<chrono::Utc>,
) -> chrono::DateTime<chrono::Utc> {
    eventually(
        Duration::from_secs(30),
        &format!("a tick claimed by {candidate}"),
        || async {
            ticks(&db.pool, "reanalyze")
                .await
                .into_iter()
                .filter(|t| t.claimed_by == candidate && t.claimed_at >= since)
                .map(|t| t.claimed_at)
                .min()
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_schedulers_enqueue_each_tick_exactly_once() {
    let db = TestDb::new().await;
    seed_stale_repositories(&db.pool, 200).await;
    let mut a = Scheduler::spawn("scheduler-a", &db.url(), &[]);
    let mut b = Scheduler::spawn("scheduler-b", &db.url(), &[]);
    let id_a = a.wait_running().await;
    let id_b = b.wait_running().await;
    eventually(Duration::from_secs(30), "eight ticks", || async {
        (ticks(&db.pool, "reanalyze").await.len() >= 8).then_some(())
    })
    .await;
    // Exactly one of them leads and says so.
    let (sa, sb) = (a.status().await, b.status().await);
    assert_ne!(
        sa["scheduler_leader"], sb["scheduler_leader"],
        "one leader: {sa} {sb}"
    );
    assert!(a.child.terminate(Duration::from_secs(20)).await.success());
    assert!(b.child.terminate(Duration::from_secs(20)).await.success());

    let ticks = assert_each_tick_once(&db.pool).await;
    assert!(ticks.len() >= 8);
    let actors: std::collections::BTreeSet<&str> =
        ticks.iter().map(|t| t.claimed_by.as_str()).collect();
    assert_eq!(actors.len(), 1, "only the leader acted: {actors:?}");
    assert!(actors.contains(id_a.as_str()) || actors.contains(id_b.as_str()));
    // The cleanup task too: consecutive ticks, each claimed once, all by the same replica.
    let cleanups = support::ticks(&db.pool, "reservation-cleanup").await;
    assert!(cleanups.len() >= 8);
    for pair in cleanups.windows(2) {
        assert_eq!(
            pair[1].tick_at - pair[0].tick_at,
            chrono::Duration::seconds(1)
        );
    }
    assert!(
        cleanups
            .iter()
            .all(|t| actors.contains(t.claimed_by.as_str()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_kill_9_of_the_leader_the_other_acts_within_the_takeover_bound() {
    let db = TestDb::new().await;
    seed_stale_repositories(&db.pool, 200).await;
    let ttl = "3s";
    let mut a = Scheduler::spawn("leader", &db.url(), &[("SCHEDULER_LEASE_TTL", ttl)]);
    let id_a = a.wait_running().await;
    wait_ticks_by(&db, &id_a, 2).await;
    let mut b = Scheduler::spawn("standby", &db.url(), &[("SCHEDULER_LEASE_TTL", ttl)]);
    let id_b = b.wait_running().await;
    wait_ticks_by(&db, &id_a, 4).await;
    assert_eq!(
        current_leader(&db.pool).await.as_deref(),
        Some(id_a.as_str())
    );

    let killed_at = db_now(&db.pool).await;
    a.child.kill_9().await;
    let acted_at = first_claim_after(&db, &id_b, killed_at).await;
    let took = (acted_at - killed_at).to_std().unwrap();
    let config: scheduler::Config =
        common::config::load_from(None, [("SCHEDULER_LEASE_TTL".to_owned(), ttl.to_owned())])
            .unwrap();
    let bound = config.takeover_bound();
    eprintln!("kill -9: the standby acted {took:?} after the leader died (bound {bound:?})");
    assert!(
        took <= bound + SLACK,
        "took {took:?}, bound {bound:?} + {SLACK:?}"
    );
    assert!(took <= Duration::from_secs(15), "the issue's bound");
    // The standby caught up what the dead leader missed: still every tick exactly once.
    wait_ticks_by(&db, &id_b, 3).await;
    assert!(b.child.terminate(Duration::from_secs(20)).await.success());
    let ticks = assert_each_tick_once(&db.pool).await;
    assert!(
        ticks
            .iter()
            .filter(|t| t.claimed_by == id_a)
            .all(|t| t.claimed_at <= killed_at),
        "the dead leader did not act after its death"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_sigterm_of_the_leader_the_other_acts_within_two_seconds() {
    let db = TestDb::new().await;
    seed_stale_repositories(&db.pool, 200).await;
    // A lease far longer than 2 s: only the resignation can explain a quick hand-over.
    let ttl = "30s";
    let mut a = Scheduler::spawn("leader", &db.url(), &[("SCHEDULER_LEASE_TTL", ttl)]);
    let id_a = a.wait_running().await;
    wait_ticks_by(&db, &id_a, 2).await;
    let mut b = Scheduler::spawn("standby", &db.url(), &[("SCHEDULER_LEASE_TTL", ttl)]);
    let id_b = b.wait_running().await;
    wait_ticks_by(&db, &id_a, 4).await;

    let signalled_at = db_now(&db.pool).await;
    a.child.signal(Signal::SIGTERM);
    let acted_at = first_claim_after(&db, &id_b, signalled_at).await;
    let took = (acted_at - signalled_at).to_std().unwrap();
    eprintln!("SIGTERM: the standby acted {took:?} after the leader was told to stop");
    assert!(took <= Duration::from_secs(2) + SLACK, "took {took:?}");
    let status = tokio::time::timeout(Duration::from_secs(20), a.child.wait())
        .await
        .expect("the old leader exits");
    assert!(status.success(), "{status:?}");
    let elected_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT elected_at FROM fairlane_leader WHERE name = 'scheduler'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!((elected_at - signalled_at).to_std().unwrap() <= Duration::from_secs(2) + SLACK);
    assert_eq!(
        current_leader(&db.pool).await.as_deref(),
        Some(id_b.as_str())
    );
    wait_ticks_by(&db, &id_b, 3).await;
    assert!(b.child.terminate(Duration::from_secs(20)).await.success());
    assert_each_tick_once(&db.pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_leader_stops_acting_once_its_lease_is_gone() {
    let db = TestDb::new().await;
    seed_stale_repositories(&db.pool, 200).await;
    let mut a = Scheduler::spawn("leader", &db.url(), &[]);
    let id_a = a.wait_running().await;
    wait_ticks_by(&db, &id_a, 2).await;
    let mut b = Scheduler::spawn("standby", &db.url(), &[]);
    let id_b = b.wait_running().await;
    wait_ticks_by(&db, &id_a, 3).await;

    let paused_at = db_now(&db.pool).await;
    a.child.signal(Signal::SIGSTOP);
    first_claim_after(&db, &id_b, paused_at).await;
    wait_ticks_by(&db, &id_b, 2).await;
    a.child.signal(Signal::SIGCONT);
    // The woken replica finds its lease gone and stays a follower while b keeps acting.
    let resumed_at = db_now(&db.pool).await;
    eventually(Duration::from_secs(10), "b acts after a woke", || async {
        let later = ticks(&db.pool, "reanalyze")
            .await
            .iter()
            .filter(|t| t.claimed_by == id_b && t.claimed_at > resumed_at)
            .count();
        (later >= 3).then_some(())
    })
    .await;
    assert_eq!(a.status().await["scheduler_leader"], false);
    assert!(a.child.terminate(Duration::from_secs(20)).await.success());
    assert!(b.child.terminate(Duration::from_secs(20)).await.success());
    let ticks = assert_each_tick_once(&db.pool).await;
    let late: Vec<_> = ticks
        .iter()
        .filter(|t| t.claimed_by == id_a && t.claimed_at > paused_at)
        .collect();
    assert!(late.is_empty(), "the paused leader acted: {late:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_started_before_the_migrations_waits_for_them() {
    // An empty database, not cloned from the migrated template. Named like testkit's (a v7 id
    // is this run's: `cargo xtask` drops leftover test databases by their id's age).
    let name = format!("fairlane_test_{}", uuid::Uuid::now_v7().simple());
    let server: sqlx::postgres::PgConnectOptions = testkit::database_url().parse().unwrap();
    let admin = sqlx::PgPool::connect_with(server.clone()).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&admin)
        .await
        .unwrap();
    let options = server.database(&name);
    let pool = sqlx::PgPool::connect_with(options.clone()).await.unwrap();
    let mut url = sqlx::ConnectOptions::to_url_lossy(&options);
    url.set_path(&format!("/{name}"));

    let mut s = Scheduler::spawn("early", url.as_str(), &[]);
    let status = s.status().await;
    assert_eq!(status["running"], false);
    assert_eq!(s.get("/healthz").await.unwrap().0, 200);
    let (code, body) = s.get("/readyz").await.unwrap();
    assert_eq!(code, 503, "{body}");

    schema::migrate(&pool).await.unwrap();
    eventually(Duration::from_secs(30), "ready once migrated", || async {
        (s.get("/readyz").await?.0 == 200).then_some(())
    })
    .await;
    let id = s.wait_running().await;
    eventually(Duration::from_secs(30), "a cleanup tick", || async {
        let t = ticks(&pool, "reservation-cleanup").await;
        t.iter().any(|t| t.claimed_by == id).then_some(())
    })
    .await;
    assert!(s.child.terminate(Duration::from_secs(20)).await.success());
    pool.close().await;
}
