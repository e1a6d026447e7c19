//! Redis stopped mid-test: every decision still returns within the deadline (plus slack),
//! fails open or falls back and is counted; when Redis comes back, limiting resumes by itself.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{PrivateRedis, redis_url, unique_prefix};
use ratelimit::{
    DecisionKind, DecisionSource, DescriptorKey, FailureMode, Limiter, LimiterConfig,
    RateLimitOutcome, RateLimitRequest, RedisBackend, RedisConfig, RuleSet,
};

const DEADLINE: Duration = Duration::from_millis(20);
/// Scheduling slack on a busy 2-core machine whose host may take a third of the CPU away; the
/// point is "not blocked" (a hung Redis would hold a request for good), not a benchmark.
const SLACK: Duration = Duration::from_millis(1_000);
/// How many fresh keys [`assert_limited_by_redis`] may try.
const ATTEMPTS: usize = 5;

const RULES: &str = r#"
domain: failover
descriptors:
  - key: user_id
    rate_limit: {unit: minute, requests_per_unit: 3, algorithm: sliding_log}
"#;

fn limiter(redis: &PrivateRedis, mode: FailureMode) -> Limiter {
    limiter_at(redis.url(), mode)
}

fn limiter_at(url: String, mode: FailureMode) -> Limiter {
    let backend =
        RedisBackend::new(&RedisConfig::new(url).with_key_prefix(unique_prefix("failover")))
            .expect("config");
    let config = LimiterConfig {
        deadline: DEADLINE,
        on_backend_failure: mode,
        circuit_failure_threshold: 3,
        circuit_cooldown: Duration::from_millis(200),
        reload_interval: None,
        ..LimiterConfig::default()
    };
    Limiter::new(
        RuleSet::parse_fairlane(RULES, "t").expect("rules"),
        Arc::new(backend),
        config,
    )
}

fn user(id: &str) -> RateLimitRequest {
    RateLimitRequest::new().with(DescriptorKey::UserId, id)
}

async fn timed_check(limiter: &Limiter, id: &str) -> RateLimitOutcome {
    let start = Instant::now();
    let outcome = limiter.check(&user(id)).await;
    let took = start.elapsed();
    assert!(took < DEADLINE + SLACK, "a decision took {took:?}");
    outcome
}

/// 3 allowed then denied, all by Redis itself. A decision that missed the deadline (a stalled
/// host) is rightly made by the fallback instead, and leaves the key's count unknown; such an
/// attempt is set aside and the check repeated on a fresh key, up to [`ATTEMPTS`] times.
async fn assert_limited_by_redis(limiter: &Limiter, id: &str) {
    for attempt in 0..ATTEMPTS {
        let key = format!("{id}-{attempt}");
        let mut outcomes = Vec::new();
        for _ in 0..4 {
            outcomes.push(timed_check(limiter, &key).await);
        }
        if outcomes
            .iter()
            .any(|o| o.limits[0].source != DecisionSource::Backend)
        {
            tokio::time::sleep(Duration::from_millis(300)).await;
            continue;
        }
        for (i, outcome) in outcomes.iter().enumerate() {
            assert_eq!(outcome.allowed, i < 3, "request {i} for {key}");
        }
        return;
    }
    panic!("no attempt of {ATTEMPTS} was decided by Redis throughout");
}

