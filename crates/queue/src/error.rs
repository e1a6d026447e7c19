//! Errors of the queue library.

/// Anything the queue's API can fail with.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
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
}

/// A boxed error from an extension (hook, gate, handler).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

impl QueueError {
    /// Whether the error came from a lost or refused database connection (worth retrying), as
    /// opposed to a query that will fail the same way again.
    pub fn is_connection_error(&self) -> bool {
        match self {
            QueueError::Database(e) => is_connection_error(e),
            _ => false,
        }
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
            // cannot connect now), 53300 (too many connections).
            db.code().is_some_and(|c| {
                c.starts_with("08") || matches!(c.as_ref(), "57P01" | "57P02" | "57P03" | "53300")
            })
        }
        _ => false,
    }
}
