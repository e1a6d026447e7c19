//! The telemetry settings a binary embeds in its layered configuration.
//!
//! Field names follow the house rule (lower-case form of the environment variable that sets
//! them), so the standard variables `RUST_LOG`, `OTEL_SERVICE_NAME`,
//! `OTEL_EXPORTER_OTLP_ENDPOINT` and `OTEL_EXPORTER_OTLP_PROTOCOL` work unchanged when a binary
//! puts this struct into its own config with `#[serde(flatten)]`.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The longest `OTLP_EXPORT_TIMEOUT` accepted.
pub const MAX_OTLP_EXPORT_TIMEOUT: Duration = Duration::from_secs(60);

/// How log lines are written to standard output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One JSON object per line (production).
    #[default]
    Json,
    /// Multi-line, human-oriented output (development).
    Pretty,
}

/// The OTLP transport. Only OTLP over HTTP with protobuf bodies is built in; `grpc` and
/// `http/json` are refused when the configuration is read, so a wrong setting fails at startup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum OtlpProtocol {
    /// `http/protobuf`: `POST {endpoint}/v1/traces` and `/v1/metrics`, protobuf bodies.
    #[default]
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
}

/// Everything [`crate::init`] needs. Plain data: binaries set the defaults that suit them
/// (service name and version) and let file and environment override the rest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TelemetryConfig {
    /// `service.name` resource attribute (env `OTEL_SERVICE_NAME`), e.g. `fairlane-web`.
    pub otel_service_name: String,
    /// `service.version` resource attribute (env `SERVICE_VERSION`); binaries default it to
    /// their `CARGO_PKG_VERSION`.
    pub service_version: String,
    /// Log line format (env `LOG_FORMAT`: `json` or `pretty`).
    pub log_format: LogFormat,
    /// `tracing` filter directives in `RUST_LOG` syntax (env `RUST_LOG`). It filters spans too:
    /// a span filtered out here is neither logged nor exported nor propagated.
    pub rust_log: String,
    /// Base URL of the OTLP/HTTP collector, e.g. `http://otel-collector:4318` (env
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`). Unset or empty: traces and metrics are not pushed
    /// (Prometheus `/metrics` and trace propagation still work). Only `http://` is supported.
    pub otel_exporter_otlp_endpoint: Option<String>,
    /// OTLP transport (env `OTEL_EXPORTER_OTLP_PROTOCOL`); only `http/protobuf`.
    pub otel_exporter_otlp_protocol: OtlpProtocol,
    /// Deadline of one OTLP export request including retries (env `OTLP_EXPORT_TIMEOUT`,
    /// humantime, e.g. `5s`). It also bounds how long shutdown waits for the collector.
    #[serde(with = "humantime_serde")]
    pub otlp_export_timeout: Duration,
    /// How often metrics are pushed over OTLP (env `METRICS_EXPORT_INTERVAL`, humantime).
    #[serde(with = "humantime_serde")]
    pub metrics_export_interval: Duration,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otel_service_name: "fairlane".to_owned(),
            service_version: env!("CARGO_PKG_VERSION").to_owned(),
            log_format: LogFormat::Json,
            rust_log: "info".to_owned(),
            otel_exporter_otlp_endpoint: None,
            otel_exporter_otlp_protocol: OtlpProtocol::HttpProtobuf,
            otlp_export_timeout: Duration::from_secs(5),
            metrics_export_interval: Duration::from_secs(30),
        }
    }
}

/// How long the metrics SDK waits for its reader's last export at shutdown, whatever timeout it
/// is given (`opentelemetry_sdk` 0.33: `SdkMeterProvider::shutdown_with_timeout` ignores its
/// argument and the periodic reader waits a fixed 5 s, behind an export already under way).
pub const METRICS_SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

impl TelemetryConfig {
    /// Defaults for the named service at the given version, e.g.
    /// `TelemetryConfig::for_service("fairlane-web", env!("CARGO_PKG_VERSION"))`.
    pub fn for_service(name: impl Into<String>, version: impl Into<String>) -> Self {
        TelemetryConfig {
            otel_service_name: name.into(),
            service_version: version.into(),
            ..TelemetryConfig::default()
        }
    }

    /// How long flushing traces or metrics at shutdown may take: the export timeout, plus a
    /// second for the exporter to give up.
    pub fn flush_timeout(&self) -> Duration {
        self.otlp_export_timeout + Duration::from_secs(1)
    }

    /// The longest the telemetry guard's shutdown can take: traces within
    /// [`TelemetryConfig::flush_timeout`], then metrics within that or
    /// [`METRICS_SHUTDOWN_WAIT`], whichever is longer. A deployment's grace period must cover it.
    pub fn shutdown_bound(&self) -> Duration {
        self.flush_timeout() + self.flush_timeout().max(METRICS_SHUTDOWN_WAIT)
    }

