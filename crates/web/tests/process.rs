//! The `web` binary as a process: graceful shutdown on SIGTERM with a request in flight (and a
//! second SIGTERM that ends the drain at once), trace
//! context carried into the enqueued job, and the `migrate` and `admin` subcommands.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::process::Command;
use std::time::Duration;

use http::Method;
use serde_json::Value;
use support::{analysis_body, hold_user_row, spawn_web, spawn_web_under, user_with_key};
use testkit::TestDb;

/// The `web` binary run with `args` against `database_url`, logging warnings only.
fn web_command(database_url: &str, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_web"));
    command
        .args(args)
        .env("DATABASE_URL", database_url)
        .env("RUST_LOG", "warn");
    command
}

fn web(db: &TestDb, args: &[&str]) -> (bool, Value, String) {
    let out = web_command(&db.url(), args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let json = serde_json::from_str(&stdout).unwrap_or(Value::Null);
    (
        out.status.success(),
        json,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A web process with a `POST /v1/analyses` blocked inside its transaction (the user's row held
/// by `blocker`), after SIGTERM: it has stopped accepting connections and is draining.
struct Draining {
    child: testkit::process::ChildProcess,
    blocker: sqlx::Transaction<'static, sqlx::Postgres>,
    request: tokio::task::JoinHandle<Result<support::Resp, String>>,
}

async fn draining_with_a_request_in_flight(db: &TestDb) -> Draining {
    let (mut child, http) = spawn_web(db, &[]).await;
    let (user, key) = user_with_key(&db.pool, "pro").await;
    // Hold the user's row so the request blocks inside its transaction.
    let blocker = hold_user_row(&db.pool, user).await;
    let request = {
        let http = http.clone();
        tokio::spawn(async move {
            http.try_post_json("/v1/analyses", &key, &analysis_body(1))
                .await
        })
    };
    // Wait until the request is waiting for the lock.
    support::until_a_lock_waits(&db.pool, "the request to block").await;
    child.signal(nix::sys::signal::Signal::SIGTERM);
    // New connections stop being accepted, while web waits for the request in flight.
    testkit::eventually(
        Duration::from_secs(10),
        "web to stop accepting connections after SIGTERM",
        || async {
            http.try_send(Method::GET, "/healthz", &[], None)
                .await
                .is_err()
                .then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        child.is_running(),
        "web must wait for the request in flight"
    );
    Draining {
        child,
        blocker,
        request,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_the_request_in_flight_and_exits_zero() {
    let db = TestDb::new().await;
    let Draining {
        mut child,
        blocker,
        request,
    } = draining_with_a_request_in_flight(&db).await;
    blocker.rollback().await.unwrap();
    let response = request.await.unwrap().unwrap();
    assert_eq!(response.status, 202, "{}", response.text());
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("web did not exit");
    assert!(status.success(), "exit status {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_exits_at_once_and_the_request_in_flight_changes_nothing() {
    use std::os::unix::process::ExitStatusExt;
    let db = TestDb::new().await;
    let Draining {
        mut child,
        blocker,
        request,
    } = draining_with_a_request_in_flight(&db).await;
    // The drain would wait for the request up to HTTP_REQUEST_TIMEOUT (30 s); a second SIGTERM
    // ends it now.
    child.signal(nix::sys::signal::Signal::SIGTERM);
    let status = tokio::time::timeout(Duration::from_secs(5), child.wait())
        .await
        .expect("web still draining 5 s after a second SIGTERM");
    assert_eq!(status.code(), Some(128 + 15), "exit status {status:?}");
    assert_eq!(status.signal(), None, "{status:?}");
    let answer = request.await.unwrap();
    assert!(answer.is_err(), "the client got an answer: {answer:?}");
    // Its transaction died with the process: once the lock is free, nothing was written.
    blocker.rollback().await.unwrap();
    assert_eq!(support::written_rows(&db.pool).await, [0; 5]);
}

#[tokio::test]
async fn the_request_trace_continues_into_the_job_and_metrics_are_exported() {
    let db = TestDb::new().await;
    let (_child, http) = spawn_web(
        &db,
        &[
            ("RUST_LOG", "info".to_owned()),
            ("QUOTA_ANALYSIS_FREE_LIMIT", "1".to_owned()),
        ],
    )
    .await;
    let (_, key) = user_with_key(&db.pool, "free").await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let traceparent = format!("00-{trace_id}-00f067aa0ba902b7-01");
    let auth = format!("Bearer {key}");
    let r = http
        .send(
            Method::POST,
            "/v1/analyses",
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
                ("traceparent", &traceparent),
            ],
            Some(serde_json::to_vec(&analysis_body(2)).unwrap()),
        )
        .await;
    assert_eq!(r.status, 202, "{}", r.text());
    let (metadata,): (Value,) = sqlx::query_as("SELECT metadata FROM fairlane_job")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let stored = metadata["trace"]["traceparent"].as_str().unwrap();
    assert!(stored.starts_with(&format!("00-{trace_id}-")), "{stored}");
    assert_ne!(
        stored, traceparent,
        "the job's parent is the request's own span"
    );
}

#[tokio::test]
async fn migrate_and_admin_subcommands() {
    let db = TestDb::new().await;
    let (ok, _, err) = web(&db, &["migrate"]);
    assert!(ok, "{err}");

    let (ok, user, err) = web(
        &db,
        &["admin", "create-user", "--name", "Grace", "--tier", "pro"],
    );
    assert!(ok, "{err}");
    assert_eq!(user["tier"], "pro");
    let id = user["id"].as_str().unwrap().to_owned();

    let (ok, user, err) = web(
        &db,
        &["admin", "set-tier", "--user", &id, "--tier", "enterprise"],
    );
    assert!(ok, "{err}");
    assert_eq!(user["tier"], "enterprise");

    let (ok, key, err) = web(&db, &["admin", "issue-key", "--user", &id]);
    assert!(ok, "{err}");
    let secret = key["key"].as_str().unwrap().to_owned();
    let key_id = key["key_id"].as_str().unwrap().to_owned();
    assert!(secret.starts_with("flk_") && secret.contains(&key_id));

    let (ok, revoked, err) = web(&db, &["admin", "revoke-key", "--key-id", &key_id]);
    assert!(ok, "{err}");
    assert!(revoked["revoked_at"].is_string());

    let (ok, _, err) = web(
        &db,
        &["admin", "create-user", "--name", "X", "--tier", "gold"],
    );
    assert!(!ok);
    assert!(err.contains("unknown tier `gold`"), "{err}");
    let (ok, _, err) = web(
        &db,
        &[
            "admin",
            "set-tier",
            "--user",
            &uuid::Uuid::new_v4().to_string(),
            "--tier",
            "pro",
        ],
    );
    assert!(!ok);
    assert!(err.contains("no user"), "{err}");
}

/// An admin command against a database out of reach says why (the connection refused), not only
/// that a pool timed out, and does so at once rather than after the pool's acquire timeout.
#[tokio::test]
async fn an_admin_command_says_why_the_database_is_out_of_reach() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let unreachable = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    let started = std::time::Instant::now();
    let out = web_command(
        &unreachable,
        &["admin", "create-user", "--name", "Ada", "--tier", "pro"],
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("web: connecting to the database: ")
            && stderr.to_lowercase().contains("refused"),
        "{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
    // A bad argument is told first, not the database out of reach.
    let nobody = uuid::Uuid::nil().to_string();
    let out = web_command(
        &unreachable,
        &["admin", "set-tier", "--user", &nobody, "--tier", "gold"],
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("unknown tier `gold`"), "{stderr}");
}

/// Admin commands whose output cannot be written (stdout on a full disk): the error names what
/// was written all the same, and a key whose secret nobody saw is revoked rather than left working.
#[tokio::test]
async fn an_admin_command_that_cannot_print_says_what_it_changed() {
    let db = TestDb::new().await;
    let to_full_disk = |args: &[&str]| {
        let out = web_command(&db.url(), args)
            .stdout(
                std::fs::File::options()
                    .write(true)
                    .open("/dev/full")
                    .unwrap(),
            )
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        stderr
    };

    let stderr = to_full_disk(&["admin", "create-user", "--name", "Ada", "--tier", "pro"]);
    let user_id: uuid::Uuid = sqlx::query_scalar("SELECT id FROM users WHERE name = 'Ada'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(
        stderr.contains(&format!(
            "user {user_id} was created, but printing it failed"
        )),
        "{stderr}"
    );

    let stderr = to_full_disk(&["admin", "issue-key", "--user", &user_id.to_string()]);
    let (key_id, revoked): (String, bool) =
        sqlx::query_as("SELECT id, revoked_at IS NOT NULL FROM api_keys WHERE user_id = $1")
            .bind(user_id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(revoked, "a key nobody saw is still valid");
    assert!(
        stderr.contains(&format!(
            "key {key_id} was issued, but printing it failed, so it was revoked"
        )),
        "{stderr}"
    );
}

/// An environment variable that is not UTF-8: ignored when it is not one of web's settings (a
/// panic and exit 101 before, whatever the subcommand), refused by name when it is.
#[tokio::test]
async fn a_variable_that_is_not_utf8_is_ignored_unless_it_is_a_setting() {
    use std::os::unix::ffi::OsStrExt;
    let db = TestDb::new().await;
    let not_utf8 = std::ffi::OsStr::from_bytes(b"caf\xe9");
    let out = web_command(
        &db.url(),
        &["admin", "create-user", "--name", "Ada", "--tier", "free"],
    )
    .env("LEGACY_LOCALE_NAME", not_utf8)
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    let user: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(user["tier"], "free");

    let users: i64 = sqlx::query_scalar("SELECT count(*) FROM users")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let out = web_command(
        &db.url(),
        &["admin", "create-user", "--name", "Bob", "--tier", "free"],
    )
    .env("HTTP_REQUEST_TIMEOUT", not_utf8)
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("HTTP_REQUEST_TIMEOUT") && stderr.contains("is not valid UTF-8"),
        "{stderr}"
    );
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM users")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(after, users);
}

/// `web migrate` against a table another session holds for longer than it will wait: it gives up
/// with exit 1 and a message saying why, having waited in short attempts; once the table is free
/// it succeeds.
#[tokio::test]
async fn migrate_gives_up_on_a_table_held_too_long_and_succeeds_once_it_is_free() {
    let db = TestDb::new().await;
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE _sqlx_migrations IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_web"))
        .arg("migrate")
        .env("DATABASE_URL", db.url())
        .env("RUST_LOG", "error")
        .env("MIGRATION_LOCK_TIMEOUT", "200ms")
        .env("MIGRATION_GIVE_UP_AFTER", "1s")
        .output()
        .unwrap();
    let waited = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("gave up applying migrations after 2 attempts")
            && stderr.contains("lock timeout"),
        "{stderr}"
    );
    // Two attempts of 200 ms and a pause, not a wait for the holder.
    assert!(waited < Duration::from_secs(30), "{waited:?}");
    holder.rollback().await.unwrap();
    let (ok, _, err) = web(&db, &["migrate"]);
    assert!(ok, "{err}");
}

#[tokio::test]
async fn bad_settings_stop_the_start_with_one_line_and_write_nothing() {
    let db = TestDb::new().await;
    let bin = env!("CARGO_BIN_EXE_web");
    for (env, needle) in [
        (
            ("DATABASE_MAX_CONNECTIONS", "0"),
            "DATABASE_MAX_CONNECTIONS must be at least 1, got 0",
        ),
        (
            ("HTTP_REQUEST_TIMEOUT", "0s"),
            "HTTP_REQUEST_TIMEOUT must be longer than zero",
        ),
        (
            ("RATELIMIT_DEADLINE", "0s"),
            "RATELIMIT_DEADLINE must be longer than zero",
        ),
        (
            ("RATELIMIT_DEADLINE", "30"),
            "environment variable RATELIMIT_DEADLINE=\"30\": expected a duration with a unit, such as `30s`",
        ),
        (
            ("RATELIMIT_DEADLINE", "1m"),
            "RATELIMIT_DEADLINE (60s) must be shorter than HTTP_REQUEST_TIMEOUT (30s)",
        ),
        (
            ("RESOLVE_TIMEOUT", "0s"),
            "RESOLVE_TIMEOUT must be longer than zero",
        ),
        (
            ("HTTP_BODY_LIMIT", "0"),
            "HTTP_BODY_LIMIT must be at least 1 byte",
        ),
        (
            ("ENQUEUE_BATCH_MAX", "0"),
            "ENQUEUE_BATCH_MAX must be between 1 and 10000",
        ),
        (
            ("ENQUEUE_BATCH_MAX", "4611686018427387904"),
            "ENQUEUE_BATCH_MAX must be between 1 and 10000",
        ),
        (
            ("ENQUEUE_BATCH_CONCURRENCY", "0"),
            "ENQUEUE_BATCH_CONCURRENCY must be between 1 and 64",
        ),
        (
            ("ENQUEUE_BATCH_CONCURRENCY", "1000000"),
            "ENQUEUE_BATCH_CONCURRENCY must be between 1 and 64",
        ),
        (
            ("METRICS_EXPORT_INTERVAL", "0s"),
            "METRICS_EXPORT_INTERVAL must be longer than zero",
        ),
        (
            ("OTLP_EXPORT_TIMEOUT", "18446744073709551615s"),
            "OTLP_EXPORT_TIMEOUT",
        ),
        (
            ("QUOTA_ANALYSIS_FREE_LIMIT", "-3"),
            "environment variable QUOTA_ANALYSIS_FREE_LIMIT=\"-3\": invalid value: integer `-3`, expected u32",
        ),
    ] {
        let line = db.refused_start(bin, &["serve"], &[env]).await;
        assert!(line.starts_with("web: "), "{line}");
        assert!(line.contains(needle), "{env:?}: {line}");
    }
    // The subcommands build a pool too; a pool of 0 used to be raised to 1 quietly.
    for args in [
        &["migrate"][..],
        &["admin", "create-user", "--name", "X", "--tier", "pro"][..],
    ] {
        let line = db
            .refused_start(bin, args, &[("DATABASE_MAX_CONNECTIONS", "0")])
            .await;
        assert_eq!(
            line, "web: DATABASE_MAX_CONNECTIONS must be at least 1, got 0",
            "{args:?}"
        );
    }
    // Command lines clap refuses: one line and exit code 1 like any other refusal, not clap's
    // usage block and exit code 2.
    for (args, expected) in [
        (
            &["admin", "set-tier", "--user", "42", "--tier", "pro"][..],
            "web: invalid value '42' for '--user <USER>'",
        ),
        (
            &[
                "admin",
                "set-tier",
                "--user",
                "0190b7a2-0000-7000-8000-000000000000",
            ][..],
            "web: the following required arguments were not provided: --tier <TIER>",
        ),
        (&["admin"][..], "web: a subcommand is required (see --help)"),
        (
            &["serve", "--no-such-flag"][..],
            "web: unexpected argument '--no-such-flag'",
        ),
    ] {
        let line = db.refused_start(bin, args, &[]).await;
        assert!(line.starts_with(expected), "{args:?}: {line}");
    }
    // A misspelt key in the --config file.
    let file = std::env::temp_dir().join(format!("fairlane-web-{}.toml", uuid::Uuid::new_v4()));
    std::fs::write(&file, "http_request_timout = \"5s\"\n").unwrap();
    let path = file.to_str().unwrap().to_owned();
    let line = db
        .refused_start(bin, &["--config", &path, "serve"], &[])
        .await;
    std::fs::remove_file(&file).unwrap();
    assert_eq!(
        line,
        format!(
            "web: loading configuration: config file {path}: unknown setting `http_request_timout` (settings are the environment variables' names in lower case)"
        )
    );
}

/// Sends `GET path` with `key` on the kept-alive `stream` and returns the status code.
async fn get_on(stream: &mut tokio::net::TcpStream, path: &str, key: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: fairlane\r\nAuthorization: Bearer {key}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let (head_end, length) = loop {
        let n = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut buf))
            .await
            .expect("an answer")
            .unwrap();
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&seen).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse::<usize>().unwrap())
                })
                .unwrap_or(0);
            break (end + 4, length);
        }
    };
    while seen.len() < head_end + length {
        let n = stream.read(&mut buf).await.unwrap();
        assert!(n > 0);
        seen.extend_from_slice(&buf[..n]);
    }
    let status_line = String::from_utf8_lossy(&seen[..head_end]).into_owned();
    status_line.split(' ').nth(1).unwrap().parse().unwrap()
}

