//! Finding or starting the PostgreSQL and Redis servers tests, benchmarks and `dev` need.
//!
//! Order of preference: the URL in the environment; a server on the standard local port that
//! actually lets us in (a PostgreSQL login as `postgres` without a password and `SELECT 1`; a
//! Redis `PING` answered `+PONG`); a private server started from the installed binaries, with its
//! data in `.fairlane/` (as the `postgres` user when running as root, because initdb refuses root).
//! A local server that is there but refuses us (say a stock Debian cluster asking for a password)
//! is passed over with a one-line note saying why.

use std::io::{Read, Write};
use std::net::TcpStream;
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

/// A connection to `addr` (`host:port`, a name resolved first: `localhost:5432`), within 500 ms
/// per address.
fn connect(addr: &str) -> Option<TcpStream> {
    use std::net::ToSocketAddrs as _;
    addr.to_socket_addrs()
        .ok()?
        .find_map(|a| TcpStream::connect_timeout(&a, Duration::from_millis(500)).ok())
}

fn reachable(addr: &str) -> bool {
    connect(addr).is_some()
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

/// Logs in to `url` with `psql` and checks that the tests can use the server: PostgreSQL 15 or
/// later (the migrations and test support use its features), not a standby (every test writes),
/// and a role that may create databases (every test gets one). `Err` holds psql's first line of
/// complaint (e.g. `fe_sendauth: no password supplied`) or what is missing.
fn postgres_login(url: &str) -> Result<(), String> {
    let answer = postgres_query(
        url,
        "SELECT current_setting('server_version_num') || '|' || pg_is_in_recovery() || '|' || \
         (SELECT rolsuper OR rolcreatedb FROM pg_roles WHERE rolname = current_user)",
    )?;
    usable_server(&answer)
}

/// [`postgres_login`]'s verdict on its query's answer (`<version_num>|<in recovery>|<can create
/// databases>`, booleans as `true`/`false`).
fn usable_server(answer: &str) -> Result<(), String> {
    let fields: Vec<&str> = answer.split('|').collect();
    let [version, recovery, create] = fields[..] else {
        return Err(format!("its settings read as `{answer}`"));
    };
    match version.parse::<u32>() {
        Ok(v) if v >= 150_000 => {}
        Ok(v) => return Err(format!("it is PostgreSQL {}, not 15 or later", v / 10_000)),
        Err(_) => return Err(format!("its version reads as `{version}`")),
    }
    if recovery != "false" {
        return Err("it is a standby (read-only)".to_owned());
    }
    if create != "true" {
        return Err("the role may not create databases".to_owned());
    }
    Ok(())
}

/// Runs one query returning one value at `url` with `psql`, never prompting for a password;
/// `Err` holds psql's first line of complaint.
fn postgres_query(url: &str, sql: &str) -> Result<String, String> {
    let out = Command::new("psql")
        .args(["--no-password", "--no-psqlrc", "-Atc", sql, &libpq_url(url)])
        .env("PGCONNECT_TIMEOUT", "5")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("could not run psql: {e}"))?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned());
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
    let mut stream = connect(addr).ok_or_else(|| format!("no Redis on {addr}"))?;
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
    // By version number, not as text (`9.6` would come after `16`).
    versions.sort_by_key(|bin| {
        bin.parent()
            .and_then(Path::file_name)
            .map(|v| {
                v.to_string_lossy()
                    .split('.')
                    .map(|part| part.parse::<u32>().unwrap_or(0))
                    .collect::<Vec<u32>>()
            })
            .unwrap_or_default()
    });
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
#[derive(Debug)]
pub(crate) struct StartedPostgres {
    bindir: PathBuf,
    data: PathBuf,
}

