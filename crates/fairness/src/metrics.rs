//! Fairness metrics recorded as things happen: snoozes by tier (`fairlane_fairness_snoozes_total`).
//! The counted gauges (running and held-back jobs) are in [`crate::gauges`].

use common::Tier;
use opentelemetry::KeyValue;
use opentelemetry::metrics::Counter;

#[derive(Debug, Clone)]
pub(crate) struct FairnessMetrics {
    snoozes: Counter<u64>,
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
        FairnessMetrics { snoozes }
    }

    pub(crate) fn snoozed(&self, tier: Tier) {
        self.snoozes.add(1, &[KeyValue::new("tier", tier.as_str())]);
    }
}
