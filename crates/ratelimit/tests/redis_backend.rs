//! The Redis scripts against the algorithms' definitions on a real Redis, in real time, using the
//! server timestamps each script returns; and many concurrent callers on separate connections.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Event, allowed_times, redis_url, unique_prefix};
use rand::{Rng, SeedableRng, rngs::StdRng};
use ratelimit::algorithms::decide;
use ratelimit::{Algorithm, Backend, CounterState, Policy, RedisBackend, RedisConfig, Unit};

const W: u64 = 1_000_000;

async fn backend(test: &str) -> RedisBackend {
    RedisBackend::connect(&RedisConfig::new(redis_url()).with_key_prefix(unique_prefix(test)))
        .await
        .expect("redis reachable (REDIS_URL or 127.0.0.1:6379)")
}

/// A trace this long, with some denials in it, exercises a script enough.
const ENOUGH_DECISIONS: usize = 100;
/// How long a trace may go on to reach that on a slow or busy machine.
const LONGEST_TRACE: Duration = Duration::from_secs(60);

/// Send requests one after another, with small random pauses, for at least `span` and until the
/// trace holds more than [`ENOUGH_DECISIONS`] decisions and some denials: a machine that
/// answers slowly (a busy CI host) gets a longer trace, not a thinner one. Returns every
/// decision with the server time it was made at.
async fn sequential_trace(
    backend: &RedisBackend,
    policy: &Policy,
    span: Duration,
    seed: u64,
) -> Vec<ratelimit::BackendDecision> {
    let mut rng = StdRng::seed_from_u64(seed);
    let start = Instant::now();
    let mut out: Vec<ratelimit::BackendDecision> = Vec::new();
    let covered = |out: &[ratelimit::BackendDecision]| {
        out.len() > ENOUGH_DECISIONS && out.iter().any(|d| !d.verdict.allowed)
    };
    while start.elapsed() < span || (!covered(&out) && start.elapsed() < LONGEST_TRACE) {
        out.push(
            backend
                .decide("{seq}:k", policy)
                .await
                .expect("redis decision"),
        );
        let pause = rng.random_range(0..8_000);
        tokio::time::sleep(Duration::from_micros(pause)).await;
    }
    out
}

/// The script's decisions must be exactly the pure algorithm's at the same server times, and
/// the algorithm's invariant must hold on the server timeline.
async fn script_matches_definition(algorithm: Algorithm, n: u64, burst: u64) {
    let backend = backend(algorithm.as_str()).await;
    let policy = Policy::new(algorithm, Unit::Second, n).with_burst(burst);
    let trace = sequential_trace(&backend, &policy, Duration::from_millis(2_300), n).await;
    assert!(
        trace.len() > ENOUGH_DECISIONS,
        "only {} requests",
        trace.len()
    );
    let mut state = CounterState::fresh(algorithm);
    for (i, d) in trace.iter().enumerate() {
        let expected = decide(&policy, &mut state, d.clock_us);
        assert_eq!(
            d.verdict, expected,
            "{algorithm}: request {i} at {}",
            d.clock_us
        );
    }
    let events: Vec<Event> = trace
        .iter()
        .map(|d| Event {
            at_us: d.clock_us,
            allowed: d.verdict.allowed,
        })
        .collect();
    let allowed = allowed_times(&events);
    assert!(
        allowed.len() < events.len(),
        "{algorithm}: nothing was limited"
    );
    check_invariant(&policy, &allowed);
}

fn check_invariant(policy: &Policy, allowed: &[u64]) {
    let n = policy.requests_per_unit;
    match policy.algorithm {
        Algorithm::FixedWindow => {
            let per = common::per_aligned_window(allowed, W);
            assert!(per.values().all(|&c| c <= n), "{per:?}");
        }
        Algorithm::SlidingLog => {
            assert!(common::max_in_any_window(allowed, W) <= n as usize);
        }
        Algorithm::SlidingWindow => {
            common::assert_sliding_window_bound(allowed, n, W);
        }
        Algorithm::TokenBucket | Algorithm::LeakyBucket => {
            common::assert_bucket_bound(allowed, n, W, policy.burst);
        }
    }
}

#[tokio::test]
async fn fixed_window_script_matches_definition() {
    script_matches_definition(Algorithm::FixedWindow, 20, 20).await;
}

#[tokio::test]
async fn sliding_log_script_matches_definition() {
    script_matches_definition(Algorithm::SlidingLog, 20, 20).await;
}

#[tokio::test]
async fn sliding_window_script_matches_definition() {
    script_matches_definition(Algorithm::SlidingWindow, 20, 20).await;
}

#[tokio::test]
async fn token_bucket_script_matches_definition() {
    script_matches_definition(Algorithm::TokenBucket, 20, 8).await;
}

#[tokio::test]
async fn leaky_bucket_script_matches_definition() {
    script_matches_definition(Algorithm::LeakyBucket, 20, 8).await;
}