impl StartedPostgres {
    /// [`StartedPostgres::stop`], unless another run uses the server (a `cargo xtask test` that
    /// reused the one `dev` started): then it is left running, and says so.
    pub(crate) fn stop_unless_in_use(self) -> anyhow::Result<()> {
        let dir = self
            .data
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        let _turn = take_turn(&dir)?;
        if alone_in_use(&dir)?.is_none() {
            say("another run uses the private PostgreSQL: leaving it running");
            return Ok(());
        }
        self.stop()
    }

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
/// when one was already running on the private port and is used as it is).
pub(crate) fn start_private_postgres_owned(
    durability: Durability,
) -> anyhow::Result<(String, Option<StartedPostgres>)> {
    PrivatePostgres {
        port: PRIVATE_PG_PORT,
        dir: state_dir().join("postgres"),
    }
    .start(durability)
}

/// Where a private PostgreSQL keeps its data and listens: `.fairlane/postgres` and
/// [`PRIVATE_PG_PORT`] for every command (tests use their own).
struct PrivatePostgres {
    port: u16,
    dir: PathBuf,
}

impl PrivatePostgres {
    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Starts the server unless one already runs on the port. A running one is reused, except
    /// that one running with fsync off (started by `cargo xtask test`) is not what a benchmark
    /// or `dev` asked for: it is restarted with the server's defaults when it is this folder's,
    /// and refused otherwise.
    fn start(&self, durability: Durability) -> anyhow::Result<(String, Option<StartedPostgres>)> {
        let url = self.url();
        let data = self.dir.join("data");
        // One run at a time checks, starts or restarts the server: two starting it at once would
        // both run `pg_ctl start`, and the loser's clean-up would stop the winner's server.
        let _turn = take_turn(&self.dir)?;
        if reachable(&format!("127.0.0.1:{}", self.port)) {
            let (fsync, sessions, data_directory) = running_settings(&url).map_err(|why| {
                anyhow::anyhow!(
                    "the server on 127.0.0.1:{} cannot be used as the private PostgreSQL ({why}); \
                     stop it, or set DATABASE_URL",
                    self.port
                )
            })?;
            if durability == Durability::Tests {
                say(format!(
                    "using the private PostgreSQL already running at {url} (left running)"
                ));
                // Held beside the folder the server runs from, which may be another
                // checkout's: the port is the same for every checkout.
                let server_dir = Path::new(&data_directory).parent().unwrap_or(&self.dir);
                if let Err(e) = hold_in_use(server_dir) {
                    say(format!(
                        "could not mark the private PostgreSQL as in use ({e:#}); a `dev` or \
                         bench run meanwhile may restart it"
                    ));
                }
                return Ok((url, None));
            }
            if fsync == "on" {
                say(format!(
                    "using the private PostgreSQL already running at {url} (left running)"
                ));
                hold_in_use(&self.dir)?;
                return Ok((url, None));
            }
            if !same_folder(Path::new(&data_directory), &data) {
                bail!(
                    "the PostgreSQL on 127.0.0.1:{} runs with fsync off and keeps its data in {data_directory}, \
                     not {}: stop it, or set DATABASE_URL",
                    self.port,
                    data.display()
                );
            }
            // Every run that uses the server holds `…/postgres.users` shared while it lives,
            // between its test binaries too: a restart needs it alone.
            let Some(_alone) = alone_in_use(&self.dir)? else {
                bail!(
                    "the private PostgreSQL at {url} runs with fsync off (for tests) and another \
                     run uses it (cargo xtask test?): wait for it, stop the server \
                     (pg_ctl -D {} stop), or set DATABASE_URL",
                    data.display()
                );
            };
            if sessions > 0 {
                bail!(
                    "the private PostgreSQL at {url} runs with fsync off (for tests) and {sessions} \
                     other sessions use it (a test run?): wait for them, stop it \
                     (pg_ctl -D {} stop), or set DATABASE_URL",
                    data.display()
                );
            }
            say(format!(
                "the private PostgreSQL at {url} runs with fsync off (for tests); restarting it with durable settings"
            ));
            StartedPostgres {
                bindir: postgres_bindir()?,
                data: data.clone(),
            }
            .stop()?;
        }
        let bindir = postgres_bindir()?;
        let dir = &self.dir;
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        if is_root() {
            // The server runs as `postgres`; it must own its folder and reach it.
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(dir)
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
        let init = || -> anyhow::Result<()> {
            if data.join("PG_VERSION").exists() {
                return Ok(());
            }
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
            )
        };
        init()?;
        // Clients connect over TCP only: no Unix socket, whose path (in the checkout) could
        // pass the kernel's 107 bytes, and no path in the options pg_ctl hands to a shell.
        let mut options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' -c max_connections=300",
            self.port
        );
        if durability == Durability::Tests {
            options.push_str(" -c fsync=off -c synchronous_commit=off -c full_page_writes=off");
        }
        let log = dir.join("server.log");
        let log_str = log.to_string_lossy().into_owned();
        let start = || {
            pg_command(
                &bindir,
                "pg_ctl",
                &[
                    "-D", &data_str, "-o", &options, "-l", &log_str, "-w", "start",
                ],
            )
        };
        let stop = || {
            // The server runs in a session of its own, so a Ctrl-C that ended `pg_ctl` while it
            // waited has not reached it: stop it (if it never started, this fails harmlessly).
            let _ = StartedPostgres {
                bindir: bindir.clone(),
                data: data.clone(),
            }
            .stop();
        };
        let mut started = start();
        if started.is_err() && durability == Durability::Tests {
            // A test cluster's data is throwaway: one that cannot start (left by other server
            // binaries, or by a machine reset with fsync off) is made again rather than
            // failing every run until someone deletes it.
            stop();
            say(format!(
                "the private PostgreSQL in {} did not start; making its test data folder again. \
                 The end of {}:\n{}",
                data.display(),
                log.display(),
                last_lines(&log, 5)
            ));
            std::fs::remove_dir_all(&data)
                .with_context(|| format!("removing {}", data.display()))?;
            init()?;
            started = start();
        }
        if let Err(e) = started {
            stop();
            return Err(e.context(format!(
                "the private PostgreSQL did not start; the end of {}:\n{}",
                log.display(),
                last_lines(&log, 5)
            )));
        }
        let started = StartedPostgres { bindir, data };
        say(format!(
            "private PostgreSQL running at {url} (stop: pg_ctl -D {data_str} stop)"
        ));
        hold_in_use(&self.dir)?;
        Ok((url, Some(started)))
    }
}

