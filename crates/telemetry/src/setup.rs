//! Process-wide telemetry setup: the global `tracing` subscriber (filter, log format,
//! OpenTelemetry layer), the global tracer and meter providers, the W3C propagator, and the
//! guard that flushes and stops it all.

use std::fmt::Write as _;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider, Temporality};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer as _;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt as _;

use crate::config::{LogFormat, OtlpProtocol, TelemetryConfig};
use crate::otlp_transport::TransportRuntime;
use crate::prometheus::{PrometheusReader, seconds_histogram_view, set_global_reader};

/// The instrumentation scope name of Fairlane's tracer (and, by convention, its meter).
pub const INSTRUMENTATION_NAME: &str = "fairlane";

/// Why telemetry could not be set up or shut down.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// A setting [`TelemetryConfig::validate`] refuses.
    #[error("invalid telemetry configuration: {0}")]
    Config(String),
    /// `rust_log` is not a valid filter.
    #[error("invalid log filter {filter:?}: {source}")]
    LogFilter {
        filter: String,
        #[source]
        source: tracing_subscriber::filter::ParseError,
    },
    /// The OTLP endpoint is not a plain `http://host[:port][/path]` URL.
    #[error("unsupported OTLP endpoint {0:?}: expected an http:// URL (TLS is not built in)")]
    UnsupportedEndpoint(String),
    /// The OTLP exporter could not be built.
    #[error("building the OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    /// The exporters' HTTP runtime could not start.
    #[error("starting the OTLP transport: {0}")]
    Transport(#[source] std::io::Error),
    /// A global `tracing` subscriber (or `log` logger) is already installed in this process.
    #[error("telemetry is already initialised in this process: {0}")]
    AlreadyInitialized(String),
    /// Flushing or stopping the providers failed (e.g. the collector was unreachable).
    #[error("telemetry shutdown: {0}")]
    Shutdown(String),
}

/// Keeps telemetry running. Dropping it (or calling [`TelemetryGuard::shutdown`]) exports what is
/// buffered and stops the exporters; that blocks for at most
/// [`TelemetryConfig::shutdown_bound`] (`otlp_export_timeout` + 1 s for traces, then as long or
/// the metrics SDK's fixed 5 s, the longer, for metrics), even when the collector is gone.
/// Hold it in `main` for the life of the process.
#[must_use = "dropping the guard shuts telemetry down"]
pub struct TelemetryGuard {
    tracer_provider: SdkTracerProvider,
    meter_provider: SdkMeterProvider,
    transport: Option<TransportRuntime>,
    shutdown_timeout: Duration,
    service_instance_id: String,
    shut_down: bool,
}

impl std::fmt::Debug for TelemetryGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TelemetryGuard")
            .field("service_instance_id", &self.service_instance_id)
            .field("exporting", &self.transport.is_some())
            .field("shut_down", &self.shut_down)
            .finish()
    }
}

impl TelemetryGuard {
    /// The `service.instance.id` resource attribute of this process (a random UUID).
    pub fn service_instance_id(&self) -> &str {
        &self.service_instance_id
    }

    /// Whether spans and metrics are pushed over OTLP.
    pub fn is_exporting(&self) -> bool {
        self.transport.is_some()
    }

    /// Flushes and stops the exporters, reporting failures. Blocking (bounded, see the type
    /// docs); from async code prefer `tokio::task::spawn_blocking(move || guard.shutdown())`.
    pub fn shutdown(mut self) -> Result<(), TelemetryError> {
        self.shutdown_once()
    }

    fn shutdown_once(&mut self) -> Result<(), TelemetryError> {
        if self.shut_down {
            return Ok(());
        }
        self.shut_down = true;
        let traces = self
            .tracer_provider
            .shutdown_with_timeout(self.shutdown_timeout);
        let metrics = self
            .meter_provider
            .shutdown_with_timeout(self.shutdown_timeout);
        // Abandon whatever request is still in flight: nothing may outlive the guard.
        if let Some(transport) = self.transport.as_mut() {
            transport.stop();
        }
        let failures: Vec<String> = [("traces", traces), ("metrics", metrics)]
            .into_iter()
            .filter_map(|(what, result)| result.err().map(|e| format!("{what}: {e}")))
            .collect();
        if failures.is_empty() {
            Ok(())
        } else {
            Err(TelemetryError::Shutdown(failures.join("; ")))
        }
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        // Errors were already reported by the SDK's internal logs; there is no caller to tell.
        let _ = self.shutdown_once();
    }
}

