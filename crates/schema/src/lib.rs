//! Fairlane's database schema: every migration in the workspace's `migrations/` folder, embedded
//! at compile time, so each binary can apply it (`web migrate`) or check it (`/readyz`).

use std::time::{Duration, Instant};

use sqlx::migrate::{MigrateError, Migrator};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection, PgPool};

/// All of Fairlane's migrations, in order.
pub static MIGRATOR: Migrator = sqlx::migrate!("../../migrations");

/// A schema problem.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    #[error("applying migrations failed: {0}")]
    Migrate(#[from] MigrateError),
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error(
        "database schema is behind: {missing} of {expected} migrations are not applied (run `web migrate`)"
    )]
    Behind { missing: usize, expected: usize },
    #[error(
        "a migration could not take its locks in {attempts} attempts over {waited:?} (each waited \
         {lock_timeout:?}); a long transaction holds a table it changes: end it, or run \
         `web migrate` again when the database is quieter ({last})"
    )]
    LocksUnavailable {
        attempts: u32,
        waited: Duration,
        lock_timeout: Duration,
        last: sqlx::Error,
    },
}

/// How [`migrate_patiently`] waits for the locks its migrations take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockPatience {
    /// Longest one attempt waits for a lock (the session's `lock_timeout`). While a migration
    /// waits for a table, every later statement on it waits behind the migration, so this is
    /// how long a migration may stall the queue's reads and writes at a time.
    pub lock_timeout: Duration,
    /// Longest time to go on trying, pauses included; then the migration fails, nothing of it
    /// applied.
    pub give_up_after: Duration,
    /// The pause between attempts, in which the statements queued behind the last attempt run.
    pub pause: Duration,
}

impl Default for LockPatience {
    /// 5 s per attempt and between attempts, for up to 10 minutes.
    fn default() -> Self {
        LockPatience {
            lock_timeout: Duration::from_secs(5),
            give_up_after: Duration::from_secs(600),
            pause: Duration::from_secs(5),
        }
    }
}

/// Applies every pending migration (safe to run concurrently: sqlx takes an advisory lock).
pub async fn migrate(pool: &PgPool) -> Result<(), SchemaError> {
    MIGRATOR.run(pool).await?;
    Ok(())
}

/// Applies every pending migration, none of them waiting for a lock longer than
/// `patience.lock_timeout` at a time: a migration that cannot take its locks (a long transaction
/// holds the table) is rolled back and tried again after a pause, until
/// `patience.give_up_after`. Waiting without a limit instead would queue every statement on that
/// table (job fetches, completions, enqueues) behind the migration for as long as the long
/// transaction lasts.
pub async fn migrate_patiently(
    options: &PgConnectOptions,
    patience: LockPatience,
) -> Result<(), SchemaError> {
    apply_patiently(&MIGRATOR, options, patience).await
}

/// [`migrate_patiently`] with any migrator (tests bring their own).
pub async fn apply_patiently(
    migrator: &Migrator,
    options: &PgConnectOptions,
    patience: LockPatience,
) -> Result<(), SchemaError> {
    let lock_timeout = format!("{}ms", patience.lock_timeout.as_millis().max(1));
    let options = options
        .clone()
        .options([("lock_timeout", lock_timeout.as_str())]);
    let started = Instant::now();
    let mut attempts = 0;
    loop {
        attempts += 1;
        // A connection per attempt: a failed attempt's session ends with it, and with the
        // session the migrator's advisory lock, which sqlx does not release on an error.
        let mut conn = PgConnection::connect_with(&options).await?;
        let result = migrator.run(&mut conn).await;
        let Err(e) = result else {
            conn.close().await?;
            return Ok(());
        };
        drop(conn);
        let last = lock_unavailable(e)?;
        let waited = started.elapsed();
        if waited + patience.pause >= patience.give_up_after {
            return Err(SchemaError::LocksUnavailable {
                attempts,
                waited,
                lock_timeout: patience.lock_timeout,
                last,
            });
        }
        tracing::warn!(
            attempt = attempts,
            error = %last,
            "a migration could not take its locks within {:?}; rolled back, trying again in {:?}",
            patience.lock_timeout,
            patience.pause
        );
        tokio::time::sleep(patience.pause).await;
    }
}

/// `Ok` with the database's error if `e` is a lock that could not be taken in time (`55P03`,
/// both for a migration's statements and for the migrator's advisory lock); any other error as
/// the `Err` it is.
fn lock_unavailable(e: MigrateError) -> Result<sqlx::Error, SchemaError> {
    let is_lock_timeout = |e: &sqlx::Error| {
        e.as_database_error()
            .and_then(|d| d.code())
            .is_some_and(|code| code == "55P03")
    };
    match e {
        MigrateError::Execute(e) | MigrateError::ExecuteMigration(e, _) if is_lock_timeout(&e) => {
            Ok(e)
        }
        other => Err(other.into()),
    }
}

/// Checks that every embedded migration is applied (readiness).
pub async fn check_applied(pool: &PgPool) -> Result<(), SchemaError> {
    let applied: Vec<(i64,)> =
        match sqlx::query_as("SELECT version FROM _sqlx_migrations WHERE success")
            .fetch_all(pool)
            .await
        {
            Ok(rows) => rows,
            // No migrations table yet: nothing applied.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => Vec::new(),
            Err(e) => return Err(e.into()),
        };
    let expected = MIGRATOR
        .iter()
        .filter(|m| m.migration_type.is_up_migration())
        .count();
    let missing = MIGRATOR
        .iter()
        .filter(|m| m.migration_type.is_up_migration())
        .filter(|m| !applied.iter().any(|(v,)| *v == m.version))
        .count();
    if missing > 0 {
        return Err(SchemaError::Behind { missing, expected });
    }
    Ok(())
}
