//! The layers every request goes through ([`web::with_layers`]), around routes of the tests' own:
//! a handler that panics answers a 500 problem and is measured like every other response, a
//! made-up method is measured as `_OTHER` (with
//! the global meter provider of `telemetry::init`, once per process: only the panic test calls
//! it), and a handler that runs out of time answers 503 `timeout`, or
//! `timeout_outcome_unknown` if it was dropped while its writes were being committed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use axum::routing::get;
use axum::{Extension, Router};
use http::Method;
use support::{Http, config};
use telemetry::{LogFormat, TelemetryConfig};
use testkit::TestDb;
use web::middleware::TimeoutWatch;

#[tokio::test]
async fn a_panicking_handler_answers_500_and_is_counted_in_the_request_metric() {
    let _telemetry = telemetry::init(&TelemetryConfig {
        log_format: LogFormat::Pretty,
        ..TelemetryConfig::for_service("fairlane-web-panics", "0.0.1")
    })
    .unwrap();
    let db = TestDb::new().await;
    let config = config(&db);
    let batch_thread = web::batch::BatchThread::start("panics-test-batches").unwrap();
    let state = web::build_state(&config, db.pool.clone(), &batch_thread).unwrap();
    let routes = Router::new().route("/boom", get(boom));
    let app = web::with_layers(routes, state, &config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = Http::new(listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let response = http.send(Method::GET, "/boom", &[], None).await;
    let body = response.problem(500, "internal");
    assert!(
        !body["detail"].as_str().unwrap().contains("broke"),
        "{body}"
    );

    // A method of the client's own making is measured as `_OTHER`: clients cannot mint series.
    for made_up in ["FOO123", "FOO124"] {
        http.send(
            Method::from_bytes(made_up.as_bytes()).unwrap(),
            "/boom",
            &[],
            None,
        )
        .await
        .problem(405, "method_not_allowed");
    }

    let expected = "http_server_request_duration_seconds_count{method=\"GET\",route=\"/boom\",status=\"500\"} 1";
    let text = telemetry::render_prometheus();
    assert!(
        text.lines().any(|line| line == expected),
        "missing {expected:?} in\n{text}"
    );
    let other = "http_server_request_duration_seconds_count{method=\"_OTHER\",route=\"/boom\",status=\"405\"} 2";
    assert!(
        text.lines().any(|line| line == other),
        "missing {other:?} in\n{text}"
    );
    assert!(!text.contains("FOO12"), "{text}");
    server.abort();
}

async fn boom() -> &'static str {
    panic!("the handler broke")
}

/// Tells the request's watch, when dropped, that its writes may have committed.
struct Committing(TimeoutWatch);

impl Drop for Committing {
    fn drop(&mut self) {
        self.0.outcome_unknown();
    }
}

async fn slow_while_committing(Extension(watch): Extension<TimeoutWatch>) -> &'static str {
    let _committing = Committing(watch);
    tokio::time::sleep(Duration::from_secs(30)).await;
    "finished"
}

async fn slow() -> &'static str {
    tokio::time::sleep(Duration::from_secs(30)).await;
    "finished"
}

#[tokio::test]
async fn a_timeout_says_nothing_changed_only_when_the_handler_was_not_committing() {
    let db = TestDb::new().await;
    let mut config = config(&db);
    config.http_request_timeout = Duration::from_millis(200);
    let batch_thread = web::batch::BatchThread::start("timeout-test-batches").unwrap();
    let state = web::build_state(&config, db.pool.clone(), &batch_thread).unwrap();
    let routes = Router::new()
        .route("/slow", get(slow))
        .route("/slow-while-committing", get(slow_while_committing));
    let app = web::with_layers(routes, state, &config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = Http::new(listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let body = http
        .send(Method::GET, "/slow", &[], None)
        .await
        .problem(503, "timeout");
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("nothing was changed"),
        "{body}"
    );
    let body = http
        .send(Method::GET, "/slow-while-committing", &[], None)
        .await
        .problem(503, "timeout_outcome_unknown");
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.contains("may have taken effect") && !detail.contains("nothing was changed"),
        "{body}"
    );
    server.abort();
}
