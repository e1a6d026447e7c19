//! The dashboards against real data (issue #7): the services (every package of
//! `deploy_checks::SERVICE_PACKAGES`) run against a test database and process jobs in all six
//! queues, submitted through the API and the queue; a real Prometheus (Debian's `prometheus`)
//! scrapes them with a config derived from the shipped `deploy/prometheus/prometheus.yml` (same
//! scrape jobs and relabelling, targets rewritten to the test ports and labelled with a
//! namespace as on Kubernetes, 1 s interval); then every PromQL expression of every shipped
//! dashboard must parse and return data (for all namespaces and for the scraped one, none for
//! another), every metric and label it names must exist in what was scraped, the alert rules
//! must evaluate, and every metric of SPEC §8 must carry exactly its SPEC labels.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::{Lane, Service};
use queue::NewJob;
use serde_json::{Value, json};
use support::{
    Http, Service as Running, env_names, free_port, start_service, temp_dir, url_encode,
    workspace_root,
};
use testkit::TestDb;
use testkit::process::ChildProcess;

/// What Grafana's built-in variables become for the check (scrapes are 1 s apart here).
const BUILTIN_VARIABLES: [(&str, &str); 4] = [
    ("$__rate_interval", "20s"),
    ("$__interval", "1s"),
    ("$__range", "5m"),
    ("$__auto", "1s"),
];

/// The `namespace` label the check's scrape config gives every series, as Kubernetes service
/// discovery does (deploy/prometheus/kubernetes.yml).
const CHECK_NAMESPACE: &str = "fairlane-check";

/// SPEC §8: metric family → its labels (besides the `job`/`instance` Prometheus adds, the
/// `namespace` of [`CHECK_NAMESPACE`], and `le` on histogram buckets).
const SPEC_METRICS: [(&str, &[&str]); 11] = [
    ("fairlane_queue_jobs", &["queue", "state"]),
    ("fairlane_jobs_total", &["queue", "kind", "outcome"]),
    ("fairlane_job_wait_seconds_bucket", &["queue"]),
    ("fairlane_job_duration_seconds_bucket", &["queue", "kind"]),
    ("fairlane_workers_busy", &["queue"]),
    ("fairlane_workers_max", &["queue"]),
    ("fairlane_fairness_snoozes_total", &["tier"]),
    ("fairlane_quota_rejections_total", &["event_type", "tier"]),
    ("fairlane_quota_reservations_active", &["event_type"]),
    ("fairlane_ratelimit_decisions_total", &["rule", "decision"]),
    (
        "http_server_request_duration_seconds_bucket",
        &["route", "method", "status"],
    ),
];

/// Every setting a test service might take; each binary gets only those it reads.
fn service_env(db: &TestDb) -> Vec<(&'static str, String)> {
    let rules = workspace_root().join("deploy/ratelimit/rules.yaml");
    vec![
        ("DATABASE_URL", db.url()),
        ("RUST_LOG", "warn".into()),
        ("LOG_FORMAT", "json".into()),
        ("ANALYZER_ALLOW_FILE_URLS", "true".into()),
        ("RATELIMIT_RULES", rules.to_string_lossy().into_owned()),
        ("RATELIMIT_ENABLED", "true".into()),
        ("QUOTA_ANALYSIS_FREE_LIMIT", "1".into()),
        ("WORKER_SLEEP_JOBS", "true".into()),
        ("QUEUE_POLL_INTERVAL", "200ms".into()),
        ("QUEUE_PROMOTE_INTERVAL", "200ms".into()),
        ("QUEUE_DEPTH_INTERVAL", "1s".into()),
    ]
}

async fn start_all(http: &Http, db: &TestDb) -> BTreeMap<String, Running> {
    let env = service_env(db);
    let mut running = BTreeMap::new();
    for package in deploy_checks::SERVICE_PACKAGES {
        let reads =
            env_names(package).unwrap_or_else(|| panic!("add {package} to support::env_names"));
        let own: Vec<(&str, String)> = env
            .iter()
            .filter(|(k, _)| reads.contains(*k))
            .cloned()
            .collect();
        running.insert(
            (*package).to_owned(),
            start_service(http, package, &own).await,
        );
    }
    running
}

