//! Temporary checkout directories: one root folder, one `fairlane-inv-<pid>-<start>-<n>` folder
//! per checkout, removed by an RAII guard, and a sweep that removes the folders of processes
//! that no longer exist.

use std::fs;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use nix::errno::Errno;
use nix::sys::signal::kill;
use nix::unistd::Pid;

/// The prefix of every checkout folder under the work root.
pub const CHECKOUT_PREFIX: &str = "fairlane-inv-";

static SEQUENCE: AtomicU64 = AtomicU64::new(0);

/// A process's start time in clock ticks since boot (Linux `/proc/<pid>/stat` field 22), used to
/// tell a live owner from a later process that reused its pid; 0 when unknown.
pub fn process_start_time(pid: i32) -> u64 {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    // The command name (field 2) is in parentheses and may contain spaces: count from the last `)`.
    let Some((_, after_comm)) = stat.rsplit_once(')') else {
        return 0;
    };
    after_comm
        .split_whitespace()
        .nth(19)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// The folder name for a new checkout of this process.
fn folder_name() -> String {
    let pid = std::process::id();
    let start = process_start_time(pid as i32);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let seq = SEQUENCE.fetch_add(1, Ordering::Relaxed);
    format!("{CHECKOUT_PREFIX}{pid}-{start}-{seq}x{nanos:08x}")
}

/// Parses `fairlane-inv-<pid>-<start>-…` into (pid, start).
fn parse_folder_name(name: &str) -> Option<(i32, u64)> {
    let rest = name.strip_prefix(CHECKOUT_PREFIX)?;
    let mut parts = rest.splitn(3, '-');
    let pid: i32 = parts.next()?.parse().ok()?;
    let start: u64 = parts.next()?.parse().ok()?;
    parts.next()?;
    (pid > 0).then_some((pid, start))
}

/// A checkout folder that is removed (with everything in it) when dropped — on success, error,
/// timeout, cancellation and panic alike.
#[derive(Debug)]
pub struct WorkDir {
    path: PathBuf,
}

impl WorkDir {
    /// Creates a fresh folder (mode 0700) under `root`, creating `root` if needed.
    pub fn create(root: &Path) -> io::Result<WorkDir> {
        fs::create_dir_all(root)?;
        let path = root.join(folder_name());
        fs::DirBuilder::new().mode(0o700).create(&path)?;
        Ok(WorkDir { path })
    }

    /// The folder.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for WorkDir {
    /// Removes the folder before returning. Dropped on a worker thread of a multi-threaded Tokio
    /// runtime (a fetch that failed or was cancelled), the removal (a large checkout, and up to
    /// 300 ms of retries) runs in `block_in_place`, so the thread's other tasks move elsewhere
    /// meanwhile instead of waiting behind it.
    fn drop(&mut self) {
        let on_async_worker = tokio::runtime::Handle::try_current().is_ok_and(|runtime| {
            runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread
        });
        if on_async_worker {
            tokio::task::block_in_place(|| remove_folder(&self.path));
        } else {
            remove_folder(&self.path);
        }
    }
}

/// Removes `path` and everything in it; a killed git may still be exiting, so it retries a few
/// times before giving up (with a warning: the next start's sweep removes what is left).
fn remove_folder(path: &Path) {
    #[cfg(test)]
    tests::before_removing(path);
    for attempt in 0..5 {
        match fs::remove_dir_all(path) {
            Ok(()) => return,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return,
            Err(e) if attempt == 4 => {
                tracing::warn!(path = %path.display(), error = %e, "could not remove checkout folder");
            }
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(20 << attempt)),
        }
    }
}

/// What [`sweep_stale`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Folders removed (their owner is gone).
    pub removed: Vec<PathBuf>,
    /// Checkout folders kept because their owner still runs.
    pub kept: Vec<PathBuf>,
}

/// Whether the process that created a folder is still the one running under that pid.
fn owner_alive(pid: i32, start: u64) -> bool {
    match kill(Pid::from_raw(pid), None) {
        Ok(()) | Err(Errno::EPERM) => {
            let now = process_start_time(pid);
            // Same pid but another start time: the pid was reused, the owner is gone.
            start == 0 || now == 0 || now == start
        }
        Err(_) => false,
    }
}

