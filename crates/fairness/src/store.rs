//! The SQL behind fairness. Every function runs on the caller's connection, so the gate's
//! statements share the fetch transaction.

use std::collections::HashMap;

use common::Tier;
use queue::JobId;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::FairnessError;
use crate::decision::Candidate;

/// Per-tier limits, bound as SQL parameters.
#[derive(Debug, Clone, Copy)]
pub struct TierLimits {
    pub free: i64,
    pub pro: i64,
    pub pro_plus: i64,
    pub enterprise: i64,
}

impl TierLimits {
    /// The limits `config` sets.
    pub fn from_config(config: &crate::FairnessConfig) -> TierLimits {
        TierLimits {
            free: i64::from(config.limit(Tier::Free)),
            pro: i64::from(config.limit(Tier::Pro)),
            pro_plus: i64::from(config.limit(Tier::ProPlus)),
            enterprise: i64::from(config.limit(Tier::Enterprise)),
        }
    }
}

/// Users whose running jobs in the service's queues (`$1`) fill their tier's limit (`$2..$5`:
/// free, pro, pro plus, enterprise), with that tier. Shared by the gate's candidate selection
/// and the waiting count; tiers are read from the paid users only (ADR 0015).
macro_rules! full_users_ctes {
    ($queues:literal, $free:literal, $pro:literal, $pro_plus:literal, $enterprise:literal) => {
        concat!(
            "running AS (
    SELECT user_id, count(*) AS n FROM fairlane_job
    WHERE state = 'running' AND user_id IS NOT NULL AND queue = ANY(",
            $queues,
            ")
    GROUP BY user_id
), full_users AS (
    SELECT r.user_id, coalesce(u.tier::text, 'free') AS tier
    FROM running r LEFT JOIN users u ON u.id = r.user_id AND u.tier <> 'free'
    WHERE r.n >= CASE u.tier WHEN 'pro' THEN ",
            $pro,
            " WHEN 'pro_plus' THEN ",
            $pro_plus,
            "
                             WHEN 'enterprise' THEN ",
            $enterprise,
            " ELSE ",
            $free,
            " END
)"
        )
    };
}

/// How many fairness locks there are per service: a user's lock is one of these stripes (by a
/// hash of the user's id), so a fetch that admits thousands of users holds at most this many
/// locks, and, each being exclusive, all the fetches of a service on every replica together hold
/// no more (two services: at most 4,096 entries of the lock table). PostgreSQL's lock table is
/// shared by all sessions and holds about
/// `max_locks_per_transaction × max_connections` locks (6,400 by default); a lock per user let a
/// few large fetches fill it, and then every transaction needing a lock, anywhere in the
/// database, failed with "out of shared memory". Two users of one stripe cannot be admitted by
/// two fetches at the same moment (one of them waits for the next fetch), which a fetch of `n`
/// users makes the fate of about `n / USER_LOCK_STRIPES` of another concurrent fetch's users.
pub const USER_LOCK_STRIPES: u32 = 2048;

/// The key of a user's fairness lock (an advisory lock, transaction-scoped): `$service` and
/// `$user` are the SQL of the service's name and the user's id. One expression for the gate's
/// try-lock and the middleware's lock, which must take the same lock. The mask is
/// [`USER_LOCK_STRIPES`] − 1 (a test holds them equal).
macro_rules! user_lock_key {
    ($service:literal, $user:literal) => {
        concat!(
            "hashtextextended('fairlane-fairness:' || ",
            $service,
            " || ':' || (hashtextextended(",
            $user,
            "::text, 0) & 2047)::text, 0)"
        )
    };
}

