//! The scheduler's own OpenTelemetry instruments (the queue-depth and reservation gauges are in
//! [`crate::depth`]). Prometheus names, after the telemetry crate's translation:
//!
//! - `fairlane_scheduler_ticks_total{task,outcome}`: ticks handled by this replica (`done`,
//!   `already_done`, `not_leader`, `failed`);
//! - `fairlane_scheduler_orphan_reservations_total{reason}`: reservations removed by cleanup
//!   (`final_job`, `missing_job`, `expired_without_job`); should stay flat;
//! - `fairlane_scheduler_reanalyses_total{outcome}`: re-analyses `enqueued` or found `duplicate`;
//! - `fairlane_scheduler_leader{lease}`: 1 while this replica holds the lease (`scheduler`,
//!   `queue-maintenance`), else 0; exported by every replica.

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, ObservableGauge};
use queue::LeaderHandle;
use quota::CleanupReport;

use crate::reanalyze::ReanalyzeReport;

#[derive(Debug, Clone)]
pub struct SchedulerMetrics {
    ticks: Counter<u64>,
    orphans: Counter<u64>,
    reanalyses: Counter<u64>,
}

impl Default for SchedulerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl SchedulerMetrics {
    /// Instruments from the global `fairlane` meter (build after telemetry is initialised).
    pub fn new() -> Self {
        let meter = opentelemetry::global::meter("fairlane");
        SchedulerMetrics {
            ticks: meter
                .u64_counter("fairlane.scheduler.ticks")
                .with_unit("{tick}")
                .with_description("Scheduler ticks handled by this replica, by task and outcome")
                .build(),
            orphans: meter
                .u64_counter("fairlane.scheduler.orphan_reservations")
                .with_unit("{reservation}")
                .with_description(
                    "Quota reservations removed by cleanup because their job was final or gone, \
                     or they never got a job within the TTL (should stay flat)",
                )
                .build(),
            reanalyses: meter
                .u64_counter("fairlane.scheduler.reanalyses")
                .with_unit("{job}")
                .with_description("Re-analyses of stale repositories, enqueued or already pending")
                .build(),
        }
    }

    pub fn tick(&self, task: &'static str, outcome: &'static str) {
        self.ticks.add(
            1,
            &[
                KeyValue::new("task", task),
                KeyValue::new("outcome", outcome),
            ],
        );
    }

    pub fn orphans(&self, report: &CleanupReport) {
        for (reason, n) in [
            ("final_job", report.final_job),
            ("missing_job", report.missing_job),
            ("expired_without_job", report.expired_without_job),
        ] {
            // Adding zero creates the series, so dashboards see 0 rather than nothing.
            self.orphans.add(n, &[KeyValue::new("reason", reason)]);
        }
    }

    pub fn reanalyses(&self, report: &ReanalyzeReport) {
        self.reanalyses
            .add(report.enqueued, &[KeyValue::new("outcome", "enqueued")]);
        self.reanalyses
            .add(report.duplicates, &[KeyValue::new("outcome", "duplicate")]);
    }
}

/// Registers `fairlane.scheduler.leader{lease}`; keep the returned gauge alive.
pub fn leader_gauge(leases: Vec<(&'static str, LeaderHandle)>) -> ObservableGauge<i64> {
    opentelemetry::global::meter("fairlane")
        .i64_observable_gauge("fairlane.scheduler.leader")
        .with_description("1 while this replica holds the lease, else 0")
        .with_callback(move |observer| {
            for (lease, handle) in &leases {
                observer.observe(
                    i64::from(handle.is_leader()),
                    &[KeyValue::new("lease", *lease)],
                );
            }
        })
        .build()
}
