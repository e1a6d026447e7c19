//! Entry point of `scheduler`: parse the command line, load the layered configuration
//! (defaults < `--config` file < environment), start telemetry, run until SIGTERM/SIGINT.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;

#[derive(Parser)]
#[command(name = "scheduler", version, about = "Fairlane scheduler")]
struct Cli {
    /// A TOML file with settings (environment variables override it).
    #[arg(long, env = "FAIRLANE_CONFIG")]
    config: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let config: scheduler::Config =
        common::config::load(cli.config.as_deref()).context("loading configuration")?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async {
        let telemetry = telemetry::init(&config.telemetry)?;
        let shutdown =
            telemetry::shutdown_on_signals().context("installing the SIGTERM/SIGINT handlers")?;
        let pool = scheduler::lazy_pool(&config)?;
        let result = scheduler::run(&config, pool, shutdown).await;
        if let Err(e) = tokio::task::spawn_blocking(move || telemetry.shutdown()).await? {
            tracing::warn!(error = %e, "telemetry shutdown");
        }
        result.context("scheduler failed")
    })
}
