//! The `web` binary: parses the command line and hands over to [`web::cli::main`]. A failure is
//! one line on stderr and exit code 1 (a command line clap refuses too).

use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    match common::report::parse_command_line::<web::cli::Cli>("web") {
        Ok(cli) => common::report::exit_code("web", web::cli::main(cli).await),
        Err(exit) => exit,
    }
}
