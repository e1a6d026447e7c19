//! Rate limiter benchmark: decisions per second and latency percentiles for the in-memory
//! backend (alone and through the `Limiter`, one and several threads) and for Redis with 50
//! concurrent callers. Prints a markdown table.
//!
//! Run: `cargo bench -p ratelimit --bench ratelimit` (Redis from `REDIS_URL`, else
//! 127.0.0.1:6379; the Redis rows are skipped if it is unreachable). `BENCH_DECISIONS`
//! (default 1,000,000) sets the in-memory rows' decisions per thread (the backend alone makes
//! twice as many): a small count under `valgrind --tool=callgrind` gives instructions per
//! decision, which do not drift with the machine.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use ratelimit::{
    Algorithm, Backend, DescriptorKey, Limiter, LimiterConfig, MemoryBackend, MemoryConfig, Policy,
    RateLimitRequest, RedisBackend, RedisConfig, RuleSet, Unit,
};

const RULES: &str = r#"
domain: bench
descriptors:
  - key: tier
    value: pro
    descriptors:
      - key: user_id
        rate_limit: {unit: minute, requests_per_unit: 1000000, algorithm: token_bucket, burst: 1000}
"#;

const USERS: usize = 10_000;

struct Row {
    name: String,
    decisions: usize,
    elapsed: Duration,
    latencies_ns: Vec<u64>,
}

impl Row {
    fn new(name: impl Into<String>, elapsed: Duration, mut latencies_ns: Vec<u64>) -> Row {
        latencies_ns.sort_unstable();
        Row {
            name: name.into(),
            decisions: latencies_ns.len(),
            elapsed,
            latencies_ns,
        }
    }

    fn percentile(&self, p: f64) -> f64 {
        let index = ((self.latencies_ns.len() as f64 - 1.0) * p).round() as usize;
        self.latencies_ns[index] as f64
    }
}

fn format_ns(ns: f64) -> String {
    if ns >= 1_000_000.0 {
        format!("{:.2} ms", ns / 1_000_000.0)
    } else if ns >= 1_000.0 {
        format!("{:.2} µs", ns / 1_000.0)
    } else {
        format!("{ns:.0} ns")
    }
}

fn requests() -> Vec<RateLimitRequest> {
    (0..USERS)
        .map(|i| {
            RateLimitRequest::new()
                .with(DescriptorKey::UserId, format!("user-{i}"))
                .with(DescriptorKey::Tier, "pro")
                .with(DescriptorKey::Route, "/v1/jobs/{id}")
                .with(DescriptorKey::Method, "GET")
        })
        .collect()
}

fn limiter(backend: Arc<dyn Backend>) -> Limiter {
    Limiter::new(
        RuleSet::parse_fairlane(RULES, "bench").expect("bench rules"),
        backend,
        LimiterConfig {
            reload_interval: None,
            ..LimiterConfig::default()
        },
    )
}

fn bench_memory_backend(decisions: usize) -> Row {
    let backend = MemoryBackend::with_system_clock(&MemoryConfig::default());
    let policy = Policy::new(Algorithm::TokenBucket, Unit::Minute, 1_000_000).with_burst(1_000);
    let keys: Vec<String> = (0..USERS)
        .map(|i| format!("{{bench|user_id=user-{i}}}:tb:60"))
        .collect();
    let mut latencies = Vec::with_capacity(decisions);
    let start = Instant::now();
    for i in 0..decisions {
        let t = Instant::now();
        std::hint::black_box(backend.decide_now(&keys[i % USERS], &policy));
        latencies.push(t.elapsed().as_nanos() as u64);
    }
    Row::new("in-memory backend, 1 thread", start.elapsed(), latencies)
}

fn run_limiter_loop(
    limiter: &Limiter,
    requests: &[RateLimitRequest],
    decisions: usize,
    offset: usize,
) -> Vec<u64> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let mut latencies = Vec::with_capacity(decisions);
        for i in 0..decisions {
            let t = Instant::now();
            let outcome = limiter.check(&requests[(i + offset) % USERS]).await;
            latencies.push(t.elapsed().as_nanos() as u64);
            assert!(outcome.allowed);
        }
        latencies
    })
}

