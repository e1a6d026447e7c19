//! The `analysis` job: inventories the tests of a repository at one commit and stages the
//! result on its `analyses` record, which [`records::RecordHook`] completes (or fails) in the
//! job's final transaction.
//!
//! Steps: claim the record (`running`); vet its URL with the configured policy, DNS included,
//! right before fetching; fetch exactly the record's commit (a user's request, resolved by the
//! API; the branch may have moved since) or, for a system re-analysis without a commit, resolve
//! the requested ref (default: the remote's default branch) and fetch that; scan the checkout off
//! the async workers; stage the inventory (`inventory::Analysis` as JSON) and the commit; set the
//! job's output. The checkout folder is removed on every path (success, error, timeout, cancel,
//! panic); a crashed process's folders are swept when the service starts again.
//!
//! Failures that retrying cannot fix (missing repository or ref, caps, policy, a timed-out fetch)
//! cancel the job for good, with the reason as the record's error; others (DNS, network, database)
//! are retried by the queue's rules.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use common::AnalysisArgs;
use inventory::model::Totals;
use inventory::{FetchError, ResolvedRef, ScanError, UrlError, VettedUrl};
use queue::{JobContext, JobError, Worker};
use records::analyses::AnalysisRecord;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

use crate::settings::AnalysisSettings;

/// What a completed `analysis` job reports as its output (`GET /v1/jobs/{id}` → `result`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnalysisOutput {
    pub analysis_id: Uuid,
    /// The normalised repository URL.
    pub repository: String,
    /// The commit analysed.
    pub commit: String,
    /// Test counts overall and per framework.
    pub totals: Totals,
}

/// The handler of `analysis` jobs.
#[derive(Debug, Clone)]
pub struct AnalysisWorker {
    pool: PgPool,
    settings: Arc<AnalysisSettings>,
}

impl AnalysisWorker {
    pub fn new(pool: PgPool, settings: AnalysisSettings) -> Self {
        AnalysisWorker {
            pool,
            settings: Arc::new(settings),
        }
    }
}

#[async_trait]
impl Worker<AnalysisArgs> for AnalysisWorker {
    async fn work(&self, ctx: &JobContext, args: AnalysisArgs) -> Result<(), JobError> {
        // Stopping drops the analysis: git is killed and the checkout folder removed.
        ctx.unless_stopped(
            "stopped before the analysis finished",
            self.analyse(ctx, &args),
        )
        .await
    }

    fn timeout(&self) -> Option<Duration> {
        Some(self.settings.job_timeout())
    }
}

impl AnalysisWorker {
    async fn analyse(&self, ctx: &JobContext, args: &AnalysisArgs) -> Result<(), JobError> {
        let job_id = ctx.id();
        let record = records::analyses::claim(&self.pool, args.analysis_id, job_id)
            .await?
            .map_err(|refusal| {
                JobError::Cancel(format!("analysis {} {refusal}", args.analysis_id))
            })?;
        let policy = self.settings.url_policy();
        let vetted = inventory::vet_url(&record.repository, &policy)
            .await
            .map_err(|e| url_failure(&e, ctx.job().attempt))?;
        let limits = self.settings.limits();
        tracing::info!(
            analysis_id = %record.id,
            repository = %vetted.url(),
            commit = record.commit.as_deref().unwrap_or("(default branch)"),
            "fetching"
        );
        let checkout = fetch(&vetted, &record, &limits)
            .await
            .map_err(|e| fetch_failure(e, ctx.job().attempt))?;
        let commit = checkout.commit().to_owned();
        if let Some(wanted) = &record.commit
            && record.user_id.is_some()
            && *wanted != commit
        {
            return Err(JobError::Cancel(format!(
                "the server would not serve commit {wanted} by its id, and `{}` now points to \
                 {commit}; request the analysis again",
                record.requested_ref.as_deref().unwrap_or("HEAD")
            )));
        }

        let cap = self.settings.analyzer_scan_timeout;
        // Dropping this future (a user's cancel, the job's timeout, a shutdown) stops the scan
        // at its next file or folder: the blocking thread is not stopped by dropping its handle.
        let stop = StopOnDrop::default();
        let options = inventory::ScanOptions {
            // The scan stops by itself at the cap, so its thread and checkout do not outlive
            // the job that gave up on it.
            deadline: Some(std::time::Instant::now() + cap),
            cancel: Some(Arc::clone(&stop.0)),
            ..limits.scan_options()
        };
        let root = checkout.path().to_path_buf();
        let scanned = within_cap(
            cap,
            move || inventory::scan_tree(&root, &options),
            // The folder is removed there, off the async workers, once the scan is done with
            // it; its removal (a large tree) is not the scan's time.
            move || drop(checkout),
        )
        .await;
        let inventory = match scanned {
            // The cap passed while waiting, or the scan stopped itself at its deadline.
            Err(Unfinished::TimedOut) | Ok(Err(ScanError::TimedOut)) => {
                return Err(JobError::Cancel(format!(
                    "scanning the checkout for tests took longer than {cap:?}"
                )));
            }
            Err(Unfinished::Failed(join)) if join.is_panic() => {
                std::panic::resume_unwind(join.into_panic())
            }
            Err(Unfinished::Failed(join)) => {
                return Err(JobError::msg(format!("the scan did not finish: {join}")));
            }
            Ok(scanned) => scanned.map_err(scan_failure)?,
        };

        let output = AnalysisOutput {
            analysis_id: record.id,
            repository: vetted.url().as_str().to_owned(),
            commit: commit.clone(),
            totals: inventory.totals.clone(),
        };
        let analysis = inventory::Analysis {
            repository: output.repository.clone(),
            requested_ref: record.requested_ref.clone(),
            commit: commit.clone(),
            inventory,
        };
        // Tens of megabytes of JSON for a large repository: serialized off the async workers.
        let json = match tokio::task::spawn_blocking(move || serde_json::to_string(&analysis)).await
        {
            Ok(json) => json.map_err(JobError::from)?,
            Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
            Err(join) => {
                return Err(JobError::msg(format!(
                    "serializing the inventory did not finish: {join}"
                )));
            }
        };
        if !records::analyses::stage(&self.pool, record.id, job_id, &commit, &json)
            .await
            .map_err(records::stage_failure)?
        {
            return Err(JobError::Cancel(format!(
                "analysis {} changed while the job ran; its result was not stored",
                record.id
            )));
        }
        ctx.set_output(&output).map_err(JobError::from)?;
        tracing::info!(
            analysis_id = %record.id,
            repository = %output.repository,
            %commit,
            files = output.totals.overall.files,
            tests = output.totals.overall.tests,
            "analysis stored"
        );
        Ok(())
    }
}

