//! The queue-depth gauge of a real scheduler process equals the database's counts per queue and
//! state (and follows them, reading 0 for a state that empties); the reservations gauge equals
//! the live reservations; only the leader exports them.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use common::Service;
use queue::{Client, NewJob, QueueName};
use quota::{Quota, QuotaConfig};
use support::*;
use testkit::TestDb;

type Depths = BTreeMap<(String, String), i64>;

async fn db_depths(db: &TestDb) -> Depths {
    let rows: Vec<(String, String, i64)> =
        sqlx::query_as("SELECT queue::text, state::text, count(*) FROM fairlane_job GROUP BY 1, 2")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    rows.into_iter().map(|(q, s, n)| ((q, s), n)).collect()
}

fn gauge(samples: &[Sample], name: &str) -> Depths {
    samples
        .iter()
        .filter(|s| s.name == name)
        .map(|s| {
            (
                (
                    s.labels.get("queue").cloned().unwrap_or_default(),
                    s.labels.get("state").cloned().unwrap_or_default(),
                ),
                s.value as i64,
            )
        })
        .collect()
}

/// The gauge equals the database: every (queue, state) the database has, with its count, and
/// every other series the gauge exports is 0.
fn matches(gauge: &Depths, db: &Depths) -> bool {
    db.iter().all(|(k, n)| gauge.get(k) == Some(n))
        && gauge
            .iter()
            .all(|(k, n)| db.get(k).copied().unwrap_or(0) == *n)
}

async fn insert(client: &Client, queue: &str, n: usize) -> Vec<i64> {
    let mut ids = Vec::new();
    for _ in 0..n {
        let job =
            NewJob::from_json("k", QueueName::new(queue).unwrap(), serde_json::json!({})).unwrap();
        ids.push(client.insert(job).await.unwrap().job.id);
    }
    ids
}

async fn set_state(db: &TestDb, ids: &[i64], state: &str) {
    sqlx::query(
        "UPDATE fairlane_job SET state = $2::text::fairlane_job_state, \
           finalized_at = CASE WHEN $2 IN ('completed', 'cancelled', 'discarded') THEN now() END, \
           scheduled_at = CASE WHEN $2 IN ('scheduled', 'retryable') THEN now() + interval '1 hour' \
                               ELSE scheduled_at END, \
           attempt = CASE WHEN $2 = 'available' THEN 0 ELSE 1 END, \
           attempted_by = CASE WHEN $2 = 'available' THEN '{}'::text[] ELSE '{some-worker}'::text[] END \
         WHERE id = ANY($1)",
    )
    .bind(ids)
    .bind(state)
    .execute(&db.pool)
    .await
    .unwrap();
}

/// Nothing changes the jobs behind the test's back: no maintenance, no re-analysis, no cleanup.
const QUIET: [(&str, &str); 3] = [
    ("QUEUE_MAINTENANCE", "false"),
    ("REANALYZE_ENABLED", "false"),
    ("RESERVATION_CLEANUP_SCHEDULE", "0 0 1 1 *"),
];

