//! Reservations and usage in PostgreSQL: [`Quota::check`] / [`Quota::check_many`] with
//! [`Grant::reserve`] / [`Quota::reserve_many`] inside the caller's transaction,
//! [`Quota::reserve`] + [`Reservation::attach_job`], [`release`], [`Quota::usage`], [`cleanup`]
//! and [`active_reservations`].
//!
//! Why it cannot overspend (the race ADR-21's formula alone leaves open): a check first takes
//! the users' row locks (`SELECT … FOR NO KEY UPDATE`, in id order), so two reservations of the
//! same user run one after the other; the sums are then read by a *new* statement, whose
//! snapshot (READ COMMITTED) already contains whatever the previous lock holder committed. Within
//! one check of many requests, each grant counts for the later ones ([`Ledger`]). The
//! reservation and job inserts commit together with the caller's transaction, and the locks are
//! held until then.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::{Service, Tier};
use opentelemetry::KeyValue;
use opentelemetry::metrics::Counter;
use queue::JobId;
use serde::Serialize;
use sqlx::postgres::PgArguments;
use sqlx::{Arguments, PgConnection, PgPool};
use uuid::Uuid;

use crate::config::{InvalidQuotaConfig, QuotaConfig};
use crate::decision::{Decision, Ledger, Standing};
use crate::error::{QuotaError, QuotaExceeded};
use crate::period::BillingPeriod;

/// The SQL condition for a live reservation `r`: linked to a job that is not final, or not yet
/// linked and younger than its TTL. A reservation of a finished or deleted job no longer counts,
/// even before cleanup removes it.
/// A reservation that still holds units, exactly: unlinked and within its TTL, or linked to a job
/// that exists and is not final. Used for the gauge and the cleanup's view.
pub(crate) const LIVE_RESERVATION: &str = "((r.job_id IS NULL AND r.expires_at > now()) \
     OR EXISTS (SELECT 1 FROM fairlane_job j WHERE j.id = r.job_id \
                AND j.state NOT IN ('completed', 'cancelled', 'discarded')))";

/// The quota service: configuration plus metrics. Cheap to clone.
#[derive(Clone)]
pub struct Quota {
    config: Arc<QuotaConfig>,
    rejections: Counter<u64>,
}

impl std::fmt::Debug for Quota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Quota")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Units held for one request until its job ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub id: Uuid,
    pub user_id: Uuid,
    /// The user's tier as read (and locked) from `users`; unknown names resolve to Free.
    pub tier: Tier,
    pub event_type: Service,
    pub amount: i64,
    pub expires_at: DateTime<Utc>,
    pub period: BillingPeriod,
    /// The standing before this reservation.
    pub before: Standing,
}

/// A passed quota check, valid inside the transaction that made it (which holds the user's
/// lock). Turn it into a [`Reservation`] with [`Grant::reserve`] before committing.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a grant reserves nothing until `reserve` is called"]
pub struct Grant {
    pub user_id: Uuid,
    /// The user's tier as read (and locked) from `users`; unknown names resolve to Free.
    pub tier: Tier,
    pub event_type: Service,
    /// Units the request costs.
    pub amount: i64,
    pub period: BillingPeriod,
    /// The standing before this request.
    pub before: Standing,
    ttl: Duration,
}

impl Grant {
    /// Inserts the reservation, linked to `job_id` if the job is already inserted (in the same
    /// transaction), else unlinked until [`Reservation::attach_job`].
    pub async fn reserve(
        self,
        conn: &mut PgConnection,
        job_id: Option<JobId>,
    ) -> Result<Reservation, QuotaError> {
        let (id, expires_at): (Uuid, DateTime<Utc>) = sqlx::query_as(
            "INSERT INTO quota_reservations (id, user_id, event_type, reserved_amount, job_id, \
                                             expires_at) \
             VALUES ($6, $1, $2::fairlane_usage_event_type, $3, $4, \
                     now() + make_interval(secs => $5)) \
             RETURNING id, expires_at",
        )
        .bind(self.user_id)
        .bind(self.event_type.as_str())
        .bind(i32::try_from(self.amount).unwrap_or(i32::MAX))
        .bind(job_id)
        .bind(self.ttl.as_secs_f64())
        .bind(Uuid::now_v7())
        .fetch_one(&mut *conn)
        .await?;
        tracing::debug!(user_id = %self.user_id, reservation_id = %id, event_type = self.event_type.as_str(), amount = self.amount, job_id, "quota reserved");
        Ok(Reservation {
            id,
            user_id: self.user_id,
            tier: self.tier,
            event_type: self.event_type,
            amount: self.amount,
            expires_at,
            period: self.period,
            before: self.before,
        })
    }
}

