//! SPEC §5's race, end to end: a user at 4,998 of 5,000 sends 200 concurrent analysis requests;
//! exactly two are accepted, every other one is refused with `quota_exceeded`, in every round,
//! with one `web` process and with two sharing the database.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use support::{
    Http, TestServer, analysis_body, config, count, seed_usage, spawn_web, user_with_key,
};
use testkit::TestDb;
use uuid::Uuid;

const REQUESTS: u64 = 200;
const ROUNDS: u64 = 20;

async fn reset(pool: &PgPool, user: Uuid) {
    for table in [
        "usage_events",
        "quota_reservations",
        "fairlane_job",
        "analyses",
    ] {
        sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM {table}")))
            .execute(pool)
            .await
            .unwrap();
    }
    seed_usage(pool, user, "analysis", 4998).await;
}

/// One round: 200 concurrent requests spread over `servers`; checks the outcome.
async fn round(pool: &PgPool, servers: &[Http], key: &str, round: u64) {
    let mut tasks = Vec::new();
    for i in 0..REQUESTS {
        let http = servers[(i as usize) % servers.len()].clone();
        let key = key.to_owned();
        tasks.push(tokio::spawn(async move {
            http.post_json("/v1/analyses", &key, &analysis_body(round * 1000 + i))
                .await
        }));
    }
    let mut accepted = 0;
    let mut refused = 0;
    for t in tasks {
        let r = t.await.unwrap();
        match r.status.as_u16() {
            202 => {
                accepted += 1;
                let body = r.json();
                assert_eq!(body["job"]["queue"], "analysis_priority");
                assert!(body["job"]["id"].is_i64());
            }
            429 => {
                refused += 1;
                let body = r.problem(429, "quota_exceeded");
                assert_eq!(body["used"], 4998);
                assert_eq!(body["reserved"], 2);
                assert_eq!(body["limit"], 5000);
                assert_eq!(body["event_type"], "analysis");
                let period_end: DateTime<Utc> =
                    body["period_end"].as_str().unwrap().parse().unwrap();
                let retry: i64 = r.header("retry-after").unwrap().parse().unwrap();
                let to_end = (period_end - Utc::now()).num_seconds();
                assert!(
                    retry >= 1 && retry <= to_end + 2,
                    "Retry-After {retry}, period ends in {to_end} s"
                );
            }
            other => panic!("unexpected {other}: {}", r.text()),
        }
    }
    assert_eq!((accepted, refused), (2, REQUESTS - 2), "round {round}");
    // Never an overage, and nothing half-written.
    let (reserved,): (i64,) =
        sqlx::query_as("SELECT COALESCE(SUM(reserved_amount), 0)::int8 FROM quota_reservations")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(reserved, 2);
    assert_eq!(count(pool, "fairlane_job").await, 2);
    assert_eq!(count(pool, "analyses").await, 2);
    assert_eq!(
        count(pool, "quota_reservations WHERE job_id IS NULL").await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_process_never_exceeds_the_quota() {
    let db = TestDb::new().await;
    let server = TestServer::start(config(&db)).await;
    let (user, key) = user_with_key(&db.pool, "enterprise").await;
    for n in 0..ROUNDS {
        reset(&db.pool, user).await;
        round(&db.pool, std::slice::from_ref(&server.http), &key, n).await;
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_processes_sharing_the_database_never_exceed_the_quota() {
    let db = TestDb::new().await;
    let (_a, http_a) = spawn_web(&db, &[]).await;
    let (_b, http_b) = spawn_web(&db, &[]).await;
    let (user, key) = user_with_key(&db.pool, "enterprise").await;
    for n in 0..ROUNDS {
        reset(&db.pool, user).await;
        round(&db.pool, &[http_a.clone(), http_b.clone()], &key, n).await;
    }
}
