//! Helpers the benchmarks share: the machine's pgbench single-row INSERT rate as a reference, a
//! checkpoint before write phases, how the machine's CPU time was spent during a phase, the CPU
//! time this process and PostgreSQL used, and the median of rounds.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use sqlx::PgPool;

use crate::TestDb;

/// The whole number in environment variable `name`, or `default` when it is unset or not one:
/// the benchmarks' knobs.
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The middle value (the mean of the two middle ones for an even count); sorts `values`. A
/// benchmark that alternates two phases for several rounds reports the median of their ratios.
pub fn median(values: &mut [f64]) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(values[n / 2]),
        _ => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
    }
}

/// A scratch database and script for pgbench's one-row INSERT transactions.
pub struct PgbenchTarget {
    db: TestDb,
    script: PathBuf,
}

impl PgbenchTarget {
    pub async fn new() -> PgbenchTarget {
        let db = TestDb::new().await;
        sqlx::query("CREATE TABLE pgbench_insert_target (id bigserial PRIMARY KEY, payload text)")
            .execute(&db.pool)
            .await
            .expect("creating pgbench's table");
        let script = std::env::temp_dir().join(format!(
            "fairlane-pgbench-{}-{}.sql",
            std::process::id(),
            db.name
        ));
        std::fs::write(
            &script,
            "INSERT INTO pgbench_insert_target (payload) VALUES ('x');\n",
        )
        .expect("writing pgbench's script");
        PgbenchTarget { db, script }
    }

    /// Runs pgbench (8 clients, 2 threads) for `seconds` after a checkpoint.
    pub async fn run(&self, seconds: u64) -> PgbenchRun {
        checkpoint(&self.db.pool).await;
        let before = CpuTimes::read();
        let output = Command::new("pgbench")
            .args(["-n", "-c", "8", "-j", "2", "-T", &seconds.to_string(), "-f"])
            .arg(&self.script)
            .arg(libpq_url(&self.db.url()))
            .output();
        PgbenchRun {
            rate: rate(output),
            cpu: CpuShare::since(before),
        }
    }
}

/// What one pgbench run measured.
#[derive(Debug, Clone)]
pub struct PgbenchRun {
    /// Transactions of one row per second, or why there is no rate.
    pub rate: Result<f64, String>,
    /// The machine's CPU while pgbench ran (none where `/proc/stat` cannot be read).
    pub cpu: Option<CpuShare>,
}

/// The rate pgbench printed, or why there is none.
fn rate(output: std::io::Result<std::process::Output>) -> Result<f64, String> {
    match output {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.trim().strip_prefix("tps = "))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|tps| tps.parse().ok())
            .ok_or_else(|| "pgbench printed no tps".into()),
        Ok(out) => Err(format!(
            "pgbench failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Err(format!("pgbench not available: {e}")),
    }
}

impl Drop for PgbenchTarget {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.script);
    }
}

/// sqlx adds its own parameters to URLs; libpq tools refuse them.
fn libpq_url(url: &str) -> String {
    url.split('?').next().unwrap_or(url).to_owned()
}

/// Forces a checkpoint so that each write phase starts from the same state: a checkpoint that
/// happens to begin during a phase (PostgreSQL starts them by time and WAL volume) makes the
/// next write of every page carry a full-page image, which can cost that phase a third of its
/// rate.
#[allow(clippy::print_stderr)] // benchmarks report to the terminal
pub async fn checkpoint(pool: &PgPool) {
    if let Err(e) = sqlx::query("CHECKPOINT").execute(pool).await {
        eprintln!("CHECKPOINT failed ({e}); the numbers may vary more between runs");
    }
}

/// The machine's CPU time counters from the first line of `/proc/stat` (Linux), in ticks.
#[derive(Debug, Clone, Copy)]
pub struct CpuTimes {
    idle: u64,
    steal: u64,
    total: u64,
}

