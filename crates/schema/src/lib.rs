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
        "gave up applying migrations after {attempts} attempts over {waited:?}, the last failing \
         with: {last}. A lock wait cut short (lock_timeout) means a long transaction, or another \
         `web migrate`, holds a table a migration changes: end it, or run `web migrate` again \
         when the database is quieter. Nothing of the failed migration is applied"
    )]
    GaveUp {
        attempts: u32,
        waited: Duration,
        last: sqlx::Error,
    },
}

/// How [`migrate_patiently`] waits for the locks its migrations take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockPatience {
    /// Longest one statement of a migration waits for a lock (the session's `lock_timeout`).
    /// While a migration waits for a table, every later statement on it waits behind the
    /// migration, so this bounds how long a migration stalls the queue's reads and writes at a
    /// time. A migration of several statements can wait once per statement, and a wait cut
    /// short rolls back what its transaction did so far.
    pub lock_timeout: Duration,
    /// Longest time to go on trying, pauses included; then the migration fails, nothing of it
    /// applied.
    pub give_up_after: Duration,
    /// The first pause between attempts, in which the statements queued behind the last attempt
    /// run; each further pause is twice as long, up to [`MAX_PAUSE`] (or this first pause, if it
    /// is longer).
    pub pause: Duration,
}

/// The longest pause between two attempts of [`migrate_patiently`].
pub const MAX_PAUSE: Duration = Duration::from_secs(60);

/// How long [`connect_within`] waits for a connection (a `migrate_patiently` attempt, an admin
/// command's first connection) before giving up.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

impl Default for LockPatience {
    /// Lock waits of 5 s; pauses of 5 s, doubling; up to 10 minutes.
    fn default() -> Self {
        LockPatience {
            lock_timeout: Duration::from_secs(5),
            give_up_after: Duration::from_secs(600),
            pause: Duration::from_secs(5),
        }
    }
}

/// The connect options of a `DATABASE_URL`, or why it is not a PostgreSQL URL (the URL itself
/// is not repeated: it can hold a password). Every service reads its URL with this before
/// anything starts, so `mysql://…` or `postgress://…` is one line at start rather than a
/// service waiting for its database for ever.
pub fn database_url_options(url: &str) -> Result<PgConnectOptions, String> {
    // sqlx reads any scheme as PostgreSQL's.
    if !["postgres://", "postgresql://"]
        .iter()
        .any(|scheme| url.starts_with(scheme))
    {
        return Err(
            "DATABASE_URL is not a PostgreSQL URL: it must start with postgres:// or postgresql://"
                .to_owned(),
        );
    }
    url.parse()
        .map_err(|e| format!("DATABASE_URL is not a PostgreSQL URL: {e}"))
}

/// Applies every pending migration (safe to run concurrently: sqlx takes an advisory lock).
pub async fn migrate(pool: &PgPool) -> Result<(), SchemaError> {
    MIGRATOR.run(pool).await?;
    Ok(())
}

/// Applies every pending migration, no statement of one waiting for a lock longer than
/// `patience.lock_timeout`: a migration that cannot take its locks (a long transaction holds the
/// table) is rolled back and tried again after a pause, until `patience.give_up_after`; so is
/// one that lost its connection, met a deadlock, or found the server starting up. Waiting
/// without a limit instead would queue every statement on that table (job fetches, completions,
/// enqueues) behind the migration for as long as the long transaction lasts.
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
    let mut pause = patience.pause.max(Duration::from_millis(1));
    let mut attempts = 0;
    loop {
        attempts += 1;
        let last = match attempt(migrator, &options).await {
            Ok(()) => return Ok(()),
            Err(e) => worth_retrying(e)?,
        };
        let waited = started.elapsed();
        if waited + pause >= patience.give_up_after {
            return Err(SchemaError::GaveUp {
                attempts,
                waited,
                last,
            });
        }
        tracing::warn!(
            attempt = attempts,
            error = %last,
            "a migration attempt failed and was rolled back; trying again in {pause:?}"
        );
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MAX_PAUSE.max(patience.pause));
    }
}

/// One attempt on a connection of its own: a failed attempt's session ends with it, and with the
/// session the migrator's advisory lock, which sqlx does not release on an error.
async fn attempt(migrator: &Migrator, options: &PgConnectOptions) -> Result<(), MigrateError> {
    let mut conn = connect_within(options)
        .await
        .map_err(MigrateError::Execute)?;
    migrator.run(&mut conn).await?;
    conn.close().await?;
    Ok(())
}

/// One connection of `options`, or the reason there is none (refused, a wrong password, no such
/// database), an I/O `TimedOut` error after [`CONNECT_TIMEOUT`] without an answer.
pub async fn connect_within(options: &PgConnectOptions) -> Result<PgConnection, sqlx::Error> {
    match tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(options)).await {
        Ok(connected) => connected,
        Err(_) => Err(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("connecting took longer than {CONNECT_TIMEOUT:?}"),
        ))),
    }
}

/// `Ok` with the database's error if another attempt may succeed where `e` failed: a lock wait
/// cut short (`55P03`, a migration's statement or the migrator's advisory lock), a deadlock
/// (`40P01`), a server shutting down or starting up (`57P01`–`57P03`), a lost or refused
/// connection (I/O, `08…`); any other error as the `Err` it is.
fn worth_retrying(e: MigrateError) -> Result<sqlx::Error, SchemaError> {
    let transient = |e: &sqlx::Error| match e {
        sqlx::Error::Io(_) => true,
        sqlx::Error::Database(d) => d.code().is_some_and(|code| {
            // Not a dropped database (57P04) nor a protocol violation (08P01): another attempt
            // meets them again.
            matches!(
                code.as_ref(),
                "55P03" | "40P01" | "57P01" | "57P02" | "57P03"
            ) || (code.starts_with("08") && code != "08P01")
        }),
        _ => false,
    };
    match e {
        MigrateError::Execute(e) | MigrateError::ExecuteMigration(e, _) if transient(&e) => Ok(e),
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
