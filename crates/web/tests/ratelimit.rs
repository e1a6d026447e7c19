//! Rate limiting through the HTTP API: limit headers on allowed responses, a complete 429 when
//! over, anonymous callers limited per address, and two `web` processes sharing Redis never
//! letting one user through more often than the limit; behind trusted proxies, each forwarded
//! client limited on its own.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use http::Method;
use support::{TestServer, config, spawn_web, user_with_key};
use testkit::TestDb;

/// A rules file unique to this test, in a folder removed when this is dropped (keep it while
/// the server runs: it reloads the file).
struct Rules {
    _dir: testkit::git_fixture::TempDir,
    path: String,
}

/// [`Rules`]: per user `per_user` a day, per anonymous address `per_ip` a day (fixed windows; a
/// day so that no test straddles a window edge in practice).
fn rules(per_user: u32, per_ip: u32) -> Rules {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let dir = testkit::git_fixture::TempDir::new("web-rules");
    let path = dir.path().join("rules.yaml");
    std::fs::write(
        &path,
        format!(
            "domain: webtest{id}\n\
             descriptors:\n\
             \x20 - key: user_id\n\
             \x20   rate_limit: {{unit: day, requests_per_unit: {per_user}, algorithm: fixed_window}}\n\
             \x20 - key: tier\n\
             \x20   value: anonymous\n\
             \x20   descriptors:\n\
             \x20     - key: remote_address\n\
             \x20       rate_limit: {{unit: day, requests_per_unit: {per_ip}, algorithm: fixed_window}}\n"
        ),
    )
    .unwrap();
    Rules {
        path: path.display().to_string(),
        _dir: dir,
    }
}

fn assert_limit_headers(r: &support::Resp, limit: u64) {
    assert_eq!(
        r.header("x-ratelimit-limit"),
        Some(limit.to_string().as_str()),
        "{:?}",
        r.headers
    );
    let remaining: u64 = r.header("x-ratelimit-remaining").unwrap().parse().unwrap();
    assert!(remaining <= limit);
    let reset: u64 = r.header("x-ratelimit-reset").unwrap().parse().unwrap();
    assert!((1..=86_400).contains(&reset));
    let policy = r.header("ratelimit-policy").unwrap();
    assert!(policy.ends_with(&format!(";q={limit};w=86400")), "{policy}");
    let field = r.header("ratelimit").unwrap();
    assert!(
        field.contains(&format!(";r={remaining};t={reset}")),
        "{field}"
    );
}

#[tokio::test]
async fn headers_on_allowed_responses_and_a_complete_429() {
    let db = TestDb::new().await;
    let mut c = config(&db);
    c.ratelimit_enabled = true;
    let rules = rules(5, 3);
    c.ratelimit_rules = rules.path.clone();
    let s = TestServer::start(c).await;
    let (_, key) = user_with_key(&db.pool, "free").await;
    for n in 0..5u64 {
        let r = s.http.get("/v1/usage", &key).await;
        assert_eq!(r.status, 200);
        assert_limit_headers(&r, 5);
        assert_eq!(
            r.header("x-ratelimit-remaining"),
            Some((4 - n).to_string().as_str())
        );
    }
    let r = s.http.get("/v1/usage", &key).await;
    let body = r.problem(429, "rate_limited");
    assert_limit_headers(&r, 5);
    assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=86_400).contains(&retry));
    assert_eq!(body["retry_after"], retry);
    // Another user has their own budget.
    let (_, other) = user_with_key(&db.pool, "free").await;
    assert_eq!(s.http.get("/v1/usage", &other).await.status, 200);
    // Unauthenticated (and bad-key) requests are limited per address, and still get a 401.
    for _ in 0..3 {
        let r = s.http.send(Method::GET, "/v1/usage", &[], None).await;
        r.problem(401, "unauthorized");
        assert_limit_headers(&r, 3);
    }
    s.http
        .get("/v1/usage", "bogus")
        .await
        .problem(429, "rate_limited");
    // Operational endpoints are not limited.
    for _ in 0..5 {
        assert_eq!(
            s.http.send(Method::GET, "/healthz", &[], None).await.status,
            200
        );
    }
    s.stop().await;
}