/// One event type's usage in the current period.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EventUsage {
    pub event_type: Service,
    pub used: i64,
    pub reserved: i64,
    pub limit: i64,
    pub period_start: DateTime<Utc>,
    pub period_end: DateTime<Utc>,
}

/// A user's usage of every event type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UserUsage {
    pub user_id: Uuid,
    pub tier: Tier,
    pub events: Vec<EventUsage>,
}

/// What [`cleanup`] removed. Every count is an orphan: in a healthy system (every process that
/// finishes jobs runs [`crate::QuotaHook`]) all three stay zero.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CleanupReport {
    /// Reservations whose job is final (finished by a process without the hook).
    pub final_job: u64,
    /// Reservations whose job no longer exists.
    pub missing_job: u64,
    /// Reservations that never got a job and are older than the TTL.
    pub expired_without_job: u64,
}

impl CleanupReport {
    pub fn total(&self) -> u64 {
        self.final_job + self.missing_job + self.expired_without_job
    }
}

impl Quota {
    /// Validates `config`; instruments come from `opentelemetry::global::meter("fairlane")`, so
    /// build this after telemetry is initialised.
    pub fn new(config: QuotaConfig) -> Result<Quota, InvalidQuotaConfig> {
        config.validate()?;
        let rejections = opentelemetry::global::meter("fairlane")
            .u64_counter("fairlane.quota.rejections")
            .with_description("Requests refused because the user's quota was exhausted")
            .build();
        // Every (event type, tier) series exists from the start (at 0), so dashboards and alerts
        // read a rate of 0, not "no data", until the first rejection.
        for event_type in Service::ALL {
            for tier in Tier::ALL {
                rejections.add(
                    0,
                    &[
                        KeyValue::new("event_type", event_type.as_str()),
                        KeyValue::new("tier", tier.as_str()),
                    ],
                );
            }
        }
        Ok(Quota {
            config: Arc::new(config),
            rejections,
        })
    }

    pub fn config(&self) -> &QuotaConfig {
        &self.config
    }

    /// The billing period containing `now`.
    pub fn period(&self, now: DateTime<Utc>) -> BillingPeriod {
        self.config.quota_billing_period.period_containing(now)
    }

    /// Checks `used + reserved + cost <= limit` for one request of `event_type` and, if it fits,
    /// returns a [`Grant`] to turn into a reservation. Must run inside the caller's transaction
    /// (`&mut *tx`): it locks the user's row until that transaction ends, which serializes
    /// concurrent checks of the same user, so the decision stays true until the reservation the
    /// caller inserts next is committed. The grant carries the user's tier (read under the same
    /// lock) for choosing the job's queue.
    pub async fn check(
        &self,
        conn: &mut PgConnection,
        user_id: Uuid,
        event_type: Service,
        now: DateTime<Utc>,
    ) -> Result<Grant, QuotaError> {
        self.check_many(conn, &[(user_id, event_type)], now)
            .await?
            .pop()
            .unwrap_or(Err(QuotaError::UnknownUser(user_id)))
    }