/// Fetches the record's commit, or resolves and fetches its ref when it has none (a system
/// re-analysis).
async fn fetch(
    url: &VettedUrl,
    record: &AnalysisRecord,
    limits: &inventory::Limits,
) -> Result<inventory::Checkout, FetchError> {
    match fetch_target(record) {
        Some(target) => inventory::fetch_commit(url, &target, limits).await,
        None => inventory::fetch(url, record.requested_ref.as_deref(), limits).await,
    }
}

/// What to fetch for a user's record: its commit by id, with the requested ref (or the remote's
/// `HEAD`) as the fallback for servers that refuse fetching by id. `None` when the commit is to
/// be resolved now: a system re-analysis always resolves its ref afresh, also on a retry after
/// an earlier attempt staged a commit (the branch may have moved since, and no user is waiting
/// for that commit in particular).
fn fetch_target(record: &AnalysisRecord) -> Option<ResolvedRef> {
    record.user_id?;
    let commit = record.commit.clone()?;
    let requested = record.requested_ref.clone();
    let fallback = match requested.as_deref() {
        Some(r) if r.eq_ignore_ascii_case(&commit) => None,
        Some(r) => Some(r.to_owned()),
        None => Some("HEAD".to_owned()),
    };
    Some(ResolvedRef {
        requested,
        ref_name: fallback,
        commit,
    })
}

/// The attempt on which a host the DNS says does not exist ends the job: about 17 minutes
/// after the first (the ten retries before it wait 1 s, 2 s, 4 s … 512 s), longer than a
/// resolver's bad answer lasts.
/// Until then it is retried like any DNS failure; after, a name that never existed (a typo; the
/// API does not resolve the host of a request naming a commit) stops holding its user's quota
/// for the days 25 attempts take.
pub const UNKNOWN_HOST_ATTEMPTS: i16 = 11;

/// A URL the policy refuses ends the job; a DNS failure may pass and is retried, except a name
/// the DNS keeps saying does not exist, on attempt [`UNKNOWN_HOST_ATTEMPTS`].
fn url_failure(e: &UrlError, attempt: i16) -> JobError {
    match e {
        UrlError::UnknownHost { .. } if attempt >= UNKNOWN_HOST_ATTEMPTS => {
            JobError::Cancel(format!("{e}, on {attempt} attempts"))
        }
        UrlError::Resolution { .. }
        | UrlError::UnknownHost { .. }
        | UrlError::ResolutionTimedOut { .. }
        | UrlError::NoAddresses { .. } => JobError::msg(e.to_string()),
        _ => JobError::Cancel(format!("refused by policy: {e}")),
    }
}

