//! `migrate_patiently` against a real PostgreSQL: a migration blocked by a long transaction
//! waits in short attempts, so the statements on its table are never stuck behind it, is tried
//! again when its connection is lost, and applies once the table is free; one blocked for good
//! gives up with nothing applied. A plain migration, for contrast, stalls every writer of the
//! table while it waits.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use schema::{LockPatience, SchemaError, apply_patiently};
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection, SqlSafeStr};
use testkit::TestDb;

/// One migration that needs an exclusive lock on `t`, recorded in a table of its own.
fn adding_a_column() -> Migrator {
    let mut migrator = Migrator::with_migrations(vec![Migration::new(
        1,
        "add a column".into(),
        MigrationType::Simple,
        "ALTER TABLE t ADD COLUMN y int".into_sql_str(),
        false,
    )]);
    migrator.dangerous_set_table_name("patience_migrations");
    migrator
}

fn options(db: &TestDb) -> PgConnectOptions {
    db.pool.connect_options().as_ref().clone()
}

/// A table `t`, and a session reading it in a transaction left open.
async fn table_held_by_a_reader(db: &TestDb) -> PgConnection {
    sqlx::query("CREATE TABLE t (x int)")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut reader = PgConnection::connect_with(&options(db)).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT count(*) FROM t")
        .execute(&mut reader)
        .await
        .unwrap();
    reader
}

/// Waits until a migration's `ALTER TABLE` is waiting for its lock in this test's database (the
/// tests beside it run the same statement in theirs), in a session other than `not`; returns
/// that session's process id.
async fn until_the_migration_waits(db: &TestDb, not: Option<i32>) -> i32 {
    testkit::eventually(
        Duration::from_secs(10),
        "the migration to wait for its lock",
        || async {
            sqlx::query_scalar(
                "SELECT pid FROM pg_stat_activity WHERE query LIKE 'ALTER TABLE t%' \
                 AND wait_event_type = 'Lock' AND datname = current_database() \
                 AND pid IS DISTINCT FROM $1 LIMIT 1",
            )
            .bind(not)
            .fetch_optional(&db.pool)
            .await
            .unwrap()
        },
    )
    .await
}

/// An insert into `t` from a session of its own that waits at most `patience` for its lock.
async fn insert_waiting_at_most(db: &TestDb, patience: &str) -> Result<(), sqlx::Error> {
    let mut writer = PgConnection::connect_with(&options(db).options([("lock_timeout", patience)]))
        .await
        .unwrap();
    sqlx::query("INSERT INTO t VALUES (1)")
        .execute(&mut writer)
        .await
        .map(drop)
}

async fn has_column_y(db: &TestDb) -> bool {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT FROM information_schema.columns \
         WHERE table_name = 't' AND column_name = 'y')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_migration_waits_in_short_attempts_and_applies_once_the_table_is_free() {
    let db = TestDb::new().await;
    let reader = table_held_by_a_reader(&db).await;
    let patience = LockPatience {
        lock_timeout: Duration::from_millis(200),
        give_up_after: Duration::from_secs(120),
        pause: Duration::from_millis(300),
    };
    let options = options(&db);
    let migrator = adding_a_column();
    let (applied, ()) = tokio::join!(apply_patiently(&migrator, &options, patience), async {
        until_the_migration_waits(&db, None).await;
        // Writers of the table get through while the migration keeps trying (each waits at
        // most one attempt's 200 ms behind it), over several attempts.
        for _ in 0..8 {
            insert_waiting_at_most(&db, "3s").await.unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(!has_column_y(&db).await);
        reader.close().await.unwrap();
    });
    applied.unwrap();
    assert!(has_column_y(&db).await);
    let applied: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM patience_migrations WHERE success")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(applied, [1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_blocked_for_good_gives_up_with_nothing_applied() {
    let db = TestDb::new().await;
    let reader = table_held_by_a_reader(&db).await;
    let patience = LockPatience {
        lock_timeout: Duration::from_millis(100),
        give_up_after: Duration::from_millis(1500),
        pause: Duration::from_millis(200),
    };
    let e = apply_patiently(&adding_a_column(), &options(&db), patience)
        .await
        .unwrap_err();
    let SchemaError::GaveUp { attempts, last, .. } = &e else {
        panic!("{e}");
    };
    assert!(*attempts >= 2, "{e}");
    assert_eq!(
        last.as_database_error().and_then(|d| d.code()).as_deref(),
        Some("55P03"),
        "{e}"
    );
    let text = e.to_string();
    assert!(
        text.starts_with("gave up applying migrations after ")
            && text.contains("a long transaction, or another `web migrate`, holds a table"),
        "{text}"
    );
    assert!(!has_column_y(&db).await);
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM patience_migrations")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(applied, 0);
    reader.close().await.unwrap();
}

/// What the patience is for: a migration that waits for its lock without a limit holds up
/// every writer of the table for as long as the long transaction lasts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_migration_blocked_by_a_reader_stalls_the_tables_writers() {
    let db = TestDb::new().await;
    let reader = table_held_by_a_reader(&db).await;
    let migration = {
        let pool = db.pool.clone();
        tokio::spawn(async move { adding_a_column().run(&pool).await })
    };
    until_the_migration_waits(&db, None).await;
    let stalled = insert_waiting_at_most(&db, "1s").await.unwrap_err();
    assert_eq!(
        stalled
            .as_database_error()
            .and_then(|d| d.code())
            .as_deref(),
        Some("55P03"),
        "{stalled}"
    );
    reader.close().await.unwrap();
    migration.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_whose_connection_is_lost_is_tried_again() {
    let db = TestDb::new().await;
    let reader = table_held_by_a_reader(&db).await;
    // Lock waits long enough for the session to be found and ended while it waits.
    let patience = LockPatience {
        lock_timeout: Duration::from_secs(30),
        give_up_after: Duration::from_secs(120),
        pause: Duration::from_millis(100),
    };
    let options = options(&db);
    let migrator = adding_a_column();
    let (applied, ()) = tokio::join!(apply_patiently(&migrator, &options, patience), async {
        let first = until_the_migration_waits(&db, None).await;
        let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(first)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert!(ended);
        // The next attempt, on a new connection, waits for the lock again.
        until_the_migration_waits(&db, Some(first)).await;
        reader.close().await.unwrap();
    });
    applied.unwrap();
    assert!(has_column_y(&db).await);
}
