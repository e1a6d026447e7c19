//! `scheduler` started with bad settings: exit code 1, one line on stderr naming the setting,
//! nothing written. Its settings used to be checked only after `main` had built the pool, so a
//! pool of 0 panicked in sqlx before the "at least 8" check could run.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use testkit::TestDb;

const BIN: &str = env!("CARGO_BIN_EXE_scheduler");

#[tokio::test]
async fn bad_settings_stop_the_start_with_one_line_and_write_nothing() {
    let db = TestDb::new().await;
    for (env, needle) in [
        (
            ("DATABASE_MAX_CONNECTIONS", "0"),
            "DATABASE_MAX_CONNECTIONS must be at least 8",
        ),
        (
            ("QUEUE_PROMOTE_INTERVAL", "0s"),
            "QUEUE_PROMOTE_INTERVAL must be greater than zero",
        ),
        (
            ("QUEUE_HEARTBEAT_INTERVAL", "18446744073709551615s"),
            "QUEUE_HEARTBEAT_INTERVAL",
        ),
        (("REANALYZE_BATCH", "-5"), "REANALYZE_BATCH"),
        (("REANALYZE_AFTER", "7"), "`30s`"),
        (
            ("OTLP_EXPORT_TIMEOUT", "0s"),
            "OTLP_EXPORT_TIMEOUT must be longer than zero",
        ),
        // Any scheme was read as PostgreSQL's: the scheduler waited for its database for ever.
        (
            ("DATABASE_URL", "mysql://db/fairlane"),
            "DATABASE_URL is not a PostgreSQL URL",
        ),
    ] {
        let line = db.refused_start(BIN, &[], &[env]).await;
        assert!(line.starts_with("scheduler: "), "{line}");
        assert!(line.contains(needle), "{env:?}: {line}");
    }
    // An empty FAIRLANE_CONFIG is unset, like any other empty variable (clap refused it as an
    // empty `--config` before the settings were read).
    let line = db
        .refused_start(
            BIN,
            &[],
            &[("FAIRLANE_CONFIG", ""), ("DATABASE_MAX_CONNECTIONS", "0")],
        )
        .await;
    assert!(
        line.starts_with("scheduler: ")
            && line.contains("DATABASE_MAX_CONNECTIONS must be at least 8"),
        "{line}"
    );
    // A command line clap refuses is one line and exit code 1 as well.
    let line = db.refused_start(BIN, &["--confg", "x.toml"], &[]).await;
    assert!(
        line.starts_with("scheduler: unexpected argument '--confg'"),
        "{line}"
    );
}
