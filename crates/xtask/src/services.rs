//! Finding or starting the PostgreSQL and Redis servers tests, benchmarks and `dev` need.
//!
//! Order of preference: the URL in the environment; a server on the standard local port that
//! actually lets us in (a PostgreSQL login as `postgres` without a password and `SELECT 1`; a
//! Redis `PING` answered `+PONG`); a private server started from the installed binaries, with its
//! data in `.fairlane/` (as the `postgres` user when running as root, because initdb refuses root).
//! A local server that is there but refuses us (say a stock Debian cluster asking for a password)
//! is passed over with a one-line note saying why.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};

use crate::{say, workspace_root};

const LOCAL_PG: &str = "postgres://postgres@127.0.0.1:5432/postgres";
const LOCAL_REDIS: &str = "redis://127.0.0.1:6379";
// Below Linux's ephemeral range (32768–60999 by default): a port in it can be held for a minute
// by a client socket in TIME-WAIT (the tests' own connections to 5432), and a private server
// then fails to bind, or a test's stand-in listener to take the port.
const PRIVATE_PG_PORT: u16 = 25432;
const PRIVATE_REDIS_PORT: u16 = 26379;

/// How the private PostgreSQL should trade durability for speed.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Durability {
    /// fsync off: for throwaway test data only.
    Tests,
    /// Server defaults: for benchmarks and `dev`.
    Default,
}

/// `XTASK_PRIVATE_SERVERS=1` skips the environment and the standard ports (to exercise the
/// private-server path, or to keep a run away from shared servers).
fn private_only() -> bool {
    std::env::var("XTASK_PRIVATE_SERVERS").is_ok_and(|v| v == "1")
}

/// The environment variable `name`, with an empty value counting as unset (as in every Fairlane
/// service's configuration).
pub(crate) fn env_setting(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|value| !value.is_empty())
}

pub(crate) fn postgres(durability: Durability) -> anyhow::Result<String> {
    if private_only() {
        return start_private_postgres(durability);
    }
    if let Some(url) = env_setting("DATABASE_URL") {
        return Ok(url);
    }
    match usable_postgres("127.0.0.1:5432", LOCAL_PG) {
        Ok(()) => return Ok(LOCAL_PG.to_owned()),
        Err(why) => say(format!("{why}; starting a private one")),
    }
    start_private_postgres(durability)
}

pub(crate) fn redis() -> anyhow::Result<String> {
    if private_only() {
        return start_private_redis();
    }
    if let Some(url) = env_setting("REDIS_URL") {
        return Ok(url);
    }
    match usable_redis("127.0.0.1:6379") {
        Ok(()) => return Ok(LOCAL_REDIS.to_owned()),
        Err(why) => say(format!("{why}; starting a private one")),
    }
    start_private_redis()
}

fn reachable(addr: &str) -> bool {
    addr.parse::<SocketAddr>()
        .ok()
        .and_then(|a| TcpStream::connect_timeout(&a, Duration::from_millis(500)).ok())
        .is_some()
}

/// Whether the PostgreSQL at `addr` lets `url` in: a real login and `SELECT 1` with `psql`,
/// never prompting for a password. A listening port is not enough: a cluster that wants a
/// password the URL lacks would fail every test. `Err` says why, in one line.
fn usable_postgres(addr: &str, url: &str) -> Result<(), String> {
    if !reachable(addr) {
        return Err(format!("no PostgreSQL on {addr}"));
    }
    postgres_login(url).map_err(|why| format!("PostgreSQL on {addr} refuses {url} ({why})"))
}

/// Logs in to `url` with `psql` and runs `SELECT 1`; `Err` holds psql's first line of complaint
/// (e.g. `fe_sendauth: no password supplied`).
fn postgres_login(url: &str) -> Result<(), String> {
    let out = Command::new("psql")
        .args([
            "--no-password",
            "--no-psqlrc",
            "-Atc",
            "SELECT 1",
            &libpq_url(url),
        ])
        .env("PGCONNECT_TIMEOUT", "5")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("could not run psql: {e}"))?;
    if out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "1" {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let why = stderr
        .lines()
        .map(|line| line.trim().trim_start_matches("psql: error: "))
        .find(|line| !line.is_empty())
        .map_or_else(|| format!("psql exited with {}", out.status), str::to_owned);
    Err(why)
}

/// Whether the Redis at `addr` answers `PING` with `+PONG` (one that wants `AUTH` answers
/// `-NOAUTH …`, and would fail every test). `Err` says why, in one line.
fn usable_redis(addr: &str) -> Result<(), String> {
    let mut stream = addr
        .parse::<SocketAddr>()
        .ok()
        .and_then(|a| TcpStream::connect_timeout(&a, Duration::from_millis(500)).ok())
        .ok_or_else(|| format!("no Redis on {addr}"))?;
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let mut reply = Vec::new();
    let mut byte = [0u8; 1];
    let answered = stream.write_all(b"PING\r\n").is_ok()
        && loop {
            match stream.read(&mut byte) {
                Ok(1) if byte[0] == b'\n' => break true,
                Ok(1) if reply.len() < 200 => reply.push(byte[0]),
                _ => break !reply.is_empty(),
            }
        };
    let reply = String::from_utf8_lossy(&reply).trim().to_owned();
    match reply.as_str() {
        "+PONG" => Ok(()),
        _ if !answered => Err(format!("the server on {addr} does not answer Redis's PING")),
        _ => Err(format!("Redis on {addr} answers PING with `{reply}`")),
    }
}

