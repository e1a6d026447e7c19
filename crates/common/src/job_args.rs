//! Job argument types shared by the service that enqueues a job and the worker that runs it.
//!
//! Every user-originated job carries `user_id` at the top level of its JSON arguments: the queue
//! indexes it, fairness counts running jobs by it, and a job without one is a system job.

use serde::{Serialize, de::DeserializeOwned};
use uuid::Uuid;

/// Arguments of one job kind. `KIND` is stored in the job row and selects the handler.
pub trait JobArgs: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The job kind, e.g. `analysis`.
    const KIND: &'static str;
}

/// Inventory the tests of a repository at a ref.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AnalysisArgs {
    /// The requesting user; `None` for scheduler-driven re-analysis (a system job).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_id: Option<Uuid>,
    /// The analysis record this job fills in.
    pub analysis_id: Uuid,
    /// The repository URL as submitted (already validated by whoever enqueued it).
    pub repository: String,
    /// Branch, tag or commit; `None` means the remote's default branch.
    #[serde(default, rename = "ref", skip_serializing_if = "Option::is_none")]
    pub git_ref: Option<String>,
}

impl JobArgs for AnalysisArgs {
    const KIND: &'static str = "analysis";
}

/// Turn a finished analysis into a behaviour specification.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SpecviewArgs {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_id: Option<Uuid>,
    /// The specview record this job fills in.
    pub specview_id: Uuid,
    /// The analysis it is generated from.
    pub analysis_id: Uuid,
}

impl JobArgs for SpecviewArgs {
    const KIND: &'static str = "specview";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_id_is_a_top_level_field_and_omitted_for_system_jobs() {
        let id = Uuid::nil();
        let user = AnalysisArgs {
            user_id: Some(id),
            analysis_id: id,
            repository: "https://example.com/r.git".into(),
            git_ref: Some("main".into()),
        };
        let v = serde_json::to_value(&user).unwrap();
        assert_eq!(v["user_id"], id.to_string());
        assert_eq!(v["ref"], "main");

        let system = AnalysisArgs {
            user_id: None,
            ..user
        };
        let v = serde_json::to_value(&system).unwrap();
        assert!(v.get("user_id").is_none());
        let back: AnalysisArgs = serde_json::from_value(v).unwrap();
        assert_eq!(back, system);
    }
}
