//! The `web` command line: `serve` (default), `migrate`, and `admin …` for users, tiers and keys.

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
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
    Ok(())
}

/// Runs an admin command against the database (no logging on stdout: it carries the result).
pub async fn run_admin(config: &WebConfig, command: AdminCommand) -> anyhow::Result<()> {
    let pool = crate::pool(config)?;
    let result = async {
        match command {
            AdminCommand::CreateUser { name, tier } => {
                let tier = admin::parse_tier(&tier)?;
                print_json(&admin::create_user(&pool, &name, tier).await?)
            }
            AdminCommand::SetTier { user, tier } => {
                let tier = admin::parse_tier(&tier)?;
                print_json(&admin::set_tier(&pool, user, tier).await?)
            }
            AdminCommand::IssueKey { user } => print_json(&admin::issue_key(&pool, user).await?),
            AdminCommand::RevokeKey { key_id } => {
                print_json(&admin::revoke_key(&pool, &key_id).await?)
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
