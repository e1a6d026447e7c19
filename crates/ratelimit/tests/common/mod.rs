//! Helpers shared by the integration tests: Redis address, unique key prefixes, a private
//! `redis-server`, and the invariant checks run on traces of server-timestamped decisions.
#![allow(dead_code, unreachable_pub)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The Redis the tests use: `REDIS_URL`, else the local default.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A key prefix no other test (or test run) uses.
pub fn unique_prefix(test: &str) -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after epoch")
        .as_nanos();
    format!(
        "test:rl:{test}:{}:{nanos}:{}:",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// A directory of its own under the system temp dir.
pub fn temp_dir(test: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(unique_prefix(test).replace(':', "_"));
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

/// A `redis-server` started by the test on a free port, killed on drop. Its working folder is
/// a temporary one of its own: it keeps nothing on disk, but a replication (`REPLICAOF`) still
/// writes a `dump.rdb` there.
pub struct PrivateRedis {
    pub port: u16,
    dir: std::path::PathBuf,
    child: Option<Child>,
}

impl PrivateRedis {
    /// Start one on a free port and wait until it answers.
    pub fn start() -> PrivateRedis {
        let port = TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr")
            .port();
        let dir = temp_dir("redis-server");
        let mut redis = PrivateRedis {
            port,
            dir,
            child: None,
        };
        redis.restart();
        redis
    }

    /// The server's process id (to stop and continue it).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// (Re)start the server on the same port.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "already running");
        let child = Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .current_dir(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", self.port)) {
                use std::io::{Read, Write};
                let mut buf = [0u8; 7];
                if stream.write_all(b"PING\r\n").is_ok()
                    && stream.read_exact(&mut buf).is_ok()
                    && &buf == b"+PONG\r\n"
                {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kill the server (SIGKILL) and wait for it to be gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One decision as seen in a trace: the backend's clock and whether it passed.
#[derive(Debug, Clone, Copy)]
pub struct Event {
    pub at_us: u64,
    pub allowed: bool,
}

/// Allowed timestamps, sorted.
pub fn allowed_times(events: &[Event]) -> Vec<u64> {
    let mut t: Vec<u64> = events
        .iter()
        .filter(|e| e.allowed)
        .map(|e| e.at_us)
        .collect();
    t.sort_unstable();
    t
}

/// Most allowed in any window `(t - w, t]`.
pub fn max_in_any_window(allowed: &[u64], w: u64) -> usize {
    let mut best = 0;
    let mut lo = 0;
    for hi in 0..allowed.len() {
        while allowed[lo] + w <= allowed[hi] {
            lo += 1;
        }
        best = best.max(hi - lo + 1);
    }
    best
}

/// Allowed per aligned window index.
pub fn per_aligned_window(allowed: &[u64], w: u64) -> std::collections::BTreeMap<u64, u64> {
    let mut m = std::collections::BTreeMap::new();
    for t in allowed {
        *m.entry(t / w).or_insert(0) += 1;
    }
    m
}

/// Panics unless no more than `burst + rate × span` were allowed over any span.
pub fn assert_bucket_bound(allowed: &[u64], n: u64, w: u64, burst: u64) {
    for i in 0..allowed.len() {
        for j in i..allowed.len() {
            let span = allowed[j] - allowed[i];
            let bound = burst
                + u64::try_from(u128::from(span) * u128::from(n) / u128::from(w)).expect("fits");
            if (j - i + 1) as u64 > bound {
                panic!("{} allowed within {span} µs, bound {bound}", j - i + 1);
            }
            if span > w * 4 {
                break;
            }
        }
    }
}

/// Panics unless the sliding-window counter's documented bound holds: in any `(t - W, t]`
/// ending `e` µs into its aligned window, allowed ≤ N + p·e/W (p: previous aligned window), so
/// fewer than 2N. Returns the worst window's count as a multiple of N.
pub fn assert_sliding_window_bound(allowed: &[u64], n: u64, w: u64) -> f64 {
    let per_window = per_aligned_window(allowed, w);
    assert!(per_window.values().all(|&c| c <= n), "{per_window:?}");
    let mut worst_ratio: f64 = 0.0;
    let mut lo = 0;
    for hi in 0..allowed.len() {
        let t = allowed[hi];
        while allowed[lo] + w <= t {
            lo += 1;
        }
        let count = (hi - lo + 1) as u64;
        let p = per_window.get(&(t / w - 1)).copied().unwrap_or(0);
        let e = t % w;
        assert!(
            u128::from(count) * u128::from(w) <= u128::from(n * w) + u128::from(p * e),
            "{count} allowed in the window ending at {t} (p = {p}, e = {e})"
        );
        assert!(count < 2 * n);
        worst_ratio = worst_ratio.max(count as f64 / n as f64);
    }
    worst_ratio
}
