//! The `web` binary: parses the command line and hands over to [`web::cli::main`]. A failure is
//! one line on stderr and exit code 1 (a command line clap refuses too).

use std::process::ExitCode;

fn main() -> ExitCode {
    match common::report::parse_command_line::<web::cli::Cli>("web") {
        // Ends its runtime within `telemetry::runtime::LEFTOVER_BLOCKING_WAIT` of its work: a DNS
        // look-up a request gave up on runs on a blocking thread until the resolver answers.
        Ok(cli) => common::report::exit_code(
            "web",
            telemetry::runtime::block_on(web::cli::main(cli))
                .map_err(anyhow::Error::from)
                .and_then(|done| done),
        ),
        Err(exit) => exit,
    }
}
