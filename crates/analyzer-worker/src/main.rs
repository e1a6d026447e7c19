//! Entry point of `analyzer-worker`: parse the command line, load the layered configuration
//! (defaults < `--config` file < environment), start telemetry, run until SIGTERM/SIGINT.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;

#[derive(Parser)]
#[command(name = "analyzer-worker", version, about = "Fairlane analyzer-worker")]
struct Cli {
    /// A TOML file with settings (environment variables override it).
    #[arg(long, env = "FAIRLANE_CONFIG")]
    config: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let config: analyzer_worker::Config =
        common::config::load(cli.config.as_deref()).context("loading configuration")?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime
        .block_on(workerkit::serve(&config.worker, |pool, shutdown| {
            analyzer_worker::run(&config, pool, shutdown)
        }))
        .context("analyzer-worker failed")
}
