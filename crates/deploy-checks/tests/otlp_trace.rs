//! One request, one trace (SPEC §8, issue #7): `web` and `analyzer-worker` run as processes that
//! export spans over OTLP to the test receiver of the telemetry crate; a request to
//! `POST /v1/analyses` enqueues an `analysis` job, the worker runs it, and the receiver must hold
//! the web's request span and the worker's `job.process` span in the same trace, the worker span
//! a child of the span that enqueued the job.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use serde_json::json;
use support::{Http, env_names, start_service, temp_dir};
use telemetry::testing::{OtlpReceiver, ReceivedSpan};
use testkit::TestDb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_request_and_the_job_it_enqueued_share_one_trace_across_processes() {
    let receiver = OtlpReceiver::start().await.unwrap();
    let http = Http::default();
    let db = TestDb::new().await;
    let settings: Vec<(&str, String)> = vec![
        ("DATABASE_URL", db.url()),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint()),
        // The SDK's batch span processor: export quickly.
        ("OTEL_BSP_SCHEDULE_DELAY", "100".into()),
        ("RUST_LOG", "info".into()),
        ("LOG_FORMAT", "json".into()),
        ("ANALYZER_ALLOW_FILE_URLS", "true".into()),
        ("RATELIMIT_ENABLED", "false".into()),
        ("QUEUE_POLL_INTERVAL", "200ms".into()),
    ];
    let mut services = Vec::new();
    for binary in ["web", "analyzer-worker"] {
        let reads = env_names(binary).unwrap();
        let env: Vec<(&str, String)> = settings
            .iter()
            .filter(|(k, _)| reads.contains(*k) || k.starts_with("OTEL_BSP_"))
            .cloned()
            .collect();
        services.push(start_service(&http, binary, &env).await);
    }
    let web = services[0].base.clone();

    let user = web::admin::create_user(&db.pool, "tracer", web::admin::parse_tier("pro").unwrap())
        .await
        .unwrap();
    let key = web::admin::issue_key(&db.pool, user.id).await.unwrap().key;
    let repo_dir = temp_dir("trace-repo");
    let (repository, commit) = support::fixture_repository(&repo_dir);
    // The client names the trace and says "not sampled": the trace id is kept, for
    // correlation, but the request and its job are recorded all the same.
    let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let auth = format!("Bearer {key}");
    let client_parent = format!("00-{client_trace}-00f067aa0ba902b7-00");
    let response = http
        .try_send(
            http::Method::POST,
            &format!("{web}/v1/analyses"),
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
                ("traceparent", &client_parent),
            ],
            serde_json::to_vec(&json!({"repository": repository, "ref": commit})).unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status, 202, "{}", response.text());
    let job_id = response.json()["job"]["id"].as_i64().unwrap();
    let traceparent: String = sqlx::query_scalar(
        "SELECT metadata -> 'trace' ->> 'traceparent' FROM fairlane_job WHERE id = $1",
    )
    .bind(job_id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let parts: Vec<&str> = traceparent.split('-').collect();
    let (trace_id, enqueuing_span) = (parts[1].to_owned(), parts[2].to_owned());
    assert_eq!(trace_id, client_trace, "the caller's trace is continued");
    assert_eq!(parts[3], "01", "and recorded: {traceparent}");

    let in_trace = |r: &OtlpReceiver, service: &str| -> Vec<ReceivedSpan> {
        r.spans()
            .into_iter()
            .filter(|s| s.trace_id == trace_id && s.service_name.as_deref() == Some(service))
            .collect()
    };
    let complete = receiver
        .wait_until(Duration::from_secs(60), |r| {
            let worker = in_trace(r, "fairlane-analyzer-worker");
            !in_trace(r, "fairlane-web").is_empty()
                && worker.iter().any(|s| s.parent_span_id == enqueuing_span)
        })
        .await;
    let web_spans = in_trace(&receiver, "fairlane-web");
    let worker_spans = in_trace(&receiver, "fairlane-analyzer-worker");
    assert!(
        complete,
        "trace {trace_id}: web spans {web_spans:?}, worker spans {worker_spans:?}; all: {:?}",
        receiver.spans()
    );
    // The enqueuing span is the web's (exported), and the worker's job span hangs below it.
    assert!(
        web_spans.iter().any(|s| s.span_id == enqueuing_span),
        "the job's parent {enqueuing_span} is not a web span: {web_spans:?}"
    );
    let request_span = web_spans
        .iter()
        .find(|s| s.span_id == enqueuing_span)
        .unwrap();
    assert_eq!(request_span.name, "POST /v1/analyses");
    let job_span = worker_spans
        .iter()
        .find(|s| s.parent_span_id == enqueuing_span)
        .unwrap();
    assert_eq!(job_span.name, "process analysis", "{worker_spans:?}");
    // The attempt runs in that span, not in a root span of a trace of its own.
    let roots: Vec<ReceivedSpan> = receiver
        .spans()
        .into_iter()
        .filter(|s| {
            s.service_name.as_deref() == Some("fairlane-analyzer-worker")
                && s.parent_span_id.is_empty()
                && s.name == "job"
        })
        .collect();
    assert!(
        roots.is_empty(),
        "attempts in traces of their own: {roots:?}"
    );
    assert!(receiver.rejected().is_empty(), "{:?}", receiver.rejected());
    for mut service in services {
        assert!(
            service
                .child
                .terminate(Duration::from_secs(60))
                .await
                .success(),
            "{} did not exit cleanly",
            service.name
        );
    }
}
