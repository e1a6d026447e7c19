//! Entry point of `specgen-worker`: parse the command line, load the layered configuration
//! (defaults < `--config` file < environment) and check it, then start telemetry and run until
//! SIGTERM/SIGINT. A failed start is one line on stderr and exit code 1.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser;

#[derive(Parser)]
#[command(name = "specgen-worker", version, about = "Fairlane specgen-worker")]
struct Cli {
    /// A TOML file with settings (environment variables override it).
    #[arg(long, env = "FAIRLANE_CONFIG")]
    config: Option<PathBuf>,
}

fn main() -> ExitCode {
    match common::report::parse_command_line::<Cli>("specgen-worker") {
        Ok(cli) => common::report::exit_code("specgen-worker", run(&cli)),
        Err(exit) => exit,
    }
}

fn run(cli: &Cli) -> anyhow::Result<()> {
    let config: specgen_worker::Config =
        common::config::load(cli.config.as_deref()).context("loading configuration")?;
    // Before the pool, telemetry or anything else: bad settings change nothing.
    config.validate()?;
    telemetry::runtime::block_on(workerkit::serve(&config.worker, |pool, shutdown| {
        specgen_worker::run(&config, pool, shutdown)
    }))
    .context("starting the async runtime")?
    .context("specgen-worker failed")
}
