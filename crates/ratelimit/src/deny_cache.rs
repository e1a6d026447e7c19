//! Local cache of counters known to be over their limit, until their `retry_after`: requests to
//! such a counter are denied without a Redis round trip.
//!
//! Safe because `retry_after` is a lower bound (other traffic can only push the real time
//! later) and the entry's deadline is computed from when the request was *sent*, before the
//! server decided. Cleared whenever the rules change, and a decision made under rules read
//! before a change is not cached after it ([`DenyCache::generation`]).

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What is known about a counter that is over its limit.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DenyEntry {
    pub(crate) retry_at: Instant,
    pub(crate) reset_at: Instant,
    pub(crate) limit: u64,
}

/// One lock's share of the entries.
#[derive(Default)]
struct Shard {
    entries: HashMap<Box<str>, DenyEntry>,
    /// When a full shard may next be swept for expired entries: not before the earliest
    /// `retry_at` among its entries (nothing to remove until then), nor sooner than
    /// [`MIN_SWEEP_INTERVAL`] after the last sweep. `None`: sweep when full.
    next_sweep_at: Option<Instant>,
}

pub(crate) struct DenyCache {
    shards: Box<[Mutex<Shard>]>,
    per_shard_cap: usize,
    hasher: RandomState,
    /// Bumped by every [`DenyCache::clear`], before the shards are emptied.
    generation: AtomicU64,
    /// Sweeps of full shards so far (each a pass over one shard's entries).
    sweeps: AtomicU64,
}

const SHARDS: usize = 16;

/// The least time between two sweeps of one full shard. A shard full of entries that expire
/// one after another would otherwise be swept by every insert, each pass over all its entries
/// under its lock: a flood of distinct denied keys could make every denial cost that much.
const MIN_SWEEP_INTERVAL: Duration = Duration::from_millis(50);

impl DenyCache {
    pub(crate) fn new(max_entries: usize) -> Self {
        DenyCache {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            per_shard_cap: max_entries.div_ceil(SHARDS).max(1),
            hasher: RandomState::new(),
            generation: AtomicU64::new(0),
            sweeps: AtomicU64::new(0),
        }
    }

    /// Sweeps of full shards so far.
    #[cfg(test)]
    fn sweeps(&self) -> u64 {
        self.sweeps.load(Ordering::Relaxed)
    }

    fn shard(&self, key: &str) -> std::sync::MutexGuard<'_, Shard> {
        #[allow(clippy::cast_possible_truncation)]
        let index = self.hasher.hash_one(key) as usize % SHARDS;
        self.shards[index]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The entry for `key` if it is still in force at `now`.
    pub(crate) fn get(&self, key: &str, now: Instant) -> Option<DenyEntry> {
        let mut shard = self.shard(key);
        match shard.entries.get(key) {
            Some(entry) if entry.retry_at > now => Some(*entry),
            Some(_) => {
                shard.entries.remove(key);
                None
            }
            None => None,
        }
    }

    /// The current generation. A caller reads it *before* the rules it decides under, and
    /// hands it to [`DenyCache::insert`]: a clear since then (the rules changed, perhaps under
    /// it) makes the insert a no-op.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Remember that `key` is denied until `entry.retry_at`, if the cache has not been cleared
    /// since `generation`. Skipped when the shard is full of live entries (the cache is an
    /// optimisation, never needed for correctness); a full shard is swept for expired entries
    /// at most once per [`MIN_SWEEP_INTERVAL`], and not before one can have expired.
    pub(crate) fn insert(&self, key: &str, entry: DenyEntry, now: Instant, generation: u64) {
        let mut shard = self.shard(key);
        // Checked under the shard's lock: a clear that bumps the generation after this check
        // empties this shard only once this insert is done.
        if self.generation() != generation {
            return;
        }
        if shard.entries.len() >= self.per_shard_cap && !shard.entries.contains_key(key) {
            if shard.next_sweep_at.is_some_and(|at| now < at) {
                return;
            }
            self.sweeps.fetch_add(1, Ordering::Relaxed);
            let mut earliest: Option<Instant> = None;
            shard.entries.retain(|_, e| {
                let live = e.retry_at > now;
                if live {
                    earliest = Some(earliest.map_or(e.retry_at, |t| t.min(e.retry_at)));
                }
                live
            });
            shard.next_sweep_at = earliest.map(|t| t.max(now + MIN_SWEEP_INTERVAL));
            if shard.entries.len() >= self.per_shard_cap {
                return;
            }
        }
        shard.next_sweep_at = shard
            .next_sweep_at
            .map(|at| at.min(entry.retry_at.max(now + MIN_SWEEP_INTERVAL)));
        shard.entries.insert(Box::from(key), entry);
    }

