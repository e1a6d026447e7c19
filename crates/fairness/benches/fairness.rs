//! `cargo xtask bench fairness`: 1,000 users of mixed tiers × 20 no-op jobs, worked with fairness
//! off and then on (fresh database each, same jobs): jobs/s, snoozes per completed job, and the
//! time from a user's slot freeing to that user's next job starting.
//!
//! A phase lasts well under a second, so one pair of phases says little about the code: the pair
//! runs `BENCH_ROUNDS` times (3 by default), each round's on ÷ off is printed, and the summary
//! gives their median. A phase ends with its last completion's transaction (`max(finalized_at)`),
//! not when the polling loop that waits for it notices.
//!
//! `BENCH_IDLE_USERS=N` adds N free users with no jobs to `users` (a SaaS's registered users
//! beside the 1,000 active ones), so the gate's tier look-ups run against a table of that size.

#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::print_stderr)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Service, Tier, select_queue};
use fairness::{FairnessConfig, FairnessGate, FairnessHook, FairnessMiddleware, TierCache};
use queue::{Client, Engine, EngineConfig, JobError, NewJob, Workers};
use rand::Rng;
use serde::{Deserialize, Serialize};
use testkit::TestDb;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

#[derive(Serialize, Deserialize)]
struct Noop {
    user_id: Uuid,
}
impl queue::JobArgs for Noop {
    const KIND: &'static str = "noop";
}

const USERS: usize = 1000;
const JOBS_PER_USER: usize = 20;

struct Outcome {
    jobs_per_sec: f64,
    /// CPU µs per job: this process, PostgreSQL.
    cpu_us: (f64, f64),
    snoozes: i64,
    slot_latency_ms: Option<(f64, f64)>,
}

#[tokio::main]
async fn main() {
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let workers = testkit::bench::env_usize("BENCH_WORKERS", 300);
    // Tier mix of a typical paid-tier SaaS: most users free.
    let mut rng = rand::rng();
    let tiers: Vec<Tier> = (0..USERS)
        .map(|_| match rng.random_range(0..100) {
            0..50 => Tier::Free,
            50..75 => Tier::Pro,
            75..88 => Tier::ProPlus,
            _ => Tier::Enterprise,
        })
        .collect();
    // Jobs interleaved in a random order, as requests from many users arrive.
    let mut order: Vec<usize> = (0..USERS * JOBS_PER_USER).map(|i| i % USERS).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.random_range(0..=i));
    }
    let rounds = testkit::bench::env_usize("BENCH_ROUNDS", 3).max(1);
    let idle_users = testkit::bench::env_usize("BENCH_IDLE_USERS", 0);
    let mut results = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let off = run(&tiers, &order, workers, idle_users, false).await;
        let on = run(&tiers, &order, workers, idle_users, true).await;
        results.push((off, on));
    }
    let total = (USERS * JOBS_PER_USER) as f64;
    let plural = if rounds == 1 { "" } else { "s" };
    println!("## cargo xtask bench fairness\n");
    println!(
        "{USERS} users (free/pro/pro_plus/enterprise: {}/{}/{}/{}) × {JOBS_PER_USER} no-op jobs, routed by tier; \
         {workers} workers per lane in one process; {idle_users} idle users; {rounds} round{plural} of fairness off, then on\n",
        tiers.iter().filter(|t| **t == Tier::Free).count(),
        tiers.iter().filter(|t| **t == Tier::Pro).count(),
        tiers.iter().filter(|t| **t == Tier::ProPlus).count(),
        tiers.iter().filter(|t| **t == Tier::Enterprise).count(),
    );
    println!(
        "| round | jobs/s, fairness off | jobs/s, fairness on | on ÷ off | CPU per job off: this process / PostgreSQL | CPU per job on | snoozes per completed job: off / on | slot freed → user's next job started, p50 / p95 |"
    );
    println!("|---:|---:|---:|---:|---|---|---|---|");
    let mut ratios = Vec::with_capacity(rounds);
    for (round, (off, on)) in (1..).zip(&results) {
        let ratio = on.jobs_per_sec / off.jobs_per_sec;
        ratios.push(ratio);
        let slot = on.slot_latency_ms.map_or_else(
            || "–".to_owned(),
            |(p50, p95)| format!("{p50:.1} ms / {p95:.1} ms"),
        );
        println!(
            "| {round} | {:.0} | {:.0} | {:.0} % | {:.1} µs / {:.1} µs | {:.1} µs / {:.1} µs | {:.3} / {:.3} | {slot} |",
            off.jobs_per_sec,
            on.jobs_per_sec,
            100.0 * ratio,
            off.cpu_us.0,
            off.cpu_us.1,
            on.cpu_us.0,
            on.cpu_us.1,
            off.snoozes as f64 / total,
            on.snoozes as f64 / total,
        );
    }
    let listed: Vec<String> = ratios
        .iter()
        .map(|r| format!("{:.0} %", 100.0 * r))
        .collect();
    if let Some(median) = testkit::bench::median(&mut ratios) {
        println!();
        println!("| summary | value |\n|---|---|");
        println!(
            "| fairness on ÷ off, median of {rounds} round{plural} | {:.0} % (each: {}; target ≥ 70 %) |",
            100.0 * median,
            listed.join(", ")
        );
    }
    println!();
}