/// Wrong admin tokens are limited per address like any other unauthenticated call (guesses at
/// the admin token were unlimited); the right token is never limited, not even from an address
/// whose budget wrong ones have used up.
#[tokio::test]
async fn wrong_admin_tokens_are_limited_per_address_and_the_right_one_never_is() {
    let db = TestDb::new().await;
    let mut c = config(&db);
    c.ratelimit_enabled = true;
    let rules = rules(100, 3);
    c.ratelimit_rules = rules.path.clone();
    let s = TestServer::start(c).await;
    let body = serde_json::json!({"name": "Mallory", "tier": "enterprise"});
    for _ in 0..3 {
        let r = s
            .http
            .post_json("/admin/users", "a-wrong-admin-token", &body)
            .await;
        r.problem(401, "unauthorized");
        assert_limit_headers(&r, 3);
    }
    let r = s
        .http
        .post_json("/admin/users", "another-guess-at-it", &body)
        .await;
    let problem = r.problem(429, "rate_limited");
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert_eq!(problem["retry_after"], retry);
    // No token at all counts the same.
    s.http
        .send(Method::DELETE, "/admin/keys/0011223344556677", &[], None)
        .await
        .problem(429, "rate_limited");
    let users: i64 = sqlx::query_scalar("SELECT count(*) FROM users")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(users, 0);
    // The admin, from the same address, is not held back.
    for n in 0..5 {
        let r = s
            .http
            .post_json(
                "/admin/users",
                support::ADMIN_TOKEN,
                &serde_json::json!({"name": format!("user {n}"), "tier": "pro"}),
            )
            .await;
        assert_eq!(r.status, 201, "{}", r.text());
        assert_eq!(r.header("x-ratelimit-limit"), None);
    }
    s.stop().await;
}

/// An anonymous `GET /v1/usage` that says it was forwarded for `chain`; its status.
async fn forwarded(s: &TestServer, chain: Option<&str>) -> u16 {
    let headers: Vec<(&str, &str)> = chain.map(|c| ("x-forwarded-for", c)).into_iter().collect();
    s.http
        .send(Method::GET, "/v1/usage", &headers, None)
        .await
        .status
        .as_u16()
}

