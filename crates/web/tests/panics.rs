//! A handler that panics answers a 500 problem and is measured like every other response: the
//! server's layers ([`web::with_layers`]) around a route that panics, with the global meter
//! provider of `telemetry::init`. One global `init` per process: this file.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use axum::Router;
use axum::routing::get;
use http::Method;
use support::{Http, config};
use telemetry::{LogFormat, TelemetryConfig};
use testkit::TestDb;

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

    let expected = "http_server_request_duration_seconds_count{method=\"GET\",route=\"/boom\",status=\"500\"} 1";
    let text = telemetry::render_prometheus();
    assert!(
        text.lines().any(|line| line == expected),
        "missing {expected:?} in\n{text}"
    );
    server.abort();
}

async fn boom() -> &'static str {
    panic!("the handler broke")
}
