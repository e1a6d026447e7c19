//! The scheduler's connections run READ COMMITTED whatever the database's default: its reservation
//! cleanup and the rescue decide after their locks, on what was committed before them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[tokio::test]
async fn connections_are_read_committed_whatever_the_databases_default() {
    testkit::assert_pools_pin_read_committed(|db| {
        let config = scheduler::config::Config {
            database_url: db.url(),
            ..scheduler::config::Config::default()
        };
        vec![scheduler::lazy_pool(&config).unwrap()]
    })
    .await;
}
