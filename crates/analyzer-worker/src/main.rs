//! Entry point of `analyzer-worker`: parse the command line, load the layered configuration
//! (defaults < `--config` file < environment) and check it, then start telemetry and run until
//! SIGTERM/SIGINT. A failed start is one line on stderr and exit code 1.

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser;

#[derive(Parser)]
#[command(name = "analyzer-worker", version, about = "Fairlane analyzer-worker")]
struct Cli {
    #[command(flatten)]
    config: common::config::ConfigFileArg,
}

fn main() -> ExitCode {
    match common::report::parse_command_line::<Cli>("analyzer-worker") {
        Ok(cli) => common::report::exit_code("analyzer-worker", run(&cli)),
        Err(exit) => exit,
    }
}

fn run(cli: &Cli) -> anyhow::Result<()> {
    let config: analyzer_worker::Config =
        common::config::load(cli.config.path()).context("loading configuration")?;
    // Before the pool, telemetry or anything else: bad settings change nothing.
    config.validate()?;
    telemetry::runtime::block_on(workerkit::serve(&config.worker, |pool, shutdown| {
        analyzer_worker::run(&config, pool, shutdown)
    }))
    .context("starting the async runtime")?
    .context("analyzer-worker failed")
}
