//! Helpers shared by the deployment checks: the workspace, the service binaries (built with
//! cargo on first use), a small HTTP client, child services, and the environment variable names
//! each binary reads.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use testkit::process::ChildProcess;

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("crates/deploy-checks lives two levels below the workspace root")
        .to_path_buf()
}

/// Reads a file of the workspace.
pub fn read(relative: &str) -> String {
    let path = workspace_root().join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The service binaries by name, built (or found up to date) with the cargo running the tests.
/// `cargo xtask test` builds them beforehand with the same command, so this is quick there.
pub fn service_binaries() -> &'static BTreeMap<String, PathBuf> {
    static BINARIES: OnceLock<BTreeMap<String, PathBuf>> = OnceLock::new();
    BINARIES.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut args = vec![
            "build",
            "--bins",
            "--message-format=json-render-diagnostics",
        ];
        for package in deploy_checks::SERVICE_PACKAGES {
            args.extend(["--package", package]);
        }
        let out = Command::new(&cargo)
            .args(&args)
            .current_dir(workspace_root())
            .stderr(std::process::Stdio::inherit())
            .output()
            .unwrap_or_else(|e| panic!("running {cargo}: {e}"));
        assert!(out.status.success(), "cargo {} failed", args.join(" "));
        let mut binaries = BTreeMap::new();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            if message["reason"] == "compiler-artifact"
                && let Some(exe) = message["executable"].as_str()
                && let Some(name) = message["target"]["name"].as_str()
            {
                binaries.insert(name.to_owned(), PathBuf::from(exe));
            }
        }
        for package in deploy_checks::SERVICE_PACKAGES {
            assert!(
                binaries.contains_key(*package),
                "cargo built no `{package}` binary: {binaries:?}"
            );
        }
        binaries
    })
}

pub fn binary(name: &str) -> String {
    service_binaries()[name].to_string_lossy().into_owned()
}

/// A free loopback port (bound and released; a tiny race, acceptable in tests).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A response, fully read.
#[derive(Debug)]
pub struct Resp {
    pub status: StatusCode,
    pub body: Bytes,
}

impl Resp {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// HTTP/1.1 to loopback services.
#[derive(Clone)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Default for Http {
    fn default() -> Self {
        Http {
            client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
        }
    }
}

