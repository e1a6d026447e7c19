//! Each algorithm against its definition, with an explicit clock (pure logic, no I/O).

mod common;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use ratelimit::algorithms::decide;
use ratelimit::{Algorithm, CounterState, Policy, Unit, Verdict};

const SEC: u64 = 1_000_000;
/// An arbitrary epoch-aligned start, far from zero like a real clock.
const T0: u64 = 1_700_000_000 * SEC;

fn run(policy: &Policy, state: &mut CounterState, now: u64) -> Verdict {
    decide(policy, state, now)
}

/// A random request trace: bursts and pauses, times strictly increasing, seeded.
fn random_trace(seed: u64, len: usize, mean_gap: u64) -> Vec<u64> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = T0 + rng.random_range(0..SEC);
    let mut out = Vec::with_capacity(len);
    for _ in 0..len {
        let gap = match rng.random_range(0..10) {
            0..=5 => rng.random_range(0..mean_gap / 4 + 1), // bursts
            6..=8 => rng.random_range(0..mean_gap * 2),
            _ => rng.random_range(0..mean_gap * 20), // pauses
        };
        t += gap;
        out.push(t);
    }
    out
}

/// Times of the allowed requests of `trace` under `policy`, and the verdicts.
fn replay(policy: &Policy, trace: &[u64]) -> (Vec<u64>, Vec<Verdict>) {
    let mut state = CounterState::fresh(policy.algorithm);
    let mut allowed = Vec::new();
    let mut verdicts = Vec::new();
    for &t in trace {
        let v = run(policy, &mut state, t);
        if v.allowed {
            allowed.push(t);
        }
        verdicts.push(v);
    }
    (allowed, verdicts)
}

#[test]
fn fixed_window_counts_per_aligned_window_and_resets_at_the_boundary() {
    let policy = Policy::new(Algorithm::FixedWindow, Unit::Second, 3);
    let mut state = CounterState::fresh(policy.algorithm);
    let start = T0 + 250_000; // a quarter into a window
    for i in 0..3 {
        let v = run(&policy, &mut state, start + i);
        assert!(v.allowed);
        assert_eq!(v.remaining, 2 - i);
        assert_eq!(v.reset_us, 750_000 - i);
    }
    let v = run(&policy, &mut state, start + 10);
    assert!(!v.allowed);
    assert_eq!(v.retry_after_us, 750_000 - 10);
    // One microsecond before the boundary: still the same window, still denied.
    assert!(!run(&policy, &mut state, T0 + SEC - 1).allowed);
    // At the boundary the counter is fresh.
    let v = run(&policy, &mut state, T0 + SEC);
    assert!(v.allowed);
    assert_eq!(v.remaining, 2);
    assert_eq!(v.reset_us, SEC);
}

#[test]
fn fixed_window_allows_exactly_n_per_aligned_window_over_a_random_trace() {
    let policy = Policy::new(Algorithm::FixedWindow, Unit::Second, 7);
    let trace = random_trace(11, 20_000, SEC / 20);
    let (allowed, verdicts) = replay(&policy, &trace);
    let per_window = common::per_aligned_window(&allowed, SEC);
    assert!(per_window.values().all(|&c| c <= 7));
    // Every denial happened in a window that was already full.
    for (t, v) in trace.iter().zip(&verdicts) {
        if !v.allowed {
            assert_eq!(per_window[&(t / SEC)], 7);
        }
    }
}

#[test]
fn sliding_log_never_allows_more_than_n_in_any_window() {
    for seed in 0..20 {
        let n = 1 + seed % 9;
        let policy = Policy::new(Algorithm::SlidingLog, Unit::Second, n);
        let trace = random_trace(seed, 5_000, SEC / n / 2);
        let (allowed, verdicts) = replay(&policy, &trace);
        assert!(
            common::max_in_any_window(&allowed, SEC) <= n as usize,
            "seed {seed}: more than {n} in a window"
        );
        // And it is not stricter than the definition: every denied request had exactly n
        // allowed requests in (t - W, t].
        for (t, v) in trace.iter().zip(&verdicts) {
            if !v.allowed {
                let in_window = allowed.iter().filter(|&&a| a + SEC > *t && a <= *t).count();
                assert_eq!(in_window, n as usize, "seed {seed}: needless denial at {t}");
            }
        }
    }
}