/// Requests through the API: accepted analyses for a Pro and a Free user (of a repository in
/// `repo_dir`, which must outlive their jobs), a quota rejection, a bad key; returns the ids of
/// the accepted jobs.
async fn use_the_api(http: &Http, db: &TestDb, web: &str, repo_dir: &std::path::Path) -> Vec<i64> {
    let (repository, commit) = support::fixture_repository(repo_dir);
    let mut jobs = Vec::new();
    for (tier, requests) in [("pro", 1), ("free", 2)] {
        let user = web::admin::create_user(
            &db.pool,
            &format!("{tier} user"),
            web::admin::parse_tier(tier).unwrap(),
        )
        .await
        .unwrap();
        let key = web::admin::issue_key(&db.pool, user.id).await.unwrap().key;
        for n in 0..requests {
            // Another commit after the first: the same one, still in flight, would be the
            // answer again (202) instead of a request for more quota.
            let commit = if n == 0 {
                commit.clone()
            } else {
                format!("{n:040x}")
            };
            let r = http
                .post_json(
                    &format!("{web}/v1/analyses"),
                    &key,
                    &json!({"repository": repository, "ref": commit}),
                )
                .await;
            if n == 0 {
                assert_eq!(r.status, 202, "{}", r.text());
                jobs.push(r.json()["job"]["id"].as_i64().unwrap());
            } else {
                assert_eq!(r.status, 429, "the free quota is 1: {}", r.text());
                assert_eq!(r.json()["code"], "quota_exceeded");
            }
        }
    }
    let r = http
        .post_json(&format!("{web}/v1/analyses"), "flk_nope", &json!({}))
        .await;
    assert_eq!(r.status, 401);
    jobs
}

/// `sleep` jobs in every queue, one of them failing for good; returns their ids.
async fn enqueue_sleep_jobs(db: &TestDb) -> Vec<i64> {
    let user: uuid::Uuid = sqlx::query_scalar(
        "INSERT INTO users (name, tier) VALUES ('sleeper', 'enterprise') RETURNING id",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let client = queue::Client::new(db.pool.clone());
    let mut ids = Vec::new();
    for service in Service::ALL {
        for lane in Lane::ALL {
            for (ms, fail) in [(150, false), (50, false), (20, true)] {
                let mut args = json!({"ms": ms, "fail": fail});
                if lane != Lane::Scheduled {
                    args["user_id"] = json!(user);
                }
                let job = NewJob::from_json("sleep", service.queue(lane), args)
                    .unwrap()
                    .max_attempts(1);
                ids.push(client.insert(job).await.unwrap().job.id);
            }
        }
    }
    ids
}

async fn wait_for_jobs(db: &TestDb, finished: &[i64], attempted: &[i64]) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let (unfinished, unattempted): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM fairlane_job WHERE id = ANY($1) AND finalized_at IS NULL), \
                    (SELECT count(*) FROM fairlane_job WHERE id = ANY($2) AND attempt = 0)",
        )
        .bind(finished)
        .bind(attempted)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if unfinished == 0 && unattempted == 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{unfinished} sleep jobs unfinished, {unattempted} API jobs never attempted"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The shipped scrape config with the targets of the running services, labelled with
/// [`CHECK_NAMESPACE`], and a 1 s interval.
fn derived_config(
    running: &BTreeMap<String, Running>,
    dir: &std::path::Path,
) -> std::path::PathBuf {
    let root = workspace_root();
    let mut config: serde_yaml::Value =
        serde_yaml::from_str(&support::read("deploy/prometheus/prometheus.yml")).unwrap();
    config["global"]["scrape_interval"] = "1s".into();
    config["global"]["evaluation_interval"] = "1s".into();
    let rules: Vec<serde_yaml::Value> = config["rule_files"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|r| {
            root.join("deploy/prometheus")
                .join(r.as_str().unwrap())
                .to_string_lossy()
                .into_owned()
                .into()
        })
        .collect();
    config["rule_files"] = rules.into();
    let scrapes = config["scrape_configs"].as_sequence_mut().unwrap();
    let shipped: BTreeSet<String> = scrapes
        .iter()
        .map(|s| s["job_name"].as_str().unwrap().to_owned())
        .collect();
    for name in running.keys() {
        assert!(
            shipped.contains(name),
            "prometheus.yml has no scrape job `{name}`"
        );
    }
    scrapes.retain(|s| running.contains_key(s["job_name"].as_str().unwrap()));
    for scrape in scrapes.iter_mut() {
        let service = &running[scrape["job_name"].as_str().unwrap()];
        let statics = scrape["static_configs"].as_sequence_mut().unwrap();
        assert_eq!(statics.len(), 1);
        statics[0]["targets"] = vec![serde_yaml::Value::from(format!(
            "127.0.0.1:{}",
            service.port
        ))]
        .into();
        // What kubernetes.yml's relabelling adds to every series; the dashboards filter on it.
        let mut labels = serde_yaml::Mapping::new();
        labels.insert("namespace".into(), CHECK_NAMESPACE.into());
        statics[0]["labels"] = labels.into();
    }
    let path = dir.join("prometheus.yml");
    std::fs::write(&path, serde_yaml::to_string(&config).unwrap()).unwrap();
    path
}

