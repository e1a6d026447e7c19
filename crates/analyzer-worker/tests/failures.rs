//! Analyses that cannot succeed end cleanly (issue #8, SPEC §5): caps on size, files and time,
//! repositories that cannot be fetched, URLs the worker's own policy refuses, a worker killed
//! mid-fetch. Each time the job ends for good, the analysis record is `failed` with the reason,
//! the quota reservation is released, nothing is billed, and no checkout folder or git process
//! is left behind. Disallowed URLs never get past the API.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{AnalysisArgs, Service, Tier, select_queue};
use queue::NewJob;
use serde_json::{Value, json};
use support::{
    Api, GitFixture, OrphanedGit, TempDir, Web, billing_rows, job_billing, job_state,
    processes_mentioning, spawn_worker, worker_env,
};
use testkit::TestDb;
use testkit::git_fixture::random_bytes;
use uuid::Uuid;

const SETTLE: Duration = Duration::from_secs(60);

/// Submits `repository` at `git_ref` and waits for the analysis to settle; returns
/// (the settled analysis, its job id).
async fn analyse_and_settle(api: &Api, repository: &str, git_ref: &str) -> (Value, i64) {
    let accepted = api.analyse(repository, Some(git_ref)).await;
    assert_eq!(accepted.status, 202, "{}", accepted.text());
    let accepted = accepted.json();
    let path = format!("/v1/analyses/{}", accepted["analysis_id"].as_str().unwrap());
    let settled = api.wait_settled(&path, SETTLE).await;
    (settled, accepted["job"]["id"].as_i64().unwrap())
}

