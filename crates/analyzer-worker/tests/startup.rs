//! `analyzer-worker` started with bad settings: it exits with code 1 and one line on stderr
//! naming the setting, before it writes anything (before the pool is built, so a pool of 0 no
//! longer panics, and before its worker row, so an absurd lane no longer panics after it). A lane
//! of 0 is allowed: the process leaves that queue to others and says so.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Stdio;
use std::time::Duration;

use testkit::TestDb;
use tokio::io::{AsyncBufReadExt as _, BufReader};

const BIN: &str = env!("CARGO_BIN_EXE_analyzer-worker");

fn base_env(db: &TestDb) -> Vec<(&'static str, String)> {
    vec![
        ("DATABASE_URL", db.url()),
        ("HTTP_ADDR", "127.0.0.1:0".to_owned()),
        ("RUST_LOG", "warn".to_owned()),
        ("LOG_FORMAT", "json".to_owned()),
    ]
}

/// Starts the worker with `extra`: it must refuse, naming `needle`, and write nothing.
async fn refused(db: &TestDb, extra: &[(&'static str, &str)], needle: &str) -> String {
    let line = db.refused_start(BIN, &[], extra).await;
    assert!(line.starts_with("analyzer-worker: "), "{line}");
    assert!(line.contains(needle), "{extra:?}: {line}");
    line
}

#[tokio::test]
async fn bad_settings_stop_the_start_with_one_line_and_write_nothing() {
    let db = TestDb::new().await;
    // A pool of 0 made sqlx panic (ArrayQueue::new(0)); fewer than 4 starve the heartbeat.
    for n in ["0", "3"] {
        refused(
            &db,
            &[("DATABASE_MAX_CONNECTIONS", n)],
            "DATABASE_MAX_CONNECTIONS must be at least 4",
        )
        .await;
    }
    // 2^61 workers panicked in Semaphore::new after the worker row was written.
    refused(
        &db,
        &[("ANALYZER_QUEUE_DEFAULT_WORKERS", "2305843009213693952")],
        "ANALYZER_QUEUE_DEFAULT_WORKERS must be at most 10000",
    )
    .await;
    refused(
        &db,
        &[
            ("ANALYZER_QUEUE_PRIORITY_WORKERS", "0"),
            ("ANALYZER_QUEUE_DEFAULT_WORKERS", "0"),
            ("ANALYZER_QUEUE_SCHEDULED_WORKERS", "0"),
        ],
        "would work no queue",
    )
    .await;
    refused(
        &db,
        &[("ANALYZER_QUEUE_PRIORITY_WORKERS", "-1")],
        "environment variable ANALYZER_QUEUE_PRIORITY_WORKERS=\"-1\"",
    )
    .await;
    refused(
        &db,
        &[("QUEUE_POLL_INTERVAL", "0s")],
        "QUEUE_POLL_INTERVAL must be greater than zero",
    )
    .await;
    refused(&db, &[("QUEUE_JOB_TIMEOUT", "30")], "`30s`").await;
    // Any scheme was read as PostgreSQL's: the worker waited for its database for ever.
    refused(
        &db,
        &[("DATABASE_URL", "postgress://db/fairlane")],
        "DATABASE_URL is not a PostgreSQL URL",
    )
    .await;
    // An empty FAIRLANE_CONFIG is unset (clap refused it as an empty `--config`).
    refused(
        &db,
        &[("FAIRLANE_CONFIG", ""), ("QUEUE_JOB_TIMEOUT", "30")],
        "`30s`",
    )
    .await;
    // Each overflowed a duration sum once the service ran.
    refused(
        &db,
        &[("ANALYZER_FETCH_TIMEOUT", "18446744073709551615s")],
        "ANALYZER_FETCH_TIMEOUT",
    )
    .await;
    refused(
        &db,
        &[("ANALYZER_FETCH_TIMEOUT", "30days")],
        "ANALYZER_FETCH_TIMEOUT must be at most 1day",
    )
    .await;
    refused(
        &db,
        &[("FAIRNESS_SNOOZE_JITTER", "10days")],
        "FAIRNESS_SNOOZE_JITTER must be at most 1h",
    )
    .await;
    refused(
        &db,
        &[("OTLP_EXPORT_TIMEOUT", "18446744073709551615s")],
        "OTLP_EXPORT_TIMEOUT",
    )
    .await;
    refused(
        &db,
        &[("METRICS_EXPORT_INTERVAL", "0s")],
        "METRICS_EXPORT_INTERVAL must be longer than zero",
    )
    .await;

    // A work folder that exists but cannot hold a checkout (every job failed, and was retried
    // for hours, after a start that looked healthy).
    refused(
        &db,
        &[("ANALYZER_WORK_DIR", "/proc")],
        "ANALYZER_WORK_DIR `/proc`: ",
    )
    .await;

    // A misspelt key in the config file.
    let dir = testkit::git_fixture::TempDir::new("analyzer-config");
    let file = dir.path().join("worker.toml");
    std::fs::write(&file, "analyzer_queue_priorty_workers = 2\n").unwrap();
    let line = refused(
        &db,
        &[("FAIRLANE_CONFIG", file.to_str().unwrap())],
        "unknown setting `analyzer_queue_priorty_workers`",
    )
    .await;
    assert!(line.contains(file.to_str().unwrap()), "{line}");
}

#[tokio::test]
async fn a_lane_of_zero_is_left_to_other_processes_with_a_warning() {
    let db = TestDb::new().await;
    let mut child = tokio::process::Command::new(BIN)
        .envs(base_env(&db))
        .env("ANALYZER_QUEUE_SCHEDULED_WORKERS", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let warning = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains("ANALYZER_QUEUE_SCHEDULED_WORKERS=0") {
                return line;
            }
        }
        panic!("the worker exited without the warning");
    })
    .await
    .expect("no warning about the lane of 0 within 30 s");
    assert!(warning.contains("\"level\":\"WARN\""), "{warning}");
    assert!(warning.contains("analysis_scheduled"), "{warning}");
    // It works the other two lanes.
    let queues = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let row: Option<(Vec<String>,)> = sqlx::query_as("SELECT queues FROM fairlane_worker")
                .fetch_optional(&db.pool)
                .await
                .unwrap();
            if let Some((queues,)) = row {
                return queues;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the worker never registered");
    assert_eq!(queues, ["analysis_priority", "analysis_default"]);
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id().unwrap()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("no exit within 30 s of SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");
}
