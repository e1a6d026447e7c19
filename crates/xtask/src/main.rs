//! `cargo xtask`: the developer's entry point. `test` runs every check and test against real
//! PostgreSQL and Redis (starting private servers when none is reachable), `bench` runs the
//! benchmarks, `dev` runs the whole system locally, `dashboards` regenerates the per-queue Grafana
//! dashboards from their template.

mod bench;
mod dev;
mod services;
mod test;
mod tools;

use clap::Subcommand;

#[derive(clap::Parser)]
#[command(name = "cargo xtask", about = "Fairlane developer tasks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Format check, clippy, then every test against real PostgreSQL and Redis.
    Test {
        /// Skip `cargo fmt --check` and clippy.
        #[arg(long)]
        no_lint: bool,
        /// Extra arguments for cargo-nextest (or cargo test), e.g. a test filter.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Run a benchmark and print its report.
    Bench {
        #[arg(value_enum)]
        suite: bench::Suite,
    },
    /// Regenerate deploy/grafana/dashboards/queue-*.json from deploy/grafana/templates/queue.json.
    Dashboards,
    /// Install the external tools the checks use (prometheus, kubernetes-validate, schemathesis,
    /// the KEDA schema models); quick when they are present.
    Tools,
    /// Run the whole system on this machine until Ctrl-C.
    Dev {
        /// Port of the HTTP API (not 0, and not 9091–9093, the other services' ports).
        #[arg(long, default_value_t = 8080)]
        port: u16,
    },
}

fn main() -> std::process::ExitCode {
    // A command line clap refuses is one line and exit code 1, as for the services.
    let cli = match common::report::parse_command_line::<Cli>("xtask") {
        Ok(cli) => cli,
        Err(exit) => return exit,
    };
    let result = match cli.command {
        Command::Test { no_lint, args } => test::run(!no_lint, &args),
        Command::Bench { suite } => bench::run(suite),
        Command::Dev { port } => dev::run(port),
        Command::Dashboards => dashboards(),
        Command::Tools => tools::ensure().into_result(),
    };
    if let Err(e) = result {
        say(format!("{e:#}"));
        return std::process::ExitCode::FAILURE;
    }
    std::process::ExitCode::SUCCESS
}

fn dashboards() -> anyhow::Result<()> {
    for path in deploy_checks::dashboards::write(&workspace_root())? {
        say(format!("wrote {}", path.display()));
    }
    Ok(())
}

/// The workspace root (xtask lives in `crates/xtask`).
fn workspace_root() -> std::path::PathBuf {
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .ancestors()
        .nth(2)
        .map(std::path::Path::to_path_buf)
        .unwrap_or_else(|| manifest.to_path_buf())
}

/// Prints a progress line to stderr. A stderr that is gone (a `| tee` killed by the same Ctrl-C,
/// a closed terminal) is ignored: `eprintln!` would panic there, and a panic in a shutdown path
/// (or a second one while unwinding through `Drop`) would leave the services and a private
/// PostgreSQL running.
fn say(message: impl std::fmt::Display) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "xtask: {message}");
}
