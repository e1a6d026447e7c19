//! The web service's connections run READ COMMITTED whatever the database's default: the quota
//! check decides after the users' locks, on what was committed before them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use testkit::TestDb;

#[tokio::test]
async fn connections_are_read_committed_whatever_the_databases_default() {
    let db = TestDb::new().await;
    db.set_default_isolation("repeatable read").await;
    let config = support::config(&db);
    for pool in [
        web::pool(&config).unwrap(),
        web::migration_pool(&config).unwrap(),
    ] {
        assert_eq!(testkit::isolation_of(&pool).await, "read committed");
    }
    assert_eq!(
        testkit::isolation_of(&db.pool_with(1).await).await,
        "repeatable read",
        "the database's default applies without the settings"
    );
}