impl Http {
    pub async fn try_send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: Vec<u8>,
    ) -> Result<Resp, String> {
        let mut builder = Request::builder().method(method).uri(url);
        for (k, v) in headers {
            builder = builder.header(*k, *v);
        }
        let request = builder.body(Full::new(Bytes::from(body))).unwrap();
        let response = tokio::time::timeout(Duration::from_secs(30), self.client.request(request))
            .await
            .map_err(|_| format!("{url}: timed out"))?
            .map_err(|e| format!("{url}: {e:?}"))?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("{url}: reading body: {e}"))?
            .to_bytes();
        Ok(Resp { status, body })
    }

    pub async fn get(&self, url: &str) -> Resp {
        self.try_send(Method::GET, url, &[], Vec::new())
            .await
            .unwrap()
    }

    pub async fn post_json(&self, url: &str, bearer: &str, body: &serde_json::Value) -> Resp {
        let auth = format!("Bearer {bearer}");
        self.try_send(
            Method::POST,
            url,
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
            ],
            serde_json::to_vec(body).unwrap(),
        )
        .await
        .unwrap()
    }

    /// Polls `url` until it answers 200, or panics after `timeout`.
    pub async fn wait_ok(&self, url: &str, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match self.try_send(Method::GET, url, &[], Vec::new()).await {
                Ok(r) if r.status == StatusCode::OK => return,
                other => assert!(
                    tokio::time::Instant::now() < deadline,
                    "{url} not ready after {timeout:?}: {other:?}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Percent-encodes a query parameter value.
pub fn url_encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len() * 3);
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A running service: its process and the base URL of its HTTP surface.
pub struct Service {
    pub name: String,
    pub base: String,
    pub port: u16,
    pub child: ChildProcess,
}

/// Starts `binary` listening on a fresh loopback port with `env` (plus `HTTP_ADDR`), and waits
/// until its `/healthz` answers.
pub async fn start_service(http: &Http, binary_name: &str, env: &[(&str, String)]) -> Service {
    let port = free_port();
    let mut env: Vec<(&str, String)> = env.to_vec();
    env.push(("HTTP_ADDR", format!("127.0.0.1:{port}")));
    let args: &[&str] = if binary_name == "web" {
        &["serve"]
    } else {
        &[]
    };
    let child = ChildProcess::spawn(binary_name, &binary(binary_name), args, &env);
    let base = format!("http://127.0.0.1:{port}");
    http.wait_ok(&format!("{base}/healthz"), Duration::from_secs(60))
        .await;
    Service {
        name: binary_name.to_owned(),
        base,
        port,
        child,
    }
}

/// A git repository with one commit and a test file, for `file://` analyses: (url, commit).
pub fn fixture_repository(dir: &Path) -> (String, String) {
    let git = |args: &[&str]| {
        let out = Command::new("git")
            .args(args)
            .current_dir(dir)
            .env("GIT_AUTHOR_NAME", "t")
            .env("GIT_AUTHOR_EMAIL", "t@example.invalid")
            .env("GIT_COMMITTER_NAME", "t")
            .env("GIT_COMMITTER_EMAIL", "t@example.invalid")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "git {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    std::fs::create_dir_all(dir.join("tests")).unwrap();
    std::fs::write(
        dir.join("tests/test_math.py"),
        "def test_adds_numbers():\n    assert 1 + 1 == 2\n",
    )
    .unwrap();
    git(&["init", "-q", "-b", "main"]);
    git(&["add", "."]);
    git(&["commit", "-q", "-m", "fixture"]);
    let commit = git(&["rev-parse", "HEAD"]);
    (format!("file://{}", dir.display()), commit)
}

/// A fresh temporary directory, removed when dropped (keep the value for as long as the test
/// uses the folder).
pub fn temp_dir(label: &str) -> testkit::git_fixture::TempDir {
    testkit::git_fixture::TempDir::new(label)
}

/// The environment variable names a configuration struct reads: the keys of its default,
/// serialized (the loader's flat field names are the lower-case variable names).
fn config_names<T: serde::Serialize>(config: &T) -> BTreeSet<String> {
    let serde_json::Value::Object(map) = serde_json::to_value(config).unwrap() else {
        panic!("a configuration serializes to an object");
    };
    map.keys().map(|k| k.to_ascii_uppercase()).collect()
}

/// Read by the OpenTelemetry SDK itself in every binary (see docs/telemetry.md).
const SDK_VARIABLES: [&str; 2] = ["OTEL_RESOURCE_ATTRIBUTES", "OTEL_EXPORTER_OTLP_HEADERS"];

/// Every environment variable `binary` reads, or `None` for a binary this check does not know.
pub fn env_names(binary: &str) -> Option<BTreeSet<String>> {
    let mut names = match binary {
        "web" => config_names(&web::WebConfig::default()),
        "analyzer-worker" => {
            let mut n = config_names(&analyzer_worker::Config::default());
            n.insert("FAIRLANE_CONFIG".into()); // clap `--config`'s variable
            n
        }
        "specgen-worker" => {
            let mut n = config_names(&specgen_worker::Config::default());
            n.insert("FAIRLANE_CONFIG".into());
            n
        }
        "scheduler" => {
            let mut n = config_names(&scheduler::Config::default());
            n.insert("FAIRLANE_CONFIG".into());
            n
        }
        _ => return None,
    };
    names.extend(SDK_VARIABLES.iter().map(|s| (*s).to_owned()));
    Some(names)
}