/// With fewer open files allowed than `HTTP_MAX_CONNECTIONS` (here 300 against 4,096), idle
/// clients cannot take every descriptor: the server serves fewer connections at once, and the
/// rest wait in the backlog. A request on a connection already open still gets the database
/// connections it needs, instead of a 500 for want of a descriptor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_clients_cannot_take_the_descriptors_the_database_needs() {
    let db = TestDb::new().await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    let (child, http) = spawn_web_under(&db, &[], &["prlimit", "--nofile=300:300", "--"]).await;
    let addr = http.base.trim_start_matches("http://").to_owned();
    let mut kept = tokio::net::TcpStream::connect(&addr).await.unwrap();
    assert_eq!(get_on(&mut kept, "/v1/usage", &key).await, 200);

    // More than the 300 descriptors, fewer than those served plus the listen backlog (128).
    let mut idle = Vec::new();
    for _ in 0..320 {
        idle.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Every database session of the server ends: the next request needs new ones.
    sqlx::query(
        "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid() \
           AND backend_type = 'client backend'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(get_on(&mut kept, "/v1/usage", &key).await, 200);
    drop(idle);
    drop(child);
}

/// A `git ls-remote` scratch folder left by a web process that no longer runs (killed mid-
/// request) is removed when web starts; one of a live process is kept. The pod's temporary
/// folder outlives the container, so they piled up across restarts.
#[tokio::test]
async fn scratch_folders_of_dead_web_processes_are_swept_at_start() {
    let db = TestDb::new().await;
    let tmp = testkit::git_fixture::TempDir::new("web-scratch");
    let root = tmp.path().join("fairlane-inventory");
    let mut gone = Command::new("true").spawn().unwrap();
    let dead_pid = gone.id();
    gone.wait().unwrap();
    let dead = root.join(format!("fairlane-inv-{dead_pid}-0-1x0"));
    let own_pid = std::process::id();
    let own_start = inventory::fetch::process_start_time(i32::try_from(own_pid).unwrap());
    let live = root.join(format!("fairlane-inv-{own_pid}-{own_start}-1x0"));
    for dir in [&dead, &live] {
        std::fs::create_dir_all(dir.join("home")).unwrap();
    }
    let (child, _http) = spawn_web(&db, &[("TMPDIR", tmp.path().display().to_string())]).await;
    assert!(!dead.exists(), "{} is still there", dead.display());
    assert!(live.exists(), "a live process's folder was removed");
    drop(child);
}

/// The process's peak resident memory so far (`VmHWM`), in bytes.
fn peak_resident_bytes(pid: nix::unistd::Pid) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .map(|v| v.trim().parse().unwrap())
        .expect("VmHWM in /proc/<pid>/status");
    kib * 1024
}