#[tokio::test]
async fn behind_a_trusted_proxy_each_forwarded_client_has_its_own_budget() {
    let db = TestDb::new().await;
    let mut c = config(&db);
    c.ratelimit_enabled = true;
    let trusted_rules = rules(100, 2);
    c.ratelimit_rules = trusted_rules.path.clone();
    c.http_trusted_proxies = "127.0.0.1, ::1".into();
    let s = TestServer::start(c.clone()).await;
    assert_eq!(forwarded(&s, Some("203.0.113.1")).await, 401);
    assert_eq!(forwarded(&s, Some("203.0.113.1")).await, 401);
    assert_eq!(forwarded(&s, Some("203.0.113.1")).await, 429);
    // Another client behind the same proxy has its own budget …
    assert_eq!(forwarded(&s, Some("203.0.113.2")).await, 401);
    // … and a client cannot pick one: what it wrote itself is left of what the proxy appended.
    assert_eq!(forwarded(&s, Some("198.51.100.9, 203.0.113.1")).await, 429);
    // Through two proxies of ours (both trusted), the client is still the one they name.
    assert_eq!(forwarded(&s, Some("203.0.113.1, 127.0.0.1")).await, 429);
    // The proxy's own requests (no header) count for the proxy.
    assert_eq!(forwarded(&s, None).await, 401);
    s.stop().await;

    // Trusting no one (the default), the header is ignored: every request is the peer's.
    c.http_trusted_proxies = String::new();
    let untrusted_rules = rules(100, 2);
    c.ratelimit_rules = untrusted_rules.path.clone();
    let s = TestServer::start(c).await;
    assert_eq!(forwarded(&s, Some("203.0.113.1")).await, 401);
    assert_eq!(forwarded(&s, Some("203.0.113.2")).await, 401);
    assert_eq!(forwarded(&s, Some("203.0.113.3")).await, 429);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_processes_sharing_redis_never_exceed_the_limit() {
    let db = TestDb::new().await;
    let rules = rules(20, 1000);
    let env = [
        ("RATELIMIT_ENABLED", "true".to_owned()),
        ("RATELIMIT_RULES", rules.path.clone()),
        ("REDIS_URL", testkit::redis_url()),
        ("RATELIMIT_DEADLINE", "2s".to_owned()),
    ];
    let (_a, a) = spawn_web(&db, &env).await;
    let (_b, b) = spawn_web(&db, &env).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    let mut tasks = Vec::new();
    for i in 0..100 {
        let http = if i % 2 == 0 { a.clone() } else { b.clone() };
        let key = key.clone();
        tasks.push(tokio::spawn(
            async move { http.get("/v1/usage", &key).await },
        ));
    }
    let mut allowed = [0u32; 2];
    let mut limited = 0;
    for (i, t) in tasks.into_iter().enumerate() {
        let r = t.await.unwrap();
        match r.status.as_u16() {
            200 => allowed[i % 2] += 1,
            429 => {
                r.problem(429, "rate_limited");
                limited += 1;
            }
            other => panic!("unexpected {other}: {}", r.text()),
        }
    }
    assert_eq!(
        allowed[0] + allowed[1],
        20,
        "allowed per process: {allowed:?}"
    );
    assert_eq!(limited, 80);
    // Still limited afterwards, through either process.
    a.get("/v1/usage", &key).await.problem(429, "rate_limited");
    b.get("/v1/usage", &key).await.problem(429, "rate_limited");
}

/// With Redis unreachable, requests are still served (from each replica's own memory), and what
/// the alert on the limiter's backend (deploy/prometheus/alerts.yml) watches is exported: the
/// alert can fire when it should.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_redis_serves_requests_and_exports_what_its_alert_watches() {
    let db = TestDb::new().await;
    let rules = rules(20, 1000);
    let env = [
        ("RATELIMIT_ENABLED", "true".to_owned()),
        ("RATELIMIT_RULES", rules.path.clone()),
        (
            "REDIS_URL",
            format!("redis://127.0.0.1:{}", support::free_port()),
        ),
    ];
    let (_web, http) = spawn_web(&db, &env).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    for _ in 0..5 {
        let r = http.get("/v1/usage", &key).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_limit_headers(&r, 20);
    }

    let alerts: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../deploy/prometheus/alerts.yml"),
        )
        .unwrap(),
    )
    .unwrap();
    let expr = alerts["groups"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_sequence().unwrap())
        .find(|r| r["alert"] == "FairlaneRateLimiterBackendFailing")
        .expect("the limiter's backend alert")["expr"]
        .as_str()
        .unwrap()
        .to_owned();
    // The alert's selector: its metric, and its label matchers (`label="value"`), if any.
    let start = expr
        .find("fairlane_")
        .expect("a fairlane metric in the alert");
    let selector = &expr[start..];
    let metric_end = selector
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(selector.len());
    let metric = &selector[..metric_end];
    let matchers: Vec<&str> = match selector[metric_end..].strip_prefix('{') {
        Some(rest) => rest[..rest.find('}').unwrap()].split(',').collect(),
        None => Vec::new(),
    };
    let metrics = http.send(Method::GET, "/metrics", &[], None).await.text();
    let failures: f64 = metrics
        .lines()
        .filter(|line| {
            line.strip_prefix(metric)
                .is_some_and(|rest| rest.starts_with(['{', ' ']))
                && matchers.iter().all(|m| line.contains(m.trim()))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(
        failures >= 5.0,
        "{metric} counts {failures} failed calls after 5 requests:\n{metrics}"
    );
}