async fn run(
    tiers: &[Tier],
    order: &[usize],
    workers: usize,
    idle_users: usize,
    fair: bool,
) -> Outcome {
    let db = TestDb::new().await;
    let pool = db.pool_with(16).await;
    let mut users = Vec::with_capacity(tiers.len());
    for tier in tiers {
        let id: Uuid = sqlx::query_scalar(
            "INSERT INTO users (name, tier) VALUES ('bench', $1::fairlane_tier) RETURNING id",
        )
        .bind(tier.as_str())
        .fetch_one(&pool)
        .await
        .unwrap();
        users.push(id);
    }
    if idle_users > 0 {
        sqlx::query(
            "INSERT INTO users (name, tier) SELECT 'idle', 'free' FROM generate_series(1, $1)",
        )
        .bind(i64::try_from(idle_users).unwrap_or(i64::MAX))
        .execute(&pool)
        .await
        .unwrap();
    }
    let jobs: Vec<NewJob> = order
        .iter()
        .map(|&u| {
            NewJob::new(
                select_queue(Service::Analysis, tiers[u], false),
                &Noop { user_id: users[u] },
            )
            .unwrap()
        })
        .collect();
    let client = Client::new(pool.clone());
    client.insert_bulk(&jobs).await.unwrap();
    sqlx::query("VACUUM ANALYZE fairlane_job, users")
        .execute(&pool)
        .await
        .unwrap();

    // (user, start, end) of every run, to measure slot reuse.
    let runs: Arc<Mutex<Vec<(Uuid, Instant, Instant)>>> = Arc::new(Mutex::new(Vec::new()));
    let mut registry = Workers::new();
    {
        let runs = runs.clone();
        registry.register_fn::<Noop, _, _>(move |_ctx, args| {
            let runs = runs.clone();
            async move {
                let now = Instant::now();
                runs.lock().unwrap().push((args.user_id, now, now));
                Ok::<(), JobError>(())
            }
        });
    }
    let queues = Service::Analysis.queues();
    let config = FairnessConfig {
        fairness_enabled: fair,
        ..FairnessConfig::default()
    };
    let tier_cache = Arc::new(TierCache::new(config.fairness_tier_cache_ttl));
    let engine_client =
        Client::new(db.pool_with(16).await).with_hooks(vec![Arc::new(FairnessHook::new(&queues))]);
    let mut builder = Engine::builder(engine_client)
        .name("bench")
        .config(EngineConfig {
            completer_batch: 2000,
            ..EngineConfig::default()
        })
        .workers(registry)
        .middleware(Arc::new(FairnessMiddleware::new(
            pool.clone(),
            "analysis",
            &queues,
            config.clone(),
            tier_cache.clone(),
        )))
        .fetch_gate(Arc::new(FairnessGate::new(
            "analysis",
            &queues,
            config.clone(),
        )));
    for q in queues {
        builder = builder.queue(q, workers);
    }
    let engine = builder.build().unwrap();
    let shutdown = CancellationToken::new();
    let cpu_before = testkit::bench::CpuSnapshot::take();
    let started: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&pool)
        .await
        .unwrap();
    let handle = tokio::spawn(engine.run(shutdown.clone()));
    loop {
        let left: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM fairlane_job WHERE state = 'available' AND queue LIKE 'analysis%') \
                 OR EXISTS (SELECT 1 FROM fairlane_job WHERE state = 'running' AND cardinality(attempted_by) > 0) \
                 OR EXISTS (SELECT 1 FROM fairlane_job WHERE state IN ('scheduled', 'retryable'))",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        if !left {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // When the last completion's transaction ran, on PostgreSQL's clock like `started`: the
    // polling above notices it up to 50 ms late, a tenth of a phase.
    let elapsed: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM max(finalized_at) - $1)::float8 FROM fairlane_job",
    )
    .bind(started)
    .fetch_one(&pool)
    .await
    .unwrap();
    let cpu_after = testkit::bench::CpuSnapshot::take();
    shutdown.cancel();
    handle.await.unwrap().unwrap();
    let snoozes: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum((metadata->>'snoozes')::int8), 0)::int8 FROM fairlane_job",
    )
    .fetch_one(&pool)
    .await
    .unwrap();

    let slot_latency_ms = fair.then(|| {
        let limits: HashMap<Uuid, usize> = users
            .iter()
            .zip(tiers)
            .map(|(u, t)| (*u, config.limit(*t) as usize))
            .collect();
        let mut by_user: HashMap<Uuid, Vec<(Instant, Instant)>> = HashMap::new();
        for (user, start, end) in runs.lock().unwrap().iter() {
            by_user.entry(*user).or_default().push((*start, *end));
        }
        let mut latencies = Vec::new();
        for (user, mut user_runs) in by_user {
            let limit = limits[&user];
            user_runs.sort_by_key(|r| r.0);
            let mut ends: Vec<Instant> = user_runs.iter().map(|r| r.1).collect();
            ends.sort();
            // Run i needed i - limit + 1 earlier runs to have finished: the last of those freed
            // its slot.
            for (i, (start, _)) in user_runs.iter().enumerate().skip(limit) {
                let freed = ends[i - limit];
                latencies.push(start.saturating_duration_since(freed).as_secs_f64() * 1000.0);
            }
        }
        latencies.sort_by(f64::total_cmp);
        let pct =
            |p: f64| latencies[((latencies.len() as f64 * p) as usize).min(latencies.len() - 1)];
        (pct(0.5), pct(0.95))
    });
    let per_job = 1e6 / (USERS * JOBS_PER_USER) as f64;
    Outcome {
        cpu_us: (
            cpu_after.own_seconds_since(&cpu_before) * per_job,
            cpu_after.postgres_seconds_since(&cpu_before) * per_job,
        ),
        jobs_per_sec: (USERS * JOBS_PER_USER) as f64 / elapsed,
        snoozes,
        slot_latency_ms,
    }
}