/// The file `dir` with `extension` (`.fairlane/postgres.lock` beside `.fairlane/postgres`),
/// created if need be. An existing one is opened for reading only, which is all `flock` needs:
/// a root run's file stays usable by a later run as another user.
fn lock_file_beside(dir: &Path, extension: &str) -> anyhow::Result<std::fs::File> {
    let path = dir.with_extension(extension);
    match std::fs::File::open(&path) {
        Ok(file) => return Ok(file),
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("opening {}", path.display()));
        }
        Err(_) => {}
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("creating {}", path.display()))
}

/// Marks this process as a user of the server kept in `dir` until it exits: a shared lock on
/// `dir.users`, which a restart or a stop must take alone.
fn hold_in_use(dir: &Path) -> anyhow::Result<()> {
    let file = lock_file_beside(dir, "users")?;
    file.lock_shared()
        .context("locking the private PostgreSQL's users file")?;
    in_use()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(dir.to_path_buf(), file);
    Ok(())
}

/// Waits for (and then holds, until the returned file is dropped) the lock beside the server
/// kept in `dir`: one run at a time checks, starts, restarts or stops it.
fn take_turn(dir: &Path) -> anyhow::Result<std::fs::File> {
    let file = lock_file_beside(dir, "lock")?;
    if file.try_lock().is_err() {
        say("waiting for another run that is starting or stopping the private PostgreSQL");
        file.lock()
            .with_context(|| format!("locking {}", dir.with_extension("lock").display()))?;
    }
    Ok(file)
}

/// Whether this process is the only run using the server kept in `dir`: it lets go of its own
/// hold and tries `dir.users` alone. `Some` holds that lock until dropped (long enough to
/// restart or stop the server); `None` means another run holds it.
fn alone_in_use(dir: &Path) -> anyhow::Result<Option<std::fs::File>> {
    release_in_use(dir);
    let users = lock_file_beside(dir, "users")?;
    Ok(users.try_lock().is_ok().then_some(users))
}

/// Lets go of this process's own hold on the server kept in `dir` (before it restarts or stops
/// the server itself).
fn release_in_use(dir: &Path) {
    in_use()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .remove(dir);
}

