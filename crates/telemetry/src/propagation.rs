//! Trace propagation into jobs: the W3C Trace Context of a `tracing` span as a string map that
//! travels in job metadata (under [`JOB_METADATA_TRACE_KEY`]), and back into a worker's span.
//!
//! The carrier format is fixed (W3C `traceparent` and, when present, `tracestate`), independent
//! of the process's global propagator, so a job enqueued by one service can be continued by any
//! other. It works whether or not the process exports spans, as long as the tracing-opentelemetry
//! layer is installed ([`crate::init`] always installs it).

use std::collections::BTreeMap;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::{OpenTelemetrySpanExt, SetParentError};

/// The job-metadata key under which the carrier is stored:
/// `{"trace": {"traceparent": "00-…-…-01", "tracestate": "…"}}`.
pub const JOB_METADATA_TRACE_KEY: &str = "trace";

/// A trace context that could not be attached to a span.
#[derive(Debug, thiserror::Error)]
pub enum TraceContextError {
    /// The carrier holds no valid `traceparent` (absent, malformed, or all-zero ids).
    #[error("the carrier holds no valid W3C traceparent")]
    NoValidContext,
    /// The span is disabled (filtered out) or no OpenTelemetry layer is installed.
    #[error("the span cannot carry an OpenTelemetry parent: {0}")]
    Span(#[source] SetParentError),
}

struct CarrierInjector<'a>(&'a mut BTreeMap<String, String>);

impl Injector for CarrierInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key.to_owned(), value);
    }
}

struct CarrierExtractor<'a>(&'a BTreeMap<String, String>);

impl Extractor for CarrierExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        // W3C header names are case-insensitive; the carrier normally uses lower case.
        self.0.get(key).map(String::as_str).or_else(|| {
            self.0
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(key))
                .map(|(_, v)| v.as_str())
        })
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

/// The W3C trace context of the current `tracing` span, to store in a job's metadata under
/// [`JOB_METADATA_TRACE_KEY`]. `None` when there is no current span with a valid OpenTelemetry
/// context (no span entered, the span was filtered out, or telemetry is not initialised).
pub fn current_trace_context() -> Option<BTreeMap<String, String>> {
    trace_context_of(&tracing::Span::current())
}

/// [`current_trace_context`] for a given span.
pub fn trace_context_of(span: &tracing::Span) -> Option<BTreeMap<String, String>> {
    let context = span.context();
    if !context.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = BTreeMap::new();
    TraceContextPropagator::new().inject_context(&context, &mut CarrierInjector(&mut carrier));
    // An empty `tracestate` says nothing; keep the stored metadata minimal.
    carrier.retain(|_, value| !value.is_empty());
    carrier.contains_key("traceparent").then_some(carrier)
}

