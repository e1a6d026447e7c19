//! Shared helpers for the end-to-end tests: fixture git repositories built with the real `git`
//! CLI, the `web` API served in-process, the `analyzer-worker` binary as a child process, the
//! `specgen-worker` service in-process, a small HTTP client, and polling helpers.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use sqlx::PgPool;
use testkit::TestDb;
use testkit::process::ChildProcess;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub mod fixture;

pub use testkit::git_fixture::{GitFixture, TempDir, processes_mentioning};

pub const WORKER_BIN: &str = env!("CARGO_BIN_EXE_analyzer-worker");

/// Kills, by pid, the git processes that a `kill -9`ed worker left behind on a fixture (they
/// sit in their own process group, blocked on the stalled object), when dropped — also when the
/// test fails half-way.
pub struct OrphanedGit {
    needle: String,
}

impl OrphanedGit {
    pub fn of(fixture: &GitFixture) -> OrphanedGit {
        OrphanedGit {
            needle: fixture.path().display().to_string(),
        }
    }
}

impl Drop for OrphanedGit {
    fn drop(&mut self) {
        for (pid, _) in processes_mentioning(&self.needle) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// A response, fully read.
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: StatusCode,
    pub content_type: Option<String>,
    pub body: Bytes,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// An HTTP/1.1 client for one API key.
#[derive(Clone)]
pub struct Api {
    base: String,
    key: String,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Api {
    pub fn new(addr: SocketAddr, key: &str) -> Api {
        Api {
            base: format!("http://{addr}"),
            key: key.to_owned(),
            client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
        }
    }

    pub async fn send(
        &self,
        method: Method,
        path: &str,
        accept: &str,
        body: Option<&Value>,
    ) -> Resp {
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("authorization", format!("Bearer {}", self.key))
            .header("accept", accept);
        let body = match body {
            Some(v) => {
                builder = builder.header("content-type", "application/json");
                Bytes::from(serde_json::to_vec(v).unwrap())
            }
            None => Bytes::new(),
        };
        let response = tokio::time::timeout(
            Duration::from_secs(60),
            self.client.request(builder.body(Full::new(body)).unwrap()),
        )
        .await
        .expect("request timed out")
        .expect("request failed");
        let (parts, body) = response.into_parts();
        Resp {
            status: parts.status,
            content_type: parts
                .headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
            body: body.collect().await.unwrap().to_bytes(),
        }
    }

    pub async fn get(&self, path: &str) -> Resp {
        self.send(Method::GET, path, "application/json", None).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> Resp {
        self.send(Method::POST, path, "application/json", Some(body))
            .await
    }

    /// `POST /v1/analyses`.
    pub async fn analyse(&self, repository: &str, git_ref: Option<&str>) -> Resp {
        let mut body = serde_json::json!({ "repository": repository });
        if let Some(r) = git_ref {
            body["ref"] = Value::from(r);
        }
        self.post("/v1/analyses", &body).await
    }

    /// Polls `GET {path}` until the record's `state` is `completed` or `failed`.
    pub async fn wait_settled(&self, path: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let r = self.get(path).await;
            assert_eq!(r.status, 200, "{}", r.text());
            let v = r.json();
            if v["state"] == "completed" || v["state"] == "failed" {
                return v;
            }
            assert!(Instant::now() < deadline, "{path} still {}", v["state"]);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The `web` API served in this process (file:// allowed, no rate limiting).
pub struct Web {
    pub addr: SocketAddr,
    shutdown: CancellationToken,
    handle: JoinHandle<anyhow::Result<()>>,
}

impl Web {
    pub async fn start(db: &TestDb) -> Web {
        Self::start_with(web::WebConfig {
            database_url: db.url(),
            database_max_connections: 5,
            http_addr: "127.0.0.1:0".into(),
            ratelimit_enabled: false,
            analyzer_allow_file_urls: true,
            ..web::WebConfig::default()
        })
        .await
    }

    pub async fn start_with(config: web::WebConfig) -> Web {
        let server = web::Server::bind(&config).await.unwrap();
        let addr = server.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn(server.run(shutdown.clone()));
        Web {
            addr,
            shutdown,
            handle,
        }
    }

    /// A client for a new user of `tier` with an API key; returns (user id, client).
    pub async fn user(&self, pool: &PgPool, tier: &str) -> (Uuid, Api) {
        let tier = web::admin::parse_tier(tier).unwrap();
        let user = web::admin::create_user(pool, "e2e user", tier)
            .await
            .unwrap();
        let key = web::admin::issue_key(pool, user.id).await.unwrap();
        (user.id, Api::new(self.addr, &key.key))
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .expect("web did not stop")
            .unwrap()
            .unwrap();
    }
}

/// The environment of an `analyzer-worker` child: this database, `work_dir`, fast heartbeats
/// and rescue, `file://` allowed; `extra` overrides or adds variables.
pub fn worker_env(db: &TestDb, work_dir: &Path, extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = [
        ("DATABASE_URL", db.url()),
        ("HTTP_ADDR", "127.0.0.1:0".to_owned()),
        ("ANALYZER_ALLOW_FILE_URLS", "true".to_owned()),
        ("ANALYZER_WORK_DIR", work_dir.display().to_string()),
        ("LOG_FORMAT", "pretty".to_owned()),
        ("RUST_LOG", "warn".to_owned()),
        ("QUEUE_HEARTBEAT_INTERVAL", "300ms".to_owned()),
        ("QUEUE_RESCUE_AFTER", "2s".to_owned()),
        ("QUEUE_RESCUE_INTERVAL", "300ms".to_owned()),
        ("QUEUE_PROMOTE_INTERVAL", "100ms".to_owned()),
        ("QUEUE_LEADER_TTL", "1s".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    for (k, v) in extra {
        env.retain(|(name, _)| name != k);
        env.push(((*k).to_owned(), (*v).to_owned()));
    }
    env
}

/// Spawns the `analyzer-worker` binary with `env`.
pub fn spawn_worker(name: &str, env: &[(String, String)]) -> ChildProcess {
    let env: Vec<(&str, String)> = env.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    ChildProcess::spawn(name, WORKER_BIN, &[], &env)
}

/// The `specgen-worker` service running in this process.
pub struct Specgen {
    shutdown: CancellationToken,
    handle: JoinHandle<Result<(), workerkit::WorkerError>>,
}

impl Specgen {
    pub async fn start(db: &TestDb) -> Specgen {
        let mut config = specgen_worker::Config::default();
        config.worker.database_url = db.url();
        config.worker.http_addr = "127.0.0.1:0".into();
        config.worker.database_max_connections = 5;
        let pool = db.pool_with(5).await;
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        let handle = tokio::spawn(async move { specgen_worker::run(&config, pool, token).await });
        Specgen { shutdown, handle }
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .expect("specgen-worker did not stop")
            .unwrap()
            .unwrap();
    }
}

/// Jobs, reservations and usage events in the database.
pub async fn billing_rows(pool: &PgPool) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM fairlane_job), (SELECT count(*) FROM quota_reservations), \
                (SELECT count(*) FROM usage_events)",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A job's state and cancel reason.
pub async fn job_state(pool: &PgPool, job: i64) -> (String, Option<String>) {
    sqlx::query_as(
        "SELECT state::text, metadata ->> 'cancel_reason' FROM fairlane_job WHERE id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Usage events and live reservations of one job.
pub async fn job_billing(pool: &PgPool, job: i64) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM usage_events WHERE job_id = $1), \
                (SELECT count(*) FROM quota_reservations WHERE job_id = $1)",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Waits until `check` holds, polling every 50 ms.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