struct Prometheus {
    base: String,
    http: Http,
    _child: ChildProcess,
}

impl Prometheus {
    async fn start(http: &Http, config: &std::path::Path, dir: &std::path::Path) -> Prometheus {
        let port = free_port();
        let child = ChildProcess::spawn(
            "prometheus",
            "prometheus",
            &[
                &format!("--config.file={}", config.display()),
                &format!("--storage.tsdb.path={}", dir.join("data").display()),
                &format!("--web.listen-address=127.0.0.1:{port}"),
                "--log.level=warn",
            ],
            &[],
        );
        let base = format!("http://127.0.0.1:{port}");
        http.wait_ok(&format!("{base}/-/ready"), Duration::from_secs(60))
            .await;
        Prometheus {
            base,
            http: http.clone(),
            _child: child,
        }
    }

    async fn api(&self, path_and_query: &str) -> Value {
        let r = self
            .http
            .get(&format!("{}{path_and_query}", self.base))
            .await;
        let body = r.json();
        assert_eq!(body["status"], "success", "{path_and_query}: {body}");
        body["data"].clone()
    }

    /// Runs an instant query; Err with Prometheus' error (a parse error, say) instead of a panic.
    async fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        let r = self
            .http
            .get(&format!(
                "{}/api/v1/query?query={}",
                self.base,
                url_encode(expr)
            ))
            .await;
        let body = r.json();
        if body["status"] != "success" {
            return Err(format!("{}: {}", body["errorType"], body["error"]));
        }
        Ok(body["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// Label names carried by any series of `metric`.
    async fn label_names(&self, metric: &str) -> BTreeSet<String> {
        let series = self
            .api(&format!("/api/v1/series?match[]={}", url_encode(metric)))
            .await;
        series
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|s| s.as_object().unwrap().keys().cloned())
            .collect()
    }
}

/// The dashboard's own variables (their current values, or `picked` for those it names) and
/// Grafana's built-ins, substituted.
fn substitute(dashboard: &Value, expr: &str, picked: &[(&str, &str)]) -> String {
    let mut vars: Vec<(String, String)> = Vec::new();
    for var in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let name = var["name"].as_str().unwrap();
        if let Some((_, value)) = picked.iter().find(|(n, _)| *n == name) {
            vars.push((format!("${{{name}}}"), (*value).to_owned()));
            vars.push((format!("${name}"), (*value).to_owned()));
            continue;
        }
        let current = &var["current"]["value"];
        let all = current
            .as_array()
            .is_some_and(|v| v.iter().any(|x| x == "$__all"))
            || current == "$__all";
        let value = if all {
            var["allValue"]
                .as_str()
                .expect("an All option needs an allValue")
                .to_owned()
        } else {
            current
                .as_str()
                .map(str::to_owned)
                .unwrap_or_else(|| panic!("variable {name} has no current value"))
        };
        vars.push((format!("${{{name}}}"), value.clone()));
        vars.push((format!("${name}"), value));
    }
    let mut text = expr.to_owned();
    for (name, value) in BUILTIN_VARIABLES {
        text = text.replace(name, value);
    }
    // Longest names first, so `$queue_x` is not cut by `$queue`.
    vars.sort_by_key(|(n, _)| std::cmp::Reverse(n.len()));
    for (name, value) in vars {
        text = text.replace(&name, &value);
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_prometheus_scrapes_the_services_and_every_dashboard_query_returns_data() {
    let http = Http::default();
    let db = TestDb::new().await;
    let running = start_all(&http, &db).await;
    let web = running["web"].base.clone();
    let repo_dir = temp_dir("fixture-repo");
    let api_jobs = use_the_api(&http, &db, &web, &repo_dir).await;
    let sleep_jobs = enqueue_sleep_jobs(&db).await;
    wait_for_jobs(&db, &sleep_jobs, &api_jobs).await;
    // Some traffic on every route family, so latency panels have several routes.
    for path in ["/healthz", "/readyz", "/openapi.json", "/v1/usage"] {
        let _ = http.get(&format!("{web}{path}")).await;
    }

    let dir = temp_dir("prometheus");
    let config = derived_config(&running, &dir);
    let prometheus = Prometheus::start(&http, &config, &dir).await;

    // Every target up, and a few scrapes in the bag so rate() has two points.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let targets = prometheus.api("/api/v1/targets?state=active").await;
        let active = targets["activeTargets"].as_array().unwrap();
        let up = active.iter().filter(|t| t["health"] == "up").count();
        if up == running.len() && active.len() == running.len() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "targets not all up: {targets}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tokio::time::sleep(Duration::from_secs(5)).await;

    let scraped: BTreeSet<String> = prometheus
        .api("/api/v1/label/__name__/values")
        .await
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();

    // SPEC §8: every metric, with exactly its labels.
    let mut problems = Vec::new();
    for (metric, labels) in SPEC_METRICS {
        let mut want: BTreeSet<String> = labels.iter().map(|l| (*l).to_owned()).collect();
        want.extend(["__name__", "job", "instance", "namespace"].map(str::to_owned));
        if metric.ends_with("_bucket") {
            want.insert("le".into());
        }
        let series = prometheus
            .api(&format!("/api/v1/series?match[]={}", url_encode(metric)))
            .await;
        let series = series.as_array().unwrap();
        if series.is_empty() {
            problems.push(format!("{metric}: not exported by any service"));
        }
        for s in series {
            let have: BTreeSet<String> = s.as_object().unwrap().keys().cloned().collect();
            if have != want {
                problems.push(format!("{metric}: labels {have:?}, SPEC says {want:?}"));
            }
        }
    }

    // Every dashboard expression: parses, returns data, names only scraped metrics and labels.
    let dashboards_dir = workspace_root().join(deploy_checks::dashboards::DASHBOARD_DIR);
    let mut checked = 0;
    let mut files: Vec<_> = std::fs::read_dir(&dashboards_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for path in files {
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let dashboard: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for var in dashboard["templating"]["list"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if let Some(query) = var["query"]["query"].as_str().or(var["query"].as_str())
                && let Some(inner) = query
                    .strip_prefix("label_values(")
                    .and_then(|q| q.strip_suffix(')'))
            {
                let inner = substitute(&dashboard, inner, &[]);
                let (metric, label) = inner.rsplit_once(',').unwrap();
                if !prometheus
                    .label_names(metric.trim())
                    .await
                    .contains(label.trim())
                {
                    problems.push(format!(
                        "{file}: variable query {query}: no such metric/label"
                    ));
                }
            }
        }
        let unscoped = deploy_checks::dashboards::unscoped_selectors(&dashboard).unwrap();
        if !unscoped.is_empty() {
            problems.push(format!("{file}: not scoped by namespace: {unscoped:?}"));
        }
        for (title, raw) in deploy_checks::dashboards::expressions(&dashboard) {
            checked += 1;
            // The namespace picked: the scraped one gives data, another gives none.
            for (namespace, data) in [(CHECK_NAMESPACE, true), ("elsewhere", false)] {
                let expr = substitute(&dashboard, &raw, &[("namespace", namespace)]);
                match prometheus.query(&expr).await {
                    Ok(result) if result.is_empty() == data => problems.push(format!(
                        "{file} «{title}» in namespace {namespace}: {}: {expr}",
                        if data { "no data" } else { "data" }
                    )),
                    Ok(_) => {}
                    Err(e) => problems.push(format!("{file} «{title}»: {e}: {expr}")),
                }
            }
            let expr = substitute(&dashboard, &raw, &[]);
            let names = match deploy_checks::promql::names(&expr) {
                Ok(n) => n,
                Err(e) => {
                    problems.push(format!("{file} «{title}»: {e}: {expr}"));
                    continue;
                }
            };
            let mut labels_available = BTreeSet::new();
            for metric in &names.metrics {
                if !scraped.contains(metric) {
                    problems.push(format!("{file} «{title}»: metric {metric} is not exported"));
                }
                labels_available.extend(prometheus.label_names(metric).await);
            }
            for label in &names.labels {
                if !labels_available.contains(label) {
                    problems.push(format!(
                        "{file} «{title}»: label {label} is on none of {:?}",
                        names.metrics
                    ));
                }
            }
            match prometheus.query(&expr).await {
                Ok(result) if result.is_empty() => {
                    problems.push(format!("{file} «{title}»: no data: {expr}"));
                }
                Ok(_) => {}
                Err(e) => problems.push(format!("{file} «{title}»: {e}: {expr}")),
            }
        }
    }
    assert!(checked > 7 * 8, "only {checked} expressions found");

    // The alert rules load and evaluate without errors.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let groups = prometheus.api("/api/v1/rules").await;
        let rules: Vec<Value> = groups["groups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["rules"].as_array().unwrap().clone())
            .collect();
        assert!(!rules.is_empty(), "no alert rules loaded");
        if rules.iter().all(|r| r["health"] == "ok") {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            for r in rules.iter().filter(|r| r["health"] != "ok") {
                problems.push(format!(
                    "alert {}: {} {}",
                    r["name"], r["health"], r["lastError"]
                ));
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    assert!(
        problems.is_empty(),
        "{} problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
}
