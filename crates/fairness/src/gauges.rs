//! The fairness gauges a worker service reports, counted fleet-wide every [`GAUGE_INTERVAL`] by
//! every replica (all report the same counts, so dashboards aggregate them with `max`, not `sum`):
//!
//! - `fairlane.fairness.waiting{service,queue,tier}` (Prometheus `fairlane_fairness_waiting`):
//!   runnable jobs held back because their user already runs as many jobs as the tier allows.
//!   The fetch gate skips such jobs inside the fetch, so they are never snoozed and
//!   `fairlane_fairness_snoozes_total` does not see them. One statement: the gate's own "users at
//!   their limit" part, joined to the available jobs of the service's queues.
//! - `fairlane.fairness.running{service,tier}` (`fairlane_fairness_running`): running user jobs
//!   of the service, by tier: the slots in use. It was once recorded by each fetch from the users
//!   that fetch looked at, so it left out users at their limit, each lane overwrote the others'
//!   count, and it kept its last value once the queues emptied.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::Tier;
use opentelemetry::KeyValue;
use opentelemetry::metrics::ObservableGauge;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::store::{self, TierLimits};

/// How often the counts are taken.
pub const GAUGE_INTERVAL: Duration = Duration::from_secs(15);

/// Held jobs per (queue, tier).
pub type Waiting = BTreeMap<(String, Tier), i64>;

/// Running user jobs per tier.
pub type Running = BTreeMap<Tier, i64>;

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

/// `rows` with every tier, zero where the database had no row.
pub fn running_zero_filled(rows: &[(Tier, i64)]) -> Running {
    let mut running: Running = Tier::ALL.iter().map(|t| (*t, 0)).collect();
    for (tier, n) in rows {
        *running.entry(*tier).or_insert(0) += n;
    }
    running
}

/// What the gauges report.
#[derive(Debug, Clone, Default)]
struct Counts {
    waiting: Waiting,
    running: Running,
}

/// The gauges and the counts they report. Keep it alive as long as the gauges should exist.
#[derive(Debug)]
pub struct FairnessGauges {
    service: String,
    queues: Vec<String>,
    counts: Arc<Mutex<Counts>>,
    _waiting: ObservableGauge<i64>,
    _running: ObservableGauge<i64>,
}

impl FairnessGauges {
    /// Registers the gauges on the global `fairlane` meter for the worker service's `queues`.
    pub fn register(service: &str, queues: &[String]) -> FairnessGauges {
        let counts = Arc::new(Mutex::new(Counts {
            waiting: zero_filled(queues, &[]),
            running: running_zero_filled(&[]),
        }));
        let meter = opentelemetry::global::meter("fairlane");
        let waiting = {
            let counts = Arc::clone(&counts);
            let service = service.to_owned();
            meter
                .i64_observable_gauge("fairlane.fairness.waiting")
                .with_unit("{job}")
                .with_description(
                    "Available jobs whose user is at the tier's limit, held back by fairness \
                     (fleet-wide; every replica reports the same count)",
                )
                .with_callback(move |observer| {
                    for ((queue, tier), n) in &lock(&counts).waiting {
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
        let running = {
            let counts = Arc::clone(&counts);
            let service = service.to_owned();
            meter
                .i64_observable_gauge("fairlane.fairness.running")
                .with_unit("{job}")
                .with_description(
                    "Running user jobs of the worker service, by tier: the fairness slots in use \
                     (fleet-wide; every replica reports the same count)",
                )
                .with_callback(move |observer| {
                    for (tier, n) in &lock(&counts).running {
                        observer.observe(
                            *n,
                            &[
                                KeyValue::new("service", service.clone()),
                                KeyValue::new("tier", tier.as_str()),
                            ],
                        );
                    }
                })
                .build()
        };
        FairnessGauges {
            service: service.to_owned(),
            queues: queues.to_vec(),
            counts,
            _waiting: waiting,
            _running: running,
        }
    }

    /// The held-back jobs reported now.
    pub fn waiting(&self) -> Waiting {
        lock(&self.counts).waiting.clone()
    }

    /// The running jobs reported now.
    pub fn running(&self) -> Running {
        lock(&self.counts).running.clone()
    }

    /// Counts once and stores the result for the gauges. A count that fails removes every
    /// series until one succeeds, as the scheduler's depth gauges do: kept, an old and large
    /// "held back by fairness" count would cancel out jobs really waiting for capacity in the
    /// backlog alert, which counts every waiting job when the series are absent.
    pub async fn refresh(&self, pool: &PgPool, limits: &TierLimits) -> Result<(), sqlx::Error> {
        let counted = self.count(pool, limits).await;
        let mut counts = lock(&self.counts);
        match counted {
            Ok(fresh) => {
                *counts = fresh;
                Ok(())
            }
            Err(e) => {
                *counts = Counts::default();
                Err(e)
            }
        }
    }

    async fn count(&self, pool: &PgPool, limits: &TierLimits) -> Result<Counts, sqlx::Error> {
        let unwrap = |crate::FairnessError::Database(e)| e;
        let mut conn = pool.acquire().await?;
        let waiting = store::waiting_at_limit(&mut conn, &self.queues, limits)
            .await
            .map_err(unwrap)?;
        let running = store::running_by_tier(&mut conn, &self.queues)
            .await
            .map_err(unwrap)?;
        Ok(Counts {
            waiting: zero_filled(&self.queues, &waiting),
            running: running_zero_filled(&running),
        })
    }

    /// Counts every `interval` until `shutdown`; a failed count is logged, and its series are
    /// gone until a count succeeds.
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
                tracing::warn!(error = %e, service = %self.service, "counting the fairness gauges failed");
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
        }
    }
}

fn lock(counts: &Mutex<Counts>) -> std::sync::MutexGuard<'_, Counts> {
    counts
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

    #[test]
    fn every_tier_reports_its_running_jobs() {
        let running = running_zero_filled(&[(Tier::Pro, 3), (Tier::Free, 1), (Tier::Pro, 1)]);
        assert_eq!(running.len(), Tier::ALL.len());
        assert_eq!(running[&Tier::Pro], 4);
        assert_eq!(running[&Tier::Free], 1);
        assert_eq!(running[&Tier::Enterprise], 0);
    }
}
