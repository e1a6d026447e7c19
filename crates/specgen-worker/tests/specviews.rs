//! The `specview` job with a real `specgen-worker` process and PostgreSQL: a known analysis
//! becomes the expected specification (JSON and Markdown) and is billed once; a specview that
//! cannot be made (analysis not completed, unreadable result) fails its record with the reason,
//! releases its reservation and bills nothing; one cancelled while it runs stores and bills nothing.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use common::{Service, SpecviewArgs, select_queue};
use queue::NewJob;
use quota::{Quota, QuotaConfig};
use serde_json::{Value, json};
use sqlx::PgPool;
use testkit::TestDb;
use testkit::process::ChildProcess;
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_specgen-worker");
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

fn spawn(db: &TestDb) -> ChildProcess {
    let env: Vec<(&str, String)> = vec![
        ("DATABASE_URL", db.url()),
        ("HTTP_ADDR", "127.0.0.1:0".into()),
        ("LOG_FORMAT", "pretty".into()),
        ("RUST_LOG", "warn".into()),
    ];
    ChildProcess::spawn("specgen-worker", BIN, &[], &env)
}

fn test(name: &str, suite: &[&str], line: u32, modifier: &str, parameterized: bool) -> Value {
    json!({"name": name, "suite": suite, "line": line, "modifier": modifier,
           "parameterized": parameterized})
}

/// A known analysis result (`inventory::Analysis` as the analyzer stores it).
fn known_analysis() -> Value {
    json!({
        "repository": "https://example.com/shop.git",
        "requested_ref": "main",
        "commit": COMMIT,
        "inventory": {
            "files": [
                {"path": "api/orders_test.go", "framework": "go", "tests": [
                    test("TestCreateOrder", &[], 5, "none", false),
                    test("rejects empty carts", &["TestCreateOrder"], 6, "none", false),
                    test("TestHTTPTimeouts", &[], 20, "skip", false),
                ]},
                {"path": "web/src/checkout.spec.ts", "framework": "vitest", "tests": [
                    test("applies a `discount` code", &["Checkout *beta*"], 3, "none", false),
                    test("charges %s", &["Checkout *beta*"], 8, "only", true),
                    test("refunds", &["Checkout *beta*", "after payment"], 12, "todo", false),
                ]},
            ],
            "totals": {
                "overall": {"files": 2, "tests": 6, "skipped": 1, "only": 1, "todo": 1,
                            "benchmarks": 0, "fuzz": 0, "examples": 0},
                "by_framework": {}
            },
            "stats": {"files_visited": 9, "files_scanned": 2, "files_too_large": 0,
                      "symlinks_skipped": 0}
        }
    })
}

const EXPECTED_MARKDOWN: &str = "# Behaviour specification

6 behaviours in 2 files (1 skipped, 1 focused, 1 to do).

## `api/orders_test.go` (go)

- create order
  - rejects empty carts
- HTTP timeouts _(skipped)_

## `web/src/checkout.spec.ts` (vitest)

- **Checkout \\*beta\\***
  - applies a \\`discount\\` code
  - charges %s _(each case)_ _(focused)_
  - **after payment**
    - refunds _(to do)_
";