#[test]
fn sliding_log_does_not_log_rejected_requests() {
    // The seed's variant logs rejections too, so a client that keeps retrying stays locked out.
    let policy = Policy::new(Algorithm::SlidingLog, Unit::Second, 2);
    let mut state = CounterState::fresh(policy.algorithm);
    assert!(run(&policy, &mut state, T0).allowed);
    assert!(run(&policy, &mut state, T0 + 100).allowed);
    for i in 0..100 {
        assert!(!run(&policy, &mut state, T0 + 200 + i * 1000).allowed);
    }
    // One window after the first allowed request, a slot is free despite the retries.
    assert!(run(&policy, &mut state, T0 + SEC).allowed);
    let CounterState::SlidingLog(log) = &state else {
        panic!("state of another algorithm");
    };
    assert_eq!(log.log.len(), 2);
}

#[test]
fn token_bucket_allows_the_burst_then_the_refill_rate() {
    // 10 per second, burst 5: one token every 100 ms.
    let policy = Policy::new(Algorithm::TokenBucket, Unit::Second, 10).with_burst(5);
    let mut state = CounterState::fresh(policy.algorithm);
    for i in 0..5 {
        let v = run(&policy, &mut state, T0);
        assert!(v.allowed, "burst request {i}");
        assert_eq!(v.remaining, 4 - i);
    }
    let v = run(&policy, &mut state, T0);
    assert!(!v.allowed);
    assert_eq!(v.retry_after_us, 100_000);
    assert_eq!(v.reset_us, 500_000, "empty bucket refills in 5 × 100 ms");
    assert!(!run(&policy, &mut state, T0 + 99_999).allowed);
    assert!(run(&policy, &mut state, T0 + 100_000).allowed);
    assert!(!run(&policy, &mut state, T0 + 100_001).allowed);
    // Steady state: exactly one per 100 ms over 10 seconds.
    let mut passed = 0;
    for step in 1..=1000 {
        if run(&policy, &mut state, T0 + 100_000 + step * 10_000).allowed {
            passed += 1;
        }
    }
    assert_eq!(passed, 100);
    // Idle long enough and the full burst is back, no more.
    let later = T0 + 100 * SEC;
    let allowed = (0..10)
        .filter(|_| run(&policy, &mut state, later).allowed)
        .count();
    assert_eq!(allowed, 5);
}

#[test]
fn leaky_bucket_drains_at_its_rate() {
    // Capacity 4, drains 2 per second: one slot every 500 ms.
    let policy = Policy::new(Algorithm::LeakyBucket, Unit::Second, 2).with_burst(4);
    let mut state = CounterState::fresh(policy.algorithm);
    for _ in 0..4 {
        assert!(run(&policy, &mut state, T0).allowed);
    }
    let v = run(&policy, &mut state, T0);
    assert!(!v.allowed);
    assert_eq!(v.retry_after_us, 500_000);
    assert_eq!(v.reset_us, 2 * SEC, "a full bucket of 4 drains in 2 s");
    // Half a second later exactly one request fits again.
    assert!(run(&policy, &mut state, T0 + 500_000).allowed);
    assert!(!run(&policy, &mut state, T0 + 500_000).allowed);
    // After the full drain time the bucket is empty and holds the whole capacity.
    let v = run(&policy, &mut state, T0 + 500_000 + 2 * SEC);
    assert!(v.allowed);
    assert_eq!(v.remaining, 3);
}

#[test]
fn buckets_never_exceed_burst_plus_rate_over_any_interval() {
    for algorithm in [Algorithm::TokenBucket, Algorithm::LeakyBucket] {
        for seed in 0..10 {
            let (n, b) = (3 + seed % 5, 1 + seed % 7);
            let policy = Policy::new(algorithm, Unit::Second, n).with_burst(b);
            let trace = random_trace(100 + seed, 3_000, SEC / n);
            let (allowed, _) = replay(&policy, &trace);
            for i in 0..allowed.len() {
                for j in i..allowed.len().min(i + 200) {
                    let span = allowed[j] - allowed[i];
                    let bound = b + span * n / SEC;
                    assert!(
                        (j - i + 1) as u64 <= bound,
                        "{algorithm} seed {seed}: {} allowed in {span} µs",
                        j - i + 1
                    );
                }
            }
        }
    }
}

