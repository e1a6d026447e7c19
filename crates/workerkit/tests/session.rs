//! The workers' connections run READ COMMITTED whatever the database's default: the fairness gate
//! counts a user's running jobs after taking the user's lock, and must see every admission
//! committed before it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[tokio::test]
async fn connections_are_read_committed_whatever_the_databases_default() {
    testkit::assert_pools_pin_read_committed(|db| {
        let config = workerkit::WorkerConfig {
            database_url: db.url(),
            ..workerkit::WorkerConfig::default()
        };
        vec![workerkit::lazy_pool(&config).unwrap()]
    })
    .await;
}