fn bench_memory_limiter(threads: usize, decisions_per_thread: usize) -> Row {
    let backend: Arc<dyn Backend> =
        Arc::new(MemoryBackend::with_system_clock(&MemoryConfig::default()));
    let limiter = limiter(backend);
    let requests = Arc::new(requests());
    let start = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let limiter = limiter.clone();
            let requests = Arc::clone(&requests);
            std::thread::spawn(move || {
                run_limiter_loop(&limiter, &requests, decisions_per_thread, t * 997)
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for h in handles {
        latencies.extend(h.join().expect("thread"));
    }
    let name = if threads == 1 {
        "in-memory `Limiter::check`, 1 thread".to_owned()
    } else {
        format!("in-memory `Limiter::check`, {threads} threads")
    };
    Row::new(name, start.elapsed(), latencies)
}

async fn bench_redis(url: &str, callers: usize, decisions_per_caller: usize) -> Option<Row> {
    let config = RedisConfig::new(url).with_key_prefix(format!("bench:rl:{}:", std::process::id()));
    let backend = match RedisBackend::connect(&config).await {
        Ok(b) => b,
        Err(e) => {
            eprintln!("skipping Redis rows: {e}");
            return None;
        }
    };
    let limiter = limiter(Arc::new(backend));
    let requests = Arc::new(requests());
    // Warm up: load the script, open the connection.
    for r in requests.iter().take(100) {
        limiter.check(r).await;
    }
    let start = Instant::now();
    let handles: Vec<_> = (0..callers)
        .map(|c| {
            let limiter = limiter.clone();
            let requests = Arc::clone(&requests);
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(decisions_per_caller);
                for i in 0..decisions_per_caller {
                    let t = Instant::now();
                    let outcome = limiter.check(&requests[(c * 131 + i) % USERS]).await;
                    latencies.push(t.elapsed().as_nanos() as u64);
                    assert!(outcome.allowed, "bench limits are generous");
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for h in handles {
        latencies.extend(h.await.expect("task"));
    }
    let elapsed = start.elapsed();
    let stats = limiter.stats();
    assert_eq!(
        stats.failed_open + stats.fallback_decisions,
        0,
        "Redis failed during the bench: {stats:?}"
    );
    Some(Row::new(
        format!(
            "Redis `Limiter::check`, {callers} concurrent caller{}",
            if callers == 1 { "" } else { "s" }
        ),
        elapsed,
        latencies,
    ))
}

/// Decisions per thread in the in-memory rows unless `BENCH_DECISIONS` sets another (0 also
/// means this).
const DEFAULT_DECISIONS: usize = 1_000_000;

fn main() {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let decisions = match testkit::bench::env_usize("BENCH_DECISIONS", DEFAULT_DECISIONS) {
        0 => DEFAULT_DECISIONS,
        n => n,
    };
    let mut rows = vec![
        bench_memory_backend(2 * decisions),
        bench_memory_limiter(1, decisions),
        bench_memory_limiter(threads, decisions),
    ];
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    // Client runtimes with 1 and with all hardware threads: on a small machine the client's
    // threads compete with redis-server for the same cores.
    for workers in [1, threads] {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            for callers in [1, 50] {
                if let Some(mut row) = bench_redis(&url, callers, 100 * callers.max(50)).await {
                    row.name = format!(
                        "{} ({workers} client thread{})",
                        row.name,
                        if workers == 1 { "" } else { "s" }
                    );
                    rows.push(row);
                }
            }
        });
    }

    println!("| case | decisions | decisions/s | p50 | p99 | p99.9 |");
    println!("|---|---:|---:|---:|---:|---:|");
    for row in &rows {
        let rate = row.decisions as f64 / row.elapsed.as_secs_f64();
        println!(
            "| {} | {} | {:.0} | {} | {} | {} |",
            row.name,
            row.decisions,
            rate,
            format_ns(row.percentile(0.50)),
            format_ns(row.percentile(0.99)),
            format_ns(row.percentile(0.999)),
        );
    }
    println!(
        "\n({threads} hardware threads; latency includes one `Instant::now()` pair, ~20-40 ns)"
    );
}
