//! Putting jobs into the queue: one or many (optionally unique, inside the caller's transaction)
//! with a single `INSERT … SELECT FROM unnest(…)` statement, and bulk loads with binary `COPY`.
//!
//! In a caller's transaction ([`Notify::InStatement`]) each statement also `NOTIFY`s the queues
//! that received runnable jobs; PostgreSQL delivers the notification only when the transaction
//! commits, so a rolled-back insert wakes nobody. The client's own inserts and `QueueTx` wake the
//! producers after commit instead ([`Notify::AfterCommit`], ADR 0006).

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use common::{JobArgs, QueueName};
use serde_json::{Map, Value};
use sqlx::PgConnection;

use crate::copy::CopyEncoder;
use crate::error::QueueError;
use crate::job::JobRow;

/// The NOTIFY channel that announces runnable jobs; the payload is the queue name.
pub const INSERT_CHANNEL: &str = "fairlane_insert";

/// Priorities run from 1 (first) to 4 (last).
pub const PRIORITY_RANGE: std::ops::RangeInclusive<i16> = 1..=4;
/// Default attempts before a failing job is discarded.
pub const DEFAULT_MAX_ATTEMPTS: i16 = 25;
const MAX_UNIQUE_KEY_LEN: usize = 1024;

/// A job to insert.
#[derive(Debug, Clone, PartialEq)]
pub struct NewJob {
    pub kind: String,
    pub queue: QueueName,
    pub args: Value,
    pub priority: i16,
    pub max_attempts: i16,
    /// Run no earlier than this; `None` means now.
    pub scheduled_at: Option<DateTime<Utc>>,
    /// At most one non-final job per key.
    pub unique_key: Option<String>,
    pub metadata: Map<String, Value>,
}

/// The result of inserting one job.
#[derive(Debug, Clone, PartialEq)]
pub struct Inserted {
    pub job: JobRow,
    /// The job was not inserted because a non-final job with the same unique key exists; `job` is
    /// that existing job.
    pub duplicate: bool,
}

impl NewJob {
    /// A job of `A::KIND` with `args` on `queue`.
    pub fn new<A: JobArgs>(queue: QueueName, args: &A) -> Result<Self, QueueError> {
        Self::from_json(A::KIND, queue, serde_json::to_value(args)?)
    }

    /// A job from raw JSON arguments (they must be a JSON object).
    pub fn from_json(
        kind: impl Into<String>,
        queue: QueueName,
        args: Value,
    ) -> Result<Self, QueueError> {
        let job = NewJob {
            kind: kind.into(),
            queue,
            args,
            priority: 1,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            scheduled_at: None,
            unique_key: None,
            metadata: Map::new(),
        };
        job.validate()?;
        Ok(job)
    }

    pub fn priority(mut self, priority: i16) -> Self {
        self.priority = priority;
        self
    }

    pub fn max_attempts(mut self, max_attempts: i16) -> Self {
        self.max_attempts = max_attempts;
        self
    }

    pub fn scheduled_at(mut self, at: DateTime<Utc>) -> Self {
        self.scheduled_at = Some(at);
        self
    }

    pub fn unique_key(mut self, key: impl Into<String>) -> Self {
        self.unique_key = Some(key.into());
        self
    }

    /// Adds a metadata entry. The keys of [`QUEUE_METADATA_KEYS`] are the queue's own, and
    /// refused by [`NewJob::validate`].
    pub fn metadata(mut self, key: impl Into<String>, value: Value) -> Self {
        self.metadata.insert(key.into(), value);
        self
    }

    /// Checks what the database would otherwise refuse with a less helpful message.
    pub fn validate(&self) -> Result<(), QueueError> {
        let bad = |m: String| Err(QueueError::InvalidJob(m));
        if self.kind.is_empty() || self.kind.len() > 255 {
            return bad(format!(
                "kind must be 1 to 255 bytes long, got {}",
                self.kind.len()
            ));
        }
        if !self.args.is_object() {
            return bad(format!(
                "arguments of `{}` must be a JSON object, got {}",
                self.kind,
                json_type(&self.args)
            ));
        }
        match self.args.get("user_id") {
            None | Some(Value::Null) => {}
            // PostgreSQL's uuid takes every form `Uuid` parses but the `urn:uuid:` one.
            Some(Value::String(id))
                if uuid::Uuid::parse_str(id).is_ok()
                    && !id.get(..4).is_some_and(|p| p.eq_ignore_ascii_case("urn:")) => {}
            Some(other) => {
                return bad(format!(
                    "args.user_id of `{}` must be a user's UUID, got {other}",
                    self.kind
                ));
            }
        }
        if !PRIORITY_RANGE.contains(&self.priority) {
            return bad(format!(
                "priority must be between 1 and 4, got {}",
                self.priority
            ));
        }
        if self.max_attempts < 1 {
            return bad(format!(
                "max_attempts must be at least 1, got {}",
                self.max_attempts
            ));
        }
        if let Some(key) = &self.unique_key
            && (key.is_empty() || key.len() > MAX_UNIQUE_KEY_LEN)
        {
            return bad(format!(
                "unique key must be 1 to {MAX_UNIQUE_KEY_LEN} bytes long"
            ));
        }
        if let Some(key) = QUEUE_METADATA_KEYS
            .iter()
            .find(|k| self.metadata.contains_key(**k))
        {
            return bad(format!(
                "metadata key `{key}` of `{}` is the queue's own (it counts snoozes and records \
                 cancel requests); choose another name",
                self.kind
            ));
        }
        Ok(())
    }
}