async fn wait_for_recovery(limiter: &Limiter) {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut probe = 0;
    loop {
        probe += 1;
        let outcome = timed_check(limiter, &format!("probe-{probe}")).await;
        if outcome.limits[0].source == DecisionSource::Backend {
            return;
        }
        assert!(Instant::now() < deadline, "limiting did not resume");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_falls_back_to_memory_and_recovers() {
    let mut redis = PrivateRedis::start();
    let limiter = limiter(&redis, FailureMode::FallbackToMemory);
    assert_limited_by_redis(&limiter, "before").await;

    redis.kill();
    let before = limiter.stats();
    // The in-memory fallback still limits (per replica): 3 allowed, then denied.
    for i in 0..40 {
        let outcome = timed_check(&limiter, "during").await;
        assert_eq!(
            outcome.limits[0].source,
            DecisionSource::Fallback,
            "request {i}"
        );
        assert_eq!(outcome.allowed, i < 3, "request {i}");
    }
    let stats = limiter.stats();
    assert_eq!(stats.fallback_decisions - before.fallback_decisions, 40);
    assert!(
        stats.backend_errors + stats.backend_timeouts
            >= before.backend_errors + before.backend_timeouts + 3,
        "{stats:?}"
    );
    assert!(
        stats.circuit_open_skips > before.circuit_open_skips,
        "the circuit never opened: {stats:?}"
    );
    assert_eq!(stats.failed_open, 0);

    // Same port, fresh server: the limiter finds it again without help.
    redis.restart();
    wait_for_recovery(&limiter).await;
    assert_limited_by_redis(&limiter, "after").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_fails_open_when_configured_and_recovers() {
    let mut redis = PrivateRedis::start();
    let limiter = limiter(&redis, FailureMode::FailOpen);
    assert_limited_by_redis(&limiter, "before").await;

    redis.kill();
    let before = limiter.stats();
    for i in 0..40 {
        let outcome = timed_check(&limiter, "during").await;
        assert!(outcome.allowed, "request {i} was not let through");
        assert_eq!(outcome.limits[0].kind, DecisionKind::FailedOpen);
        assert_eq!(outcome.limits[0].source, DecisionSource::None);
    }
    let stats = limiter.stats();
    assert_eq!(stats.failed_open - before.failed_open, 40);
    assert_eq!(stats.fallback_decisions, 0);
    assert!(
        stats.circuit_open_skips > before.circuit_open_skips,
        "{stats:?}"
    );

    redis.restart();
    wait_for_recovery(&limiter).await;
    assert_limited_by_redis(&limiter, "after").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_redis_costs_at_most_the_deadline() {
    // SIGSTOP: the server accepts nothing and answers nothing; only the deadline helps.
    let redis = PrivateRedis::start();
    let limiter = limiter(&redis, FailureMode::FailOpen);
    assert_limited_by_redis(&limiter, "before").await;
    let pid = redis.pid();
    let stop = std::process::Command::new("kill")
        .args(["-STOP", &pid.to_string()])
        .status()
        .expect("kill -STOP");
    assert!(stop.success());
    let before = limiter.stats();
    for _ in 0..20 {
        let outcome = timed_check(&limiter, "hung").await;
        assert!(outcome.allowed);
        assert_eq!(outcome.limits[0].kind, DecisionKind::FailedOpen);
    }
    let stats = limiter.stats();
    assert!(
        stats.backend_timeouts >= before.backend_timeouts + 3,
        "{stats:?}"
    );
    assert!(
        stats.circuit_open_skips > before.circuit_open_skips,
        "{stats:?}"
    );
    let cont = std::process::Command::new("kill")
        .args(["-CONT", &pid.to_string()])
        .status()
        .expect("kill -CONT");
    assert!(cont.success());
    wait_for_recovery(&limiter).await;
    assert_limited_by_redis(&limiter, "after").await;
}

/// A TCP proxy in front of the shared Redis that waits `delay` before connecting each client
/// through, as Redis across zones, behind TLS or slow DNS does; returns its URL.
async fn slow_to_connect_proxy(delay: Duration) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let address = listener.local_addr().expect("address");
    let url = redis_url();
    let upstream = url
        .trim_start_matches("redis://")
        .split('/')
        .next()
        .expect("host:port")
        .to_owned();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let upstream = upstream.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(&upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    format!("redis://{address}")
}

/// Opening a connection takes longer than a decision's deadline: the decisions that wait for
/// it fall back, but the opening goes on without them, and limiting by Redis starts once it is
/// open, and stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_slower_to_connect_than_the_deadline_is_still_reached() {
    let proxy = slow_to_connect_proxy(DEADLINE * 3).await;
    let limiter = limiter_at(proxy, FailureMode::FallbackToMemory);
    let first = timed_check(&limiter, "first").await;
    assert_eq!(
        first.limits[0].source,
        DecisionSource::Fallback,
        "the connection cannot be open yet"
    );
    wait_for_recovery(&limiter).await;
    assert_limited_by_redis(&limiter, "connected").await;
}

/// A failover that demotes the old primary without closing its clients' connections (a manual
/// switchover, some managed services): the limiter's connection now reaches a replica, and every
/// script fails with `READONLY`. It drops that connection, and the next one reaches the new
/// primary, so limiting by Redis resumes instead of falling back for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_demoted_to_replica_is_left_for_the_new_primary() {
    let old_primary = PrivateRedis::start();
    let new_primary = PrivateRedis::start();
    // The address a failover points at the new primary: connections made after the switch go
    // there, those made before stay on the old one.
    let proxy = testkit::proxy::TcpProxy::start(format!("127.0.0.1:{}", old_primary.port)).await;
    let limiter = limiter_at(
        format!("redis://{}", proxy.addr()),
        FailureMode::FallbackToMemory,
    );
    assert_limited_by_redis(&limiter, "before").await;

    let client = redis::Client::open(old_primary.url()).expect("url");
    let mut old = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect to the old primary");
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(new_primary.port)
        .query_async(&mut old)
        .await
        .expect("REPLICAOF");
    proxy.forward_to(format!("127.0.0.1:{}", new_primary.port));

    wait_for_recovery(&limiter).await;
    assert_limited_by_redis(&limiter, "after").await;
    assert!(
        limiter.stats().backend_errors > 0,
        "the demotion was not seen"
    );
}
