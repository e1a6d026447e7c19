//! `fairlane.fairness.waiting{service,queue,tier}` (Prometheus `fairlane_fairness_waiting`):
//! runnable jobs held back because their user already runs as many jobs as the tier allows.
//!
//! The fetch gate skips such jobs inside the fetch, so they are never snoozed and
//! `fairlane_fairness_snoozes_total` does not see them. This gauge does: every replica of a
//! worker service counts them fleet-wide every [`WAITING_INTERVAL`] with one statement (the
//! gate's own "users at their limit" part, joined to the available jobs of the service's queues).
//! All replicas report the same count, so dashboards aggregate it with `max`, not `sum`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::Tier;
use opentelemetry::KeyValue;
use opentelemetry::metrics::ObservableGauge;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::store::{self, TierLimits};

/// How often the count is taken.
pub const WAITING_INTERVAL: Duration = Duration::from_secs(15);

/// Held jobs per (queue, tier).
pub type Waiting = BTreeMap<(String, Tier), i64>;

/// `rows` with every queue of `queues` at every tier, zero where the database had no row, so a
/// series that empties reads 0 instead of keeping its last value.
pub fn zero_filled(queues: &[String], rows: &[(String, Tier, i64)]) -> Waiting {
    let mut waiting: Waiting = queues
        .iter()
        .flat_map(|q| Tier::ALL.iter().map(move |t| ((q.clone(), *t), 0)))
        .collect();
    for (queue, tier, n) in rows {
        *waiting.entry((queue.clone(), *tier)).or_insert(0) += n;
    }
    waiting
}

/// The gauge and the counts it reports. Keep it alive as long as the gauge should exist.
#[derive(Debug)]
pub struct WaitingGauge {
    service: String,
    queues: Vec<String>,
    snapshot: Arc<Mutex<Waiting>>,
    _gauge: ObservableGauge<i64>,
}

impl WaitingGauge {
    /// Registers the gauge on the global `fairlane` meter for the worker service's `queues`.
    pub fn register(service: &str, queues: &[String]) -> WaitingGauge {
        let snapshot = Arc::new(Mutex::new(zero_filled(queues, &[])));
        let gauge = {
            let snapshot = Arc::clone(&snapshot);
            let service = service.to_owned();
            opentelemetry::global::meter("fairlane")
                .i64_observable_gauge("fairlane.fairness.waiting")
                .with_unit("{job}")
                .with_description(
                    "Available jobs whose user is at the tier's limit, held back by fairness \
                     (fleet-wide; every replica reports the same count)",
                )
                .with_callback(move |observer| {
                    for ((queue, tier), n) in lock(&snapshot).iter() {
                        observer.observe(
                            *n,
                            &[
                                KeyValue::new("service", service.clone()),
                                KeyValue::new("queue", queue.clone()),
                                KeyValue::new("tier", tier.as_str()),
                            ],
                        );
                    }
                })
                .build()
        };
        WaitingGauge {
            service: service.to_owned(),
            queues: queues.to_vec(),
            snapshot,
            _gauge: gauge,
        }
    }

    /// The counts reported now.
    pub fn current(&self) -> Waiting {
        lock(&self.snapshot).clone()
    }

    /// Counts once and stores the result for the gauge.
    pub async fn refresh(&self, pool: &PgPool, limits: &TierLimits) -> Result<(), sqlx::Error> {
        let mut conn = pool.acquire().await?;
        let rows = store::waiting_at_limit(&mut conn, &self.queues, limits)
            .await
            .map_err(|crate::FairnessError::Database(e)| e)?;
        *lock(&self.snapshot) = zero_filled(&self.queues, &rows);
        Ok(())
    }

    /// Counts every `interval` until `shutdown`; a failed count keeps the last one and is logged.
    pub async fn run(
        self,
        pool: PgPool,
        limits: TierLimits,
        interval: Duration,
        shutdown: CancellationToken,
    ) {
        loop {
            let refreshed = tokio::select! {
                () = shutdown.cancelled() => return,
                refreshed = self.refresh(&pool, &limits) => refreshed,
            };
            if let Err(e) = refreshed {
                tracing::warn!(error = %e, service = %self.service, "counting jobs held by fairness failed");
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
        }
    }
}

fn lock(snapshot: &Mutex<Waiting>) -> std::sync::MutexGuard<'_, Waiting> {
    snapshot
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_queue_reports_every_tier_and_rows_fill_in() {
        let queues = vec![
            "analysis_default".to_owned(),
            "analysis_priority".to_owned(),
        ];
        let waiting = zero_filled(
            &queues,
            &[
                ("analysis_default".into(), Tier::Free, 7),
                ("analysis_priority".into(), Tier::Pro, 2),
            ],
        );
        assert_eq!(waiting.len(), 2 * Tier::ALL.len());
        assert_eq!(waiting[&("analysis_default".into(), Tier::Free)], 7);
        assert_eq!(waiting[&("analysis_priority".into(), Tier::Pro)], 2);
        assert_eq!(waiting[&("analysis_priority".into(), Tier::Enterprise)], 0);
        assert_eq!(waiting.values().sum::<i64>(), 9);
    }
}
