//! Fairlane's analysis core, shared by the analyzer and specgen workers and the web API.
//!
//! - [`url_policy`]: which repository URLs may be fetched (sync syntactic check for the API,
//!   async check with DNS for the worker).
//! - [`fetch`]: resolve a ref to a commit without cloning (cache-first lookups), and fetch a
//!   commit into a self-removing temporary folder with the `git` CLI under time, byte and file
//!   caps; [`fetch::sweep_stale`] cleans up after crashed processes.
//! - [`scan`]: inventory the tests of a checked-out tree per file and framework.
//! - [`spec`]: turn an inventory into a behaviour specification and Markdown.
//! - [`analyze`]: all of it in one call.

pub mod fetch;
pub mod model;
pub mod scan;
pub mod spec;
pub mod url_policy;

pub use fetch::{
    Checkout, FetchError, Limits, ResolvedRef, Stage, fetch, fetch_commit, resolve_ref, sweep_stale,
};
pub use model::{Counts, FileInventory, Framework, Inventory, Modifier, TestCase};
pub use scan::{ScanError, ScanOptions, scan_tree};
pub use spec::{Spec, sentence};
pub use url_policy::{RepoUrl, UrlError, UrlPolicy, VettedUrl, check_url, vet_url};

use serde::{Deserialize, Serialize};

/// The result of analysing a repository at a ref.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Analysis {
    /// The normalised repository URL.
    pub repository: String,
    /// The ref as requested (`None` = default branch).
    pub requested_ref: Option<String>,
    /// The commit that was analysed.
    pub commit: String,
    /// Its test inventory.
    pub inventory: Inventory,
}

/// Why an analysis failed.
#[derive(Debug, thiserror::Error)]
pub enum AnalyzeError {
    /// The URL policy refused the repository URL.
    #[error("refused by policy: {0}")]
    Refused(#[from] UrlError),
    /// Resolving or fetching failed.
    #[error(transparent)]
    Fetch(#[from] FetchError),
    /// Walking the checkout failed.
    #[error("scanning the checkout failed: {0}")]
    Scan(#[from] ScanError),
}

impl AnalyzeError {
    /// Whether retrying the same request cannot help (see [`FetchError::is_permanent`]).
    pub fn is_permanent(&self) -> bool {
        match self {
            AnalyzeError::Refused(_) => true,
            AnalyzeError::Fetch(e) => e.is_permanent(),
            AnalyzeError::Scan(
                ScanError::TooManyFiles { .. }
                | ScanError::TooManyTests { .. }
                | ScanError::TooLarge { .. }
                | ScanError::TimedOut,
            ) => true,
            AnalyzeError::Scan(ScanError::Io { .. } | ScanError::Cancelled) => false,
        }
    }
}

impl Limits {
    /// The scan bounds implied by these limits.
    pub fn scan_options(&self) -> ScanOptions {
        ScanOptions {
            max_file_bytes: self.max_file_bytes,
            max_files: self.max_files,
            ..ScanOptions::default()
        }
    }
}

/// Checks the URL (with DNS), resolves the ref, fetches the commit, inventories its tests and
/// removes the checkout (also on error, timeout, cancellation and panic).
pub async fn analyze(
    url: &str,
    git_ref: Option<&str>,
    limits: &Limits,
    policy: &UrlPolicy,
) -> Result<Analysis, AnalyzeError> {
    let vetted = vet_url(url, policy).await?;
    let checkout = fetch(&vetted, git_ref, limits).await?;
    let tree = checkout.path().to_path_buf();
    let options = limits.scan_options();
    let scanned = tokio::task::spawn_blocking(move || scan_tree(&tree, &options)).await;
    let inventory = match scanned {
        Ok(result) => result?,
        Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
        Err(_) => {
            return Err(AnalyzeError::Scan(ScanError::Io {
                path: ".".into(),
                source: std::io::Error::other("the scan task was cancelled"),
            }));
        }
    };
    let commit = checkout.commit().to_string();
    drop(checkout);
    Ok(Analysis {
        repository: vetted.url().as_str().to_string(),
        requested_ref: git_ref.map(str::to_string),
        commit,
        inventory,
    })
}
