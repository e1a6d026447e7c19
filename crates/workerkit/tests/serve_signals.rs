//! A worker binary's `serve` listens for SIGTERM before it runs anything: a SIGTERM that
//! arrives as soon as the service starts (before its first `.await`) is a shutdown, not death.
//! This file is its own test binary, so the signals it sends reach no other test.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use workerkit::WorkerConfig;

/// SIGTERM to this very process, synchronously (the calling task does not yield meanwhile).
fn sigterm_to_self() {
    let status = Command::new("kill")
        .args(["-TERM", &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

// A current-thread runtime: nothing spawned runs until the service's first `.await`, so a
// handler installed by a spawned task would not be in place yet and SIGTERM would kill the test.
#[tokio::test(flavor = "current_thread")]
async fn sigterm_before_the_service_first_yields_cancels_its_shutdown_token() {
    let config = WorkerConfig::default();
    let result = workerkit::serve(&config, |_pool, shutdown| async move {
        sigterm_to_self();
        tokio::time::timeout(Duration::from_secs(10), shutdown.cancelled())
            .await
            .expect("SIGTERM cancels the shutdown token");
        Ok(())
    })
    .await;
    assert!(result.is_ok(), "{result:?}");
}
