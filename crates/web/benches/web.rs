//! `cargo bench -p web --bench web`: the HTTP API under load, next to the machine's pgbench
//! single-row INSERT rate measured in the same run. Prints markdown tables; every number comes
//! from this run.
//!
//! - `POST /v1/analyses` (authenticated, a new commit per request so nothing is cached, quota
//!   plenty): 32 concurrent clients (`BENCH_CLIENTS`) over 100 users; requests/s, p50, p99.
//!   It takes turns with pgbench for `BENCH_ROUNDS` rounds (default 3), so that each round's
//!   ratio compares the two on the machine as it was then; the summary gives the median
//!   ratio. A shared virtual machine's speed drifts by minutes, so every phase prints how the
//!   machine's CPU was spent (from `/proc/stat`), including the time its host took away
//!   ("stolen"), and the summary counts the phases that lost 5 % or more that way.
//! - `GET /v1/jobs/{id}` (authenticated, trivial): the same load without rate limiting and with
//!   the Redis rate limiter (one rule per request), alternated twice.
//!
//! `BENCH_SECONDS` (default 10) sets each phase's length, pgbench's included; `BENCH_ROUNDS`
//! the number of rounds; `BENCH_CLIENTS` the number of concurrent clients (default 32, the
//! target's setting; more shows how throughput grows with concurrency, docs/benchmarks.md);
//! `BENCH_BATCH_CONCURRENCY` overrides `ENQUEUE_BATCH_CONCURRENCY` (to compare settings);
//! `BENCH_POST_ONLY=1` skips the `GET` phases; Redis from `REDIS_URL`. Each write phase starts
//! after a `CHECKPOINT`.

#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr
)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use testkit::TestDb;
use testkit::bench::{
    CpuShare, CpuSnapshot, CpuTimes, PgbenchRun, PgbenchTarget, checkpoint, env_usize, median,
};
use tokio_util::sync::CancellationToken;
use web::WebConfig;

/// Concurrent clients of every phase, unless `BENCH_CLIENTS` says otherwise: the issue's 32.
const DEFAULT_CLIENTS: usize = 32;
const USERS: usize = 100;
/// Stolen CPU (per cent) from which a phase is flagged in the summary.
const STOLEN_NOTABLE: f64 = 5.0;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(client_count() * 2)
        .build(connector)
}

struct Load {
    requests: u64,
    errors: u64,
    seconds: f64,
    latencies_us: Vec<u64>,
    /// The machine's CPU during the load (none where `/proc/stat` cannot be read).
    cpu: Option<CpuShare>,
}

impl Load {
    fn rps(&self) -> f64 {
        self.requests as f64 / self.seconds
    }
    fn percentile(&self, p: f64) -> f64 {
        let i = ((self.latencies_us.len() as f64 - 1.0) * p).round() as usize;
        self.latencies_us.get(i).copied().unwrap_or(0) as f64 / 1000.0
    }
}

/// Runs [`client_count`] closed-loop clients for `seconds`; `make` builds request number `n` of
/// client `c`; `expect` is the status every response must have.
async fn load<F>(seconds: u64, expect: u16, make: F) -> Load
where
    F: Fn(usize, u64) -> Request<Full<Bytes>> + Send + Sync + 'static,
{
    let http = client();
    let make = Arc::new(make);
    let errors = Arc::new(AtomicU64::new(0));
    let stop = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    let cpu_before = CpuTimes::read();
    let mut tasks = Vec::new();
    for c in 0..client_count() {
        let (http, make, errors) = (http.clone(), Arc::clone(&make), Arc::clone(&errors));
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut n = 0u64;
            while Instant::now() < stop {
                let t = Instant::now();
                let ok = match http.request(make(c, n)).await {
                    Ok(resp) => {
                        let status = resp.status().as_u16();
                        let body = resp.into_body().collect().await;
                        if status != expect && errors.fetch_add(1, Ordering::Relaxed) < 3 {
                            eprintln!(
                                "unexpected {status}: {:?}",
                                body.map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
                            );
                        }
                        status == expect
                    }
                    Err(e) => {
                        eprintln!("request failed: {e}");
                        false
                    }
                };
                if !ok {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
                latencies.push(t.elapsed().as_micros() as u64);
                n += 1;
            }
            latencies
        }));
    }
    let mut latencies_us = Vec::new();
    for t in tasks {
        latencies_us.extend(t.await.unwrap());
    }
    let seconds = started.elapsed().as_secs_f64();
    latencies_us.sort_unstable();
    Load {
        requests: latencies_us.len() as u64,
        errors: errors.load(Ordering::Relaxed),
        seconds,
        latencies_us,
        cpu: CpuShare::since(cpu_before),
    }
}

