//! Shared helpers for the web integration tests: a small HTTP client, the server in-process or
//! as a child `web` process, users and keys, and row counts.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
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
use web::WebConfig;

pub const ADMIN_TOKEN: &str = "test-admin-token";

/// A response, fully read.
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Asserts a problem+json with `status` and `code`; returns the body.
    pub fn problem(&self, status: u16, code: &str) -> Value {
        assert_eq!(self.status.as_u16(), status, "body: {}", self.text());
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "body: {}",
            self.text()
        );
        let body = self.json();
        assert_eq!(body["code"], code, "body: {body}");
        assert_eq!(body["status"], status);
        for member in ["type", "title", "detail"] {
            assert!(body[member].is_string(), "{member} missing: {body}");
        }
        body
    }
}

/// An HTTP/1.1 client against one base URL.
#[derive(Clone)]
pub struct Http {
    pub base: String,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Http {
    pub fn new(addr: SocketAddr) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Http {
            base: format!("http://{addr}"),
            client: Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(256)
                .build(connector),
        }
    }

    pub async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<Vec<u8>>,
    ) -> Resp {
        self.try_send(method, path, headers, body)
            .await
            .unwrap_or_else(|e| panic!("request failed: {e}"))
    }

    /// [`Http::send`] that reports connection errors instead of panicking.
    pub async fn try_send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<Vec<u8>>,
    ) -> Result<Resp, String> {
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        for (k, v) in headers {
            builder = builder.header(*k, *v);
        }
        let request = builder
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .unwrap();
        let response = tokio::time::timeout(Duration::from_secs(60), self.client.request(request))
            .await
            .map_err(|_| "request timed out".to_owned())?
            .map_err(|e| format!("{e:?}"))?;
        let (parts, body) = response.into_parts();
        let body = body
            .collect()
            .await
            .map_err(|e| format!("reading body: {e}"))?
            .to_bytes();
        Ok(Resp {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    pub async fn get(&self, path: &str, key: &str) -> Resp {
        let auth = format!("Bearer {key}");
        self.send(Method::GET, path, &[("authorization", &auth)], None)
            .await
    }

    pub async fn delete(&self, path: &str, key: &str) -> Resp {
        let auth = format!("Bearer {key}");
        self.send(Method::DELETE, path, &[("authorization", &auth)], None)
            .await
    }

    pub async fn post_json(&self, path: &str, key: &str, body: &Value) -> Resp {
        self.try_post_json(path, key, body)
            .await
            .unwrap_or_else(|e| panic!("request failed: {e}"))
    }

    /// [`Http::post_json`] that reports connection errors instead of panicking.
    pub async fn try_post_json(&self, path: &str, key: &str, body: &Value) -> Result<Resp, String> {
        let auth = format!("Bearer {key}");
        self.try_send(
            Method::POST,
            path,
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
            ],
            Some(serde_json::to_vec(body).unwrap()),
        )
        .await
    }
}

/// Settings for a test server on `db`: loopback, random port, admin token, `file://` allowed,
/// no rate limiting unless a test asks for it.
pub fn config(db: &TestDb) -> WebConfig {
    WebConfig {
        database_url: db.url(),
        database_max_connections: 20,
        http_addr: "127.0.0.1:0".into(),
        admin_token: Some(ADMIN_TOKEN.into()),
        ratelimit_enabled: false,
        analyzer_allow_file_urls: true,
        ..WebConfig::default()
    }
}

/// A server running in this process.
pub struct TestServer {
    pub http: Http,
    pub addr: SocketAddr,
    shutdown: CancellationToken,
    handle: JoinHandle<anyhow::Result<()>>,
}

impl TestServer {
    pub async fn start(config: WebConfig) -> TestServer {
        let server = web::Server::bind(&config).await.unwrap();
        let addr = server.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn(server.run(shutdown.clone()));
        TestServer {
            http: Http::new(addr),
            addr,
            shutdown,
            handle,
        }
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .expect("server did not stop")
            .unwrap()
            .unwrap();
    }
}

/// A free loopback port (bound and released; a tiny race, acceptable in tests).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `web` child process serving on a fresh port, ready when this returns.
pub async fn spawn_web(db: &TestDb, extra_env: &[(&str, String)]) -> (ChildProcess, Http) {
    spawn_web_under(db, extra_env, &[]).await
}

/// [`spawn_web`], run by `launcher` (a command that runs the rest of its arguments, such as
/// `prlimit --nofile=300 --`), if not empty.
pub async fn spawn_web_under(
    db: &TestDb,
    extra_env: &[(&str, String)],
    launcher: &[&str],
) -> (ChildProcess, Http) {
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut env: Vec<(&str, String)> = vec![
        ("DATABASE_URL", db.url()),
        ("HTTP_ADDR", addr.to_string()),
        ("ADMIN_TOKEN", ADMIN_TOKEN.into()),
        ("ANALYZER_ALLOW_FILE_URLS", "true".into()),
        ("RATELIMIT_ENABLED", "false".into()),
        ("RUST_LOG", "warn".into()),
        ("LOG_FORMAT", "json".into()),
    ];
    for (k, v) in extra_env {
        env.retain(|(name, _)| name != k);
        env.push((k, v.clone()));
    }
    let binary = env!("CARGO_BIN_EXE_web");
    let child = match launcher.split_first() {
        None => ChildProcess::spawn("web", binary, &["serve"], &env),
        Some((program, launcher_args)) => {
            let mut args = launcher_args.to_vec();
            args.extend([binary, "serve"]);
            ChildProcess::spawn("web", program, &args, &env)
        }
    };
    let http = Http::new(addr);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let ready = tokio::time::timeout(
            Duration::from_secs(2),
            http.try_send(Method::GET, "/healthz", &[], None),
        )
        .await;
        if matches!(ready, Ok(Ok(ref r)) if r.status == StatusCode::OK) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "web did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (child, http)
}

/// Locks `user`'s row (`FOR UPDATE`) in a transaction of its own, as another session holding it
/// would: the user's enqueue requests wait for it until it ends or their timeouts.
pub async fn hold_user_row(
    pool: &PgPool,
    user: Uuid,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM users WHERE id = $1 FOR UPDATE")
        .bind(user)
        .execute(&mut *holder)
        .await
        .unwrap();
    holder
}

/// Waits up to 10 s for a session of the test database to wait for a lock (`what` names it).
pub async fn until_a_lock_waits(pool: &PgPool, what: &str) {
    testkit::eventually(Duration::from_secs(10), what, || async {
        (!testkit::lock_waiting_statements(pool).await.is_empty()).then_some(())
    })
    .await;
}

/// A user of `tier` with an API key; returns (user id, key).
pub async fn user_with_key(pool: &PgPool, tier: &str) -> (Uuid, String) {
    let tier = web::admin::parse_tier(tier).unwrap();
    let user = web::admin::create_user(pool, "test user", tier)
        .await
        .unwrap();
    let key = web::admin::issue_key(pool, user.id).await.unwrap();
    (user.id, key.key)
}

pub async fn seed_usage(pool: &PgPool, user: Uuid, event: &str, amount: i32) {
    sqlx::query(
        "INSERT INTO usage_events (user_id, event_type, amount) \
         VALUES ($1, $2::text::fairlane_usage_event_type, $3)",
    )
    .bind(user)
    .bind(event)
    .bind(amount)
    .execute(pool)
    .await
    .unwrap();
}

pub async fn count(pool: &PgPool, table: &str) -> i64 {
    let (n,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
        .fetch_one(pool)
        .await
        .unwrap();
    n
}

/// Rows that a request may write: jobs, reservations, usage events, analyses, specviews.
pub async fn written_rows(pool: &PgPool) -> [i64; 5] {
    [
        count(pool, "fairlane_job").await,
        count(pool, "quota_reservations").await,
        count(pool, "usage_events").await,
        count(pool, "analyses").await,
        count(pool, "specviews").await,
    ]
}

/// A 40-hex commit id that differs per `n`.
pub fn sha(n: u64) -> String {
    format!("{n:040x}")
}

pub fn analysis_body(n: u64) -> Value {
    serde_json::json!({
        "repository": "https://github.com/fairlane-test/fixture.git",
        "ref": sha(n),
    })
}
