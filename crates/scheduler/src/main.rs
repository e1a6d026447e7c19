//! Entry point of `scheduler`: parse the command line, load the layered configuration
//! (defaults < `--config` file < environment) and check it, then start telemetry and run until
//! SIGTERM/SIGINT. A failed start is one line on stderr and exit code 1.

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser;

#[derive(Parser)]
#[command(name = "scheduler", version, about = "Fairlane scheduler")]
struct Cli {
    #[command(flatten)]
    config: common::config::ConfigFileArg,
}

fn main() -> ExitCode {
    match common::report::parse_command_line::<Cli>("scheduler") {
        Ok(cli) => common::report::exit_code("scheduler", run(&cli)),
        Err(exit) => exit,
    }
}

fn run(cli: &Cli) -> anyhow::Result<()> {
    let config: scheduler::Config =
        common::config::load(cli.config.path()).context("loading configuration")?;
    // Before the pool, telemetry or anything else: bad settings change nothing.
    config.check()?;
    telemetry::runtime::block_on(async {
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
    .context("starting the async runtime")?
}
