//! Errors of the queue library.

/// Anything the queue's API can fail with.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The database gave no answer within the engine's `database_timeout`; the connection was
    /// closed.
    #[error("the database gave no answer within {0:?}; the connection was closed")]
    Unanswered(std::time::Duration),
    #[error("invalid job: {0}")]
    InvalidJob(String),
    #[error("job arguments could not be encoded as JSON: {0}")]
    Args(#[from] serde_json::Error),
    #[error("invalid queue configuration: {0}")]
    Config(String),
    #[error(
        "unique insert of key `{0}` kept racing with the matching job finishing; retry the insert"
    )]
    UniqueRace(String),
    #[error("a transition hook failed: {0}")]
    Hook(#[source] BoxError),
    #[error("the fetch gate failed: {0}")]
    Gate(#[source] BoxError),
    #[error(
        "the engine's completer stopped (a transition hook panicked); the engine stopped, and its running jobs are left to the rescuer"
    )]
    CompleterStopped,
    #[error(
        "a background task of the engine (heartbeat, maintenance, leader election or notifier) panicked, a transition hook most likely; the engine shut down"
    )]
    BackgroundTaskPanicked,
}

/// A boxed error from an extension (hook, gate, handler).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

impl QueueError {
    /// Whether the error came from a lost or refused database connection (worth retrying), as
    /// opposed to a query that will fail the same way again.
    pub fn is_connection_error(&self) -> bool {
        match self {
            QueueError::Database(e) => is_connection_error(e),
            QueueError::Unanswered(_) => true,
            _ => false,
        }
    }

    /// Whether the same statements may well succeed when tried again: the connection failed, or
    /// the transaction lost a conflict (serialization failure, deadlock, a lock or statement
    /// timeout), also when a hook or the gate met it. Anything else is the database refusing
    /// this particular work, and will refuse it again.
    pub fn is_transient(&self) -> bool {
        matches!(self, QueueError::Unanswered(_))
            || self
                .database_error()
                .is_some_and(|e| is_connection_error(e) || is_lost_conflict(e))
    }

    /// Whether the work ran too long: the database cancelled a statement (57014: past
    /// `statement_timeout`, or a cancel request, which the code alone cannot tell apart and whose
    /// message is in the server's language), or gave no answer within the engine's deadline.
    pub fn is_cut_short(&self) -> bool {
        matches!(self, QueueError::Unanswered(_))
            || self
                .database_error()
                .and_then(sqlx::Error::as_database_error)
                .is_some_and(|db| db.code().as_deref() == Some("57014"))
    }

    /// The database's error behind this one, if any: the queue's own statements', or a hook's or
    /// gate's that came from the database.
    pub fn database_error(&self) -> Option<&sqlx::Error> {
        match self {
            QueueError::Database(e) => Some(e),
            QueueError::Hook(e) | QueueError::Gate(e) => e.downcast_ref::<sqlx::Error>(),
            _ => None,
        }
    }
}

/// Class 40 (transaction rollback: serialization failure, deadlock), 55P03 (lock not available)
/// and 57014 (statement timeout or cancel); and states of the server that pass whatever the
/// statement: 53100 (disk full), 58030 (I/O error) and 25006 (a read-only transaction: a standby
/// during a failover, or `default_transaction_read_only` while an operator works). Out of memory
/// (53200, also "out of shared memory") and a configuration limit (53400) can be this
/// statement's own doing, so they stay refusals: the completer then splits the batch instead of
/// retrying it for ever.
fn is_lost_conflict(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            c.starts_with("40")
                || matches!(c.as_ref(), "55P03" | "57014" | "53100" | "58030" | "25006")
        }),
        _ => false,
    }
}

