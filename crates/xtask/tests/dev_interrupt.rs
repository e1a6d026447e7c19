//! `cargo xtask dev` interrupted during its startup steps: a real SIGINT while its (stand-in)
//! `cargo build` runs must stop it cleanly, without starting the next step. Without the handler
//! in place by then, xtask dies of the signal and nothing it started (a private PostgreSQL) is
//! stopped. And a second SIGINT while the services drain kills them at once.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// A fresh folder for one test's stand-in cargo and its marker files.
fn scratch_dir(label: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fairlane-xtask-{label}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes an executable shell script standing in for cargo (xtask runs `$CARGO`).
fn fake_cargo(dir: &Path, body: &str) -> PathBuf {
    let path = dir.join("cargo");
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    let status = Command::new("chmod").arg("+x").arg(&path).status().unwrap();
    assert!(status.success());
    path
}

/// A port nothing listens on (dev refuses one that is taken, or that it may not bind).
fn spare_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// `xtask dev` in a process group of its own (as a shell runs a foreground job), with the
/// stand-in cargo and a `DATABASE_URL`, so no private PostgreSQL is involved.
struct Dev {
    child: Option<Child>,
}

impl Dev {
    fn start(cargo: &Path) -> Dev {
        Dev::spawn(dev_command(cargo))
    }

    /// `xtask dev` whose stand-in services are in `target` (its `CARGO_TARGET_DIR`).
    fn start_with_services(cargo: &Path, target: &Path) -> Dev {
        let mut command = dev_command(cargo);
        command.env("CARGO_TARGET_DIR", target);
        Dev::spawn(command)
    }

    fn spawn(mut command: Command) -> Dev {
        Dev {
            child: Some(command.spawn().unwrap()),
        }
    }

    fn child(&mut self) -> &mut Child {
        self.child.as_mut().unwrap()
    }

    /// Closes the reading end of xtask's stderr: every later write to it fails (EPIPE).
    fn close_stderr(&mut self) {
        drop(self.child().stderr.take());
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Waits (bounded) for the exit and returns the output.
    fn finish(self) -> Output {
        self.finish_within(Duration::from_secs(60))
    }

    /// Waits up to `patience` for the exit (a failure past it) and returns the output; whatever
    /// of its process group is left is killed.
    fn finish_within(mut self, patience: Duration) -> Output {
        let mut child = self.child.take().unwrap();
        let deadline = Instant::now() + patience;
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                kill_group(child.id(), "KILL");
                panic!("xtask dev did not stop within {patience:?} of the SIGINT");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let group = child.id();
        let output = child.wait_with_output().unwrap();
        kill_group(group, "KILL");
        output
    }
}

/// `xtask dev` with the stand-in cargo and a `DATABASE_URL` no one answers, in a process group
/// of its own, its output piped.
fn dev_command(cargo: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_xtask"));
    command
        .args(["dev", "--port", &spare_port().to_string()])
        .env("CARGO", cargo)
        .env(
            "DATABASE_URL",
            "postgres://postgres@127.0.0.1:1/never-reached",
        )
        .env_remove("REDIS_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    command
}

/// A stand-in cargo that builds nothing and reports `CARGO_TARGET_DIR` as its target directory.
const CARGO_REPORTING_ITS_TARGET: &str =
    "[ \"$1\" = metadata ] && printf '{\"target_directory\":\"%s\"}' \"$CARGO_TARGET_DIR\"\nexit 0";

impl Drop for Dev {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill_group(child.id(), "KILL");
            let _ = child.wait();
        }
    }
}

fn kill(target: &str, signal: &str) {
    let status = Command::new("kill")
        .args([&format!("-{signal}"), "--", target])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{signal} {target}");
}

fn kill_group(pid: u32, signal: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{signal}"), "--", &format!("-{pid}")])
        .status();
}

fn wait_for(file: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !file.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared: xtask dev did not reach its build step",
            file.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn describe(status: ExitStatus, output: &Output) -> String {
    format!(
        "status {status:?} (signal {:?})\nstderr:\n{}",
        status.signal(),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// `xtask dev` said it was interrupted, exited 0, and never started migrating.
fn assert_stopped_before_migrating(output: &Output) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{}",
        describe(output.status, output)
    );
    assert!(stderr.contains("interrupted"), "{stderr}");
    assert!(
        !stderr.contains("migrating"),
        "the next step ran:\n{stderr}"
    );
}

#[test]
fn sigint_to_the_whole_group_during_the_build_stops_dev_cleanly() {
    // What a terminal's Ctrl-C does: SIGINT to xtask and to the build it runs.
    let dir = scratch_dir("group-sigint");
    let started = dir.join("build-started");
    let cargo = fake_cargo(
        &dir,
        &format!("touch '{}'\nexec sleep 60", started.display()),
    );
    let dev = Dev::start(&cargo);
    wait_for(&started);
    kill_group(dev.pid(), "INT");
    assert_stopped_before_migrating(&dev.finish());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn sigint_during_a_step_that_completes_stops_dev_before_the_next_step() {
    // SIGINT to xtask alone: its build finishes, and the next step (migrating) must not start.
    let dir = scratch_dir("sigint");
    let started = dir.join("build-started");
    let go = dir.join("build-may-finish");
    let cargo = fake_cargo(
        &dir,
        &format!(
            "touch '{}'\nwhile [ ! -e '{}' ]; do sleep 0.05; done\nexit 0",
            started.display(),
            go.display()
        ),
    );
    let dev = Dev::start(&cargo);
    wait_for(&started);
    kill(&dev.pid().to_string(), "INT");
    // Give a handler-less xtask time to die of the signal before the build ends.
    std::thread::sleep(Duration::from_millis(300));
    std::fs::write(&go, "").unwrap();
    assert_stopped_before_migrating(&dev.finish());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn sigint_with_stderr_gone_still_stops_dev_cleanly() {
    // `cargo xtask dev 2>&1 | tee dev.log` and Ctrl-C: the signal ends `tee` too, so every
    // progress line xtask writes while stopping fails. That must not panic the shutdown.
    let dir = scratch_dir("stderr-gone");
    let started = dir.join("build-started");
    let cargo = fake_cargo(
        &dir,
        &format!("touch '{}'\nexec sleep 60", started.display()),
    );
    let mut dev = Dev::start(&cargo);
    wait_for(&started);
    dev.close_stderr();
    kill_group(dev.pid(), "INT");
    let output = dev.finish();
    assert!(
        output.status.success(),
        "{}",
        describe(output.status, &output)
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// Writes stand-ins for the four services into `debug` (a `CARGO_TARGET_DIR`'s `debug`): each
/// ignores SIGTERM, as a service stuck draining would. `web` answers the admin commands dev runs
/// and, as the API, serves `/readyz` with 200 on `HTTP_ADDR`.
/// `crashing`: a service that exits (status 3) once the file given appears.
fn stubborn_services(debug: &Path, crashing: Option<(&str, &Path)>) {
    std::fs::create_dir_all(debug).unwrap();
    let web = r#"#!/bin/sh
case "$1 $2" in
  "migrate ") exit 0;;
  "admin create-user") echo '{"id":"00000000-0000-0000-0000-000000000001"}'; exit 0;;
  "admin issue-key") echo '{"key":"fl_demo"}'; exit 0;;
esac
exec python3 -c '
import http.server, os, signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)
host, port = os.environ["HTTP_ADDR"].rsplit(":", 1)
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer((host, int(port)), Ready).serve_forever()
'
"#;
    let worker = "#!/bin/sh\ntrap '' TERM\nwhile true; do sleep 0.1; done\n";
    let crash = crashing.map(|(_, when)| {
        format!(
            "#!/bin/sh\nwhile [ ! -e '{}' ]; do sleep 0.05; done\nexit 3\n",
            when.display()
        )
    });
    for (name, script) in [
        ("web", web),
        ("analyzer-worker", worker),
        ("specgen-worker", worker),
        ("scheduler", worker),
    ] {
        let script = match (&crash, crashing) {
            (Some(crash), Some((crashing, _))) if crashing == name => crash.as_str(),
            _ => script,
        };
        let path = debug.join(name);
        std::fs::write(&path, script).unwrap();
        let status = Command::new("chmod").arg("+x").arg(&path).status().unwrap();
        assert!(status.success());
    }
}

/// Reads `from` line by line until one contains `marker` (panics if it ends first); returns
/// what it read.
fn read_until(from: &mut impl std::io::Read, marker: &str) -> String {
    let mut seen = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        let read = from.read(&mut byte).unwrap();
        assert!(
            read > 0,
            "ended before {marker:?}:\n{}",
            String::from_utf8_lossy(&seen)
        );
        seen.push(byte[0]);
        if byte[0] == b'\n' && String::from_utf8_lossy(&seen).contains(marker) {
            return String::from_utf8_lossy(&seen).into_owned();
        }
    }
}

#[test]
fn a_second_sigint_while_the_services_drain_kills_them_at_once() {
    let dir = scratch_dir("force-stop");
    let cargo = fake_cargo(&dir, CARGO_REPORTING_ITS_TARGET);
    stubborn_services(&dir.join("target").join("debug"), None);
    let mut dev = Dev::start_with_services(&cargo, &dir.join("target"));
    // Until the welcome: every service is running and the API is ready.
    read_until(dev.child().stdout.as_mut().unwrap(), "Fairlane is running");
    let stopping = Instant::now();
    let pid = dev.pid().to_string();
    kill(&pid, "INT");
    // The services ignore the SIGTERM dev sends them; a second Ctrl-C must not wait 40 s. It is
    // sent once dev has taken the first (two signals sent before it looks are one).
    read_until(
        dev.child().stderr.as_mut().unwrap(),
        "stopping every service",
    );
    kill(&pid, "INT");
    let output = dev.finish_within(Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("killing every service still running"),
        "{stderr}"
    );
    assert!(
        stopping.elapsed() < Duration::from_secs(30),
        "{:?}",
        stopping.elapsed()
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_service_that_dies_is_a_failure_even_if_ctrl_c_comes_while_the_rest_stop() {
    let dir = scratch_dir("crash");
    let cargo = fake_cargo(&dir, CARGO_REPORTING_ITS_TARGET);
    let crash_now = dir.join("crash-now");
    stubborn_services(
        &dir.join("target").join("debug"),
        Some(("analyzer-worker", &crash_now)),
    );
    let mut dev = Dev::start_with_services(&cargo, &dir.join("target"));
    read_until(dev.child().stdout.as_mut().unwrap(), "Fairlane is running");
    std::fs::write(&crash_now, "").unwrap();
    // The analyzer stand-in exits; dev stops the rest, which ignore SIGTERM; the user presses
    // Ctrl-C while waiting.
    read_until(
        dev.child().stderr.as_mut().unwrap(),
        "stopping every service",
    );
    kill(&dev.pid().to_string(), "INT");
    let output = dev.finish_within(Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("analyzer-worker exited"), "{stderr}");
    std::fs::remove_dir_all(dir).unwrap();
}
