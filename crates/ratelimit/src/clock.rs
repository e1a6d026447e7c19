//! Time source for the in-memory backend: wall-clock microseconds, injectable for tests.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// A source of "now" in microseconds since the Unix epoch.
///
/// Windows are aligned to the epoch, as Redis's `TIME` is, so that the in-memory fallback and
/// Redis agree on where a fixed window starts.
pub trait Clock: Send + Sync + 'static {
    /// Microseconds since the Unix epoch.
    fn now_micros(&self) -> u64;
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_micros(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }
}

/// A clock that only moves when told to: for deterministic tests of time-based logic.
#[derive(Debug, Default)]
pub struct ManualClock {
    now: AtomicU64,
}

impl ManualClock {
    /// A clock standing at `micros`.
    pub fn new(micros: u64) -> Self {
        ManualClock {
            now: AtomicU64::new(micros),
        }
    }

    /// Move the clock to `micros`.
    pub fn set(&self, micros: u64) {
        self.now.store(micros, Ordering::SeqCst);
    }

    /// Move the clock forward by `micros`.
    pub fn advance(&self, micros: u64) {
        self.now.fetch_add(micros, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_micros(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }
}
