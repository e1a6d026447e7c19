//! The HTTP API end to end against real PostgreSQL: authentication, ownership, cancel, bad
//! input, tier routing, atomicity, billing through the real queue, cache-first, specviews, refs
//! and the operational endpoints.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use common::AnalysisArgs;
use http::Method;
use queue::{Client, Engine, EngineConfig, QueueName, Workers};
use serde_json::{Value, json};
use support::{
    ADMIN_TOKEN, Resp, TestServer, analysis_body, config, count, hold_user_row, seed_usage, sha,
    user_with_key, written_rows,
};
use testkit::TestDb;
use tokio_util::sync::CancellationToken;

async fn start(db: &TestDb) -> TestServer {
    TestServer::start(config(db)).await
}

#[tokio::test]
async fn missing_wrong_and_revoked_keys_are_401() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    assert_eq!(s.http.get("/v1/usage", &key).await.status, 200);

    let none = s.http.send(Method::GET, "/v1/usage", &[], None).await;
    let body = none.problem(401, "unauthorized");
    assert!(body["detail"].as_str().unwrap().contains("Authorization"));
    assert_eq!(none.header("www-authenticate"), Some("Bearer"));

    let basic = s
        .http
        .send(
            Method::GET,
            "/v1/usage",
            &[("authorization", "Basic dTpw")],
            None,
        )
        .await;
    basic.problem(401, "unauthorized");
    s.http
        .get("/v1/usage", "not-a-key")
        .await
        .problem(401, "unauthorized");
    // Right id, wrong secret.
    let forged = format!("{}{}", &key[..key.len() - 4], "AAAA");
    let body = s
        .http
        .get("/v1/usage", &forged)
        .await
        .problem(401, "unauthorized");
    assert!(body["detail"].as_str().unwrap().contains("not known"));
    // A well-formed key nobody issued.
    let stranger = web::keys::generate().unwrap().key;
    s.http
        .get("/v1/usage", &stranger)
        .await
        .problem(401, "unauthorized");

    // Revoked through the admin API.
    let key_id = web::keys::parse_id(&key).unwrap().to_owned();
    let admin = format!("Bearer {ADMIN_TOKEN}");
    let revoked = s
        .http
        .send(
            Method::DELETE,
            &format!("/admin/keys/{key_id}"),
            &[("authorization", &admin)],
            None,
        )
        .await;
    assert_eq!(revoked.status, 200, "{}", revoked.text());
    let body = s
        .http
        .get("/v1/usage", &key)
        .await
        .problem(401, "unauthorized");
    assert!(body["detail"].as_str().unwrap().contains("revoked"));
    s.stop().await;
}

#[tokio::test]
async fn another_users_job_and_analysis_are_not_found() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (_, alice) = user_with_key(&db.pool, "pro").await;
    let (_, bob) = user_with_key(&db.pool, "pro").await;
    let created = s
        .http
        .post_json("/v1/analyses", &alice, &analysis_body(1))
        .await;
    assert_eq!(created.status, 202, "{}", created.text());
    let body = created.json();
    let job = body["job"]["id"].as_i64().unwrap();
    let analysis = body["analysis_id"].as_str().unwrap().to_owned();
    assert_eq!(
        created.header("location"),
        Some(format!("/v1/jobs/{job}").as_str())
    );

    let mine = s.http.get(&format!("/v1/jobs/{job}"), &alice).await;
    assert_eq!(mine.status, 200);
    let view = mine.json();
    assert_eq!(view["state"], "available");
    assert_eq!(view["queue"], "analysis_priority");
    assert_eq!(view["kind"], "analysis");
    assert_eq!(view["attempt"], 0);
    assert!(view["created_at"].is_string());
    assert!(view["result"].is_null() && view["last_error"].is_null());
    // The job names the record it fills, which outlives it.
    assert_eq!(view["analysis_id"], analysis.as_str());
    assert!(view["specview_id"].is_null());

    s.http
        .get(&format!("/v1/jobs/{job}"), &bob)
        .await
        .problem(404, "not_found");
    s.http
        .delete(&format!("/v1/jobs/{job}"), &bob)
        .await
        .problem(404, "not_found");
    s.http
        .get(&format!("/v1/analyses/{analysis}"), &bob)
        .await
        .problem(404, "not_found");
    s.http
        .get("/v1/jobs/999999", &alice)
        .await
        .problem(404, "not_found");
    s.http
        .get("/v1/jobs/abc", &alice)
        .await
        .problem(404, "not_found");
    s.http
        .get("/v1/analyses/not-a-uuid", &alice)
        .await
        .problem(404, "not_found");
    // Bob's attempt changed nothing.
    let (state,): (String,) = sqlx::query_as("SELECT state::text FROM fairlane_job WHERE id = $1")
        .bind(job)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(state, "available");
    assert_eq!(count(&db.pool, "quota_reservations").await, 1);

    let own = s
        .http
        .get(&format!("/v1/analyses/{analysis}"), &alice)
        .await;
    assert_eq!(own.status, 200);
    let a = own.json();
    assert_eq!(a["state"], "pending");
    assert_eq!(a["job_id"], job);
    assert_eq!(a["commit"], sha(1));
    assert_eq!(
        a["repository"],
        "https://github.com/fairlane-test/fixture.git"
    );
    assert_eq!(a["cached"], false);
    s.stop().await;
}

#[tokio::test]
async fn deleting_a_waiting_job_releases_its_reservation() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (_, key) = user_with_key(&db.pool, "free").await;
    let created = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(7))
        .await;
    assert_eq!(created.status, 202);
    let job = created.json()["job"]["id"].as_i64().unwrap();
    let usage = s.http.get("/v1/usage", &key).await.json();
    assert_eq!(usage["usage"][0]["reserved"], 1);
    assert_eq!(usage["usage"][0]["limit"], 50);
    // A result staged by an earlier attempt (the job waits for its retry): the cancel drops it,
    // as every other end without success does.
    sqlx::query("UPDATE analyses SET result = '{\"tests\": []}' WHERE job_id = $1")
        .bind(job)
        .execute(&db.pool)
        .await
        .unwrap();

    let cancel = s.http.delete(&format!("/v1/jobs/{job}"), &key).await;
    assert_eq!(cancel.status, 200, "{}", cancel.text());
    let body = cancel.json();
    assert_eq!(body["cancellation"], "cancelled");
    assert_eq!(body["job"]["state"], "cancelled");
    assert_eq!(count(&db.pool, "quota_reservations").await, 0);
    assert_eq!(count(&db.pool, "usage_events").await, 0);
    let usage = s.http.get("/v1/usage", &key).await.json();
    assert_eq!(usage["usage"][0]["reserved"], 0);
    assert_eq!(usage["usage"][0]["used"], 0);
    let (state, error, staged): (String, Option<String>, bool) = sqlx::query_as(
        "SELECT state::text, error, result IS NOT NULL FROM analyses WHERE job_id = $1",
    )
    .bind(job)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (state.as_str(), error.as_deref(), staged),
        ("failed", Some("cancelled by the user"), false)
    );
    let again = s.http.delete(&format!("/v1/jobs/{job}"), &key).await.json();
    assert_eq!(again["cancellation"], "already_final");
    s.stop().await;
}

#[tokio::test]
async fn bad_input_is_a_helpful_4xx_and_writes_nothing() {
    let db = TestDb::new().await;
    let mut c = config(&db);
    c.analyzer_allow_file_urls = false;
    let s = TestServer::start(c).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    let auth = format!("Bearer {key}");
    let json_headers = [
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
    ];
    let raw = |body: &str| Some(body.as_bytes().to_vec());
    let auth_only = [("authorization", auth.as_str())];
    let text_plain = [
        ("authorization", auth.as_str()),
        ("content-type", "text/plain"),
    ];
    let utf16 = [
        ("authorization", auth.as_str()),
        ("content-type", "application/json; charset=utf-16"),
    ];
    let gzip = [
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
        ("content-encoding", "identity"),
        ("content-encoding", "identity, gzip"),
    ];
    let two_keys = [
        ("authorization", auth.as_str()),
        ("authorization", "Bearer fl_0000000000000000_x"),
        ("content-type", "application/json"),
    ];

    type Case<'a> = (
        &'a [(&'a str, &'a str)],
        Option<Vec<u8>>,
        u16,
        &'a str,
        &'a str,
    );
    let cases: Vec<Case<'_>> = vec![
        (
            &json_headers,
            raw("{\"repository\":"),
            400,
            "invalid_json",
            "not valid JSON",
        ),
        (
            &json_headers,
            raw("[1, 2"),
            400,
            "invalid_json",
            "not valid JSON",
        ),
        (&json_headers, raw(""), 400, "invalid_json", "EOF"),
        (
            &json_headers,
            raw("{\"repository\": 5}"),
            422,
            "validation_failed",
            "invalid type",
        ),
        (
            &json_headers,
            raw("[]"),
            422,
            "validation_failed",
            "must be a JSON object, got an array",
        ),
        (
            &json_headers,
            raw("{}"),
            422,
            "validation_failed",
            "missing field `repository`",
        ),
        (
            &json_headers,
            raw("{\"repository\": \"https://github.com/a/b\", \"branch\": \"main\"}"),
            422,
            "validation_failed",
            "unknown field `branch`",
        ),
        (
            &json_headers,
            Some(
                format!(
                    "{{\"repository\": \"https://github.com/a/{}\"}}",
                    "x".repeat(20_000)
                )
                .into_bytes(),
            ),
            413,
            "payload_too_large",
            "larger",
        ),
        (
            &auth_only,
            raw("{}"),
            415,
            "unsupported_media_type",
            "Content-Type",
        ),
        (
            &text_plain,
            raw("{}"),
            415,
            "unsupported_media_type",
            "text/plain",
        ),
        (
            &utf16,
            raw("{}"),
            415,
            "unsupported_media_type",
            "charset=utf-16",
        ),
        (
            &gzip,
            raw("{}"),
            415,
            "unsupported_media_type",
            "Content-Encoding: gzip",
        ),
        (
            &json_headers,
            raw("{\"repository\": \"https://10.0.0.1/a/b\", \
                 \"repository\": \"https://github.com/a/b\"}"),
            422,
            "validation_failed",
            "duplicate field `repository`",
        ),
        (
            &two_keys,
            raw("{}"),
            401,
            "unauthorized",
            "more than one Authorization header",
        ),
    ];
    for (headers, body, status, code, detail) in cases {
        let r = s
            .http
            .send(Method::POST, "/v1/analyses", headers, body)
            .await;
        let b = r.problem(status, code);
        assert!(b["detail"].as_str().unwrap().contains(detail), "{b}");
    }
    let urls = [
        (
            "file:///srv/repos/x.git",
            "file:// repository URLs are not allowed",
        ),
        ("ssh://github.com/a/b", "`ssh` scheme is not allowed"),
        ("ssh://git@github.com/a/b", "repository"),
        ("http://localhost/x", "`http` scheme is not allowed"),
        ("https://localhost/x", "internal name"),
        ("https://10.0.0.1/x", "private"),
        // Another port of a public host: git's answer would tell which ports are open.
        (
            "https://github.com:22/a/b",
            "port 22 is not allowed; repositories are fetched from port 443 only",
        ),
        ("git@github.com:a/b.git", "scp-style"),
        ("garbage", "no scheme"),
        ("not a url at all", "whitespace"),
        ("", "empty"),
    ];
    for (url, detail) in urls {
        let r = s
            .http
            .post_json(
                "/v1/analyses",
                &key,
                &json!({"repository": url, "ref": sha(1)}),
            )
            .await;
        let b = r.problem(422, "validation_failed");
        let text = b["detail"].as_str().unwrap();
        assert!(
            text.starts_with("repository: ") && text.contains(detail),
            "{url}: {text}"
        );
        assert_eq!(b["field"], "repository");
    }
    for (git_ref, detail) in [
        ("", "must not be empty"),
        ("a..b", "`..`"),
        ("-x", "start with `-`"),
    ] {
        let r = s
            .http
            .post_json(
                "/v1/analyses",
                &key,
                &json!({"repository": "https://github.com/a/b", "ref": git_ref}),
            )
            .await;
        let b = r.problem(422, "validation_failed");
        assert!(b["detail"].as_str().unwrap().contains(detail), "{b}");
    }
    // Specviews.
    let b = s
        .http
        .post_json("/v1/specviews", &key, &json!({"analysis_id": "nope"}))
        .await
        .problem(422, "validation_failed");
    assert!(b["detail"].as_str().unwrap().contains("UUID"), "{b}");
    s.http
        .post_json(
            "/v1/specviews",
            &key,
            &json!({"analysis_id": uuid::Uuid::new_v4()}),
        )
        .await
        .problem(404, "not_found");
    // Admin.
    let admin = format!("Bearer {ADMIN_TOKEN}");
    let r = s
        .http
        .send(
            Method::POST,
            "/admin/users",
            &[
                ("authorization", &admin),
                ("content-type", "application/json"),
            ],
            raw("{\"name\": \"x\", \"tier\": \"gold\"}"),
        )
        .await;
    assert!(
        r.problem(422, "validation_failed")["detail"]
            .as_str()
            .unwrap()
            .contains("unknown tier")
    );
    let users_before = count(&db.pool, "users").await;
    let r = s
        .http
        .send(
            Method::POST,
            "/admin/users",
            &[
                ("authorization", &admin),
                ("content-type", "application/json"),
            ],
            raw("{\"name\": \"\", \"tier\": \"pro\"}"),
        )
        .await;
    r.problem(422, "validation_failed");
    assert_eq!(count(&db.pool, "users").await, users_before);
    assert_eq!(written_rows(&db.pool).await, [0, 0, 0, 0, 0]);
    s.stop().await;
}

