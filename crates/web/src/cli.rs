//! The `web` command line: `serve` (default), `migrate`, and `admin …` for users, tiers and keys.

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use sqlx::Connection as _;
use uuid::Uuid;

use crate::admin;
use crate::config::WebConfig;

/// Fairlane's HTTP API.
#[derive(Debug, Parser)]
#[command(name = "web", version, about = "Fairlane's public and admin HTTP API")]
pub struct Cli {
    /// A TOML file with settings (flat keys named after the environment variables, lower case);
    /// the environment overrides it.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the API (the default).
    Serve,
    /// Apply pending database migrations and exit.
    Migrate,
    /// Manage users, tiers and API keys.
    #[command(subcommand)]
    Admin(AdminCommand),
}

#[derive(Debug, Subcommand)]
pub enum AdminCommand {
    /// Create a user; prints it as JSON.
    CreateUser {
        #[arg(long)]
        name: String,
        /// free, pro, pro_plus or enterprise.
        #[arg(long)]
        tier: String,
    },
    /// Change a user's tier; prints the user as JSON.
    SetTier {
        #[arg(long)]
        user: Uuid,
        #[arg(long)]
        tier: String,
    },
    /// Issue an API key; prints it (the only time it is shown) as JSON.
    IssueKey {
        #[arg(long)]
        user: Uuid,
    },
    /// Revoke an API key by its public id.
    RevokeKey {
        #[arg(long = "key-id")]
        key_id: String,
    },
}

fn print_json<T: serde::Serialize>(value: &T) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, value)?;
    writeln!(out)?;
    out.flush()?;
    Ok(())
}

/// Prints what a command wrote to the database; when stdout fails (a closed pipe, a full disk)
/// the error says what was changed all the same, so the operator is not left to guess (and
/// retry into duplicates).
fn print_written<T: serde::Serialize>(
    value: &T,
    written: impl FnOnce() -> String,
) -> anyhow::Result<()> {
    print_json(value).with_context(|| format!("{}, but printing it failed", written()))
}

/// Connects once with `pool`'s options ([`schema::connect_within`]), so that a database out of
/// reach is reported with its reason (refused, a wrong password, no such database): the pool
/// itself says only "pool timed out" once its acquire timeout is over.
async fn check_reachable(pool: &sqlx::PgPool) -> anyhow::Result<()> {
    let connection = schema::connect_within(&pool.connect_options())
        .await
        .context("connecting to the database")?;
    // Only the answer mattered; a failed goodbye changes nothing.
    let _ = connection.close().await;
    Ok(())
}

/// Runs an admin command against the database (no logging on stdout: it carries the result).
pub async fn run_admin(config: &WebConfig, command: AdminCommand) -> anyhow::Result<()> {
    // A bad argument is told before anything connects (not after a wait for a database out of
    // reach).
    if let AdminCommand::CreateUser { tier, .. } | AdminCommand::SetTier { tier, .. } = &command {
        admin::parse_tier(tier)?;
    }
    let pool = crate::pool(config)?;
    let result = async {
        check_reachable(&pool).await?;
        match command {
            AdminCommand::CreateUser { name, tier } => {
                let tier = admin::parse_tier(&tier)?;
                let user = admin::create_user(&pool, &name, tier).await?;
                print_written(&user, || format!("user {} was created", user.id))
            }
            AdminCommand::SetTier { user, tier } => {
                let tier = admin::parse_tier(&tier)?;
                let user = admin::set_tier(&pool, user, tier).await?;
                print_written(&user, || {
                    format!("user {}'s tier was set to {}", user.id, user.tier)
                })
            }
            AdminCommand::IssueKey { user } => {
                let key = admin::issue_key(&pool, user).await?;
                let Err(e) = print_json(&key) else {
                    return Ok(());
                };
                // The secret is shown only here: a key nobody saw is revoked, not left working.
                let what = match admin::revoke_key(&pool, &key.key_id).await {
                    Ok(_) => format!(
                        "key {} was issued, but printing it failed, so it was revoked (its \
                         secret may have been printed in part)",
                        key.key_id
                    ),
                    Err(revoke) => format!(
                        "key {} was issued, but printing it failed, and revoking it failed too \
                         ({revoke}); revoke it with `web admin revoke-key --key-id {}`",
                        key.key_id, key.key_id
                    ),
                };
                Err(e.context(what))
            }
            AdminCommand::RevokeKey { key_id } => {
                let revoked = admin::revoke_key(&pool, &key_id).await?;
                print_written(&revoked, || format!("key {} was revoked", revoked.key_id))
            }
        }
    }
    .await;
    pool.close().await;
    result
}

/// Applies the migrations.
pub async fn run_migrate(config: &WebConfig) -> anyhow::Result<()> {
    config
        .check_migration()
        .map_err(anyhow::Error::msg)
        .context("invalid configuration")?;
    let options = crate::migration_options(config)?;
    schema::migrate_patiently(&options, config.migration_patience())
        .await
        .context("migrating")?;
    tracing::info!("migrations applied");
    Ok(())
}

/// The whole program.
pub async fn main(cli: Cli) -> anyhow::Result<()> {
    let config = WebConfig::load(cli.config.as_deref()).context("loading configuration")?;
    match cli.command.unwrap_or(Command::Serve) {
        Command::Admin(command) => run_admin(&config, command).await,
        Command::Migrate => {
            let guard = telemetry::init(&config.telemetry)?;
            let result = run_migrate(&config).await;
            drop_guard(guard).await;
            result
        }
        Command::Serve => {
            // Before telemetry, the pool or anything else: bad settings change nothing.
            config
                .validate()
                .map_err(anyhow::Error::msg)
                .context("invalid configuration")?;
            let guard = telemetry::init(&config.telemetry)?;
            let shutdown = telemetry::shutdown_on_signals()
                .context("installing the SIGTERM/SIGINT handlers")?;
            let result = crate::run(config, shutdown).await;
            if let Err(e) = &result {
                tracing::error!(error = format!("{e:#}"), "web failed");
            }
            drop_guard(guard).await;
            result
        }
    }
}

async fn drop_guard(guard: telemetry::TelemetryGuard) {
    // Flushing exporters blocks (boundedly); keep it off the async workers.
    let _ = tokio::task::spawn_blocking(move || drop(guard)).await;
}
