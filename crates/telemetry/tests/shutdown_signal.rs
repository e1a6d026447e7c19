//! `shutdown_on_signals` listens from the moment it returns: SIGINT or SIGTERM sent before the
//! calling task yields even once still cancels its token instead of killing the process.
//! A SIGTERM after a SIGINT leaves the drain running (a repeated signal of one kind ends the
//! process: crates/web/tests/process.rs). This file is its own test binary, so the signals it
//! sends reach no other test; its one test runs each case on a runtime of its own, one after
//! the other, so they reach no other case either (a listener ends with its runtime).

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

/// `cargo xtask dev` and process managers follow a terminal's Ctrl-C (SIGINT to the whole
/// process group) with a SIGTERM of their own: that one must not end the drain, as a repeated
/// signal of the same kind does. (Were it to end the process, the test would fail with its exit
/// status.)
async fn a_sigterm_after_a_sigint_leaves_the_drain_running() {
    let shutdown = telemetry::shutdown_on_signals().unwrap();
    signal_self("INT");
    tokio::time::timeout(Duration::from_secs(10), shutdown.cancelled())
        .await
        .expect("SIGINT did not cancel the token");
    signal_self("TERM");
    tokio::time::sleep(Duration::from_millis(500)).await;
}

/// Runs `case` on a current-thread runtime of its own, which takes the case's listeners with it
/// when it ends.
fn on_its_own_runtime(case: impl Future<Output = ()>) {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(case);
}

/// One test, so that even `cargo test`, which runs the tests of a binary at once on threads of
/// one process, never has two cases' signals meet: a second SIGINT or SIGTERM reaching a
/// listener of an earlier case would end the process.
#[test]
fn signals_cancel_the_token_and_a_sigterm_after_a_sigint_leaves_the_drain_running() {
    on_its_own_runtime(signal_right_after_install_cancels_the_token("TERM"));
    on_its_own_runtime(signal_right_after_install_cancels_the_token("INT"));
    on_its_own_runtime(a_sigterm_after_a_sigint_leaves_the_drain_running());
}
