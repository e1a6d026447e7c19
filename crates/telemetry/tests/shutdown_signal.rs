//! `shutdown_on_signals` listens from the moment it returns: SIGINT or SIGTERM sent before the
//! calling task yields even once still cancels its token instead of killing the process.
//! This file is its own test binary, so the signals it sends reach no other test.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

fn signal_self(signal: &str) {
    let status = Command::new("kill")
        .args([&format!("-{signal}"), &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Installs the listener, signals this process at once (no `.await` in between: on a
/// current-thread runtime nothing spawned has run yet), and waits for the token.
async fn signal_right_after_install_cancels_the_token(signal: &str) {
    let shutdown = telemetry::shutdown_on_signals().unwrap();
    signal_self(signal);
    tokio::time::timeout(Duration::from_secs(10), shutdown.cancelled())
        .await
        .unwrap_or_else(|_| panic!("SIG{signal} did not cancel the token"));
}

#[tokio::test(flavor = "current_thread")]
async fn sigterm_and_sigint_right_after_install_cancel_instead_of_killing() {
    // One test for both: each install listens for both signals, and one process runs them.
    signal_right_after_install_cancels_the_token("TERM").await;
    signal_right_after_install_cancels_the_token("INT").await;
}