#[test]
fn leaky_bucket_meter_decides_like_the_token_bucket() {
    let token = Policy::new(Algorithm::TokenBucket, Unit::Minute, 30).with_burst(8);
    let leaky = Policy::new(Algorithm::LeakyBucket, Unit::Minute, 30).with_burst(8);
    let trace = random_trace(7, 10_000, 60 * SEC / 30);
    let (_, a) = replay(&token, &trace);
    let (_, b) = replay(&leaky, &trace);
    assert_eq!(a, b);
}

/// Limits lowered by a rules reload, as (requests_per_unit, burst) before and after: the rate
/// and capacity together, and a bucket's burst alone.
const LOWERED: [((u64, u64), (u64, u64)); 2] = [((10, 10), (3, 3)), ((10, 10), (10, 3))];

#[test]
fn a_limit_lowered_by_a_reload_refuses_with_nothing_remaining() {
    // A reload keeps each key's state, so a count or level built under the old limit can exceed
    // the new one. The key is refused, says nothing remains, and retry_after stays exact.
    for algorithm in Algorithm::ALL {
        for ((n0, b0), (n1, b1)) in LOWERED {
            if n0 == n1 && !algorithm.has_burst() {
                continue;
            }
            let before = Policy::new(algorithm, Unit::Minute, n0).with_burst(b0);
            let after = Policy::new(algorithm, Unit::Minute, n1).with_burst(b1);
            let mut state = CounterState::fresh(algorithm);
            for i in 0..n0 {
                assert!(run(&before, &mut state, T0 + i).allowed, "{algorithm}");
            }
            let t = T0 + 100;
            let snapshot = state.clone();
            let v = run(&after, &mut state, t);
            assert!(!v.allowed, "{algorithm} {after:?}");
            assert_eq!(v.remaining, 0, "{algorithm} {after:?}");
            let mut probe = snapshot.clone();
            let early = run(&after, &mut probe, t + v.retry_after_us - 1);
            assert!(!early.allowed, "{algorithm}: passes before retry_after");
            let mut probe = snapshot;
            let on_time = run(&after, &mut probe, t + v.retry_after_us);
            assert!(on_time.allowed, "{algorithm}: retry_after too early");
        }
    }
}

#[test]
fn a_clock_stepped_back_across_a_window_boundary_keeps_the_count() {
    // A wall clock stepped back (NTP) must not reopen a filled key: a key's time never goes
    // backwards. reset and retry_after are measured from the stepped-back clock and stay exact.
    for algorithm in Algorithm::ALL {
        let policy = Policy::new(algorithm, Unit::Second, 3).with_burst(3);
        let mut state = CounterState::fresh(algorithm);
        for i in 0..3 {
            assert!(run(&policy, &mut state, T0 + SEC + 10 + i).allowed);
        }
        // Back across one boundary, just and by most of a window, and across two.
        for back in [T0 + SEC - 10, T0 + 1, T0 - SEC / 2] {
            let mut stepped = state.clone();
            let v = run(&policy, &mut stepped, back);
            assert!(!v.allowed, "{algorithm}: reopened at {back}");
            assert_eq!(v.remaining, 0, "{algorithm} at {back}");
            let mut probe = state.clone();
            let early = run(&policy, &mut probe, back + v.retry_after_us - 1);
            assert!(
                !early.allowed,
                "{algorithm} at {back}: passes before retry_after"
            );
            let mut probe = state.clone();
            let on_time = run(&policy, &mut probe, back + v.retry_after_us);
            assert!(
                on_time.allowed,
                "{algorithm} at {back}: retry_after too early"
            );
            let at = back + v.reset_us;
            let mut fresh = CounterState::fresh(algorithm);
            let a: Vec<bool> = (0..6)
                .map(|i| run(&policy, &mut stepped, at + i).allowed)
                .collect();
            let b: Vec<bool> = (0..6)
                .map(|i| run(&policy, &mut fresh, at + i).allowed)
                .collect();
            assert_eq!(a, b, "{algorithm} at {back}: not fresh at reset");
        }
    }
}