impl CpuTimes {
    /// The counters now (none where `/proc/stat` cannot be read).
    pub fn read() -> Option<CpuTimes> {
        CpuTimes::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    fn parse(stat: &str) -> Option<CpuTimes> {
        let fields: Vec<u64> = stat
            .lines()
            .next()?
            .strip_prefix("cpu ")?
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        // user nice system idle iowait irq softirq steal; guest time is already in user.
        let field = |i: usize| fields.get(i).copied().unwrap_or(0);
        Some(CpuTimes {
            idle: field(3) + field(4),
            steal: field(7),
            total: (0..8).map(field).sum(),
        })
    }
}

/// How the machine's CPU time was spent between two readings, in per cent of all CPUs' time.
/// "Stolen" is time the virtual machine's host gave to others: on a shared host it comes and
/// goes by the minute and slows every phase it falls in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpuShare {
    pub busy: f64,
    pub idle: f64,
    pub stolen: f64,
}

impl CpuShare {
    pub fn between(before: CpuTimes, after: CpuTimes) -> CpuShare {
        let total = after.total.saturating_sub(before.total).max(1) as f64;
        let idle = after.idle.saturating_sub(before.idle) as f64 * 100.0 / total;
        let stolen = after.steal.saturating_sub(before.steal) as f64 * 100.0 / total;
        CpuShare {
            busy: 100.0 - idle - stolen,
            idle,
            stolen,
        }
    }

    /// The share from `before` until now (none where `/proc/stat` cannot be read).
    pub fn since(before: Option<CpuTimes>) -> Option<CpuShare> {
        Some(CpuShare::between(before?, CpuTimes::read()?))
    }
}

impl std::fmt::Display for CpuShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "busy {:.0} %, idle {:.0} %, stolen {:.0} %",
            self.busy, self.idle, self.stolen
        )
    }
}

/// User and system CPU seconds in a `/proc/<pid>/stat` line.
fn stat_seconds(stat: &str) -> Option<f64> {
    let after = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

/// CPU seconds used so far by each `postgres` process on the machine, by pid (from `/proc`).
fn postgres_cpu_by_pid() -> BTreeMap<u32, f64> {
    let mut by_pid = BTreeMap::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let path = e.path();
            if !std::fs::read_to_string(path.join("comm")).is_ok_and(|c| c.trim() == "postgres") {
                continue;
            }
            if let Some(seconds) = std::fs::read_to_string(path.join("stat"))
                .ok()
                .and_then(|s| stat_seconds(&s))
            {
                by_pid.insert(pid, seconds);
            }
        }
    }
    by_pid
}

/// CPU seconds each process in `after` used since `before`: one that started in between counts
/// from zero; one that ended in between is not in `after` and counts nothing.
fn used_since<'a>(
    before: &'a BTreeMap<u32, f64>,
    after: &'a BTreeMap<u32, f64>,
) -> impl Iterator<Item = f64> + 'a {
    after
        .iter()
        .map(|(pid, seconds)| (seconds - before.get(pid).copied().unwrap_or(0.0)).max(0.0))
}

/// The largest share of one core (0.0 to 1.0) that a single process used between two readings
/// of CPU seconds by pid, `elapsed_seconds` apart ([`used_since`]). `None` without readings.
fn busiest_process_share(
    before: &BTreeMap<u32, f64>,
    after: &BTreeMap<u32, f64>,
    elapsed_seconds: f64,
) -> Option<f64> {
    if elapsed_seconds <= 0.0 {
        return None;
    }
    used_since(before, after)
        .max_by(f64::total_cmp)
        .map(|used| used / elapsed_seconds)
}

/// The CPU time used so far by this process and by each `postgres` process on the machine, read
/// once from `/proc`, for benchmarks that report where a phase's time went.
#[derive(Debug, Clone)]
pub struct CpuSnapshot {
    taken: Instant,
    own: f64,
    postgres_by_pid: BTreeMap<u32, f64>,
}

