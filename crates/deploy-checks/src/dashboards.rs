//! The six per-queue Grafana dashboards, generated from `deploy/grafana/templates/queue.json` by
//! replacing its `@@NAME@@` placeholders. `cargo xtask dashboards` writes them to
//! `deploy/grafana/dashboards/queue-<queue>.json`; a test fails when the committed files differ
//! from what the template gives.

use std::path::{Path, PathBuf};

/// Where the template lives, relative to the workspace root.
pub const TEMPLATE: &str = "deploy/grafana/templates/queue.json";
/// Where the dashboards Grafana loads live, relative to the workspace root.
pub const DASHBOARD_DIR: &str = "deploy/grafana/dashboards";

/// One queue's dashboard: the values the template's placeholders take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueDashboard {
    /// `@@QUEUE@@`, e.g. `analysis_priority`.
    pub queue: &'static str,
    /// `@@SERVICE@@`: the worker service's name in queue names and metrics (`analysis`).
    pub service: &'static str,
    /// `@@WORKER_JOB@@`: the Prometheus scrape job of the binary that works the queue.
    pub worker_job: &'static str,
    /// `@@LANE@@`: a short description of who lands in the lane.
    pub lane: &'static str,
}

impl QueueDashboard {
    /// `@@UID@@`: stable, so links and bookmarks survive regeneration.
    pub fn uid(&self) -> String {
        format!("fairlane-queue-{}", self.queue.replace('_', "-"))
    }

    pub fn file_name(&self) -> String {
        format!("queue-{}.json", self.queue)
    }
}

const PRIORITY: &str = "priority lane: Pro, Pro Plus and Enterprise users";
const DEFAULT: &str = "default lane: Free users";
const SCHEDULED: &str = "scheduled lane: background jobs from the scheduler";

/// Every queue of SPEC §2, in the order services × lanes.
pub const QUEUE_DASHBOARDS: [QueueDashboard; 6] = [
    QueueDashboard {
        queue: "analysis_priority",
        service: "analysis",
        worker_job: "analyzer-worker",
        lane: PRIORITY,
    },
    QueueDashboard {
        queue: "analysis_default",
        service: "analysis",
        worker_job: "analyzer-worker",
        lane: DEFAULT,
    },
    QueueDashboard {
        queue: "analysis_scheduled",
        service: "analysis",
        worker_job: "analyzer-worker",
        lane: SCHEDULED,
    },
    QueueDashboard {
        queue: "specview_priority",
        service: "specview",
        worker_job: "specgen-worker",
        lane: PRIORITY,
    },
    QueueDashboard {
        queue: "specview_default",
        service: "specview",
        worker_job: "specgen-worker",
        lane: DEFAULT,
    },
    QueueDashboard {
        queue: "specview_scheduled",
        service: "specview",
        worker_job: "specgen-worker",
        lane: SCHEDULED,
    },
];

/// Why the dashboards could not be generated.
#[derive(Debug, thiserror::Error)]
pub enum DashboardError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the template leaves placeholders unreplaced: {0}")]
    Unreplaced(String),
    #[error("the generated dashboard for {queue} is not JSON: {source}")]
    Json {
        queue: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

/// The template with `dashboard`'s values filled in.
pub fn render(template: &str, dashboard: &QueueDashboard) -> Result<String, DashboardError> {
    let text = template
        .replace("@@UID@@", &dashboard.uid())
        .replace("@@QUEUE@@", dashboard.queue)
        .replace("@@SERVICE@@", dashboard.service)
        .replace("@@WORKER_JOB@@", dashboard.worker_job)
        .replace("@@LANE@@", dashboard.lane);
    if let Some(start) = text.find("@@") {
        let rest = &text[start..];
        let end = rest[2..].find("@@").map_or(rest.len(), |i| i + 4);
        return Err(DashboardError::Unreplaced(rest[..end].to_owned()));
    }
    serde_json::from_str::<serde_json::Value>(&text).map_err(|source| DashboardError::Json {
        queue: dashboard.queue,
        source,
    })?;
    Ok(text)
}

/// Every generated dashboard as (path relative to `root`, contents).
pub fn generate(root: &Path) -> Result<Vec<(PathBuf, String)>, DashboardError> {
    let template_path = root.join(TEMPLATE);
    let template =
        std::fs::read_to_string(&template_path).map_err(|source| DashboardError::Io {
            path: template_path,
            source,
        })?;
    QUEUE_DASHBOARDS
        .iter()
        .map(|d| {
            Ok((
                Path::new(DASHBOARD_DIR).join(d.file_name()),
                render(&template, d)?,
            ))
        })
        .collect()
}

/// Writes the generated dashboards under `root`; returns the paths written.
pub fn write(root: &Path) -> Result<Vec<PathBuf>, DashboardError> {
    let mut written = Vec::new();
    for (path, text) in generate(root)? {
        let full = root.join(&path);
        std::fs::write(&full, text).map_err(|source| DashboardError::Io { path: full, source })?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_replaced_and_uids_are_stable() {
        let template = r#"{"uid": "@@UID@@", "title": "@@QUEUE@@ (@@LANE@@)", "job": "@@WORKER_JOB@@", "s": "@@SERVICE@@"}"#;
        let text = render(template, &QUEUE_DASHBOARDS[3]).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["uid"], "fairlane-queue-specview-priority");
        assert_eq!(v["job"], "specgen-worker");
        assert_eq!(v["s"], "specview");
        assert!(
            v["title"]
                .as_str()
                .unwrap()
                .starts_with("specview_priority (priority lane")
        );
    }

    #[test]
    fn unknown_placeholders_and_broken_json_are_refused() {
        let err = render(r#"{"a": "@@NOPE@@"}"#, &QUEUE_DASHBOARDS[0]).unwrap_err();
        assert!(err.to_string().contains("@@NOPE@@"), "{err}");
        assert!(render(r#"{"a": "@@QUEUE@@""#, &QUEUE_DASHBOARDS[0]).is_err());
    }

    #[test]
    fn uids_fit_grafana_and_are_distinct() {
        let uids: std::collections::BTreeSet<String> =
            QUEUE_DASHBOARDS.iter().map(QueueDashboard::uid).collect();
        assert_eq!(uids.len(), 6);
        assert!(uids.iter().all(|u| u.len() <= 40), "{uids:?}");
    }
}
