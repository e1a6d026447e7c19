//! Runs the `git` CLI hardened and bounded: a cleared environment, no system/global config, no
//! prompts, credential helpers, hooks, submodules, symlinks or LFS; only the allowed transports;
//! its own process group, killed as a whole at the deadline or when a disk cap is exceeded, and
//! started by `prlimit` with a cap on its address space.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::Command;
use tokio::time::Instant;

use super::{FetchError, Stage};
use crate::url_policy::redact;

/// How much of stderr is kept (the tail).
const STDERR_KEEP: usize = 16 * 1024;

/// The settings every git invocation gets on its command line.
fn hardening_config(allow_file: bool, curl_pin: Option<&str>) -> Vec<String> {
    let mut config: Vec<String> = [
        "protocol.allow=never",
        "protocol.https.allow=always",
        "credential.helper=",
        "core.askPass=",
        "core.hooksPath=/dev/null",
        "core.fsmonitor=false",
        "core.symlinks=false",
        "core.autocrlf=false",
        "submodule.recurse=false",
        "fetch.recurseSubmodules=false",
        "fetch.unpackLimit=1",
        // One thread resolves deltas: the memory cap then bounds one object at a time, and an
        // analysis takes one core whatever the machine has.
        "pack.threads=1",
        // Pack windows small and few, so mapping a pack near the byte cap stays far below the
        // address-space cap (git's 64-bit defaults are 1 GiB windows and an 8 GiB total).
        "core.packedGitWindowSize=32m",
        "core.packedGitLimit=256m",
        "transfer.fsckObjects=true",
        "http.followRedirects=false",
        "http.sslVerify=true",
        "gc.auto=0",
        "maintenance.auto=false",
        "advice.detachedHead=false",
        "init.defaultBranch=main",
        "filter.lfs.smudge=",
        "filter.lfs.process=",
        "filter.lfs.required=false",
    ]
    .iter()
    .map(|s| (*s).to_string())
    .collect();
    if allow_file {
        config.push("protocol.file.allow=always".into());
    }
    if let Some(pin) = curl_pin {
        config.push(format!("http.curloptResolve={pin}"));
    }
    config
}

/// What a finished git process left behind.
#[derive(Debug)]
pub(crate) struct GitOutput {
    pub(crate) status: ExitStatus,
    /// The tail of stderr, credentials redacted.
    pub(crate) stderr: String,
    /// The address-space cap git ran under (for messages).
    pub(crate) memory_cap: u64,
}

impl GitOutput {
    pub(crate) fn success(&self) -> bool {
        self.status.success()
    }
}

/// A disk cap watched while git runs.
#[derive(Debug, Clone)]
pub(crate) struct DiskWatch {
    /// The folder whose total size is measured.
    pub(crate) dir: PathBuf,
    /// Abort when the size exceeds this.
    pub(crate) max_bytes: u64,
    /// How often to measure (at least; slower when a measurement takes long).
    pub(crate) interval: Duration,
}

/// Runs git commands for one checkout.
pub(crate) struct Git {
    /// `HOME`, `XDG_CONFIG_HOME` and `TMPDIR` for git: inside the checkout folder.
    pub(crate) home: PathBuf,
    pub(crate) allow_file: bool,
    pub(crate) curl_pin: Option<String>,
    /// `RLIMIT_AS` of git and every process it starts, in bytes.
    pub(crate) max_memory: u64,
    /// When the whole operation must have finished.
    pub(crate) deadline: Instant,
    /// The time cap the deadline came from (for messages).
    pub(crate) time_cap: Duration,
}

/// Kills a process group when dropped unless disarmed (covers cancellation and panics).
struct GroupGuard {
    pgid: Option<Pid>,
}

