//! The workers' connections run READ COMMITTED whatever the database's default: the fairness gate
//! counts a user's running jobs after taking the user's lock, and must see every admission
//! committed before it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use testkit::TestDb;

#[tokio::test]
async fn connections_are_read_committed_whatever_the_databases_default() {
    let db = TestDb::new().await;
    db.set_default_isolation("repeatable read").await;
    let config = workerkit::WorkerConfig {
        database_url: db.url(),
        ..workerkit::WorkerConfig::default()
    };
    let pool = workerkit::lazy_pool(&config).unwrap();
    assert_eq!(testkit::isolation_of(&pool).await, "read committed");
    assert_eq!(
        testkit::isolation_of(&db.pool_with(1).await).await,
        "repeatable read",
        "the database's default applies without the settings"
    );
}