impl CpuSnapshot {
    pub fn take() -> CpuSnapshot {
        let own = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| stat_seconds(&s))
            .unwrap_or(0.0);
        CpuSnapshot {
            taken: Instant::now(),
            own,
            postgres_by_pid: postgres_cpu_by_pid(),
        }
    }

    /// CPU seconds this process used since `before`.
    pub fn own_seconds_since(&self, before: &CpuSnapshot) -> f64 {
        self.own - before.own
    }

    /// CPU seconds all `postgres` processes used since `before`, process by process: one that
    /// started since counts whole, and one that ended since counts nothing. (A difference of
    /// totals would subtract what a process that ended had used before `before`, such as the
    /// backends of a pgbench run that were still closing, and could go below zero.)
    pub fn postgres_seconds_since(&self, before: &CpuSnapshot) -> f64 {
        used_since(&before.postgres_by_pid, &self.postgres_by_pid).sum()
    }

    /// The share of one core (0.0 to 1.0) the busiest `postgres` process used since `before`.
    /// One backend near a whole core means the work it serves cannot go faster however idle
    /// the rest of the machine is.
    pub fn busiest_postgres_share_since(&self, before: &CpuSnapshot) -> Option<f64> {
        busiest_process_share(
            &before.postgres_by_pid,
            &self.postgres_by_pid,
            self.taken.duration_since(before.taken).as_secs_f64(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postgres_cpu_since_counts_each_process_once_and_never_goes_below_zero() {
        let taken = Instant::now();
        let before = CpuSnapshot {
            taken,
            own: 10.0,
            // 2 ends before the second reading, after using 3 s.
            postgres_by_pid: BTreeMap::from([(1, 5.0), (2, 3.0)]),
        };
        let after = CpuSnapshot {
            taken,
            own: 12.5,
            // 3 started in between.
            postgres_by_pid: BTreeMap::from([(1, 6.5), (3, 0.5)]),
        };
        assert_eq!(after.own_seconds_since(&before), 2.5);
        // Totals would give 7.0 - 8.0 = -1.0.
        assert_eq!(after.postgres_seconds_since(&before), 2.0);
    }

    #[test]
    fn cpu_share_splits_the_ticks_between_two_readings() {
        let before = CpuTimes::parse("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3\n").unwrap();
        // +60 user, +10 system, +20 idle, +0 iowait, +10 steal = 100 ticks.
        let after = CpuTimes::parse("cpu  160 0 60 820 50 0 0 10 0 0\n").unwrap();
        let share = CpuShare::between(before, after);
        assert_eq!(
            share,
            CpuShare {
                busy: 70.0,
                idle: 20.0,
                stolen: 10.0
            }
        );
        assert_eq!(share.to_string(), "busy 70 %, idle 20 %, stolen 10 %");
    }

    #[test]
    fn the_busiest_process_is_the_one_that_used_most_cpu_between_readings() {
        let before = BTreeMap::from([(10, 5.0), (11, 1.0), (12, 9.0)]);
        // 10 used 3 s, 11 used 1 s, 12 is gone, 13 started and used 2 s: over 4 s, 10 had 75 %.
        let after = BTreeMap::from([(10, 8.0), (11, 2.0), (13, 2.0)]);
        assert_eq!(busiest_process_share(&before, &after, 4.0), Some(0.75));
        assert_eq!(busiest_process_share(&before, &after, 0.0), None);
        assert_eq!(
            busiest_process_share(&before, &Default::default(), 4.0),
            None
        );
    }

    #[test]
    fn a_stat_line_gives_user_plus_system_seconds() {
        // The command name may hold spaces and parentheses; fields count from the last ')'.
        let line = "42 (postgres: a (b) c) S 1 2 3 4 5 6 7 8 9 10 250 150 0 0";
        assert_eq!(stat_seconds(line), Some(4.0));
        assert_eq!(stat_seconds("42 (x) S 1"), None);
    }

    #[test]
    fn unreadable_stat_lines_give_no_times() {
        assert!(CpuTimes::parse("intr 1 2 3\n").is_none());
        assert!(CpuTimes::parse("cpu  1 x 3\n").is_none());
    }
}