#[test]
fn sliding_window_stays_within_its_documented_bound() {
    // Documented bound: in any window (t - W, t], with t at e µs into its aligned window and p
    // allowed in the previous aligned window: allowed <= N + p * e / W (so < 2N), and at most N
    // in every aligned window.
    let check = |policy: &Policy, trace: &[u64]| -> f64 {
        let n = policy.requests_per_unit;
        let w = policy.window_micros();
        let (allowed, _) = replay(policy, trace);
        common::assert_sliding_window_bound(&allowed, n, w)
    };
    for seed in 0..20 {
        let n = 5 + seed % 20;
        let policy = Policy::new(Algorithm::SlidingWindow, Unit::Second, n);
        check(&policy, &random_trace(200 + seed, 5_000, SEC / n));
    }
    // The adversarial case: the previous window filled in its last moment, then steady
    // traffic. The bound is approached but never crossed.
    let n = 100;
    let policy = Policy::new(Algorithm::SlidingWindow, Unit::Second, n);
    let mut trace: Vec<u64> = (0..n).map(|i| T0 + SEC - 100 + i).collect();
    trace.extend((0..20_000).map(|i| T0 + SEC + i * 50));
    let worst = check(&policy, &trace);
    assert!(
        worst > 1.5,
        "the adversarial trace should show the error ({worst})"
    );
}

#[test]
fn retry_after_is_exactly_the_earliest_time_a_retry_passes() {
    // Lower bound (never later than necessary) and tight (not earlier either), for every
    // algorithm, on random traces: a denial's retry_after is safe for the deny cache.
    for algorithm in Algorithm::ALL {
        for seed in 0..5 {
            let n = 2 + seed % 4;
            let policy = Policy::new(algorithm, Unit::Second, n).with_burst(n);
            let mut state = CounterState::fresh(algorithm);
            let mut denials = 0;
            for t in random_trace(300 + seed, 2_000, SEC / n / 2) {
                let before = state.clone();
                let v = run(&policy, &mut state, t);
                if v.allowed {
                    continue;
                }
                denials += 1;
                assert!(v.retry_after_us > 0, "{algorithm}");
                let mut probe = before.clone();
                let early = run(&policy, &mut probe, t + v.retry_after_us - 1);
                assert!(
                    !early.allowed,
                    "{algorithm} seed {seed}: passes 1 µs before retry_after"
                );
                let mut probe = before;
                let on_time = run(&policy, &mut probe, t + v.retry_after_us);
                assert!(
                    on_time.allowed,
                    "{algorithm} seed {seed}: retry_after too early"
                );
            }
            assert!(
                denials > 10,
                "{algorithm}: the trace should provoke denials"
            );
        }
    }
}

#[test]
fn reset_is_when_the_state_is_fresh_again() {
    // After `reset_us`, a key behaves exactly like a key never seen: that is what lets both
    // backends drop (expire) state at that moment.
    for algorithm in Algorithm::ALL {
        let policy = Policy::new(algorithm, Unit::Second, 4).with_burst(4);
        for seed in 0..5 {
            let mut state = CounterState::fresh(algorithm);
            let mut last = Verdict {
                allowed: true,
                remaining: 0,
                reset_us: 0,
                retry_after_us: 0,
            };
            let trace = random_trace(400 + seed, 50, SEC / 8);
            let end = *trace.last().expect("non-empty");
            for t in trace {
                last = run(&policy, &mut state, t);
            }
            let at = end + last.reset_us;
            let mut fresh = CounterState::fresh(algorithm);
            let a: Vec<bool> = (0..6)
                .map(|i| run(&policy, &mut state, at + i).allowed)
                .collect();
            let b: Vec<bool> = (0..6)
                .map(|i| run(&policy, &mut fresh, at + i).allowed)
                .collect();
            assert_eq!(a, b, "{algorithm} seed {seed}");
        }
    }
}
