//! A binary embeds `TelemetryConfig` in its flat, layered config with `#[serde(flatten)]`; the
//! standard OpenTelemetry and `RUST_LOG` variables then set it through `common::config`.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use telemetry::{LogFormat, TelemetryConfig};

#[derive(Debug, Serialize, Deserialize)]
#[serde(default)]
struct WebConfig {
    listen_addr: String,
    #[serde(flatten)]
    telemetry: TelemetryConfig,
}

impl Default for WebConfig {
    fn default() -> Self {
        WebConfig {
            listen_addr: "0.0.0.0:8080".to_owned(),
            telemetry: TelemetryConfig::for_service("fairlane-web", "1.0.0"),
        }
    }
}

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

#[test]
fn defaults_come_from_the_binary() {
    let c: WebConfig = common::config::load_from(None, env(&[("PATH", "/bin")])).unwrap();
    assert_eq!(c.telemetry.otel_service_name, "fairlane-web");
    assert_eq!(c.telemetry.service_version, "1.0.0");
    assert_eq!(c.telemetry.otlp_endpoint(), None);
    assert_eq!(c.listen_addr, "0.0.0.0:8080");
}

#[test]
fn standard_environment_variables_configure_telemetry() {
    let c: WebConfig = common::config::load_from(
        None,
        env(&[
            ("RUST_LOG", "warn,web=debug"),
            ("LOG_FORMAT", "pretty"),
            ("OTEL_SERVICE_NAME", "web-canary"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel-collector:4318"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("OTLP_EXPORT_TIMEOUT", "2s"),
            ("METRICS_EXPORT_INTERVAL", "15s"),
        ]),
    )
    .unwrap();
    let t = &c.telemetry;
    assert_eq!(t.rust_log, "warn,web=debug");
    assert_eq!(t.log_format, LogFormat::Pretty);
    assert_eq!(t.otel_service_name, "web-canary");
    assert_eq!(t.service_version, "1.0.0");
    assert_eq!(t.otlp_endpoint(), Some("http://otel-collector:4318"));
    assert_eq!(t.otlp_export_timeout, Duration::from_secs(2));
    assert_eq!(t.metrics_export_interval, Duration::from_secs(15));
}

#[test]
fn grpc_is_refused_at_load_time() {
    let err = common::config::load_from::<WebConfig, _>(
        None,
        env(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")]),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("http/protobuf"), "{err}");
}
