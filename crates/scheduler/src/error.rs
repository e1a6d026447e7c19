//! Errors of the scheduler library.

use crate::config::InvalidConfig;

/// Why the scheduler, or one of its ticks, failed.
#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    #[error(transparent)]
    Config(#[from] InvalidConfig),
    #[error("could not listen on {addr}: {source}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Queue(#[from] queue::QueueError),
    #[error(transparent)]
    Quota(#[from] quota::QuotaError),
}
