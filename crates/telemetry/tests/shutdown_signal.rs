//! `shutdown_on_signals` listens from the moment it returns: SIGINT or SIGTERM sent before the
//! calling task yields even once still cancels its token instead of killing the process.
//! A SIGTERM after a SIGINT leaves the drain running (a repeated signal of one kind ends the
//! process: crates/web/tests/process.rs). This file is its own test binary, so the signals it
//! sends reach no other test.

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

/// `cargo xtask dev` and process managers follow a terminal's Ctrl-C (SIGINT to the whole
/// process group) with a SIGTERM of their own: that one must not end the drain, as a repeated
/// signal of the same kind does. (Nextest runs each test in a process of its own; were this one
/// to end the process, the test would fail with its exit status.)
#[tokio::test(flavor = "current_thread")]
async fn a_sigterm_after_a_sigint_leaves_the_drain_running() {
    let shutdown = telemetry::shutdown_on_signals().unwrap();
    signal_self("INT");
    tokio::time::timeout(Duration::from_secs(10), shutdown.cancelled())
        .await
        .expect("SIGINT did not cancel the token");
    signal_self("TERM");
    tokio::time::sleep(Duration::from_millis(500)).await;
}