/// The `tracing` filter for `directives`. The OpenTelemetry SDK's own diagnostics (provider set,
/// export failed, ...) are capped at `warn` unless the directives name an `opentelemetry` target:
/// they get the directives' default level (the last bare level; none means off) or `warn`,
/// whichever is quieter.
fn log_filter(directives: &str) -> Result<EnvFilter, TelemetryError> {
    let mut effective = directives.trim().to_owned();
    if !effective.contains("opentelemetry") {
        let default_level = effective
            .split(',')
            .filter_map(|directive| directive.trim().parse::<LevelFilter>().ok())
            .next_back()
            .unwrap_or(LevelFilter::OFF);
        if !effective.is_empty() {
            effective.push(',');
        }
        let _ = write!(
            effective,
            "opentelemetry={}",
            default_level.min(LevelFilter::WARN)
        );
    }
    EnvFilter::try_new(&effective).map_err(|source| TelemetryError::LogFilter {
        filter: directives.to_owned(),
        source,
    })
}

/// Checks that the endpoint is an `http://` URL with a host, returning it without trailing `/`.
fn validate_endpoint(endpoint: &str) -> Result<String, TelemetryError> {
    let uri: http::Uri = endpoint
        .parse()
        .map_err(|_| TelemetryError::UnsupportedEndpoint(endpoint.to_owned()))?;
    let plain_http = uri.scheme_str() == Some("http") && uri.authority().is_some();
    if !plain_http || uri.query().is_some() {
        return Err(TelemetryError::UnsupportedEndpoint(endpoint.to_owned()));
    }
    Ok(endpoint.trim_end_matches('/').to_owned())
}

