//! `wait_for_schema` gives up at once on shutdown, even while a check is stuck on a database
//! that accepted the connection and never answers (a silent network, a hung server).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn a_shutdown_does_not_wait_for_a_check_stuck_on_a_silent_database() {
    // Accepts connections and never says a word.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            open.push(socket);
        }
    });
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(30))
        .connect_lazy(&format!("postgres://postgres@{addr}/postgres"))
        .unwrap();
    let shutdown = CancellationToken::new();
    let cancel = shutdown.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        cancel.cancel();
    });
    let started = Instant::now();
    let ready = workerkit::wait_for_schema(&pool, &shutdown).await;
    assert!(!ready);
    // About the 300 ms until the shutdown; the stuck check alone would take 30 s.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    held.abort();
}