/// The attempt on which git killed by the out-of-memory killer ends the job. Once may be a
/// neighbour's doing (ten analyses share a replica's memory); on every try, the repository needs
/// more than the worker has, and waiting days of retries would only hold the user's quota.
pub const KILLED_ATTEMPTS: i16 = 3;

fn fetch_failure(e: FetchError, attempt: i16) -> JobError {
    match e {
        FetchError::Killed { .. } if attempt >= KILLED_ATTEMPTS => {
            JobError::Cancel(format!("{e}, on {attempt} attempts"))
        }
        e if e.is_permanent() => JobError::Cancel(e.to_string()),
        e => JobError::Failed(Box::new(e)),
    }
}

fn scan_failure(e: ScanError) -> JobError {
    match e {
        ScanError::TooManyFiles { .. }
        | ScanError::TooManyTests { .. }
        | ScanError::TooLarge { .. }
        | ScanError::TimedOut => JobError::Cancel(e.to_string()),
        ScanError::Io { .. } | ScanError::Cancelled => JobError::Failed(Box::new(e)),
    }
}

/// Why [`within_cap`] gave no result.
#[derive(Debug)]
enum Unfinished {
    /// The cap passed first.
    TimedOut,
    /// The work panicked, or its thread was cancelled.
    Failed(tokio::task::JoinError),
}

/// Runs `work` on a blocking thread and waits at most `cap` for its result; `cleanup` runs on
/// that thread once the result is handed over (or the work panicked), outside the cap, and is
/// waited for before the result is returned: the job holds its slot (and the disk its checkout
/// took) until the folder is gone, so a new job's checkout never lands beside an old one's.
async fn within_cap<R: Send + 'static>(
    cap: Duration,
    work: impl FnOnce() -> R + Send + 'static,
    cleanup: impl FnOnce() + Send + 'static,
) -> Result<R, Unfinished> {
    let (result_tx, result_rx) = tokio::sync::oneshot::channel();
    let task = tokio::task::spawn_blocking(move || {
        // Dropped while unwinding if `work` panics: the cleanup's captures go with it.
        let cleanup = cleanup;
        let _ = result_tx.send(work());
        cleanup();
    });
    match tokio::time::timeout(cap, result_rx).await {
        Err(_) => Err(Unfinished::TimedOut),
        Ok(Ok(result)) => {
            // The cleanup cannot fail the result: it only removes what the work used.
            let _ = task.await;
            Ok(result)
        }
        // No result: the work panicked. Its thread is ending, so this wait is short.
        Ok(Err(_)) => match task.await {
            Err(join) => Err(Unfinished::Failed(join)),
            Ok(()) => Err(Unfinished::TimedOut),
        },
    }
}