    pub(crate) fn clear(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        for shard in &self.shards {
            shard
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .entries
                .clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(retry_at: Instant) -> DenyEntry {
        DenyEntry {
            retry_at,
            reset_at: retry_at,
            limit: 1,
        }
    }

    /// A cache of `SHARDS` entries: each shard holds one.
    fn one_per_shard() -> DenyCache {
        DenyCache::new(SHARDS)
    }

    /// Fills every shard of `cache` with a live entry; returns their keys.
    fn fill(cache: &DenyCache, now: Instant, retry_at: Instant) -> Vec<String> {
        let mut keys = Vec::new();
        let mut n = 0;
        while keys.len() < SHARDS * 64 && cache.len() < SHARDS {
            let key = format!("k{n}");
            n += 1;
            cache.insert(&key, entry(retry_at), now, cache.generation());
            keys.push(key);
        }
        assert_eq!(cache.len(), SHARDS, "every shard filled");
        keys
    }

    impl DenyCache {
        fn len(&self) -> usize {
            self.shards
                .iter()
                .map(|s| s.lock().expect("shard").entries.len())
                .sum()
        }
    }

    #[test]
    fn a_full_cache_of_live_entries_is_not_swept_by_every_insert() {
        let cache = one_per_shard();
        let now = Instant::now();
        fill(&cache, now, now + Duration::from_secs(60));
        let before = cache.sweeps();
        // A flood of new denied keys while every entry is live: each shard is swept at most
        // once (when it first fills), then inserts are skipped without a pass.
        for n in 0..10_000 {
            cache.insert(
                &format!("flood{n}"),
                entry(now + Duration::from_secs(60)),
                now + Duration::from_millis(n % 40),
                cache.generation(),
            );
        }
        assert!(
            cache.sweeps() - before <= SHARDS as u64,
            "{} sweeps",
            cache.sweeps() - before
        );
        assert_eq!(cache.len(), SHARDS);
    }

    #[test]
    fn expired_entries_make_room_once_they_can_have_expired() {
        let cache = one_per_shard();
        let now = Instant::now();
        let keys = fill(&cache, now, now + Duration::from_millis(100));
        // Full and live: the newcomer waits.
        cache.insert(
            "late",
            entry(now + Duration::from_secs(60)),
            now,
            cache.generation(),
        );
        assert!(cache.get("late", now).is_none());
        // After the entries' retry_at: a sweep removes them and the newcomer is kept.
        let later = now + Duration::from_millis(200);
        cache.insert(
            "late",
            entry(now + Duration::from_secs(60)),
            later,
            cache.generation(),
        );
        assert!(cache.get("late", later).is_some());
        assert!(keys.iter().all(|k| cache.get(k, later).is_none()));
    }

    #[test]
    fn a_denied_key_already_cached_is_updated_in_a_full_shard() {
        let cache = one_per_shard();
        let now = Instant::now();
        let keys = fill(&cache, now, now + Duration::from_secs(1));
        let later = now + Duration::from_secs(30);
        cache.insert(&keys[0], entry(later), now, cache.generation());
        assert_eq!(cache.get(&keys[0], now).map(|e| e.retry_at), Some(later));
    }

    #[test]
    fn an_insert_decided_before_a_clear_is_dropped() {
        let cache = one_per_shard();
        let now = Instant::now();
        let generation = cache.generation();
        cache.clear();
        cache.insert("k", entry(now + Duration::from_secs(1)), now, generation);
        assert!(cache.get("k", now).is_none());
        cache.insert(
            "k",
            entry(now + Duration::from_secs(1)),
            now,
            cache.generation(),
        );
        assert!(cache.get("k", now).is_some());
    }
}
