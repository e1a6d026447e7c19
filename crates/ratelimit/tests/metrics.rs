//! The OpenTelemetry counter `fairlane.ratelimit.decisions{rule, decision}` (Prometheus:
//! `fairlane_ratelimit_decisions_total`), read back through an SDK meter provider.

use std::collections::BTreeMap;
use std::sync::Arc;

use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use ratelimit::{
    DescriptorKey, Limiter, LimiterConfig, ManualClock, MemoryBackend, MemoryConfig,
    RateLimitRequest, RuleSet,
};

#[tokio::test]
async fn decisions_are_counted_by_rule_and_decision() {
    let exporter = InMemoryMetricExporter::default();
    let provider = SdkMeterProvider::builder()
        .with_reader(PeriodicReader::builder(exporter.clone()).build())
        .build();
    opentelemetry::global::set_meter_provider(provider.clone());

    let rules = RuleSet::parse_fairlane(
        r#"
domain: metrics
descriptors:
  - key: tier
    value: free
    descriptors:
      - key: user_id
        rate_limit: {unit: minute, requests_per_unit: 2}
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 1}
    shadow_mode: true
"#,
        "t",
    )
    .expect("rules");
    let backend = Arc::new(MemoryBackend::new(
        &MemoryConfig::default(),
        Arc::new(ManualClock::new(1_700_000_000_000_000)),
    ));
    let limiter = Limiter::new(
        rules,
        backend,
        LimiterConfig {
            reload_interval: None,
            ..LimiterConfig::default()
        },
    );
    for user in ["secret-user-a", "secret-user-a", "secret-user-a"] {
        let request = RateLimitRequest::new()
            .with(DescriptorKey::Tier, "free")
            .with(DescriptorKey::UserId, user)
            .with(DescriptorKey::RemoteAddress, "192.0.2.55");
        limiter.check(&request).await;
    }
    provider.force_flush().expect("flush");

    let mut seen = BTreeMap::new();
    for resource in exporter.get_finished_metrics().expect("metrics") {
        for scope in resource.scope_metrics() {
            for metric in scope.metrics() {
                if metric.name() != "fairlane.ratelimit.decisions" {
                    continue;
                }
                let AggregatedMetrics::U64(MetricData::Sum(sum)) = metric.data() else {
                    panic!("not a u64 sum");
                };
                assert!(sum.is_monotonic());
                for point in sum.data_points() {
                    let attrs: BTreeMap<String, String> = point
                        .attributes()
                        .map(|kv| (kv.key.to_string(), kv.value.to_string()))
                        .collect();
                    assert_eq!(attrs.len(), 2, "{attrs:?}");
                    seen.insert(
                        (attrs["rule"].clone(), attrs["decision"].clone()),
                        point.value(),
                    );
                }
            }
        }
    }
    let expected = BTreeMap::from([
        (("metrics:tier=free/user_id".into(), "allowed".into()), 2),
        (("metrics:tier=free/user_id".into(), "limited".into()), 1),
        (("metrics:remote_address".into(), "allowed".into()), 1),
        (
            ("metrics:remote_address".into(), "shadow_limited".into()),
            2,
        ),
    ]);
    assert_eq!(seen, expected);
    // Low cardinality: the user's id and address never appear in a label.
    assert!(
        seen.keys()
            .all(|(rule, _)| !rule.contains("secret") && !rule.contains("192.0.2"))
    );
}