/// A rules reload keeps each key's state, so a key filled under a larger limit is then decided
/// under a smaller one (the rate and capacity together, or a bucket's burst alone): the script
/// must decide exactly as the pure algorithm does, refusing with nothing remaining.
#[tokio::test]
async fn a_lowered_limit_decides_alike_in_both_backends() {
    const LOWERED: [((u64, u64), (u64, u64)); 2] = [((10, 10), (3, 3)), ((10, 10), (10, 3))];
    let backend = backend("lowered").await;
    for algorithm in Algorithm::ALL {
        for (case, ((n0, b0), (n1, b1))) in LOWERED.into_iter().enumerate() {
            if n0 == n1 && !algorithm.has_burst() {
                continue;
            }
            // An hour's unit: the trace takes milliseconds, so no window ends during it.
            let before = Policy::new(algorithm, Unit::Hour, n0).with_burst(b0);
            let after = Policy::new(algorithm, Unit::Hour, n1).with_burst(b1);
            let key = format!("{{lowered}}:{}:{case}", algorithm.key_tag());
            let mut trace = Vec::new();
            for policy in std::iter::repeat_n(before, 10).chain(std::iter::repeat_n(after, 3)) {
                let d = backend.decide(&key, &policy).await.expect("decision");
                trace.push((policy, d));
            }
            let mut state = CounterState::fresh(algorithm);
            for (i, (policy, d)) in trace.iter().enumerate() {
                let expected = decide(policy, &mut state, d.clock_us);
                assert_eq!(d.verdict, expected, "{algorithm} case {case}: request {i}");
            }
            for (_, d) in &trace[10..] {
                assert!(!d.verdict.allowed, "{algorithm} case {case}");
                assert_eq!(d.verdict.remaining, 0, "{algorithm} case {case}");
            }
        }
    }
}

/// Write `state` into Redis at `key` as the scripts store it (with a TTL, should the test stop
/// before a script sets one).
async fn store_state(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
    state: &CounterState,
) {
    let mut pipe = redis::pipe();
    pipe.atomic().del(key);
    match state {
        CounterState::FixedWindow(s) => {
            pipe.hset_multiple(key, &[("w", s.window), ("c", s.count)]);
        }
        CounterState::SlidingWindow(s) => {
            pipe.hset_multiple(key, &[("w", s.window), ("c", s.current), ("p", s.previous)]);
        }
        CounterState::TokenBucket(s) => {
            pipe.hset_multiple(key, &[("tk", s.tokens_scaled), ("ts", s.updated_us)]);
        }
        CounterState::LeakyBucket(s) => {
            pipe.hset_multiple(key, &[("lv", s.level_scaled), ("ts", s.updated_us)]);
        }
        CounterState::SlidingLog(s) => {
            for (i, t) in s.log.iter().enumerate() {
                pipe.zadd(key, format!("stored-{i}"), *t);
            }
        }
    }
    pipe.pexpire(key, 60_000);
    let () = pipe.query_async(conn).await.expect("store state");
}

/// A wall clock can step back (NTP) after a key's state was written. Redis's `TIME` cannot be
/// moved, so the state is built by the pure algorithm two windows ahead of this machine's clock
/// and stored: the script must keep refusing a filled key, and decide exactly as the pure
/// algorithm does from the same state at the same server times, for a filled key and for one
/// with room left (whose allowed requests are recorded at the stored time).
#[tokio::test]
async fn a_clock_stepped_back_decides_alike_in_both_backends() {
    let backend = backend("stepped-back").await;
    let client = redis::Client::open(redis_url()).expect("url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    for algorithm in Algorithm::ALL {
        for used in [3, 1] {
            let policy = Policy::new(algorithm, Unit::Second, 3).with_burst(3);
            let local_now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock after epoch")
                .as_micros();
            // Far enough ahead that a slow machine's decisions still land before it.
            let ahead = (u64::try_from(local_now).expect("fits") / W + 30) * W + 10;
            let mut state = CounterState::fresh(algorithm);
            for i in 0..used {
                assert!(decide(&policy, &mut state, ahead + i).allowed);
            }
            let key = format!("{{stepped-back}}:{}:{used}", algorithm.key_tag());
            store_state(&mut conn, &backend.redis_key(&key), &state).await;
            for i in 0..4 {
                let d = backend.decide(&key, &policy).await.expect("decision");
                assert!(
                    d.clock_us / W < ahead / W,
                    "Redis's clock is not behind the stored state (is it on another host?)"
                );
                let expected = decide(&policy, &mut state, d.clock_us);
                assert_eq!(d.verdict, expected, "{algorithm}, {used} used: request {i}");
                assert_eq!(
                    d.verdict.allowed,
                    used + i < 3,
                    "{algorithm}, {used} used: request {i}"
                );
            }
        }
    }
}

