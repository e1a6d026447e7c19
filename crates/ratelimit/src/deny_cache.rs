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
use std::time::Instant;

/// What is known about a counter that is over its limit.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DenyEntry {
    pub(crate) retry_at: Instant,
    pub(crate) reset_at: Instant,
    pub(crate) limit: u64,
}

type Shard = HashMap<Box<str>, DenyEntry>;

pub(crate) struct DenyCache {
    shards: Box<[Mutex<Shard>]>,
    per_shard_cap: usize,
    hasher: RandomState,
    /// Bumped by every [`DenyCache::clear`], before the shards are emptied.
    generation: AtomicU64,
}

const SHARDS: usize = 16;

impl DenyCache {
    pub(crate) fn new(max_entries: usize) -> Self {
        DenyCache {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            per_shard_cap: max_entries.div_ceil(SHARDS).max(1),
            hasher: RandomState::new(),
            generation: AtomicU64::new(0),
        }
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
        match shard.get(key) {
            Some(entry) if entry.retry_at > now => Some(*entry),
            Some(_) => {
                shard.remove(key);
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
    /// optimisation, never needed for correctness).
    pub(crate) fn insert(&self, key: &str, entry: DenyEntry, now: Instant, generation: u64) {
        let mut shard = self.shard(key);
        // Checked under the shard's lock: a clear that bumps the generation after this check
        // empties this shard only once this insert is done.
        if self.generation() != generation {
            return;
        }
        if shard.len() >= self.per_shard_cap {
            shard.retain(|_, e| e.retry_at > now);
            if shard.len() >= self.per_shard_cap {
                return;
            }
        }
        shard.insert(Box::from(key), entry);
    }

    pub(crate) fn clear(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        for shard in &self.shards {
            shard
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clear();
        }
    }
}