/// This process's shared locks on the private servers it uses, by folder.
fn in_use() -> &'static std::sync::Mutex<std::collections::HashMap<PathBuf, std::fs::File>> {
    static IN_USE: std::sync::OnceLock<
        std::sync::Mutex<std::collections::HashMap<PathBuf, std::fs::File>>,
    > = std::sync::OnceLock::new();
    IN_USE.get_or_init(Default::default)
}

/// `fsync`, how many other client sessions are connected, and `data_directory` of the server
/// at `url`.
fn running_settings(url: &str) -> Result<(String, u64, String), String> {
    let row = postgres_query(
        url,
        "SELECT current_setting('fsync') || ' ' || \
           (SELECT count(*) FROM pg_stat_activity \
            WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()) || ' ' || \
           current_setting('data_directory')",
    )?;
    let mut parts = row.splitn(3, ' ');
    match (parts.next(), parts.next().map(str::parse), parts.next()) {
        (Some(fsync), Some(Ok(sessions)), Some(dir)) => {
            Ok((fsync.to_owned(), sessions, dir.to_owned()))
        }
        _ => Err(format!("unexpected answer `{row}`")),
    }
}

/// Whether two paths name the same folder (both canonicalised when they exist).
fn same_folder(a: &Path, b: &Path) -> bool {
    let canonical = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    canonical(a) == canonical(b)
}

/// The last `n` lines of a log file, or a note that it could not be read.
fn last_lines(path: &Path, n: usize) -> String {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(n)..].join("\n")
        }
        Err(e) => format!("(could not read it: {e})"),
    }
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

/// How old a test database with no session must be to be taken for a finished run's. A running
/// test's database has no session for a moment after it is created, and while a test has
/// terminated its connections on purpose; no test runs this long (nextest's timeout is 5 min).
const FINISHED_TEST_DATABASE_AGE: Duration = Duration::from_secs(15 * 60);

/// Whether the test database `name` (`fairlane_test_<uuid>`) is old enough to be a finished run's
/// at `now`: its id is a version 7 UUID, whose first 48 bits are its creation time in Unix
/// milliseconds. Other ids (older runs' random ones) are taken as old.
fn finished_test_database(name: &str, now: std::time::SystemTime) -> bool {
    let Some(id) = name.strip_prefix("fairlane_test_") else {
        return false;
    };
    let created_ms = (id.len() == 32 && id.as_bytes()[12] == b'7')
        .then(|| u64::from_str_radix(&id[..12], 16).ok())
        .flatten();
    let Some(created_ms) = created_ms else {
        return true;
    };
    let created = std::time::UNIX_EPOCH + Duration::from_millis(created_ms);
    now.duration_since(created)
        .is_ok_and(|age| age >= FINISHED_TEST_DATABASE_AGE)
}

