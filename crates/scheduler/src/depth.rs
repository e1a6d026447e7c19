//! Queue-depth and reservation gauges, counted from the database by the scheduler leader:
//!
//! - `fairlane.queue.jobs{queue,state}` (Prometheus `fairlane_queue_jobs`): jobs per queue and
//!   state. Every queue ever seen by this process (and the six standard queues) reports every
//!   state, so a state that empties reads 0 instead of keeping its last value.
//! - `fairlane.quota.reservations.active{event_type}` (`fairlane_quota_reservations_active`):
//!   live reservations per event type ([`quota::active_reservations`]).
//!
//! Only the leader exports them: the gauges are observable and their callback reports the latest
//! counts only while this replica holds the `scheduler` lease, so a follower (or a former
//! leader) exports no series at all and `sum()` over replicas is the true count.
//!
//! Cost. Non-final states are counted every `QUEUE_DEPTH_INTERVAL` with one statement whose parts
//! each match a partial index (`fairlane_job_fetch` for available, `fairlane_job_due` for
//! scheduled and retryable, `fairlane_job_running_worker` for running — a running job always
//! names its worker), so it reads only live jobs however many finished ones the table retains.
//! Final states (completed, cancelled, discarded: up to a day or a week of history) need a pass
//! over every retained final row, so they are counted every `QUEUE_DEPTH_FINAL_INTERVAL`
//! (5 min by default) and their gauge is that old at most.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::Service;
use opentelemetry::KeyValue;
use opentelemetry::metrics::ObservableGauge;
use queue::{JobState, LeaderHandle};
use sqlx::{PgConnection, PgPool};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::SchedulerError;

/// States counted every interval.
pub const LIVE_STATES: [JobState; 4] = [
    JobState::Available,
    JobState::Scheduled,
    JobState::Running,
    JobState::Retryable,
];
/// States counted every final interval.
pub const FINAL_STATES: [JobState; 3] = [
    JobState::Completed,
    JobState::Cancelled,
    JobState::Discarded,
];

/// Jobs per (queue, state name).
pub type Depths = BTreeMap<(String, &'static str), i64>;

/// `rows` as a map in which every queue of `known` has every state of `states`, zero when the
/// database returned no row for it.
pub fn zero_filled(
    known: &BTreeSet<String>,
    states: &[JobState],
    rows: &[(String, JobState, i64)],
) -> Depths {
    let mut depths: Depths = rows
        .iter()
        .map(|(queue, state, n)| ((queue.clone(), state.as_str()), *n))
        .collect();
    fill_missing(&mut depths, known, states);
    depths
}

/// Gives every queue of `known` every state of `states` in `depths`, zero where it has none.
fn fill_missing(depths: &mut Depths, known: &BTreeSet<String>, states: &[JobState]) {
    for queue in known {
        for state in states {
            depths.entry((queue.clone(), state.as_str())).or_insert(0);
        }
    }
}

/// Non-final jobs per queue and state (see the module docs for the index each part uses).
pub async fn count_live(
    conn: &mut PgConnection,
) -> Result<Vec<(String, JobState, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT queue::text, 'available'::fairlane_job_state, count(*) FROM fairlane_job \
           WHERE state = 'available' GROUP BY queue \
         UNION ALL \
         SELECT queue::text, state, count(*) FROM fairlane_job \
           WHERE state IN ('scheduled', 'retryable') GROUP BY queue, state \
         UNION ALL \
         SELECT queue::text, 'running'::fairlane_job_state, count(*) FROM fairlane_job \
           WHERE state = 'running' AND cardinality(attempted_by) > 0 GROUP BY queue",
    )
    .fetch_all(&mut *conn)
    .await
}

/// Final jobs per queue and state (a pass over every retained final row).
pub async fn count_final(
    conn: &mut PgConnection,
) -> Result<Vec<(String, JobState, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT queue::text, state, count(*) FROM fairlane_job \
         WHERE finalized_at IS NOT NULL GROUP BY queue, state",
    )
    .fetch_all(&mut *conn)
    .await
}

#[derive(Debug, Default)]
struct Snapshot {
    live: Depths,
    finals: Depths,
    reservations: BTreeMap<Service, i64>,
}

/// The gauges and the counts they report. Keep it alive as long as the gauges should exist.
#[derive(Debug)]
pub struct DepthGauges {
    snapshot: Arc<Mutex<Snapshot>>,
    _jobs: ObservableGauge<i64>,
    _reservations: ObservableGauge<i64>,
}

impl DepthGauges {
    /// Registers the gauges on the global `fairlane` meter; they report only while `leader`
    /// says this replica leads.
    pub fn register(leader: &LeaderHandle) -> DepthGauges {
        let snapshot = Arc::new(Mutex::new(Snapshot::default()));
        let meter = opentelemetry::global::meter("fairlane");
        let jobs = {
            let snapshot = Arc::clone(&snapshot);
            let leader = leader.clone();
            meter
                .i64_observable_gauge("fairlane.queue.jobs")
                .with_unit("{job}")
                .with_description(
                    "Jobs per queue and state, counted by the scheduler leader (final states \
                     every QUEUE_DEPTH_FINAL_INTERVAL)",
                )
                .with_callback(move |observer| {
                    if !leader.is_leader() {
                        return;
                    }
                    let s = lock(&snapshot);
                    for ((queue, state), n) in s.live.iter().chain(s.finals.iter()) {
                        observer.observe(
                            *n,
                            &[
                                KeyValue::new("queue", queue.clone()),
                                KeyValue::new("state", *state),
                            ],
                        );
                    }
                })
                .build()
        };
        let reservations = {
            let snapshot = Arc::clone(&snapshot);
            let leader = leader.clone();
            meter
                .i64_observable_gauge("fairlane.quota.reservations.active")
                .with_unit("{reservation}")
                .with_description(
                    "Live quota reservations per event type, counted by the scheduler leader",
                )
                .with_callback(move |observer| {
                    if !leader.is_leader() {
                        return;
                    }
                    for (event_type, n) in &lock(&snapshot).reservations {
                        observer.observe(*n, &[KeyValue::new("event_type", event_type.as_str())]);
                    }
                })
                .build()
        };
        DepthGauges {
            snapshot,
            _jobs: jobs,
            _reservations: reservations,
        }
    }