/// Sets up logging, tracing and metrics for this process. Call it once, first thing in `main`
/// (inside or outside a Tokio runtime), and keep the returned guard until exit:
///
/// - installs the global `tracing` subscriber: `rust_log` filter, JSON or pretty lines on
///   stdout, and the tracing-opentelemetry layer (always, so trace context exists and
///   propagates even when nothing is exported); `log` records are forwarded to `tracing`;
/// - installs the global tracer provider (batch OTLP export when an endpoint is configured),
///   the global meter provider (a Prometheus pull reader for [`crate::render_prometheus`], plus
///   periodic OTLP export when an endpoint is configured) with [`seconds_histogram_view`], and
///   the W3C Trace Context propagator;
/// - resource: `service.name`, `service.version`, a fresh `service.instance.id`, plus whatever
///   `OTEL_RESOURCE_ATTRIBUTES` adds. `OTEL_EXPORTER_OTLP_HEADERS` adds request headers.
///
/// Instruments must be created after `init` (a `Meter` taken from `opentelemetry::global`
/// before it stays a no-op).
pub fn init(config: &TelemetryConfig) -> Result<TelemetryGuard, TelemetryError> {
    config.validate().map_err(TelemetryError::Config)?;
    let filter = log_filter(&config.rust_log)?;
    let endpoint = config.otlp_endpoint().map(validate_endpoint).transpose()?;

    let service_instance_id = uuid::Uuid::new_v4().to_string();
    let resource = Resource::builder()
        .with_service_name(config.otel_service_name.clone())
        .with_attributes([
            KeyValue::new("service.version", config.service_version.clone()),
            KeyValue::new("service.instance.id", service_instance_id.clone()),
        ])
        .build();

    let prometheus = PrometheusReader::new();
    // Every span is recorded. A caller's `traceparent` still names the trace (for correlation),
    // but its "not sampled" flag does not turn recording off: a client could otherwise hide its
    // requests, and the jobs they enqueue, from tracing.
    let sampler = opentelemetry_sdk::trace::Sampler::parent_based(
        opentelemetry_sdk::trace::Sampler::AlwaysOn,
    )
    .with_remote_parent_not_sampled(opentelemetry_sdk::trace::Sampler::AlwaysOn);
    let mut tracer_builder = SdkTracerProvider::builder()
        .with_resource(resource.clone())
        .with_sampler(sampler);
    let mut meter_builder = SdkMeterProvider::builder()
        .with_resource(resource)
        .with_reader(prometheus.clone())
        .with_view(seconds_histogram_view);

    let transport = match &endpoint {
        None => None,
        Some(endpoint) => {
            let transport = TransportRuntime::start().map_err(TelemetryError::Transport)?;
            let timeout = config.otlp_export_timeout;
            let client = || {
                transport.client(timeout).ok_or_else(|| {
                    TelemetryError::Transport(std::io::Error::other("transport runtime stopped"))
                })
            };
            let protocol = match config.otel_exporter_otlp_protocol {
                OtlpProtocol::HttpProtobuf => Protocol::HttpBinary,
            };
            let span_exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_http_client(client()?)
                .with_protocol(protocol)
                .with_endpoint(format!("{endpoint}/v1/traces"))
                .with_timeout(timeout)
                .build()?;
            let metric_exporter = opentelemetry_otlp::MetricExporter::builder()
                .with_http()
                .with_http_client(client()?)
                .with_protocol(protocol)
                .with_endpoint(format!("{endpoint}/v1/metrics"))
                .with_timeout(timeout)
                .with_temporality(Temporality::Cumulative)
                .build()?;
            tracer_builder = tracer_builder.with_batch_exporter(span_exporter);
            meter_builder = meter_builder.with_reader(
                PeriodicReader::builder(metric_exporter)
                    .with_interval(config.metrics_export_interval)
                    .build(),
            );
            Some(transport)
        }
    };
    let tracer_provider = tracer_builder.build();
    let meter_provider = meter_builder.build();
    let guard = TelemetryGuard {
        tracer_provider,
        meter_provider,
        transport,
        shutdown_timeout: config.flush_timeout(),
        service_instance_id,
        shut_down: false,
    };

    let fmt_layer = match config.log_format {
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .boxed(),
        LogFormat::Pretty => tracing_subscriber::fmt::layer().pretty().boxed(),
    };
    let otel_layer = tracing_opentelemetry::layer()
        .with_tracer(guard.tracer_provider.tracer(INSTRUMENTATION_NAME));
    // The subscriber first: if another one came first, the guard drops here and shuts its
    // providers down, and nothing global was touched.
    let subscriber = tracing_subscriber::registry()
        .with(filter)
        .with(fmt_layer)
        .with(otel_layer);
    tracing::subscriber::set_global_default(subscriber)
        .map_err(|e| TelemetryError::AlreadyInitialized(e.to_string()))?;
    // Then the `log` bridge, with the subscriber's level. It fails when the process already has
    // a `log` logger: the subscriber is in place by then, so telemetry runs on without `log`
    // records rather than fail with a subscriber left behind whose providers were shut down.
    let log_bridge_refused = tracing_log::LogTracer::builder()
        .with_max_level(tracing_log::AsLog::as_log(&LevelFilter::current()))
        .init()
        .err();

    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    opentelemetry::global::set_tracer_provider(guard.tracer_provider.clone());
    opentelemetry::global::set_meter_provider(guard.meter_provider.clone());
    set_global_reader(prometheus);
    if let Some(e) = log_bridge_refused {
        tracing::warn!(error = %e, "`log` records are not logged: the process has a `log` logger of its own");
    }
    Ok(guard)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_http_endpoints_are_accepted() {
        assert_eq!(
            validate_endpoint("http://otel-collector:4318/").unwrap(),
            "http://otel-collector:4318"
        );
        assert_eq!(
            validate_endpoint("http://127.0.0.1:4318/otlp").unwrap(),
            "http://127.0.0.1:4318/otlp"
        );
        for bad in [
            "https://collector:4318",
            "collector:4318",
            "http://",
            "not a url",
            "http://c:4318/?x=1",
        ] {
            assert!(
                matches!(
                    validate_endpoint(bad),
                    Err(TelemetryError::UnsupportedEndpoint(_))
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn sdk_diagnostics_are_capped_at_warn_unless_asked_for() {
        assert_eq!(
            log_filter("info").unwrap().to_string(),
            "opentelemetry=warn,info"
        );
        // Never louder than the directives ask for everything else.
        for (directives, hint) in [
            ("off", LevelFilter::OFF),
            ("error", LevelFilter::ERROR),
            ("warn,fairlane=off", LevelFilter::WARN),
        ] {
            assert_eq!(
                log_filter(directives).unwrap().max_level_hint(),
                Some(hint),
                "{directives}"
            );
        }
        assert_eq!(
            log_filter("web=info").unwrap().to_string(),
            "opentelemetry=off,web=info"
        );
        assert_eq!(
            log_filter("debug,opentelemetry_sdk=debug")
                .unwrap()
                .to_string(),
            "opentelemetry_sdk=debug,debug"
        );
        assert!(matches!(
            log_filter("info,fairlane=loud"),
            Err(TelemetryError::LogFilter { filter, .. }) if filter == "info,fairlane=loud"
        ));
    }

    #[test]
    fn bad_filters_and_endpoints_fail_before_touching_global_state() {
        let config = TelemetryConfig {
            rust_log: "info,fairlane=loud".to_owned(),
            ..TelemetryConfig::default()
        };
        assert!(matches!(
            init(&config),
            Err(TelemetryError::LogFilter { .. })
        ));
        let config = TelemetryConfig {
            otel_exporter_otlp_endpoint: Some("https://collector:4318".to_owned()),
            ..TelemetryConfig::default()
        };
        assert!(matches!(
            init(&config),
            Err(TelemetryError::UnsupportedEndpoint(_))
        ));
        // Nothing was installed: the process still has no global subscriber.
        let global_is_unset =
            tracing::dispatcher::get_default(|d| d.is::<tracing::subscriber::NoSubscriber>());
        assert!(global_is_unset);
    }
}
