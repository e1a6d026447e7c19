//! `cargo xtask dev`: the whole system on this machine. Without `DATABASE_URL` (unset or empty, as
//! everywhere) it starts a private PostgreSQL from the installed server binaries (in `.fairlane/`),
//! creates the `fairlane_dev` database and migrates it; creates one demo user per tier and prints
//! their API keys and a sample `curl`; starts every Fairlane service; and on Ctrl-C stops them
//! all, then the private PostgreSQL if this run started it. A Ctrl-C during those startup steps
//! stops the same way: the handler is installed first, and the next step does not start. Without
//! `REDIS_URL` the API uses the in-memory rate limiter. `--port` is the API's; 0 and the other
//! services' ports (9091–9093) are refused before anything starts, and so is a port something
//! already listens on (the API's, or one of 9091–9093). The welcome is printed only once every
//! service is still running and the API's `/readyz` answers 200.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::services::{self, Durability, env_setting, libpq_url};
use crate::test::cargo;
use crate::{say, workspace_root};

const TIERS: [&str; 4] = ["free", "pro", "pro_plus", "enterprise"];

/// The services `dev` runs: binary, the port of its HTTP surface.
const SERVICES: [(&str, u16); 4] = [
    ("analyzer-worker", 9091),
    ("specgen-worker", 9092),
    ("scheduler", 9093),
    ("web", 0),
];

pub(crate) fn run(port: u16) -> anyhow::Result<()> {
    // Before anything starts: a port dev cannot use would only fail after the 60 s readiness wait.
    check_port(port)?;
    check_ports_free(port)?;
    // First of all: until this handler is in place, a Ctrl-C kills xtask outright, no `Drop`
    // runs, and a private PostgreSQL this run started (in a session of its own, out of reach
    // of the terminal's Ctrl-C) would keep running.
    let stop = StopRequest::install()?;
    match start_and_run(port, &stop) {
        // Decided when the service died: a Ctrl-C during the stop that follows does not make
        // it an interruption.
        Err(e) if e.is::<ServiceDied>() => Err(e),
        Err(e) if e.is::<Interrupted>() => {
            say("interrupted; everything this run started is stopped");
            Ok(())
        }
        // A step's child process got the terminal's Ctrl-C too, and failed because of it. The
        // handler's thread sets the flag; it may run a moment after the child's exit is seen.
        Err(e) if stop.requested_within(Duration::from_secs(1)) => {
            say(format!(
                "interrupted ({e:#}); everything this run started is stopped"
            ));
            Ok(())
        }
        other => other,
    }
}

/// Refuses an API port that `dev` cannot serve on: 0 (dev waits for the API on the port it
/// gave it, and prints it) and the fixed ports of the other services' HTTP surfaces.
fn check_port(port: u16) -> anyhow::Result<()> {
    if port == 0 {
        bail!("--port 0: the API needs a fixed port (dev waits for it there and prints it)");
    }
    if let Some((bin, _)) = SERVICES.iter().find(|(_, p)| *p == port) {
        let taken: Vec<String> = SERVICES
            .iter()
            .filter(|(_, p)| *p != 0)
            .map(|(b, p)| format!("{p} ({b})"))
            .collect();
        bail!(
            "--port {port} is {bin}'s HTTP port; dev gives the other services {}: choose another",
            taken.join(", ")
        );
    }
    Ok(())
}

/// Where `cargo build` (run in `root`) puts its output, as cargo reports it: `CARGO_TARGET_DIR`,
/// `build.target-dir` of any cargo configuration, else `root/target`. Guessing from the
/// environment alone ran stale binaries from `target/` (or none) for anyone whose cargo
/// configuration moves the target directory.
fn target_dir(root: &Path) -> anyhow::Result<std::path::PathBuf> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .current_dir(root)
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo metadata")?;
    if !out.status.success() {
        bail!("cargo metadata failed ({})", out.status);
    }
    let metadata: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("cargo metadata printed no JSON")?;
    metadata["target_directory"]
        .as_str()
        .map(std::path::PathBuf::from)
        .context("cargo metadata names no target_directory")
}

