//! The re-analysis tick and the tick claim against real PostgreSQL: which repositories are stale,
//! what one tick writes, that a duplicate leaves no orphan row, that only the lease holder acts,
//! that concurrent claimers of one tick enqueue once, and that a claimer frozen inside its
//! transaction is cut off instead of blocking the next leader.

#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use chrono::{DateTime, Utc};
use scheduler::reanalyze::{self, ReanalyzeReport, ReanalyzeSettings, TickOutcome};
use scheduler::ticks::{Claim, TickStore};
use sqlx::PgPool;
use support::*;
use testkit::TestDb;

const WEEK: Duration = Duration::from_secs(7 * 24 * 3600);

fn settings(batch: u32) -> ReanalyzeSettings {
    ReanalyzeSettings {
        after: WEEK,
        batch,
        max_attempts: 5,
    }
}

/// An analysis of `repository`: `user` or system, `state`, created and completed `days` ago.
async fn analysis(pool: &PgPool, repository: &str, system: bool, state: &str, days: i32) {
    let user: Option<uuid::Uuid> = if system {
        None
    } else {
        Some(
            sqlx::query_scalar("INSERT INTO users (name, tier) VALUES ('u', 'free') RETURNING id")
                .fetch_one(pool)
                .await
                .unwrap(),
        )
    };
    sqlx::query(
        "INSERT INTO analyses (user_id, repository, commit, state, created_at, completed_at) \
         VALUES ($1, $2, md5(random()::text), $3::text::fairlane_work_state, \
                 now() - make_interval(days => $4), \
                 CASE WHEN $3 = 'completed' THEN now() - make_interval(days => $4) END)",
    )
    .bind(user)
    .bind(repository)
    .bind(state)
    .bind(days)
    .execute(pool)
    .await
    .unwrap();
}