/// A completed analysis's inventory is passed through as the stored text: reading one of 68 MB
/// of JSON (400,000 tests) raises web's peak memory by about three times that (the connection's
/// read buffer, the text, the body), where parsing it into a tree (a map per test) and
/// serialising the tree again took seven times (485 MB), and a few concurrent reads of one large
/// result could take gigabytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_result_is_served_without_parsing_it() {
    let db = TestDb::new().await;
    let (child, http) = spawn_web(&db, &[]).await;
    let (user, key) = user_with_key(&db.pool, "pro").await;
    let (id, stored) = large_analysis(&db, user).await;
    let before = peak_resident_bytes(child.pid());
    let r = http.get(&format!("/v1/analyses/{id}"), &key).await;
    assert_large_analysis(&r);
    let grown = peak_resident_bytes(child.pid()).saturating_sub(before);
    eprintln!("stored {} MB, peak grew {} MB", stored >> 20, grown >> 20);
    assert!(
        grown < 4 * stored,
        "reading {stored} bytes of result raised the peak by {grown} bytes"
    );
}

/// Concurrent reads of one large result share `HTTP_LARGE_READ_MEMORY` (here less than one
/// read's peak, so they run one at a time): four at once raise web's peak memory about as much
/// as one, where each added its own three times the text (a few polls of a large result could
/// take the process past its memory limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reads_of_a_large_result_share_a_memory_budget() {
    let db = TestDb::new().await;
    let (child, http) = spawn_web(&db, &[("HTTP_LARGE_READ_MEMORY", "100000000".into())]).await;
    let (user, key) = user_with_key(&db.pool, "pro").await;
    let (id, stored) = large_analysis(&db, user).await;
    let before = peak_resident_bytes(child.pid());
    let reads: Vec<_> = (0..4)
        .map(|_| {
            let http = http.clone();
            let (path, key) = (format!("/v1/analyses/{id}"), key.clone());
            tokio::spawn(async move { http.get(&path, &key).await })
        })
        .collect();
    for read in reads {
        assert_large_analysis(&read.await.unwrap());
    }
    let grown = peak_resident_bytes(child.pid()).saturating_sub(before);
    eprintln!(
        "stored {} MB, four reads grew the peak {} MB",
        stored >> 20,
        grown >> 20
    );
    assert!(
        grown < 5 * stored,
        "four reads of {stored} bytes of result raised the peak by {grown} bytes"
    );
}

