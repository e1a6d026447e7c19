//! Test helpers: unique temporary folders and fixture git repositories built with the real
//! `git` CLI (isolated from the machine's git config).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use inventory::{Limits, UrlPolicy};

static NEXT: AtomicU64 = AtomicU64::new(0);

/// A folder removed when dropped.
pub(crate) struct TempDir {
    path: PathBuf,
}

impl TempDir {
    pub(crate) fn new(tag: &str) -> TempDir {
        let path = std::env::temp_dir().join(format!(
            "fairlane-inventory-test-{tag}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).unwrap();
        TempDir { path }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// A git repository in a temporary folder.
pub(crate) struct Fixture {
    pub(crate) dir: TempDir,
}

impl Fixture {
    pub(crate) fn new(tag: &str) -> Fixture {
        let fixture = Fixture {
            dir: TempDir::new(tag),
        };
        fixture.git(&["init", "--quiet", "--initial-branch=main", "."]);
        fixture
    }

    pub(crate) fn path(&self) -> &Path {
        self.dir.path()
    }

    pub(crate) fn url(&self) -> String {
        format!("file://{}", self.path().display())
    }

    pub(crate) fn git(&self, args: &[&str]) -> String {
        let out = Command::new("git")
            .args([
                "-c",
                "user.name=Fixture",
                "-c",
                "user.email=fixture@example.com",
                "-c",
                "commit.gpgsign=false",
                "-c",
                "tag.gpgsign=false",
                "-c",
                "core.autocrlf=false",
            ])
            .args(args)
            .current_dir(self.path())
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_TERMINAL_PROMPT", "0")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "git {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }

    pub(crate) fn write(&self, rel: &str, contents: impl AsRef<[u8]>) {
        let path = self.path().join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, contents).unwrap();
    }

    /// Commits everything; returns the new commit id.
    pub(crate) fn commit(&self, message: &str) -> String {
        self.git(&["add", "--all"]);
        self.git(&["commit", "--quiet", "--allow-empty", "-m", message]);
        self.git(&["rev-parse", "HEAD"])
    }
}

/// Test policy: file URLs allowed, everything else as in production.
pub(crate) fn policy() -> UrlPolicy {
    UrlPolicy::with_file_urls(true)
}

/// Default limits with checkouts under `root/work`.
pub(crate) fn limits(root: &Path) -> Limits {
    Limits {
        work_root: root.join("work"),
        total_time: Duration::from_secs(60),
        ..Limits::default()
    }
}

/// The entries left under a work root (none after every fetch, whatever its outcome).
pub(crate) fn leftovers(work_root: &Path) -> Vec<String> {
    match fs::read_dir(work_root) {
        Ok(entries) => entries
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Processes whose command line mentions `needle` (to prove git was killed as a group).
pub(crate) fn processes_mentioning(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in fs::read_dir("/proc").unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if let Ok(cmdline) = fs::read(entry.path().join("cmdline")) {
            let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if text.contains(needle) {
                found.push(format!("{name}: {text}"));
            }
        }
    }
    found
}