#[tokio::test]
async fn fixed_window_resets_at_the_server_boundary() {
    let backend = backend("fw-boundary").await;
    let policy = Policy::new(Algorithm::FixedWindow, Unit::Second, 3);
    let first = backend.decide("{b}:k", &policy).await.expect("decision");
    let window = first.clock_us / W;
    let mut last = first;
    // Exhaust the window (unless it ends meanwhile; then start over in the next one).
    while last.verdict.allowed {
        last = backend.decide("{b}:k", &policy).await.expect("decision");
    }
    assert!(last.verdict.retry_after_us > 0);
    assert_eq!(
        last.verdict.retry_after_us,
        (last.clock_us / W + 1) * W - last.clock_us,
        "retry after = time to the window boundary"
    );
    tokio::time::sleep(Duration::from_micros(last.verdict.retry_after_us)).await;
    let next = backend.decide("{b}:k", &policy).await.expect("decision");
    assert!(next.clock_us / W > window);
    assert!(next.verdict.allowed, "a new window starts empty");
    assert_eq!(next.verdict.remaining, 2);
}

#[tokio::test]
async fn keys_carry_a_ttl_and_a_hash_tag() {
    let prefix = unique_prefix("ttl");
    let backend = RedisBackend::connect(&RedisConfig::new(redis_url()).with_key_prefix(&prefix))
        .await
        .expect("redis");
    let client = redis::Client::open(redis_url()).expect("url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    for algorithm in Algorithm::ALL {
        let policy = Policy::new(algorithm, Unit::Minute, 5);
        let counter_key = format!("{{fl|user_id=ttl}}:{}:60", algorithm.key_tag());
        let d = backend
            .decide(&counter_key, &policy)
            .await
            .expect("decision");
        let key = backend.redis_key(&counter_key);
        let pttl: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("pttl");
        let reset_ms = i64::try_from(d.verdict.reset_us.div_ceil(1000)).expect("fits");
        assert!(pttl > 0, "{algorithm}: key without TTL ({pttl})");
        assert!(
            pttl <= reset_ms + 1,
            "{algorithm}: TTL {pttl} ms > reset {reset_ms} ms"
        );
        // Redis Cluster hashes only the part between the first `{` and the next `}`.
        let open = key.find('{').expect("hash tag opens");
        let close = open + key[open..].find('}').expect("hash tag closes");
        assert_eq!(
            &key[open + 1..close],
            "fl|user_id=ttl",
            "{algorithm}: {key}"
        );
    }
}

/// Many callers on separate connections hammer one key; the server-time trace must respect the
/// algorithm's bound.
async fn hammer(algorithm: Algorithm, n: u64, burst: u64) {
    const CONNECTIONS: usize = 8;
    const TASKS_PER_CONNECTION: usize = 4;
    let prefix = unique_prefix(&format!("hammer-{algorithm}"));
    let policy = Policy::new(algorithm, Unit::Second, n).with_burst(burst);
    let mut handles = Vec::new();
    for _ in 0..CONNECTIONS {
        let backend = Arc::new(
            RedisBackend::connect(&RedisConfig::new(redis_url()).with_key_prefix(&prefix))
                .await
                .expect("redis"),
        );
        for _ in 0..TASKS_PER_CONNECTION {
            let backend = Arc::clone(&backend);
            handles.push(tokio::spawn(async move {
                let start = Instant::now();
                let mut events = Vec::new();
                while start.elapsed() < Duration::from_millis(2_200) {
                    let d = backend
                        .decide("{shared|user_id=1}:k", &policy)
                        .await
                        .expect("decision");
                    events.push(Event {
                        at_us: d.clock_us,
                        allowed: d.verdict.allowed,
                    });
                    tokio::time::sleep(Duration::from_micros(500)).await;
                }
                events
            }));
        }
    }
    let mut events = Vec::new();
    for h in handles {
        events.extend(h.await.expect("task"));
    }
    let allowed = allowed_times(&events);
    assert!(
        events.len() > allowed.len() * 2,
        "the key was not contended"
    );
    check_invariant(&policy, &allowed);
    if algorithm == Algorithm::FixedWindow {
        // Windows entirely inside the run were saturated: exactly N each.
        let per = common::per_aligned_window(&allowed, W);
        let first = events.iter().map(|e| e.at_us).min().expect("events") / W;
        let last = events.iter().map(|e| e.at_us).max().expect("events") / W;
        for (window, count) in &per {
            if *window > first && *window < last {
                assert_eq!(*count, n, "window {window}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_callers_never_exceed_fixed_window() {
    hammer(Algorithm::FixedWindow, 30, 30).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_callers_never_exceed_sliding_log() {
    hammer(Algorithm::SlidingLog, 30, 30).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_callers_stay_within_sliding_window_bound() {
    hammer(Algorithm::SlidingWindow, 30, 30).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_callers_never_exceed_token_bucket() {
    hammer(Algorithm::TokenBucket, 30, 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_callers_never_exceed_leaky_bucket() {
    hammer(Algorithm::LeakyBucket, 30, 10).await;
}
