//! A process that already has a `log` logger when `init` runs: telemetry starts all the same
//! (spans, metrics), without forwarding `log` records, instead of failing with a tracing
//! subscriber left installed whose providers were shut down. One global `init` per process:
//! this file.

use telemetry::TelemetryConfig;

/// A `log` logger that takes nothing.
struct Silent;

impl log::Log for Silent {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        false
    }
    fn log(&self, _: &log::Record<'_>) {}
    fn flush(&self) {}
}

#[test]
fn init_after_another_log_logger_runs_without_the_log_bridge() {
    log::set_boxed_logger(Box::new(Silent)).unwrap();
    let guard = telemetry::init(&TelemetryConfig::for_service("fairlane-log-first", "0.0.1"))
        .expect("telemetry starts beside another log logger");
    let request = tracing::info_span!("request");
    assert!(
        request.in_scope(telemetry::current_trace_context).is_some(),
        "spans are traced"
    );
    opentelemetry::global::meter("fairlane")
        .u64_counter("fairlane.jobs")
        .build()
        .add(1, &[]);
    assert!(telemetry::render_prometheus().contains("fairlane_jobs_total"));
    // A second init is refused, as ever.
    assert!(telemetry::init(&TelemetryConfig::default()).is_err());
    drop(guard);
}