/// Metadata keys the queue writes and reads itself: a job inserted with one would have its
/// snoozes fail to count (and use up attempts), or be taken for cancelled from the start.
pub const QUEUE_METADATA_KEYS: [&str; 3] = ["snoozes", "cancel_attempted_at", "cancel_reason"];

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// `insert_many`'s statement, with the rows inserted in the given order and the given conflict
/// clause after the `INSERT`'s `SELECT`.
macro_rules! insert_many_sql {
    ($order:literal, $on_conflict:literal) => {
        concat!(
            r#"
WITH input AS (
    SELECT *
    FROM unnest($1::text[], $2::text[], $3::jsonb[], $4::int2[], $5::int2[], $6::timestamptz[],
                $7::text[], $8::jsonb[])
         WITH ORDINALITY AS t(kind, queue, args, priority, max_attempts, scheduled_at, unique_key,
                              metadata, ord)
),
ins AS (
    INSERT INTO fairlane_job (state, kind, queue, args, priority, max_attempts, scheduled_at,
                              unique_key, metadata)
    SELECT "#,
            new_job_state_sql!(),
            r#",
           n.kind, n.queue, n.args, n.priority, n.max_attempts, coalesce(n.scheduled_at, now()),
           n.unique_key, n.metadata
    FROM input n
    ORDER BY "#,
            $order,
            r#"
    "#,
            $on_conflict,
            r#"
    RETURNING *
),
notified AS (
    SELECT pg_notify('fairlane_insert', d.queue)
    FROM (SELECT DISTINCT queue FROM ins WHERE state = 'available' AND $9) d
)
SELECT ins.* FROM ins WHERE (SELECT count(*) FROM notified) >= 0 ORDER BY ins.id
"#
        )
    };
}

/// For a batch in which some job has a unique key: a duplicate of a live job is skipped. The
/// keyed rows go in in key order (after the others, which keep theirs): an insert that meets a
/// key another transaction has just inserted waits for that transaction, so two batches taking
/// shared keys in different orders would each wait for the other, and one would fail with a
/// deadlock instead of learning the existing job. Within a key, the earlier job of a batch still
/// wins.
const INSERT_MANY_SQL: &str = insert_many_sql!(
    "n.unique_key NULLS FIRST, n.ord",
    "ON CONFLICT (unique_key)
        WHERE unique_key IS NOT NULL AND state IN ('available', 'scheduled', 'running', 'retryable')
        DO NOTHING"
);

/// For a batch without unique keys, where no row can conflict: without an `ON CONFLICT` clause
/// PostgreSQL inserts each row directly instead of speculatively (a check of the arbiter index,
/// then a second WAL record to confirm the row), about a tenth less work per row.
const INSERT_MANY_WITHOUT_KEYS_SQL: &str = insert_many_sql!("n.ord", "");

const EXISTING_UNIQUE_SQL: &str = "SELECT * FROM fairlane_job \
     WHERE unique_key = ANY($1) AND state IN ('available', 'scheduled', 'running', 'retryable')";

/// Whether an insert statement NOTIFYs the queues it made runnable (delivered at commit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notify {
    /// NOTIFY in the statement: correct inside any caller's transaction, but every such
    /// transaction's commit is serialized by PostgreSQL with every other notifying commit.
    InStatement,
    /// The caller wakes producers after commit (see [`crate::wake::Waker`]).
    AfterCommit,
}

/// Inserts one job. Pass `&mut *tx` to insert inside your transaction; producers are notified
/// when it commits.
pub async fn insert(conn: &mut PgConnection, job: NewJob) -> Result<Inserted, QueueError> {
    insert_with(conn, job, Notify::InStatement).await
}

