//! The six per-queue Grafana dashboards, generated from `deploy/grafana/templates/queue.json` by
//! replacing its `@@NAME@@` placeholders. `cargo xtask dashboards` writes them to
//! `deploy/grafana/dashboards/queue-<queue>.json`; a test fails when the committed files differ
//! from what the template gives. Every shipped dashboard is scoped by a `namespace` variable
//! ([`unscoped_selectors`] finds a selector that forgot it).

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

/// The matcher every selector of a shipped dashboard carries, as (label, op, value): the
/// namespaces picked in the `namespace` variable. Its All value is `.*`, which also matches a
/// series without the label (the compose stack's), so one dashboard serves both.
pub const NAMESPACE_MATCHER: (&str, &str, &str) = ("namespace", "=~", "$namespace");

/// Every `expr` of a dashboard (panels and rows' nested panels), with its panel's title.
pub fn expressions(dashboard: &serde_json::Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack: Vec<&serde_json::Value> = dashboard["panels"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    while let Some(panel) = stack.pop() {
        if let Some(nested) = panel["panels"].as_array() {
            stack.extend(nested);
        }
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = target["expr"].as_str() {
                out.push((
                    panel["title"].as_str().unwrap_or("?").to_owned(),
                    expr.to_owned(),
                ));
            }
        }
    }
    out
}

/// The queries of `dashboard` (its panels' expressions and its variables' `label_values(…)`)
/// with a selector that lacks [`NAMESPACE_MATCHER`], each as `«where»: expression`. Such a
/// panel would add up every namespace's series whatever the viewer picked.
pub fn unscoped_selectors(
    dashboard: &serde_json::Value,
) -> Result<Vec<String>, crate::promql::PromqlError> {
    let (label, op, value) = NAMESPACE_MATCHER;
    let mut queries = expressions(dashboard);
    let mut unscoped_forms = Vec::new();
    for var in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        // The namespace variable lists the namespaces; it cannot be scoped by itself. Other
        // kinds (custom, interval, …) query nothing.
        if var["type"] != "query" || var["name"] == "namespace" {
            continue;
        }
        let place = format!("variable {}", var["name"].as_str().unwrap_or("?"));
        let query = var["query"]["query"]
            .as_str()
            .or(var["query"].as_str())
            .unwrap_or_default();
        match query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .and_then(|inner| inner.rsplit_once(','))
        {
            Some((metric, _)) => queries.push((place, metric.trim().to_owned())),
            // `label_values(label)`, `query_result(…)`, …: not read here, so not passed.
            None => unscoped_forms.push(format!("«{place}»: a query form not checked: {query}")),
        }
    }
    let mut unscoped = unscoped_forms;
    for (place, query) in queries {
        let selectors = crate::promql::selectors(&query)?;
        if selectors
            .iter()
            .any(|s| !s.matchers.iter().any(|m| m.is(label, op, value)))
        {
            unscoped.push(format!("«{place}»: {query}"));
        }
    }
    Ok(unscoped)
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

    fn shipped_dashboards() -> Vec<(String, serde_json::Value)> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(DASHBOARD_DIR);
        let mut found: Vec<(String, serde_json::Value)> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| {
                let path = e.unwrap().path();
                let text = std::fs::read_to_string(&path).unwrap();
                (
                    path.file_name().unwrap().to_string_lossy().into_owned(),
                    serde_json::from_str(&text).unwrap(),
                )
            })
            .collect();
        found.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(found.len(), QUEUE_DASHBOARDS.len() + 1, "{found:?}");
        found
    }

    #[test]
    fn every_shipped_query_is_scoped_by_the_namespace_variable() {
        for (file, dashboard) in shipped_dashboards() {
            let vars = dashboard["templating"]["list"].as_array().unwrap();
            let namespace = vars
                .iter()
                .find(|v| v["name"] == "namespace")
                .unwrap_or_else(|| panic!("{file}: no namespace variable"));
            // All must also match series without the label (the compose stack's), and be
            // what a dashboard opens with.
            assert_eq!(namespace["includeAll"], true, "{file}");
            assert_eq!(namespace["allValue"], ".*", "{file}");
            assert_eq!(namespace["current"]["value"][0], "$__all", "{file}");
            assert!(expressions(&dashboard).len() >= 8, "{file}");
            let unscoped = unscoped_selectors(&dashboard).unwrap();
            assert!(unscoped.is_empty(), "{file}: {unscoped:#?}");
        }
    }

    #[test]
    fn a_selector_without_the_namespace_matcher_is_found() {
        let dashboard = serde_json::json!({
            "templating": {"list": [
                {"name": "namespace", "type": "query",
                 "query": {"query": "label_values(up, namespace)"}},
                {"name": "queue", "type": "query",
                 "query": {"query": "label_values(fairlane_workers_max, queue)"}},
                {"name": "kind", "type": "query", "query": {"query": "label_values(kind)"}},
                {"name": "step", "type": "interval", "query": "1m,5m"}
            ]},
            "panels": [
                {"title": "scoped", "targets": [
                    {"expr": "sum(a{namespace=~\"$namespace\"}) / sum(b{namespace=~\"$namespace\", q=\"x\"}) > Inf or NaN"}
                ]},
                {"title": "row", "panels": [
                    {"title": "half", "targets": [
                        {"expr": "a{namespace=~\"$namespace\"} / b{namespace=\"$namespace\"}"}
                    ]}
                ]}
            ]
        });
        let unscoped = unscoped_selectors(&dashboard).unwrap();
        assert_eq!(
            unscoped,
            vec![
                "«variable kind»: a query form not checked: label_values(kind)".to_owned(),
                "«half»: a{namespace=~\"$namespace\"} / b{namespace=\"$namespace\"}".to_owned(),
                "«variable queue»: fairlane_workers_max".to_owned(),
            ]
        );
    }

    #[test]
    fn uids_fit_grafana_and_are_distinct() {
        let uids: std::collections::BTreeSet<String> =
            QUEUE_DASHBOARDS.iter().map(QueueDashboard::uid).collect();
        assert_eq!(uids.len(), 6);
        assert!(uids.iter().all(|u| u.len() <= 40), "{uids:?}");
    }
}
