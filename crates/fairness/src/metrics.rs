//! Fairness metrics: snoozes by tier (`fairlane_fairness_snoozes_total`) and running jobs by tier
//! (`fairlane_fairness_running`, the fleet-wide count of the service, as seen by the last fetch).

use common::Tier;
use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Gauge};

#[derive(Debug, Clone)]
pub(crate) struct FairnessMetrics {
    snoozes: Counter<u64>,
    running: Gauge<u64>,
}

impl FairnessMetrics {
    pub(crate) fn new() -> Self {
        let meter = opentelemetry::global::meter("fairlane");
        let snoozes = meter
            .u64_counter("fairlane.fairness.snoozes")
            .with_unit("{snooze}")
            .with_description("Jobs delayed because their user was at the tier's limit")
            .build();
        // Every tier's series exists from the start (at 0), so dashboards and alerts read a
        // rate of 0, not "no data", until the first snooze.
        for tier in Tier::ALL {
            snoozes.add(0, &[KeyValue::new("tier", tier.as_str())]);
        }
        FairnessMetrics {
            snoozes,
            running: meter
                .u64_gauge("fairlane.fairness.running")
                .with_unit("{job}")
                .with_description("Running user jobs of the worker service, by tier (fleet-wide)")
                .build(),
        }
    }

    pub(crate) fn snoozed(&self, tier: Tier) {
        self.snoozes.add(1, &[KeyValue::new("tier", tier.as_str())]);
    }

    pub(crate) fn running(&self, service: &str, by_tier: &[(Tier, u64)]) {
        for (tier, n) in by_tier {
            self.running.record(
                *n,
                &[
                    KeyValue::new("tier", tier.as_str()),
                    KeyValue::new("service", service.to_owned()),
                ],
            );
        }
    }
}
