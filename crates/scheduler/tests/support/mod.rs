//! Shared helpers for the scheduler's tests: real `scheduler` processes on free ports with
//! second-resolution schedules, a tiny HTTP client, Prometheus text parsing, and the rows the
//! scheduler writes.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgPool;
use testkit::process::ChildProcess;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub const BIN: &str = env!("CARGO_BIN_EXE_scheduler");

/// A free loopback port (bound and released; a tiny race, acceptable in tests).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Settings that make a scheduler act every second and notice everything within milliseconds.
pub fn fast_env(database_url: &str) -> Vec<(&'static str, String)> {
    vec![
        ("DATABASE_URL", database_url.to_owned()),
        ("LOG_FORMAT", "pretty".into()),
        ("RUST_LOG", "warn".into()),
        ("SCHEDULER_LEASE_TTL", "2s".into()),
        ("REANALYZE_SCHEDULE", "* * * * * *".into()),
        ("REANALYZE_AFTER", "1h".into()),
        ("REANALYZE_BATCH", "1".into()),
        ("RESERVATION_CLEANUP_SCHEDULE", "* * * * * *".into()),
        ("QUEUE_DEPTH_INTERVAL", "200ms".into()),
        ("QUEUE_DEPTH_FINAL_INTERVAL", "200ms".into()),
        ("QUEUE_HEARTBEAT_INTERVAL", "300ms".into()),
        ("QUEUE_RESCUE_AFTER", "2s".into()),
        ("QUEUE_RESCUE_INTERVAL", "300ms".into()),
        ("QUEUE_PROMOTE_INTERVAL", "100ms".into()),
        ("QUEUE_LEADER_TTL", "1s".into()),
    ]
}

/// A scheduler child process and its HTTP port.
pub struct Scheduler {
    pub child: ChildProcess,
    pub port: u16,
}