async fn server(config: WebConfig) -> (SocketAddr, CancellationToken) {
    let server = web::Server::bind(&config).await.unwrap();
    let addr = server.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    tokio::spawn(server.run(shutdown.clone()));
    (addr, shutdown)
}

fn base_config(db: &TestDb) -> WebConfig {
    let mut c = WebConfig {
        database_url: db.url(),
        database_max_connections: u32::try_from(client_count()).unwrap_or(u32::MAX),
        http_addr: "127.0.0.1:0".into(),
        ratelimit_enabled: false,
        ..WebConfig::default()
    };
    c.quota.quota_analysis_enterprise_limit = u32::MAX;
    c.enqueue_batch_concurrency = env_usize("BENCH_BATCH_CONCURRENCY", c.enqueue_batch_concurrency);
    c.telemetry.rust_log = "error".into();
    c
}

fn row(case: &str, l: &Load) -> String {
    format!(
        "| {case} | {} | {:.0} | {:.2} ms | {:.2} ms | {} | {} |",
        l.requests,
        l.rps(),
        l.percentile(0.50),
        l.percentile(0.99),
        l.errors,
        cpu_column(l.cpu.as_ref()),
    )
}

#[tokio::main]
async fn main() {
    let seconds = env_usize("BENCH_SECONDS", 10).max(1) as u64;
    let rounds = env_usize("BENCH_ROUNDS", 3).max(1);
    let pgbench = PgbenchTarget::new().await;

    let db = TestDb::new().await;
    let mut keys = Vec::new();
    for _ in 0..USERS {
        let user = web::admin::create_user(&db.pool, "bench", common::Tier::Enterprise)
            .await
            .unwrap();
        keys.push(web::admin::issue_key(&db.pool, user.id).await.unwrap().key);
    }
    let keys = Arc::new(keys);

    // pgbench and POST /v1/analyses take turns, so that both sides of each round's ratio see
    // the machine in the same state.
    let (addr, stop) = server(base_config(&db)).await;
    let counter = Arc::new(AtomicU64::new(0));
    let mut results = Vec::new();
    for _ in 0..rounds {
        let pgbench_run = pgbench.run(seconds).await;
        checkpoint(&db.pool).await;
        let cpu_before = CpuSnapshot::take();
        let post = post_phase(addr, &keys, &counter, seconds).await;
        let cpu_after = CpuSnapshot::take();
        let per_request = |seconds: f64| seconds * 1e6 / post.requests.max(1) as f64;
        results.push(Round {
            pgbench: pgbench_run,
            web_us_per_request: per_request(cpu_after.own_seconds_since(&cpu_before)),
            postgres_us_per_request: per_request(cpu_after.postgres_seconds_since(&cpu_before)),
            busiest_backend: cpu_after.busiest_postgres_share_since(&cpu_before),
            post,
        });
    }
    stop.cancel();
    // GET /v1/jobs/{id} without and with the Redis rate limiter.
    let get = if std::env::var_os("BENCH_POST_ONLY").is_some() {
        None
    } else {
        Some(get_phases(&db, &keys, seconds).await)
    };

    println!(
        "| round | pgbench single-row INSERT (8 clients) | POST /v1/analyses ({} clients, {USERS} users) | p50 | p99 | errors | POST ÷ pgbench | CPU during pgbench | CPU during POST | CPU per POST: web and clients / PostgreSQL | busiest PostgreSQL process during POST |",
        client_count(),
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|");
    let mut ratios = Vec::new();
    for (i, round) in results.iter().enumerate() {
        let post = &round.post;
        let ratio = round.pgbench.rate.as_ref().ok().map(|tps| post.rps() / tps);
        ratios.extend(ratio);
        println!(
            "| {} | {} | {:.0} req/s | {:.2} ms | {:.2} ms | {} | {} | {} | {} | {:.0} µs / {:.0} µs | {} |",
            i + 1,
            match &round.pgbench.rate {
                Ok(tps) => format!("{tps:.0} rows/s"),
                Err(e) => e.clone(),
            },
            post.rps(),
            post.percentile(0.50),
            post.percentile(0.99),
            post.errors,
            ratio.map_or_else(|| "—".into(), |r| format!("{r:.2}")),
            cpu_column(round.pgbench.cpu.as_ref()),
            cpu_column(post.cpu.as_ref()),
            round.web_us_per_request,
            round.postgres_us_per_request,
            round.busiest_backend.map_or_else(
                || "—".into(),
                |share| format!("{:.0} % of a core", share * 100.0)
            ),
        );
    }
    if let Some((without, with)) = &get {
        println!();
        println!("| case | requests | requests/s | p50 | p99 | errors | CPU |");
        println!("|---|---:|---:|---:|---:|---:|---|");
        for (name, runs) in [
            ("without rate limiting", without),
            ("with the Redis rate limiter", with),
        ] {
            for (i, l) in runs.iter().enumerate() {
                println!(
                    "{}",
                    row(&format!("GET /v1/jobs/{{id}} {name} (run {})", i + 1), l)
                );
            }
        }
    }

    println!();
    println!("| summary | value |");
    println!("|---|---|");
    if let Some(median) = median(&mut ratios) {
        let listed: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
        println!(
            "| POST /v1/analyses ÷ pgbench, median of {} round{} | {median:.2} (each: {}; target ≥ 0.5) |",
            ratios.len(),
            if ratios.len() == 1 { "" } else { "s" },
            listed.join(", ")
        );
    } else {
        println!("| POST /v1/analyses ÷ pgbench | — (pgbench gave no rate) |");
    }
    let worst_p99 = results
        .iter()
        .map(|round| round.post.percentile(0.99))
        .fold(0.0, f64::max);
    println!("| POST /v1/analyses p99, worst round | {worst_p99:.2} ms (target < 50 ms) |");
    // The phases whose CPU split was measured.
    let mut phases: Vec<&CpuShare> = results
        .iter()
        .flat_map(|round| [round.pgbench.cpu.as_ref(), round.post.cpu.as_ref()])
        .flatten()
        .collect();
    if let Some((without, with)) = &get {
        phases.extend(without.iter().chain(with).filter_map(|l| l.cpu.as_ref()));
    }
    let measured = phases.len();
    let stolen = phases
        .iter()
        .filter(|cpu| cpu.stolen >= STOLEN_NOTABLE)
        .count();
    if measured > 0 {
        println!(
            "| phases with ≥ {STOLEN_NOTABLE:.0} % of the CPU stolen by the host | {stolen} of {measured}{} |",
            if stolen > 0 {
                ": their numbers say as much about the host as about Fairlane"
            } else {
                ""
            }
        );
    }
    if let Some((without, with)) = &get {
        let mean = |runs: &[Load]| runs.iter().map(Load::rps).sum::<f64>() / runs.len() as f64;
        println!(
            "| GET with Redis limiter ÷ without | {:.2} (target ≥ 0.70) |",
            mean(with) / mean(without)
        );
    }
}

/// One round: pgbench, then `POST /v1/analyses`, with the machine's CPU use during each, the
/// CPU time each request cost this process (server and clients) and all of PostgreSQL, and the
/// busiest PostgreSQL process's share of a core.
struct Round {
    pgbench: PgbenchRun,
    post: Load,
    web_us_per_request: f64,
    postgres_us_per_request: f64,
    /// The share of one core used by the busiest PostgreSQL process (the enqueue batches'
    /// backend, normally): near 100 % it is the bound, however idle the machine is.
    busiest_backend: Option<f64>,
}

fn cpu_column(share: Option<&CpuShare>) -> String {
    share.map_or_else(|| "—".into(), CpuShare::to_string)
}

/// The number of concurrent clients: `BENCH_CLIENTS`, or [`DEFAULT_CLIENTS`].
fn client_count() -> usize {
    static COUNT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *COUNT.get_or_init(|| env_usize("BENCH_CLIENTS", DEFAULT_CLIENTS).max(1))
}

/// One `POST /v1/analyses` phase: every request names a commit never used before, so nothing
/// is served from the cache.
async fn post_phase(
    addr: SocketAddr,
    keys: &Arc<Vec<String>>,
    counter: &Arc<AtomicU64>,
    seconds: u64,
) -> Load {
    let keys = Arc::clone(keys);
    let counter = Arc::clone(counter);
    load(seconds, 202, move |c, n| {
        let commit = counter.fetch_add(1, Ordering::Relaxed);
        let key = &keys[(c * 7919 + n as usize) % USERS];
        let body = format!(
            "{{\"repository\":\"https://github.com/fairlane-bench/repo.git\",\"ref\":\"{commit:040x}\"}}"
        );
        Request::builder()
            .method(Method::POST)
            .uri(format!("http://{addr}/v1/analyses"))
            .header("authorization", format!("Bearer {key}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap()
    })
    .await
}

/// `GET /v1/jobs/{id}` without and with the Redis rate limiter, alternated twice; returns the
/// runs without and with it.
async fn get_phases(db: &TestDb, keys: &Arc<Vec<String>>, seconds: u64) -> (Vec<Load>, Vec<Load>) {
    let jobs: Vec<(i64, String)> = sqlx::query_as(
        "SELECT j.id, k.id FROM fairlane_job j JOIN api_keys k ON k.user_id = j.user_id \
         ORDER BY j.id LIMIT 1000",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let key_by_id: std::collections::HashMap<String, String> = keys
        .iter()
        .map(|k| (web::keys::parse_id(k).unwrap().to_owned(), k.clone()))
        .collect();
    let targets: Arc<Vec<(i64, String)>> = Arc::new(
        jobs.into_iter()
            .map(|(job, key_id)| (job, key_by_id[&key_id].clone()))
            .collect(),
    );
    let (plain, stop_plain) = server(base_config(db)).await;
    let rules =
        std::env::temp_dir().join(format!("fairlane-bench-rules-{}.yaml", std::process::id()));
    std::fs::write(
        &rules,
        format!(
            "domain: bench{}\ndescriptors:\n  - key: user_id\n    rate_limit: {{unit: second, requests_per_unit: 1000000, algorithm: token_bucket}}\n",
            std::process::id()
        ),
    )
    .unwrap();
    let mut limited_config = base_config(db);
    limited_config.ratelimit_enabled = true;
    limited_config.ratelimit_rules = rules.display().to_string();
    limited_config.redis_url = Some(testkit::redis_url());
    let (limited, stop_limited) = server(limited_config).await;
    let get = |addr: SocketAddr| {
        let targets = Arc::clone(&targets);
        move |c: usize, n: u64| {
            let (job, key) = &targets[(c * 131 + n as usize) % targets.len()];
            Request::builder()
                .method(Method::GET)
                .uri(format!("http://{addr}/v1/jobs/{job}"))
                .header("authorization", format!("Bearer {key}"))
                .body(Full::new(Bytes::new()))
                .unwrap()
        }
    };
    let half = (seconds / 2).max(1);
    let mut without = Vec::new();
    let mut with = Vec::new();
    for _ in 0..2 {
        without.push(load(half, 200, get(plain)).await);
        with.push(load(half, 200, get(limited)).await);
    }
    stop_plain.cancel();
    stop_limited.cancel();
    let _ = std::fs::remove_file(&rules);
    (without, with)
}