    /// [`Quota::check`] for many requests at once, in three statements whatever their number:
    /// the users' rows are locked (in id order, so concurrent batches cannot deadlock), their
    /// standings are read by a new statement, and the requests are decided in the given order,
    /// each allowed one counting as reserved for the later ones of the same user and event type
    /// ([`Ledger`]). The outer error is a database failure; the inner ones are per request
    /// (quota exceeded, unknown user). Every grant is valid only if the caller reserves it in
    /// this transaction — all of them or, if some are dropped, the later grants over-count.
    pub async fn check_many(
        &self,
        conn: &mut PgConnection,
        requests: &[(Uuid, Service)],
        now: DateTime<Utc>,
    ) -> Result<Vec<Result<Grant, QuotaError>>, QuotaError> {
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let period = self.period(now);
        let tiers = lock_users(conn, requests.iter().map(|(user, _)| *user)).await?;
        let mut pairs: Vec<(Uuid, Service)> = requests
            .iter()
            .filter(|(user, _)| tiers.contains_key(user))
            .copied()
            .collect();
        pairs.sort_unstable_by_key(|(user, event)| (*user, event.as_str()));
        pairs.dedup();
        let standings = standings(conn, &pairs, period, |user, event| {
            self.config
                .limit(event, tiers.get(&user).copied().unwrap_or(Tier::Free))
        })
        .await?;
        let mut ledger = Ledger::new(standings);
        let outcomes = requests
            .iter()
            .map(|&(user_id, event_type)| {
                let tier = *tiers
                    .get(&user_id)
                    .ok_or(QuotaError::UnknownUser(user_id))?;
                let requested = self.config.cost(event_type);
                let (before, decision) = ledger
                    .take(&(user_id, event_type), requested)
                    .ok_or(QuotaError::UnknownUser(user_id))?;
                match decision {
                    Decision::Allow { .. } => Ok(Grant {
                        user_id,
                        tier,
                        event_type,
                        amount: requested,
                        period,
                        before,
                        ttl: self.config.quota_reservation_ttl,
                    }),
                    Decision::Deny { .. } => Err(self.refused(QuotaExceeded {
                        user_id,
                        tier,
                        event_type,
                        used: before.used,
                        reserved: before.reserved,
                        requested,
                        limit: before.limit,
                        period,
                    })),
                }
            })
            .collect();
        Ok(outcomes)
    }

    /// Counts and logs a refusal.
    fn refused(&self, x: QuotaExceeded) -> QuotaError {
        self.rejections.add(
            1,
            &[
                KeyValue::new("event_type", x.event_type.as_str()),
                KeyValue::new("tier", x.tier.as_str()),
            ],
        );
        tracing::info!(user_id = %x.user_id, event_type = x.event_type.as_str(),
            tier = x.tier.as_str(), used = x.used, reserved = x.reserved, limit = x.limit,
            "quota exceeded");
        QuotaError::Exceeded(Box::new(x))
    }

    /// Inserts the reservations of many grants (from one [`Quota::check_many`]), each linked to
    /// the job inserted for it in the same transaction, in one statement.
    pub async fn reserve_many(
        &self,
        conn: &mut PgConnection,
        grants: &[(Grant, JobId)],
    ) -> Result<(), QuotaError> {
        if grants.is_empty() {
            return Ok(());
        }
        let mut args = PgArguments::default();
        let only_grants: Vec<&Grant> = grants.iter().map(|(g, _)| g).collect();
        bind_reservations(&only_grants, &mut args)?;
        let jobs: Vec<JobId> = grants.iter().map(|(_, job)| *job).collect();
        args.add(&jobs).map_err(encode_error)?;
        let sql = format!(
            "WITH job AS (SELECT * FROM unnest(${}::int8[]) WITH ORDINALITY AS j(id, ord)), {} \
             SELECT count(*) FROM quota_reserved",
            RESERVATIONS_CTE_PARAMS + 1,
            reservations_cte("job", 1)
        );
        let (inserted,): (i64,) = sqlx::query_as_with(sqlx::AssertSqlSafe(sql), args)
            .fetch_one(&mut *conn)
            .await?;
        tracing::debug!(reservations = inserted, "quota reserved");
        Ok(())
    }