/// PostgreSQL refuses NUL (U+0000) in `text` and inside `jsonb` strings; every string a caller
/// supplies is refused before it gets there: 422 naming the field for bodies, 404 for path ids.
#[tokio::test]
async fn nul_characters_are_refused_before_the_database_and_write_nothing() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    let users_before = count(&db.pool, "users").await;
    let keys_before = count(&db.pool, "api_keys").await;
    let admin = format!("Bearer {ADMIN_TOKEN}");
    let admin_json = [
        ("authorization", admin.as_str()),
        ("content-type", "application/json"),
    ];
    let auth = format!("Bearer {key}");
    let user_json = [
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
    ];
    // Bodies, written as JSON text so that the escape reaches the server as sent.
    /// Request headers.
    type Headers<'a> = &'a [(&'a str, &'a str)];
    let bodies: [(Headers<'_>, Method, String, &str, &str); 9] = [
        (
            &admin_json,
            Method::POST,
            "/admin/users".into(),
            r#"{"name":"a\u0000b","tier":"free"}"#,
            "name: must not contain NUL",
        ),
        (
            &admin_json,
            Method::POST,
            "/admin/users".into(),
            r#"{"name":"\u0000","tier":"free"}"#,
            "name: must not contain NUL",
        ),
        (
            &admin_json,
            Method::POST,
            "/admin/users".into(),
            r#"{"name":"Ada","tier":"free\u0000"}"#,
            "unknown tier",
        ),
        (
            &admin_json,
            Method::PATCH,
            format!("/admin/users/{}", uuid::Uuid::new_v4()),
            r#"{"tier":"pro\u0000"}"#,
            "unknown tier",
        ),
        (
            &user_json,
            Method::POST,
            "/v1/analyses".into(),
            r#"{"repository":"https://github.com/a/b\u0000"}"#,
            "repository: ",
        ),
        (
            &user_json,
            Method::POST,
            "/v1/analyses".into(),
            r#"{"repository":"https://github.com/a/b%00"}"#,
            "repository: ",
        ),
        (
            &user_json,
            Method::POST,
            "/v1/analyses".into(),
            r#"{"repository":"https://github.com/a/b","ref":"main\u0000"}"#,
            "ref: ",
        ),
        (
            &user_json,
            Method::POST,
            "/v1/analyses".into(),
            r#"{"repository":"https://github.com/a/b","ref":"\u0000"}"#,
            "ref: ",
        ),
        (
            &user_json,
            Method::POST,
            "/v1/specviews".into(),
            r#"{"analysis_id":"\u0000"}"#,
            "UUID parsing failed",
        ),
    ];
    for (headers, method, path, body, detail) in bodies {
        let r = s
            .http
            .send(method, &path, headers, Some(body.as_bytes().to_vec()))
            .await;
        let b = r.problem(422, "validation_failed");
        assert!(
            b["detail"].as_str().unwrap().contains(detail),
            "{path} {body}: {b}"
        );
    }
    // Path ids: a NUL (`%00`) or anything else that is not an id's form names nothing.
    let admin_only = [("authorization", admin.as_str())];
    let user_only = [("authorization", auth.as_str())];
    let paths: [(Headers<'_>, Method, &str); 10] = [
        (&admin_only, Method::DELETE, "/admin/keys/%00"),
        (
            &admin_only,
            Method::DELETE,
            "/admin/keys/0123456789abcde%00",
        ),
        (&admin_only, Method::DELETE, "/admin/keys/not-a-key-id"),
        (&admin_only, Method::POST, "/admin/users/%00/keys"),
        (&admin_json, Method::PATCH, "/admin/users/%00"),
        (&user_only, Method::GET, "/v1/jobs/%00"),
        (&user_only, Method::DELETE, "/v1/jobs/1%00"),
        (&user_only, Method::GET, "/v1/analyses/%00"),
        (&user_only, Method::GET, "/v1/specviews/%00"),
        (&user_only, Method::GET, "/v1/specviews/a%00b"),
    ];
    for (headers, method, path) in paths {
        let body = (method == Method::PATCH).then(|| br#"{"tier":"pro"}"#.to_vec());
        s.http
            .send(method, path, headers, body)
            .await
            .problem(404, "not_found");
    }
    assert_eq!(count(&db.pool, "users").await, users_before);
    assert_eq!(count(&db.pool, "api_keys").await, keys_before);
    let (revoked,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM api_keys WHERE revoked_at IS NOT NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(revoked, 0);
    assert_eq!(written_rows(&db.pool).await, [0, 0, 0, 0, 0]);
    // The key and the server still work.
    assert_eq!(s.http.get("/v1/usage", &key).await.status, 200);
    s.stop().await;
}

#[tokio::test]
async fn every_tier_is_routed_to_its_lane_and_unknown_tiers_to_default() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    sqlx::query("ALTER TYPE fairlane_tier ADD VALUE 'gold'")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut cases = Vec::new();
    for (tier, queue) in [
        ("free", "analysis_default"),
        ("pro", "analysis_priority"),
        ("pro_plus", "analysis_priority"),
        ("enterprise", "analysis_priority"),
    ] {
        let (user, key) = user_with_key(&db.pool, tier).await;
        cases.push((tier, user, key, queue));
    }
    // A tier value this build does not know (say a later migration added it).
    let (gold, gold_key) = user_with_key(&db.pool, "free").await;
    sqlx::query("UPDATE users SET tier = 'gold' WHERE id = $1")
        .bind(gold)
        .execute(&db.pool)
        .await
        .unwrap();
    cases.push(("gold", gold, gold_key, "analysis_default"));
    for (n, (tier, user, key, queue)) in cases.iter().enumerate() {
        let r = s
            .http
            .post_json("/v1/analyses", key, &analysis_body(n as u64))
            .await;
        assert_eq!(r.status, 202, "{tier}: {}", r.text());
        let body = r.json();
        assert_eq!(body["job"]["queue"], *queue, "{tier}");
        let (db_queue, args): (String, Value) =
            sqlx::query_as("SELECT queue::text, args FROM fairlane_job WHERE id = $1")
                .bind(body["job"]["id"].as_i64().unwrap())
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert_eq!(db_queue, *queue);
        assert_eq!(args["user_id"], user.to_string());
        assert_eq!(args["ref"], sha(n as u64));
        assert_eq!(args["analysis_id"], body["analysis_id"]);
    }
    let usage = s.http.get("/v1/usage", &cases[4].2).await.json();
    assert_eq!(usage["tier"], "free");
    assert_eq!(usage["usage"][0]["limit"], 50);
    s.stop().await;
}

/// The trigger of [`refuse_late_commits`].
const REFUSE_LATE_COMMIT: &str = "refuse_late_commit";

/// Makes the commit of any transaction that wrote a job of a repository containing `late` fail.
async fn refuse_late_commits(pool: &sqlx::PgPool) {
    at_commit_of_jobs_for(
        pool,
        REFUSE_LATE_COMMIT,
        "late",
        "RAISE EXCEPTION 'commit refused by test trigger';",
    )
    .await;
}

/// Runs `action` (PL/pgSQL) at the COMMIT of every transaction that inserted a job of a
/// repository containing `marker`: a deferred constraint trigger on `fairlane_job` named `name`,
/// which also counts its firings in the sequence `{name}_fired` (no rollback undoes them; read
/// with [`commit_trigger_firings`]).
async fn at_commit_of_jobs_for(pool: &sqlx::PgPool, name: &str, marker: &str, action: &str) {
    for statement in [
        format!("CREATE SEQUENCE {name}_fired"),
        format!(
            "CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN IF NEW.args->>'repository' LIKE '%{marker}%' THEN \
               PERFORM nextval('{name}_fired'); {action} END IF; RETURN NULL; END $$"
        ),
        format!(
            "CREATE CONSTRAINT TRIGGER {name} AFTER INSERT ON fairlane_job \
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {name}()"
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(pool)
            .await
            .unwrap();
    }
}

/// How often the trigger of [`at_commit_of_jobs_for`] named `name` fired.
async fn commit_trigger_firings(pool: &sqlx::PgPool, name: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {name}_fired"
    )))
    .fetch_one(pool)
    .await
    .unwrap()
}

/// `r` is a 500 `internal` problem whose detail does not reveal the test trigger that caused it.
fn assert_internal_problem_hides_the_trigger(r: &Resp) {
    let body = r.problem(500, "internal");
    assert!(
        !body["detail"].as_str().unwrap().contains("trigger"),
        "no internals leak: {body}"
    );
}

/// `r` is a 503 `commit_outcome_unknown` problem that names the request's analysis, which the
/// client can look up (here it was not committed: 404), and does not reveal the test trigger.
async fn assert_commit_outcome_unknown(r: &Resp, http: &support::Http, key: &str) {
    let body = r.problem(503, "commit_outcome_unknown");
    assert!(
        !body["detail"].as_str().unwrap().contains("trigger"),
        "no internals leak: {body}"
    );
    let id = body["analysis_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no analysis_id: {body}"));
    let looked_up = http.get(&format!("/v1/analyses/{id}"), key).await;
    looked_up.problem(404, "not_found");
}

/// Makes every job insert whose repository contains `explode` fail inside its transaction.
async fn refuse_jobs_of_exploding_repositories(pool: &sqlx::PgPool) {
    sqlx::query(
        "CREATE FUNCTION refuse_job() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.args->>'repository' LIKE '%explode%' THEN \
           RAISE EXCEPTION 'job insert refused by test trigger'; END IF; RETURN NEW; END $$",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "CREATE TRIGGER refuse_job BEFORE INSERT ON fairlane_job \
         FOR EACH ROW EXECUTE FUNCTION refuse_job()",
    )
    .execute(pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn a_failing_job_insert_leaves_no_reservation() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    refuse_jobs_of_exploding_repositories(&db.pool).await;
    let r = s
        .http
        .post_json(
            "/v1/analyses",
            &key,
            &json!({"repository": "https://github.com/a/explode", "ref": sha(3)}),
        )
        .await;
    assert_internal_problem_hides_the_trigger(&r);
    assert_eq!(written_rows(&db.pool).await, [0, 0, 0, 0, 0]);
    // The same request without the failure goes through.
    let ok = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(3))
        .await;
    assert_eq!(ok.status, 202);
    assert_eq!(written_rows(&db.pool).await, [1, 1, 0, 1, 0]);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_request_in_a_batch_fails_alone() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    refuse_jobs_of_exploding_repositories(&db.pool).await;
    // 40 concurrent requests share batches with the 4 that fail; each fails alone.
    let requests = (0..40u64).map(|n| {
        let (http, key) = (s.http.clone(), key.clone());
        async move {
            let body = if n % 10 == 0 {
                json!({"repository": "https://github.com/a/explode", "ref": sha(n)})
            } else {
                analysis_body(n)
            };
            (n, http.post_json("/v1/analyses", &key, &body).await.status)
        }
    });
    for (n, status) in futures_util::future::join_all(requests).await {
        assert_eq!(status, if n % 10 == 0 { 500 } else { 202 }, "request {n}");
    }
    assert_eq!(written_rows(&db.pool).await, [36, 36, 0, 36, 0]);
    let orphans: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM quota_reservations r \
         WHERE NOT EXISTS (SELECT 1 FROM analyses a WHERE a.job_id = r.job_id)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(orphans, 0);
    s.stop().await;
}

/// A commit that fails after the batch's writes succeeded leaves nothing, answers 503
/// `commit_outcome_unknown` with the analysis id to look up, and is not retried: a failed
/// commit's outcome is unknown in general, and a retry could enqueue twice (unlike a failed
/// statement, whose batch is retried request by request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_commit_is_answered_with_an_error_and_never_retried() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    refuse_late_commits(&db.pool).await;
    // Concurrent requests share batches, so some batch holds several of them: each batch
    // commits once and fails as a whole; retrying its requests alone would fire more often.
    const REQUESTS: u64 = 32;
    let requests = (0..REQUESTS).map(|n| {
        let (http, key) = (s.http.clone(), key.clone());
        async move {
            let body = json!({"repository": "https://github.com/a/late", "ref": sha(n)});
            http.post_json("/v1/analyses", &key, &body).await
        }
    });
    for r in futures_util::future::join_all(requests).await {
        assert_commit_outcome_unknown(&r, &s.http, &key).await;
    }
    let attempts = commit_trigger_firings(&db.pool, REFUSE_LATE_COMMIT).await;
    assert!(
        attempts < REQUESTS as i64,
        "{attempts} commits for {REQUESTS} requests: failed commits were retried"
    );
    assert_eq!(written_rows(&db.pool).await, [0, 0, 0, 0, 0]);
    // The connection that failed is not reused; the next batch runs on a fresh one.
    let ok = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(7))
        .await;
    assert_eq!(ok.status, 202, "{}", ok.text());
    assert_eq!(written_rows(&db.pool).await, [1, 1, 0, 1, 0]);
    s.stop().await;
}