/// Drops databases left by earlier test and bench runs (a test's is kept until then, for
/// inspection after a failure). A database someone is connected to belongs to a run still going
/// (another `cargo xtask test` or bench on the same server) and is left alone: no `FORCE`; so is
/// one created in the last [`FINISHED_TEST_DATABASE_AGE`], which may be a running test's between
/// its sessions.
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
    let now = std::time::SystemTime::now();
    let names: Vec<&str> = names
        .lines()
        .filter(|name| !name.is_empty() && finished_test_database(name, now))
        .collect();
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

    #[test]
    fn only_a_writable_postgresql_15_whose_role_creates_databases_is_used() {
        assert_eq!(usable_server("150019|false|true"), Ok(()));
        assert_eq!(usable_server("170002|false|true"), Ok(()));
        assert_eq!(
            usable_server("140011|false|true"),
            Err("it is PostgreSQL 14, not 15 or later".to_owned())
        );
        assert_eq!(
            usable_server("150019|true|true"),
            Err("it is a standby (read-only)".to_owned())
        );
        assert_eq!(
            usable_server("150019|false|false"),
            Err("the role may not create databases".to_owned())
        );
        assert!(usable_server("garbage").is_err());
    }

    #[test]
    fn only_test_databases_older_than_any_test_are_taken_for_finished_runs() {
        let now = std::time::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let named = |age: Duration| {
            let created = (now - age)
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis();
            format!("fairlane_test_{created:012x}7abc8def0123456789ab")
        };
        assert!(!finished_test_database(&named(Duration::from_secs(1)), now));
        assert!(!finished_test_database(
            &named(Duration::from_secs(14 * 60)),
            now
        ));
        assert!(finished_test_database(
            &named(Duration::from_secs(16 * 60)),
            now
        ));
        // A random (version 4) id from before: its time is unknown.
        assert!(finished_test_database(
            "fairlane_test_3f2a9c1e5b7d4e0f8a6b2c4d1e3f5a7b",
            now
        ));
        assert!(!finished_test_database("fairlane", now));
        // The id a test database gets today reads as just created.
        let fresh = format!("fairlane_test_{}", uuid::Uuid::now_v7().simple());
        assert!(!finished_test_database(
            &fresh,
            std::time::SystemTime::now()
        ));
    }

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
        // A host name is resolved (a `DATABASE_URL` naming `localhost` was taken for no server).
        let port = addr.rsplit_once(':').unwrap().1;
        if addr.starts_with("127.0.0.1:") {
            assert!(reachable(&format!("localhost:{port}")));
        }
        assert!(!reachable("no-such-host.invalid:5432"));
    }

    /// A private server in a folder and on a port of its own, stopped when dropped.
    struct ScratchServer {
        postgres: PrivatePostgres,
    }

    impl ScratchServer {
        fn new(label: &str) -> ScratchServer {
            let dir = std::env::temp_dir()
                .join(format!("fairlane-xtask-pg-{label}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            let port = TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            ScratchServer {
                postgres: PrivatePostgres { port, dir },
            }
        }

        fn fsync(&self) -> String {
            running_settings(&self.postgres.url()).unwrap().0
        }

        fn stop(&self) {
            let _ = StartedPostgres {
                bindir: postgres_bindir().unwrap(),
                data: self.postgres.dir.join("data"),
            }
            .stop();
        }
    }

    impl Drop for ScratchServer {
        fn drop(&mut self) {
            self.stop();
            let _ = std::fs::remove_dir_all(&self.postgres.dir);
            for lock in ["lock", "users"] {
                let _ = std::fs::remove_file(self.postgres.dir.with_extension(lock));
            }
        }
    }

    /// A test cluster whose data cannot start (here: written by a server of another major
    /// version) is made again; a durable one (`dev`'s, a benchmark's) is never thrown away.
    #[test]
    fn a_private_postgres_for_tests_that_cannot_start_is_made_again_and_a_durable_one_is_kept() {
        let server = ScratchServer::new("rebuild");
        server.postgres.start(Durability::Tests).unwrap();
        server.stop();
        let version = server.postgres.dir.join("data/PG_VERSION");
        std::fs::write(&version, "9\n").unwrap();
        let refused = server
            .postgres
            .start(Durability::Default)
            .unwrap_err()
            .to_string();
        assert!(refused.contains("did not start"), "{refused}");
        assert_eq!(std::fs::read_to_string(&version).unwrap(), "9\n", "kept");
        let (_, started) = server.postgres.start(Durability::Tests).unwrap();
        assert!(started.is_some());
        assert_ne!(std::fs::read_to_string(&version).unwrap(), "9\n");
        assert_eq!(server.fsync(), "off");
    }

    #[test]
    fn a_private_postgres_left_running_without_fsync_is_not_used_for_durable_work() {
        let server = ScratchServer::new("durability");
        let (_, started) = server.postgres.start(Durability::Tests).unwrap();
        assert!(started.is_some());
        assert_eq!(server.fsync(), "off");
        // Tests reuse it as it is.
        let (_, reused) = server.postgres.start(Durability::Tests).unwrap();
        assert!(reused.is_none());
        // Not while another run holds it (a test run between its test binaries).
        let other_run = server.postgres.dir.with_extension("users");
        let other_run = std::fs::File::open(&other_run).unwrap();
        other_run.lock_shared().unwrap();
        let in_use = server
            .postgres
            .start(Durability::Default)
            .unwrap_err()
            .to_string();
        assert!(in_use.contains("another run uses it"), "{in_use}");
        drop(other_run);
        hold_in_use(&server.postgres.dir).unwrap();
        // Not while another session uses it (a test run would lose its database).
        let mut user = Command::new("psql")
            .args([
                "--no-psqlrc",
                "-qAtc",
                "SELECT pg_sleep(2)",
                &server.postgres.url(),
            ])
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while running_settings(&server.postgres.url()).unwrap().1 == 0 {
            assert!(std::time::Instant::now() < deadline, "psql never connected");
            std::thread::sleep(Duration::from_millis(20));
        }
        let in_use = server
            .postgres
            .start(Durability::Default)
            .unwrap_err()
            .to_string();
        assert!(in_use.contains("other sessions use it"), "{in_use}");
        assert_eq!(server.fsync(), "off");
        assert!(user.wait().unwrap().success());
        while running_settings(&server.postgres.url()).unwrap().1 > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "psql's session never ended"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // A benchmark (or dev) gets it restarted with durable settings.
        let (_, restarted) = server.postgres.start(Durability::Default).unwrap();
        assert!(restarted.is_some());
        assert_eq!(server.fsync(), "on");
        let (_, reused) = server.postgres.start(Durability::Default).unwrap();
        assert!(reused.is_none());

        // Another folder's server running without fsync is refused, and left running.
        server.stop();
        server.postgres.start(Durability::Tests).unwrap();
        let other = PrivatePostgres {
            port: server.postgres.port,
            dir: server.postgres.dir.join("elsewhere"),
        };
        let refused = other.start(Durability::Default).unwrap_err().to_string();
        assert!(refused.contains("runs with fsync off"), "{refused}");
        assert_eq!(server.fsync(), "off");
    }

    #[test]
    fn two_runs_starting_the_private_postgres_at_once_take_turns() {
        let server = ScratchServer::new("together");
        let started: Vec<bool> = std::thread::scope(|scope| {
            let runs: Vec<_> = (0..2)
                .map(|_| scope.spawn(|| server.postgres.start(Durability::Tests)))
                .collect();
            runs.into_iter()
                .map(|run| run.join().unwrap().unwrap().1.is_some())
                .collect()
        });
        assert_eq!(
            started.iter().filter(|s| **s).count(),
            1,
            "one starts it, the other uses it: {started:?}"
        );
        assert_eq!(server.fsync(), "off", "and it is still running");
    }

    #[test]
    fn a_private_postgres_another_run_uses_is_not_stopped_under_it() {
        let server = ScratchServer::new("stop-in-use");
        let (_, started) = server.postgres.start(Durability::Tests).unwrap();
        let started = started.unwrap();
        // A test run that reused the server `dev` started.
        let other_run = std::fs::File::open(server.postgres.dir.with_extension("users")).unwrap();
        other_run.lock_shared().unwrap();
        StartedPostgres {
            bindir: started.bindir.clone(),
            data: started.data.clone(),
        }
        .stop_unless_in_use()
        .unwrap();
        assert_eq!(server.fsync(), "off", "still running for the other run");
        drop(other_run);
        started.stop_unless_in_use().unwrap();
        assert!(
            running_settings(&server.postgres.url()).is_err(),
            "stopped once no one else uses it"
        );
    }

    #[test]
    fn a_private_postgres_that_cannot_start_shows_the_end_of_its_log() {
        let server = ScratchServer::new("broken");
        server.postgres.start(Durability::Tests).unwrap();
        server.stop();
        // A setting the server refuses at start.
        let conf = server.postgres.dir.join("data/postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).unwrap();
        text.push_str("\nshared_buffers = 'lots'\n");
        std::fs::write(&conf, text).unwrap();
        // A durable cluster (dev's, a benchmark's) is not made again: its failure is shown.
        let e = server.postgres.start(Durability::Default).unwrap_err();
        let message = format!("{e:#}");
        assert!(
            message.contains("the private PostgreSQL did not start"),
            "{message}"
        );
        assert!(message.contains("shared_buffers"), "{message}");
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
