//! `cargo xtask test`: format check, clippy, then every test of the workspace against real
//! PostgreSQL and Redis (cargo-nextest, installed when missing).

use std::process::Command;

use anyhow::{Context, bail};

use crate::services::{self, Durability};
use crate::{say, tools, workspace_root};

pub(crate) fn run(lint: bool, extra: &[String]) -> anyhow::Result<()> {
    let root = workspace_root();
    if lint {
        say("cargo fmt --check");
        cargo(&root, &["fmt", "--all", "--", "--check"], &[])?;
        say("cargo clippy");
        cargo(
            &root,
            &[
                "clippy",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ],
            &[],
        )?;
    }
    say("checking the external tools of the deployment checks");
    let tools = tools::ensure();
    for failure in &tools.failures {
        // The checks that need it fail, saying so; every other test still runs.
        say(format!("{failure} (the checks that need it will fail)"));
    }
    // The deployment checks start the service binaries; build them now, so the tests' own
    // `cargo build` of them finds nothing to do (and no test waits minutes on a compile).
    let mut build = vec!["build", "--quiet", "--bins"];
    for package in deploy_checks::SERVICE_PACKAGES {
        build.extend(["--package", package]);
    }
    cargo(&root, &build, &[])?;
    let database_url = services::postgres(Durability::Tests)?;
    let redis_url = services::redis()?;
    services::drop_old_test_databases(&database_url);
    say(format!("DATABASE_URL={database_url} REDIS_URL={redis_url}"));
    let mut env = vec![
        ("DATABASE_URL", database_url.as_str()),
        ("REDIS_URL", redis_url.as_str()),
    ];
    env.extend(tools.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    ensure_nextest(&root)?;
    let mut args: Vec<&str> = vec!["nextest", "run", "--workspace", "--no-fail-fast"];
    args.extend(extra.iter().map(String::as_str));
    cargo(&root, &args, &env)?;
    if extra.is_empty() {
        // nextest does not run doctests; a filtered run is about specific tests, so skip them.
        cargo(&root, &["test", "--workspace", "--doc"], &env)?;
    }
    say("all checks passed");
    Ok(())
}

/// Installs cargo-nextest from crates.io when `cargo nextest` is missing. The suite needs it:
/// it runs each test in a process of its own (the signal tests signal their own process), and
/// `.config/nextest.toml` sets the timeouts and the groups of tests that must not overlap.
/// `cargo test` would run them as threads of one process, with no timeout.
fn ensure_nextest(root: &std::path::Path) -> anyhow::Result<()> {
    let installed = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["nextest", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if installed {
        return Ok(());
    }
    say("cargo-nextest not found; installing it from crates.io (a few minutes, once)");
    cargo(root, &["install", "cargo-nextest", "--locked"], &[]).context(
        "installing cargo-nextest (or install it yourself: cargo install cargo-nextest --locked)",
    )
}

pub(crate) fn cargo(
    root: &std::path::Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> anyhow::Result<()> {
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(args)
        .current_dir(root)
        .envs(env.iter().copied())
        .status()
        .with_context(|| format!("running cargo {}", args.join(" ")))?;
    if !status.success() {
        bail!("cargo {} failed ({status})", args.join(" "));
    }
    Ok(())
}
