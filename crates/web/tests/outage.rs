//! The database out of reach, through a proxy that goes silent: requests are answered 503
//! `database_unavailable` (nothing written), and an enqueue batch whose connection is cut is
//! answered as a whole once the database proves out of reach, instead of each of its requests
//! waiting for a connection in turn until their request timeouts; an admin write cut in flight is
//! answered `commit_outcome_unknown`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use http::Method;

use support::{
    Resp, TestServer, analysis_body, config, hold_user_row, until_a_lock_waits, user_with_key,
    written_rows,
};
use testkit::TestDb;
use testkit::proxy::TcpProxy;

fn assert_unavailable(r: &Resp, who: &str) {
    assert_eq!(r.status.as_u16(), 503, "{who}: {}", r.text());
    assert_eq!(
        r.json()["code"],
        "database_unavailable",
        "{who}: {}",
        r.text()
    );
    assert_eq!(r.header("retry-after"), Some("5"), "{who}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_gone_silent_answers_a_whole_batch_unavailable_within_its_timeout() {
    let db = TestDb::new().await;
    let proxy = TcpProxy::start(db.server_address()).await;
    let mut c = config(&db);
    c.database_url = db.url_through(proxy.addr());
    // Requests wait for a held row until the cut, not until a lock timeout.
    c.database_lock_timeout = Duration::from_secs(120);
    // A connection is waited for 10 s at most: the batch's retry on a fresh one and the first
    // request run alone take 20 s; a second one alone would take the rest past 28 s.
    c.http_request_timeout = Duration::from_secs(28);
    let s = TestServer::start(c).await;
    let mut users = Vec::new();
    for _ in 0..6 {
        users.push(user_with_key(&db.pool, "pro").await);
    }
    let hold_first = hold_user_row(&db.pool, users[0].0).await;
    let hold_second = hold_user_row(&db.pool, users[1].0).await;
    let post = |n: usize| {
        let http = s.http.clone();
        let key = users[n].1.clone();
        tokio::spawn(async move {
            http.post_json("/v1/analyses", &key, &analysis_body(n as u64))
                .await
        })
    };
    // The first user's request, alone in a batch, waits for its row; the other five queue
    // behind that batch and go together in the next.
    let first = post(0);
    until_a_lock_waits(&db.pool, "the first batch to block").await;
    let rest: Vec<_> = (1..6).map(post).collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    hold_first.rollback().await.unwrap();
    let first = first.await.unwrap();
    assert_eq!(first.status.as_u16(), 202, "{}", first.text());
    // The second batch waits for the second user's row, on its kept connection.
    until_a_lock_waits(&db.pool, "the second batch to block").await;

    proxy.blackhole();
    let usage = {
        let http = s.http.clone();
        let key = users[5].1.clone();
        tokio::spawn(async move { http.get("/v1/usage", &key).await })
    };
    for (n, request) in rest.into_iter().enumerate() {
        assert_unavailable(&request.await.unwrap(), &format!("request {}", n + 1));
    }
    assert_unavailable(&usage.await.unwrap(), "GET /v1/usage");

    // The batch's transaction died with its connection: only the first user's writes are there.
    hold_second.rollback().await.unwrap();
    testkit::eventually(
        Duration::from_secs(10),
        "the cut sessions to end",
        || async { (written_rows(&db.pool).await == [1, 1, 0, 1, 0]).then_some(()) },
    )
    .await;
    proxy.forward_to(db.server_address());
    s.stop().await;
}

/// An admin write is one autocommit statement: cut while it waits for a row, its effect is
/// unknown (`commit_outcome_unknown`, look before sending it again); one that never gets a
/// connection changed nothing (`database_unavailable`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_write_cut_in_flight_is_of_unknown_outcome_and_one_never_sent_is_unavailable() {
    let db = TestDb::new().await;
    let proxy = TcpProxy::start(db.server_address()).await;
    let mut c = config(&db);
    c.database_url = db.url_through(proxy.addr());
    c.database_lock_timeout = Duration::from_secs(120);
    let s = TestServer::start(c).await;
    let (user, _) = user_with_key(&db.pool, "free").await;
    let admin = format!("Bearer {}", support::ADMIN_TOKEN);
    let send = |method: Method, path: String, body: &'static str| {
        let http = s.http.clone();
        let admin = admin.clone();
        tokio::spawn(async move {
            let headers = [
                ("authorization", admin.as_str()),
                ("content-type", "application/json"),
            ];
            http.send(method, &path, &headers, Some(body.as_bytes().to_vec()))
                .await
        })
    };
    let holder = hold_user_row(&db.pool, user).await;
    let change = send(
        Method::PATCH,
        format!("/admin/users/{user}"),
        r#"{"tier": "enterprise"}"#,
    );
    until_a_lock_waits(&db.pool, "the tier change to block").await;
    proxy.blackhole();
    let change = change.await.unwrap();
    change.problem(503, "commit_outcome_unknown");
    let create = send(
        Method::POST,
        "/admin/users".to_owned(),
        r#"{"name": "n", "tier": "pro"}"#,
    )
    .await
    .unwrap();
    assert_unavailable(&create, "POST /admin/users");
    holder.rollback().await.unwrap();
    proxy.forward_to(db.server_address());
    s.stop().await;
}
