//! Errors of the quota library.

use chrono::{DateTime, Utc};
use common::{Service, Tier};
use uuid::Uuid;

use crate::period::BillingPeriod;

/// A request that does not fit into the user's remaining quota, with the numbers behind it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaExceeded {
    pub user_id: Uuid,
    pub tier: Tier,
    pub event_type: Service,
    /// Units billed in the period.
    pub used: i64,
    /// Units held by live reservations.
    pub reserved: i64,
    /// Units the request needed.
    pub requested: i64,
    pub limit: i64,
    pub period: BillingPeriod,
    /// The database's clock when the standings were read: what the time to the period's end
    /// is counted from (the period is the database's too; a web host's clock may differ).
    pub read_at: DateTime<Utc>,
}

impl QuotaExceeded {
    /// When the period ends (the earliest time the request can fit without a release).
    pub fn period_end(&self) -> DateTime<Utc> {
        self.period.end
    }
}

/// Anything the quota API can fail with.
#[derive(Debug, thiserror::Error)]
pub enum QuotaError {
    #[error(
        "{event_type} quota exceeded: {used} used + {reserved} reserved + {requested} requested > limit {limit} (period ends {period_end})",
        event_type = .0.event_type, used = .0.used, reserved = .0.reserved,
        requested = .0.requested, limit = .0.limit, period_end = .0.period.end
    )]
    Exceeded(Box<QuotaExceeded>),
    #[error("user {0} does not exist")]
    UnknownUser(Uuid),
    #[error("reservation {0} does not exist, is linked already or has expired")]
    UnknownReservation(Uuid),
    /// Standings read when the database's clock was outside the plan's period: deciding on them
    /// would count the wrong period's usage. [`crate::Quota::settle_period`] reads them again.
    #[error(
        "quota standings read at {read_at} do not belong to the billing period {start} to {end}"
    )]
    StandingsOutsidePeriod {
        read_at: DateTime<Utc>,
        start: DateTime<Utc>,
        end: DateTime<Utc>,
    },
    /// The check ran in a transaction whose snapshot outlives the wait for the users' locks
    /// (REPEATABLE READ or SERIALIZABLE): its read could miss what the previous lock holder
    /// reserved, so it decides nothing.
    #[error(
        "quota checks need READ COMMITTED transactions, and this one is {0}: its snapshot could \
         predate the reservations of whoever held the user's lock before it"
    )]
    NotReadCommitted(String),
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
}
