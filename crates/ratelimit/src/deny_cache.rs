//! Local cache of counters known to be over their limit, until their `retry_after`: requests to
//! such a counter are denied without a Redis round trip.
//!
//! Safe because `retry_after` is a lower bound (other traffic can only push the real time
//! later) and the entry's deadline is computed from when the request was *sent*, before the
//! server decided. Cleared whenever the rules change.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Mutex;
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
}

const SHARDS: usize = 16;

impl DenyCache {
    pub(crate) fn new(max_entries: usize) -> Self {
        DenyCache {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            per_shard_cap: max_entries.div_ceil(SHARDS).max(1),
            hasher: RandomState::new(),
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

    /// Remember that `key` is denied until `entry.retry_at`. Skipped when the shard is full of
    /// live entries (the cache is an optimisation, never needed for correctness).
    pub(crate) fn insert(&self, key: &str, entry: DenyEntry, now: Instant) {
        let mut shard = self.shard(key);
        if shard.len() >= self.per_shard_cap {
            shard.retain(|_, e| e.retry_at > now);
            if shard.len() >= self.per_shard_cap {
                return;
            }
        }
        shard.insert(Box::from(key), entry);
    }

    pub(crate) fn clear(&self) {
        for shard in &self.shards {
            shard
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clear();
        }
    }
}
