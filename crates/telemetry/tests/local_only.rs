//! `init` without an OTLP endpoint: nothing is pushed, yet spans have trace context that
//! propagates into jobs, the global meter feeds `render_prometheus`, and a second `init` is
//! refused. One global `init` per process: this file.

use opentelemetry::KeyValue;
use telemetry::{LogFormat, TelemetryConfig, TelemetryError};

#[test]
fn local_only_telemetry_propagates_and_renders() {
    let config = TelemetryConfig {
        log_format: LogFormat::Pretty,
        ..TelemetryConfig::for_service("fairlane-local", "0.0.1")
    };
    let guard = telemetry::init(&config).unwrap();
    assert!(!guard.is_exporting());

    // Propagation works although no exporter is configured.
    let request = tracing::info_span!("request");
    let carrier = request
        .in_scope(telemetry::current_trace_context)
        .expect("spans have valid context without an exporter");
    let job = tracing::info_span!("job");
    telemetry::set_parent_from(&job, &carrier).unwrap();
    let job_carrier = telemetry::trace_context_of(&job).unwrap();
    let trace_id = |c: &std::collections::BTreeMap<String, String>| {
        c["traceparent"].split('-').nth(1).unwrap().to_owned()
    };
    assert_eq!(trace_id(&job_carrier), trace_id(&carrier));
    assert_ne!(job_carrier["traceparent"], carrier["traceparent"]);
    // Filtered-out spans carry nothing: the default filter is `info`.
    let debug_span = tracing::debug_span!("too_detailed");
    assert_eq!(debug_span.in_scope(telemetry::current_trace_context), None);

    let meter = opentelemetry::global::meter("fairlane");
    let snoozes = meter
        .u64_counter("fairlane.fairness.snoozes")
        .with_description("Jobs snoozed because the user was at their limit")
        .build();
    snoozes.add(2, &[KeyValue::new("tier", "free")]);
    let request_duration = meter
        .f64_histogram("http.server.request.duration")
        .with_unit("s")
        .build();
    request_duration.record(
        0.003,
        &[
            KeyValue::new("http.route", "/v1/analyses"),
            KeyValue::new("http.request.method", "POST"),
            KeyValue::new("http.response.status_code", 202),
        ],
    );
    let reservations = meter
        .i64_up_down_counter("fairlane.quota.reservations.active")
        .build();
    reservations.add(1, &[KeyValue::new("event_type", "analysis")]);

    let text = telemetry::render_prometheus();
    for line in [
        "# HELP fairlane_fairness_snoozes_total Jobs snoozed because the user was at their limit\n",
        "# TYPE fairlane_fairness_snoozes_total counter\n",
        "fairlane_fairness_snoozes_total{tier=\"free\"} 2\n",
        "# TYPE http_server_request_duration_seconds histogram\n",
        "http_server_request_duration_seconds_bucket{http_request_method=\"POST\",http_response_status_code=\"202\",http_route=\"/v1/analyses\",le=\"0.001\"} 0\n",
        "http_server_request_duration_seconds_bucket{http_request_method=\"POST\",http_response_status_code=\"202\",http_route=\"/v1/analyses\",le=\"0.005\"} 1\n",
        "http_server_request_duration_seconds_bucket{http_request_method=\"POST\",http_response_status_code=\"202\",http_route=\"/v1/analyses\",le=\"60\"} 1\n",
        "http_server_request_duration_seconds_count{http_request_method=\"POST\",http_response_status_code=\"202\",http_route=\"/v1/analyses\"} 1\n",
        "# TYPE fairlane_quota_reservations_active gauge\n",
        "fairlane_quota_reservations_active{event_type=\"analysis\"} 1\n",
        "# TYPE target_info gauge\n",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    let target_info = text
        .lines()
        .find(|l| l.starts_with("target_info{"))
        .unwrap();
    for label in [
        "service_name=\"fairlane-local\"",
        "service_version=\"0.0.1\"",
        &format!("service_instance_id=\"{}\"", guard.service_instance_id()),
    ] {
        assert!(target_info.contains(label), "{target_info}");
    }

    // The subscriber and providers are process-global: a second init is refused.
    assert!(matches!(
        telemetry::init(&config),
        Err(TelemetryError::AlreadyInitialized(_))
    ));

    guard.shutdown().unwrap();
    assert_eq!(telemetry::render_prometheus(), "");
}
