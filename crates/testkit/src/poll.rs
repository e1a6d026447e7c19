//! Waiting in tests for something another task or process brings about: poll until it holds, or
//! fail naming what never happened.

use std::future::Future;
use std::time::Duration;

/// Polls `check` every 20 ms until it returns `Some`, and returns that; panics after `timeout`
/// with `what`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
