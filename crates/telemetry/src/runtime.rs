//! The async runtime a service binary runs on, and how it ends: without waiting on blocking
//! work that nothing will use any more.

use std::future::Future;
use std::time::Duration;

/// How long blocking tasks still running after a service's work is done may hold up its exit.
pub const LEFTOVER_BLOCKING_WAIT: Duration = Duration::from_secs(1);

/// Runs `service` to completion on a new multi-threaded runtime, then ends the runtime within
/// [`LEFTOVER_BLOCKING_WAIT`]. Dropping a runtime instead waits for every blocking task without
/// limit: a repository scan the engine abandoned at shutdown runs on until its own deadline
/// (`ANALYZER_SCAN_TIMEOUT`), past the pod's grace period, and the process is then killed
/// (exit 137) after its work, telemetry flush included, was done.
pub fn block_on<F: Future>(service: F) -> std::io::Result<F::Output> {
    let runtime = tokio::runtime::Runtime::new()?;
    let output = runtime.block_on(service);
    runtime.shutdown_timeout(LEFTOVER_BLOCKING_WAIT);
    Ok(output)
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    #[test]
    fn a_blocking_task_left_running_does_not_hold_up_the_end() {
        let started = Instant::now();
        let output = block_on(async {
            drop(tokio::task::spawn_blocking(|| {
                std::thread::sleep(Duration::from_secs(60));
            }));
            42
        })
        .unwrap();
        assert_eq!(output, 42);
        // About LEFTOVER_BLOCKING_WAIT; dropping the runtime would take the whole minute.
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{:?}",
            started.elapsed()
        );
    }
}