    /// [`Quota::check`] and [`Grant::reserve`] without a job: the reservation is inserted now and
    /// linked later with [`Reservation::attach_job`] (the ADR-21 order: reserve, insert the job,
    /// link). Prefer `check` + `reserve(conn, Some(job_id))`, one statement fewer.
    pub async fn reserve(
        &self,
        conn: &mut PgConnection,
        user_id: Uuid,
        event_type: Service,
        now: DateTime<Utc>,
    ) -> Result<Reservation, QuotaError> {
        let grant = self.check(conn, user_id, event_type, now).await?;
        grant.reserve(conn, None).await
    }

    /// The user's usage of every event type in the period containing `now`.
    pub async fn usage(
        &self,
        conn: &mut PgConnection,
        user_id: Uuid,
        now: DateTime<Utc>,
    ) -> Result<UserUsage, QuotaError> {
        let tier: Option<(String,)> = sqlx::query_as("SELECT tier::text FROM users WHERE id = $1")
            .bind(user_id)
            .fetch_optional(&mut *conn)
            .await?;
        let Some((tier,)) = tier else {
            return Err(QuotaError::UnknownUser(user_id));
        };
        let tier = Tier::resolve(Some(&tier));
        let period = self.period(now);
        let pairs: Vec<(Uuid, Service)> = Service::ALL.iter().map(|s| (user_id, *s)).collect();
        let standings = standings(conn, &pairs, period, |_, event| {
            self.config.limit(event, tier)
        })
        .await?;
        let events = Service::ALL
            .iter()
            .map(|&event_type| {
                let s = standings
                    .iter()
                    .find(|((_, e), _)| *e == event_type)
                    .map(|(_, s)| *s)
                    .unwrap_or(Standing {
                        used: 0,
                        reserved: 0,
                        limit: self.config.limit(event_type, tier),
                    });
                EventUsage {
                    event_type,
                    used: s.used,
                    reserved: s.reserved,
                    limit: s.limit,
                    period_start: period.start,
                    period_end: period.end,
                }
            })
            .collect();
        Ok(UserUsage {
            user_id,
            tier,
            events,
        })
    }
}

impl Reservation {
    /// Links the reservation to the job it pays for, in the same transaction as the job insert.
    /// From then on it lives exactly as long as the job is not final.
    pub async fn attach_job(
        &self,
        conn: &mut PgConnection,
        job_id: JobId,
    ) -> Result<(), QuotaError> {
        let updated = sqlx::query("UPDATE quota_reservations SET job_id = $2 WHERE id = $1")
            .bind(self.id)
            .bind(job_id)
            .execute(&mut *conn)
            .await?
            .rows_affected();
        if updated == 0 {
            return Err(QuotaError::UnknownReservation(self.id));
        }
        Ok(())
    }
}

/// Locks the users' rows against other reservations (not against foreign-key checks: `NO KEY`),
/// in id order so that two batches never wait for each other in a cycle, and returns their
/// tiers, resolved leniently. Unknown users are missing from the map.
async fn lock_users(
    conn: &mut PgConnection,
    users: impl Iterator<Item = Uuid>,
) -> Result<HashMap<Uuid, Tier>, QuotaError> {
    let mut ids: Vec<Uuid> = users.collect();
    ids.sort_unstable();
    ids.dedup();
    let rows: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT id, tier::text FROM users WHERE id = ANY($1) ORDER BY id FOR NO KEY UPDATE",
    )
    .bind(&ids)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(id, tier)| (id, Tier::resolve(Some(&tier))))
        .collect())
}

