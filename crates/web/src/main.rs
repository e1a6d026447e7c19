//! The `web` binary: parses the command line and hands over to [`web::cli::main`]. A failure is
//! one line on stderr and exit code 1.

use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    match web::cli::main(web::cli::Cli::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            #[allow(clippy::print_stderr)]
            {
                eprintln!("web: {}", common::report::one_line(e.as_ref()));
            }
            ExitCode::FAILURE
        }
    }
}