impl GroupGuard {
    fn kill(&mut self) {
        if let Some(pgid) = self.pgid {
            let _ = killpg(pgid, Signal::SIGKILL);
        }
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

impl Git {
    fn command(&self, cwd: &Path, args: &[&str]) -> Command {
        // `prlimit` sets the limit on itself and then execs git (same pid, same process group);
        // git's helpers (`index-pack`, `remote-https`) inherit it.
        let mut cmd = Command::new("prlimit");
        cmd.env_clear();
        if let Some(path) = std::env::var_os("PATH") {
            cmd.env("PATH", path);
        }
        let protocols = if self.allow_file {
            "https:file"
        } else {
            "https"
        };
        cmd.env("HOME", &self.home)
            .env("XDG_CONFIG_HOME", &self.home)
            .env("TMPDIR", &self.home)
            .env("LC_ALL", "C")
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .env("GIT_TERMINAL_PROMPT", "0")
            .env("GIT_LFS_SKIP_SMUDGE", "1")
            .env("GIT_ALLOW_PROTOCOL", protocols)
            .env("GIT_PROTOCOL_FROM_USER", "0")
            .env("GIT_OPTIONAL_LOCKS", "0");
        // Git looks for a repository upwards from `cwd`; one above it (a deploy checkout that
        // holds the work folder) would lend its config (`url.<base>.insteadOf`, proxies) to a
        // command run in a folder that is no repository of its own, such as `ls-remote`'s.
        if let Some(parent) = cwd.parent() {
            cmd.env("GIT_CEILING_DIRECTORIES", parent);
        }
        let mut argv: Vec<OsString> = vec![
            format!("--as={}", self.max_memory).into(),
            "--".into(),
            "git".into(),
        ];
        for setting in hardening_config(self.allow_file, self.curl_pin.as_deref()) {
            argv.push("-c".into());
            argv.push(setting.into());
        }
        argv.extend(args.iter().map(OsString::from));
        cmd.args(argv)
            .current_dir(cwd)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        cmd
    }

    /// Runs `git <args>` in `cwd`, feeding stdout to `sink` as it arrives. Fails with
    /// [`FetchError::TimedOut`] at the deadline and [`FetchError::TooLarge`] when `watch`'s cap is
    /// exceeded (the whole process group is killed first), or with whatever `sink` returns.
    pub(crate) async fn run(
        &self,
        stage: Stage,
        cwd: &Path,
        args: &[&str],
        watch: Option<&DiskWatch>,
        sink: &mut (dyn FnMut(&[u8]) -> Result<(), FetchError> + Send),
    ) -> Result<GitOutput, FetchError> {
        let mut child = self
            .command(cwd, args)
            .spawn()
            .map_err(|source| FetchError::Io {
                action: "start git with util-linux's prlimit",
                source,
            })?;
        let mut guard = GroupGuard {
            pgid: child.id().map(|id| Pid::from_raw(id as i32)),
        };
        let stdout = child.stdout.take();
        let stderr_task = child.stderr.take().map(|s| tokio::spawn(read_tail(s)));

        let outcome = self.supervise(stage, &mut child, stdout, watch, sink).await;
        let status = match outcome {
            Ok(status) => {
                // The leader exited; stop stray helpers of the group before the pgid can be reused.
                guard.kill();
                guard.pgid = None;
                status
            }
            Err(error) => {
                guard.kill();
                let _ = child.wait().await;
                wait_group_gone(&mut guard).await;
                return Err(error);
            }
        };
        let stderr = match stderr_task {
            Some(task) => match tokio::time::timeout(Duration::from_secs(2), task).await {
                Ok(Ok(bytes)) => redact(String::from_utf8_lossy(&bytes).trim()),
                _ => String::new(),
            },
            None => String::new(),
        };
        Ok(GitOutput {
            status,
            stderr,
            memory_cap: self.max_memory,
        })
    }

    async fn supervise(
        &self,
        stage: Stage,
        child: &mut tokio::process::Child,
        mut stdout: Option<tokio::process::ChildStdout>,
        watch: Option<&DiskWatch>,
        sink: &mut (dyn FnMut(&[u8]) -> Result<(), FetchError> + Send),
    ) -> Result<ExitStatus, FetchError> {
        let mut buf = vec![0u8; 64 * 1024];
        let mut status: Option<ExitStatus> = None;
        let mut next_measure =
            Instant::now() + watch.map_or(Duration::from_secs(3600), |w| w.interval);
        loop {
            if status.is_some() && stdout.is_none() {
                break;
            }
            tokio::select! {
                read = async { stdout.as_mut().expect("guarded by the select condition").read(&mut buf).await },
                    if stdout.is_some() =>
                {
                    match read {
                        Ok(0) | Err(_) => stdout = None,
                        Ok(n) => sink(&buf[..n])?,
                    }
                }
                exited = child.wait(), if status.is_none() => {
                    status = Some(exited.map_err(|source| FetchError::Io { action: "wait for git", source })?);
                }
                () = tokio::time::sleep_until(self.deadline) => {
                    return Err(FetchError::TimedOut { stage, limit: self.time_cap });
                }
                () = tokio::time::sleep_until(next_measure), if watch.is_some() => {
                    if let Some(w) = watch {
                        let began = Instant::now();
                        let dir = w.dir.clone();
                        // The time cap holds while a big tree is measured too: past it, git is
                        // stopped and the measurement left to finish on its own.
                        let measuring = tokio::task::spawn_blocking(move || disk_usage(&dir));
                        let Ok(used) = tokio::time::timeout_at(self.deadline, measuring).await
                        else {
                            return Err(FetchError::TimedOut { stage, limit: self.time_cap });
                        };
                        let used = used.unwrap_or(0);
                        if used > w.max_bytes {
                            return Err(FetchError::TooLarge { stage, limit: w.max_bytes });
                        }
                        // Measuring a big tree is not free: never spend more than ~20% on it.
                        next_measure = Instant::now() + w.interval.max(began.elapsed() * 4);
                    }
                }
            }
        }
        status.ok_or(FetchError::Io {
            action: "wait for git",
            source: std::io::Error::other("git exited without status"),
        })
    }
}

/// Waits (briefly) until no live process of the group is left, so the checkout can be removed.
async fn wait_group_gone(guard: &mut GroupGuard) {
    let Some(pgid) = guard.pgid else { return };
    for _ in 0..100 {
        if !group_has_live_members(pgid) {
            break;
        }
        let _ = killpg(pgid, Signal::SIGKILL);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    guard.pgid = None;
}

/// Whether any process of group `pgid` is still running. Zombies (killed helpers waiting for
/// whoever inherited them to reap them) do not count: they hold no files. Without `/proc`, any
/// member counts.
fn group_has_live_members(pgid: Pid) -> bool {
    if matches!(killpg(pgid, None), Err(Errno::ESRCH)) {
        return false;
    }
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return true;
    };
    for entry in entries.flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // Fields after the parenthesised command name: state, ppid, pgrp, …
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next().unwrap_or("");
        let pgrp = fields.nth(1).and_then(|f| f.parse::<i32>().ok());
        if pgrp == Some(pgid.as_raw()) && !matches!(state, "Z" | "X") {
            return true;
        }
    }
    false
}

async fn read_tail(mut reader: impl AsyncRead + Unpin) -> Vec<u8> {
    let mut kept: Vec<u8> = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match reader.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                kept.extend_from_slice(&buf[..n]);
                if kept.len() > STDERR_KEEP * 2 {
                    kept.drain(..kept.len() - STDERR_KEEP);
                }
            }
        }
    }
    if kept.len() > STDERR_KEEP {
        kept.drain(..kept.len() - STDERR_KEEP);
    }
    kept
}