/// The reservations a quota check counts: every linked one (their running total in
/// `quota_reserved_totals`, kept by triggers), and unlinked ones within their TTL (summed through
/// a partial index; normally there are none). A linked reservation ends in the same transaction
/// as its job's final state, so a linked one whose job is final or gone is an orphan of a bug or
/// a hand edit; counting it until the scheduler's cleanup removes it errs on the safe side (it
/// can only refuse, never overspend), and spares the check a look-up of every pending job.
/// Used and reserved units of each (user, event type) pair, read in one statement (one
/// snapshot: a completion that moves units from reserved to used is seen entirely or not at
/// all) of constant cost per pair, however many jobs wait; `limit` gives each pair's limit.
async fn standings(
    conn: &mut PgConnection,
    pairs: &[(Uuid, Service)],
    period: BillingPeriod,
    limit: impl Fn(Uuid, Service) -> i64,
) -> Result<Vec<((Uuid, Service), Standing)>, QuotaError> {
    if pairs.is_empty() {
        return Ok(Vec::new());
    }
    const SQL: &str = "SELECT i.ord, \
           (SELECT COALESCE(SUM(e.amount), 0)::int8 FROM usage_events e \
             WHERE e.user_id = i.user_id AND e.event_type = i.event_type \
               AND e.occurred_at >= $3 AND e.occurred_at < $4), \
           COALESCE((SELECT t.reserved FROM quota_reserved_totals t \
                      WHERE t.user_id = i.user_id AND t.event_type = i.event_type), 0) \
           + (SELECT COALESCE(SUM(r.reserved_amount), 0)::int8 FROM quota_reservations r \
               WHERE r.user_id = i.user_id AND r.event_type = i.event_type \
                 AND r.job_id IS NULL AND r.expires_at > now()) \
         FROM unnest($1::uuid[], $2::text[]::fairlane_usage_event_type[]) \
              WITH ORDINALITY AS i(user_id, event_type, ord)";
    let users: Vec<Uuid> = pairs.iter().map(|(u, _)| *u).collect();
    let events: Vec<&str> = pairs.iter().map(|(_, e)| e.as_str()).collect();
    let rows: Vec<(i64, i64, i64)> = sqlx::query_as(SQL)
        .bind(&users)
        .bind(&events)
        .bind(period.start)
        .bind(period.end)
        .fetch_all(&mut *conn)
        .await?;
    rows.into_iter()
        .map(|(ord, used, reserved)| {
            let &(user, event) = usize::try_from(ord - 1)
                .ok()
                .and_then(|i| pairs.get(i))
                .ok_or_else(|| QuotaError::Database(sqlx::Error::RowNotFound))?;
            Ok((
                (user, event),
                Standing {
                    used,
                    reserved,
                    limit: limit(user, event),
                },
            ))
        })
        .collect()
}

/// Removes the reservation of `job_id` without billing (an explicit cancel outside the queue's
/// own cancel path). Returns whether one existed.
pub async fn release(conn: &mut PgConnection, job_id: JobId) -> Result<bool, QuotaError> {
    let deleted = sqlx::query("DELETE FROM quota_reservations WHERE job_id = $1")
        .bind(job_id)
        .execute(&mut *conn)
        .await?
        .rows_affected();
    Ok(deleted > 0)
}

/// The scheduler's safety net: deletes reservations whose job is final or gone, and reservations
/// that never got a job and are older than `ttl`. Never touches the reservation of a live job,
/// however old. Orphans are logged; in a healthy system there are none.
pub async fn cleanup(pool: &PgPool, ttl: Duration) -> Result<CleanupReport, QuotaError> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "WITH doomed AS ( \
           SELECT r.id, CASE WHEN r.job_id IS NULL THEN 'expired' \
                             WHEN j.id IS NULL THEN 'missing' ELSE 'final' END AS why \
           FROM quota_reservations r LEFT JOIN fairlane_job j ON j.id = r.job_id \
           WHERE (r.job_id IS NULL AND r.created_at < now() - make_interval(secs => $1)) \
              OR (r.job_id IS NOT NULL \
                  AND (j.id IS NULL OR j.state IN ('completed', 'cancelled', 'discarded'))) \
           FOR UPDATE OF r SKIP LOCKED \
         ), deleted AS ( \
           DELETE FROM quota_reservations r USING doomed d WHERE r.id = d.id RETURNING d.why \
         ) \
         SELECT why, count(*) FROM deleted GROUP BY why",
    )
    .bind(ttl.as_secs_f64())
    .fetch_all(pool)
    .await?;
    let mut report = CleanupReport::default();
    for (why, n) in rows {
        let n = u64::try_from(n).unwrap_or(0);
        match why.as_str() {
            "final" => report.final_job = n,
            "missing" => report.missing_job = n,
            _ => report.expired_without_job = n,
        }
    }
    if report.total() > 0 {
        tracing::warn!(
            final_job = report.final_job,
            missing_job = report.missing_job,
            expired_without_job = report.expired_without_job,
            "removed orphaned quota reservations"
        );
    }
    Ok(report)
}