/// The enqueue collector held up: a request of a user of its own waits in its batch for that
/// user's row, held here, so requests sent meanwhile queue together for the next batch.
struct ParkedCollector {
    holder: sqlx::Transaction<'static, sqlx::Postgres>,
    first: tokio::task::JoinHandle<Resp>,
}

impl ParkedCollector {
    async fn park(s: &TestServer, db: &TestDb) -> Self {
        let (user, key) = user_with_key(&db.pool, "pro").await;
        let holder = hold_user_row(&db.pool, user).await;
        let http = s.http.clone();
        let first = tokio::spawn(async move {
            http.post_json("/v1/analyses", &key, &analysis_body(1))
                .await
        });
        support::until_a_lock_waits(&db.pool, "the parked batch to block").await;
        ParkedCollector { holder, first }
    }

    /// Lets the collector go once the requests sent meanwhile (`waiting`, none answered yet)
    /// have had time to queue.
    async fn release<'a>(
        self,
        waiting: impl IntoIterator<Item = &'a tokio::task::JoinHandle<Resp>>,
    ) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            waiting.into_iter().all(|w| !w.is_finished()),
            "answered before the release"
        );
        self.holder.rollback().await.unwrap();
        assert_eq!(self.first.await.unwrap().status, 202);
    }
}

/// Identical requests of one batch whose commit fails are told the one record to look up: the
/// first's, whose work the others joined.
#[tokio::test]
async fn repeats_at_a_failed_commit_name_the_record_they_joined() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    refuse_late_commits(&db.pool).await;
    // The collector's batch waits for a held row, so the identical requests queue together.
    let parked = ParkedCollector::park(&s, &db).await;
    let same: Vec<_> = (0..4)
        .map(|_| {
            let (http, key) = (s.http.clone(), key.clone());
            let body = json!({"repository": "https://github.com/a/late", "ref": sha(3)});
            tokio::spawn(async move { http.post_json("/v1/analyses", &key, &body).await })
        })
        .collect();
    parked.release(&same).await;
    let mut named = std::collections::BTreeSet::new();
    for answer in same {
        let r = answer.await.unwrap();
        assert_commit_outcome_unknown(&r, &s.http, &key).await;
        named.insert(r.json()["analysis_id"].as_str().unwrap().to_owned());
    }
    assert_eq!(named.len(), 1, "one record named: {named:?}");
    s.stop().await;
}

/// A cancel whose COMMIT fails may or may not have taken effect: it is answered 503
/// `commit_outcome_unknown` naming the job to look up (a 500 said nothing of it), and here,
/// where the commit was refused, the job is as it was.
#[tokio::test]
async fn a_cancel_whose_commit_fails_is_answered_with_the_job_to_look_up() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    let r = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(1))
        .await;
    assert_eq!(r.status, 202, "{}", r.text());
    let job_id = r.json()["job"]["id"].as_i64().unwrap();
    for statement in [
        "CREATE FUNCTION refuse_cancel() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.state = 'cancelled' THEN RAISE EXCEPTION 'commit refused by test trigger'; \
         END IF; RETURN NULL; END $$",
        "CREATE CONSTRAINT TRIGGER refuse_cancel AFTER UPDATE ON fairlane_job \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_cancel()",
    ] {
        sqlx::query(statement).execute(&db.pool).await.unwrap();
    }
    let r = s.http.delete(&format!("/v1/jobs/{job_id}"), &key).await;
    let body = r.problem(503, "commit_outcome_unknown");
    assert_eq!(body["job_id"], job_id);
    assert!(
        !body["detail"].as_str().unwrap().contains("trigger"),
        "{body}"
    );
    let job = s.http.get(&format!("/v1/jobs/{job_id}"), &key).await.json();
    assert_eq!(job["state"], "available", "{job}");
    s.stop().await;
}

/// Terminates every other session of the test database (the server's pools and the
/// collectors' held connections, as a restart or an idle kill would), waiting until each is gone
/// (else a pool's ping could still pass on a session about to end).
async fn terminate_other_backends(pool: &sqlx::PgPool) {
    // One connection for all of it: the pool's others are among those terminated.
    let mut conn = pool.acquire().await.unwrap();
    // Client sessions only: an autovacuum worker may come and go on its own meanwhile.
    let pids: Vec<i32> = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
         AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    assert!(!pids.is_empty(), "no session to terminate");
    // Waits up to 10 s for each to end; a session that ended on its own meanwhile is fine.
    sqlx::query("SELECT pg_terminate_backend(pid, 10000) FROM unnest($1::int4[]) AS t(pid)")
        .bind(&pids)
        .execute(&mut *conn)
        .await
        .unwrap();
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)")
        .bind(&pids)
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(left, 0, "a session stayed");
}

/// The collectors keep their connections outside the pool, so nothing tests them before a
/// batch. One the server closed (a restart, an idle kill) fails the batch's first statement;
/// the batch then runs again on a fresh connection, and its requests succeed as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_succeed_after_the_collectors_connections_were_killed() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    // Both collectors (key look-up, enqueue) now hold a connection.
    let r = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(1))
        .await;
    assert_eq!(r.status, 202, "{}", r.text());

    // A key look-up alone on its killed connection.
    terminate_other_backends(&db.pool).await;
    let r = s.http.get("/v1/usage", &key).await;
    assert_eq!(r.status, 200, "{}", r.text());

    // A batch of one on the enqueue collector's killed connection.
    let r = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(2))
        .await;
    assert_eq!(r.status, 202, "{}", r.text());

    // Both collectors at once, with concurrent requests.
    terminate_other_backends(&db.pool).await;
    let requests = (10..26).map(|n| {
        let (http, key) = (s.http.clone(), key.clone());
        async move {
            http.post_json("/v1/analyses", &key, &analysis_body(n))
                .await
        }
    });
    for r in futures_util::future::join_all(requests).await {
        assert_eq!(r.status, 202, "{}", r.text());
    }
    assert_eq!(written_rows(&db.pool).await, [18, 18, 0, 18, 0]);
    s.stop().await;
}

/// A connection lost while COMMIT was on its way leaves the batch's fate unknown, so the batch is
/// not run again, even on a connection kept from an earlier batch: here the backend ends itself
/// in a deferred trigger (nothing commits), and the request is answered with an error after
/// exactly one attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_at_commit_is_answered_with_an_error_and_never_retried() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    at_commit_of_jobs_for(
        &db.pool,
        "lose_commit",
        "lost",
        "PERFORM pg_terminate_backend(pg_backend_pid()); PERFORM pg_sleep(5);",
    )
    .await;
    // The enqueue collector now holds a connection, which the next batch reuses.
    let r = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(1))
        .await;
    assert_eq!(r.status, 202, "{}", r.text());
    let body = json!({"repository": "https://github.com/a/lost", "ref": sha(2)});
    let r = s.http.post_json("/v1/analyses", &key, &body).await;
    assert_commit_outcome_unknown(&r, &s.http, &key).await;
    let attempts = commit_trigger_firings(&db.pool, "lose_commit").await;
    assert_eq!(attempts, 1, "a batch whose COMMIT was sent ran again");
    assert_eq!(written_rows(&db.pool).await, [1, 1, 0, 1, 0]);
    let r = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(3))
        .await;
    assert_eq!(r.status, 202, "{}", r.text());
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserved_units_become_used_exactly_once_when_jobs_complete() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    let mut jobs = Vec::new();
    for n in 0..3 {
        let r = s
            .http
            .post_json("/v1/analyses", &key, &analysis_body(100 + n))
            .await;
        assert_eq!(r.status, 202);
        jobs.push(r.json()["job"]["id"].as_i64().unwrap());
    }
    let usage = s.http.get("/v1/usage", &key).await.json();
    assert_eq!(
        (
            usage["usage"][0]["used"].clone(),
            usage["usage"][0]["reserved"].clone()
        ),
        (json!(0), json!(3))
    );
    assert_eq!(usage["usage"][0]["remaining"], 997);

    // A worker: the real engine, with the quota hook on its client.
    let client = Client::new(db.pool.clone()).with_hooks(vec![Arc::new(quota::QuotaHook::new())]);
    let mut workers = Workers::new();
    workers.register_fn::<AnalysisArgs, _, _>(|ctx, args| async move {
        ctx.set_output(&json!({"tests": 42, "commit": args.git_ref}))
            .map_err(queue::JobError::from)?;
        Ok(())
    });
    let engine = Engine::builder(client)
        .config(EngineConfig {
            poll_interval: Duration::from_millis(100),
            ..EngineConfig::default()
        })
        .queue(QueueName::new("analysis_priority").unwrap(), 2)
        .workers(workers)
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    let handle = tokio::spawn(engine.run(shutdown.clone()));
    testkit::eventually(Duration::from_secs(30), "the 3 jobs completed", || async {
        (count(&db.pool, "fairlane_job WHERE state = 'completed'").await == 3).then_some(())
    })
    .await;
    shutdown.cancel();
    handle.await.unwrap().unwrap();
    let usage = s.http.get("/v1/usage", &key).await.json();
    assert_eq!(usage["usage"][0]["used"], 3);
    assert_eq!(usage["usage"][0]["reserved"], 0);
    assert_eq!(count(&db.pool, "usage_events").await, 3);
    let job = s
        .http
        .get(&format!("/v1/jobs/{}", jobs[0]), &key)
        .await
        .json();
    assert_eq!(job["state"], "completed");
    assert_eq!(job["result"]["tests"], 42);
    assert!(job["finalized_at"].is_string());
    // Cancelling a completed job changes nothing and bills nothing more.
    let r = s
        .http
        .delete(&format!("/v1/jobs/{}", jobs[0]), &key)
        .await
        .json();
    assert_eq!(r["cancellation"], "already_final");
    assert_eq!(count(&db.pool, "usage_events").await, 3);
    s.stop().await;
}

/// A completed analysis of `owner`'s of `repository` at `commit`, with `{"tests": 7}` as its
/// result: what a cache hit copies.
async fn completed_analysis(
    pool: &sqlx::PgPool,
    owner: uuid::Uuid,
    repository: &str,
    commit: &str,
) {
    sqlx::query(
        "INSERT INTO analyses (user_id, repository, commit, state, result, completed_at) \
         VALUES ($1, $2, $3, 'completed', '{\"tests\": 7}', now())",
    )
    .bind(owner)
    .bind(repository)
    .bind(commit)
    .execute(pool)
    .await
    .unwrap();
}

/// A cache hit's copy stores no inventory of its own: it is read with its original's. When the
/// original goes (its owner is deleted), the inventory is written into the copy first, which
/// reads as before.
#[tokio::test]
async fn a_cache_copy_shares_its_originals_inventory_and_keeps_it_when_the_original_goes() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (owner, _) = user_with_key(&db.pool, "pro").await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    let repository = "https://github.com/fairlane-test/fixture";
    completed_analysis(&db.pool, owner, repository, &sha(5)).await;
    let hit = s
        .http
        .post_json(
            "/v1/analyses",
            &key,
            &json!({"repository": repository, "ref": sha(5)}),
        )
        .await;
    assert_eq!(hit.status, 200, "{}", hit.text());
    assert_eq!(hit.json()["result"]["tests"], 7);
    let copy = hit.json()["id"].as_str().unwrap().to_owned();
    let stored = |copy: String| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, Option<Value>>(
                "SELECT result FROM analyses WHERE id = $1::uuid",
            )
            .bind(copy)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(stored(copy.clone()).await, None, "the copy stores none");
    let read = s.http.get(&format!("/v1/analyses/{copy}"), &key).await;
    assert_eq!(read.status, 200, "{}", read.text());
    assert_eq!(read.json()["result"]["tests"], 7);
    assert_eq!(read.json()["cached"], true);

    sqlx::query("DELETE FROM users WHERE id = $1")
        .bind(owner)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(count(&db.pool, "analyses").await, 1);
    assert_eq!(
        stored(copy.clone()).await,
        Some(json!({"tests": 7})),
        "written into the copy"
    );
    let read = s.http.get(&format!("/v1/analyses/{copy}"), &key).await;
    assert_eq!(read.status, 200, "{}", read.text());
    assert_eq!(read.json()["result"]["tests"], 7);
    s.stop().await;
}