fn tick(s: &str) -> DateTime<Utc> {
    s.parse().unwrap()
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A re-analysis job of `repository` waiting in `analysis_scheduled` (its unique key is what
/// the scheduler checks).
async fn pending_reanalysis(pool: &PgPool, repository: &str) {
    let job = queue::NewJob::from_json(
        "analysis",
        common::Service::Analysis.queue(common::Lane::Scheduled),
        serde_json::json!({}),
    )
    .unwrap()
    .unique_key(reanalyze::unique_key(repository));
    queue::Client::new(pool.clone()).insert(job).await.unwrap();
}

#[tokio::test]
async fn stale_repositories_are_the_stalest_first_skipping_fresh_pending_and_recently_tried_ones() {
    let db = TestDb::new().await;
    let p = &db.pool;
    analysis(p, "https://x.test/ten-days", false, "completed", 10).await;
    analysis(p, "https://x.test/twenty-days", true, "completed", 20).await;
    analysis(p, "https://x.test/yesterday", false, "completed", 1).await;
    // Old, but analysed again recently (by anyone): fresh.
    analysis(p, "https://x.test/refreshed", false, "completed", 30).await;
    analysis(p, "https://x.test/refreshed", false, "completed", 2).await;
    // Old, and a system re-analysis failed two days ago: not tried again for a week.
    analysis(p, "https://x.test/broken", false, "completed", 15).await;
    analysis(p, "https://x.test/broken", true, "failed", 2).await;
    // Old, with a re-analysis job still pending (its row is old too: the job's key decides).
    analysis(p, "https://x.test/pending", false, "completed", 40).await;
    pending_reanalysis(p, "https://x.test/pending").await;
    // Never completed: nothing to refresh.
    analysis(p, "https://x.test/never", false, "failed", 30).await;

    let mut conn = p.acquire().await.unwrap();
    let stale = reanalyze::stale_repositories(&mut conn, WEEK, 10)
        .await
        .unwrap();
    assert_eq!(
        stale,
        ["https://x.test/twenty-days", "https://x.test/ten-days"]
    );
    let stale = reanalyze::stale_repositories(&mut conn, WEEK, 1)
        .await
        .unwrap();
    assert_eq!(
        stale,
        ["https://x.test/twenty-days"],
        "bounded, stalest first"
    );
}

/// A repository whose re-analyses keep failing (deleted, made private) is given up after three
/// in a row, instead of costing a job and a failed record every week for ever; once an analysis
/// of it completes again (a user asks for it), it is kept fresh again.
#[tokio::test]
async fn a_repository_whose_reanalyses_keep_failing_is_given_up_until_it_completes_again() {
    let db = TestDb::new().await;
    let p = &db.pool;
    analysis(p, "https://x.test/o/gone", false, "completed", 60).await;
    for days in [50, 40, 30] {
        analysis(p, "https://x.test/o/gone.git", true, "failed", days).await;
    }
    analysis(p, "https://x.test/o/flaky", false, "completed", 60).await;
    for days in [50, 40] {
        analysis(p, "https://x.test/o/flaky", true, "failed", days).await;
    }
    // Three failures, but before its newest completion: they do not count.
    analysis(p, "https://x.test/o/back", false, "completed", 90).await;
    for days in [80, 70, 60] {
        analysis(p, "https://x.test/o/back", true, "failed", days).await;
    }
    analysis(p, "https://x.test/o/back", false, "completed", 20).await;

    let mut conn = p.acquire().await.unwrap();
    let stale = reanalyze::stale_repositories(&mut conn, WEEK, 10)
        .await
        .unwrap();
    assert_eq!(stale, ["https://x.test/o/flaky", "https://x.test/o/back"]);
}

/// `…/o/r` and `…/o/r.git` are one repository (the cache key): fresh when either spelling was
/// analysed lately, re-analysed once (under the spelling analysed last) when both are stale,
/// and not again while a re-analysis of either spelling is pending. `file://` spellings stay
/// apart.
#[tokio::test]
async fn two_spellings_of_one_repository_are_one_repository() {
    let db = TestDb::new().await;
    let p = &db.pool;
    analysis(p, "https://x.test/o/fresh", false, "completed", 1).await;
    analysis(p, "https://x.test/o/fresh.git", false, "completed", 30).await;
    analysis(p, "https://x.test/o/stale.git", false, "completed", 20).await;
    analysis(p, "https://x.test/o/stale", false, "completed", 25).await;
    analysis(p, "https://x.test/o/tried", false, "completed", 40).await;
    analysis(p, "https://x.test/o/tried.git", true, "failed", 2).await;
    analysis(p, "https://x.test/o/queued.git", false, "completed", 50).await;
    pending_reanalysis(p, "https://x.test/o/queued").await;
    analysis(p, "file:///srv/x", false, "completed", 60).await;
    analysis(p, "file:///srv/x.git", false, "completed", 70).await;

    let mut conn = p.acquire().await.unwrap();
    let stale = reanalyze::stale_repositories(&mut conn, WEEK, 10)
        .await
        .unwrap();
    assert_eq!(
        stale,
        [
            "file:///srv/x.git",
            "file:///srv/x",
            "https://x.test/o/stale.git"
        ]
    );
}

#[tokio::test]
async fn a_tick_enqueues_system_jobs_with_their_rows_once() {
    let db = TestDb::new().await;
    seed_stale_repositories(&db.pool, 3).await;
    lease(&db.pool, "me", true).await;
    let store = TickStore::new(db.pool.clone(), "me", Duration::from_secs(5));
    let t1 = tick("2026-11-24T10:00:00Z");

    let outcome = reanalyze::run_tick(&store, &settings(2), t1).await.unwrap();
    assert_eq!(
        outcome,
        TickOutcome::Done(ReanalyzeReport {
            candidates: 2,
            enqueued: 2,
            duplicates: 0
        })
    );
    // The same tick again (a second replica, a retry): nothing more.
    let again = reanalyze::run_tick(&store, &settings(2), t1).await.unwrap();
    assert_eq!(again, TickOutcome::AlreadyDone);
    assert_eq!(reanalysis_jobs(&db.pool).await.len(), 2);
    // The next tick takes the last stale repository; the queued ones are not queued twice.
    let t2 = tick("2026-11-24T11:00:00Z");
    let next = reanalyze::run_tick(&store, &settings(2), t2).await.unwrap();
    assert_eq!(
        next,
        TickOutcome::Done(ReanalyzeReport {
            candidates: 1,
            enqueued: 1,
            duplicates: 0
        })
    );
    let jobs = reanalysis_jobs(&db.pool).await;
    assert_eq!(jobs.len(), 3);
    assert_eq!(jobs[0].tick_at.as_deref(), Some("2026-11-24T10:00:00Z"));
    assert_eq!(jobs[2].tick_at.as_deref(), Some("2026-11-24T11:00:00Z"));
    let max_attempts: i16 = sqlx::query_scalar("SELECT DISTINCT max_attempts FROM fairlane_job")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(max_attempts, 5);
    let recorded = ticks(&db.pool, "reanalyze").await;
    assert_eq!(recorded.len(), 2);
    assert_eq!(recorded[0].claimed_by, "me");
    assert_eq!(recorded[0].result.as_ref().unwrap()["enqueued"], 2);
    let pending = count(
        &db.pool,
        "SELECT count(*) FROM analyses WHERE user_id IS NULL AND commit IS NULL \
         AND requested_ref IS NULL AND state = 'pending' AND job_id IS NOT NULL",
    )
    .await;
    assert_eq!(pending, 3);
    // Nothing stale is left.
    let t3 = tick("2026-11-24T12:00:00Z");
    let idle = reanalyze::run_tick(&store, &settings(2), t3).await.unwrap();
    assert_eq!(idle, TickOutcome::Done(ReanalyzeReport::default()));
}

#[tokio::test]
async fn a_duplicate_leaves_no_analysis_row() {
    let db = TestDb::new().await;
    let held = "https://x.test/held";
    let job = queue::NewJob::from_json(
        "analysis",
        common::Service::Analysis.queue(common::Lane::Scheduled),
        serde_json::json!({}),
    )
    .unwrap()
    .unique_key(reanalyze::unique_key(held));
    let holder = queue::Client::new(db.pool.clone())
        .insert(job)
        .await
        .unwrap()
        .job;
    let mut tx = db.pool.begin().await.unwrap();
    let report = reanalyze::enqueue(
        &mut tx,
        &[held.to_owned(), "https://x.test/free".to_owned()],
        5,
        tick("2026-11-24T10:00:00Z"),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        report,
        ReanalyzeReport {
            candidates: 2,
            enqueued: 1,
            duplicates: 1
        }
    );
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT repository, job_id FROM analyses")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].0, "https://x.test/free");
    assert_ne!(rows[0].1, holder.id);
}

#[tokio::test]
async fn only_the_lease_holder_claims_by_the_databases_clock() {
    let db = TestDb::new().await;
    seed_stale_repositories(&db.pool, 2).await;
    let store = TickStore::new(db.pool.clone(), "me", Duration::from_secs(5));
    let t = tick("2026-11-24T10:00:00Z");
    // No lease at all, another holder, our own lease expired: nothing happens.
    assert_eq!(
        reanalyze::run_tick(&store, &settings(5), t).await.unwrap(),
        TickOutcome::NotLeader
    );
    lease(&db.pool, "someone-else", true).await;
    assert_eq!(
        reanalyze::run_tick(&store, &settings(5), t).await.unwrap(),
        TickOutcome::NotLeader
    );
    lease(&db.pool, "me", false).await;
    assert_eq!(
        reanalyze::run_tick(&store, &settings(5), t).await.unwrap(),
        TickOutcome::NotLeader
    );
    assert!(reanalysis_jobs(&db.pool).await.is_empty());
    assert!(ticks(&db.pool, "reanalyze").await.is_empty());
    lease(&db.pool, "me", true).await;
    assert!(matches!(
        reanalyze::run_tick(&store, &settings(5), t).await.unwrap(),
        TickOutcome::Done(_)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_that_all_believe_they_lead_still_enqueue_a_tick_once() {
    let db = TestDb::new().await;
    seed_stale_repositories(&db.pool, 50).await;
    // The worst case: every claimer passes the fence (same identity, as a paused leader and its
    // own restarted self could); only the tick's primary key stands between them.
    lease(&db.pool, "me", true).await;
    for round in 0..5 {
        let t = tick("2026-11-24T10:00:00Z") + chrono::Duration::seconds(round);
        let mut claimers = tokio::task::JoinSet::new();
        for _ in 0..4 {
            let store = TickStore::new(db.pool.clone(), "me", Duration::from_secs(5));
            claimers.spawn(async move { reanalyze::run_tick(&store, &settings(3), t).await });
        }
        let mut done = 0;
        while let Some(outcome) = claimers.join_next().await {
            match outcome.unwrap().unwrap() {
                TickOutcome::Done(report) => {
                    assert_eq!(report.enqueued, 3);
                    done += 1;
                }
                TickOutcome::AlreadyDone => {}
                TickOutcome::NotLeader => panic!("the lease is ours"),
            }
        }
        assert_eq!(done, 1, "round {round}: exactly one claimer enqueued");
    }
    let jobs = reanalysis_jobs(&db.pool).await;
    assert_eq!(jobs.len(), 15);
    let analyses = count(
        &db.pool,
        "SELECT count(*) FROM analyses WHERE state = 'pending'",
    )
    .await;
    assert_eq!(analyses, 15, "no orphan rows from the claimers that lost");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimer_frozen_in_its_transaction_is_cut_off_and_the_tick_stays_available() {
    let db = TestDb::new().await;
    lease(&db.pool, "me", true).await;
    let t = tick("2026-11-24T10:00:00Z");
    let frozen = TickStore::new(db.pool.clone(), "me", Duration::from_millis(300));
    let mut tx = frozen.begin().await.unwrap();
    assert_eq!(
        frozen.claim(&mut tx, "reanalyze", t).await.unwrap(),
        Claim::Claimed
    );
    // It stops talking to the database for longer than the lease TTL (a paused process).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        tx.commit().await.is_err(),
        "the server ended the frozen session"
    );
    // The tick was never done, and the lease row is not locked: the next leader claims it.
    let next = TickStore::new(db.pool.clone(), "me", Duration::from_secs(5));
    let mut tx = next.begin().await.unwrap();
    assert_eq!(
        next.claim(&mut tx, "reanalyze", t).await.unwrap(),
        Claim::Claimed
    );
    tx.commit().await.unwrap();
    assert_eq!(
        next.frontier("reanalyze").await.unwrap().last_done,
        Some(t),
        "the frontier is where a new leader resumes"
    );
}

/// The cut-off is a third of the TTL: the tick's share lock holds back the leader's renewals, so
/// a leader frozen mid-tick up to a third of the TTL after its last renewal must have let go by
/// the time its lease expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimer_frozen_for_a_third_of_the_ttl_is_cut_off() {
    let db = TestDb::new().await;
    lease(&db.pool, "me", true).await;
    let frozen = TickStore::new(db.pool.clone(), "me", Duration::from_secs(3));
    let mut tx = frozen.begin().await.unwrap();
    assert_eq!(
        frozen
            .claim(&mut tx, "reanalyze", tick("2026-11-24T10:00:00Z"))
            .await
            .unwrap(),
        Claim::Claimed
    );
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert!(
        tx.commit().await.is_err(),
        "the server ended the session frozen for more than a third of the TTL"
    );
}

/// The fence reads the lease against the database's clock at the claim, not at the start of the
/// transaction: a transaction begun under a lease that lapsed while it did its reads claims
/// nothing.
#[tokio::test]
async fn a_lease_that_lapsed_during_the_transaction_fences_the_claim() {
    let db = TestDb::new().await;
    sqlx::query(
        "INSERT INTO fairlane_leader (name, leader_id, expires_at) \
         VALUES ('scheduler', 'me', clock_timestamp() + interval '2 seconds')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // A TTL whose third (the transaction's idle limit) outlasts the wait below.
    let store = TickStore::new(db.pool.clone(), "me", Duration::from_secs(15));
    let mut tx = store.begin().await.unwrap();
    // The transaction began under the lease (`now()` is its start)…
    let began_leading: bool = sqlx::query_scalar(
        "SELECT now() < expires_at FROM fairlane_leader WHERE name = 'scheduler'",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert!(
        began_leading,
        "the lease lapsed before the transaction began"
    );
    // …which lapses before the claim.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        store
            .claim(&mut tx, "reanalyze", tick("2026-11-24T10:00:00Z"))
            .await
            .unwrap(),
        Claim::NotLeader
    );
}
