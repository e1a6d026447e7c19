//! `cargo xtask bench queue`: bulk insert, burn-down, sustained insert-to-start latency, table
//! health after churn, and the machine's pgbench single-row insert rate as the ceiling reference.
//! Prints a markdown report; every number comes from this run.
//!
//! `BENCH_TELEMETRY=1` runs it with Fairlane's telemetry installed as in the services
//! (`telemetry::init`: the metrics SDK with the Prometheus reader, the tracing-opentelemetry
//! layer with spans at `info`, and OTLP export when `OTEL_EXPORTER_OTLP_ENDPOINT` is set), to
//! measure what observability costs (docs/operations.md).

#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::print_stderr)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use queue::{Client, Engine, EngineConfig, JobArgs, NewJob, QueueName, Workers};
use serde::{Deserialize, Serialize};
use testkit::TestDb;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

#[derive(Serialize, Deserialize)]
struct Noop {
    n: u64,
}
impl JobArgs for Noop {
    const KIND: &'static str = "noop";
}

#[tokio::main]
async fn main() {
    let telemetry_guard = if std::env::var("BENCH_TELEMETRY").is_ok_and(|v| v == "1") {
        let config = telemetry::TelemetryConfig {
            otel_exporter_otlp_endpoint: std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok(),
            // Telemetry logs to stdout, where this report goes: keep log lines to warnings, but
            // create the queue's `info` spans as in production.
            rust_log: "warn,queue=info".to_owned(),
            ..telemetry::TelemetryConfig::for_service("fairlane-queue-bench", "bench")
        };
        Some(telemetry::init(&config).expect("telemetry init"))
    } else {
        None
    };
    if telemetry_guard.is_none() && std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let jobs = testkit::bench::env_usize("BENCH_JOBS", 100_000);
    // No-op jobs finish in microseconds: it takes many slots to keep the database busy.
    let workers = testkit::bench::env_usize("BENCH_WORKERS", 2000);
    let sustained_secs = testkit::bench::env_usize("BENCH_SUSTAINED_SECS", 20);
    println!(
        "## cargo xtask bench queue (telemetry {})\n",
        if telemetry_guard.is_some() {
            "on"
        } else {
            "off"
        }
    );
    println!(
        "machine: {} cores, PostgreSQL on the same machine; jobs={jobs}, workers={workers}\n",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    println!("| measurement | result |\n|---|---|");

    let pgbench = match testkit::bench::PgbenchTarget::new()
        .await
        .run(10)
        .await
        .rate
    {
        Ok(tps) => format!("{tps:.0} rows/s"),
        Err(e) => e,
    };
    println!("| pgbench single-row INSERT (8 clients, 10 s) | {pgbench} |");

    // Bulk insert (COPY) and batched INSERT … unnest.
    let db = TestDb::new().await;
    let pool = db.pool_with(16).await;
    let client = Client::new(pool.clone());
    let q = QueueName::new("bench").unwrap();
    let batch: Vec<NewJob> = (0..jobs as u64)
        .map(|n| NewJob::new(q.clone(), &Noop { n }).unwrap())
        .collect();
    let started = Instant::now();
    client.insert_bulk(&batch).await.unwrap();
    let copy_secs = started.elapsed().as_secs_f64();
    println!(
        "| bulk insert {jobs} jobs (binary COPY) | {:.0} jobs/s ({copy_secs:.2} s) |",
        jobs as f64 / copy_secs
    );

    let unnest_db = TestDb::new().await;
    let unnest_client = Client::new(unnest_db.pool.clone());
    let started = Instant::now();
    for chunk in batch.chunks(5_000) {
        unnest_client.insert_many(chunk.to_vec()).await.unwrap();
    }
    let unnest_secs = started.elapsed().as_secs_f64();
    println!(
        "| insert {jobs} jobs (INSERT … unnest, 5,000 per statement) | {:.0} jobs/s |",
        jobs as f64 / unnest_secs
    );
    drop(unnest_client);

    // Burn-down of the COPY-loaded jobs.
    vacuum_analyze(&pool).await;
    let config = EngineConfig {
        fetch_limit: 1000,
        completer_batch: 2000,
        ..EngineConfig::default()
    };
    let mut registry = Workers::new();
    registry.register_fn::<Noop, _, _>(|_, _| async { Ok(()) });
    let engine = Engine::builder(Client::new(db.pool_with(10).await))
        .name("bench")
        .config(config.clone())
        .queue(q.clone(), workers)
        .workers(registry)
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    let scans_before = seq_scans(&pool).await;
    let cpu_before = testkit::bench::CpuSnapshot::take();
    let started = Instant::now();
    let handle = tokio::spawn(engine.run(shutdown.clone()));
    loop {
        // EXISTS probes stop at the first index entry, so watching does not load the server.
        let left: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM fairlane_job WHERE state = 'available' AND queue = 'bench') \
                 OR EXISTS (SELECT 1 FROM fairlane_job \
                            WHERE state = 'running' AND cardinality(attempted_by) > 0)",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        if !left {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let burn_secs = started.elapsed().as_secs_f64();
    let cpu_after = testkit::bench::CpuSnapshot::take();
    shutdown.cancel();
    let scans_after = seq_scans(&pool).await;
    handle.await.unwrap().unwrap();
    println!(
        "| burn-down {jobs} no-op jobs ({workers} workers, 1 process) | {:.0} jobs/s ({burn_secs:.2} s) |",
        jobs as f64 / burn_secs
    );
    println!(
        "| burn-down CPU: this process / PostgreSQL server processes | {:.2} s / {:.2} s (wall {burn_secs:.2} s) |",
        cpu_after.own_seconds_since(&cpu_before),
        cpu_after.postgres_seconds_since(&cpu_before)
    );
    println!(
        "| burn-down sequential scans of fairlane_job (scans / rows read) | {} / {} |",
        scans_after.0 - scans_before.0,
        scans_after.1 - scans_before.1
    );
    let (dead, live, size) = table_health(&pool).await;
    println!(
        "| after burn-down: dead tuples / live rows / fairlane_job total size | {dead} / {live} / {:.1} MiB |",
        size as f64 / (1024.0 * 1024.0)
    );
    sqlx::query("DELETE FROM fairlane_job")
        .execute(&pool)
        .await
        .unwrap();
    vacuum_analyze(&pool).await;

    // Sustained load: 1,000 inserts/s while workers consume; insert-to-start latency.
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(sustained_secs * 1000)));
    let mut registry = Workers::new();
    {
        let latencies = latencies.clone();
        registry.register_fn::<Noop, _, _>(move |ctx, _| {
            let latencies = latencies.clone();
            async move {
                let waited = chrono::Utc::now() - ctx.job().created_at;
                latencies.lock().await.push(waited.as_seconds_f64());
                Ok(())
            }
        });
    }
    // Producers and consumers are separate services in production: give them separate pools.
    let insert_client = Client::new(db.pool_with(16).await);
    let engine = Engine::builder(Client::new(db.pool_with(10).await))
        .name("bench")
        .config(config)
        .queue(q.clone(), 50)
        .workers(registry)
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    let handle = tokio::spawn(engine.run(shutdown.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let total = sustained_secs * 1000;
    let mut ticker = tokio::time::interval(Duration::from_millis(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let started = Instant::now();
    let mut inserts = tokio::task::JoinSet::new();
    for n in 0..total as u64 {
        ticker.tick().await;
        let client = insert_client.clone();
        let q = q.clone();
        inserts.spawn(async move { client.insert(NewJob::new(q, &Noop { n }).unwrap()).await });
        while inserts.len() > 64 {
            inserts.join_next().await;
        }
    }
    while inserts.join_next().await.is_some() {}
    let insert_secs = started.elapsed().as_secs_f64();
    loop {
        if latencies.lock().await.len() >= total {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    handle.await.unwrap().unwrap();
    let mut l = latencies.lock().await.clone();
    l.sort_by(f64::total_cmp);
    let pct = |p: f64| l[((l.len() as f64 * p) as usize).min(l.len() - 1)] * 1000.0;
    println!(
        "| sustained {:.0} inserts/s for {sustained_secs} s: insert-to-start p50 / p99 / max | {:.1} ms / {:.1} ms / {:.1} ms |",
        total as f64 / insert_secs,
        pct(0.50),
        pct(0.99),
        pct(1.0)
    );
    println!();
}

async fn vacuum_analyze(pool: &sqlx::PgPool) {
    sqlx::query("VACUUM ANALYZE fairlane_job")
        .execute(pool)
        .await
        .unwrap();
}

async fn table_health(pool: &sqlx::PgPool) -> (i64, i64, i64) {
    // Let every backend flush its statistics before reading them.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let _ = sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(pool)
        .await;
    sqlx::query_as(
        "SELECT n_dead_tup, n_live_tup, pg_total_relation_size('fairlane_job') \
         FROM pg_stat_user_tables WHERE relname = 'fairlane_job'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn seq_scans(pool: &sqlx::PgPool) -> (i64, i64) {
    let _ = sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(pool)
        .await;
    sqlx::query_as(
        "SELECT seq_scan, seq_tup_read FROM pg_stat_user_tables WHERE relname = 'fairlane_job'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}
