//! The in-memory backend: bounded memory (expiry and a hard cap) and exact limits under real
//! concurrency.

use std::sync::Arc;
use std::time::Duration;

use ratelimit::{Algorithm, ManualClock, MemoryBackend, MemoryConfig, Policy, Unit};

const SEC: u64 = 1_000_000;
const T0: u64 = 1_700_000_000 * SEC;

fn backend(max_entries: usize, clock: &Arc<ManualClock>) -> MemoryBackend {
    let config = MemoryConfig {
        max_entries,
        shards: 8,
        sweep_interval: Duration::from_secs(1),
    };
    MemoryBackend::new(&config, Arc::clone(clock) as Arc<dyn ratelimit::Clock>)
}

#[test]
fn the_hard_cap_bounds_the_number_of_entries() {
    let clock = Arc::new(ManualClock::new(T0));
    let backend = backend(1_000, &clock);
    let policy = Policy::new(Algorithm::SlidingWindow, Unit::Day, 100);
    for i in 0..20_000 {
        backend.decide_now(&format!("{{d|remote_address=ip-{i}}}:sw:86400"), &policy);
        assert!(backend.len() <= backend.capacity());
    }
    assert_eq!(backend.capacity(), 1_000);
    assert!(backend.len() >= 900, "the cap is used, not undershot");
    assert!(backend.evictions() >= 19_000);
}

#[test]
fn every_key_keeps_its_own_count_among_thousands() {
    let clock = Arc::new(ManualClock::new(T0));
    let backend = backend(100_000, &clock);
    let policy = Policy::new(Algorithm::FixedWindow, Unit::Hour, 3);
    let keys: Vec<String> = (0..5_000)
        .map(|i| format!("{{d|user_id=u-{i}}}:fw:3600"))
        .collect();
    // Interleaved, so every shard's table grows while its keys are counted.
    for round in 0..4 {
        for key in &keys {
            let allowed = backend.decide_now(key, &policy).verdict.allowed;
            assert_eq!(allowed, round < 3, "{key}, request {}", round + 1);
        }
    }
    assert_eq!(backend.len(), keys.len());
    assert_eq!(backend.evictions(), 0);
}

#[test]
fn idle_keys_expire_and_are_swept() {
    let clock = Arc::new(ManualClock::new(T0));
    let backend = backend(100_000, &clock);
    let policy = Policy::new(Algorithm::TokenBucket, Unit::Second, 10).with_burst(5);
    for i in 0..500 {
        backend.decide_now(&format!("{{d|user_id={i}}}:tb:1"), &policy);
    }
    assert_eq!(backend.len(), 500);
    // One token refills in 100 ms: after that every bucket is full again, i.e. fresh.
    clock.advance(100_001);
    backend.sweep();
    assert!(backend.is_empty());
    // The lazy sweep does the same without being asked, once per sweep interval.
    for i in 0..500 {
        backend.decide_now(&format!("{{d|user_id={i}}}:tb:1"), &policy);
    }
    clock.advance(2 * SEC);
    backend.decide_now("{d|user_id=new}:tb:1", &policy);
    assert!(backend.len() < 500, "{} entries left", backend.len());
    assert_eq!(backend.evictions(), 0, "nothing live was evicted");
}

#[test]
fn an_expired_entry_counts_as_fresh() {
    let clock = Arc::new(ManualClock::new(T0));
    let backend = backend(100, &clock);
    let policy = Policy::new(Algorithm::FixedWindow, Unit::Second, 2);
    assert!(backend.decide_now("k", &policy).verdict.allowed);
    assert!(backend.decide_now("k", &policy).verdict.allowed);
    assert!(!backend.decide_now("k", &policy).verdict.allowed);
    clock.advance(SEC);
    let d = backend.decide_now("k", &policy);
    assert!(d.verdict.allowed);
    assert_eq!(d.verdict.remaining, 1);
}

#[test]
fn a_clock_stepped_back_across_a_window_boundary_keeps_the_count() {
    for algorithm in Algorithm::ALL {
        let clock = Arc::new(ManualClock::new(T0 + SEC + 10));
        let backend = backend(100, &clock);
        let policy = Policy::new(algorithm, Unit::Second, 2);
        assert!(backend.decide_now("k", &policy).verdict.allowed);
        assert!(backend.decide_now("k", &policy).verdict.allowed);
        // The wall clock steps back 20 µs, into the previous window.
        clock.set(T0 + SEC - 10);
        let d = backend.decide_now("k", &policy);
        assert!(
            !d.verdict.allowed,
            "{algorithm}: the filled window reopened"
        );
        assert_eq!(d.verdict.remaining, 0, "{algorithm}");
    }
}

#[test]
fn concurrent_threads_never_exceed_the_limit() {
    for algorithm in Algorithm::ALL {
        let clock = Arc::new(ManualClock::new(T0 + 123));
        let backend = Arc::new(backend(1_000, &clock));
        let policy = Policy::new(algorithm, Unit::Minute, 500).with_burst(500);
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let backend = Arc::clone(&backend);
                std::thread::spawn(move || {
                    (0..2_000)
                        .filter(|_| backend.decide_now("{hot}:k", &policy).verdict.allowed)
                        .count()
                })
            })
            .collect();
        let allowed: usize = threads.into_iter().map(|t| t.join().expect("thread")).sum();
        assert_eq!(allowed, 500, "{algorithm}");
    }
}