fn state_dir() -> PathBuf {
    workspace_root().join(".fairlane")
}

/// The newest installed PostgreSQL server binaries.
fn postgres_bindir() -> anyhow::Result<PathBuf> {
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output()
        && out.status.success()
    {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if dir.join("initdb").exists() {
            return Ok(dir);
        }
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|entries| entries.flatten().map(|e| e.path().join("bin")).collect())
        .unwrap_or_default();
    versions.retain(|p| p.join("initdb").exists());
    versions.sort();
    versions
        .pop()
        .context("no PostgreSQL server binaries found (install postgresql, or set DATABASE_URL)")
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Runs a PostgreSQL tool, as the `postgres` user when we are root.
fn pg_command(bindir: &Path, tool: &str, args: &[&str]) -> anyhow::Result<()> {
    let program = bindir.join(tool);
    let mut cmd = if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(&program);
        c
    } else {
        Command::new(&program)
    };
    let status = cmd
        .args(args)
        .status()
        .with_context(|| format!("running {}", program.display()))?;
    if !status.success() {
        bail!(
            "{} {} failed with {status}",
            program.display(),
            args.join(" ")
        );
    }
    Ok(())
}

pub(crate) fn start_private_postgres(durability: Durability) -> anyhow::Result<String> {
    Ok(start_private_postgres_owned(durability)?.0)
}

/// A private PostgreSQL server this process started.
pub(crate) struct StartedPostgres {
    bindir: PathBuf,
    data: PathBuf,
}

impl StartedPostgres {
    /// Stops the server, ending its sessions (`pg_ctl stop -m fast`); its data stays for the
    /// next start.
    pub(crate) fn stop(self) -> anyhow::Result<()> {
        pg_command(
            &self.bindir,
            "pg_ctl",
            &[
                "-D",
                &self.data.to_string_lossy(),
                "-m",
                "fast",
                "-w",
                "stop",
            ],
        )
    }
}

/// Like [`start_private_postgres`], and tells whether this call started the server (`None`
/// when one was already running on the private port).
pub(crate) fn start_private_postgres_owned(
    durability: Durability,
) -> anyhow::Result<(String, Option<StartedPostgres>)> {
    let url = format!("postgres://postgres@127.0.0.1:{PRIVATE_PG_PORT}/postgres");
    if reachable(&format!("127.0.0.1:{PRIVATE_PG_PORT}")) {
        return Ok((url, None));
    }
    let bindir = postgres_bindir()?;
    let dir = state_dir().join("postgres");
    let data = dir.join("data");
    std::fs::create_dir_all(&dir).context("creating .fairlane/postgres")?;
    if is_root() {
        // The server runs as `postgres`; it must own its folder and reach it.
        let status = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(&dir)
            .status()?;
        if !status.success() {
            bail!("could not hand {} to the postgres user", dir.display());
        }
        let mut p = dir.parent();
        while let Some(parent) = p {
            // Traversal permission only; nothing is made readable.
            let _ = Command::new("chmod").arg("o+x").arg(parent).status();
            p = parent.parent();
        }
    }
    let data_str = data.to_string_lossy().into_owned();
    if !data.join("PG_VERSION").exists() {
        pg_command(
            &bindir,
            "initdb",
            &[
                "-D",
                &data_str,
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
            ],
        )?;
    }
    let mut options = format!(
        "-p {PRIVATE_PG_PORT} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} -c max_connections=300",
        dir.to_string_lossy()
    );
    if durability == Durability::Tests {
        options.push_str(" -c fsync=off -c synchronous_commit=off -c full_page_writes=off");
    }
    let log = dir.join("server.log").to_string_lossy().into_owned();
    let started = StartedPostgres { bindir, data };
    if let Err(e) = pg_command(
        &started.bindir,
        "pg_ctl",
        &["-D", &data_str, "-o", &options, "-l", &log, "-w", "start"],
    ) {
        // The server runs in a session of its own, so a Ctrl-C that ended `pg_ctl` while it
        // waited has not reached it: stop it (if it never started, this fails harmlessly).
        let _ = started.stop();
        return Err(e);
    }
    say(format!(
        "private PostgreSQL running at {url} (stop: pg_ctl -D {data_str} stop)"
    ));
    Ok((url, Some(started)))
}

