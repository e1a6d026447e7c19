//! The web service's connections run READ COMMITTED whatever the database's default: the quota
//! check decides after the users' locks, on what was committed before them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

#[tokio::test]
async fn connections_are_read_committed_whatever_the_databases_default() {
    testkit::assert_pools_pin_read_committed(|db| {
        let config = support::config(db);
        vec![
            web::pool(&config).unwrap(),
            sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .connect_lazy_with(web::migration_options(&config).unwrap()),
        ]
    })
    .await;
}