/// Candidate selection for the gate, in one statement:
///
/// - `full_users`: users whose running jobs in the service's queues already fill their tier's
///   limit; their jobs are skipped, so a heavy user's backlog never occupies a worker or hides
///   anyone else's job. Tiers are read from the paid users only (`users_paid`, ADR 0015): a user
///   not among them is free, so the look-up costs what the paid users cost, not every user;
/// - every other runnable job is taken in fetch order and locked `FOR UPDATE SKIP LOCKED`;
/// - a user job is only taken if this transaction gets its user's advisory lock without waiting
///   (`pg_try_advisory_xact_lock`): a user being admitted by another fetch right now, on any
///   replica, is left to the next fetch. The lock is held until commit, so the gate's next
///   statement can count the user's running jobs knowing no one else admits them meanwhile;
/// - it runs in the fetch transaction, with bitmap scans and sorts off
///   ([`queue::begin_fetch`], ADR 0013): it walks the fetch index in order and stops
///   after `$7` rows, so it tries the advisory locks of the users of those rows only.
///
/// `$1` queue, `$2` the service's queues, `$3..$6` limits (free, pro, pro plus, enterprise),
/// `$7` how many, `$8` the service name (lock namespace).
const CANDIDATES_SQL: &str = concat!(
    "
WITH ",
    full_users_ctes!("$2", "$3", "$4", "$5", "$6"),
    "
SELECT j.id, j.user_id FROM fairlane_job j
WHERE j.state = 'available' AND j.queue = $1
  AND (j.user_id IS NULL OR (
        j.user_id NOT IN (SELECT user_id FROM full_users)
        AND pg_try_advisory_xact_lock(",
    user_lock_key!("$8", "j.user_id"),
    ")))
ORDER BY j.priority, j.scheduled_at, j.id
LIMIT $7
FOR UPDATE OF j SKIP LOCKED"
);

/// Available jobs of `queues` whose user is at the tier's limit, by queue and tier: what the
/// gate holds back right now.
const WAITING_SQL: &str = concat!(
    "
WITH ",
    full_users_ctes!("$1", "$2", "$3", "$4", "$5"),
    "
SELECT j.queue::text, f.tier, count(*) FROM fairlane_job j JOIN full_users f USING (user_id)
WHERE j.state = 'available' AND j.queue = ANY($1)
GROUP BY j.queue, f.tier"
);

/// Available jobs held back by the limits, per queue of `queues` and tier ([`WAITING_SQL`]).
pub async fn waiting_at_limit(
    conn: &mut PgConnection,
    queues: &[String],
    limits: &TierLimits,
) -> Result<Vec<(String, Tier, i64)>, FairnessError> {
    let rows: Vec<(String, String, i64)> = sqlx::query_as(WAITING_SQL)
        .bind(queues)
        .bind(limits.free)
        .bind(limits.pro)
        .bind(limits.pro_plus)
        .bind(limits.enterprise)
        .fetch_all(&mut *conn)
        .await?;
    Ok(rows
        .into_iter()
        .map(|(queue, tier, n)| (queue, Tier::resolve(Some(&tier)), n))
        .collect())
}

/// Running user jobs of `queues`, by the user's tier (read from the paid users only, ADR 0015:
/// anyone else is free): the slots in use.
pub async fn running_by_tier(
    conn: &mut PgConnection,
    queues: &[String],
) -> Result<Vec<(Tier, i64)>, FairnessError> {
    let rows: Vec<(Option<String>, i64)> = sqlx::query_as(
        "SELECT u.tier::text, count(*) FROM fairlane_job j \
         LEFT JOIN users u ON u.id = j.user_id AND u.tier <> 'free' \
         WHERE j.state = 'running' AND j.user_id IS NOT NULL AND j.queue = ANY($1) \
         GROUP BY u.tier",
    )
    .bind(queues)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(tier, n)| (Tier::resolve(tier.as_deref()), n))
        .collect())
}

/// Locks up to `limit` candidates of `queue` (see [`CANDIDATES_SQL`]).
pub async fn lock_candidates(
    conn: &mut PgConnection,
    service: &str,
    queue: &str,
    queues: &[String],
    limits: &TierLimits,
    limit: usize,
) -> Result<Vec<Candidate>, FairnessError> {
    let rows: Vec<(JobId, Option<Uuid>)> = sqlx::query_as(CANDIDATES_SQL)
        .bind(queue)
        .bind(queues)
        .bind(limits.free)
        .bind(limits.pro)
        .bind(limits.pro_plus)
        .bind(limits.enterprise)
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .bind(service)
        .fetch_all(&mut *conn)
        .await?;
    Ok(rows
        .into_iter()
        .map(|(job_id, user_id)| Candidate { job_id, user_id })
        .collect())
}

/// Locks up to `limit` runnable jobs of `queue` in fetch order, with no fairness at all
/// (`FAIRNESS_ENABLED=false`).
pub async fn lock_any(
    conn: &mut PgConnection,
    queue: &str,
    limit: usize,
) -> Result<Vec<JobId>, FairnessError> {
    Ok(sqlx::query_scalar(
        "SELECT id FROM fairlane_job WHERE state = 'available' AND queue = $1 \
         ORDER BY priority, scheduled_at, id LIMIT $2 FOR UPDATE SKIP LOCKED",
    )
    .bind(queue)
    .bind(i64::try_from(limit).unwrap_or(i64::MAX))
    .fetch_all(&mut *conn)
    .await?)
}

/// [`counts_and_tiers`]' statement: `$1` the service's queues, `$2` the users.
const COUNTS_AND_TIERS_SQL: &str = "SELECT c.user_id, \
        (SELECT count(*) FROM fairlane_job j \
         WHERE j.state = 'running' AND j.user_id IS NOT NULL \
           AND j.user_id = c.user_id AND j.queue = ANY($1)), \
        u.tier::text \
     FROM unnest($2::uuid[]) AS c(user_id) \
     LEFT JOIN users u ON u.id = c.user_id AND u.tier <> 'free'";

/// For each of `users`: running jobs in `queues`, and tier (Free when the user is unknown). The
/// tier is read from the paid users only (`users_paid`, ADR 0015); anyone else is free.
pub async fn counts_and_tiers(
    conn: &mut PgConnection,
    queues: &[String],
    users: &[Uuid],
) -> Result<HashMap<Uuid, (u32, Tier)>, FairnessError> {
    let rows: Vec<(Uuid, i64, Option<String>)> = sqlx::query_as(COUNTS_AND_TIERS_SQL)
        .bind(queues)
        .bind(users)
        .fetch_all(&mut *conn)
        .await?;
    Ok(rows
        .into_iter()
        .map(|(user, n, tier)| {
            (
                user,
                (
                    u32::try_from(n).unwrap_or(u32::MAX),
                    Tier::resolve(tier.as_deref()),
                ),
            )
        })
        .collect())
}

/// Takes `user`'s fairness lock of `service` for the rest of the transaction, waiting for it: the
/// advisory lock [`lock_candidates`] tries for each user it admits.
pub async fn lock_user(
    conn: &mut PgConnection,
    service: &str,
    user: Uuid,
) -> Result<(), FairnessError> {
    sqlx::query(concat!(
        "SELECT pg_advisory_xact_lock(",
        user_lock_key!("$1", "$2"),
        ")"
    ))
    .bind(service)
    .bind(user)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Running jobs of `user` in `queues` that `job` must leave room for: all of them but `job`
/// itself and the jobs fetched in the same fetch as `job` (same queue, same `attempted_at`, same
/// fetching worker, and the same transaction: the rows' `xmin`, since two fetches of one worker
/// can start in the same microsecond) with a higher id. A row changed again since its fetch (a
/// cancel request) counts whole, which errs towards the limit.
///
/// Jobs of one fetch commit together, so each sees all the others; if every one counted every
/// other, a user's jobs fetched together with free slots would all snooze, and with no jitter come
/// back together and snooze again, forever. Ranked by id within their fetch, the first `limit`
/// run. Jobs of different fetches still count each other whole, which keeps two racing fetches
/// from both taking the last slot (see [`crate::FairnessMiddleware`]).
pub async fn other_running(
    conn: &mut PgConnection,
    queues: &[String],
    user: Uuid,
    job: JobId,
) -> Result<u32, FairnessError> {
    let n: i64 = sqlx::query_scalar(
        "WITH mine AS ( \
           SELECT queue, attempted_at, attempted_by[cardinality(attempted_by)] AS worker, \
                  xmin AS fetched_in \
           FROM fairlane_job WHERE id = $3 \
         ) \
         SELECT count(*) FROM fairlane_job o \
         WHERE o.state = 'running' AND o.user_id IS NOT NULL AND o.user_id = $2 \
           AND o.queue = ANY($1) AND o.id <> $3 \
           AND NOT EXISTS ( \
             SELECT 1 FROM mine f \
             WHERE o.id > $3 AND o.queue = f.queue AND o.attempted_at = f.attempted_at \
               AND o.attempted_by[cardinality(o.attempted_by)] = f.worker \
               AND o.xmin = f.fetched_in \
           )",
    )
    .bind(queues)
    .bind(user)
    .bind(job)
    .fetch_one(&mut *conn)
    .await?;
    Ok(u32::try_from(n).unwrap_or(u32::MAX))
}

/// The paid tiers among `users`, read from the paid users only (`users_paid`, ADR 0015); free
/// and unknown users are absent, and callers count them as free.
pub async fn tiers(
    conn: &mut PgConnection,
    users: &[Uuid],
) -> Result<HashMap<Uuid, Tier>, FairnessError> {
    if users.is_empty() {
        return Ok(HashMap::new());
    }
    let rows: Vec<(Uuid, String)> =
        sqlx::query_as("SELECT id, tier::text FROM users WHERE id = ANY($1) AND tier <> 'free'")
            .bind(users)
            .fetch_all(&mut *conn)
            .await?;
    Ok(rows
        .into_iter()
        .map(|(id, tier)| (id, Tier::resolve(Some(&tier))))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;
    use testkit::TestDb;
    use testkit::plan::plan_nodes;

    #[test]
    fn the_lock_key_masks_to_the_stripe_count() {
        assert!(USER_LOCK_STRIPES.is_power_of_two());
        let key = user_lock_key!("$1", "$2");
        assert!(
            key.contains(&format!("& {})", USER_LOCK_STRIPES - 1)),
            "{key}"
        );
    }

    /// With many more free users than paid ones, the gate's statements and the waiting count
    /// read tiers through `users_paid` only (ADR 0015): a look-up by primary key or a scan of
    /// `users` would cost every running or candidate user a visit, however many users are free.
    #[tokio::test]
    async fn the_gate_statements_read_tiers_from_the_paid_users_index_only() {
        let db = TestDb::new().await;
        sqlx::raw_sql(
            "INSERT INTO users (name, tier) SELECT 'idle', 'free' FROM generate_series(1, 20000); \
             INSERT INTO users (name, tier) SELECT 'paid', 'pro' FROM generate_series(1, 40); \
             INSERT INTO fairlane_job (queue, kind, args, state, attempt, attempted_at, attempted_by) \
               SELECT 'analysis_priority', 'noop', jsonb_build_object('user_id', u.id), 'running', \
                      1, now(), ARRAY['w'] \
               FROM users u, generate_series(1, 3) WHERE u.tier = 'pro'; \
             INSERT INTO fairlane_job (queue, kind, args) \
               SELECT 'analysis_priority', 'noop', jsonb_build_object('user_id', u.id) \
               FROM (SELECT id FROM users WHERE tier = 'pro' \
                     UNION ALL (SELECT id FROM users WHERE tier = 'free' ORDER BY id LIMIT 200)) u, \
                    generate_series(1, 5); \
             ANALYZE users; ANALYZE fairlane_job;",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        let queues = vec![
            "analysis_priority".to_owned(),
            "analysis_default".to_owned(),
        ];
        let users: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM users LIMIT 300")
            .fetch_all(&db.pool)
            .await
            .unwrap();

        let mut tx = queue::begin_fetch(&db.pool).await.unwrap();
        let candidates: Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "EXPLAIN (FORMAT JSON) {CANDIDATES_SQL}"
        )))
        .bind("analysis_priority")
        .bind(&queues)
        .bind(1_i64)
        .bind(3_i64)
        .bind(3_i64)
        .bind(5_i64)
        .bind(100_i64)
        .bind("analysis")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        let counts: Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "EXPLAIN (FORMAT JSON) {COUNTS_AND_TIERS_SQL}"
        )))
        .bind(&queues)
        .bind(&users)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        tx.rollback().await.unwrap();
        // The waiting count runs on its own, outside any fetch transaction.
        let waiting: Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "EXPLAIN (FORMAT JSON) {WAITING_SQL}"
        )))
        .bind(&queues)
        .bind(1_i64)
        .bind(3_i64)
        .bind(3_i64)
        .bind(5_i64)
        .fetch_one(&db.pool)
        .await
        .unwrap();

        for (name, explained) in [
            ("candidates", candidates),
            ("counts", counts),
            ("waiting", waiting),
        ] {
            // The index each node that reads `users` uses (`None` for a sequential scan).
            let reads: Vec<Option<&str>> = plan_nodes(&explained)
                .into_iter()
                .filter(|n| n["Relation Name"] == "users")
                .map(|n| n["Index Name"].as_str())
                .collect();
            assert!(!reads.is_empty(), "{name}: reads users: {explained}");
            assert!(
                reads.iter().all(|r| *r == Some("users_paid")),
                "{name}: reads users through {reads:?}, not users_paid alone: {explained}"
            );
        }
    }
}
