//! `cargo xtask bench <suite>`: runs a benchmark target (each prints its own markdown report)
//! against real servers started or found like the tests', but with durable settings.

use crate::services::{self, Durability};
use crate::test::cargo;
use crate::workspace_root;

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum Suite {
    /// Bulk insert, burn-down, sustained latency, table health.
    Queue,
    /// 1,000 users × 20 jobs with fairness on vs off: throughput, snoozes, slot reuse latency.
    Fairness,
    /// Decisions/s and p99 of the in-memory and Redis limiters.
    Ratelimit,
    /// The quota check's read of 16 users' standings as their billed usage grows.
    Quota,
    /// Authenticated POST /v1/analyses vs pgbench; the Redis limiter's cost on a trivial GET.
    Web,
}

impl Suite {
    fn target(self) -> (&'static str, &'static str) {
        match self {
            Suite::Queue => ("queue", "queue"),
            Suite::Fairness => ("fairness", "fairness"),
            Suite::Ratelimit => ("ratelimit", "ratelimit"),
            Suite::Quota => ("quota", "quota"),
            Suite::Web => ("web", "web"),
        }
    }
}

pub(crate) fn run(suite: Suite) -> anyhow::Result<()> {
    let database_url = services::postgres(Durability::Default)?;
    let redis_url = services::redis()?;
    // Each bench leaves the databases it filled, as tests do (a web run leaves about 250 MB);
    // a run starts by dropping them, so they do not pile up on the disk.
    services::drop_old_test_databases(&database_url);
    let (package, bench) = suite.target();
    cargo(
        &workspace_root(),
        &["bench", "--package", package, "--bench", bench],
        &[
            ("DATABASE_URL", database_url.as_str()),
            ("REDIS_URL", redis_url.as_str()),
        ],
    )
}
