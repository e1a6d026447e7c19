//! In-memory backend: sharded maps behind one mutex per shard, bounded memory.
//!
//! Memory stays bounded two ways: an entry expires when its algorithm says the state is fresh
//! again (`reset`), and expired entries are swept lazily (per shard, at most once per sweep
//! interval, and whenever a shard is full); and a hard cap on entries per shard, where a full
//! shard with nothing expired evicts the entry closest to expiry among a small sample. Evicting
//! a live entry forgets its count (that key is limited a little less): the price of the cap.
//!
//! A key is hashed once per decision, with a randomly keyed hasher (keys carry request values,
//! so they must not be able to crowd one shard): some of the hash's bits pick the shard, and
//! the shard's table uses the same hash to find the entry.

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use hashbrown::HashTable;

use super::{Backend, BackendDecision, BackendError};
use crate::algorithms::{self, CounterState, Verdict};
use crate::clock::{Clock, SystemClock};
use crate::policy::Policy;

/// How many live entries to look at when a full shard must evict one.
const EVICTION_SAMPLE: usize = 8;

/// Sizing of the in-memory backend.
#[derive(Debug, Clone)]
pub struct MemoryConfig {
    /// Hard cap on the number of counters kept (split evenly over the shards).
    pub max_entries: usize,
    /// Number of independently locked shards (rounded up to a power of two).
    pub shards: usize,
    /// How often each shard drops its expired entries.
    pub sweep_interval: Duration,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            max_entries: 1_000_000,
            shards: 64,
            sweep_interval: Duration::from_secs(10),
        }
    }
}

struct Entry {
    state: CounterState,
    /// When the state becomes equivalent to a fresh one (µs).
    expires_us: u64,
}

struct Slot {
    key: Box<str>,
    /// The key's hash, kept so the table can grow without hashing the key again.
    hash: u64,
    entry: Entry,
}

#[derive(Default)]
struct Shard {
    map: HashTable<Slot>,
    next_sweep_us: u64,
}

impl Shard {
    fn sweep(&mut self, now: u64) {
        self.map.retain(|slot| slot.entry.expires_us > now);
    }

    fn evict_one(&mut self) -> bool {
        let victim = self
            .map
            .iter()
            .take(EVICTION_SAMPLE)
            .min_by_key(|slot| slot.entry.expires_us)
            .map(|slot| (slot.hash, slot.key.clone()));
        victim.is_some_and(|(hash, key)| {
            self.map
                .find_entry(hash, |slot| slot.key == key)
                .map(|found| found.remove())
                .is_ok()
        })
    }
}

/// Counters in this process's memory. Thread-safe; cheap to share behind an `Arc`.
pub struct MemoryBackend {
    shards: Box<[Mutex<Shard>]>,
    shard_mask: usize,
    per_shard_cap: usize,
    sweep_interval_us: u64,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
    evictions: AtomicU64,
}

impl MemoryBackend {
    /// A backend reading time from `clock`.
    pub fn new(config: &MemoryConfig, clock: Arc<dyn Clock>) -> Self {
        let shards = config.shards.max(1).next_power_of_two();
        let per_shard_cap = config.max_entries.max(1).div_ceil(shards);
        MemoryBackend {
            shards: (0..shards).map(|_| Mutex::default()).collect(),
            shard_mask: shards - 1,
            per_shard_cap,
            sweep_interval_us: u64::try_from(config.sweep_interval.as_micros()).unwrap_or(u64::MAX),
            hasher: RandomState::new(),
            clock,
            evictions: AtomicU64::new(0),
        }
    }

    /// A backend on the system clock.
    pub fn with_system_clock(config: &MemoryConfig) -> Self {
        Self::new(config, Arc::new(SystemClock))
    }

    /// The key's hash and its shard, locked.
    fn shard(&self, key: &str) -> (u64, MutexGuard<'_, Shard>) {
        let hash = self.hasher.hash_one(key);
        // The table finds entries by the hash's low bits and tags them with its top seven, so
        // the shard is picked by bits from the middle. Truncating to usize keeps them.
        #[allow(clippy::cast_possible_truncation)]
        let index = (hash >> 32) as usize & self.shard_mask;
        // A panic while holding a shard cannot leave a counter half-updated in a way that
        // matters more than losing it, so a poisoned lock is simply taken over.
        let shard = self.shards[index]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (hash, shard)
    }

    /// Decide at the clock's current time.
    pub fn decide_now(&self, counter_key: &str, policy: &Policy) -> BackendDecision {
        let now = self.clock.now_micros();
        BackendDecision {
            verdict: self.decide_at(counter_key, policy, now),
            clock_us: now,
        }
    }

    /// Decide at `now_us`.
    pub fn decide_at(&self, counter_key: &str, policy: &Policy, now_us: u64) -> Verdict {
        let (hash, mut shard) = self.shard(counter_key);
        if now_us >= shard.next_sweep_us {
            shard.sweep(now_us);
            shard.next_sweep_us = now_us.saturating_add(self.sweep_interval_us);
        }
        if let Some(slot) = shard
            .map
            .find_mut(hash, |slot| slot.hash == hash && *slot.key == *counter_key)
        {
            let entry = &mut slot.entry;
            if entry.expires_us <= now_us {
                entry.state = CounterState::fresh(policy.algorithm);
            }
            let verdict = algorithms::decide(policy, &mut entry.state, now_us);
            entry.expires_us = now_us.saturating_add(verdict.reset_us);
            return verdict;
        }
        let mut state = CounterState::fresh(policy.algorithm);
        let verdict = algorithms::decide(policy, &mut state, now_us);
        if verdict.reset_us == 0 {
            return verdict; // nothing worth remembering
        }
        if shard.map.len() >= self.per_shard_cap {
            shard.sweep(now_us);
            while shard.map.len() >= self.per_shard_cap && shard.evict_one() {
                self.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        shard.map.insert_unique(
            hash,
            Slot {
                key: Box::from(counter_key),
                hash,
                entry: Entry {
                    state,
                    expires_us: now_us.saturating_add(verdict.reset_us),
                },
            },
            |slot| slot.hash,
        );
        verdict
    }

    /// Number of counters currently held (expired ones not yet swept included).
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().map_or(0, |s| s.map.len()))
            .sum()
    }

    /// Whether no counter is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The hard cap on entries (per-shard cap × shards).
    pub fn capacity(&self) -> usize {
        self.per_shard_cap * self.shards.len()
    }

    /// Live entries dropped because a shard was full.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// Drop every expired entry now.
    pub fn sweep(&self) {
        let now = self.clock.now_micros();
        for shard in &self.shards {
            shard
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .sweep(now);
        }
    }
}

#[async_trait]
impl Backend for MemoryBackend {
    async fn decide(
        &self,
        counter_key: &str,
        policy: &Policy,
    ) -> Result<BackendDecision, BackendError> {
        Ok(self.decide_now(counter_key, policy))
    }

    fn name(&self) -> &'static str {
        "memory"
    }

    fn is_local(&self) -> bool {
        true
    }

    fn decide_in_process(&self, counter_key: &str, policy: &Policy) -> Option<BackendDecision> {
        Some(self.decide_now(counter_key, policy))
    }
}
