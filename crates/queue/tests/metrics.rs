//! The job outcome counter `fairlane.jobs{queue, kind, outcome}` (Prometheus:
//! `fairlane_jobs_total`) for attempts no completer ends: those of a worker that died.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use queue::{Client, NewJob};
use support::*;
use testkit::TestDb;

/// A worker killed mid-attempt (out of memory, say) never reaches its completer: the rescue
/// that ends the attempt counts it, as `rescued`, so the failure-ratio alert sees a job that
/// kills its workers on every attempt instead of a ratio of 0.
#[tokio::test]
async fn attempts_of_dead_workers_are_counted_as_rescued() {
    let exporter = InMemoryMetricExporter::default();
    let provider = SdkMeterProvider::builder()
        .with_reader(PeriodicReader::builder(exporter.clone()).build())
        .build();
    opentelemetry::global::set_meter_provider(provider.clone());

    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let job = client
        .insert(NewJob::new(q("q"), &Noop {}).unwrap().max_attempts(1))
        .await
        .unwrap()
        .job;
    mark_running(&db.pool, &[job.id], "killed-worker", 60_000).await;
    let waker = queue::wake::Waker::new(db.pool.clone());
    let rescued =
        queue::maintenance::rescue_dead_workers(&db.pool, &[], &waker, Duration::from_secs(1))
            .await
            .expect("rescue");
    assert_eq!(rescued.len(), 1, "{rescued:?}");
    provider.force_flush().expect("flush");

    let mut counted = BTreeMap::new();
    for resource in exporter.get_finished_metrics().expect("metrics") {
        for scope in resource.scope_metrics() {
            for metric in scope.metrics().filter(|m| m.name() == "fairlane.jobs") {
                let AggregatedMetrics::U64(MetricData::Sum(sum)) = metric.data() else {
                    panic!("not a u64 sum");
                };
                for point in sum.data_points() {
                    let attrs: BTreeMap<String, String> = point
                        .attributes()
                        .map(|kv| (kv.key.to_string(), kv.value.to_string()))
                        .collect();
                    counted.insert(attrs, point.value());
                }
            }
        }
    }
    let labels = BTreeMap::from([
        ("queue".to_owned(), "q".to_owned()),
        ("kind".to_owned(), "noop".to_owned()),
        ("outcome".to_owned(), "rescued".to_owned()),
    ]);
    assert_eq!(counted, BTreeMap::from([(labels, 1)]));
}