/// Makes the span a child of the (remote) span described by `carrier`, so a worker's job span
/// continues the trace of the request that enqueued the job. Call it right after creating the
/// span and before entering it: once a span has started, its parent is fixed.
///
/// ```no_run
/// # let carrier = std::collections::BTreeMap::new();
/// let span = tracing::info_span!("job", queue = "analysis_default");
/// if let Err(error) = telemetry::set_parent_from(&span, &carrier) {
///     tracing::debug!(%error, "job carries no usable trace context");
/// }
/// let _entered = span.enter();
/// ```
pub fn set_parent_from(
    span: &tracing::Span,
    carrier: &BTreeMap<String, String>,
) -> Result<(), TraceContextError> {
    let parent = TraceContextPropagator::new().extract(&CarrierExtractor(carrier));
    if !parent.span().span_context().is_valid() {
        return Err(TraceContextError::NoValidContext);
    }
    span.set_parent(parent).map_err(TraceContextError::Span)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
    use opentelemetry_sdk::error::OTelSdkResult;
    use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
    use tracing_subscriber::layer::SubscriberExt;

    /// Keeps exported spans in memory (the SDK's own in-memory exporter needs its `testing`
    /// feature).
    #[derive(Debug, Clone, Default)]
    struct CollectingExporter(Arc<Mutex<Vec<SpanData>>>);

    impl SpanExporter for CollectingExporter {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            self.0.lock().unwrap().extend(batch);
            Ok(())
        }
    }

    /// A subscriber (thread-local, not global) with the OpenTelemetry layer and an exporter.
    fn subscriber() -> (
        impl tracing::Subscriber + Send + Sync,
        SdkTracerProvider,
        CollectingExporter,
    ) {
        let exporter = CollectingExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("test"));
        (
            tracing_subscriber::registry().with(layer),
            provider,
            exporter,
        )
    }

    #[test]
    fn a_job_span_continues_the_request_trace_as_a_child() {
        let (subscriber, provider, exporter) = subscriber();
        let (carrier, request_trace, request_span) =
            tracing::subscriber::with_default(subscriber, || {
                let request = tracing::info_span!("request");
                let _entered = request.enter();
                let carrier = current_trace_context().expect("inside a span");
                let sc = request.context().span().span_context().clone();
                let job = tracing::info_span!("job");
                set_parent_from(&job, &carrier).unwrap();
                job.in_scope(|| {
                    let job_sc = tracing::Span::current()
                        .context()
                        .span()
                        .span_context()
                        .clone();
                    assert_eq!(job_sc.trace_id(), sc.trace_id());
                    assert_ne!(job_sc.span_id(), sc.span_id());
                });
                (carrier, sc.trace_id(), sc.span_id())
            });
        let keys: Vec<&str> = carrier.keys().map(String::as_str).collect();
        assert_eq!(keys, ["traceparent"], "empty tracestate is not written");
        assert_eq!(
            carrier["traceparent"],
            format!("00-{request_trace}-{request_span}-01")
        );

        provider.force_flush().unwrap();
        let spans = exporter.0.lock().unwrap().clone();
        let job = spans.iter().find(|s| s.name == "job").expect("job span");
        let request = spans
            .iter()
            .find(|s| s.name == "request")
            .expect("request span");
        assert_eq!(job.span_context.trace_id(), request_trace);
        assert_eq!(request.span_context.trace_id(), request_trace);
        assert_eq!(job.parent_span_id, request_span);
        assert!(
            job.parent_span_is_remote,
            "the parent came through the carrier"
        );
        assert_eq!(request.parent_span_id, SpanId::INVALID);
    }

    #[test]
    fn tracestate_round_trips() {
        let (subscriber, _provider, _exporter) = subscriber();
        let mut carrier = BTreeMap::new();
        carrier.insert(
            "traceparent".to_owned(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
        );
        carrier.insert("tracestate".to_owned(), "fairlane=abc,other=1".to_owned());
        let inner = tracing::subscriber::with_default(subscriber, || {
            let job = tracing::info_span!("job");
            set_parent_from(&job, &carrier).unwrap();
            job.in_scope(current_trace_context).unwrap()
        });
        let trace_id = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
        assert!(inner["traceparent"].starts_with(&format!("00-{trace_id}-")));
        assert!(
            !inner["traceparent"].contains("00f067aa0ba902b7"),
            "new span id"
        );
        assert_eq!(inner["tracestate"], "fairlane=abc,other=1");
    }

    #[test]
    fn missing_or_broken_carriers_are_reported() {
        let (subscriber, _provider, _exporter) = subscriber();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("job");
            let empty = BTreeMap::new();
            assert!(matches!(
                set_parent_from(&span, &empty),
                Err(TraceContextError::NoValidContext)
            ));
            let mut zero = BTreeMap::new();
            zero.insert(
                "traceparent".to_owned(),
                "00-00000000000000000000000000000000-0000000000000000-01".to_owned(),
            );
            assert!(matches!(
                set_parent_from(&span, &zero),
                Err(TraceContextError::NoValidContext)
            ));
            // Upper-case keys are accepted.
            let mut upper = BTreeMap::new();
            upper.insert(
                "TraceParent".to_owned(),
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
            );
            set_parent_from(&span, &upper).unwrap();
            // Once started, the parent is fixed.
            span.in_scope(|| {});
            assert!(matches!(
                set_parent_from(&span, &upper),
                Err(TraceContextError::Span(_))
            ));
        });
    }

    #[test]
    fn without_a_span_or_layer_there_is_no_context() {
        assert_eq!(current_trace_context(), None, "no subscriber at all");
        let (subscriber, _provider, _exporter) = subscriber();
        tracing::subscriber::with_default(subscriber, || {
            assert_eq!(current_trace_context(), None, "no span entered");
        });
        // A subscriber without the OpenTelemetry layer cannot carry a parent.
        tracing::subscriber::with_default(tracing_subscriber::registry(), || {
            let span = tracing::info_span!("job");
            let mut carrier = BTreeMap::new();
            carrier.insert(
                "traceparent".to_owned(),
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
            );
            assert!(matches!(
                set_parent_from(&span, &carrier),
                Err(TraceContextError::Span(_))
            ));
            assert_eq!(span.in_scope(current_trace_context), None);
        });
    }
}
