//! The `specview` job: turns a completed analysis into a behaviour specification (test names as
//! sentences, grouped by file and suite) and stages it on its `specviews` record — structured as
//! JSON and rendered as Markdown — which [`records::RecordHook`] completes (or fails) in the
//! job's final transaction.
//!
//! A specview of an analysis that is not completed, or whose result cannot be read, cannot
//! succeed by retrying: the job is cancelled for good with the reason as the record's error.

use async_trait::async_trait;
use common::SpecviewArgs;
use inventory::Spec;
use queue::{JobContext, JobError, Worker};
use records::WorkState;
use records::specviews::SpecviewRecord;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

/// What a specview stores as `result`: the specification and where it comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecviewResult {
    pub analysis_id: Uuid,
    /// The normalised repository URL.
    pub repository: String,
    /// The commit the analysis inventoried.
    pub commit: String,
    /// Files, suites and behaviours with their sentences, and the counts.
    #[serde(flatten)]
    pub spec: Spec,
}

/// What a completed `specview` job reports as its output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecviewOutput {
    pub specview_id: Uuid,
    pub analysis_id: Uuid,
    pub files: u64,
    pub behaviours: u64,
}

/// The handler of `specview` jobs.
#[derive(Debug, Clone)]
pub struct SpecviewWorker {
    pool: PgPool,
}

impl SpecviewWorker {
    pub fn new(pool: PgPool) -> Self {
        SpecviewWorker { pool }
    }
}

#[async_trait]
impl Worker<SpecviewArgs> for SpecviewWorker {
    async fn work(&self, ctx: &JobContext, args: SpecviewArgs) -> Result<(), JobError> {
        // A user's cancel, the job's timeout or a shutdown ends the job here, whatever step it
        // is at: nothing is staged after it, so nothing is billed. A rendering already started
        // runs to its end on its blocking thread (the inventory's caps bound it) and is dropped.
        ctx.unless_stopped(
            "stopped before the specview was stored",
            self.render(ctx, args),
        )
        .await
    }
}

impl SpecviewWorker {
    async fn render(&self, ctx: &JobContext, args: SpecviewArgs) -> Result<(), JobError> {
        let job_id = ctx.id();
        let record = records::specviews::claim(&self.pool, args.specview_id, job_id)
            .await?
            .map_err(|refusal| {
                JobError::Cancel(format!("specview {} {refusal}", args.specview_id))
            })?;
        let specview_id = record.id;
        let analysis_id = record.analysis_id;
        // Decoding, rendering and serializing a large inventory is CPU work: keep it off the
        // async workers.
        let built = tokio::task::spawn_blocking(move || {
            let (result, markdown) = build(record)?;
            let json = serde_json::to_string(&result)
                .map_err(|e| format!("the specification cannot be stored as JSON: {e}"))?;
            let counts = (result.spec.files.len() as u64, result.spec.behaviours);
            Ok::<_, String>((json, markdown, counts))
        })
        .await;
        let (json, markdown, (files, behaviours)) = match built {
            Ok(built) => built.map_err(JobError::Cancel)?,
            Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
            Err(join) => return Err(JobError::msg(format!("rendering did not finish: {join}"))),
        };
        if !records::specviews::stage(&self.pool, specview_id, job_id, &json, &markdown)
            .await
            .map_err(records::stage_failure)?
        {
            return Err(JobError::Cancel(format!(
                "specview {specview_id} changed while the job ran; its result was not stored"
            )));
        }
        let output = SpecviewOutput {
            specview_id,
            analysis_id,
            files,
            behaviours,
        };
        ctx.set_output(&output).map_err(JobError::from)?;
        tracing::info!(
            %specview_id,
            %analysis_id,
            files = output.files,
            behaviours = output.behaviours,
            "specview stored"
        );
        Ok(())
    }
}

/// The most a specview may hold: its structured JSON and its Markdown together. A test's name
/// becomes its title beside it, in both, so a specview is up to about three and a half times its
/// analysis's inventory (capped at 64 MiB): 215 MB for one within that cap, made of 300-character
/// names of `*`, which Markdown escapes. The job holds the two texts and the database driver
/// copies each twice while storing them, and `web` holds them while answering, in pods of 512 MiB.
pub const MAX_SPECVIEW_BYTES: u64 = 64 * 1024 * 1024;

/// The specification of a claimed record's analysis, structured and as Markdown; `Err` says why
/// there can be none.
pub fn build(record: SpecviewRecord) -> Result<(SpecviewResult, String), String> {
    build_within(record, MAX_SPECVIEW_BYTES)
}

/// [`build`], refusing a specification whose JSON and Markdown together take more than
/// `max_bytes`. The JSON is measured without being written out, and before the Markdown is
/// rendered; the analysis's text and inventory are let go once the specification is built.
pub fn build_within(
    record: SpecviewRecord,
    max_bytes: u64,
) -> Result<(SpecviewResult, String), String> {
    let analysis_id = record.analysis_id;
    if record.analysis_state != WorkState::Completed {
        return Err(format!(
            "analysis {analysis_id} is {}; a specview needs a completed analysis",
            record.analysis_state
        ));
    }
    let Some(text) = record.analysis_result else {
        return Err(format!("analysis {analysis_id} has no result"));
    };
    let analysis: inventory::Analysis = serde_json::from_str(&text)
        .map_err(|e| format!("the result of analysis {analysis_id} cannot be read: {e}"))?;
    drop(text);
    let spec = Spec::from_inventory(&analysis.inventory);
    let result = SpecviewResult {
        analysis_id,
        repository: record.repository,
        commit: record.commit.unwrap_or(analysis.commit),
        spec,
    };
    let too_large = |bytes: u64| {
        format!(
            "the specification is too large: more than {max_bytes} bytes of JSON and Markdown \
             (at least {bytes})"
        )
    };
    let mut json = ByteCount(0);
    serde_json::to_writer(&mut json, &result)
        .map_err(|e| format!("the specification cannot be stored as JSON: {e}"))?;
    if json.0 > max_bytes {
        return Err(too_large(json.0));
    }
    let markdown = result.spec.to_markdown();
    let total = json.0 + markdown.len() as u64;
    if total > max_bytes {
        return Err(too_large(total));
    }
    Ok((result, markdown))
}

