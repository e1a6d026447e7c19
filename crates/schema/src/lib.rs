//! Fairlane's database schema: every migration in the workspace's `migrations/` folder, embedded
//! at compile time, so each binary can apply it (`web migrate`) or check it (`/readyz`).

use sqlx::PgPool;
use sqlx::migrate::Migrator;

/// All of Fairlane's migrations, in order.
pub static MIGRATOR: Migrator = sqlx::migrate!("../../migrations");

/// A schema problem.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    #[error("applying migrations failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error(
        "database schema is behind: {missing} of {expected} migrations are not applied (run `web migrate`)"
    )]
    Behind { missing: usize, expected: usize },
}

/// Applies every pending migration (safe to run concurrently: sqlx takes an advisory lock).
pub async fn migrate(pool: &PgPool) -> Result<(), SchemaError> {
    MIGRATOR.run(pool).await?;
    Ok(())
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
