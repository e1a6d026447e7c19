//! The SQL behind fairness: running counts per user, candidate selection that skips full users,
//! per-user advisory locks, and tier look-ups. Every function runs on the caller's connection, so
//! the gate's statements share the fetch transaction.

use std::collections::HashMap;

use common::Tier;
use queue::JobId;
use sqlx::PgConnection;

use crate::FairnessError;
use crate::decision::Candidate;

/// Running jobs per user in `queues` (optionally only for `users`).
pub async fn running_counts(
    conn: &mut PgConnection,
    queues: &[String],
    users: Option<&[String]>,
) -> Result<HashMap<String, u32>, FairnessError> {
    // Both predicates match the `fairlane_job_running_user` partial index.
    let rows: Vec<(String, i64)> = match users {
        None => {
            sqlx::query_as(
                "SELECT user_id, count(*) FROM fairlane_job \
                 WHERE state = 'running' AND user_id IS NOT NULL AND queue = ANY($1) \
                 GROUP BY user_id",
            )
            .bind(queues)
            .fetch_all(&mut *conn)
            .await?
        }
        Some(users) => {
            sqlx::query_as(
                "SELECT user_id, count(*) FROM fairlane_job \
                 WHERE state = 'running' AND user_id IS NOT NULL AND user_id = ANY($2) \
                   AND queue = ANY($1) \
                 GROUP BY user_id",
            )
            .bind(queues)
            .bind(users)
            .fetch_all(&mut *conn)
            .await?
        }
    };
    Ok(rows
        .into_iter()
        .map(|(u, n)| (u, u32::try_from(n).unwrap_or(u32::MAX)))
        .collect())
}

/// Running jobs of `user` in `queues`, not counting `except`.
pub async fn other_running(
    conn: &mut PgConnection,
    queues: &[String],
    user: &str,
    except: JobId,
) -> Result<u32, FairnessError> {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM fairlane_job \
         WHERE state = 'running' AND user_id IS NOT NULL AND user_id = $2 AND queue = ANY($1) \
           AND id <> $3",
    )
    .bind(queues)
    .bind(user)
    .bind(except)
    .fetch_one(&mut *conn)
    .await?;
    Ok(u32::try_from(n).unwrap_or(u32::MAX))
}

/// Locks (`FOR UPDATE SKIP LOCKED`) up to `limit` runnable jobs of `queue` in fetch order,
/// skipping the jobs of `full_users`.
pub async fn lock_candidates(
    conn: &mut PgConnection,
    queue: &str,
    full_users: &[String],
    limit: usize,
) -> Result<Vec<Candidate>, FairnessError> {
    let rows: Vec<(JobId, Option<String>)> = sqlx::query_as(
        "SELECT id, user_id FROM fairlane_job \
         WHERE state = 'available' AND queue = $1 \
           AND (user_id IS NULL OR NOT (user_id = ANY($2))) \
         ORDER BY priority, scheduled_at, id \
         LIMIT $3 \
         FOR UPDATE SKIP LOCKED",
    )
    .bind(queue)
    .bind(full_users)
    .bind(i64::try_from(limit).unwrap_or(i64::MAX))
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(job_id, user_id)| Candidate { job_id, user_id })
        .collect())
}

/// Takes transaction-scoped advisory locks on `keys`, in ascending order so that two
/// transactions locking overlapping sets can never deadlock.
pub async fn lock_keys(conn: &mut PgConnection, keys: &mut [i64]) -> Result<(), FairnessError> {
    if keys.is_empty() {
        return Ok(());
    }
    keys.sort_unstable();
    sqlx::query("SELECT pg_advisory_xact_lock(k) FROM unnest($1::int8[]) AS k")
        .bind(&*keys)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// The tiers of `users` from the `users` table. Ids that are not UUIDs, or not found, are absent
/// (the caller treats them as Free).
pub async fn tiers(
    conn: &mut PgConnection,
    users: &[&str],
) -> Result<HashMap<String, Tier>, FairnessError> {
    let ids: Vec<uuid::Uuid> = users
        .iter()
        .filter_map(|u| uuid::Uuid::parse_str(u).ok())
        .collect();
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    let rows: Vec<(uuid::Uuid, String)> =
        sqlx::query_as("SELECT id, tier::text FROM users WHERE id = ANY($1)")
            .bind(&ids)
            .fetch_all(&mut *conn)
            .await?;
    // Key by the id as written in the job (any case); `Uuid` parses both.
    let by_uuid: HashMap<uuid::Uuid, Tier> = rows
        .into_iter()
        .map(|(id, tier)| (id, Tier::resolve(Some(&tier))))
        .collect();
    Ok(users
        .iter()
        .filter_map(|u| {
            let id = uuid::Uuid::parse_str(u).ok()?;
            by_uuid.get(&id).map(|t| ((*u).to_owned(), *t))
        })
        .collect())
}
