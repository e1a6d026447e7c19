//! Entry point of `specgen-worker`: parse the command line, load the layered configuration
//! (defaults < `--config` file < environment), start telemetry, run until SIGTERM/SIGINT.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;

#[derive(Parser)]
#[command(name = "specgen-worker", version, about = "Fairlane specgen-worker")]
struct Cli {
    /// A TOML file with settings (environment variables override it).
    #[arg(long, env = "FAIRLANE_CONFIG")]
    config: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let config: specgen_worker::Config =
        common::config::load(cli.config.as_deref()).context("loading configuration")?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime
        .block_on(workerkit::serve(&config.worker, |pool, shutdown| {
            specgen_worker::run(&config, pool, shutdown)
        }))
        .context("specgen-worker failed")
}
