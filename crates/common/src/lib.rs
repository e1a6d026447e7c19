//! Fairlane's shared vocabulary: tiers, services and lanes, queue names and routing, job argument
//! types, the layered configuration loader every binary uses, and the one-line form in which a
//! binary reports why it stopped.
//!
//! Everything here is pure (no I/O except reading a config file) so that the rules it encodes —
//! which queue a request lands in, which names are valid — can be tested alone.

pub mod config;
pub mod job_args;
pub mod queue_name;
pub mod report;
pub mod routing;
pub mod tier;

pub use job_args::{AnalysisArgs, JobArgs, SpecviewArgs};
pub use queue_name::{QueueName, QueueNameError};
pub use routing::{Lane, Service, select_queue};
pub use tier::{Tier, UnknownTier};