/// The file system block a file's content (and a folder) is reckoned in: a one-byte file takes
/// one.
pub(crate) const BLOCK_BYTES: u64 = 4096;

/// `bytes` of a file's content in whole [`BLOCK_BYTES`] blocks.
pub(crate) fn in_blocks(bytes: u64) -> u64 {
    bytes.div_ceil(BLOCK_BYTES).saturating_mul(BLOCK_BYTES)
}

/// What the files and folders under `dir` take on disk: a file its size in whole
/// [`BLOCK_BYTES`] blocks, a folder its own size (symlinks not followed; unreadable entries count
/// as zero, since they are usually files git is replacing). A one-byte file holds a block, as a
/// volume's limit counts it (`du`, an `emptyDir`'s `sizeLimit`), and folders count, so a
/// checkout of millions of empty folders or tiny files does not measure as nothing.
pub fn disk_usage(dir: &Path) -> u64 {
    let mut total = 0u64;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            // A file in whole blocks, from its size rather than the blocks the file system
            // reports: XFS counts the room it sets aside past the end of a file being written
            // (a pack while it is fetched) until the file is closed, up to twice its size.
            let bytes = if meta.is_file() {
                in_blocks(meta.len())
            } else {
                meta.len()
            };
            total = total.saturating_add(bytes);
            if meta.is_dir() {
                stack.push(entry.path());
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_usage_counts_folders() {
        let dir = std::env::temp_dir().join(format!("fairlane-disk-usage-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let empty = disk_usage(&dir);
        for i in 0..100 {
            std::fs::create_dir(dir.join(i.to_string())).unwrap();
        }
        let folders = disk_usage(&dir);
        std::fs::write(dir.join("0/f"), [0u8; 1000]).unwrap();
        let with_file = disk_usage(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(folders > empty, "{folders} after 100 empty folders");
        // The file, and whatever its name adds to its folder (tmpfs, XFS and btrfs count names).
        let added = with_file - folders;
        assert!(
            (1000..1000 + 4096).contains(&added),
            "{with_file} - {folders}"
        );
    }
}
