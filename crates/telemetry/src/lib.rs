//! Fairlane's observability: one call ([`init`]) gives a binary structured logs, OpenTelemetry
//! traces and metrics (pushed over OTLP/HTTP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set), and a
//! Prometheus text rendering ([`render_prometheus`]) for the binary's own `/metrics` route.
//! [`current_trace_context`] and [`set_parent_from`] carry a request's trace into the jobs it
//! enqueues. [`shutdown_on_signals`] is the SIGTERM/SIGINT listener every service binary starts
//! beside [`init`], on the runtime of [`runtime::block_on`].
//!
//! Library crates do not depend on this one for metrics: they record through the OpenTelemetry
//! API (`opentelemetry::global::meter("fairlane")`) and `tracing`, and pick up whatever
//! [`init`] installed.

pub mod config;
mod otlp_transport;
pub mod prometheus;
pub mod propagation;
pub mod runtime;
mod setup;
pub mod signals;
#[cfg(feature = "test-receiver")]
pub mod testing;

pub use config::{LogFormat, METRICS_SHUTDOWN_WAIT, OtlpProtocol, TelemetryConfig};
pub use prometheus::{
    PROMETHEUS_CONTENT_TYPE, PrometheusReader, SECONDS_BUCKETS, render_prometheus,
    seconds_histogram_view,
};
pub use propagation::{
    JOB_METADATA_TRACE_KEY, TraceContextError, current_trace_context, set_parent_from,
    trace_context_of,
};
pub use setup::{INSTRUMENTATION_NAME, TelemetryError, TelemetryGuard, init};
pub use signals::shutdown_on_signals;