/// A quiet scheduler on `url`, once it leads.
async fn quiet_leader(name: &str, url: &str) -> Scheduler {
    let leader = Scheduler::spawn(name, url, &QUIET);
    eventually(Duration::from_secs(30), "leader elected", || async {
        (leader.status().await["scheduler_leader"] == true).then_some(())
    })
    .await;
    leader
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_depth_gauge_equals_the_database_counts_and_only_the_leader_exports_it() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    insert(&client, "analysis_default", 3).await;
    let scheduled = insert(&client, "specview_priority", 2).await;
    set_state(&db, &scheduled, "scheduled").await;
    let retryable = insert(&client, "reports", 2).await;
    set_state(&db, &retryable, "retryable").await;
    let running = insert(&client, "reports", 1).await;
    set_state(&db, &running, "running").await;
    let completed = insert(&client, "analysis_scheduled", 4).await;
    set_state(&db, &completed, "completed").await;
    let cancelled = insert(&client, "reports", 1).await;
    set_state(&db, &cancelled, "cancelled").await;
    let discarded = insert(&client, "analysis_priority", 1).await;
    set_state(&db, &discarded, "discarded").await;
    // Reservations: one live (waiting job), one of a finished job (not live).
    let user: uuid::Uuid =
        sqlx::query_scalar("INSERT INTO users (name, tier) VALUES ('u', 'pro') RETURNING id")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let quota = Quota::new(QuotaConfig::default()).unwrap();
    for job in [scheduled[0], completed[0]] {
        let mut tx = db.pool.begin().await.unwrap();
        let grant = quota
            .check(&mut tx, user, Service::Analysis, chrono::Utc::now())
            .await
            .unwrap();
        grant.reserve(&mut tx, Some(job)).await.unwrap();
        tx.commit().await.unwrap();
    }

    let mut leader = quiet_leader("leader", &db.url()).await;
    let mut follower = Scheduler::spawn("follower", &db.url(), &QUIET);
    follower.wait_running().await;

    let expected = db_depths(&db).await;
    let exported = eventually(
        Duration::from_secs(20),
        "gauge equals the database",
        || async {
            let g = gauge(&leader.metrics().await, "fairlane_queue_jobs");
            matches(&g, &expected).then_some(g)
        },
    )
    .await;
    // Every standard queue reports every state, zeros included.
    for service in Service::ALL {
        for q in service.queues() {
            for state in queue::JobState::ALL {
                assert!(
                    exported.contains_key(&(q.to_string(), state.as_str().to_owned())),
                    "{q} {state} missing"
                );
            }
        }
    }
    assert_eq!(exported[&("reports".to_owned(), "running".to_owned())], 1);
    assert_eq!(
        exported[&("analysis_scheduled".to_owned(), "completed".to_owned())],
        4
    );

    // The counts move: retryable jobs go away, the running one completes, new jobs arrive.
    sqlx::query("DELETE FROM fairlane_job WHERE id = ANY($1)")
        .bind(&retryable)
        .execute(&db.pool)
        .await
        .unwrap();
    set_state(&db, &running, "completed").await;
    insert(&client, "analysis_default", 2).await;
    let expected = db_depths(&db).await;
    let exported = eventually(
        Duration::from_secs(20),
        "gauge follows the database",
        || async {
            let g = gauge(&leader.metrics().await, "fairlane_queue_jobs");
            matches(&g, &expected).then_some(g)
        },
    )
    .await;
    assert_eq!(
        exported.get(&("reports".to_owned(), "retryable".to_owned())),
        Some(&0),
        "a state that emptied reads 0"
    );
    assert_eq!(
        exported[&("analysis_default".to_owned(), "available".to_owned())],
        5
    );

    // Live reservations per event type.
    let reservations = |samples: &[Sample]| -> BTreeMap<String, f64> {
        samples
            .iter()
            .filter(|s| s.name == "fairlane_quota_reservations_active")
            .map(|s| (s.labels["event_type"].clone(), s.value))
            .collect()
    };
    let m = leader.metrics().await;
    assert_eq!(
        reservations(&m),
        BTreeMap::from([("analysis".to_owned(), 1.0), ("specview".to_owned(), 0.0)])
    );
    let is_leader = |samples: &[Sample]| {
        samples
            .iter()
            .find(|s| {
                s.name == "fairlane_scheduler_leader"
                    && s.labels.get("lease").map(String::as_str) == Some("scheduler")
            })
            .map(|s| s.value)
    };
    assert_eq!(is_leader(&m), Some(1.0));

    // The follower exports none of the counts.
    let f = follower.metrics().await;
    assert!(
        gauge(&f, "fairlane_queue_jobs").is_empty(),
        "follower exports depths"
    );
    assert!(reservations(&f).is_empty());
    assert_eq!(is_leader(&f), Some(0.0));

    // When the leader goes, the follower takes over the gauge.
    assert!(
        leader
            .child
            .terminate(Duration::from_secs(20))
            .await
            .success()
    );
    let expected = db_depths(&db).await;
    eventually(
        Duration::from_secs(20),
        "the new leader exports",
        || async {
            let g = gauge(&follower.metrics().await, "fairlane_queue_jobs");
            matches(&g, &expected).then_some(())
        },
    )
    .await;
    assert!(
        follower
            .child
            .terminate(Duration::from_secs(20))
            .await
            .success()
    );
}

/// A leader whose count of final jobs fails (here: its role may not read `finalized_at`) still
/// exports the live counts, and exports no final-state counts rather than stale ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_counts_are_exported_when_the_final_count_fails() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    insert(&client, "analysis_default", 2).await;
    let done = insert(&client, "reports", 1).await;
    set_state(&db, &done, "completed").await;
    // Roles belong to the server, so this one is named after the test's database.
    let role = format!("{}_blind", db.name);
    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT quote_ident(column_name::text) FROM information_schema.columns \
         WHERE table_name = 'fairlane_job' AND column_name <> 'finalized_at'",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE ROLE {role} LOGIN PASSWORD 'blind'; \
         GRANT USAGE ON SCHEMA public TO {role}; \
         GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}; \
         GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}; \
         REVOKE ALL ON fairlane_job FROM {role}; \
         GRANT SELECT ({}), INSERT, UPDATE, DELETE ON fairlane_job TO {role};",
        columns.join(", ")
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let url = format!(
        "postgres://{role}:blind@{}/{}",
        db.server_address(),
        db.name
    );
    let mut leader = quiet_leader("blind-leader", &url).await;

    let live_only = |depths: &Depths| -> Depths {
        depths
            .iter()
            .filter(|((_, state), _)| {
                !["completed", "cancelled", "discarded"].contains(&state.as_str())
            })
            .map(|(k, n)| (k.clone(), *n))
            .collect()
    };
    for round in ["first", "after new jobs"] {
        if round != "first" {
            insert(&client, "analysis_default", 5).await;
        }
        let expected = live_only(&db_depths(&db).await);
        let exported = eventually(Duration::from_secs(20), round, || async {
            let g = gauge(&leader.metrics().await, "fairlane_queue_jobs");
            matches(&g, &expected).then_some(g)
        })
        .await;
        assert!(
            exported.keys().all(
                |(_, state)| !["completed", "cancelled", "discarded"].contains(&state.as_str())
            ),
            "final states exported though they could not be counted: {exported:?}"
        );
    }
    assert!(
        leader
            .child
            .terminate(Duration::from_secs(20))
            .await
            .success()
    );
    drop(leader);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP OWNED BY {role}; DROP ROLE {role};"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
}
