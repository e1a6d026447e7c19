//! Leader election on a PostgreSQL lease (`fairlane_leader`), for work that must happen once
//! fleet-wide: queue maintenance, the scheduler's periodic jobs.
//!
//! A candidate holds the lease named `name` while it keeps renewing it; others take it over only
//! once it has expired by the database's clock. The holder stops considering itself leader at
//! `time it sent the renewal + ttl` by its own monotonic clock, which is never later than the
//! expiry the database recorded — so a paused or partitioned leader stops acting before anyone else
//! can start. Resigning deletes the lease and notifies the other candidates so the hand-over takes
//! one round trip instead of a TTL.

use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::notifier::Notifier;

/// The NOTIFY channel on which a resigning leader announces its lease is free (payload: the name).
pub const LEADER_CHANNEL: &str = "fairlane_leader";

/// Tracks whether this process holds a lease.
#[derive(Debug, Clone)]
pub struct LeaderHandle {
    valid_until: Arc<Mutex<Option<Instant>>>,
    changes: watch::Receiver<bool>,
}

impl LeaderHandle {
    /// Whether this process may act as leader right now.
    pub fn is_leader(&self) -> bool {
        self.valid_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some_and(|until| Instant::now() < until)
    }

    /// Waits until leadership (as last observed) changes, or is restored after it lapsed
    /// without a change being seen (a late renewal); returns the new value.
    pub async fn changed(&mut self) -> bool {
        if self.changes.changed().await.is_err() {
            // The elector stopped: never leader again.
            std::future::pending::<()>().await;
        }
        *self.changes.borrow()
    }
}

/// Campaigns for one lease until shut down.
#[derive(Debug)]
pub struct LeaderElector {
    pool: PgPool,
    name: String,
    candidate_id: String,
    ttl: Duration,
    wake: Arc<Notify>,
    valid_until: Arc<Mutex<Option<Instant>>>,
    changes: watch::Sender<bool>,
}

impl LeaderElector {
    /// Creates an elector and registers its wake-up on `notifier` (resignations of `name`).
    pub fn new(
        pool: PgPool,
        name: impl Into<String>,
        candidate_id: impl Into<String>,
        ttl: Duration,
        notifier: &mut Notifier,
    ) -> (Self, LeaderHandle) {
        let name = name.into();
        let wake = Arc::new(Notify::new());
        let wake_cb = Arc::clone(&wake);
        let watched = name.clone();
        notifier.subscribe(
            LEADER_CHANNEL,
            Arc::new(move |payload| {
                if payload.is_none_or(|p| p == watched) {
                    wake_cb.notify_one();
                }
            }),
        );
        let valid_until = Arc::new(Mutex::new(None));
        let (changes, rx) = watch::channel(false);
        let handle = LeaderHandle {
            valid_until: Arc::clone(&valid_until),
            changes: rx,
        };
        (
            LeaderElector {
                pool,
                name,
                candidate_id: candidate_id.into(),
                ttl,
                wake,
                valid_until,
                changes,
            },
            handle,
        )
    }

    /// Records the lease's validity and tells the waiters when leadership changes, or becomes
    /// valid again after it lapsed with no change sent: renewals late past the lease's validity
    /// leave `is_leader` false meanwhile, and whoever skipped work in that gap must learn that
    /// it holds again now, not at its next wake-up (a schedule's next tick can be an hour away).
    fn set_valid_until(&self, until: Option<Instant>) {
        let was_valid = self.still_valid();
        *self
            .valid_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = until;
        let leader = until.is_some();
        let valid_again = !was_valid && self.still_valid();
        self.changes.send_if_modified(|v| {
            let changed = *v != leader || valid_again;
            *v = leader;
            changed
        });
    }

    /// Campaigns and renews until `shutdown`, then resigns if leader.
    pub async fn run(self, shutdown: CancellationToken) {
        let renew_every = self.ttl / 3;
        loop {
            let sent_at = Instant::now();
            match self.try_acquire().await {
                Ok(true) => {
                    if !self.was_leader() {
                        tracing::info!(lease = %self.name, candidate = %self.candidate_id, "became leader");
                    }
                    self.set_valid_until(Some(sent_at + self.ttl));
                }
                Ok(false) => {
                    if self.was_leader() {
                        tracing::warn!(lease = %self.name, "lost leadership");
                    }
                    self.set_valid_until(None);
                }
                Err(e) => {
                    // Keep the current deadline: it expires by itself if renewals keep failing.
                    tracing::warn!(lease = %self.name, error = %e, "leader election query failed");
                    if !self.still_valid() {
                        self.set_valid_until(None);
                    }
                }
            }
            let pause = if self.was_leader() {
                renew_every
            } else {
                // Followers retry a little faster than the leader renews, and at once on a
                // resignation notice.
                renew_every.min(Duration::from_secs(2))
            };
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = self.wake.notified() => {}
                () = tokio::time::sleep(pause) => {}
            }
        }
        if self.was_leader() {
            self.set_valid_until(None);
            match self.resign().await {
                Ok(()) => tracing::info!(lease = %self.name, "resigned leadership"),
                Err(e) => {
                    tracing::warn!(lease = %self.name, error = %e, "could not resign; the lease will expire");
                }
            }
        }
    }

    fn was_leader(&self) -> bool {
        *self.changes.borrow()
    }

    fn still_valid(&self) -> bool {
        self.valid_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some_and(|u| Instant::now() < u)
    }

    async fn try_acquire(&self) -> Result<bool, sqlx::Error> {
        let row: Option<(String,)> = sqlx::query_as(
            "INSERT INTO fairlane_leader (name, leader_id, elected_at, expires_at) \
             VALUES ($1, $2, now(), now() + $3 * interval '1 millisecond') \
             ON CONFLICT (name) DO UPDATE SET \
                 leader_id = EXCLUDED.leader_id, \
                 elected_at = CASE WHEN fairlane_leader.leader_id = EXCLUDED.leader_id \
                                   THEN fairlane_leader.elected_at ELSE now() END, \
                 expires_at = EXCLUDED.expires_at \
             WHERE fairlane_leader.leader_id = EXCLUDED.leader_id \
                OR fairlane_leader.expires_at < now() \
             RETURNING leader_id",
        )
        .bind(&self.name)
        .bind(&self.candidate_id)
        .bind(duration_millis(self.ttl))
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.is_some())
    }

    async fn resign(&self) -> Result<(), sqlx::Error> {
        let mut tx = crate::begin::begin(&self.pool).await?;
        sqlx::query("DELETE FROM fairlane_leader WHERE name = $1 AND leader_id = $2")
            .bind(&self.name)
            .bind(&self.candidate_id)
            .execute(&mut *tx)
            .await?;
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(LEADER_CHANNEL)
            .bind(&self.name)
            .execute(&mut *tx)
            .await?;
        tx.commit().await
    }
}

pub(crate) fn duration_millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