    /// Refuses settings that would break exporting or hang shutdown: an `OTLP_EXPORT_TIMEOUT`
    /// of zero (every export fails) or above [`MAX_OTLP_EXPORT_TIMEOUT`] (shutdown waits that
    /// long for the collector), a `METRICS_EXPORT_INTERVAL` of zero (the SDK would quietly use
    /// its own 60 s).
    pub fn validate(&self) -> Result<(), String> {
        if self.otlp_export_timeout.is_zero() || self.otlp_export_timeout > MAX_OTLP_EXPORT_TIMEOUT
        {
            return Err(format!(
                "OTLP_EXPORT_TIMEOUT must be longer than zero and at most {:?} (it also bounds how long shutdown waits for the collector), got {:?}",
                MAX_OTLP_EXPORT_TIMEOUT, self.otlp_export_timeout
            ));
        }
        if self.metrics_export_interval.is_zero() {
            return Err("METRICS_EXPORT_INTERVAL must be longer than zero".to_owned());
        }
        Ok(())
    }

    /// The configured collector base URL without trailing slashes, if one is set and non-blank.
    pub fn otlp_endpoint(&self) -> Option<&str> {
        self.otel_exporter_otlp_endpoint
            .as_deref()
            .map(|e| e.trim().trim_end_matches('/'))
            .filter(|e| !e.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shutdown_bound_covers_the_metrics_sdks_fixed_wait() {
        let with_timeout = |secs| TelemetryConfig {
            otlp_export_timeout: Duration::from_secs(secs),
            ..TelemetryConfig::default()
        };
        // Spans within timeout + 1 s; metrics within the same or the SDK's 5 s, the longer.
        assert_eq!(with_timeout(1).shutdown_bound(), Duration::from_secs(2 + 5));
        assert_eq!(with_timeout(3).shutdown_bound(), Duration::from_secs(4 + 5));
        assert_eq!(with_timeout(5).shutdown_bound(), Duration::from_secs(6 + 6));
        assert_eq!(
            with_timeout(10).shutdown_bound(),
            Duration::from_secs(11 + 11)
        );
    }

    #[test]
    fn defaults_are_json_info_and_no_exporter() {
        let c = TelemetryConfig::default();
        assert_eq!(c.log_format, LogFormat::Json);
        assert_eq!(c.rust_log, "info");
        assert_eq!(c.otlp_endpoint(), None);
        assert_eq!(c.otel_exporter_otlp_protocol, OtlpProtocol::HttpProtobuf);
    }

    #[test]
    fn serde_round_trip_uses_wire_names() {
        let c = TelemetryConfig {
            otel_exporter_otlp_endpoint: Some("http://collector:4318/".into()),
            log_format: LogFormat::Pretty,
            ..TelemetryConfig::for_service("fairlane-web", "1.2.3")
        };
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(v["otel_exporter_otlp_protocol"], "http/protobuf");
        assert_eq!(v["log_format"], "pretty");
        assert_eq!(v["metrics_export_interval"], "30s");
        assert_eq!(v["otlp_export_timeout"], "5s");
        let back: TelemetryConfig = serde_json::from_value(v).unwrap();
        assert_eq!(back, c);
        assert_eq!(back.otlp_endpoint(), Some("http://collector:4318"));
    }

    #[test]
    fn unsupported_protocols_are_refused_by_name() {
        for bad in ["grpc", "http/json"] {
            let err = serde_json::from_value::<TelemetryConfig>(
                serde_json::json!({ "otel_exporter_otlp_protocol": bad }),
            )
            .unwrap_err()
            .to_string();
            assert!(err.contains("http/protobuf"), "{bad}: {err}");
        }
    }

    #[test]
    fn export_settings_that_break_exporting_are_refused_by_name() {
        TelemetryConfig::default().validate().unwrap();
        let with = |timeout: Duration, interval: Duration| {
            TelemetryConfig {
                otlp_export_timeout: timeout,
                metrics_export_interval: interval,
                ..TelemetryConfig::default()
            }
            .validate()
        };
        let ok = Duration::from_secs(5);
        for timeout in [Duration::ZERO, Duration::from_secs(61), Duration::MAX] {
            let e = with(timeout, ok).unwrap_err();
            assert!(e.starts_with("OTLP_EXPORT_TIMEOUT must be"), "{e}");
        }
        with(MAX_OTLP_EXPORT_TIMEOUT, ok).unwrap();
        let e = with(ok, Duration::ZERO).unwrap_err();
        assert_eq!(e, "METRICS_EXPORT_INTERVAL must be longer than zero");
    }

    #[test]
    fn blank_endpoint_means_no_exporter() {
        let c = TelemetryConfig {
            otel_exporter_otlp_endpoint: Some("  ".into()),
            ..TelemetryConfig::default()
        };
        assert_eq!(c.otlp_endpoint(), None);
    }
}