/// A cache hit racing the deletion of its original never leaves a copy without an inventory: the
/// batch locks the original it copies, so it waits for a deletion under way, then finds no
/// original and enqueues the work anew.
#[tokio::test]
async fn a_cache_hit_racing_the_deletion_of_its_original_waits_and_enqueues_anew() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (owner, _) = user_with_key(&db.pool, "pro").await;
    let (caller, key) = user_with_key(&db.pool, "pro").await;
    let repository = "https://github.com/fairlane-test/fixture";
    completed_analysis(&db.pool, owner, repository, &sha(5)).await;
    // The owner's deletion, under way: the original is locked by its trigger.
    let mut deletion = db.pool.begin().await.unwrap();
    sqlx::query("DELETE FROM users WHERE id = $1")
        .bind(owner)
        .execute(&mut *deletion)
        .await
        .unwrap();
    let http = s.http.clone();
    let request = tokio::spawn(async move {
        http.post_json(
            "/v1/analyses",
            &key,
            &json!({"repository": repository, "ref": sha(5)}),
        )
        .await
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while testkit::lock_waiting_statements(&db.pool).await.is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the cache hit did not wait for the deletion of its original"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    deletion.commit().await.unwrap();
    let answer = request.await.unwrap();
    assert_eq!(answer.status, 202, "{}", answer.text());
    let (records, without_inventory): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE state = 'completed' AND result IS NULL) \
         FROM analyses WHERE user_id = $1",
    )
    .bind(caller)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((records, without_inventory), (1, 0));
    s.stop().await;
}

/// Identical requests of one user that meet in one enqueue batch get one copy of the stored
/// analysis between them, as requests one after the other do: each used to copy the whole
/// inventory again, with an id of its own.
#[tokio::test]
async fn identical_cache_hits_in_one_batch_share_one_copy() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (owner, _) = user_with_key(&db.pool, "pro").await;
    let (caller, key) = user_with_key(&db.pool, "free").await;
    let repository = "https://github.com/fairlane-test/fixture.git";
    completed_analysis(&db.pool, owner, repository, &sha(5)).await;
    // The collector's batch waits for a held row, so the identical requests queue together.
    let parked = ParkedCollector::park(&s, &db).await;
    let same: Vec<_> = (0..10)
        .map(|n| {
            let (http, key) = (s.http.clone(), key.clone());
            // Both spellings of the repository, and the commit in either case.
            let body = if n % 2 == 0 {
                json!({"repository": repository, "ref": sha(5)})
            } else {
                json!({"repository": "https://github.com/fairlane-test/fixture", "ref": sha(5).to_uppercase()})
            };
            tokio::spawn(async move { http.post_json("/v1/analyses", &key, &body).await })
        })
        .collect();
    parked.release(&same).await;
    let mut ids = std::collections::BTreeSet::new();
    for answer in same {
        let r = answer.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["result"]["tests"], 7);
        ids.insert(r.json()["id"].as_str().unwrap().to_owned());
    }
    assert_eq!(
        ids.len(),
        1,
        "one copy for one user, repository and commit: {ids:?}"
    );
    let (copies,): (i64,) = sqlx::query_as("SELECT count(*) FROM analyses WHERE user_id = $1")
        .bind(caller)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(copies, 1);
    s.stop().await;
}

/// Identical new requests of one user that meet in one enqueue batch get one job between them,
/// as requests one after the other do (docs/web.md, "Sent again"): one reservation, so a user
/// with one unit left gets 202 for each, not one 202 and `quota_exceeded` for the rest. Either
/// spelling of the repository, and the commit in either case, is the same analysis; specviews
/// of one analysis likewise. With no unit left, each is refused and nothing is written. (A
/// request that reached the batch only after the first committed finds its work in flight
/// instead, with the same answer.)
#[tokio::test]
async fn identical_new_requests_in_one_batch_share_one_job() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (caller, key) = user_with_key(&db.pool, "free").await;
    // One unit of each left: free has 50 analyses and 5 specviews.
    seed_usage(&db.pool, caller, "analysis", 49).await;
    seed_usage(&db.pool, caller, "specview", 4).await;
    let repository = "https://github.com/fairlane-test/fixture.git";
    completed_analysis(&db.pool, caller, repository, &sha(7)).await;
    let (done,): (uuid::Uuid,) =
        sqlx::query_as("SELECT id FROM analyses WHERE user_id = $1 AND state = 'completed'")
            .bind(caller)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    // The collector's batch waits for a held row, so the identical requests queue together.
    let parked = ParkedCollector::park(&s, &db).await;
    let send = |path: &'static str, body: Value| {
        let (http, key) = (s.http.clone(), key.clone());
        tokio::spawn(async move { http.post_json(path, &key, &body).await })
    };
    let analyses: Vec<_> = (0..8)
        .map(|n| {
            let body = if n % 2 == 0 {
                json!({"repository": repository, "ref": sha(3)})
            } else {
                json!({"repository": "https://github.com/fairlane-test/fixture", "ref": sha(3).to_uppercase()})
            };
            send("/v1/analyses", body)
        })
        .collect();
    let specviews: Vec<_> = (0..8)
        .map(|_| send("/v1/specviews", json!({"analysis_id": done})))
        .collect();
    parked.release(analyses.iter().chain(&specviews)).await;
    for (answers, id) in [(analyses, "analysis_id"), (specviews, "specview_id")] {
        let mut answered = std::collections::BTreeSet::new();
        for answer in answers {
            let r = answer.await.unwrap();
            assert_eq!(r.status, 202, "{}", r.text());
            let job = r.json()["job"]["id"].as_i64().unwrap();
            assert_eq!(
                r.header("location"),
                Some(format!("/v1/jobs/{job}").as_str())
            );
            answered.insert((
                r.json()[id].as_str().unwrap().to_owned(),
                r.json()["job"].to_string(),
            ));
        }
        assert_eq!(answered.len(), 1, "one {id} and job: {answered:?}");
    }
    let written: (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM fairlane_job WHERE args ->> 'user_id' = $1::text), \
                (SELECT count(*) FROM quota_reservations WHERE user_id = $1), \
                (SELECT count(*) FROM analyses WHERE user_id = $1), \
                (SELECT count(*) FROM specviews WHERE user_id = $1)",
    )
    .bind(caller)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        written,
        (2, 2, 2, 1),
        "jobs, reservations, analyses, specviews"
    );

    // Used up: another commit, sent four times at once, is refused four times.
    seed_usage(&db.pool, caller, "analysis", 1).await;
    let parked = ParkedCollector::park(&s, &db).await;
    let refused: Vec<_> = (0..4)
        .map(|_| {
            send(
                "/v1/analyses",
                json!({"repository": repository, "ref": sha(4)}),
            )
        })
        .collect();
    parked.release(&refused).await;
    for answer in refused {
        answer.await.unwrap().problem(429, "quota_exceeded");
    }
    let reservations: i64 =
        sqlx::query_scalar("SELECT count(*) FROM quota_reservations WHERE user_id = $1")
            .bind(caller)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(reservations, 2);
    s.stop().await;
}

#[tokio::test]
async fn cache_hits_return_the_stored_result_without_job_reservation_or_usage() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (other, _) = user_with_key(&db.pool, "pro").await;
    let (_, key) = user_with_key(&db.pool, "free").await;
    let repository = "https://github.com/fairlane-test/fixture.git";
    completed_analysis(&db.pool, other, repository, &sha(5)).await;
    // Same repository written differently (upper-case host, default port, no `.git`, trailing
    // slash) and the commit in upper case.
    let r = s
        .http
        .post_json(
            "/v1/analyses",
            &key,
            &json!({"repository": "https://GitHub.com:443/fairlane-test/fixture/", "ref": sha(5).to_uppercase()}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let body = r.json();
    assert_eq!(body["cached"], true);
    // The copy keeps the caller's spelling, normalised.
    assert_eq!(
        body["repository"],
        "https://github.com/fairlane-test/fixture"
    );
    assert_eq!(body["state"], "completed");
    assert_eq!(body["result"]["tests"], 7);
    assert_eq!(body["commit"], sha(5));
    assert!(body["job_id"].is_null());
    // The copy is the caller's own.
    let id = body["id"].as_str().unwrap();
    assert_eq!(
        s.http.get(&format!("/v1/analyses/{id}"), &key).await.status,
        200
    );
    assert_eq!(written_rows(&db.pool).await, [0, 0, 0, 2, 0]);
    // Asking again returns the same record.
    let again = s
        .http
        .post_json(
            "/v1/analyses",
            &key,
            &json!({"repository": repository, "ref": sha(5)}),
        )
        .await
        .json();
    assert_eq!(again["id"], body["id"]);
    assert_eq!(written_rows(&db.pool).await, [0, 0, 0, 2, 0]);
    for spelling in [
        "https://github.com/fairlane-test/fixture.git/",
        "https://github.com//fairlane-test//fixture",
    ] {
        let again = s
            .http
            .post_json(
                "/v1/analyses",
                &key,
                &json!({"repository": spelling, "ref": sha(5)}),
            )
            .await
            .json();
        assert_eq!(again["id"], body["id"], "{spelling}");
    }
    assert_eq!(written_rows(&db.pool).await, [0, 0, 0, 2, 0]);
    // Another repository (path case matters) is not cached.
    let other_repository = s
        .http
        .post_json(
            "/v1/analyses",
            &key,
            &json!({"repository": "https://github.com/fairlane-test/Fixture", "ref": sha(5)}),
        )
        .await;
    assert_eq!(other_repository.status, 202, "{}", other_repository.text());
    // A different commit is not cached.
    let miss = s
        .http
        .post_json(
            "/v1/analyses",
            &key,
            &json!({"repository": repository, "ref": sha(6)}),
        )
        .await;
    assert_eq!(miss.status, 202);
    s.stop().await;
}

/// A cache hit's copy is committed before its inventory is read: if that read fails (here the
/// database stops taking new connections, and the server's pool has none left), the answer is 503
/// `committed_unread` naming the committed copy to look up, not a 500 that says nothing of it.
#[tokio::test]
async fn a_cache_hit_whose_read_fails_after_the_commit_names_the_committed_copy() {
    let db = TestDb::new().await;
    let mut c = config(&db);
    c.http_request_timeout = Duration::from_secs(3);
    let s = TestServer::start(c).await;
    let (original_owner, first_key) = user_with_key(&db.pool, "pro").await;
    let (second_user, second_key) = user_with_key(&db.pool, "pro").await;
    let repository = "https://github.com/fairlane-test/fixture";
    completed_analysis(&db.pool, original_owner, repository, &sha(5)).await;
    let body = json!({"repository": repository, "ref": sha(5)});
    // Both collectors now hold a connection, and the server's pool one or two more (the read,
    // and the weighing before it: large_reads).
    let r = s.http.post_json("/v1/analyses", &first_key, &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["result"]["tests"], 7);

    // The pool's connections end, and no new one is let in; the collectors' stay.
    let mut admin = db.pool.acquire().await.unwrap();
    let readers: Vec<i32> = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
         AND pid <> pg_backend_pid() AND query LIKE '% analyses WHERE id = $1 AND user_id = $2'",
    )
    .fetch_all(&mut *admin)
    .await
    .unwrap();
    assert!(
        (1..=2).contains(&readers.len()),
        "the pool's read connections: {readers:?}"
    );
    for reader in readers {
        let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 10000)")
            .bind(reader)
            .fetch_one(&mut *admin)
            .await
            .unwrap();
        assert!(ended);
    }
    let database: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&mut *admin)
        .await
        .unwrap();
    // A database cannot close itself to connections from its own session.
    let mut server = <sqlx::PgConnection as sqlx::Connection>::connect(&testkit::database_url())
        .await
        .unwrap();
    let allow_connections = |allow: bool| {
        sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE \"{database}\" ALLOW_CONNECTIONS {allow}"
        ))
    };
    sqlx::query(allow_connections(false))
        .execute(&mut server)
        .await
        .unwrap();

    let r = s.http.post_json("/v1/analyses", &second_key, &body).await;
    let problem = r.problem(503, "committed_unread");
    assert_eq!(r.header("retry-after"), Some("1"));
    let named = problem["analysis_id"].as_str().unwrap().to_owned();

    sqlx::query(allow_connections(true))
        .execute(&mut server)
        .await
        .unwrap();
    let copies: Vec<(uuid::Uuid,)> = sqlx::query_as("SELECT id FROM analyses WHERE user_id = $1")
        .bind(second_user)
        .fetch_all(&mut *admin)
        .await
        .unwrap();
    assert_eq!(copies.len(), 1, "the copy was committed");
    assert_eq!(copies[0].0.to_string(), named);
    // The id answers the question the failed read left open.
    let r = s
        .http
        .get(&format!("/v1/analyses/{named}"), &second_key)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["result"]["tests"], 7);
    // Asking again returns that copy: nothing twice, no quota.
    let r = s.http.post_json("/v1/analyses", &second_key, &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["id"], named.as_str());
    // The original (its owner asked first and got it) and the one copy.
    assert_eq!(written_rows(&db.pool).await, [0, 0, 0, 2, 0]);
    s.stop().await;
}