/// A completed analysis of `user` with an inventory of 400 files of 1,000 tests (about 68 MB
/// of JSON); its id and the size of its result as text.
async fn large_analysis(db: &TestDb, user: uuid::Uuid) -> (uuid::Uuid, u64) {
    let (id,): (uuid::Uuid,) = sqlx::query_as(
        "INSERT INTO analyses (user_id, repository, commit, state, result, completed_at) \
         SELECT $1, 'https://example.com/big.git', repeat('b', 40), 'completed', \
                jsonb_build_object('files', jsonb_agg(jsonb_build_object('path', 'f' || f, \
                  'tests', (SELECT jsonb_agg(jsonb_build_object('name', repeat('n', 150) || t, \
                                                                'line', t)) \
                            FROM generate_series(1, 1000) t)))), now() \
         FROM generate_series(1, 400) f RETURNING id",
    )
    .bind(user)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let (stored,): (i64,) =
        sqlx::query_as("SELECT length(result::text)::bigint FROM analyses WHERE id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    (id, u64::try_from(stored).unwrap())
}

/// `r` is [`large_analysis`]'s record with its whole inventory.
fn assert_large_analysis(r: &support::Resp) {
    assert_eq!(r.status, 200);
    let body = r.json();
    assert_eq!(body["result"]["files"].as_array().unwrap().len(), 400);
    assert_eq!(
        body["result"]["files"][399]["tests"][999]["line"], 1000,
        "the inventory as stored"
    );
}

/// Sends `request` on a new connection to `addr` and returns the answer's status line.
async fn raw_status_line(addr: &str, request: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    // The server may answer (and close) before it has read everything.
    let _ = stream.write_all(request).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer)
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// The value of `fairlane_http_connection_errors_total{reason="<reason>"}` in `metrics`.
fn connection_errors(metrics: &str, reason: &str) -> f64 {
    metrics
        .lines()
        .filter(|line| {
            line.starts_with("fairlane_http_connection_errors_total{")
                && line.contains(&format!("reason=\"{reason}\""))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Requests hyper refuses itself (a malformed request line, headers beyond its limits) never
/// reach the API's request metric; they are counted by reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_refused_before_the_api_are_counted_by_reason() {
    let db = TestDb::new().await;
    let (_child, http) = spawn_web(&db, &[]).await;
    let addr = http.base.trim_start_matches("http://").to_owned();
    let before = http.send(Method::GET, "/metrics", &[], None).await.text();
    for reason in web::serve::CONNECTION_ERROR_REASONS {
        assert_eq!(
            connection_errors(&before, reason),
            0.0,
            "{reason}\n{before}"
        );
    }
    let malformed = raw_status_line(&addr, b"NOT HTTP AT ALL\r\n\r\n").await;
    assert!(malformed.contains(" 400 "), "{malformed}");
    let mut many = b"GET /healthz HTTP/1.1\r\nHost: fairlane\r\n".to_vec();
    for n in 0..200 {
        many.extend_from_slice(format!("X-Filler-{n}: x\r\n").as_bytes());
    }
    many.extend_from_slice(b"\r\n");
    let too_large = raw_status_line(&addr, &many).await;
    assert!(too_large.contains(" 431 "), "{too_large}");
    testkit::eventually(Duration::from_secs(10), "both to be counted", || async {
        let after = http.send(Method::GET, "/metrics", &[], None).await.text();
        (connection_errors(&after, "malformed") == 1.0
            && connection_errors(&after, "headers_too_large") == 1.0)
            .then_some(())
    })
    .await;
}
