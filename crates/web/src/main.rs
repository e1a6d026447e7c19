//! The `web` binary: parses the command line and hands over to [`web::cli::main`]. A failure is
//! one line on stderr and exit code 1 (a command line clap refuses too).

use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = match common::report::parse_command_line::<web::cli::Cli>("web") {
        Ok(cli) => cli,
        Err(exit) => return exit,
    };
    match web::cli::main(cli).await {
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