async fn user(pool: &PgPool) -> Uuid {
    sqlx::query_scalar("INSERT INTO users (name, tier) VALUES ('u', 'free') RETURNING id")
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn analysis(pool: &PgPool, user: Uuid, commit: &str, state: &str, result: Value) -> Uuid {
    sqlx::query_scalar(
        "INSERT INTO analyses (user_id, repository, commit, state, result) \
         VALUES ($1, 'https://example.com/shop.git', $2, $3::fairlane_work_state, $4) RETURNING id",
    )
    .bind(user)
    .bind(commit)
    .bind(state)
    .bind(result)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Enqueues a specview as the API does: quota check, job, reservation and record in one
/// transaction. Returns (specview id, job id).
async fn enqueue(pool: &PgPool, user: Uuid, analysis_id: Uuid) -> (Uuid, i64) {
    let quota = Quota::new(QuotaConfig::default()).unwrap();
    let mut tx = pool.begin().await.unwrap();
    let grant = quota
        .check(&mut tx, user, Service::Specview, chrono::Utc::now())
        .await
        .unwrap();
    let specview_id = Uuid::new_v4();
    let args = SpecviewArgs {
        user_id: Some(user),
        specview_id,
        analysis_id,
    };
    let job = NewJob::new(select_queue(Service::Specview, grant.tier, false), &args).unwrap();
    let job = queue::insert::insert(&mut tx, job).await.unwrap().job;
    grant.reserve(&mut tx, Some(job.id)).await.unwrap();
    sqlx::query("INSERT INTO specviews (id, user_id, analysis_id, job_id) VALUES ($1, $2, $3, $4)")
        .bind(specview_id)
        .bind(user)
        .bind(analysis_id)
        .bind(job.id)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    (specview_id, job.id)
}

#[derive(Debug)]
struct Settled {
    state: String,
    markdown: Option<String>,
    result: Option<Value>,
    error: Option<String>,
    job_state: String,
    billed: i64,
    reserved: i64,
}

async fn settled(pool: &PgPool, specview: Uuid, job: i64) -> Settled {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (state, markdown, result, error): (
            String,
            Option<String>,
            Option<Value>,
            Option<String>,
        ) = sqlx::query_as(
            "SELECT state::text, markdown, result, error FROM specviews WHERE id = $1",
        )
        .bind(specview)
        .fetch_one(pool)
        .await
        .unwrap();
        if state == "completed" || state == "failed" {
            let (job_state, billed, reserved): (String, i64, i64) = sqlx::query_as(
                "SELECT (SELECT state::text FROM fairlane_job WHERE id = $1), \
                        (SELECT count(*) FROM usage_events WHERE job_id = $1), \
                        (SELECT count(*) FROM quota_reservations WHERE job_id = $1)",
            )
            .bind(job)
            .fetch_one(pool)
            .await
            .unwrap();
            return Settled {
                state,
                markdown,
                result,
                error,
                job_state,
                billed,
                reserved,
            };
        }
        assert!(
            Instant::now() < deadline,
            "specview {specview} still {state}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_specviews_of_known_and_unusable_analyses() {
    let db = TestDb::new().await;
    let u = user(&db.pool).await;
    let known = analysis(&db.pool, u, COMMIT, "completed", known_analysis()).await;
    let running = analysis(&db.pool, u, &"1".repeat(40), "running", Value::Null).await;
    let unreadable = analysis(
        &db.pool,
        u,
        &"2".repeat(40),
        "completed",
        json!({"tests": 7}),
    )
    .await;
    let (good, good_job) = enqueue(&db.pool, u, known).await;
    let (early, early_job) = enqueue(&db.pool, u, running).await;
    let (bad, bad_job) = enqueue(&db.pool, u, unreadable).await;
    // Another user's cache copy of the known analysis, which shares its inventory.
    let other = user(&db.pool).await;
    let copy: Uuid = sqlx::query_scalar(
        "INSERT INTO analyses (user_id, repository, commit, state, cached_from, completed_at) \
         SELECT $1, repository, commit, 'completed', id, now() FROM analyses WHERE id = $2 \
         RETURNING id",
    )
    .bind(other)
    .bind(known)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let (of_copy, of_copy_job) = enqueue(&db.pool, other, copy).await;
    let mut worker = spawn(&db);

    let s = settled(&db.pool, good, good_job).await;
    assert_eq!(s.state, "completed", "{s:?}");
    assert_eq!(s.markdown.as_deref(), Some(EXPECTED_MARKDOWN));
    let result = s.result.unwrap();
    assert_eq!(result["analysis_id"], known.to_string());
    assert_eq!(result["commit"], COMMIT);
    assert_eq!(result["repository"], "https://example.com/shop.git");
    assert_eq!(
        (
            &result["behaviours"],
            &result["skipped"],
            &result["focused"],
            &result["todo"]
        ),
        (&json!(6), &json!(1), &json!(1), &json!(1))
    );
    let go = &result["files"][0]["nodes"][0];
    assert_eq!(
        (&go["kind"], &go["title"]),
        (&json!("behaviour"), &json!("create order"))
    );
    assert_eq!(go["children"][0]["title"], "rejects empty carts");
    assert_eq!(
        result["files"][1]["nodes"][0]["children"][2]["children"][0]["modifier"],
        "todo"
    );
    assert_eq!(
        (s.job_state.as_str(), s.billed, s.reserved),
        ("completed", 1, 0)
    );
    let output: Value = sqlx::query_scalar("SELECT output FROM fairlane_job WHERE id = $1")
        .bind(good_job)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(output["behaviours"], 6);
    assert_eq!(output["files"], 2);

    let s = settled(&db.pool, of_copy, of_copy_job).await;
    assert_eq!(s.state, "completed", "{s:?}");
    assert_eq!(s.markdown.as_deref(), Some(EXPECTED_MARKDOWN));
    assert_eq!(s.result.unwrap()["analysis_id"], copy.to_string());

    let s = settled(&db.pool, early, early_job).await;
    assert_eq!(
        s.error,
        Some(format!(
            "analysis {running} is running; a specview needs a completed analysis"
        ))
    );
    assert_eq!(
        (s.state.as_str(), s.job_state.as_str(), s.billed, s.reserved),
        ("failed", "cancelled", 0, 0)
    );

    let s = settled(&db.pool, bad, bad_job).await;
    let error = s.error.clone().unwrap();
    assert!(
        error.starts_with(&format!(
            "the result of analysis {unreadable} cannot be read"
        )),
        "{error}"
    );
    assert_eq!(
        (
            s.state.as_str(),
            s.job_state.as_str(),
            s.billed,
            s.reserved,
            s.markdown
        ),
        ("failed", "cancelled", 0, 0, None)
    );

    assert!(worker.terminate(Duration::from_secs(30)).await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_specview_cancelled_while_it_runs_stores_and_bills_nothing() {
    let db = TestDb::new().await;
    let u = user(&db.pool).await;
    let known = analysis(&db.pool, u, COMMIT, "completed", known_analysis()).await;
    let (specview, job) = enqueue(&db.pool, u, known).await;
    // The record's row is held, so the job stops at its claim until the test lets go.
    let mut held = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM specviews WHERE id = $1 FOR UPDATE")
        .bind(specview)
        .execute(&mut *held)
        .await
        .unwrap();
    // The grace is long enough that only the handler's own stop can end the job in this test.
    let mut worker = ChildProcess::spawn(
        "specgen-worker",
        BIN,
        &[],
        &[
            ("DATABASE_URL", db.url()),
            ("HTTP_ADDR", "127.0.0.1:0".into()),
            ("QUEUE_CANCEL_GRACE", "120s".into()),
            ("RUST_LOG", "warn".into()),
        ],
    );
    testkit::eventually(Duration::from_secs(30), "the claim to wait", || async {
        let waiting = testkit::lock_waiting_statements(&db.pool).await;
        waiting
            .iter()
            .any(|q| q.contains("WITH claimed"))
            .then_some(())
    })
    .await;

    let cancelled = queue::Client::new(db.pool.clone())
        .cancel(job)
        .await
        .unwrap();
    assert!(
        matches!(cancelled, Some(queue::CancelResult::Requested(_))),
        "{cancelled:?}"
    );
    // The job's ending writes the record too, so it waits behind the test's lock beside the
    // claim.
    testkit::eventually(Duration::from_secs(30), "the job's ending", || async {
        let waiting = testkit::lock_waiting_statements(&db.pool).await;
        waiting
            .iter()
            .any(|q| !q.contains("WITH claimed"))
            .then_some(())
    })
    .await;
    held.rollback().await.unwrap();

    let s = settled(&db.pool, specview, job).await;
    assert_eq!(
        (
            s.state.as_str(),
            s.error.as_deref(),
            s.job_state.as_str(),
            s.billed,
            s.reserved,
            s.markdown
        ),
        (
            "failed",
            Some("cancelled by the user"),
            "cancelled",
            0,
            0,
            None
        )
    );
    assert!(worker.terminate(Duration::from_secs(30)).await.success());
}
