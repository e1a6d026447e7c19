//! The analysis and specview paths end to end (SPEC §5, §7b): the `web` API in-process, the
//! `analyzer-worker` binary as a real process, the `specgen-worker` service in-process, a
//! fixture repository with every framework fetched over `file://`, real PostgreSQL.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use common::{AnalysisArgs, Service, Tier, select_queue};
use http::Method;
use queue::NewJob;
use serde_json::{Value, json};
use support::fixture::{self, EXPECTED_MARKDOWN, EXPECTED_PER_FRAMEWORK, EXPECTED_TESTS};
use support::{GitFixture, Specgen, TempDir, Web, billing_rows, spawn_worker, worker_env};
use testkit::TestDb;
use uuid::Uuid;

const SETTLE: Duration = Duration::from_secs(60);

fn per_framework(result: &Value) -> Vec<(String, u64)> {
    result["inventory"]["totals"]["by_framework"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v["tests"].as_u64().unwrap()))
        .collect()
}

fn expected_per_framework() -> Vec<(String, u64)> {
    let mut expected: Vec<(String, u64)> = EXPECTED_PER_FRAMEWORK
        .iter()
        .map(|(f, n)| ((*f).to_owned(), *n))
        .collect();
    // JSON objects come back in key order.
    expected.sort();
    expected
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_every_framework_is_inventoried_served_from_cache_and_specified() {
    let db = TestDb::new().await;
    let repo = GitFixture::new("e2e-every");
    let commit = fixture::build(&repo);
    let work = TempDir::new("e2e-every-work");
    let web = Web::start(&db).await;
    let specgen = Specgen::start(&db).await;
    let mut worker = spawn_worker("analyzer", &worker_env(&db, work.path(), &[]));
    let (_, alice) = web.user(&db.pool, "pro").await;

    // The default branch, resolved by the API, analysed by the worker.
    let accepted = alice.analyse(&repo.url(), None).await;
    assert_eq!(accepted.status, 202, "{}", accepted.text());
    let accepted = accepted.json();
    assert_eq!(accepted["commit"], commit);
    let analysis_id = accepted["analysis_id"].as_str().unwrap().to_owned();
    let job_id = accepted["job"]["id"].as_i64().unwrap();
    let analysis = alice
        .wait_settled(&format!("/v1/analyses/{analysis_id}"), SETTLE)
        .await;
    assert_eq!(analysis["state"], "completed", "{analysis}");
    assert_eq!(analysis["commit"], commit);
    assert_eq!(analysis["cached"], false);
    assert_eq!(analysis["error"], Value::Null);
    let result = &analysis["result"];
    assert_eq!(result["repository"], repo.url());
    assert_eq!(result["commit"], commit);
    assert_eq!(fixture::describe(result), EXPECTED_TESTS);
    let overall = &result["inventory"]["totals"]["overall"];
    assert_eq!(
        (
            &overall["files"],
            &overall["tests"],
            &overall["skipped"],
            &overall["todo"],
            &overall["only"],
            &overall["benchmarks"]
        ),
        (
            &json!(10),
            &json!(22),
            &json!(4),
            &json!(1),
            &json!(0),
            &json!(1)
        )
    );
    assert_eq!(per_framework(result), expected_per_framework());
    let go = &result["inventory"]["files"][9];
    assert_eq!(go["path"], "services/api/handler_test.go");
    assert_eq!(go["other"][0]["name"], "BenchmarkHandler");

    // The job reports what it did, was billed once, and left no checkout behind.
    let job = alice.get(&format!("/v1/jobs/{job_id}")).await.json();
    assert_eq!(job["state"], "completed");
    assert_eq!(job["result"]["analysis_id"], analysis_id);
    assert_eq!(job["result"]["commit"], commit);
    assert_eq!(job["result"]["totals"]["overall"]["tests"], 22);
    assert_eq!(billing_rows(&db.pool).await, (1, 0, 1));
    assert_eq!(work.entries(), Vec::<String>::new());

    // The same commit again, by branch name: the stored analysis, no job, no quota.
    let again = alice.analyse(&repo.url(), Some("main")).await;
    assert_eq!(again.status, 200, "{}", again.text());
    assert_eq!(again.json()["id"], analysis_id.as_str());
    assert_eq!(billing_rows(&db.pool).await, (1, 0, 1));
    // Someone else, by commit id: a copy of the result, theirs, free.
    let (_, bob) = web.user(&db.pool, "free").await;
    let copy = bob.analyse(&repo.url(), Some(&commit)).await;
    assert_eq!(copy.status, 200, "{}", copy.text());
    let copy = copy.json();
    assert_eq!(copy["cached"], true);
    assert_eq!(copy["job_id"], Value::Null);
    assert_ne!(copy["id"], analysis_id.as_str());
    assert_eq!(copy["result"], *result);
    assert_eq!(billing_rows(&db.pool).await, (1, 0, 1));
    let usage = bob.get("/v1/usage").await.json();
    assert_eq!(
        (&usage["usage"][0]["used"], &usage["usage"][0]["reserved"]),
        (&json!(0), &json!(0))
    );

    // The behaviour specification of that analysis, as JSON and as Markdown.
    let spec = alice
        .post("/v1/specviews", &json!({"analysis_id": analysis_id}))
        .await;
    assert_eq!(spec.status, 202, "{}", spec.text());
    let specview_id = spec.json()["specview_id"].as_str().unwrap().to_owned();
    let path = format!("/v1/specviews/{specview_id}");
    let view = alice.wait_settled(&path, SETTLE).await;
    assert_eq!(view["state"], "completed", "{view}");
    assert_eq!(view["markdown"], EXPECTED_MARKDOWN);
    assert_eq!(view["result"]["behaviours"], 22);
    assert_eq!(view["result"]["skipped"], 4);
    assert_eq!(view["result"]["commit"], commit);
    assert_eq!(view["result"]["analysis_id"], analysis_id.as_str());
    assert_eq!(view["result"]["files"].as_array().unwrap().len(), 10);
    assert_eq!(
        view["result"]["files"][7]["nodes"][0]["children"][1]["children"][0]["title"],
        "shows an empty message"
    );
    let markdown = alice.send(Method::GET, &path, "text/markdown", None).await;
    assert_eq!(markdown.status, 200);
    assert_eq!(
        markdown.content_type.as_deref(),
        Some("text/markdown; charset=utf-8")
    );
    assert_eq!(markdown.text(), EXPECTED_MARKDOWN);
    // The copy is specified the same way, and each specview is billed once.
    let bobs = bob
        .post("/v1/specviews", &json!({"analysis_id": copy["id"]}))
        .await
        .json();
    let bobs = bob
        .wait_settled(
            &format!("/v1/specviews/{}", bobs["specview_id"].as_str().unwrap()),
            SETTLE,
        )
        .await;
    assert_eq!(bobs["markdown"], EXPECTED_MARKDOWN);
    assert_eq!(billing_rows(&db.pool).await, (3, 0, 3));
    let usage = alice.get("/v1/usage").await.json();
    assert_eq!(usage["usage"][1]["event_type"], "specview");
    assert_eq!(usage["usage"][1]["used"], 1);

    assert!(worker.terminate(Duration::from_secs(30)).await.success());
    specgen.stop().await;
    web.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_ref_that_moves_between_requests_is_analysed_at_each_commit() {
    let db = TestDb::new().await;
    let repo = GitFixture::new("e2e-moving");
    let first_commit = fixture::build(&repo);
    let work = TempDir::new("e2e-moving-work");
    let web = Web::start(&db).await;
    let (_, alice) = web.user(&db.pool, "pro").await;

    // Both requests are made before any worker runs: the first must still be analysed at the
    // commit `main` pointed to when it was made.
    let first = alice.analyse(&repo.url(), Some("main")).await.json();
    assert_eq!(first["commit"], first_commit);
    let second_commit = fixture::add_users_test(&repo);
    let second = alice.analyse(&repo.url(), Some("main")).await;
    assert_eq!(second.status, 202, "{}", second.text());
    let second = second.json();
    assert_eq!(second["commit"], second_commit);
    assert_ne!(first["job"]["id"], second["job"]["id"]);

    let mut worker = spawn_worker("analyzer", &worker_env(&db, work.path(), &[]));
    let path = |v: &Value| format!("/v1/analyses/{}", v["analysis_id"].as_str().unwrap());
    let a = alice.wait_settled(&path(&first), SETTLE).await;
    let b = alice.wait_settled(&path(&second), SETTLE).await;
    assert_eq!(
        (&a["state"], &b["state"]),
        (&json!("completed"), &json!("completed"))
    );
    assert_eq!(a["result"]["commit"], first_commit);
    assert_eq!(a["result"]["inventory"]["totals"]["overall"]["tests"], 22);
    assert_eq!(b["result"]["commit"], second_commit);
    assert_eq!(b["result"]["inventory"]["totals"]["overall"]["tests"], 23);
    assert_eq!(b["result"]["inventory"]["totals"]["overall"]["files"], 11);
    assert!(
        fixture::describe(&b["result"])
            .contains(&"services/api/users_test.go (go) | TestCreateUser | none".to_owned())
    );
    // Two jobs, two usage events.
    assert_eq!(billing_rows(&db.pool).await, (2, 0, 2));
    let usage = alice.get("/v1/usage").await.json();
    assert_eq!(usage["usage"][0]["used"], 2);

    // Unchanged ref: served from the cache.
    let third = alice.analyse(&repo.url(), Some("main")).await;
    assert_eq!(third.status, 200);
    assert_eq!(third.json()["id"], second["analysis_id"]);
    assert_eq!(billing_rows(&db.pool).await, (2, 0, 2));
    assert_eq!(work.entries(), Vec::<String>::new());

    assert!(worker.terminate(Duration::from_secs(30)).await.success());
    web.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_system_reanalysis_resolves_the_default_branch_and_feeds_the_cache() {
    let db = TestDb::new().await;
    let repo = GitFixture::new("e2e-system");
    let commit = fixture::build(&repo);
    let work = TempDir::new("e2e-system-work");

    // Enqueued the way the scheduler does: no user, no commit, a job in the scheduled lane.
    let analysis_id = Uuid::new_v4();
    let args = AnalysisArgs {
        user_id: None,
        analysis_id,
        repository: repo.url(),
        git_ref: None,
    };
    let mut tx = db.pool.begin().await.unwrap();
    let job = NewJob::new(select_queue(Service::Analysis, Tier::Free, true), &args).unwrap();
    let job = queue::insert::insert(&mut tx, job).await.unwrap().job;
    sqlx::query("INSERT INTO analyses (id, repository, job_id) VALUES ($1, $2, $3)")
        .bind(analysis_id)
        .bind(repo.url())
        .bind(job.id)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let mut worker = spawn_worker("analyzer", &worker_env(&db, work.path(), &[]));
    support::wait_until("the system analysis", SETTLE, || async {
        let state: String = sqlx::query_scalar("SELECT state::text FROM analyses WHERE id = $1")
            .bind(analysis_id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        state == "completed"
    })
    .await;
    let (stored_commit, tests): (Option<String>, i64) = sqlx::query_as(
        "SELECT commit, (result -> 'inventory' -> 'totals' -> 'overall' ->> 'tests')::int8 \
         FROM analyses WHERE id = $1",
    )
    .bind(analysis_id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (stored_commit.as_deref(), tests),
        (Some(commit.as_str()), 22)
    );
    // A system job bills nobody.
    assert_eq!(billing_rows(&db.pool).await, (1, 0, 0));

    // A user asking for the same commit gets the system's result from the cache.
    let web = Web::start(&db).await;
    let (_, alice) = web.user(&db.pool, "free").await;
    let cached = alice.analyse(&repo.url(), None).await;
    assert_eq!(cached.status, 200, "{}", cached.text());
    let cached = cached.json();
    assert_eq!(cached["cached"], true);
    assert_eq!(cached["commit"], commit);
    assert_eq!(fixture::describe(&cached["result"]), EXPECTED_TESTS);
    assert_eq!(billing_rows(&db.pool).await, (1, 0, 0));

    assert!(worker.terminate(Duration::from_secs(30)).await.success());
    web.stop().await;
}
