//! Fixture git repositories for tests that fetch code: temporary folders, repositories built
//! with the real `git` CLI (isolated from the machine's git config), a way to make a fetch stall,
//! and a scan for the git processes a test left behind.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

static NEXT: AtomicU64 = AtomicU64::new(0);

/// A folder removed when dropped.
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// A new empty folder under the system's temporary folder, unique to this process.
    pub fn new(tag: &str) -> TempDir {
        let path = std::env::temp_dir().join(format!(
            "fairlane-test-{tag}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).unwrap();
        TempDir { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The names of the entries in this folder (checkout folders, for a work dir).
    pub fn entries(&self) -> Vec<String> {
        entries(&self.path)
    }
}

/// The folder's path, so a `TempDir` goes wherever a `&Path` does (`dir.join(…)`, `&dir`).
impl std::ops::Deref for TempDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// The names of the entries in `dir`, sorted (none if it does not exist).
pub fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .map(|entries| {
            entries
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// A git repository in a temporary folder, on branch `main`.
pub struct GitFixture {
    dir: TempDir,
}

impl GitFixture {
    pub fn new(tag: &str) -> GitFixture {
        let fixture = GitFixture {
            dir: TempDir::new(tag),
        };
        fixture.git(&["init", "--quiet", "--initial-branch=main", "."]);
        fixture
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The repository as a `file://` URL.
    pub fn url(&self) -> String {
        format!("file://{}", self.path().display())
    }

    /// Runs `git args…` in the repository; panics on failure; returns stdout, trimmed.
    pub fn git(&self, args: &[&str]) -> String {
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
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    }

    /// Writes a file (creating its folders), relative to the repository's root.
    pub fn write(&self, rel: &str, contents: impl AsRef<[u8]>) {
        let path = self.path().join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, contents).unwrap();
    }

    /// Commits everything; returns the new commit id.
    pub fn commit(&self, message: &str) -> String {
        self.git(&["add", "--all"]);
        self.git(&["commit", "--quiet", "--allow-empty", "-m", message]);
        self.git(&["rev-parse", "HEAD"])
    }

    /// Makes the commit object unreadable without blocking `ls-remote`: the loose object becomes
    /// a FIFO, so serving the commit stalls forever, like a server that hangs mid-fetch.
    pub fn stall(&self, commit: &str) {
        let object = self
            .path()
            .join(".git/objects")
            .join(&commit[..2])
            .join(&commit[2..]);
        assert!(object.is_file(), "no loose object {}", object.display());
        fs::remove_file(&object).unwrap();
        assert!(
            Command::new("mkfifo")
                .arg(&object)
                .status()
                .unwrap()
                .success()
        );
    }
}

/// Random bytes (incompressible, so a repository holding them is as large packed as unpacked).
pub fn random_bytes(n: usize) -> Vec<u8> {
    let mut buf = vec![0u8; n];
    fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut buf)
        .unwrap();
    buf
}

/// Processes whose command line mentions `needle`, as (pid, command line): proves git was
/// killed as a group, or finds what a killed worker left behind.
pub fn processes_mentioning(needle: &str) -> Vec<(i32, String)> {
    let mut found = Vec::new();
    for entry in fs::read_dir("/proc").unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Ok(pid) = name.parse::<i32>() else {
            continue;
        };
        if let Ok(cmdline) = fs::read(entry.path().join("cmdline")) {
            let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if text.contains(needle) {
                found.push((pid, text));
            }
        }
    }
    found
}