/// Removes checkout folders under `root` left by processes that no longer exist (crash
/// clean-up at worker start). Folders of live processes — this one included — are kept; other
/// entries are not touched. A missing root is not an error. Blocking.
pub fn sweep_stale(root: &Path) -> io::Result<SweepReport> {
    let mut report = SweepReport::default();
    let entries = match fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(report),
        Err(e) => return Err(e),
    };
    let mut names: Vec<(String, PathBuf)> = Vec::new();
    for entry in entries {
        let entry = entry?;
        if !entry.file_type()?.is_dir() {
            continue;
        }
        names.push((
            entry.file_name().to_string_lossy().into_owned(),
            entry.path(),
        ));
    }
    names.sort();
    for (name, path) in names {
        let Some((pid, start)) = parse_folder_name(&name) else {
            continue;
        };
        if owner_alive(pid, start) {
            report.kept.push(path);
        } else {
            match fs::remove_dir_all(&path) {
                Ok(()) => report.removed.push(path),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
    }
    if !report.removed.is_empty() {
        tracing::info!(removed = report.removed.len(), root = %root.display(), "swept stale checkout folders");
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;
    use std::time::{Duration, Instant};

    use super::*;

    /// The folder whose removal waits (up to 5 s) until its flag is set: what a test sets to
    /// hold a removal while it checks what else can run meanwhile.
    type HeldRemoval = Option<(PathBuf, Arc<AtomicBool>)>;
    static HELD_REMOVAL: std::sync::Mutex<HeldRemoval> = std::sync::Mutex::new(None);

    pub(super) fn before_removing(path: &Path) {
        let held = HELD_REMOVAL.lock().unwrap().clone();
        if let Some((held, release)) = held
            && held == path
        {
            let deadline = Instant::now() + Duration::from_secs(5);
            while !release.load(Ordering::Acquire) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    #[test]
    fn folder_names_round_trip() {
        let name = folder_name();
        let (pid, start) = parse_folder_name(&name).unwrap();
        assert_eq!(pid as u32, std::process::id());
        assert_eq!(start, process_start_time(pid));
        assert_ne!(start, 0, "Linux /proc should give a start time");
        assert_eq!(parse_folder_name("fairlane-inv-12-34-x"), Some((12, 34)));
        assert_eq!(parse_folder_name("fairlane-inv-12-34"), None);
        assert_eq!(parse_folder_name("fairlane-inv-0-34-x"), None);
        assert_eq!(parse_folder_name("other-12-34-x"), None);
        assert_ne!(folder_name(), folder_name());
    }

    /// Dropped on the only worker thread of a multi-threaded runtime, a checkout is removed
    /// with that thread's other tasks moved elsewhere: a task queued on the same thread runs
    /// while the removal goes on (here the removal waits for it, at most 5 s), not after it, and
    /// the folder is gone when the drop returns.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_drop_on_an_async_worker_does_not_hold_up_its_other_tasks() {
        let root = std::env::temp_dir().join(format!("fairlane-workdir-test-{}", folder_name()));
        let dir = WorkDir::create(&root).unwrap();
        let path = dir.path().to_path_buf();
        fs::write(path.join("file"), b"x").unwrap();
        let release = Arc::new(AtomicBool::new(false));
        *HELD_REMOVAL.lock().unwrap() = Some((path.clone(), Arc::clone(&release)));
        let waited = tokio::spawn(async move {
            // Queued on this worker thread, behind the task that is about to drop the folder.
            let other = tokio::spawn(async move { release.store(true, Ordering::Release) });
            let started = Instant::now();
            drop(dir);
            let waited = started.elapsed();
            other.await.unwrap();
            waited
        })
        .await
        .unwrap();
        assert!(
            !path.exists(),
            "the folder is removed when the drop returns"
        );
        assert!(
            waited < Duration::from_secs(4),
            "the other task ran only after the removal gave up waiting for it ({waited:?})"
        );
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn own_process_is_alive_and_reused_pid_is_not() {
        let pid = std::process::id() as i32;
        let start = process_start_time(pid);
        assert!(owner_alive(pid, start));
        assert!(!owner_alive(pid, start + 1));
    }
}