/// Whether a sqlx error means the connection (not the statement) failed.
pub fn is_connection_error(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Tls(_) => true,
        sqlx::Error::Database(db) => {
            // Class 08 (connection exception), 57P01-57P03 (admin shutdown, crash shutdown,
            // cannot connect now), 57P05 (idle session timeout), 25P03 (idle in transaction
            // timeout: the server ended the session), 53300 (too many connections).
            db.code().is_some_and(|c| {
                c.starts_with("08")
                    || matches!(
                        c.as_ref(),
                        "57P01" | "57P02" | "57P03" | "57P05" | "25P03" | "53300"
                    )
            })
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use testkit::TestDb;

    async fn error_of(pool: &sqlx::PgPool, sql: &str) -> QueueError {
        error_after(pool, "SET LOCAL statement_timeout = '50ms'", sql).await
    }

    /// The error of `sql`, run in a transaction after `setup`.
    async fn error_after(pool: &sqlx::PgPool, setup: &str, sql: &str) -> QueueError {
        let mut tx = pool.begin().await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(setup.to_owned()))
            .execute(&mut *tx)
            .await
            .unwrap();
        QueueError::Database(
            sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
                .execute(&mut *tx)
                .await
                .unwrap_err(),
        )
    }

    /// A PL/pgSQL block that fails with SQLSTATE condition `state`.
    fn raising(state: &str) -> String {
        format!("DO $$ BEGIN RAISE EXCEPTION 'failed' USING ERRCODE = '{state}'; END $$")
    }

    #[tokio::test]
    async fn timeouts_and_lost_connections_are_transient_refusals_are_not() {
        let db = TestDb::new().await;
        assert!(
            error_of(&db.pool, "SELECT pg_sleep(1)")
                .await
                .is_transient()
        );
        assert!(!error_of(&db.pool, "SELECT 1/0").await.is_transient());
        assert!(
            !error_of(&db.pool, "SELECT '{\"a\":\"\\u0000\"}'::jsonb")
                .await
                .is_transient()
        );
        let refused = error_of(&db.pool, "SELECT 1/0").await;
        let QueueError::Database(refused) = refused else {
            unreachable!()
        };
        assert!(!QueueError::Hook(Box::new(refused)).is_transient());
        assert!(QueueError::Hook(Box::new(sqlx::Error::PoolTimedOut)).is_transient());
        assert!(QueueError::Database(sqlx::Error::PoolClosed).is_transient());
        assert!(!QueueError::InvalidJob("no".into()).is_transient());
    }

    /// A statement cut short (by `statement_timeout` or a cancel request) and a try the engine
    /// gave up waiting for are cut short, also when a hook's error carries them; a lock timeout
    /// and a refusal are not.
    #[tokio::test]
    async fn work_cut_short_is_told_from_a_lock_timeout_and_a_refusal() {
        let db = TestDb::new().await;
        let timed_out = error_of(&db.pool, "SELECT pg_sleep(1)").await;
        assert!(timed_out.is_cut_short(), "{timed_out}");
        let QueueError::Database(timed_out) = timed_out else {
            unreachable!()
        };
        assert!(QueueError::Hook(Box::new(timed_out)).is_cut_short());
        let cancelled = error_after(&db.pool, "SELECT 1", &raising("57014")).await;
        assert!(cancelled.is_transient() && cancelled.is_cut_short());
        let unanswered = QueueError::Unanswered(std::time::Duration::from_secs(60));
        assert!(unanswered.is_transient() && unanswered.is_cut_short());
        let lock = error_after(&db.pool, "SELECT 1", &raising("55P03")).await;
        assert!(lock.is_transient() && !lock.is_cut_short());
        assert!(!error_of(&db.pool, "SELECT 1/0").await.is_cut_short());
    }

    /// A server that passes through a failover (read-only), a full disk or an I/O error refuses
    /// every statement for a while: retried, not recorded as the job's failure. Out of memory can
    /// be the statement's own doing (a batch that takes too many locks): a refusal.
    #[tokio::test]
    async fn a_server_that_is_read_only_out_of_disk_or_failing_io_is_transient() {
        let db = TestDb::new().await;
        let read_only = error_after(
            &db.pool,
            "SET LOCAL transaction_read_only = on",
            "CREATE TABLE read_only_probe (x int)",
        )
        .await;
        assert!(read_only.is_transient(), "{read_only}");
        for state in ["disk_full", "io_error"] {
            assert!(
                error_of(&db.pool, &raising(state)).await.is_transient(),
                "{state}"
            );
        }
        for state in [
            "out_of_memory",
            "configuration_limit_exceeded",
            "undefined_file",
            "check_violation",
            "invalid_text_representation",
        ] {
            assert!(
                !error_of(&db.pool, &raising(state)).await.is_transient(),
                "{state}"
            );
        }
    }
}
