//! `specgen-worker` started with bad settings: exit code 1, one line on stderr naming the
//! setting, nothing written (a pool of 0 used to panic; lanes of 0 everywhere used to start a
//! process that works no queue).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use testkit::TestDb;

const BIN: &str = env!("CARGO_BIN_EXE_specgen-worker");

#[tokio::test]
async fn bad_settings_stop_the_start_with_one_line_and_write_nothing() {
    let db = TestDb::new().await;
    for (env, needle) in [
        (
            &[("DATABASE_MAX_CONNECTIONS", "0")][..],
            "DATABASE_MAX_CONNECTIONS must be at least 4",
        ),
        (
            &[
                ("SPECGEN_QUEUE_PRIORITY_WORKERS", "0"),
                ("SPECGEN_QUEUE_DEFAULT_WORKERS", "0"),
                ("SPECGEN_QUEUE_SCHEDULED_WORKERS", "0"),
            ][..],
            "SPECGEN_QUEUE_PRIORITY_WORKERS, SPECGEN_QUEUE_DEFAULT_WORKERS and SPECGEN_QUEUE_SCHEDULED_WORKERS are all 0",
        ),
        (
            &[("SPECGEN_QUEUE_SCHEDULED_WORKERS", "100000")][..],
            "SPECGEN_QUEUE_SCHEDULED_WORKERS must be at most 10000",
        ),
        (
            &[("FAIRNESS_SNOOZE_DURATION", "18446744073709551615s")][..],
            "FAIRNESS_SNOOZE_DURATION",
        ),
    ] {
        let line = db.refused_start(BIN, &[], env).await;
        assert!(line.starts_with("specgen-worker: "), "{line}");
        assert!(line.contains(needle), "{env:?}: {line}");
    }
}