#[tokio::test]
async fn specviews_need_a_completed_analysis_and_serve_markdown() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (_, key) = user_with_key(&db.pool, "free").await;
    let (_, other) = user_with_key(&db.pool, "free").await;
    let created = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(9))
        .await
        .json();
    let analysis = created["analysis_id"].as_str().unwrap().to_owned();
    let body = json!({"analysis_id": analysis});
    let waiting = s
        .http
        .post_json("/v1/specviews", &key, &body)
        .await
        .problem(409, "conflict");
    assert_eq!(waiting["state"], "pending");
    // A failed analysis never will be completed, and the answer says so.
    let failed = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(10))
        .await
        .json();
    sqlx::query("UPDATE analyses SET state = 'failed' WHERE id = $1::uuid")
        .bind(failed["analysis_id"].as_str().unwrap())
        .execute(&db.pool)
        .await
        .unwrap();
    let never = s
        .http
        .post_json(
            "/v1/specviews",
            &key,
            &json!({"analysis_id": failed["analysis_id"]}),
        )
        .await
        .problem(409, "conflict");
    assert_eq!(never["state"], "failed");
    assert!(
        never["detail"].as_str().unwrap().contains("failed"),
        "{never}"
    );
    s.http
        .post_json("/v1/specviews", &other, &body)
        .await
        .problem(404, "not_found");
    sqlx::query("UPDATE analyses SET state = 'completed', result = '{}' WHERE id = $1::uuid")
        .bind(&analysis)
        .execute(&db.pool)
        .await
        .unwrap();
    let r = s.http.post_json("/v1/specviews", &key, &body).await;
    assert_eq!(r.status, 202, "{}", r.text());
    let accepted = r.json();
    assert_eq!(accepted["job"]["queue"], "specview_default");
    let specview = accepted["specview_id"].as_str().unwrap().to_owned();
    let (args,): (Value,) = sqlx::query_as("SELECT args FROM fairlane_job WHERE id = $1")
        .bind(accepted["job"]["id"].as_i64().unwrap())
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(args["specview_id"], specview);
    let usage = s.http.get("/v1/usage", &key).await.json();
    assert_eq!(usage["usage"][1]["event_type"], "specview");
    assert_eq!(usage["usage"][1]["reserved"], 1);
    assert_eq!(usage["usage"][1]["limit"], 5);

    let path = format!("/v1/specviews/{specview}");
    let json = s.http.get(&path, &key).await;
    assert_eq!(
        json.header("vary"),
        Some("accept"),
        "the representation varies"
    );
    let view = json.json();
    assert_eq!(view["state"], "pending");
    let auth = format!("Bearer {key}");
    let md_headers = [
        ("authorization", auth.as_str()),
        ("accept", "text/markdown"),
    ];
    s.http
        .send(Method::GET, &path, &md_headers, None)
        .await
        .problem(409, "conflict");
    sqlx::query(
        "UPDATE specviews SET state = 'completed', markdown = '# Spec' WHERE id = $1::uuid",
    )
    .bind(&specview)
    .execute(&db.pool)
    .await
    .unwrap();
    let md = s.http.send(Method::GET, &path, &md_headers, None).await;
    assert_eq!(md.status, 200);
    assert_eq!(
        md.header("content-type"),
        Some("text/markdown; charset=utf-8")
    );
    assert_eq!(md.header("vary"), Some("accept"));
    assert_eq!(md.text(), "# Spec");
    // Large values are weighed, then read whole (docs/web.md, Large results): a Markdown of
    // over 1 MiB, a result stored in over 16 KiB.
    sqlx::query(
        "UPDATE specviews SET markdown = repeat('m', 2000000), \
                result = (SELECT jsonb_object_agg(md5(i::text), md5((i * 7)::text)) \
                          FROM generate_series(1, 5000) i) \
         WHERE id = $1::uuid",
    )
    .bind(&specview)
    .execute(&db.pool)
    .await
    .unwrap();
    let md = s.http.send(Method::GET, &path, &md_headers, None).await;
    assert_eq!(md.status, 200);
    assert_eq!(md.text().len(), 2_000_000);
    let whole = s.http.get(&path, &key).await.json();
    assert_eq!(whole["markdown"].as_str().map(str::len), Some(2_000_000));
    assert_eq!(whole["result"].as_object().map(|r| r.len()), Some(5000));
    s.http.get(&path, &other).await.problem(404, "not_found");
    let other_auth = format!("Bearer {other}");
    s.http
        .send(
            Method::GET,
            &path,
            &[
                ("authorization", other_auth.as_str()),
                ("accept", "text/markdown"),
            ],
            None,
        )
        .await
        .problem(404, "not_found");
    // The free tier's five specviews: four more fit, the sixth does not. Each is marked done
    // before the next (its reservation stays): one still in flight would be the answer.
    for _ in 0..4 {
        let r = s.http.post_json("/v1/specviews", &key, &body).await;
        assert_eq!(r.status, 202, "{}", r.text());
        sqlx::query("UPDATE specviews SET state = 'completed' WHERE id = $1::uuid")
            .bind(r.json()["specview_id"].as_str().unwrap())
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let refused = s.http.post_json("/v1/specviews", &key, &body).await;
    let p = refused.problem(429, "quota_exceeded");
    assert_eq!(
        (p["limit"].clone(), p["reserved"].clone()),
        (json!(5), json!(5))
    );
    assert_eq!(p["event_type"], "specview");
    s.stop().await;
}

fn git(dir: &std::path::Path, args: &[&str]) -> String {
    let out = std::process::Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_AUTHOR_NAME", "t")
        .env("GIT_AUTHOR_EMAIL", "t@example.com")
        .env("GIT_COMMITTER_NAME", "t")
        .env("GIT_COMMITTER_EMAIL", "t@example.com")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A repository in a fresh folder (removed on drop) with one commit on `main`.
fn repository_with_main(tag: &str) -> testkit::git_fixture::TempDir {
    let dir = testkit::git_fixture::TempDir::new(&format!("web-{tag}"));
    git(dir.path(), &["init", "-q", "-b", "main"]);
    std::fs::write(dir.path().join("lib_test.go"), "package x\n").unwrap();
    git(dir.path(), &["add", "."]);
    git(dir.path(), &["commit", "-q", "-m", "one"]);
    dir
}

/// A repository as [`repository_with_main`] whose `packed-refs` is a FIFO no one writes yet: a
/// `git ls-remote` of it waits until the FIFO is opened for writing. Returns it and the FIFO.
fn stalled_repository(tag: &str) -> (testkit::git_fixture::TempDir, std::path::PathBuf) {
    let dir = repository_with_main(tag);
    let fifo = dir.path().join(".git/packed-refs");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    (dir, fifo)
}

/// `POST /v1/analyses` of the `file://` repository in `dir` at `main` with `key`, in a task.
fn post_main(
    http: &support::Http,
    key: &str,
    dir: &std::path::Path,
) -> tokio::task::JoinHandle<Resp> {
    let (http, key) = (http.clone(), key.to_owned());
    let body = json!({"repository": format!("file://{}", dir.display()), "ref": "main"});
    tokio::spawn(async move { http.post_json("/v1/analyses", &key, &body).await })
}

/// Each of `answers` is a 202 within 10 s (once the resolve slots it waited for are free).
async fn all_accepted_within_10s(answers: impl IntoIterator<Item = tokio::task::JoinHandle<Resp>>) {
    for answer in answers {
        let r = tokio::time::timeout(Duration::from_secs(10), answer)
            .await
            .expect("answered once the permit is free")
            .unwrap();
        assert_eq!(r.status, 202, "{}", r.text());
    }
}

/// Waits up to 10 s for a git process that names `folder`.
async fn until_git_runs_in(folder: &str) {
    testkit::eventually(Duration::from_secs(10), "git to start", || async {
        (!testkit::git_fixture::processes_mentioning(folder).is_empty()).then_some(())
    })
    .await;
}

/// At most `RESOLVE_CONCURRENCY` `git ls-remote` run at once. With one permit, a request whose
/// ls-remote hangs (its repository's `packed-refs` is a FIFO no one writes yet) holds it, and a
/// second request naming a branch waits for it; once the first is released, both are answered.
#[tokio::test]
async fn branch_resolves_run_at_most_resolve_concurrency_at_once() {
    let db = TestDb::new().await;
    let mut config = config(&db);
    config.resolve_concurrency = 1;
    // The stalled git must still be waiting on its FIFO when the test opens it (which blocks
    // until a reader is there), however slow the machine.
    config.resolve_timeout = Duration::from_secs(120);
    config.http_request_timeout = Duration::from_secs(150);
    let s = TestServer::start(config).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    let (stalled, fifo) = stalled_repository("stalled");
    let fine = repository_with_main("fine");
    let post = |dir: &std::path::Path| post_main(&s.http, &key, dir);

    let first = post(stalled.path());
    let stalled_name = stalled.path().display().to_string();
    until_git_runs_in(&stalled_name).await;
    let second = post(fine.path());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!second.is_finished(), "the second resolve did not wait");

    // Writing nothing and closing gives the reader an empty `packed-refs`.
    drop(std::fs::OpenOptions::new().write(true).open(&fifo).unwrap());
    all_accepted_within_10s([first, second]).await;
    s.stop().await;
}

/// One user holds at most `RESOLVE_CONCURRENCY_PER_USER` of the ls-remote slots: with two slots
/// and one per user, a user whose two branch resolves hang (a host that stalls each until
/// `RESOLVE_TIMEOUT`) runs one git and leaves the other slot to everyone else, where they used to
/// take both and keep every other user's branch requests waiting.
#[tokio::test]
async fn one_user_cannot_hold_every_resolve_slot() {
    let db = TestDb::new().await;
    let mut config = config(&db);
    config.resolve_concurrency = 2;
    config.resolve_concurrency_per_user = 1;
    config.resolve_timeout = Duration::from_secs(120);
    config.http_request_timeout = Duration::from_secs(150);
    let s = TestServer::start(config).await;
    let (_, hog) = user_with_key(&db.pool, "enterprise").await;
    let (_, other) = user_with_key(&db.pool, "free").await;
    let (stalled, fifo) = stalled_repository("hog-stalled");
    let held = stalled.path().join(".git/packed-refs.fifo");
    std::fs::hard_link(&fifo, &held).unwrap();
    let fine = repository_with_main("other-fine");
    let post = |key: &str, dir: &std::path::Path| post_main(&s.http, key, dir);

    let hogged = [post(&hog, stalled.path()), post(&hog, stalled.path())];
    let stalled_name = stalled.path().display().to_string();
    until_git_runs_in(&stalled_name).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    // git runs `upload-pack` (through a shell) for the file:// remote: count the ls-remotes.
    let resolves = || {
        testkit::git_fixture::processes_mentioning(&stalled_name)
            .into_iter()
            .filter(|(_, command)| command.contains(" ls-remote "))
            .count()
    };
    assert_eq!(
        resolves(),
        1,
        "one user ran more than one ls-remote at once"
    );
    // Another user's branch request is served meanwhile.
    let served = tokio::time::timeout(Duration::from_secs(30), post(&other, fine.path()))
        .await
        .expect("another user's request waited for the stalled ones")
        .unwrap();
    assert_eq!(served.status, 202, "{}", served.text());
    assert!(hogged.iter().all(|h| !h.is_finished()));

    // The stalled git waits to open the FIFO for reading. A plain empty `packed-refs` takes the
    // FIFO's name (so the next git, and any re-read, find it), and opening the FIFO by another
    // name for writing and closing it gives the waiting git an empty read. Opening blocks until
    // a reader is there, so it runs off this runtime, which serves web.
    let plain = stalled.path().join(".git/packed-refs.plain");
    std::fs::write(&plain, "").unwrap();
    std::fs::rename(&plain, &fifo).unwrap();
    tokio::time::timeout(
        Duration::from_secs(30),
        tokio::task::spawn_blocking(move || {
            drop(std::fs::OpenOptions::new().write(true).open(&held).unwrap());
        }),
    )
    .await
    .expect("the stalled git reading packed-refs")
    .unwrap();
    all_accepted_within_10s(hogged).await;
    s.stop().await;
}

#[tokio::test]
async fn branch_and_tag_refs_resolve_against_the_repository() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    let repo = repository_with_main("repo");
    let dir = repo.path();
    git(dir, &["tag", "v1"]);
    let head = git(dir, &["rev-parse", "HEAD"]);
    let url = format!("file://{}", dir.display());
    for git_ref in [Some("main"), Some("v1"), None] {
        let r = s
            .http
            .post_json(
                "/v1/analyses",
                &key,
                &json!({"repository": url, "ref": git_ref}),
            )
            .await;
        assert!(
            r.status == 202 || r.status == 200,
            "{git_ref:?}: {}",
            r.text()
        );
        let body = r.json();
        assert_eq!(body["commit"], head, "{git_ref:?}");
    }
    let r = s
        .http
        .post_json(
            "/v1/analyses",
            &key,
            &json!({"repository": url, "ref": "nope"}),
        )
        .await;
    assert!(
        r.problem(422, "ref_not_found")["detail"]
            .as_str()
            .unwrap()
            .contains("nope")
    );
    let r = s
        .http
        .post_json(
            "/v1/analyses",
            &key,
            &json!({"repository": "file:///nonexistent/fairlane-repo", "ref": "main"}),
        )
        .await;
    r.problem(422, "repository_not_found");
    s.stop().await;
}

/// Readiness tells an unreachable database without the driver's words, which can name the
/// database, its user or its host; those go to the log.
#[tokio::test]
async fn readiness_does_not_tell_the_drivers_error() {
    let db = TestDb::new().await;
    let mut config = config(&db);
    config.database_url = format!(
        "postgres://secret_user_x:pw@127.0.0.1:{}/secret_db_x",
        support::free_port()
    );
    let s = TestServer::start(config).await;
    let body = s
        .http
        .send(Method::GET, "/readyz", &[], None)
        .await
        .problem(503, "not_ready");
    assert_eq!(body["detail"], "the database is not reachable", "{body}");
    s.stop().await;
}