pub(crate) async fn insert_with(
    conn: &mut PgConnection,
    job: NewJob,
    notify: Notify,
) -> Result<Inserted, QueueError> {
    let mut results = insert_many_with(conn, vec![job], notify).await?;
    results
        .pop()
        .ok_or_else(|| QueueError::InvalidJob("insert returned no row".into()))
}

/// Inserts jobs in one statement; the results are in input order. A unique job whose key is held by
/// a non-final job (including one earlier in the same batch) is not inserted and reports that job.
/// Producers are notified when the transaction commits.
pub async fn insert_many(
    conn: &mut PgConnection,
    jobs: Vec<NewJob>,
) -> Result<Vec<Inserted>, QueueError> {
    insert_many_with(conn, jobs, Notify::InStatement).await
}

pub(crate) async fn insert_many_with(
    conn: &mut PgConnection,
    jobs: Vec<NewJob>,
    notify: Notify,
) -> Result<Vec<Inserted>, QueueError> {
    for job in &jobs {
        job.validate()?;
    }
    let mut pending: Vec<(usize, NewJob)> = jobs.into_iter().enumerate().collect();
    let mut results: Vec<Option<Inserted>> = vec![None; pending.len()];
    // A duplicate whose holder finishes between our insert and our look-up is inserted again; a
    // few rounds settle any realistic race.
    for _round in 0..5 {
        if pending.is_empty() {
            break;
        }
        let inserted = run_insert(conn, pending.iter().map(|(_, j)| j), notify).await?;
        let mut unique_rows: HashMap<String, JobRow> = HashMap::new();
        let mut plain_rows = Vec::new();
        for row in inserted {
            match row.unique_key.clone() {
                Some(key) => {
                    unique_rows.insert(key, row);
                }
                None => plain_rows.push(row),
            }
        }
        let mut plain_rows = plain_rows.into_iter();
        let mut claimed: HashMap<String, JobRow> = HashMap::new();
        let mut duplicates: Vec<(usize, NewJob)> = Vec::new();
        for (index, job) in pending.drain(..) {
            match &job.unique_key {
                None => {
                    let row = plain_rows.next().ok_or_else(|| {
                        QueueError::InvalidJob("insert returned fewer rows than jobs".into())
                    })?;
                    results[index] = Some(Inserted {
                        job: row,
                        duplicate: false,
                    });
                }
                Some(key) => {
                    if let Some(row) = unique_rows.remove(key) {
                        claimed.insert(key.clone(), row.clone());
                        results[index] = Some(Inserted {
                            job: row,
                            duplicate: false,
                        });
                    } else if let Some(row) = claimed.get(key) {
                        results[index] = Some(Inserted {
                            job: row.clone(),
                            duplicate: true,
                        });
                    } else {
                        duplicates.push((index, job));
                    }
                }
            }
        }
        if duplicates.is_empty() {
            break;
        }
        let keys: Vec<String> = duplicates
            .iter()
            .filter_map(|(_, j)| j.unique_key.clone())
            .collect();
        let existing: Vec<JobRow> = sqlx::query_as(EXISTING_UNIQUE_SQL)
            .bind(&keys)
            .fetch_all(&mut *conn)
            .await?;
        let existing: HashMap<String, JobRow> = existing
            .into_iter()
            .filter_map(|r| r.unique_key.clone().map(|k| (k, r)))
            .collect();
        for (index, job) in duplicates {
            let key = job.unique_key.as_deref().unwrap_or_default();
            match existing.get(key) {
                Some(row) => {
                    results[index] = Some(Inserted {
                        job: row.clone(),
                        duplicate: true,
                    });
                }
                None => pending.push((index, job)),
            }
        }
    }
    if let Some((_, job)) = pending.first() {
        return Err(QueueError::UniqueRace(
            job.unique_key.clone().unwrap_or_default(),
        ));
    }
    results
        .into_iter()
        .map(|r| r.ok_or_else(|| QueueError::InvalidJob("a job got no insert result".into())))
        .collect()
}

