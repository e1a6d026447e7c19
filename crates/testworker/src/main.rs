//! A worker process for tests that need real processes: it works the queues named in
//! `TESTWORKER_QUEUES` (`name:workers,…`) with the engine settings in `TESTWORKER_ENGINE` (JSON,
//! missing fields default), runs `record` jobs that log every run into the test's `test_runs`
//! table, and shuts down gracefully on SIGTERM or SIGINT (exit 0).

use std::time::Duration;

use anyhow::Context as _;
use queue::{Client, Engine, EngineConfig, JobError, QueueName, Workers};
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;

/// A job that records its run: a row at start, `finished_at` at the end.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    #[serde(default)]
    sleep_ms: u64,
    /// Stop early (as a failure) when told to stop.
    #[serde(default)]
    cancellable: bool,
}

impl queue::JobArgs for Record {
    const KIND: &'static str = "record";
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let url = std::env::var("DATABASE_URL").context("DATABASE_URL is required")?;
    let queues = std::env::var("TESTWORKER_QUEUES").unwrap_or_else(|_| "default:4".into());
    let config: EngineConfig = match std::env::var("TESTWORKER_ENGINE") {
        Ok(json) => serde_json::from_str(&json).context("TESTWORKER_ENGINE is not valid")?,
        Err(_) => EngineConfig::default(),
    };
    let name = std::env::var("TESTWORKER_NAME").unwrap_or_else(|_| "testworker".into());

    let pool = PgPoolOptions::new()
        .max_connections(10)
        .connect(&url)
        .await
        .context("connecting to PostgreSQL")?;
    let log_pool = pool.clone();
    let mut workers = Workers::new();
    workers.register_fn::<Record, _, _>(move |ctx, args| {
        let pool = log_pool.clone();
        async move {
            let (run_id,): (i64,) = sqlx::query_as(
                "INSERT INTO test_runs (job_id, attempt, worker) VALUES ($1, $2, $3) RETURNING id",
            )
            .bind(ctx.id())
            .bind(i32::from(ctx.job().attempt))
            .bind(ctx.worker_id())
            .fetch_one(&pool)
            .await?;
            let sleep = tokio::time::sleep(Duration::from_millis(args.sleep_ms));
            if args.cancellable {
                tokio::select! {
                    () = sleep => {}
                    () = ctx.cancelled() => return Err(JobError::msg("stopped")),
                }
            } else {
                sleep.await;
            }
            sqlx::query("UPDATE test_runs SET finished_at = clock_timestamp() WHERE id = $1")
                .bind(run_id)
                .execute(&pool)
                .await?;
            Ok(())
        }
    });

    let mut builder = Engine::builder(Client::new(pool))
        .name(name)
        .config(config)
        .workers(workers);
    for spec in queues.split(',').filter(|s| !s.is_empty()) {
        let (q, n) = spec
            .split_once(':')
            .with_context(|| format!("queue spec `{spec}` is not name:workers"))?;
        builder = builder.queue(QueueName::new(q)?, n.parse()?);
    }
    let engine = builder.build()?;
    // Listening before `ready`: a test may send SIGTERM as soon as it reads that line.
    let shutdown = cancel_on_signals().context("installing the SIGTERM/SIGINT handlers")?;
    println_ready(engine.worker_id());
    engine.run(shutdown).await?;
    Ok(())
}

/// Tests read the worker id from this line on stdout.
#[allow(clippy::print_stdout)]
fn println_ready(worker_id: &str) {
    println!("ready {worker_id}");
}

/// A token cancelled on the first SIGTERM or SIGINT; both are handled from the moment this
/// returns (the streams are created here, not in the task that waits on them).
fn cancel_on_signals() -> std::io::Result<CancellationToken> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let shutdown = CancellationToken::new();
    let cancel = shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        cancel.cancel();
    });
    Ok(shutdown)
}
