//! The job insert as a part of a caller's statement: for rows that reference new jobs and must
//! commit with them (a quota reservation, a record the job fills), written in the same round
//! trip instead of one statement per table.
//!
//! [`JobsCte`] gives two common table expressions: `fairlane_new_job (ord, id)`, the jobs in
//! input order (1-based) with the ids they get, and `fairlane_inserted_job`, the `INSERT …
//! RETURNING id, queue, state` ([`ComposedJob`]'s columns, not the whole row: the caller has the
//! rest, and decoding every column, JSON included, took half of the caller's own work for the
//! statement).
//! The caller's own data-modifying CTEs join `fairlane_new_job` by ordinal, and its final
//! `SELECT` returns every inserted job in input order:
//! `SELECT j.* FROM fairlane_inserted_job j JOIN fairlane_new_job n USING (id) ORDER BY n.ord`.
//! [`crate::QueueTx::insert_composed`] runs such a statement.
//! The ids are drawn from the table's identity sequence before the insert, which is what lets
//! sibling CTEs (which cannot see each other's rows) know them.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::Arguments;
use sqlx::postgres::PgArguments;

use crate::error::QueueError;
use crate::insert::NewJob;
use crate::job::{JobId, JobState};

/// A job inserted by a composed statement, as [`crate::QueueTx::insert_composed`] returns it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct ComposedJob {
    pub id: JobId,
    pub queue: String,
    /// `available`, or `scheduled` for a job due later.
    pub state: JobState,
}

/// `unnest($first::t1[], $first+1::t2[], …)` over one array parameter per entry of `types`,
/// numbered from `$first`: a statement's parameters listed once, by type, with their numbers
/// derived (the next part of the statement starts at `first + types.len()`).
pub fn unnest_params(first: usize, types: &[&str]) -> String {
    let params: Vec<String> = (first..)
        .zip(types)
        .map(|(n, ty)| format!("${n}::{ty}[]"))
        .collect();
    format!("unnest({})", params.join(", "))
}

/// The element types of [`JobsCte::sql`]'s parameters, in [`JobsCte::bind`]'s order: kind,
/// queue, args, priority, max attempts, scheduled at, metadata.
const JOBS_CTE_TYPES: [&str; 7] = [
    "text",
    "text",
    "jsonb",
    "int2",
    "int2",
    "timestamptz",
    "jsonb",
];

/// The number of parameters [`JobsCte::sql`] uses.
pub const JOBS_CTE_PARAMS: usize = JOBS_CTE_TYPES.len();

/// Jobs to insert within a caller's statement. Unique keys are not supported (a conflict would
/// leave a sibling row without its job); use [`crate::insert::insert_many`] for unique jobs.
#[derive(Debug, Clone, Default)]
pub struct JobsCte {
    kinds: Vec<String>,
    queues: Vec<String>,
    args: Vec<Value>,
    priorities: Vec<i16>,
    max_attempts: Vec<i16>,
    scheduled: Vec<Option<DateTime<Utc>>>,
    metadata: Vec<Value>,
}

impl JobsCte {
    /// Validates `jobs` (as every insert does) and refuses unique keys.
    pub fn new(jobs: Vec<NewJob>) -> Result<Self, QueueError> {
        let mut cte = JobsCte::default();
        for job in jobs {
            job.validate()?;
            if job.unique_key.is_some() {
                return Err(QueueError::InvalidJob(
                    "a job inserted within another statement cannot have a unique key".into(),
                ));
            }
            cte.kinds.push(job.kind);
            cte.queues.push(job.queue.as_str().to_owned());
            cte.args.push(job.args);
            cte.priorities.push(job.priority);
            cte.max_attempts.push(job.max_attempts);
            cte.scheduled.push(job.scheduled_at);
            cte.metadata.push(Value::Object(job.metadata));
        }
        Ok(cte)
    }

    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    /// The two CTEs (without the leading `WITH`), using parameters `$first` to
    /// `$first + JOBS_CTE_PARAMS - 1`. The jobs' sequence is looked up once per statement (an
    /// uncorrelated subquery runs once), not once per row: the look-up costs ten times the
    /// `nextval` itself.
    pub fn sql(first: usize) -> String {
        format!(
            "fairlane_new_job AS ( \
               SELECT nextval((SELECT pg_get_serial_sequence('fairlane_job', 'id')::regclass)) \
                        AS id, t.* \
               FROM {jobs} \
                    WITH ORDINALITY AS t(kind, queue, args, priority, max_attempts, \
                                         scheduled_at, metadata, ord) \
             ), fairlane_inserted_job AS ( \
               INSERT INTO fairlane_job (id, state, kind, queue, args, priority, max_attempts, \
                                         scheduled_at, metadata) \
               OVERRIDING SYSTEM VALUE \
               SELECT n.id, {state}, \
                      n.kind, n.queue, n.args, n.priority, n.max_attempts, \
                      coalesce(n.scheduled_at, now()), n.metadata \
               FROM fairlane_new_job n ORDER BY n.ord \
               RETURNING id, queue, state \
             )",
            jobs = unnest_params(first, &JOBS_CTE_TYPES),
            state = new_job_state_sql!(),
        )
    }

    /// Adds the parameters, in [`JobsCte::sql`]'s order, to `args`.
    pub fn bind(self, args: &mut PgArguments) -> Result<(), QueueError> {
        let bind = |e: sqlx::error::BoxDynError| QueueError::Database(sqlx::Error::Encode(e));
        args.add(self.kinds).map_err(bind)?;
        args.add(self.queues).map_err(bind)?;
        args.add(self.args).map_err(bind)?;
        args.add(self.priorities).map_err(bind)?;
        args.add(self.max_attempts).map_err(bind)?;
        args.add(self.scheduled).map_err(bind)?;
        args.add(self.metadata).map_err(bind)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unnest_params_numbers_one_array_parameter_per_type_from_first() {
        assert_eq!(
            unnest_params(3, &["uuid", "text", "int8"]),
            "unnest($3::uuid[], $4::text[], $5::int8[])"
        );
        assert_eq!(unnest_params(1, &["jsonb"]), "unnest($1::jsonb[])");
    }

    #[test]
    fn the_jobs_cte_uses_exactly_its_parameters() {
        let sql = JobsCte::sql(4);
        assert!(
            sql.contains("$4::text[]") && sql.contains("$10::jsonb[]"),
            "{sql}"
        );
        assert!(!sql.contains("$3") && !sql.contains("$11"), "{sql}");
    }
}