/// The analysis failed with `error`, its job was cancelled for that reason, and it was neither
/// billed nor left holding a reservation.
async fn assert_failed_unbilled(db: &TestDb, analysis: &Value, job: i64, error: &str) {
    assert_eq!(analysis["state"], "failed", "{analysis}");
    assert_eq!(analysis["error"], error, "{analysis}");
    assert_eq!(analysis["result"], Value::Null);
    assert_eq!(
        job_state(&db.pool, job).await,
        ("cancelled".to_owned(), Some(error.to_owned()))
    );
    assert_eq!(
        job_billing(&db.pool, job).await,
        (0, 0),
        "usage events, reservations"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_oversized_repositories_fail_within_the_caps() {
    let db = TestDb::new().await;
    let big = GitFixture::new("caps-bytes");
    big.write("src/lib.rs", "#[test]\nfn ok() {}\n");
    big.write("assets/blob.bin", random_bytes(3 * 1024 * 1024));
    let big_commit = big.commit("big");
    let many = GitFixture::new("caps-files");
    for i in 0..40 {
        many.write(&format!("pkg{}/f{i}_test.go", i % 4), "package p\n");
    }
    let many_commit = many.commit("many");
    let work = TempDir::new("caps-work");
    let web = Web::start(&db).await;
    let (_, api) = web.user(&db.pool, "pro").await;
    let mut worker = spawn_worker(
        "analyzer",
        &worker_env(
            &db,
            work.path(),
            &[
                ("ANALYZER_MAX_REPO_BYTES", "1048576"),
                ("ANALYZER_MAX_FILES", "30"),
            ],
        ),
    );

    let (analysis, job) = analyse_and_settle(&api, &big.url(), &big_commit).await;
    assert_failed_unbilled(
        &db,
        &analysis,
        job,
        "the repository is too large: more than 1048576 bytes while fetching",
    )
    .await;
    let (analysis, job) = analyse_and_settle(&api, &many.url(), &many_commit).await;
    assert_failed_unbilled(
        &db,
        &analysis,
        job,
        "the repository has too many files and folders: more than 30",
    )
    .await;
    assert_eq!(work.entries(), Vec::<String>::new());
    let usage = api.get("/v1/usage").await.json();
    assert_eq!(
        (&usage["usage"][0]["used"], &usage["usage"][0]["reserved"]),
        (&json!(0), &json!(0))
    );

    assert!(worker.terminate(Duration::from_secs(30)).await.success());
    web.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_stalled_fetch_is_stopped_at_the_time_cap() {
    let db = TestDb::new().await;
    let repo = GitFixture::new("caps-stall");
    repo.write("a_test.go", "package a\n");
    let commit = repo.commit("a");
    repo.stall(&commit);
    let work = TempDir::new("caps-stall-work");
    let web = Web::start(&db).await;
    let (_, api) = web.user(&db.pool, "pro").await;
    let mut worker = spawn_worker(
        "analyzer",
        &worker_env(&db, work.path(), &[("ANALYZER_FETCH_TIMEOUT", "2s")]),
    );

    let started = Instant::now();
    let (analysis, job) = analyse_and_settle(&api, &repo.url(), &commit).await;
    let elapsed = started.elapsed();
    assert_failed_unbilled(
        &db,
        &analysis,
        job,
        "timed out while fetching (time cap 2s)",
    )
    .await;
    // The fetch cap ended it (not the handler's timeout, 92 s with these settings); the bound is
    // generous and only rules that out.
    assert!(elapsed >= Duration::from_secs(2), "{elapsed:?}");
    assert!(elapsed < Duration::from_secs(45), "{elapsed:?}");
    assert_eq!(work.entries(), Vec::<String>::new());
    let needle = repo.path().display().to_string();
    assert_eq!(
        processes_mentioning(&needle),
        Vec::new(),
        "git left running"
    );

    assert!(worker.terminate(Duration::from_secs(30)).await.success());
    web.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_worker_killed_mid_fetch_is_swept_at_restart_and_the_job_ends_cleanly() {
    let db = TestDb::new().await;
    let repo = GitFixture::new("kill-stall");
    repo.write("a_test.go", "package a\n");
    let commit = repo.commit("a");
    repo.stall(&commit);
    let _orphans = OrphanedGit::of(&repo);
    let work = TempDir::new("kill-work");
    let web = Web::start(&db).await;
    let (_, api) = web.user(&db.pool, "pro").await;
    let mut victim = spawn_worker(
        "victim",
        &worker_env(&db, work.path(), &[("ANALYZER_FETCH_TIMEOUT", "120s")]),
    );

    let accepted = api.analyse(&repo.url(), Some(&commit)).await.json();
    let job = accepted["job"]["id"].as_i64().unwrap();
    let path = format!("/v1/analyses/{}", accepted["analysis_id"].as_str().unwrap());
    // Wait until the victim's git is stuck fetching into its checkout folder.
    let needle = repo.path().display().to_string();
    support::wait_until("a checkout mid-fetch", SETTLE, || async {
        !work.entries().is_empty()
            && processes_mentioning(&needle)
                .iter()
                .any(|(_, cmd)| cmd.contains("upload-pack"))
    })
    .await;
    let left_behind = work.entries();
    assert_eq!(left_behind.len(), 1, "{left_behind:?}");
    assert_eq!(api.get(&path).await.json()["state"], "running");
    victim.kill_9().await;
    // A crash removes nothing: the folder is still there, the reservation too.
    assert_eq!(work.entries(), left_behind);
    assert_eq!(job_billing(&db.pool, job).await, (0, 1));

    // The next start sweeps the dead process's folder before fetching anything; the rescued job
    // runs again and stops at the (now short) time cap.
    let mut survivor = spawn_worker(
        "survivor",
        &worker_env(&db, work.path(), &[("ANALYZER_FETCH_TIMEOUT", "2s")]),
    );
    support::wait_until("the stale folder to be swept", SETTLE, || async {
        !work.entries().contains(&left_behind[0])
    })
    .await;
    let analysis = api.wait_settled(&path, SETTLE).await;
    assert_failed_unbilled(
        &db,
        &analysis,
        job,
        "timed out while fetching (time cap 2s)",
    )
    .await;
    let (attempt,): (i16,) = sqlx::query_as("SELECT attempt FROM fairlane_job WHERE id = $1")
        .bind(job)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(attempt, 2, "the killed attempt and the rescued one");
    assert_eq!(work.entries(), Vec::<String>::new());

    assert!(survivor.terminate(Duration::from_secs(30)).await.success());
    web.stop().await;
}

/// An analysis job and its record written as an enqueuer that skipped the API's validation
/// would: `requested_ref` and `commit` go into the record as they are. Returns the analysis and
/// job ids.
async fn enqueue_behind_the_api(
    db: &TestDb,
    user: Uuid,
    repository: &str,
    requested_ref: Option<&str>,
    commit: &str,
) -> (Uuid, i64) {
    let analysis_id = Uuid::new_v4();
    let args = AnalysisArgs {
        user_id: Some(user),
        analysis_id,
        repository: repository.to_owned(),
        git_ref: Some(requested_ref.unwrap_or(commit).to_owned()),
    };
    let mut tx = db.pool.begin().await.unwrap();
    let inserted = queue::insert::insert(
        &mut tx,
        NewJob::new(select_queue(Service::Analysis, Tier::Pro, false), &args).unwrap(),
    )
    .await
    .unwrap()
    .job;
    sqlx::query(
        "INSERT INTO analyses (id, user_id, repository, requested_ref, commit, job_id) \
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(analysis_id)
    .bind(user)
    .bind(repository)
    .bind(requested_ref)
    .bind(commit)
    .bind(inserted.id)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    (analysis_id, inserted.id)
}

/// Spawns the worker with its logs (debug level, both streams) going to `log`.
fn spawn_logged_worker(env: &[(String, String)], log: &std::path::Path) -> tokio::process::Child {
    let file = std::fs::File::create(log).unwrap();
    tokio::process::Command::new(support::WORKER_BIN)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_unfetchable_or_refused_repositories_fail_the_job_and_never_log_credentials() {
    let db = TestDb::new().await;
    let repo = GitFixture::new("refused");
    repo.write("a_test.go", "package a\n");
    let commit = repo.commit("a");
    let work = TempDir::new("refused-work");
    let logs = TempDir::new("refused-logs");
    let log = logs.path().join("worker.log");
    let web = Web::start(&db).await;
    let (user, api) = web.user(&db.pool, "pro").await;
    // This worker does not fetch file:// repositories, although the API accepts them.
    let env = worker_env(
        &db,
        work.path(),
        &[
            ("ANALYZER_ALLOW_FILE_URLS", "false"),
            ("RUST_LOG", "debug"),
            ("LOG_FORMAT", "json"),
        ],
    );
    let mut worker = spawn_logged_worker(&env, &log);

    let (analysis, job) = analyse_and_settle(&api, &repo.url(), &commit).await;
    assert_failed_unbilled(
        &db,
        &analysis,
        job,
        "refused by policy: file:// repository URLs are not allowed on this service; use an https:// URL",
    )
    .await;

    // An enqueuer that skipped validation: the URL carries a token. Refused, and the token is
    // in no error and no log line.
    let secret = "s3cr3t-t0ken-4711";
    let repository = format!("https://deploy:{secret}@git.example.com/org/repo.git");
    let (analysis_id, job_id) = enqueue_behind_the_api(&db, user, &repository, None, &commit).await;
    let settled = api
        .wait_settled(&format!("/v1/analyses/{analysis_id}"), SETTLE)
        .await;
    assert_eq!(settled["state"], "failed");
    let error = settled["error"].as_str().unwrap();
    assert!(
        error.starts_with("refused by policy: the repository URL contains credentials"),
        "{error}"
    );
    assert!(!error.contains(secret));

    // Another port of a public host, enqueued around the API: refused before git connects (its
    // answer would tell whether the port is open).
    let (analysis_id, _) = enqueue_behind_the_api(
        &db,
        user,
        "https://git.example.com:6379/org/repo.git",
        None,
        &commit,
    )
    .await;
    let settled = api
        .wait_settled(&format!("/v1/analyses/{analysis_id}"), SETTLE)
        .await;
    assert_eq!(settled["state"], "failed", "{settled}");
    assert_eq!(
        settled["error"],
        "refused by policy: port 6379 is not allowed; repositories are fetched from port 443 only"
    );

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(worker.id().unwrap()).unwrap()),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), worker.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success());
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains(&job_id.to_string()),
        "the log should cover the job: {logged}"
    );
    assert!(!logged.contains(secret), "a credential reached the logs");
    assert!(!logged.contains("deploy:"), "a credential reached the logs");
    web.stop().await;
}

/// A ref or commit written around the API never reaches git's command line as an option: a
/// `requested_ref` of `--upload-pack=<command>` ran that command once the fetch by id failed and
/// fell back to the ref name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_ref_or_commit_that_git_would_read_as_an_option_is_refused() {
    let db = TestDb::new().await;
    let repo = GitFixture::new("option-ref");
    repo.write("a_test.go", "package a\n");
    repo.commit("a");
    let work = TempDir::new("option-ref-work");
    let marker = work.path().join("ran");
    let web = Web::start(&db).await;
    let (user, api) = web.user(&db.pool, "pro").await;
    let mut worker = spawn_worker("analyzer", &worker_env(&db, work.path(), &[]));
    let injected = format!("--upload-pack=touch {} #", marker.display());
    let unknown_commit = "0123456789".repeat(4);
    let dash_commit = format!("--upload-pack=touch {}", marker.display());
    for (requested_ref, commit) in [
        (Some(injected.as_str()), unknown_commit.as_str()),
        (None, dash_commit.as_str()),
    ] {
        let (analysis_id, _) =
            enqueue_behind_the_api(&db, user, &repo.url(), requested_ref, commit).await;
        let settled = api
            .wait_settled(&format!("/v1/analyses/{analysis_id}"), SETTLE)
            .await;
        assert_eq!(settled["state"], "failed", "{settled}");
        let error = settled["error"].as_str().unwrap();
        assert!(error.starts_with("invalid ref: "), "{error}");
        assert!(!marker.exists(), "git ran the injected command");
    }
    assert!(worker.terminate(Duration::from_secs(30)).await.success());
    web.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_missing_repository_fails_the_job_with_a_clear_error() {
    let db = TestDb::new().await;
    let work = TempDir::new("missing-work");
    let gone = TempDir::new("missing-repo");
    let web = Web::start(&db).await;
    let (_, api) = web.user(&db.pool, "pro").await;
    let mut worker = spawn_worker("analyzer", &worker_env(&db, work.path(), &[]));
    let url = format!("file://{}/nothing-here", gone.path().display());
    let (analysis, job) = analyse_and_settle(&api, &url, &"ab".repeat(20)).await;
    assert_failed_unbilled(
        &db,
        &analysis,
        job,
        "repository not found or not accessible (private repositories are not supported)",
    )
    .await;
    assert_eq!(work.entries(), Vec::<String>::new());
    assert!(worker.terminate(Duration::from_secs(30)).await.success());
    web.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_disallowed_urls_are_refused_at_the_api_and_never_reach_a_worker() {
    let db = TestDb::new().await;
    let work = TempDir::new("api-refused-work");
    let repo = GitFixture::new("api-refused");
    let commit = repo.commit("empty");
    // Production settings: https only, public hosts only.
    let web = Web::start_with(web::WebConfig {
        database_url: db.url(),
        http_addr: "127.0.0.1:0".into(),
        ratelimit_enabled: false,
        ..web::WebConfig::default()
    })
    .await;
    let (_, api) = web.user(&db.pool, "pro").await;
    let mut worker = spawn_worker("analyzer", &worker_env(&db, work.path(), &[]));
    for url in [
        repo.url(),
        "http://github.com/org/repo.git".to_owned(),
        "ssh://git@github.com/org/repo.git".to_owned(),
        "git://github.com/org/repo.git".to_owned(),
        "git@github.com:org/repo.git".to_owned(),
        "https://user:password@github.com/org/repo.git".to_owned(),
        "https://127.0.0.1/org/repo.git".to_owned(),
        "https://10.0.0.8/org/repo.git".to_owned(),
        "https://192.168.1.20/org/repo.git".to_owned(),
        "https://[::1]/org/repo.git".to_owned(),
        "https://localhost/org/repo.git".to_owned(),
        "https://git.internal/org/repo.git".to_owned(),
        "https://github.com:22/org/repo.git".to_owned(),
    ] {
        let r = api.analyse(&url, Some(&commit)).await;
        assert_eq!(r.status, 422, "{url}: {}", r.text());
        assert_eq!(
            r.content_type.as_deref(),
            Some("application/problem+json"),
            "{url}"
        );
        assert_eq!(r.json()["code"], "validation_failed", "{url}");
    }
    // Nothing was written, so nothing could reach the worker.
    assert_eq!(billing_rows(&db.pool).await, (0, 0, 0));
    let (analyses,): (i64,) = sqlx::query_as("SELECT count(*) FROM analyses")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(analyses, 0);
    assert!(worker.terminate(Duration::from_secs(30)).await.success());
    web.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_cancelling_a_running_analysis_kills_git_and_removes_its_checkout() {
    let db = TestDb::new().await;
    let repo = GitFixture::new("cancel-stall");
    repo.write("a_test.go", "package a\n");
    let commit = repo.commit("a");
    repo.stall(&commit);
    let work = TempDir::new("cancel-work");
    let web = Web::start(&db).await;
    let (_, api) = web.user(&db.pool, "pro").await;
    let mut worker = spawn_worker(
        "analyzer",
        &worker_env(&db, work.path(), &[("ANALYZER_FETCH_TIMEOUT", "120s")]),
    );
    let accepted = api.analyse(&repo.url(), Some(&commit)).await.json();
    let job = accepted["job"]["id"].as_i64().unwrap();
    let needle = repo.path().display().to_string();
    support::wait_until("git to be fetching", SETTLE, || async {
        processes_mentioning(&needle)
            .iter()
            .any(|(_, cmd)| cmd.contains("upload-pack"))
    })
    .await;

    let cancelled = api
        .send(
            http::Method::DELETE,
            &format!("/v1/jobs/{job}"),
            "application/json",
            None,
        )
        .await
        .json();
    assert_eq!(cancelled["cancellation"], "requested");
    let analysis = api
        .wait_settled(
            &format!("/v1/analyses/{}", accepted["analysis_id"].as_str().unwrap()),
            SETTLE,
        )
        .await;
    assert_eq!(analysis["state"], "failed");
    assert_eq!(analysis["error"], "cancelled by the user");
    assert_eq!(job_state(&db.pool, job).await.0, "cancelled");
    assert_eq!(job_billing(&db.pool, job).await, (0, 0));
    assert_eq!(work.entries(), Vec::<String>::new());
    assert_eq!(
        processes_mentioning(&needle),
        Vec::new(),
        "git left running"
    );

    assert!(worker.terminate(Duration::from_secs(30)).await.success());
    web.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_scan_over_its_time_cap_fails_and_still_removes_the_checkout() {
    let db = TestDb::new().await;
    // 4,000 test files take far longer than a millisecond to walk, read and lex.
    let repo = GitFixture::new("scan-cap");
    for i in 0..4000 {
        repo.write(
            &format!("pkg{}/case{i}_test.py", i % 40),
            format!("def test_case_{i}():\n    pass\n"),
        );
    }
    let commit = repo.commit("many tests");
    let work = TempDir::new("scan-cap-work");
    let web = Web::start(&db).await;
    let (_, api) = web.user(&db.pool, "pro").await;
    let mut worker = spawn_worker(
        "analyzer",
        &worker_env(&db, work.path(), &[("ANALYZER_SCAN_TIMEOUT", "1ms")]),
    );
    let (analysis, job) = analyse_and_settle(&api, &repo.url(), &commit).await;
    assert_failed_unbilled(
        &db,
        &analysis,
        job,
        "scanning the checkout for tests took longer than 1ms",
    )
    .await;
    // The folder goes once the abandoned scan has let go of it.
    support::wait_until("the checkout to be removed", SETTLE, || async {
        work.entries().is_empty()
    })
    .await;
    assert!(worker.terminate(Duration::from_secs(30)).await.success());
    web.stop().await;
}
