//! `cargo xtask dev` refuses what it cannot use before it starts anything: `--port 0` and the
//! ports of the other services (it used to build everything, start the services and fail after
//! its 60 s readiness wait), and it treats an empty `DATABASE_URL` as unset, as every service
//! does (it used to hand the empty URL to the services, which then used their default database).
//! A port something already listens on is refused up front too (dev used to print its welcome,
//! then lose the web service, which could not listen).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A fresh folder for one test's stand-in tools and their marker files.
fn scratch_dir(label: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fairlane-xtask-{label}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes an executable shell script `name` into `dir` that records its arguments in
/// `<name>.called` and fails.
fn stand_in(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    let marker = dir.join(format!("{name}.called"));
    std::fs::write(
        &path,
        format!("#!/bin/sh\necho \"$@\" >> '{}'\nexit 1\n", marker.display()),
    )
    .unwrap();
    let status = Command::new("chmod").arg("+x").arg(&path).status().unwrap();
    assert!(status.success());
    path
}

/// Writes an executable shell script `name` into `dir` that records its arguments in
/// `<name>.called` and exits with `code`.
fn stand_in_exiting(dir: &Path, name: &str, code: u8) -> PathBuf {
    let path = stand_in(dir, name);
    let script = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, script.replace("exit 1\n", &format!("exit {code}\n"))).unwrap();
    path
}

/// A port nothing listens on.
fn spare_port() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port().to_string()
}

/// Runs `xtask dev` with `args` and `envs`, the stand-in cargo of `dir` and `dir` first on the
/// PATH; it must exit within 30 s.
fn dev(dir: &Path, args: &[&str], envs: &[(&str, &str)]) -> Output {
    let path = format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .arg("dev")
        .args(args)
        .env("CARGO", dir.join("cargo"))
        .env("PATH", path)
        .env_remove("REDIS_URL")
        .env_remove("XTASK_PRIVATE_SERVERS")
        .envs(envs.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("xtask dev {args:?} still runs after 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn ports_dev_cannot_serve_on_are_refused_before_anything_starts() {
    let dir = scratch_dir("port");
    stand_in(&dir, "cargo");
    for (port, expected) in [
        (
            "0",
            "xtask: --port 0: the API needs a fixed port (dev waits for it there and prints it)",
        ),
        (
            "9092",
            "xtask: --port 9092 is specgen-worker's HTTP port; dev gives the other services 9091 (analyzer-worker), 9092 (specgen-worker), 9093 (scheduler): choose another",
        ),
    ] {
        let out = dev(
            &dir,
            &["--port", port],
            &[(
                "DATABASE_URL",
                "postgres://postgres@127.0.0.1:1/never-reached",
            )],
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "--port {port}: {stderr}");
        assert_eq!(stderr.trim_end(), expected);
        assert!(
            !dir.join("cargo.called").exists(),
            "--port {port}: dev started building"
        );
    }
    for port in ["9091", "9093"] {
        let out = dev(
            &dir,
            &["--port", port],
            &[(
                "DATABASE_URL",
                "postgres://postgres@127.0.0.1:1/never-reached",
            )],
        );
        assert_eq!(out.status.code(), Some(1));
        assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("--port {port} is ")));
    }
    assert!(!dir.join("cargo.called").exists());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn an_empty_database_url_is_unset() {
    let dir = scratch_dir("empty-url");
    stand_in(&dir, "cargo");
    let psql = stand_in(&dir, "psql");
    // Something answers on the private server's port (this listener, or a private server
    // already running), so dev takes that path without initdb; the stand-in psql keeps it from
    // touching whatever answers. It says the server is durable, and refuses everything else.
    let script = std::fs::read_to_string(&psql).unwrap().replace(
        "exit 1\n",
        "case \"$*\" in *current_setting*) echo 'on 0 /elsewhere'; exit 0;; esac\nexit 1\n",
    );
    std::fs::write(&psql, script).unwrap();
    let _listener = std::net::TcpListener::bind("127.0.0.1:25432");
    let out = dev(&dir, &["--port", &spare_port()], &[("DATABASE_URL", "")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("could not create database fairlane_dev"),
        "{stderr}"
    );
    let psql = std::fs::read_to_string(dir.join("psql.called")).expect("dev never ran psql");
    assert!(psql.contains("127.0.0.1:25432"), "{psql}");
    assert!(
        !dir.join("cargo.called").exists(),
        "dev went on with the empty DATABASE_URL"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_port_in_use_is_refused_before_anything_starts() {
    let dir = scratch_dir("port-in-use");
    stand_in(&dir, "cargo");
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = holder.local_addr().unwrap().port().to_string();
    let out = dev(
        &dir,
        &["--port", &port],
        &[(
            "DATABASE_URL",
            "postgres://postgres@127.0.0.1:1/never-reached",
        )],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(&format!(
            "xtask: --port {port}: cannot listen on 127.0.0.1:{port} ("
        )),
        "{stderr}"
    );
    assert!(
        stderr.trim_end().ends_with("); choose another port"),
        "{stderr}"
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("Fairlane is running"));
    assert!(
        !dir.join("cargo.called").exists(),
        "dev started building with port {port} taken"
    );
    drop(holder);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_services_are_run_from_the_target_directory_cargo_reports() {
    // Cargo decides where its output goes (CARGO_TARGET_DIR, `build.target-dir` in any cargo
    // configuration): dev asks it, instead of guessing from its own environment.
    let dir = scratch_dir("target-dir");
    let cargo = stand_in_exiting(&dir, "cargo", 0);
    let elsewhere = dir.join("elsewhere");
    let script = std::fs::read_to_string(&cargo).unwrap().replace(
        "exit 0\n",
        &format!(
            "[ \"$1\" = metadata ] && echo '{{\"target_directory\":\"{}\"}}'\nexit 0\n",
            elsewhere.display()
        ),
    );
    std::fs::write(&cargo, script).unwrap();
    let debug = elsewhere.join("debug");
    std::fs::create_dir_all(&debug).unwrap();
    stand_in(&debug, "web");
    let out = dev(
        &dir,
        &["--port", &spare_port()],
        &[(
            "DATABASE_URL",
            "postgres://postgres@127.0.0.1:1/never-reached",
        )],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let web = std::fs::read_to_string(debug.join("web.called"))
        .unwrap_or_else(|_| panic!("dev did not run web from CARGO_TARGET_DIR:\n{stderr}"));
    assert_eq!(web.trim_end(), "migrate");
    std::fs::remove_dir_all(dir).unwrap();
}