async fn run_insert<'a>(
    conn: &mut PgConnection,
    jobs: impl Iterator<Item = &'a NewJob>,
    notify: Notify,
) -> Result<Vec<JobRow>, QueueError> {
    let mut kinds = Vec::new();
    let mut queues = Vec::new();
    let mut args = Vec::new();
    let mut priorities = Vec::new();
    let mut max_attempts = Vec::new();
    let mut scheduled = Vec::new();
    let mut unique_keys = Vec::new();
    let mut metadata = Vec::new();
    for job in jobs {
        kinds.push(job.kind.as_str());
        queues.push(job.queue.as_str());
        args.push(&job.args);
        priorities.push(job.priority);
        max_attempts.push(job.max_attempts);
        scheduled.push(job.scheduled_at);
        unique_keys.push(job.unique_key.as_deref());
        metadata.push(Value::Object(job.metadata.clone()));
    }
    let sql = if unique_keys.iter().any(Option::is_some) {
        INSERT_MANY_SQL
    } else {
        INSERT_MANY_WITHOUT_KEYS_SQL
    };
    let rows = sqlx::query_as::<_, JobRow>(sql)
        .bind(&kinds)
        .bind(&queues)
        .bind(&args)
        .bind(&priorities)
        .bind(&max_attempts)
        .bind(&scheduled)
        .bind(&unique_keys)
        .bind(&metadata)
        .bind(notify == Notify::InStatement)
        .fetch_all(&mut *conn)
        .await?;
    Ok(rows)
}

/// Loads many jobs with binary `COPY` — the fastest path, for large batches. Unique keys are not
/// supported here (COPY cannot skip conflicts); use [`insert_many`] for unique jobs. Returns how
/// many rows were written. Runs inside the caller's transaction if `conn` is one; producers are
/// notified when it commits.
pub async fn insert_bulk(conn: &mut PgConnection, jobs: &[NewJob]) -> Result<u64, QueueError> {
    Ok(insert_bulk_with(conn, jobs, Notify::InStatement).await?.0)
}

/// [`insert_bulk`], returning the queues that received runnable jobs.
pub(crate) async fn insert_bulk_with(
    conn: &mut PgConnection,
    jobs: &[NewJob],
    notify: Notify,
) -> Result<(u64, Vec<String>), QueueError> {
    for job in jobs {
        job.validate()?;
        if job.unique_key.is_some() {
            return Err(QueueError::InvalidJob(
                "bulk insert does not support unique keys; use insert_many".into(),
            ));
        }
    }
    if jobs.is_empty() {
        return Ok((0, Vec::new()));
    }
    // The database's clock, as the other insert paths' `now()`: this host's clock decides
    // nothing about when a job is due.
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut *conn)
        .await?;
    let mut copy = conn
        .copy_in_raw(
            "COPY fairlane_job (state, kind, queue, args, priority, max_attempts, scheduled_at, metadata) \
             FROM STDIN (FORMAT binary)",
        )
        .await?;
    let mut encoder = CopyEncoder::new();
    let mut runnable_queues: Vec<&str> = Vec::new();
    for job in jobs {
        let scheduled_at = job.scheduled_at.unwrap_or(now);
        let state = if scheduled_at <= now {
            if !runnable_queues.contains(&job.queue.as_str()) {
                runnable_queues.push(job.queue.as_str());
            }
            "available"
        } else {
            "scheduled"
        };
        encoder.begin_row(8);
        encoder.text(state);
        encoder.text(&job.kind);
        encoder.text(job.queue.as_str());
        encoder.jsonb(&job.args)?;
        encoder.int2(job.priority);
        encoder.int2(job.max_attempts);
        encoder.timestamptz(scheduled_at);
        encoder.jsonb_map(&job.metadata)?;
        if encoder.buffered() >= 1 << 20 {
            let chunk = encoder.take();
            if let Err(e) = copy.send(chunk).await {
                let _ = copy.abort("send failed").await;
                return Err(e.into());
            }
        }
    }
    let rest = encoder.finish();
    if let Err(e) = copy.send(rest).await {
        let _ = copy.abort("send failed").await;
        return Err(e.into());
    }
    let written = copy.finish().await?;
    if notify == Notify::InStatement && !runnable_queues.is_empty() {
        sqlx::query("SELECT pg_notify('fairlane_insert', q) FROM unnest($1::text[]) q")
            .bind(&runnable_queues)
            .execute(&mut *conn)
            .await?;
    }
    Ok((
        written,
        runnable_queues.into_iter().map(str::to_owned).collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue() -> QueueName {
        QueueName::new("q").unwrap()
    }

    #[test]
    fn validation_messages() {
        let err = |j: NewJob| j.validate().unwrap_err().to_string();
        let base = NewJob::from_json("k", queue(), serde_json::json!({})).unwrap();
        assert!(err(base.clone().priority(0)).contains("priority must be between 1 and 4"));
        assert!(err(base.clone().max_attempts(0)).contains("max_attempts"));
        assert!(err(base.unique_key("")).contains("unique key"));
        let e = NewJob::from_json("k", queue(), serde_json::json!([1])).unwrap_err();
        assert!(
            e.to_string()
                .contains("must be a JSON object, got an array")
        );
        let e = NewJob::from_json("", queue(), serde_json::json!({})).unwrap_err();
        assert!(e.to_string().contains("kind"));
    }
}