/// Refuses to start when one of the ports dev gives out is taken: otherwise dev would build,
/// migrate and start everything, and the service that cannot listen would die only then.
fn check_ports_free(port: u16) -> anyhow::Result<()> {
    listen_test(port).map_err(|e| {
        anyhow::anyhow!(
            "--port {port}: cannot listen on 127.0.0.1:{port} ({e}); choose another port"
        )
    })?;
    for (bin, fixed) in SERVICES.iter().filter(|(b, p)| *p != 0 && has_crate(b)) {
        listen_test(*fixed).map_err(|e| {
            anyhow::anyhow!(
                "cannot listen on 127.0.0.1:{fixed}, which dev gives {bin} ({e}); stop what uses it"
            )
        })?;
    }
    Ok(())
}

/// Binds 127.0.0.1:`port` (as the services will) and lets it go at once.
fn listen_test(port: u16) -> std::io::Result<()> {
    std::net::TcpListener::bind(("127.0.0.1", port)).map(drop)
}

/// Whether this checkout has the service `bin` (dev runs the ones it has).
fn has_crate(bin: &str) -> bool {
    workspace_root().join("crates").join(bin).exists()
}

/// The startup steps, then the services until a stop is requested or one of them dies. The
/// stop request is checked between steps; whatever was started is stopped on every way out
/// (the guards' `Drop`).
fn start_and_run(port: u16, stop: &StopRequest) -> anyhow::Result<()> {
    let root = workspace_root();
    // Declared before the services, so that on every way out it is dropped after them.
    let mut private_postgres = PrivatePostgres(None);
    let database_url = match env_setting("DATABASE_URL") {
        Some(url) => url,
        None => {
            let (server, started) = services::start_private_postgres_owned(Durability::Default)?;
            private_postgres.0 = started;
            stop.check()?;
            create_database(&server, "fairlane_dev")?;
            with_database(&server, "fairlane_dev")
        }
    };
    stop.check()?;
    let bins: Vec<&str> = SERVICES
        .iter()
        .map(|(b, _)| *b)
        .filter(|b| has_crate(b))
        .collect();
    say(format!("building {}", bins.join(", ")));
    let mut args = vec!["build", "--quiet"];
    for b in &bins {
        args.extend(["--bin", b]);
    }
    cargo(&root, &args, &[])?;
    stop.check()?;
    let target = target_dir(&root)?.join("debug");

    let admin_token = dev_admin_token()?;
    let mut env: Vec<(String, String)> = vec![
        ("DATABASE_URL".into(), database_url),
        ("ADMIN_TOKEN".into(), admin_token.clone()),
        ("HTTP_ADDR".into(), format!("127.0.0.1:{port}")),
        ("LOG_FORMAT".into(), "pretty".into()),
        ("ANALYZER_ALLOW_FILE_URLS".into(), "true".into()),
        (
            "RATELIMIT_RULES".into(),
            root.join("deploy/ratelimit/rules.yaml")
                .to_string_lossy()
                .into_owned(),
        ),
    ];
    if let Some(redis) = env_setting("REDIS_URL") {
        env.push(("REDIS_URL".into(), redis));
    }
    if std::env::var_os("RUST_LOG").is_none() {
        env.push(("RUST_LOG".into(), "info,sqlx=warn".into()));
    }

    say("migrating");
    run_tool(&target.join("web"), &["migrate"], &env)?;
    stop.check()?;
    let keys = demo_keys(&target.join("web"), &env, stop)?;

    let mut running = Services(Vec::new());
    for (bin, http_port) in SERVICES.iter().filter(|(b, _)| bins.contains(b)) {
        stop.check()?;
        let mut child_env = env.clone();
        if *http_port != 0 {
            child_env.retain(|(k, _)| k != "HTTP_ADDR");
            child_env.push(("HTTP_ADDR".into(), format!("127.0.0.1:{http_port}")));
        }
        let child = Command::new(target.join(bin))
            .envs(child_env)
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {bin}"))?;
        running.0.push(((*bin).to_owned(), child));
    }
    wait_ready(port, stop, &mut running)?;
    stop.check()?;
    print_welcome(port, &keys, &admin_token);

    // Run until Ctrl-C or until a service dies.
    let mut failed = None;
    while !stop.requested() && failed.is_none() {
        for (name, child) in &mut running.0 {
            if let Ok(Some(status)) = child.try_wait() {
                failed = Some(format!("{name} exited ({status})"));
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // A service that exited because the terminal's Ctrl-C reached it too was not a crash: the
    // handler's flag may be set a moment after its exit is seen. Decided now, before the stop.
    let died = failed.filter(|_| !stop.requested_within(Duration::from_secs(1)));
    running.stop();
    private_postgres.stop();
    match died {
        Some(reason) => Err(ServiceDied(reason).into()),
        None => Ok(()),
    }
}

/// A service exited on its own while `dev` ran.
#[derive(Debug)]
struct ServiceDied(String);

impl std::fmt::Display for ServiceDied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ServiceDied {}

/// How many times Ctrl-C (SIGINT), SIGTERM or SIGHUP has arrived. The handler only counts:
/// [`start_and_run`] checks for a first one between its steps and in its main loop, and
/// [`Services::stop`] takes one that arrives while it waits as "kill them now".
static STOP_SIGNALS: AtomicUsize = AtomicUsize::new(0);

/// Whether a stop has been asked for.
struct StopRequest;

impl StopRequest {
    fn install() -> anyhow::Result<StopRequest> {
        ctrlc::set_handler(|| {
            STOP_SIGNALS.fetch_add(1, Ordering::SeqCst);
        })
        .context("installing the Ctrl-C handler")?;
        Ok(StopRequest)
    }

    fn requested(&self) -> bool {
        STOP_SIGNALS.load(Ordering::SeqCst) > 0
    }

    /// Whether a stop is requested now or within `grace`.
    fn requested_within(&self, grace: Duration) -> bool {
        let deadline = Instant::now() + grace;
        while !self.requested() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }

    /// `Err(Interrupted)` once a stop was requested: the next step must not start.
    fn check(&self) -> Result<(), Interrupted> {
        if self.requested() {
            Err(Interrupted)
        } else {
            Ok(())
        }
    }
}

/// A stop was requested before `dev` finished starting.
#[derive(Debug)]
struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted")
    }
}

impl std::error::Error for Interrupted {}

/// The services [`run`] started. Dropping it stops them, so an early error leaves none running.
struct Services(Vec<(String, Child)>);

impl Services {
    /// SIGTERM to each, so that each drains; a service still running 40 s later is killed, and
    /// so is every one still running when another Ctrl-C arrives meanwhile.
    fn stop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        let signals_before = STOP_SIGNALS.load(Ordering::SeqCst);
        say("stopping every service (Ctrl-C again to kill them at once)");
        for (name, child) in &mut self.0 {
            // One that already exited is reaped: its pid may be another process's by now.
            if child.try_wait().ok().flatten().is_none() {
                terminate(name, child);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(40);
        let mut forced = false;
        for (name, child) in &mut self.0 {
            while child.try_wait().ok().flatten().is_none() {
                if !forced && STOP_SIGNALS.load(Ordering::SeqCst) > signals_before {
                    forced = true;
                    say("killing every service still running");
                }
                if forced || Instant::now() > deadline {
                    if !forced {
                        say(format!("{name} did not stop in time; killing it"));
                    }
                    let _ = child.kill();
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        self.0.clear();
    }
}

impl Drop for Services {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The private PostgreSQL, if [`run`] started it (one that was already running is left so).
/// Dropping it stops the server; its data stays for the next run.
struct PrivatePostgres(Option<services::StartedPostgres>);

impl PrivatePostgres {
    fn stop(&mut self) {
        if let Some(server) = self.0.take() {
            say("stopping the private PostgreSQL (its data stays in .fairlane/postgres)");
            if let Err(e) = server.stop_unless_in_use() {
                say(format!("could not stop the private PostgreSQL: {e:#}"));
            }
        }
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        self.stop();
    }
}

/// SIGTERM, so the service drains; Ctrl-C in a terminal has usually sent SIGINT already.
fn terminate(name: &str, child: &Child) {
    let pid = i32::try_from(child.id()).map(nix::unistd::Pid::from_raw);
    let sent = pid.map(|pid| nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM));
    if let Ok(Err(e)) = sent {
        say(format!("could not send SIGTERM to {name}: {e}"));
    }
}

fn run_tool(program: &Path, args: &[&str], env: &[(String, String)]) -> anyhow::Result<String> {
    let out = Command::new(program)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env("RUST_LOG", "warn")
        .output()
        .with_context(|| format!("running {}", program.display()))?;
    if !out.status.success() {
        bail!(
            "{} {} failed: {}",
            program.display(),
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// One demo user per tier, each with a fresh API key: (tier, user id, key).
fn demo_keys(
    web: &Path,
    env: &[(String, String)],
    stop: &StopRequest,
) -> anyhow::Result<Vec<(String, String, String)>> {
    let mut keys = Vec::new();
    for tier in TIERS {
        stop.check()?;
        let user: serde_json::Value = serde_json::from_str(&run_tool(
            web,
            &[
                "admin",
                "create-user",
                "--name",
                &format!("demo-{tier}"),
                "--tier",
                tier,
            ],
            env,
        )?)?;
        let id = user["id"]
            .as_str()
            .context("create-user printed no id")?
            .to_owned();
        let key: serde_json::Value =
            serde_json::from_str(&run_tool(web, &["admin", "issue-key", "--user", &id], env)?)?;
        let secret = key["key"]
            .as_str()
            .context("issue-key printed no key")?
            .to_owned();
        keys.push((tier.to_owned(), id, secret));
    }
    Ok(keys)
}

/// Waits until the API's `/readyz` answers 200 while every service is still running. A port
/// that merely accepts connections proves nothing: another program may hold it, and the web
/// service may have died failing to listen there.
fn wait_ready(port: u16, stop: &StopRequest, running: &mut Services) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !stop.requested() {
        for (name, child) in &mut running.0 {
            if let Ok(Some(status)) = child.try_wait() {
                bail!("{name} exited ({status}) before the API was ready");
            }
        }
        if readyz_ok(port) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the API on port {port} did not answer /readyz with 200 within 60 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// Whether `GET http://127.0.0.1:{port}/readyz` answers 200.
fn readyz_ok(port: u16) -> bool {
    use std::io::{BufRead as _, BufReader, Write as _};
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500))
    else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
    let mut status_line = String::new();
    stream
        .write_all(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .is_ok()
        && BufReader::new(stream).read_line(&mut status_line).is_ok()
        && status_line.split_whitespace().nth(1) == Some("200")
}

/// A fresh admin token for this run: `dev-admin-` and 32 hex digits from the kernel's random
/// source (web refuses tokens under 16 characters).
fn dev_admin_token() -> anyhow::Result<String> {
    use std::io::Read as _;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut random| random.read_exact(&mut bytes))
        .context("reading /dev/urandom for the admin token")?;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("dev-admin-{hex}"))
}

#[allow(clippy::print_stdout)]
fn print_welcome(port: u16, keys: &[(String, String, String)], admin_token: &str) {
    println!("\nFairlane is running.\n");
    println!("  API        http://127.0.0.1:{port}   (docs: /docs, OpenAPI: /openapi.json)");
    println!(
        "  workers    analyzer :9091, specgen :9092, scheduler :9093  (/healthz /readyz /metrics)"
    );
    println!("  admin      Authorization: Bearer {admin_token}\n");
    println!("  Demo API keys (shown once):");
    for (tier, user, key) in keys {
        println!("    {tier:<11} {key}   (user {user})");
    }
    if let Some((_, _, key)) = keys.iter().find(|(t, _, _)| t == "pro") {
        println!("\n  Try:");
        println!(
            "    curl -s -X POST http://127.0.0.1:{port}/v1/analyses \\\n      -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\\n      -d '{{\"repository\": \"https://github.com/rust-lang/log\"}}'"
        );
        println!("    curl -s http://127.0.0.1:{port}/v1/usage -H 'Authorization: Bearer {key}'");
    }
    println!("\n  Ctrl-C stops everything.\n");
}

fn create_database(server_url: &str, name: &str) -> anyhow::Result<()> {
    let url = libpq_url(server_url);
    let exists = Command::new("psql")
        .args([
            &url,
            "-Atc",
            &format!("SELECT 1 FROM pg_database WHERE datname = '{name}'"),
        ])
        .output()
        .context("running psql")?;
    if String::from_utf8_lossy(&exists.stdout).trim() == "1" {
        return Ok(());
    }
    let status = Command::new("psql")
        .args([&url, "-qc", &format!("CREATE DATABASE {name}")])
        .status()?;
    if !status.success() {
        bail!("could not create database {name}");
    }
    Ok(())
}

/// `server_url` with its database replaced by `name`.
fn with_database(server_url: &str, name: &str) -> String {
    let base = libpq_url(server_url);
    match base.rfind('/') {
        Some(i) if base[..i].contains("//") && i > base.find("//").map_or(0, |j| j + 1) => {
            format!("{}/{name}", &base[..i])
        }
        _ => format!("{base}/{name}"),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::io::{BufRead as _, BufReader, Write as _};
    use std::net::TcpListener;
    use std::sync::mpsc;

    use super::*;

    fn no_stop() -> StopRequest {
        StopRequest
    }

    /// Answers each request on `listener` with the next of `statuses` (the last one repeats),
    /// reporting each request line on the channel.
    fn http_server(listener: TcpListener, statuses: &'static [u16]) -> mpsc::Receiver<String> {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for (i, stream) in listener.incoming().enumerate() {
                let Ok(stream) = stream else { return };
                let mut line = String::new();
                let _ = BufReader::new(&stream).read_line(&mut line);
                let status = statuses[i.min(statuses.len() - 1)];
                let _ = (&stream).write_all(
                    format!("HTTP/1.1 {status} X\r\ncontent-length: 0\r\n\r\n").as_bytes(),
                );
                if tx.send(line.trim_end().to_owned()).is_err() {
                    return;
                }
            }
        });
        rx
    }

    #[test]
    fn a_dead_web_is_not_ready_though_something_answers_on_its_port() {
        // Another program holds the API port (and even answers 200); web died failing to listen.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let _requests = http_server(listener, &[200]);
        let mut web = Command::new("sh").args(["-c", "exit 3"]).spawn().unwrap();
        web.wait().unwrap();
        let mut running = Services(vec![("web".to_owned(), web)]);
        let err = wait_ready(port, &no_stop(), &mut running).unwrap_err();
        assert_eq!(
            err.to_string(),
            "web exited (exit status: 3) before the API was ready"
        );
    }

    #[test]
    fn ready_means_readyz_answers_200() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let requests = http_server(listener, &[503, 200]);
        let web = Command::new("sleep").arg("30").spawn().unwrap();
        let mut running = Services(vec![("web".to_owned(), web)]);
        wait_ready(port, &no_stop(), &mut running).unwrap();
        for _ in 0..2 {
            assert_eq!(requests.recv().unwrap(), "GET /readyz HTTP/1.1");
        }
        for (_, child) in &mut running.0 {
            child.kill().unwrap();
        }
    }
}