/// A writer that only counts the bytes written to it.
struct ByteCount(u64);

impl std::io::Write for ByteCount {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0 += bytes.len() as u64;
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn record(state: WorkState, result: Option<serde_json::Value>) -> SpecviewRecord {
        SpecviewRecord {
            id: Uuid::nil(),
            user_id: None,
            analysis_id: Uuid::nil(),
            job_id: Some(1),
            analysis_state: state,
            repository: "https://example.com/r.git".into(),
            commit: Some("c".repeat(40)),
            analysis_result: result.map(|r| r.to_string()),
        }
    }

    #[test]
    fn builds_the_spec_and_its_markdown() {
        let analysis = json!({
            "repository": "https://example.com/r.git",
            "requested_ref": null,
            "commit": "c".repeat(40),
            "inventory": {
                "files": [{
                    "path": "src/lib.rs",
                    "framework": "rust",
                    "tests": [
                        {"name": "adds_two_numbers", "suite": ["tests"], "line": 3,
                         "modifier": "none", "parameterized": false},
                        {"name": "test_handles_overflow", "suite": ["tests"], "line": 9,
                         "modifier": "skip", "parameterized": false}
                    ]
                }],
                "totals": {"overall": {"files": 1, "tests": 2, "skipped": 1, "only": 0, "todo": 0,
                                       "benchmarks": 0, "fuzz": 0, "examples": 0},
                           "by_framework": {}},
                "stats": {"files_visited": 1, "files_scanned": 1, "files_too_large": 0,
                          "symlinks_skipped": 0}
            }
        });
        let (result, markdown) = build(record(WorkState::Completed, Some(analysis))).unwrap();
        assert_eq!(
            markdown,
            "# Behaviour specification\n\n2 behaviours in 1 file (1 skipped).\n\n\
             ## `src/lib.rs` (rust)\n\n- **tests**\n  - adds two numbers\n  \
             - handles overflow _(skipped)_\n"
        );
        assert_eq!(result.spec.behaviours, 2);
        let json = serde_json::to_value(&result).unwrap();
        assert_eq!(json["commit"], "c".repeat(40));
        assert_eq!(json["files"][0]["nodes"][0]["title"], "tests");
        assert_eq!(
            json["files"][0]["nodes"][0]["children"][1]["title"],
            "handles overflow"
        );
    }

    /// A specification past the cap is refused for good, with its size, before its Markdown is
    /// rendered when its JSON alone is past it; one within it is built.
    #[test]
    fn a_specification_too_large_to_store_is_refused() {
        let tests: Vec<serde_json::Value> = (0..200)
            .map(|n| {
                json!({"name": format!("{n}{}", "*".repeat(300)), "suite": [], "line": n,
                       "modifier": "none", "parameterized": false})
            })
            .collect();
        let analysis = json!({
            "repository": "https://example.com/r.git",
            "requested_ref": null,
            "commit": "c".repeat(40),
            "inventory": {
                "files": [{"path": "a.test.js", "framework": "jest", "tests": tests}],
                "totals": {"overall": {"files": 1, "tests": 200, "skipped": 0, "only": 0,
                                       "todo": 0, "benchmarks": 0, "fuzz": 0, "examples": 0},
                           "by_framework": {}},
                "stats": {"files_visited": 1, "files_scanned": 1, "files_too_large": 0,
                          "symlinks_skipped": 0}
            }
        });
        let built = || record(WorkState::Completed, Some(analysis.clone()));
        let (result, markdown) = build(built()).unwrap();
        let json = serde_json::to_string(&result).unwrap().len() as u64;
        let stored = json + markdown.len() as u64;
        // Each name is in the JSON twice (name and title) and in the Markdown with every `*`
        // escaped: the inventory's 60 KB of names take about 240 KB stored.
        assert!(stored > 200 * 4 * 300, "{stored}");
        assert_eq!(
            build_within(built(), stored).map(|(_, md)| md.len()),
            Ok(markdown.len())
        );
        let refused = build_within(built(), stored - 1).unwrap_err();
        assert_eq!(
            refused,
            format!(
                "the specification is too large: more than {} bytes of JSON and Markdown \
                 (at least {stored})",
                stored - 1
            )
        );
        // Past the cap with its JSON alone: refused at that size, before the Markdown.
        assert_eq!(
            build_within(built(), json - 1).unwrap_err(),
            format!(
                "the specification is too large: more than {} bytes of JSON and Markdown \
                 (at least {json})",
                json - 1
            )
        );
    }

    #[test]
    fn refuses_what_cannot_become_a_spec() {
        assert_eq!(
            build(record(WorkState::Running, None)).unwrap_err(),
            format!(
                "analysis {} is running; a specview needs a completed analysis",
                Uuid::nil()
            )
        );
        assert!(
            build(record(WorkState::Completed, Some(json!({"tests": 7}))))
                .unwrap_err()
                .contains("cannot be read")
        );
        assert!(
            build(record(WorkState::Completed, None))
                .unwrap_err()
                .ends_with("has no result")
        );
    }
}