    fn clear(&self) {
        *lock(&self.snapshot) = Snapshot::default();
    }
}

fn lock(snapshot: &Mutex<Snapshot>) -> std::sync::MutexGuard<'_, Snapshot> {
    snapshot
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Counts every `interval` (final states every `final_interval`) while leader, until
/// `shutdown`. Losing leadership forgets the counts, so a later term starts from fresh ones.
pub async fn run(
    pool: PgPool,
    gauges: Arc<DepthGauges>,
    leader: LeaderHandle,
    interval: Duration,
    final_interval: Duration,
    shutdown: CancellationToken,
) {
    let mut known: BTreeSet<String> = Service::ALL
        .iter()
        .flat_map(|s| s.queues())
        .map(|q| q.to_string())
        .collect();
    let mut changes = leader.clone();
    let mut finals_counted_at: Option<Instant> = None;
    loop {
        if leader.is_leader() {
            let finals_due = finals_counted_at.is_none_or(|at| at.elapsed() >= final_interval);
            match refresh(&pool, &gauges, &mut known, finals_due).await {
                Ok(()) => {
                    if finals_due {
                        finals_counted_at = Some(Instant::now());
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "counting queue depths failed");
                    // What failed may have removed the final-state counts: count them again at
                    // the next round that succeeds, not a whole final interval later.
                    finals_counted_at = None;
                }
            }
        } else {
            gauges.clear();
            finals_counted_at = None;
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = changes.changed() => {}
            () = tokio::time::sleep(interval) => {}
        }
    }
}

/// One round: the live counts and reservations, then (when due) the final counts. Counts that
/// could not be read are not exported as if current: a failed live count removes every series
/// until a count succeeds, and a failed final count removes the final states' series (retried
/// next round) but not the live counts read before it.
async fn refresh(
    pool: &PgPool,
    gauges: &DepthGauges,
    known: &mut BTreeSet<String>,
    finals: bool,
) -> Result<(), SchedulerError> {
    let live_counts = async {
        let mut conn = pool.acquire().await?;
        let live = count_live(&mut conn).await?;
        let reservations = quota::active_reservations(&mut conn).await?;
        Ok::<_, SchedulerError>((conn, live, reservations))
    };
    let (mut conn, live, reservations) = match live_counts.await {
        Ok(counts) => counts,
        Err(e) => {
            gauges.clear();
            return Err(e);
        }
    };
    known.extend(live.iter().map(|(q, _, _)| q.clone()));
    {
        let mut s = lock(&gauges.snapshot);
        s.live = zero_filled(known, &LIVE_STATES, &live);
        s.reservations = reservations;
        // Queues first seen in this round read 0 in final states until the next final count.
        if !s.finals.is_empty() {
            fill_missing(&mut s.finals, known, &FINAL_STATES);
        }
    }
    if finals {
        match count_final(&mut conn).await {
            Ok(rows) => {
                known.extend(rows.iter().map(|(q, _, _)| q.clone()));
                let mut s = lock(&gauges.snapshot);
                s.finals = zero_filled(known, &FINAL_STATES, &rows);
                fill_missing(&mut s.live, known, &LIVE_STATES);
            }
            Err(e) => {
                lock(&gauges.snapshot).finals.clear();
                return Err(e.into());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_known_queue_reports_every_state_and_missing_rows_read_zero() {
        let known: BTreeSet<String> = ["a".to_owned(), "b".to_owned()].into();
        let depths = zero_filled(
            &known,
            &LIVE_STATES,
            &[
                ("a".into(), JobState::Available, 7),
                ("b".into(), JobState::Running, 2),
            ],
        );
        assert_eq!(depths.len(), 8);
        assert_eq!(depths[&("a".to_owned(), "available")], 7);
        assert_eq!(depths[&("a".to_owned(), "running")], 0);
        assert_eq!(depths[&("b".to_owned(), "running")], 2);
        assert_eq!(depths[&("b".to_owned(), "retryable")], 0);
        // A state that disappeared from the rows goes back to zero.
        let later = zero_filled(&known, &LIVE_STATES, &[]);
        assert!(later.values().all(|n| *n == 0));
        assert_eq!(later.len(), 8);
    }

    #[test]
    fn live_and_final_states_partition_all_states() {
        let mut all: Vec<JobState> = LIVE_STATES.iter().chain(&FINAL_STATES).copied().collect();
        all.sort_by_key(|s| s.as_str());
        let mut expected = JobState::ALL.to_vec();
        expected.sort_by_key(|s| s.as_str());
        assert_eq!(all, expected);
        assert!(FINAL_STATES.iter().all(|s| s.is_final()));
        assert!(LIVE_STATES.iter().all(|s| !s.is_final()));
    }
}