impl Scheduler {
    /// Spawns a scheduler with [`fast_env`] overridden by `extra`.
    pub fn spawn(name: &str, database_url: &str, extra: &[(&'static str, &str)]) -> Scheduler {
        let port = free_port();
        let mut env = fast_env(database_url);
        env.push(("HTTP_ADDR", format!("127.0.0.1:{port}")));
        for (k, v) in extra {
            env.retain(|(name, _)| name != k);
            env.push((k, (*v).to_owned()));
        }
        let child = ChildProcess::spawn(name, BIN, &[], &env);
        Scheduler { child, port }
    }

    pub async fn get(&self, path: &str) -> Option<(u16, String)> {
        http_get(self.port, path).await
    }

    /// `/status` once the HTTP server answers.
    pub async fn status(&self) -> Value {
        let (code, body) = eventually(Duration::from_secs(30), "scheduler answers", || async {
            self.get("/status").await
        })
        .await;
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }

    pub async fn candidate_id(&self) -> String {
        self.status().await["candidate_id"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    /// Waits until the scheduler campaigns (schema found).
    pub async fn wait_running(&self) -> String {
        eventually(Duration::from_secs(30), "scheduler running", || async {
            let s = self.status().await;
            (s["running"] == true).then(|| s["candidate_id"].as_str().unwrap().to_owned())
        })
        .await
    }

    pub async fn metrics(&self) -> Vec<Sample> {
        let (code, body) = self.get("/metrics").await.expect("metrics answer");
        assert_eq!(code, 200);
        parse_prometheus(&body)
    }
}

/// `GET path` on 127.0.0.1:port; `None` if nothing answers.
pub async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let request = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
        stream.write_all(req.as_bytes()).await.ok()?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.ok()?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = text.split_once("\r\n\r\n")?;
        let code = head.split_whitespace().nth(1)?.parse().ok()?;
        // Bodies may be chunked; ours are small and only read for content, so undo chunking.
        let chunked = head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked");
        let body = if chunked {
            dechunk(body)
        } else {
            body.to_owned()
        };
        Some((code, body))
    };
    tokio::time::timeout(Duration::from_secs(5), request)
        .await
        .ok()
        .flatten()
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// One Prometheus sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

pub fn parse_prometheus(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => (name, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        let mut map = BTreeMap::new();
        for pair in split_labels(labels) {
            if let Some((k, v)) = pair.split_once('=') {
                map.insert(k.to_owned(), v.trim_matches('"').to_owned());
            }
        }
        out.push(Sample {
            name: name.to_owned(),
            labels: map,
            value,
        });
    }
    out
}

fn split_labels(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut start = 0;
    let mut quoted = false;
    for (i, c) in s.char_indices() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if start < s.len() {
        parts.push(&s[start..]);
    }
    parts
}

pub use testkit::eventually;

/// One claimed tick.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Tick {
    pub tick_at: DateTime<Utc>,
    pub claimed_by: String,
    pub claimed_at: DateTime<Utc>,
    pub result: Option<Value>,
}

pub async fn ticks(pool: &PgPool, task: &str) -> Vec<Tick> {
    sqlx::query_as(
        "SELECT tick_at, claimed_by, claimed_at, result FROM scheduler_ticks \
         WHERE task = $1 ORDER BY tick_at",
    )
    .bind(task)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Repositories whose only analysis completed long ago (`n` of them, the stalest first by name
/// order: `repo-000` is the oldest).
pub async fn seed_stale_repositories(pool: &PgPool, n: i32) {
    sqlx::query(
        "INSERT INTO analyses (repository, commit, state, result, created_at, completed_at) \
         SELECT format('https://example.test/r/repo-%s.git', lpad(i::text, 3, '0')), \
                md5(i::text), 'completed', '{}', \
                now() - interval '30 days' - make_interval(mins => $1 - i), \
                now() - interval '30 days' - make_interval(mins => $1 - i) \
         FROM generate_series(0, $1 - 1) AS i",
    )
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

/// A re-analysis job as the scheduler enqueued it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ReanalysisJob {
    pub id: i64,
    pub queue: String,
    pub kind: String,
    pub args: Value,
    pub unique_key: Option<String>,
    pub tick_at: Option<String>,
}

pub async fn reanalysis_jobs(pool: &PgPool) -> Vec<ReanalysisJob> {
    sqlx::query_as(
        "SELECT id, queue::text, kind::text, args::jsonb AS args, unique_key, \
                metadata -> 'scheduler' ->> 'tick_at' AS tick_at \
         FROM fairlane_job WHERE unique_key LIKE 'reanalyze:%' ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The database's clock now (to compare with `claimed_at`).
pub async fn db_now(pool: &PgPool) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// An `analyses` row: id, user, repository, requested ref, commit, state, job.
type AnalysisRow = (
    uuid::Uuid,
    Option<uuid::Uuid>,
    String,
    Option<String>,
    Option<String>,
    String,
    Option<i64>,
);

/// Checks the invariants every run must keep: the ticks of `task` are consecutive seconds (none
/// missed), each claimed once, and for re-analysis each tick enqueued exactly one job (batch 1)
/// whose `analyses` row exists as a system row. Returns the ticks.
pub async fn assert_each_tick_once(pool: &PgPool) -> Vec<Tick> {
    let ticks = ticks(pool, "reanalyze").await;
    assert!(!ticks.is_empty(), "no re-analysis tick happened");
    for pair in ticks.windows(2) {
        assert_eq!(
            pair[1].tick_at - pair[0].tick_at,
            chrono::Duration::seconds(1),
            "a tick was missed between {} and {}",
            pair[0].tick_at,
            pair[1].tick_at
        );
    }
    let jobs = reanalysis_jobs(pool).await;
    let mut per_tick: BTreeMap<DateTime<Utc>, usize> = BTreeMap::new();
    for job in &jobs {
        let at: DateTime<Utc> = job.tick_at.as_deref().unwrap().parse().unwrap();
        *per_tick.entry(at).or_default() += 1;
    }
    for tick in &ticks {
        assert_eq!(
            per_tick.remove(&tick.tick_at),
            Some(1),
            "tick {} must have enqueued exactly one job",
            tick.tick_at
        );
        assert_eq!(tick.result.as_ref().unwrap()["enqueued"], 1, "{tick:?}");
    }
    assert!(
        per_tick.is_empty(),
        "jobs of ticks that were never claimed: {per_tick:?}"
    );
    // Every job is a system re-analysis with its analyses row; no row without a job.
    let rows: Vec<AnalysisRow> = sqlx::query_as(
        "SELECT id, user_id, repository, requested_ref, commit, state::text, job_id \
             FROM analyses WHERE state = 'pending'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), jobs.len(), "one analyses row per job");
    let mut repositories = std::collections::BTreeSet::new();
    for job in &jobs {
        assert_eq!(job.queue, "analysis_scheduled");
        assert_eq!(job.kind, "analysis");
        let args: common::AnalysisArgs = serde_json::from_value(job.args.clone()).unwrap();
        assert_eq!(args.user_id, None);
        assert_eq!(args.git_ref, None);
        assert!(job.args.get("user_id").is_none() && job.args.get("ref").is_none());
        assert_eq!(
            job.unique_key.as_deref(),
            Some(format!("reanalyze:{}", args.repository).as_str())
        );
        assert!(repositories.insert(args.repository.clone()), "queued twice");
        let row = rows.iter().find(|r| r.0 == args.analysis_id).unwrap();
        assert_eq!(row.1, None, "system analysis: no user");
        assert_eq!(row.2, args.repository);
        assert_eq!(row.3, None, "no requested ref");
        assert_eq!(row.4, None, "the worker resolves the commit");
        assert_eq!(row.6, Some(job.id));
    }
    ticks
}

pub async fn current_leader(pool: &PgPool) -> Option<String> {
    sqlx::query_scalar(
        "SELECT leader_id FROM fairlane_leader WHERE name = 'scheduler' AND expires_at > now()",
    )
    .fetch_optional(pool)
    .await
    .unwrap()
}

/// Makes `holder` the `scheduler` lease holder, its lease valid for an hour or already expired.
pub async fn lease(pool: &PgPool, holder: &str, valid: bool) {
    sqlx::query(
        "INSERT INTO fairlane_leader (name, leader_id, expires_at) \
         VALUES ('scheduler', $1, now() + CASE WHEN $2 THEN interval '1 hour' ELSE interval '-1 second' END) \
         ON CONFLICT (name) DO UPDATE SET leader_id = EXCLUDED.leader_id, expires_at = EXCLUDED.expires_at",
    )
    .bind(holder)
    .bind(valid)
    .execute(pool)
    .await
    .unwrap();
}