/// A flag set when dropped: the scan's [`inventory::ScanOptions::cancel`].
#[derive(Default)]
struct StopOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use records::WorkState;

    /// The scan's cap counts the scan, not the removal of the checkout after it: a scan done in
    /// time, followed by a removal longer than the cap, still has its result, once the removal
    /// is done.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_cleanup_after_the_work_is_not_counted_in_its_cap() {
        let cleaned = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let result = within_cap(Duration::from_secs(2), || 42, {
            let cleaned = Arc::clone(&cleaned);
            move || {
                std::thread::sleep(Duration::from_secs(4));
                cleaned.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        })
        .await;
        assert_eq!(result.unwrap(), 42);
        assert!(
            cleaned.load(std::sync::atomic::Ordering::SeqCst),
            "returned before the cleanup ended"
        );

        let slow = within_cap(
            Duration::from_millis(100),
            || std::thread::sleep(Duration::from_secs(1)),
            || {},
        )
        .await;
        assert!(matches!(slow, Err(Unfinished::TimedOut)), "{slow:?}");

        let (dropped_tx, dropped_rx) = std::sync::mpsc::channel::<()>();
        let panicked = within_cap(
            Duration::from_secs(10),
            || -> u8 { panic!("the scan broke") },
            move || drop(dropped_tx),
        )
        .await;
        match panicked {
            Err(Unfinished::Failed(join)) => assert!(join.is_panic()),
            other => panic!("{other:?}"),
        }
        // The cleanup's captures (the checkout) were dropped with the panic.
        assert!(dropped_rx.recv().is_err());
    }

    fn record(requested: Option<&str>, commit: Option<&str>) -> AnalysisRecord {
        AnalysisRecord {
            id: Uuid::nil(),
            user_id: Some(Uuid::nil()),
            repository: "https://example.com/r.git".into(),
            requested_ref: requested.map(str::to_owned),
            commit: commit.map(str::to_owned),
            state: WorkState::Running,
            job_id: Some(1),
        }
    }

    fn cancel_reason(e: JobError) -> Option<String> {
        match e {
            JobError::Cancel(reason) => Some(reason),
            _ => None,
        }
    }

    #[test]
    fn a_user_request_fetches_exactly_its_commit() {
        let sha = "a".repeat(40);
        let t = fetch_target(&record(Some("main"), Some(&sha))).unwrap();
        assert_eq!(
            (t.commit.as_str(), t.ref_name.as_deref()),
            (sha.as_str(), Some("main"))
        );
        let t = fetch_target(&record(None, Some(&sha))).unwrap();
        assert_eq!(t.ref_name.as_deref(), Some("HEAD"));
        let t = fetch_target(&record(Some(&sha.to_uppercase()), Some(&sha))).unwrap();
        assert_eq!(t.ref_name, None);
        assert_eq!(fetch_target(&record(Some("main"), None)), None);
    }

    #[test]
    fn a_system_reanalysis_resolves_its_ref_again_on_a_retry() {
        let staged = AnalysisRecord {
            user_id: None,
            ..record(Some("main"), Some(&"a".repeat(40)))
        };
        assert_eq!(fetch_target(&staged), None);
    }

    #[test]
    fn permanent_failures_cancel_and_transient_ones_retry() {
        assert_eq!(
            cancel_reason(fetch_failure(FetchError::TooManyFiles { limit: 5 }, 1)).as_deref(),
            Some("the repository has too many files and folders: more than 5")
        );
        assert!(
            cancel_reason(fetch_failure(
                FetchError::TimedOut {
                    stage: inventory::Stage::Fetch,
                    limit: Duration::from_secs(2),
                },
                1
            ))
            .is_some_and(|r| r.starts_with("timed out while fetching"))
        );
        assert!(
            cancel_reason(fetch_failure(
                FetchError::OutOfMemory {
                    stage: inventory::Stage::Fetch,
                    limit: 1 << 30,
                },
                1
            ))
            .is_some_and(|r| r.starts_with("the repository needs more memory than allowed"))
        );
        assert!(
            cancel_reason(fetch_failure(FetchError::RepositoryNotFound, 1)).is_some(),
            "not found"
        );
        assert!(matches!(
            fetch_failure(
                FetchError::Unreachable {
                    detail: "reset".into()
                },
                1
            ),
            JobError::Failed(_)
        ));
        // git killed by the out-of-memory killer is retried a few times, then ends the job.
        let killed = || FetchError::Killed {
            stage: inventory::Stage::Fetch,
        };
        assert!(matches!(
            fetch_failure(killed(), KILLED_ATTEMPTS - 1),
            JobError::Failed(_)
        ));
        assert_eq!(
            cancel_reason(fetch_failure(killed(), KILLED_ATTEMPTS)).as_deref(),
            Some(
                "git was killed while fetching (the worker ran out of memory, most likely), on 3 attempts"
            )
        );
        assert_eq!(
            cancel_reason(url_failure(&UrlError::FileUrlsNotAllowed, 1)).as_deref(),
            Some(
                "refused by policy: file:// repository URLs are not allowed on this service; use an https:// URL"
            )
        );
        assert!(matches!(
            url_failure(&UrlError::NoAddresses { host: "x.y".into() }, 1),
            JobError::Failed(_)
        ));
        // A name the DNS says does not exist is retried for a while, then ends the job.
        let unknown = UrlError::UnknownHost {
            host: "typo.example".into(),
        };
        assert!(matches!(
            url_failure(&unknown, UNKNOWN_HOST_ATTEMPTS - 1),
            JobError::Failed(_)
        ));
        assert_eq!(
            cancel_reason(url_failure(&unknown, UNKNOWN_HOST_ATTEMPTS)).as_deref(),
            Some("host `typo.example` does not exist (the DNS knows no such name), on 11 attempts")
        );
        assert!(matches!(
            url_failure(
                &UrlError::Resolution {
                    host: "x.y".into(),
                    reason: "Temporary failure in name resolution".into()
                },
                UNKNOWN_HOST_ATTEMPTS + 5
            ),
            JobError::Failed(_)
        ));
        assert!(cancel_reason(scan_failure(ScanError::TooManyFiles { limit: 3 })).is_some());
        assert!(matches!(
            scan_failure(ScanError::Io {
                path: "a".into(),
                source: std::io::Error::other("x")
            }),
            JobError::Failed(_)
        ));
    }

    #[test]
    fn credentials_never_reach_the_reason() {
        let e = inventory::check_url(
            "https://user:hunter2@example.com/r.git",
            &inventory::UrlPolicy::default(),
        )
        .unwrap_err();
        let reason = cancel_reason(url_failure(&e, 1)).unwrap();
        assert!(
            !reason.contains("hunter2") && !reason.contains("user:"),
            "{reason}"
        );
    }
}