/// Live reservations per event type (every type present, zeros included), for the
/// `fairlane.quota.reservations.active` gauge the scheduler exports.
pub async fn active_reservations(
    conn: &mut PgConnection,
) -> Result<BTreeMap<Service, i64>, QuotaError> {
    let sql = format!(
        "SELECT r.event_type::text, count(*) FROM quota_reservations r \
         WHERE {LIVE_RESERVATION} GROUP BY 1"
    );
    let rows: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .fetch_all(&mut *conn)
        .await?;
    let mut counts: BTreeMap<Service, i64> = Service::ALL.iter().map(|s| (*s, 0)).collect();
    for (name, n) in rows {
        if let Ok(service) = name.parse::<Service>() {
            counts.insert(service, n);
        }
    }
    Ok(counts)
}

/// The number of parameters [`reservations_cte`] uses.
pub const RESERVATIONS_CTE_PARAMS: usize = 5;

/// The reservations of many grants as a data-modifying CTE named `quota_reserved` (without the
/// leading `WITH`), for a statement that also inserts their jobs: the `i`-th grant (1-based) is
/// linked to the job that `jobs` — a relation with columns `ord` and `id` — lists with ordinal
/// `i`, so there must be exactly one job per grant. Uses parameters `$first` to
/// `$first + RESERVATIONS_CTE_PARAMS - 1`, bound by [`bind_reservations`]. Reservation ids are
/// UUIDv7 (time-ordered), so the primary key grows at its right edge.
pub fn reservations_cte(jobs: &str, first: usize) -> String {
    format!(
        "quota_reserved AS ( \
           INSERT INTO quota_reservations (id, user_id, event_type, reserved_amount, job_id, \
                                           expires_at) \
           SELECT t.id, t.user_id, t.event_type::fairlane_usage_event_type, t.amount, j.id, \
                  now() + make_interval(secs => t.ttl) \
           FROM unnest(${}::uuid[], ${}::uuid[], ${}::text[], ${}::int4[], ${}::float8[]) \
                WITH ORDINALITY AS t(id, user_id, event_type, amount, ttl, ord) \
           JOIN {jobs} j ON j.ord = t.ord \
           RETURNING id \
         )",
        first,
        first + 1,
        first + 2,
        first + 3,
        first + 4
    )
}

/// Adds the parameters of [`reservations_cte`] for `grants`, in order, to `args`.
pub fn bind_reservations(grants: &[&Grant], args: &mut PgArguments) -> Result<(), QuotaError> {
    let ids: Vec<Uuid> = grants.iter().map(|_| Uuid::now_v7()).collect();
    let users: Vec<Uuid> = grants.iter().map(|g| g.user_id).collect();
    let events: Vec<&str> = grants.iter().map(|g| g.event_type.as_str()).collect();
    let amounts: Vec<i32> = grants
        .iter()
        .map(|g| i32::try_from(g.amount).unwrap_or(i32::MAX))
        .collect();
    let ttls: Vec<f64> = grants.iter().map(|g| g.ttl.as_secs_f64()).collect();
    args.add(ids).map_err(encode_error)?;
    args.add(users).map_err(encode_error)?;
    args.add(events).map_err(encode_error)?;
    args.add(amounts).map_err(encode_error)?;
    args.add(ttls).map_err(encode_error)?;
    Ok(())
}

fn encode_error(e: sqlx::error::BoxDynError) -> QuotaError {
    QuotaError::Database(sqlx::Error::Encode(e))
}