#[tokio::test]
async fn operational_endpoints() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let get = |p: &'static str| s.http.send(Method::GET, p, &[], None);
    let h = get("/healthz").await;
    assert_eq!(
        (h.status.as_u16(), h.json()["status"].clone()),
        (200, json!("ok"))
    );
    let r = get("/readyz").await;
    assert_eq!(r.status, 200, "{}", r.text());
    let m = get("/metrics").await;
    assert_eq!(m.status, 200);
    assert!(m.header("content-type").unwrap().starts_with("text/plain"));
    let o = get("/openapi.json").await;
    assert_eq!(o.header("content-type"), Some("application/json"));
    let doc = o.json();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    assert!(doc["paths"]["/v1/analyses"]["post"].is_object());
    let d = get("/docs").await;
    assert!(d.header("content-type").unwrap().starts_with("text/html"));
    assert!(d.text().contains("/v1/analyses") && !d.text().contains("<script"));
    get("/nope").await.problem(404, "not_found");
    s.http
        .send(Method::PUT, "/v1/usage", &[], None)
        .await
        .problem(405, "method_not_allowed");
    // Readiness notices missing migrations.
    sqlx::query(
        "DELETE FROM _sqlx_migrations WHERE version = (SELECT max(version) FROM _sqlx_migrations)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let body = get("/readyz").await.problem(503, "not_ready");
    assert!(body["detail"].as_str().unwrap().contains("web migrate"));
    s.stop().await;
}

#[tokio::test]
async fn admin_endpoints_manage_users_tiers_and_keys() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let admin = format!("Bearer {ADMIN_TOKEN}");
    let h = [
        ("authorization", admin.as_str()),
        ("content-type", "application/json"),
    ];
    let created = s
        .http
        .send(
            Method::POST,
            "/admin/users",
            &h,
            Some(br#"{"name":"Ada","tier":"free"}"#.to_vec()),
        )
        .await;
    assert_eq!(created.status, 201, "{}", created.text());
    let user = created.json();
    let id = user["id"].as_str().unwrap().to_owned();
    assert_eq!(user["tier"], "free");
    let patched = s
        .http
        .send(
            Method::PATCH,
            &format!("/admin/users/{id}"),
            &h,
            Some(br#"{"tier":"pro_plus"}"#.to_vec()),
        )
        .await
        .json();
    assert_eq!(patched["tier"], "pro_plus");
    let issued = s
        .http
        .send(Method::POST, &format!("/admin/users/{id}/keys"), &h, None)
        .await;
    assert_eq!(issued.status, 201);
    let key = issued.json()["key"].as_str().unwrap().to_owned();
    let usage = s.http.get("/v1/usage", &key).await.json();
    assert_eq!(usage["tier"], "pro_plus");
    assert_eq!(usage["usage"][0]["limit"], 3000);
    // The stored form is a hash, never the key.
    let (hash,): (Vec<u8>,) = sqlx::query_as("SELECT key_hash FROM api_keys")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(hash.len(), 32);
    assert!(!String::from_utf8_lossy(&hash).contains(&key[20..]));
    // Wrong or missing admin token.
    let wrong = [
        ("authorization", "Bearer nope"),
        ("content-type", "application/json"),
    ];
    s.http
        .send(
            Method::POST,
            "/admin/users",
            &wrong,
            Some(br#"{"name":"x","tier":"free"}"#.to_vec()),
        )
        .await
        .problem(401, "unauthorized");
    // A user's API key is not an admin token.
    let as_user = format!("Bearer {key}");
    s.http
        .send(
            Method::POST,
            &format!("/admin/users/{id}/keys"),
            &[("authorization", &as_user)],
            None,
        )
        .await
        .problem(401, "unauthorized");
    s.http
        .send(
            Method::PATCH,
            &format!("/admin/users/{}", uuid::Uuid::new_v4()),
            &h,
            Some(br#"{"tier":"pro"}"#.to_vec()),
        )
        .await
        .problem(404, "not_found");
    s.http
        .send(Method::DELETE, "/admin/keys/0000000000000000", &h, None)
        .await
        .problem(404, "not_found");
    assert_eq!(count(&db.pool, "users").await, 1);
    s.stop().await;
}

#[tokio::test]
async fn admin_api_is_disabled_without_a_token() {
    let db = TestDb::new().await;
    let mut c = config(&db);
    c.admin_token = None;
    let s = TestServer::start(c).await;
    s.http
        .send(
            Method::POST,
            "/admin/users",
            &[
                ("authorization", "Bearer x"),
                ("content-type", "application/json"),
            ],
            Some(br#"{"name":"x","tier":"free"}"#.to_vec()),
        )
        .await
        .problem(403, "forbidden");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_the_timeout_is_a_503_and_rolled_back() {
    let db = TestDb::new().await;
    let mut c = config(&db);
    c.http_request_timeout = Duration::from_millis(500);
    let s = TestServer::start(c).await;
    let (user, key) = user_with_key(&db.pool, "pro").await;
    // Hold the user's row: the request waits inside its transaction until the timeout.
    let blocker = hold_user_row(&db.pool, user).await;
    let r = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(1))
        .await;
    let body = r.problem(503, "timeout");
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("nothing was changed")
    );
    blocker.rollback().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(written_rows(&db.pool).await, [0, 0, 0, 0, 0]);
    // The server is fine afterwards.
    assert_eq!(
        s.http
            .post_json("/v1/analyses", &key, &analysis_body(1))
            .await
            .status,
        202
    );
    s.stop().await;
}

/// A client that sends its body too slowly has its request answered 408 `request_timeout`, the
/// client's doing, not a 503 that counts against the server's error rate (and pages someone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_does_not_arrive_in_time_is_a_408() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let db = TestDb::new().await;
    let mut c = config(&db);
    c.http_request_timeout = Duration::from_millis(500);
    let s = TestServer::start(c).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    let mut stream = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let head = format!(
        "POST /v1/analyses HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"repo"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0u8; 4096];
        loop {
            let n = stream.read(&mut buf).await.unwrap_or(0);
            if n == 0 {
                break;
            }
            answer.extend_from_slice(&buf[..n]);
            if String::from_utf8_lossy(&answer).contains("}") {
                break;
            }
        }
    })
    .await
    .expect("no answer");
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("\"code\":\"request_timeout\""), "{text}");
    assert_eq!(written_rows(&db.pool).await, [0, 0, 0, 0, 0]);
    s.stop().await;
}

/// A request whose timeout comes while its batch is committing is not told "nothing was
/// changed": its writes commit, and the answer says they may have taken effect. A deferred
/// trigger holds this request's COMMIT on an advisory lock the test holds until the answer came.
#[tokio::test]
async fn a_request_past_the_timeout_while_committing_is_told_its_outcome_is_unknown() {
    let db = TestDb::new().await;
    let mut c = config(&db);
    c.http_request_timeout = Duration::from_secs(2);
    let s = TestServer::start(c).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    at_commit_of_jobs_for(
        &db.pool,
        "slow_commit",
        "slow",
        "PERFORM pg_advisory_xact_lock(4242);",
    )
    .await;
    // The server's connections are open and warm: the request reaches its COMMIT well in time.
    let r = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(1))
        .await;
    assert_eq!(r.status, 202, "{}", r.text());
    let mut holder = db.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(4242)")
        .execute(&mut *holder)
        .await
        .unwrap();

    let body = json!({"repository": "https://github.com/a/slow", "ref": sha(2)});
    let r = s.http.post_json("/v1/analyses", &key, &body).await;
    let problem = r.problem(503, "timeout_outcome_unknown");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("may have taken effect"),
        "{problem}"
    );
    sqlx::query("SELECT pg_advisory_unlock(4242)")
        .execute(&mut *holder)
        .await
        .unwrap();
    // The commit finishes: the job, its reservation and its record exist, as the answer warned.
    let mut rows = [0; 5];
    for _ in 0..150 {
        rows = written_rows(&db.pool).await;
        if rows[0] == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(rows, [2, 2, 0, 2, 0]);
    s.stop().await;
}

/// A cancel or an admin write whose timeout comes while its write is in flight (a `COMMIT`
/// held by a deferred trigger, an `UPDATE` waiting for a row lock) is not told "nothing was
/// changed": the write goes through afterwards, as the answer warned it might.
#[tokio::test]
async fn cancels_and_admin_writes_past_the_timeout_are_told_their_outcome_is_unknown() {
    let db = TestDb::new().await;
    let mut c = config(&db);
    c.http_request_timeout = Duration::from_secs(2);
    let s = TestServer::start(c).await;
    let (user, key) = user_with_key(&db.pool, "pro").await;
    let created = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(31))
        .await;
    assert_eq!(created.status, 202, "{}", created.text());
    let job = created.json()["job"]["id"].as_i64().unwrap();
    for statement in [
        "CREATE FUNCTION slow_cancel() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.state = 'cancelled' THEN PERFORM pg_advisory_xact_lock(4243); END IF; \
         RETURN NULL; END $$",
        "CREATE CONSTRAINT TRIGGER slow_cancel AFTER UPDATE ON fairlane_job \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_cancel()",
    ] {
        sqlx::query(statement).execute(&db.pool).await.unwrap();
    }
    let mut holder = db.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(4243)")
        .execute(&mut *holder)
        .await
        .unwrap();
    let cancelled = s
        .http
        .send(
            Method::DELETE,
            &format!("/v1/jobs/{job}"),
            &[("authorization", &format!("Bearer {key}"))],
            None,
        )
        .await;
    let problem = cancelled.problem(503, "timeout_outcome_unknown");
    assert!(
        !problem["detail"]
            .as_str()
            .unwrap()
            .contains("nothing was changed"),
        "{problem}"
    );
    sqlx::query("SELECT pg_advisory_unlock(4243)")
        .execute(&mut *holder)
        .await
        .unwrap();
    let mut state = String::new();
    for _ in 0..150 {
        state = sqlx::query_scalar("SELECT state::text FROM fairlane_job WHERE id = $1")
            .bind(job)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        if state == "cancelled" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(state, "cancelled", "the cancel committed after the answer");

    // A tier change waiting for the user's row, which a check of theirs holds.
    let mut blocker = db.pool.begin().await.unwrap();
    sqlx::query("SELECT FROM users WHERE id = $1 FOR NO KEY UPDATE")
        .bind(user)
        .execute(&mut *blocker)
        .await
        .unwrap();
    let admin = format!("Bearer {ADMIN_TOKEN}");
    let patched = s
        .http
        .send(
            Method::PATCH,
            &format!("/admin/users/{user}"),
            &[
                ("authorization", admin.as_str()),
                ("content-type", "application/json"),
            ],
            Some(br#"{"tier":"enterprise"}"#.to_vec()),
        )
        .await;
    patched.problem(503, "timeout_outcome_unknown");
    blocker.commit().await.unwrap();
    let mut tier = String::new();
    for _ in 0..150 {
        tier = sqlx::query_scalar("SELECT tier::text FROM users WHERE id = $1")
            .bind(user)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        if tier == "enterprise" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        tier, "enterprise",
        "the tier change committed after the answer"
    );
    s.stop().await;
}

#[tokio::test]
async fn staged_results_stay_hidden_until_completed_and_job_filled_copies_are_not_cache_hits() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    let created = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(21))
        .await
        .json();
    let analysis = created["analysis_id"].as_str().unwrap().to_owned();
    let path = format!("/v1/analyses/{analysis}");
    // A worker staged its result but the job has not completed: nothing is shown yet.
    sqlx::query(
        "UPDATE analyses SET state = 'running', result = '{\"tests\": 3}' WHERE id = $1::uuid",
    )
    .bind(&analysis)
    .execute(&db.pool)
    .await
    .unwrap();
    let view = s.http.get(&path, &key).await.json();
    assert_eq!(view["state"], "running");
    assert!(view["result"].is_null(), "{view}");
    // Completed as a copy of another original (the job ran and was billed): shown, not "cached".
    sqlx::query(
        "UPDATE analyses SET state = 'completed', completed_at = now(), \
         cached_from = gen_random_uuid() WHERE id = $1::uuid",
    )
    .bind(&analysis)
    .execute(&db.pool)
    .await
    .unwrap();
    let view = s.http.get(&path, &key).await.json();
    assert_eq!(view["result"]["tests"], 3);
    assert_eq!(view["cached"], false);
    assert_eq!(view["job_id"], created["job"]["id"]);

    // The same for a specview's staged Markdown.
    let r = s
        .http
        .post_json("/v1/specviews", &key, &json!({"analysis_id": analysis}))
        .await;
    assert_eq!(r.status, 202, "{}", r.text());
    let specview = r.json()["specview_id"].as_str().unwrap().to_owned();
    sqlx::query(
        "UPDATE specviews SET state = 'running', result = '{}', markdown = '# Spec' \
         WHERE id = $1::uuid",
    )
    .bind(&specview)
    .execute(&db.pool)
    .await
    .unwrap();
    let path = format!("/v1/specviews/{specview}");
    let auth = format!("Bearer {key}");
    let md_headers = [
        ("authorization", auth.as_str()),
        ("accept", "text/markdown"),
    ];
    let early = s.http.send(Method::GET, &path, &md_headers, None).await;
    let problem = early.problem(409, "conflict");
    assert!(problem["detail"].as_str().unwrap().contains("running"));
    let view = s.http.get(&path, &key).await.json();
    assert!(
        view["result"].is_null() && view["markdown"].is_null(),
        "{view}"
    );
    s.stop().await;
}

