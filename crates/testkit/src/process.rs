//! Child processes for tests that need real crashes and signals: spawn a binary, kill it with
//! SIGKILL or SIGTERM, and always reap it (a panicking test must not leave workers behind).

use std::io::Read as _;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

/// A spawned child that is killed when dropped.
#[derive(Debug)]
pub struct ChildProcess {
    child: Child,
    name: String,
}

impl ChildProcess {
    /// Spawns `program` with `args` and `envs`; its stdout/stderr go to the test's output.
    pub fn spawn(name: &str, program: &str, args: &[&str], envs: &[(&str, String)]) -> Self {
        let mut cmd = Command::new(program);
        cmd.args(args)
            .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {name} ({program}): {e}"));
        ChildProcess {
            child,
            name: name.to_owned(),
        }
    }

    pub fn pid(&self) -> Pid {
        let id = self
            .child
            .id()
            .unwrap_or_else(|| panic!("{} already exited", self.name));
        Pid::from_raw(i32::try_from(id).unwrap_or(i32::MAX))
    }

    /// `kill -9`: no chance to clean up.
    pub async fn kill_9(&mut self) -> ExitStatus {
        self.signal(Signal::SIGKILL);
        self.wait().await
    }

    /// Sends SIGTERM and waits up to `timeout` for the exit.
    pub async fn terminate(&mut self, timeout: Duration) -> ExitStatus {
        self.signal(Signal::SIGTERM);
        match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(status) => status.unwrap_or_else(|e| panic!("waiting for {}: {e}", self.name)),
            Err(_) => panic!("{} did not exit within {timeout:?} of SIGTERM", self.name),
        }
    }

    pub fn signal(&self, signal: Signal) {
        // The child may have exited already; that is not an error for a test.
        let _ = kill(self.pid(), signal);
    }

    pub async fn wait(&mut self) -> ExitStatus {
        self.child
            .wait()
            .await
            .unwrap_or_else(|e| panic!("waiting for {}: {e}", self.name))
    }

    /// Whether the child is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

/// Runs `program` with `args` and `envs` (on top of this process's environment), expecting it to
/// refuse to start: it must exit with code 1 within 30 s (not 101, a panic's) and print exactly
/// one line on stderr, which is returned (without its line break).
pub fn refused_start(program: &str, args: &[&str], envs: &[(&str, &str)]) -> String {
    let mut child = std::process::Command::new(program)
        .args(args)
        .envs(envs.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {program}: {e}"));
    let mut stderr = child.stderr.take().unwrap_or_else(|| unreachable!("piped"));
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{program} with {envs:?} did not exit within 30 s: it started");
            }
        }
    };
    let stderr = reader.join().unwrap_or_default();
    assert!(
        status.code() == Some(1),
        "{program} with {envs:?}: expected exit code 1, got {status:?}; stderr: {stderr}"
    );
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "{program} with {envs:?}: expected one line on stderr, got:\n{stderr}"
    );
    lines[0].to_owned()
}
