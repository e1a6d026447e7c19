//! End to end over real OTLP/HTTP: a "request" span enqueues a job carrying its trace context in
//! JSON metadata, a "job" span continues it, and the in-test receiver gets both spans (one trace,
//! parent and child, right service) and the metrics. One global `init` per process: this file.

use std::collections::BTreeMap;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::trace::TraceContextExt as _;
use telemetry::testing::OtlpReceiver;
use telemetry::{JOB_METADATA_TRACE_KEY, LogFormat, TelemetryConfig};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_and_job_spans_arrive_as_one_trace_with_metrics() {
    let receiver = OtlpReceiver::start().await.unwrap();
    let config = TelemetryConfig {
        otel_exporter_otlp_endpoint: Some(receiver.endpoint()),
        log_format: LogFormat::Json,
        // Long enough that only the final export on shutdown sends metrics.
        metrics_export_interval: Duration::from_secs(600),
        ..TelemetryConfig::for_service("fairlane-e2e", "9.9.9")
    };
    let guard = telemetry::init(&config).unwrap();
    assert!(guard.is_exporting());
    let instance_id = guard.service_instance_id().to_owned();

    // Libraries record through the API's global meter; init installed the SDK behind it.
    let meter = opentelemetry::global::meter("fairlane");
    let jobs = meter
        .u64_counter("fairlane.jobs")
        .with_unit("{job}")
        .build();
    let duration = meter
        .f64_histogram("fairlane.job.duration")
        .with_unit("s")
        .build();

    // The web process: a request span, whose context goes into the job's metadata.
    let (metadata, request_trace_id, request_span_id) = {
        let request = tracing::info_span!("request", route = "/v1/analyses");
        let _entered = request.enter();
        tracing::info!("enqueueing");
        let carrier = telemetry::current_trace_context().expect("request span has a context");
        let sc = request.context().span().span_context().clone();
        let metadata = serde_json::json!({ JOB_METADATA_TRACE_KEY: carrier });
        (
            serde_json::to_string(&metadata).unwrap(),
            sc.trace_id().to_string(),
            sc.span_id().to_string(),
        )
    };

    // The worker process: reads the job row's metadata back and continues the trace.
    let metadata: serde_json::Value = serde_json::from_str(&metadata).unwrap();
    let carrier: BTreeMap<String, String> =
        serde_json::from_value(metadata[JOB_METADATA_TRACE_KEY].clone()).unwrap();
    let job = tracing::info_span!("job", queue = "analysis_default");
    telemetry::set_parent_from(&job, &carrier).unwrap();
    job.in_scope(|| {
        tracing::info!("working");
        let attrs = [
            KeyValue::new("queue", "analysis_default"),
            KeyValue::new("kind", "analyze"),
            KeyValue::new("outcome", "completed"),
        ];
        jobs.add(1, &attrs);
        duration.record(0.2, &attrs[..2]);
    });
    drop(job);

    // The same metrics are on /metrics.
    let text = telemetry::render_prometheus();
    assert!(
        text.contains(
            "fairlane_jobs_total{kind=\"analyze\",outcome=\"completed\",queue=\"analysis_default\"} 1\n"
        ),
        "{text}"
    );
    assert!(
        text.contains("fairlane_job_duration_seconds_bucket{kind=\"analyze\",queue=\"analysis_default\",le=\"0.25\"} 1\n"),
        "{text}"
    );
    assert!(
        text.contains(&format!("service_instance_id=\"{instance_id}\"")),
        "{text}"
    );

    // Shutdown flushes both exporters; it blocks, so keep it off the runtime's workers.
    tokio::task::spawn_blocking(move || guard.shutdown())
        .await
        .unwrap()
        .unwrap();
    assert!(receiver.rejected().is_empty(), "{:?}", receiver.rejected());

    let spans = receiver.spans();
    let request = spans
        .iter()
        .find(|s| s.name == "request")
        .expect("request span");
    let job = spans.iter().find(|s| s.name == "job").expect("job span");
    assert_eq!(request.trace_id, request_trace_id);
    assert_eq!(job.trace_id, request_trace_id, "one trace id");
    assert_eq!(request.span_id, request_span_id);
    assert_eq!(
        job.parent_span_id, request.span_id,
        "job is the request's child"
    );
    assert_eq!(request.parent_span_id, "", "request is a root span");
    for span in [request, job] {
        assert_eq!(span.service_name.as_deref(), Some("fairlane-e2e"));
    }

    let names = receiver.metric_names();
    assert!(names.contains("fairlane.jobs"), "{names:?}");
    assert!(names.contains("fairlane.job.duration"), "{names:?}");
    assert_eq!(
        receiver
            .metric_service_names()
            .into_iter()
            .collect::<Vec<_>>(),
        ["fairlane-e2e"]
    );
    assert_eq!(telemetry::render_prometheus(), "", "shut down");
}