#[tokio::test]
async fn private_hosts_are_refused_unless_the_analyzer_may_reach_them() {
    let db = TestDb::new().await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    let body = json!({"repository": "https://10.1.2.3/org/repo.git", "ref": sha(31)});
    let s = start(&db).await;
    let refused = s.http.post_json("/v1/analyses", &key, &body).await;
    let problem = refused.problem(422, "validation_failed");
    assert!(
        problem["detail"].as_str().unwrap().contains("private"),
        "{problem}"
    );
    assert_eq!(written_rows(&db.pool).await, [0, 0, 0, 0, 0]);
    s.stop().await;

    let s = TestServer::start(web::WebConfig {
        analyzer_allow_private_hosts: true,
        ..config(&db)
    })
    .await;
    let accepted = s.http.post_json("/v1/analyses", &key, &body).await;
    assert_eq!(accepted.status, 202, "{}", accepted.text());
    s.stop().await;
}

/// A user's row held by another session (a web process frozen mid-batch, an operator's open
/// transaction) holds that user's requests for at most `DATABASE_LOCK_TIMEOUT`: they are
/// answered 503 `database_busy` with nothing written, and other users' requests go through.
/// Without the lock timeout the batch waited for as long as the lock was held, and every
/// request queued behind it timed out.
#[tokio::test]
async fn a_user_row_held_elsewhere_is_answered_busy_while_others_go_through() {
    let db = TestDb::new().await;
    let mut c = config(&db);
    c.database_lock_timeout = Duration::from_millis(500);
    let s = TestServer::start(c).await;
    let (stuck, stuck_key) = user_with_key(&db.pool, "pro").await;
    let (_, other_key) = user_with_key(&db.pool, "pro").await;
    let holder = hold_user_row(&db.pool, stuck).await;
    let before = written_rows(&db.pool).await;
    let first = analysis_body(1);
    let (busy, other) = tokio::join!(
        s.http.post_json("/v1/analyses", &stuck_key, &first),
        async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            s.http
                .post_json("/v1/analyses", &other_key, &analysis_body(2))
                .await
        }
    );
    busy.problem(503, "database_busy");
    assert_eq!(busy.header("retry-after"), Some("1"));
    assert_eq!(other.status.as_u16(), 202, "{}", other.text());
    let after = written_rows(&db.pool).await;
    holder.rollback().await.unwrap();
    // One job, reservation and analysis: the other user's. (Usage and specviews unchanged.)
    let added: Vec<i64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
    assert_eq!(
        added,
        [1, 1, 0, 1, 0],
        "jobs, reservations, usage, analyses, specviews"
    );
    let again = s
        .http
        .post_json("/v1/analyses", &stuck_key, &analysis_body(3))
        .await;
    assert_eq!(again.status.as_u16(), 202, "{}", again.text());
    s.stop().await;
}

/// Timeouts longer than PostgreSQL's settings can hold (2³¹−1 ms, about 24.8 days) are sent as
/// that maximum: every connection used to be refused at its start.
#[tokio::test]
async fn timeouts_beyond_what_postgresql_can_hold_still_connect() {
    let db = TestDb::new().await;
    let mut c = config(&db);
    c.http_request_timeout = Duration::from_secs(100 * 24 * 3600);
    c.database_lock_timeout = Duration::from_secs(50 * 24 * 3600);
    let s = TestServer::start(c).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    let r = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(1))
        .await;
    assert_eq!(r.status.as_u16(), 202, "{}", r.text());
    s.stop().await;
}

/// Every page of `path` (a list route with its query, without `cursor`), followed through
/// `next_cursor`: the items' ids in the order given, and how many pages there were.
async fn all_pages(http: &support::Http, path: &str, key: &str) -> (Vec<String>, usize) {
    let mut ids = Vec::new();
    let mut pages = 0;
    let mut cursor: Option<String> = None;
    loop {
        let url = match &cursor {
            Some(c) => format!("{path}&cursor={c}"),
            None => path.to_owned(),
        };
        let r = http.get(&url, key).await;
        assert_eq!(r.status, 200, "{url}: {}", r.text());
        let page = r.json();
        pages += 1;
        for item in page["items"].as_array().unwrap() {
            assert!(
                item.get("result").is_none() && item.get("markdown").is_none(),
                "a list leaves results out: {item}"
            );
            ids.push(item["id"].as_str().unwrap().to_owned());
        }
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => return (ids, pages),
        }
        assert!(pages < 100, "{path}: the pages never end");
    }
}

/// `GET /v1/analyses` and `GET /v1/specviews`: the caller's own records only, newest first, a
/// page at a time through `next_cursor`, each exactly once (records sharing a creation time
/// included, and records created while the caller pages left out of the pages still to read);
/// filters by state, repository (either spelling) and analysis; bad parameters are a 422 that
/// names them.
#[tokio::test]
async fn the_callers_records_are_listed_newest_first_a_page_at_a_time() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (alice_id, alice) = user_with_key(&db.pool, "pro").await;
    let (_, bob) = user_with_key(&db.pool, "pro").await;
    let fixture = "https://github.com/fairlane-test/fixture";
    let mut created = Vec::new();
    for (n, repository) in [
        (1, format!("{fixture}.git")),
        (2, fixture.to_owned()),
        (3, format!("{fixture}.git")),
        (4, "https://github.com/fairlane-test/other.git".to_owned()),
        (5, format!("{fixture}.git")),
    ] {
        let r = s
            .http
            .post_json(
                "/v1/analyses",
                &alice,
                &json!({"repository": repository, "ref": sha(n)}),
            )
            .await;
        assert_eq!(r.status, 202, "{}", r.text());
        created.push(r.json()["analysis_id"].as_str().unwrap().to_owned());
    }
    let bobs = s
        .http
        .post_json("/v1/analyses", &bob, &analysis_body(1))
        .await;
    assert_eq!(bobs.status, 202, "{}", bobs.text());
    let newest_first: Vec<String> = created.iter().rev().cloned().collect();

    let first = s.http.get("/v1/analyses", &alice).await.json();
    let items = first["items"].as_array().unwrap();
    assert_eq!(items.len(), 5);
    assert!(first["next_cursor"].is_null());
    assert_eq!(items[0]["id"], newest_first[0].as_str());
    assert_eq!(items[0]["commit"], sha(5));
    assert_eq!(items[0]["state"], "pending");
    assert_eq!(items[0]["cached"], false);
    assert!(items[0]["job_id"].is_i64());

    let (ids, pages) = all_pages(&s.http, "/v1/analyses?limit=2", &alice).await;
    assert_eq!((ids, pages), (newest_first.clone(), 3));
    let (ids, _) = all_pages(&s.http, "/v1/analyses?limit=1", &bob).await;
    assert_eq!(ids, vec![bobs.json()["analysis_id"].as_str().unwrap()]);

    // Either spelling of a repository finds both.
    for spelling in [fixture.to_owned(), format!("{fixture}.git")] {
        let (ids, _) = all_pages(
            &s.http,
            &format!("/v1/analyses?limit=2&repository={spelling}"),
            &alice,
        )
        .await;
        let want: Vec<String> = [4, 2, 1, 0].iter().map(|i| created[*i].clone()).collect();
        assert_eq!(ids, want, "{spelling}");
    }
    sqlx::query("UPDATE analyses SET state = 'failed' WHERE id = $1::uuid")
        .bind(&created[1])
        .execute(&db.pool)
        .await
        .unwrap();
    let (ids, _) = all_pages(&s.http, "/v1/analyses?state=failed&limit=5", &alice).await;
    assert_eq!(ids, vec![created[1].clone()]);
    let (ids, _) = all_pages(&s.http, "/v1/analyses?state=completed&limit=5", &alice).await;
    assert!(ids.is_empty());
    // Both filters: the repository's records (either spelling) of that state.
    let (ids, _) = all_pages(
        &s.http,
        &format!("/v1/analyses?state=failed&repository={fixture}.git"),
        &alice,
    )
    .await;
    assert_eq!(ids, vec![created[1].clone()]);
    let (ids, _) = all_pages(
        &s.http,
        &format!("/v1/analyses?state=pending&limit=2&repository={fixture}"),
        &alice,
    )
    .await;
    let want: Vec<String> = [4, 2, 0].iter().map(|i| created[*i].clone()).collect();
    assert_eq!(ids, want);

    // A page read, then a new record: the next page goes on where the first ended.
    let page = s.http.get("/v1/analyses?limit=2", &alice).await.json();
    let newer = s
        .http
        .post_json("/v1/analyses", &alice, &analysis_body(6))
        .await;
    assert_eq!(newer.status, 202, "{}", newer.text());
    let cursor = page["next_cursor"].as_str().unwrap();
    let rest = s
        .http
        .get(&format!("/v1/analyses?limit=10&cursor={cursor}"), &alice)
        .await
        .json();
    let rest: Vec<&str> = rest["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        rest,
        newest_first[2..]
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
    );

    // Records of one batch share their creation time: the id orders them, and none is lost or
    // repeated across pages.
    sqlx::query("UPDATE analyses SET created_at = '2026-11-01T00:00:00Z' WHERE user_id = $1")
        .bind(alice_id)
        .execute(&db.pool)
        .await
        .unwrap();
    let (ids, pages) = all_pages(&s.http, "/v1/analyses?limit=1", &alice).await;
    assert_eq!(pages, 6);
    let mut by_id = ids.clone();
    by_id.sort();
    by_id.reverse();
    assert_eq!(ids, by_id);

    // Specviews: of completed analyses of the caller's, filtered by analysis.
    let mut specviews = Vec::new();
    for analysis in [&created[0], &created[2], &created[0]] {
        sqlx::query("UPDATE analyses SET state = 'completed', result = '{}' WHERE id = $1::uuid")
            .bind(analysis)
            .execute(&db.pool)
            .await
            .unwrap();
        let r = s
            .http
            .post_json("/v1/specviews", &alice, &json!({"analysis_id": analysis}))
            .await;
        assert_eq!(r.status, 202, "{}", r.text());
        let id = r.json()["specview_id"].as_str().unwrap().to_owned();
        // Done, so the next request for its analysis makes a new one.
        sqlx::query("UPDATE specviews SET state = 'completed' WHERE id = $1::uuid")
            .bind(&id)
            .execute(&db.pool)
            .await
            .unwrap();
        specviews.push(id);
    }
    specviews.reverse();
    let (ids, pages) = all_pages(&s.http, "/v1/specviews?limit=2", &alice).await;
    assert_eq!((ids, pages), (specviews.clone(), 2));
    let (ids, _) = all_pages(
        &s.http,
        &format!(
            "/v1/specviews?limit=1&state=completed&analysis_id={}",
            created[0]
        ),
        &alice,
    )
    .await;
    assert_eq!(ids, vec![specviews[0].clone(), specviews[2].clone()]);
    for (query, found) in [
        (format!("analysis_id={}", created[1]), 0),
        (format!("analysis_id={}&state=pending", created[0]), 0),
        (format!("analysis_id={}", created[2]), 1),
    ] {
        let (ids, _) = all_pages(&s.http, &format!("/v1/specviews?{query}"), &alice).await;
        assert_eq!(ids.len(), found, "{query}");
    }
    let (ids, _) = all_pages(&s.http, "/v1/specviews?limit=2", &bob).await;
    assert!(ids.is_empty());

    // Bad parameters: a 422 that names what is wrong.
    for (query, names) in [
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("limit=many", "limit"),
        ("limit=1&limit=2", "limit"),
        ("cursor=bm90IGEgY3Vyc29y", "cursor"),
        ("cursor=", "cursor"),
        ("state=done", "done"),
        ("colour=blue", "colour"),
        ("repository=ssh://github.com/o/r", "repository"),
    ] {
        let r = s.http.get(&format!("/v1/analyses?{query}"), &alice).await;
        let body = r.problem(422, "validation_failed");
        let detail = body["detail"].as_str().unwrap();
        assert!(detail.contains(names), "{query}: {detail}");
    }
    for query in ["analysis_id=nope", "repository=https://github.com/o/r"] {
        let r = s.http.get(&format!("/v1/specviews?{query}"), &alice).await;
        r.problem(422, "validation_failed");
    }
    s.http
        .get("/v1/analyses", "not-a-key")
        .await
        .problem(401, "unauthorized");
    s.stop().await;
}