fn start_private_redis() -> anyhow::Result<String> {
    let url = format!("redis://127.0.0.1:{PRIVATE_REDIS_PORT}");
    if usable_redis(&format!("127.0.0.1:{PRIVATE_REDIS_PORT}")).is_ok() {
        return Ok(url);
    }
    let dir = state_dir().join("redis");
    std::fs::create_dir_all(&dir)?;
    let status = Command::new("redis-server")
        .args([
            "--port",
            &PRIVATE_REDIS_PORT.to_string(),
            "--bind",
            "127.0.0.1",
            "--daemonize",
            "yes",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
        ])
        .arg(&dir)
        .arg("--logfile")
        .arg(dir.join("redis.log"))
        .status()
        .context("starting redis-server (install redis-server, or set REDIS_URL)")?;
    if !status.success() {
        bail!("redis-server failed to start: {status}");
    }
    for _ in 0..50 {
        if usable_redis(&format!("127.0.0.1:{PRIVATE_REDIS_PORT}")).is_ok() {
            say(format!("private Redis running at {url}"));
            return Ok(url);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("redis-server started but does not answer on port {PRIVATE_REDIS_PORT}")
}

/// Drops databases left by earlier test and bench runs (a test's is kept until then, for
/// inspection after a failure). A database someone is connected to belongs to a run still going
/// (another `cargo xtask test` or bench on the same server) and is left alone: no `FORCE`.
pub(crate) fn drop_old_test_databases(url: &str) {
    let url = libpq_url(url);
    let list = Command::new("psql")
        .args([
            &url,
            "-Atc",
            "SELECT datname FROM pg_database d WHERE datname LIKE 'fairlane\\_test\\_%' \
             AND NOT EXISTS (SELECT FROM pg_stat_activity a WHERE a.datname = d.datname)",
        ])
        .output();
    let Ok(out) = list else { return };
    let names = String::from_utf8_lossy(&out.stdout).into_owned();
    let names: Vec<&str> = names.lines().filter(|l| !l.is_empty()).collect();
    if names.is_empty() {
        return;
    }
    say(format!(
        "dropping {} databases of earlier test and bench runs",
        names.len()
    ));
    for name in names {
        let _ = Command::new("psql")
            .args([&url, "-qc", &format!("DROP DATABASE IF EXISTS \"{name}\"")])
            .output();
    }
}

/// sqlx-specific query parameters are not understood by libpq tools.
pub(crate) fn libpq_url(url: &str) -> String {
    url.split('?').next().unwrap_or(url).to_owned()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::io::{BufRead as _, BufReader, Write as _};
    use std::net::TcpListener;

    use super::*;

    // These use the PostgreSQL and Redis the test run uses (`DATABASE_URL`, `REDIS_URL`, as
    // `cargo xtask test` passes them), else the standard local ones.

    /// `host:port` of `url` (`scheme://[user@]host:port/…`), `default_port` when it names none.
    fn address_of(url: &str, default_port: u16) -> String {
        let authority = url
            .split("://")
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .unwrap_or_default();
        let host_port = authority.rsplit('@').next().unwrap_or(authority);
        if host_port.contains(':') {
            host_port.to_owned()
        } else {
            format!("{host_port}:{default_port}")
        }
    }

    fn under_test(variable: &str, default: &str) -> String {
        std::env::var(variable)
            .ok()
            .filter(|url| !url.is_empty())
            .unwrap_or_else(|| default.to_owned())
    }

    #[test]
    fn a_postgres_that_refuses_the_login_is_not_used() {
        let good = under_test("DATABASE_URL", LOCAL_PG);
        let addr = address_of(&good, 5432);
        assert_eq!(usable_postgres(&addr, &good), Ok(()));
        // The port answers, but the login fails (as it does on a cluster that wants a password).
        let url = format!("postgres://xtask_no_such_role@{addr}/postgres");
        let why = usable_postgres(&addr, &url).unwrap_err();
        assert!(
            why.starts_with(&format!("PostgreSQL on {addr} refuses {url} (")),
            "{why}"
        );
        assert!(why.contains("xtask_no_such_role"), "{why}");
        assert!(!why.contains('\n'), "{why}");
        assert_eq!(
            usable_postgres("127.0.0.1:1", "postgres://postgres@127.0.0.1:1/postgres"),
            Err("no PostgreSQL on 127.0.0.1:1".to_owned())
        );
    }

    #[test]
    fn a_redis_that_wants_auth_is_not_used() {
        let good = under_test("REDIS_URL", LOCAL_REDIS);
        assert_eq!(usable_redis(&address_of(&good, 6379)), Ok(()));
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut line = String::new();
            BufReader::new(&stream).read_line(&mut line).unwrap();
            assert_eq!(line, "PING\r\n");
            (&stream)
                .write_all(b"-NOAUTH Authentication required.\r\n")
                .unwrap();
        });
        assert_eq!(
            usable_redis(&addr),
            Err(format!(
                "Redis on {addr} answers PING with `-NOAUTH Authentication required.`"
            ))
        );
        server.join().unwrap();
    }
}