/// A request sent again while the work it started is in flight (`pending` or `running`), as a
/// client does after a timeout, gets that work and its job: no second job, no second
/// reservation, and no `quota_exceeded` for a user whose one remaining unit it holds. Either
/// spelling of the repository finds it, and of several records of it the one whose job is in
/// flight. Once it has failed, the request enqueues anew; once
/// another user's original of the commit is completed, the cache answers instead.
#[tokio::test]
async fn a_request_sent_again_while_its_work_is_in_flight_gets_the_same_job() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (user, key) = user_with_key(&db.pool, "free").await;
    // The free tier's 50 analyses: one left.
    seed_usage(&db.pool, user, "analysis", 49).await;
    let first = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(1))
        .await;
    assert_eq!(first.status, 202, "{}", first.text());
    let first = first.json();
    for body in [
        analysis_body(1),
        json!({"repository": "https://github.com/fairlane-test/fixture", "ref": sha(1)}),
    ] {
        let again = s.http.post_json("/v1/analyses", &key, &body).await;
        assert_eq!(again.status, 202, "{}", again.text());
        let job = first["job"]["id"].as_i64().unwrap();
        assert_eq!(
            again.header("location"),
            Some(format!("/v1/jobs/{job}").as_str())
        );
        let again = again.json();
        assert_eq!(again["analysis_id"], first["analysis_id"]);
        assert_eq!(again["job"], first["job"]);
        assert_eq!(again["commit"], sha(1));
    }
    assert_eq!(count(&db.pool, "fairlane_job").await, 1);
    assert_eq!(count(&db.pool, "quota_reservations").await, 1);
    assert_eq!(count(&db.pool, "analyses").await, 1);
    // Another commit needs a unit of its own, and none is left.
    s.http
        .post_json("/v1/analyses", &key, &analysis_body(2))
        .await
        .problem(429, "quota_exceeded");

    // Running counts as in flight too.
    sqlx::query("UPDATE analyses SET state = 'running'")
        .execute(&db.pool)
        .await
        .unwrap();
    let again = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(1))
        .await;
    assert_eq!(again.json()["analysis_id"], first["analysis_id"]);

    // Cancelled while waiting: failed, its unit released; the request enqueues anew.
    let job = first["job"]["id"].as_i64().unwrap();
    sqlx::query("UPDATE analyses SET state = 'pending'")
        .execute(&db.pool)
        .await
        .unwrap();
    let cancelled = s.http.delete(&format!("/v1/jobs/{job}"), &key).await;
    assert_eq!(cancelled.json()["cancellation"], "cancelled");
    let anew = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(1))
        .await;
    assert_eq!(anew.status, 202, "{}", anew.text());
    let anew = anew.json();
    assert_ne!(anew["analysis_id"], first["analysis_id"]);
    assert_ne!(anew["job"]["id"], first["job"]["id"]);
    assert_eq!(count(&db.pool, "fairlane_job").await, 2);

    // A running job asked to stop (its record still `running` until the worker stops) and a
    // record whose job is gone are not in flight: the request enqueues anew.
    let (_, pro) = user_with_key(&db.pool, "pro").await;
    let doomed = s
        .http
        .post_json("/v1/analyses", &pro, &analysis_body(5))
        .await
        .json();
    let doomed_job = doomed["job"]["id"].as_i64().unwrap();
    sqlx::query(
        "UPDATE fairlane_job SET state = 'running', attempt = 1, attempted_at = now() \
         WHERE id = $1",
    )
    .bind(doomed_job)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("UPDATE analyses SET state = 'running' WHERE id = $1::uuid")
        .bind(doomed["analysis_id"].as_str().unwrap())
        .execute(&db.pool)
        .await
        .unwrap();
    let asked = s.http.delete(&format!("/v1/jobs/{doomed_job}"), &pro).await;
    assert_eq!(asked.json()["cancellation"], "requested");
    let restarted = s
        .http
        .post_json("/v1/analyses", &pro, &analysis_body(5))
        .await;
    assert_eq!(restarted.status, 202, "{}", restarted.text());
    let restarted = restarted.json();
    assert_ne!(restarted["job"]["id"], doomed["job"]["id"]);
    // A newer record of the same work whose job is not in flight (here: none, as a restore might
    // leave it) does not hide an older one whose job is: the request gets the older one.
    sqlx::query(
        "INSERT INTO analyses (user_id, repository, commit, state, created_at) \
         SELECT user_id, repository, commit, 'pending', created_at + interval '1 second' \
         FROM analyses WHERE id = $1::uuid",
    )
    .bind(restarted["analysis_id"].as_str().unwrap())
    .execute(&db.pool)
    .await
    .unwrap();
    let again = s
        .http
        .post_json("/v1/analyses", &pro, &analysis_body(5))
        .await;
    assert_eq!(again.status, 202, "{}", again.text());
    assert_eq!(again.json()["analysis_id"], restarted["analysis_id"]);
    assert_eq!(again.json()["job"]["id"], restarted["job"]["id"]);
    sqlx::query("DELETE FROM fairlane_job WHERE id = $1")
        .bind(restarted["job"]["id"].as_i64().unwrap())
        .execute(&db.pool)
        .await
        .unwrap();
    let orphaned = s
        .http
        .post_json("/v1/analyses", &pro, &analysis_body(5))
        .await;
    assert_eq!(orphaned.status, 202, "{}", orphaned.text());
    assert_ne!(orphaned.json()["analysis_id"], restarted["analysis_id"]);

    // Another user's completed original of the commit: the cache answers (200, a copy), even
    // with this user's own analysis of it in flight.
    let (other, _) = user_with_key(&db.pool, "pro").await;
    completed_analysis(
        &db.pool,
        other,
        "https://github.com/fairlane-test/fixture.git",
        &sha(1),
    )
    .await;
    let cached = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(1))
        .await;
    assert_eq!(cached.status, 200, "{}", cached.text());
    assert_eq!(cached.json()["cached"], true);

    // Specviews: one of an analysis in flight is the answer to another request for it.
    let analysis = cached.json()["id"].as_str().unwrap().to_owned();
    let body = json!({"analysis_id": analysis});
    let first = s.http.post_json("/v1/specviews", &key, &body).await;
    assert_eq!(first.status, 202, "{}", first.text());
    let again = s.http.post_json("/v1/specviews", &key, &body).await;
    assert_eq!(again.status, 202, "{}", again.text());
    assert_eq!(again.json()["specview_id"], first.json()["specview_id"]);
    assert_eq!(again.json()["job"], first.json()["job"]);
    let (specviews, reservations): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM specviews), \
                (SELECT count(*) FROM quota_reservations WHERE event_type = 'specview')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((specviews, reservations), (1, 1));
    let job = s
        .http
        .get(
            &format!("/v1/jobs/{}", first.json()["job"]["id"].as_i64().unwrap()),
            &key,
        )
        .await
        .json();
    assert_eq!(job["kind"], "specview");
    assert_eq!(job["specview_id"], first.json()["specview_id"]);
    assert_eq!(job["analysis_id"], analysis.as_str());
    s.stop().await;
}

/// `GET /v1/analyses/{id}` and `GET /v1/specviews/{id}` answer with an entity tag (one per
/// representation) that changes with every write of the record, and a request whose
/// `If-None-Match` names the current one is answered 304 without a body; another user's record
/// stays a 404 whatever the condition.
#[tokio::test]
async fn records_answer_with_an_entity_tag_and_304_while_unchanged() {
    let db = TestDb::new().await;
    let s = start(&db).await;
    let (_, key) = user_with_key(&db.pool, "pro").await;
    let (_, other) = user_with_key(&db.pool, "pro").await;
    let auth = format!("Bearer {key}");
    let created = s
        .http
        .post_json("/v1/analyses", &key, &analysis_body(1))
        .await
        .json();
    let id = created["analysis_id"].as_str().unwrap().to_owned();
    let path = format!("/v1/analyses/{id}");
    let get = |condition: Option<String>, key: String| {
        let http = s.http.clone();
        let path = path.clone();
        async move {
            let auth = format!("Bearer {key}");
            let mut headers = vec![("authorization", auth.as_str())];
            if let Some(c) = condition.as_deref() {
                headers.push(("if-none-match", c));
            }
            http.send(Method::GET, &path, &headers, None).await
        }
    };

    let first = get(None, key.clone()).await;
    assert_eq!(first.status, 200);
    let tag = first.header("etag").unwrap().to_owned();
    assert!(tag.starts_with('"') && tag.ends_with('"'), "{tag}");
    assert_eq!(first.header("cache-control"), Some("private, no-cache"));
    for condition in [tag.clone(), format!("W/{tag}"), format!("\"x\", {tag}")] {
        let r = get(Some(condition.clone()), key.clone()).await;
        assert_eq!(r.status, 304, "{condition}");
        assert!(r.text().is_empty());
        assert_eq!(r.header("etag"), Some(tag.as_str()));
    }
    for condition in ["\"x\"", "*", "not a tag"] {
        let r = get(Some(condition.to_owned()), key.clone()).await;
        assert_eq!(r.status, 200, "{condition}");
    }
    get(Some(tag.clone()), other.clone())
        .await
        .problem(404, "not_found");

    // Any write of the row is a new version, even one that leaves updated_at alone.
    sqlx::query("UPDATE analyses SET error = 'x' WHERE id = $1::uuid")
        .bind(&id)
        .execute(&db.pool)
        .await
        .unwrap();
    let changed = get(Some(tag.clone()), key.clone()).await;
    assert_eq!(changed.status, 200);
    let second = changed.header("etag").unwrap().to_owned();
    assert_ne!(second, tag);

    // A large result: the condition is answered before it is read.
    sqlx::query(
        "UPDATE analyses SET state = 'completed', completed_at = now(), updated_at = now(), \
                result = (SELECT jsonb_object_agg(md5(i::text), md5((i * 7)::text)) \
                          FROM generate_series(1, 5000) i) \
         WHERE id = $1::uuid",
    )
    .bind(&id)
    .execute(&db.pool)
    .await
    .unwrap();
    let large = get(Some(second.clone()), key.clone()).await;
    assert_eq!(large.status, 200);
    assert_eq!(
        large.json()["result"].as_object().map(|r| r.len()),
        Some(5000)
    );
    let third = large.header("etag").unwrap().to_owned();
    assert_eq!(get(Some(third.clone()), key.clone()).await.status, 304);

    // Specviews: JSON and Markdown have tags of their own; 304 says Vary too.
    let r = s
        .http
        .post_json("/v1/specviews", &key, &json!({"analysis_id": id}))
        .await;
    assert_eq!(r.status, 202, "{}", r.text());
    let specview = r.json()["specview_id"].as_str().unwrap().to_owned();
    sqlx::query(
        "UPDATE specviews SET state = 'completed', result = '{\"a\": 1}', markdown = '# A', \
                completed_at = now(), updated_at = now() WHERE id = $1::uuid",
    )
    .bind(&specview)
    .execute(&db.pool)
    .await
    .unwrap();
    let spath = format!("/v1/specviews/{specview}");
    let as_json = s
        .http
        .send(Method::GET, &spath, &[("authorization", &auth)], None)
        .await;
    let md_headers = [
        ("authorization", auth.as_str()),
        ("accept", "text/markdown"),
    ];
    let as_md = s.http.send(Method::GET, &spath, &md_headers, None).await;
    assert_eq!(as_json.status, 200);
    assert_eq!(as_md.status, 200);
    let (json_tag, md_tag) = (
        as_json.header("etag").unwrap().to_owned(),
        as_md.header("etag").unwrap().to_owned(),
    );
    assert_ne!(json_tag, md_tag);
    let again = s
        .http
        .send(
            Method::GET,
            &spath,
            &[("authorization", &auth), ("if-none-match", &json_tag)],
            None,
        )
        .await;
    assert_eq!(again.status, 304);
    assert_eq!(again.header("vary"), Some("accept"));
    // The JSON's tag does not stand for the Markdown.
    let md_again = s
        .http
        .send(
            Method::GET,
            &spath,
            &[
                ("authorization", &auth),
                ("accept", "text/markdown"),
                ("if-none-match", &json_tag),
            ],
            None,
        )
        .await;
    assert_eq!(md_again.status, 200);
    assert_eq!(md_again.text(), "# A");
    // No Markdown yet: a 409 whatever the condition, even one naming the version's tag.
    let pending = s
        .http
        .post_json("/v1/specviews", &key, &json!({"analysis_id": id}))
        .await;
    assert_eq!(pending.status, 202, "{}", pending.text());
    let pending_path = format!(
        "/v1/specviews/{}",
        pending.json()["specview_id"].as_str().unwrap()
    );
    let pending_tag = s
        .http
        .send(
            Method::GET,
            &pending_path,
            &[("authorization", &auth)],
            None,
        )
        .await
        .header("etag")
        .unwrap()
        .to_owned();
    let crafted = format!("{}.md\"", pending_tag.trim_end_matches('"'));
    let no_markdown = s
        .http
        .send(
            Method::GET,
            &pending_path,
            &[
                ("authorization", &auth),
                ("accept", "text/markdown"),
                ("if-none-match", &crafted),
            ],
            None,
        )
        .await;
    let body = no_markdown.problem(409, "conflict");
    assert_eq!(body["state"], "pending");
    assert!(no_markdown.header("etag").is_none());
    s.stop().await;
}
