//! Fetches a repository at a ref into a temporary folder with the `git` CLI, within caps on
//! time, bytes and files.
//!
//! Steps: [`resolve_ref`] turns the ref into a commit without cloning (`git ls-remote`; a full
//! hex object id is taken as is; no ref means the remote's `HEAD`) — the web API uses it alone
//! for cache-first lookups. [`fetch_commit`] then runs `git init`, `git fetch --depth 1 <url>
//! <commit>` (falling back to the ref name for servers that refuse fetching by id) while
//! watching the folder's size, lists the commit's tree (`git ls-tree -r -t -l`) to refuse too many
//! files and folders or too many bytes before writing any, and checks the commit out with the
//! repository's own attributes overridden, so that files are written as stored. [`fetch`] does both
//! under one deadline. The returned [`Checkout`] removes its folder when dropped.

mod git;
mod workdir;

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::time::Instant;

pub use git::disk_usage;
use git::{BLOCK_BYTES, in_blocks};
pub use workdir::{CHECKOUT_PREFIX, SweepReport, WorkDir, process_start_time, sweep_stale};

use crate::url_policy::{Scheme, VettedUrl, redact};
use git::{DiskWatch, Git, GitOutput};

/// Caps and places for a fetch (and the scan that follows it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Wall-clock cap for resolving, fetching and checking out together.
    pub total_time: Duration,
    /// Cap for resolving the ref alone (`git ls-remote`).
    pub resolve_time: Duration,
    /// Cap on the checkout folder's size (sum of file sizes: git objects plus work tree).
    pub max_bytes: u64,
    /// Cap on the number of files and folders in the commit's tree.
    pub max_files: u64,
    /// Cap on each git process's address space (`RLIMIT_AS`, set by util-linux's `prlimit`):
    /// a pack of a few KiB can inflate to objects of hundreds of MiB in git's memory.
    pub max_git_memory: u64,
    /// The scan skips source files larger than this.
    pub max_file_bytes: u64,
    /// How often the folder's size is measured while git writes.
    pub poll_interval: Duration,
    /// The folder under which checkout folders are created (and swept).
    pub work_root: PathBuf,
}

impl Default for Limits {
    /// 120 s in all, 20 s to resolve, 512 MiB, 100 000 files, 1 GiB of address space per git
    /// process, 1 MiB per scanned file, size measured every 100 ms, folders under
    /// `<tmp>/fairlane-inventory`.
    fn default() -> Self {
        Limits {
            total_time: Duration::from_secs(120),
            resolve_time: Duration::from_secs(20),
            max_bytes: 512 * 1024 * 1024,
            max_files: 100_000,
            max_git_memory: 1024 * 1024 * 1024,
            max_file_bytes: 1024 * 1024,
            poll_interval: Duration::from_millis(100),
            work_root: std::env::temp_dir().join("fairlane-inventory"),
        }
    }
}

/// Which step a fetch was in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// `git ls-remote`.
    Resolve,
    /// `git init`.
    Init,
    /// `git fetch`.
    Fetch,
    /// `git rev-parse` / `git ls-tree`.
    Inspect,
    /// `git checkout`.
    Checkout,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stage::Resolve => "resolving the ref",
            Stage::Init => "preparing the checkout",
            Stage::Fetch => "fetching",
            Stage::Inspect => "inspecting the commit",
            Stage::Checkout => "checking out",
        })
    }
}

/// Why resolving or fetching failed. Messages never contain credentials.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The ref is not a valid git ref name.
    #[error("invalid ref: {reason}")]
    InvalidRef {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Missing, private (authentication required) or not a git repository.
    #[error("repository not found or not accessible (private repositories are not supported)")]
    RepositoryNotFound,
    /// The remote has no such branch or tag (or refused the commit).
    #[error("ref `{git_ref}` was not found in the repository{hint}")]
    RefNotFound {
        /// The ref as requested.
        git_ref: String,
        /// Extra advice (may be empty).
        hint: &'static str,
    },
    /// No ref was given and the remote has no `HEAD`.
    #[error("the repository has no default branch (it may be empty)")]
    EmptyRepository,
    /// The checkout folder would exceed [`Limits::max_bytes`].
    #[error("the repository is too large: more than {limit} bytes while {stage}")]
    TooLarge {
        /// The step that hit the cap.
        stage: Stage,
        /// The cap.
        limit: u64,
    },
    /// A git process ran out of its address space ([`Limits::max_git_memory`]).
    #[error("the repository needs more memory than allowed: over {limit} bytes while {stage}")]
    OutOfMemory {
        /// The step that hit the cap.
        stage: Stage,
        /// The cap.
        limit: u64,
    },
    /// The commit's tree has more files and folders than [`Limits::max_files`].
    #[error("the repository has too many files and folders: more than {limit}")]
    TooManyFiles {
        /// The cap.
        limit: u64,
    },
    /// The time cap was reached; git was killed.
    #[error("timed out while {stage} (time cap {limit:?})")]
    TimedOut {
        /// The step that was running.
        stage: Stage,
        /// The cap that ran out.
        limit: Duration,
    },
    /// DNS, connection or TLS failure.
    #[error("the repository host could not be reached: {detail}")]
    Unreachable {
        /// git's message (redacted).
        detail: String,
    },
    /// git itself refused the transport (defence in depth behind the URL policy).
    #[error("refused by policy: {detail}")]
    Refused {
        /// git's message (redacted).
        detail: String,
    },
    /// The commit's own content cannot be used here, the same way on every try: a path git
    /// refuses to write (`invalid path`, such as a name with a backslash), an object that fails
    /// git's checks (`fsck`), a ref that points to a tree or a blob instead of a commit.
    #[error("the repository cannot be checked out while {stage}: {detail}")]
    Unusable {
        /// The step.
        stage: Stage,
        /// What is wrong (git's words, redacted).
        detail: String,
    },
    /// git was killed by a signal it was not sent by us: nearly always the kernel's out-of-memory
    /// killer, when the worker's memory ran out. That may be another job's doing, so it is
    /// retried; the caller decides when it is the repository's.
    #[error("git was killed while {stage} (the worker ran out of memory, most likely)")]
    Killed {
        /// The step.
        stage: Stage,
    },
    /// Any other git failure.
    #[error("git failed while {stage}: {detail}")]
    Git {
        /// The step.
        stage: Stage,
        /// git's message (redacted, last lines).
        detail: String,
    },
    /// A local I/O failure (temporary folders, starting git).
    #[error("could not {action}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl FetchError {
    /// Whether retrying the same request cannot help (missing repository or ref, caps, policy).
    /// Timeouts count as permanent too: the same repository will be as slow again.
    pub fn is_permanent(&self) -> bool {
        !matches!(
            self,
            FetchError::Unreachable { .. }
                | FetchError::Killed { .. }
                | FetchError::Git { .. }
                | FetchError::Io { .. }
        )
    }
}

/// A ref resolved to a commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedRef {
    /// The ref as requested (`None` = the remote's default branch).
    pub requested: Option<String>,
    /// The full ref name it matched (`refs/heads/main`, `HEAD`), `None` for a commit id.
    pub ref_name: Option<String>,
    /// The commit id (lower-case hex).
    pub commit: String,
}

/// A checked-out commit in a temporary folder, removed when this is dropped.
#[derive(Debug)]
pub struct Checkout {
    commit: String,
    work_tree: PathBuf,
    // Declared last: dropped after everything else.
    dir: WorkDir,
}

impl Checkout {
    /// The work tree (the repository's files; `.git` inside it).
    pub fn path(&self) -> &Path {
        &self.work_tree
    }

    /// The commit that was checked out.
    pub fn commit(&self) -> &str {
        &self.commit
    }

    /// The checkout's temporary folder (work tree, git home, temp files).
    pub fn folder(&self) -> &Path {
        self.dir.path()
    }
}

fn is_object_id(s: &str) -> bool {
    (s.len() == 40 || s.len() == 64) && s.bytes().all(|c| c.is_ascii_hexdigit())
}

/// Checks a ref name against git's rules (`git check-ref-format`, simplified and stricter).
pub fn validate_ref_name(name: &str) -> Result<(), FetchError> {
    let fail = |reason| Err(FetchError::InvalidRef { reason });
    if name.is_empty() {
        return fail("the ref is empty");
    }
    if name.len() > 255 {
        return fail("the ref is longer than 255 bytes");
    }
    if name.starts_with('-') {
        return fail("a ref may not start with `-`");
    }
    if name
        .bytes()
        .any(|c| c.is_ascii_control() || c == b' ' || !c.is_ascii())
    {
        return fail("a ref may only contain printable ASCII without spaces");
    }
    if name
        .chars()
        .any(|c| matches!(c, '~' | '^' | ':' | '?' | '*' | '[' | '\\'))
    {
        return fail("a ref may not contain ~ ^ : ? * [ or \\");
    }
    if name.contains("..") || name.contains("@{") || name.contains("//") {
        return fail("a ref may not contain `..`, `@{` or `//`");
    }
    if name.starts_with('/')
        || name.ends_with('/')
        || name.ends_with('.')
        || name.ends_with(".lock")
    {
        return fail("a ref may not start or end with `/`, or end with `.` or `.lock`");
    }
    if name.split('/').any(|part| part.starts_with('.')) {
        return fail("a ref component may not start with `.`");
    }
    if name == "@" {
        return fail("`@` alone is not a ref");
    }
    Ok(())
}

/// Builds a [`Git`] runner rooted in `folder` (or a scratch folder for `ls-remote`).
fn git_for(
    url: &VettedUrl,
    home: PathBuf,
    limits: &Limits,
    deadline: Instant,
    time_cap: Duration,
) -> Git {
    Git {
        home,
        allow_file: url.url().scheme() == Scheme::File,
        curl_pin: url.curl_resolve_pin(),
        max_memory: limits.max_git_memory,
        deadline,
        time_cap,
    }
}

/// Maps a failed git's stderr to an error.
fn classify_failure(stage: Stage, output: &GitOutput, git_ref: Option<&str>) -> FetchError {
    let text = output.stderr.to_ascii_lowercase();
    let has = |needles: &[&str]| needles.iter().any(|n| text.contains(n));
    // git's own words when an allocation or a mapping fails under `RLIMIT_AS`; a server's own
    // shortage (`remote: …`) is not ours, and may pass.
    let local_out_of_memory = text
        .lines()
        .filter(|line| !line.trim_start().starts_with("remote:"))
        .any(|line| line.contains("out of memory") || line.contains("cannot allocate memory"));
    if local_out_of_memory {
        return FetchError::OutOfMemory {
            stage,
            limit: output.memory_cap,
        };
    }
    // Our own kills (the time cap, a cap on size, a cancel) end the fetch before its output is
    // classified; a SIGKILL seen here came from elsewhere.
    if std::os::unix::process::ExitStatusExt::signal(&output.status) == Some(9) {
        return FetchError::Killed { stage };
    }
    if text.contains("transport") && text.contains("not allowed") {
        return FetchError::Refused {
            detail: last_lines(&output.stderr),
        };
    }
    if has(&[
        "repository not found",
        "does not appear to be a git repository",
        "could not read username",
        "could not read password",
        "authentication failed",
        "terminal prompts disabled",
        "returned error: 401",
        "returned error: 403",
        "returned error: 404",
        "not a git repository",
    ]) || text
        .lines()
        .any(|line| line.contains("repository '") && line.contains("' not found"))
    {
        // The last: a plain HTTP 404 (git-http-backend, Gitea, Forgejo), where git says
        // `fatal: repository 'https://host/o/r/' not found`.
        return FetchError::RepositoryNotFound;
    }
    // Before the network's words: a ref's own name can hold them (`update-openssl`).
    if let Some(r) = git_ref
        && has(&[
            "couldn't find remote ref",
            "not our ref",
            "no such remote ref",
            "unadvertised object",
        ])
    {
        return FetchError::RefNotFound {
            git_ref: r.to_string(),
            hint: "",
        };
    }
    // TLS trouble is told on git's `unable to access '<url>': …` line; elsewhere these words
    // can be a ref's or a path's.
    let tls_trouble = text.lines().any(|line| {
        line.contains("unable to access")
            && ["ssl", "tls", "certificate", "gnutls"]
                .iter()
                .any(|w| line.contains(w))
    });
    if tls_trouble
        || has(&[
            "could not resolve host",
            "failed to connect",
            "couldn't connect",
            "connection refused",
            "connection timed out",
            "connection reset",
            "network is unreachable",
        ])
    {
        return FetchError::Unreachable {
            detail: last_lines(&output.stderr),
        };
    }
    // The commit's content, not the moment: the same on every try.
    if has(&[
        "invalid path",
        "fsck error",
        "fsckobjects",
        "error in object",
    ]) {
        return FetchError::Unusable {
            stage,
            detail: last_lines(&output.stderr),
        };
    }
    let detail = last_lines(&output.stderr);
    FetchError::Git {
        stage,
        detail: if detail.is_empty() {
            format!("git exited with {}", output.status)
        } else {
            detail
        },
    }
}

/// Refuses a [`ResolvedRef`] whose commit is not an object id, or whose ref name is neither
/// `HEAD` nor a valid ref name, before either reaches git's command line: a caller may build one
/// from stored data (the analyzer from a record), and a value starting with `-` would be read by
/// `git fetch` as an option (`--upload-pack=…` runs a command).
fn check_fetchable(resolved: &ResolvedRef) -> Result<(), FetchError> {
    if !is_object_id(&resolved.commit) {
        return Err(FetchError::InvalidRef {
            reason: "the commit is not a 40- or 64-digit hexadecimal object id",
        });
    }
    match resolved.ref_name.as_deref() {
        None | Some("HEAD") => Ok(()),
        Some(name) => validate_ref_name(name),
    }
}

/// Whether a fetch of `commit` by its id failed because the server will not serve objects by id
/// (unadvertised object, not our ref), the one failure that fetching by the ref's name can get
/// past. Any other (the network, a server error, a shortage, a broken pack) is not a refusal:
/// the name would fetch whatever it points to now, and the job would end for a moved ref when
/// a retry by id would have worked.
fn refused_the_id(output: &GitOutput, commit: &str) -> bool {
    matches!(
        classify_failure(Stage::Fetch, output, Some(commit)),
        FetchError::RefNotFound { .. }
    )
}

/// The last three non-empty lines of git's stderr, credentials redacted, at most 600 chars.
fn last_lines(stderr: &str) -> String {
    let lines: Vec<&str> = stderr
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let tail = lines[lines.len().saturating_sub(3)..].join(" / ");
    let tail = redact(&tail);
    match tail.char_indices().nth(600) {
        Some((cut, _)) => format!("{}…", &tail[..cut]),
        None => tail,
    }
}

/// Resolves `git_ref` (branch, tag, full ref name, full commit id, or `None` for the remote's
/// default branch) to a commit, without cloning. Bounded by [`Limits::resolve_time`].
pub async fn resolve_ref(
    url: &VettedUrl,
    git_ref: Option<&str>,
    limits: &Limits,
) -> Result<ResolvedRef, FetchError> {
    let deadline = Instant::now() + limits.resolve_time;
    resolve_ref_until(url, git_ref, limits, deadline, limits.resolve_time).await
}

async fn resolve_ref_until(
    url: &VettedUrl,
    git_ref: Option<&str>,
    limits: &Limits,
    deadline: Instant,
    time_cap: Duration,
) -> Result<ResolvedRef, FetchError> {
    let wanted = git_ref.filter(|r| *r != "HEAD");
    if let Some(r) = wanted {
        if is_object_id(r) {
            return Ok(ResolvedRef {
                requested: Some(r.to_string()),
                ref_name: None,
                commit: r.to_ascii_lowercase(),
            });
        }
        validate_ref_name(r)?;
    }
    // Candidates in git's own precedence order (`git rev-parse` rules), peeled tags first.
    let candidates: Vec<String> = match wanted {
        None => vec!["HEAD".into()],
        Some(r) if r.starts_with("refs/") => vec![format!("{r}^{{}}"), r.to_string()],
        Some(r) => vec![
            format!("refs/{r}^{{}}"),
            format!("refs/{r}"),
            format!("refs/tags/{r}^{{}}"),
            format!("refs/tags/{r}"),
            format!("refs/heads/{r}"),
        ],
    };
    // ls-remote needs no repository; its scratch home still lives in a removable folder.
    let scratch = WorkDir::create(&limits.work_root).map_err(|source| FetchError::Io {
        action: "create a temporary folder",
        source,
    })?;
    let git = git_for(
        url,
        scratch.path().to_path_buf(),
        limits,
        deadline,
        time_cap,
    );
    let mut args: Vec<&str> = vec!["ls-remote", "--quiet", url.url().as_str()];
    args.extend(candidates.iter().map(String::as_str));
    let mut listing: Vec<u8> = Vec::new();
    let output = git
        .run(Stage::Resolve, scratch.path(), &args, None, &mut |chunk| {
            if listing.len() + chunk.len() > 4 * 1024 * 1024 {
                return Err(FetchError::Git {
                    stage: Stage::Resolve,
                    detail: "ls-remote produced more than 4 MiB of output".into(),
                });
            }
            listing.extend_from_slice(chunk);
            Ok(())
        })
        .await?;
    if !output.success() {
        return Err(classify_failure(Stage::Resolve, &output, git_ref));
    }
    let listing = String::from_utf8_lossy(&listing);
    let lines: Vec<(&str, &str)> = listing
        .lines()
        .filter_map(|line| line.split_once('\t'))
        .filter(|(id, _)| is_object_id(id))
        .collect();
    for candidate in &candidates {
        if let Some((id, name)) = lines.iter().find(|(_, name)| name == candidate) {
            return Ok(ResolvedRef {
                requested: git_ref.map(str::to_string),
                ref_name: Some(name.trim_end_matches("^{}").to_string()),
                commit: id.to_ascii_lowercase(),
            });
        }
    }
    match wanted {
        None => Err(FetchError::EmptyRepository),
        Some(r) => Err(FetchError::RefNotFound {
            git_ref: r.to_string(),
            hint: if r.len() >= 4 && r.len() < 40 && r.bytes().all(|c| c.is_ascii_hexdigit()) {
                " (abbreviated commit ids cannot be resolved remotely; give the full 40-character id)"
            } else {
                ""
            },
        }),
    }
}

/// Resolves and fetches under one deadline ([`Limits::total_time`]; resolving alone is also
/// bounded by [`Limits::resolve_time`]).
pub async fn fetch(
    url: &VettedUrl,
    git_ref: Option<&str>,
    limits: &Limits,
) -> Result<Checkout, FetchError> {
    let started = Instant::now();
    let deadline = started + limits.total_time;
    let (resolve_deadline, resolve_cap) = if limits.resolve_time < limits.total_time {
        (started + limits.resolve_time, limits.resolve_time)
    } else {
        (deadline, limits.total_time)
    };
    let resolved = resolve_ref_until(url, git_ref, limits, resolve_deadline, resolve_cap).await?;
    fetch_commit_until(url, &resolved, limits, deadline).await
}

/// Fetches and checks out an already resolved commit, within [`Limits::total_time`].
pub async fn fetch_commit(
    url: &VettedUrl,
    resolved: &ResolvedRef,
    limits: &Limits,
) -> Result<Checkout, FetchError> {
    fetch_commit_until(url, resolved, limits, Instant::now() + limits.total_time).await
}

async fn fetch_commit_until(
    url: &VettedUrl,
    resolved: &ResolvedRef,
    limits: &Limits,
    deadline: Instant,
) -> Result<Checkout, FetchError> {
    check_fetchable(resolved)?;
    let dir = WorkDir::create(&limits.work_root).map_err(|source| FetchError::Io {
        action: "create a temporary folder",
        source,
    })?;
    let home = dir.path().join("home");
    let work_tree = dir.path().join("repo");
    for d in [&home, &work_tree] {
        std::fs::create_dir(d).map_err(|source| FetchError::Io {
            action: "create a temporary folder",
            source,
        })?;
    }
    let git = git_for(url, home, limits, deadline, limits.total_time);
    let watch = DiskWatch {
        dir: dir.path().to_path_buf(),
        max_bytes: limits.max_bytes,
        interval: limits.poll_interval,
    };
    let mut ignore = |_: &[u8]| Ok(());
    tracing::debug!(url = %url.url(), commit = %resolved.commit, "fetching");

    let init = git
        .run(
            Stage::Init,
            &work_tree,
            &["init", "--quiet", "--template=", "."],
            None,
            &mut ignore,
        )
        .await?;
    if !init.success() {
        return Err(classify_failure(Stage::Init, &init, None));
    }
    // The repository's own `.gitattributes` could make the checkout larger than the tree's
    // blobs (`ident` expands every `$Id$`, `eol=crlf` and `working-tree-encoding` grow
    // files), past the size counted below before anything is written. This file outranks it.
    let info = work_tree.join(".git").join("info");
    std::fs::create_dir_all(&info)
        .and_then(|()| std::fs::write(info.join("attributes"), CHECKOUT_AS_STORED))
        .map_err(|source| FetchError::Io {
            action: "write the checkout's attributes",
            source,
        })?;

    let fetch_args = |what: &str| -> Vec<String> {
        [
            "fetch",
            "--quiet",
            "--no-tags",
            "--no-recurse-submodules",
            "--no-write-fetch-head",
            "--depth",
            "1",
            url.url().as_str(),
        ]
        .iter()
        .map(|s| (*s).to_string())
        .chain([format!("{what}:refs/fairlane/target")])
        .collect()
    };
    let by_id: Vec<String> = fetch_args(&resolved.commit);
    let by_id: Vec<&str> = by_id.iter().map(String::as_str).collect();
    let mut fetched = git
        .run(Stage::Fetch, &work_tree, &by_id, Some(&watch), &mut ignore)
        .await?;
    if !fetched.success()
        && let Some(name) = &resolved.ref_name
        && refused_the_id(&fetched, &resolved.commit)
    {
        // Some servers refuse fetching by object id; the ref name works everywhere.
        tracing::debug!(stderr = %fetched.stderr, "fetch by id refused, fetching by ref name");
        let by_name = fetch_args(name);
        let by_name: Vec<&str> = by_name.iter().map(String::as_str).collect();
        fetched = git
            .run(
                Stage::Fetch,
                &work_tree,
                &by_name,
                Some(&watch),
                &mut ignore,
            )
            .await?;
    }
    if !fetched.success() {
        let requested = resolved
            .requested
            .as_deref()
            .or(resolved.ref_name.as_deref());
        return Err(classify_failure(Stage::Fetch, &fetched, requested));
    }
    // The disk watch polls; settle the fetch stage exactly.
    let after_fetch = measure(dir.path()).await;
    if after_fetch > limits.max_bytes {
        return Err(FetchError::TooLarge {
            stage: Stage::Fetch,
            limit: limits.max_bytes,
        });
    }

    let mut commit_out: Vec<u8> = Vec::new();
    let rev = git
        .run(
            Stage::Inspect,
            &work_tree,
            &[
                "rev-parse",
                "--verify",
                "--quiet",
                "refs/fairlane/target^{commit}",
            ],
            None,
            &mut |c| {
                commit_out.extend_from_slice(&c[..c.len().min(256)]);
                Ok(())
            },
        )
        .await?;
    let commit = String::from_utf8_lossy(&commit_out)
        .trim()
        .to_ascii_lowercase();
    if !rev.success() || !is_object_id(&commit) {
        return Err(FetchError::Unusable {
            stage: Stage::Inspect,
            detail: "the fetched ref does not point to a commit".into(),
        });
    }

    // Count and size the tree (folders too) before writing any of it.
    let mut tree = TreeTally::new(limits.max_files);
    let listing = git
        .run(
            Stage::Inspect,
            &work_tree,
            &["ls-tree", "-r", "-t", "-l", "-z", "--full-tree", &commit],
            None,
            &mut |chunk| tree.feed(chunk),
        )
        .await?;
    if !listing.success() {
        return Err(classify_failure(Stage::Inspect, &listing, None));
    }
    if after_fetch.saturating_add(tree.bytes) > limits.max_bytes {
        return Err(FetchError::TooLarge {
            stage: Stage::Checkout,
            limit: limits.max_bytes,
        });
    }

    let checkout = git
        .run(
            Stage::Checkout,
            &work_tree,
            &["checkout", "--quiet", "--detach", &commit],
            Some(&watch),
            &mut ignore,
        )
        .await?;
    if !checkout.success() {
        return Err(classify_failure(Stage::Checkout, &checkout, None));
    }
    // Measured once more when done: the watch polls, and the last of the checkout (git's
    // index, written at the end) can fall between two of its measurements.
    if measure(dir.path()).await > limits.max_bytes {
        return Err(FetchError::TooLarge {
            stage: Stage::Checkout,
            limit: limits.max_bytes,
        });
    }
    tracing::debug!(url = %url.url(), %commit, files = tree.files, bytes = tree.bytes, "checked out");
    Ok(Checkout {
        commit,
        work_tree,
        dir,
    })
}

/// `.git/info/attributes` of every checkout: files are written exactly as stored.
const CHECKOUT_AS_STORED: &str = "* -text -eol -ident -filter -working-tree-encoding\n";

async fn measure(dir: &Path) -> u64 {
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || disk_usage(&dir))
        .await
        .unwrap_or(u64::MAX)
}

/// What a folder is reckoned to take on disk (one file system block).
const FOLDER_BYTES: u64 = BLOCK_BYTES;

/// What an entry of git's index takes besides its path: 62 bytes of stat data and object id,
/// and up to 8 of padding.
const INDEX_ENTRY_BYTES: u64 = 70;

/// What a file of `size` bytes at a path of `path_len` bytes takes once checked out: its
/// content in whole blocks, and its entry in git's index, which holds every path.
fn checked_out_bytes(size: u64, path_len: u64) -> u64 {
    in_blocks(size).saturating_add(INDEX_ENTRY_BYTES + path_len)
}

/// Counts the files and folders in `git ls-tree -r -t -l -z` output as it streams, with their
/// sizes. Folders count: a tree of a hundred thousand references to one deep chain of folders
/// is a few KiB of objects and millions of folders once checked out.
struct TreeTally {
    max_files: u64,
    files: u64,
    bytes: u64,
    partial: Vec<u8>,
}

impl TreeTally {
    fn new(max_files: u64) -> TreeTally {
        TreeTally {
            max_files,
            files: 0,
            bytes: 0,
            partial: Vec::new(),
        }
    }

    /// One more file or folder of `size` bytes.
    fn count(&mut self, size: u64) -> Result<(), FetchError> {
        self.files += 1;
        self.bytes = self.bytes.saturating_add(size);
        if self.files > self.max_files {
            return Err(FetchError::TooManyFiles {
                limit: self.max_files,
            });
        }
        Ok(())
    }

    fn feed(&mut self, chunk: &[u8]) -> Result<(), FetchError> {
        for &b in chunk {
            if b != 0 {
                if self.partial.len() < 8192 {
                    self.partial.push(b);
                }
                continue;
            }
            let record = std::mem::take(&mut self.partial);
            // "<mode> SP <type> SP <object> SP+ <size> TAB <path>"
            let meta = record.split(|&c| c == b'\t').next().unwrap_or(&[]);
            // Kept up to 8 KiB of the record, past git's longest path (4 KiB).
            let path_len = record.len().saturating_sub(meta.len() + 1) as u64;
            let fields: Vec<&[u8]> = meta
                .split(|&c| c == b' ')
                .filter(|f| !f.is_empty())
                .collect();
            match fields.get(1).copied() {
                Some(b"blob") => {
                    let size = fields
                        .get(3)
                        .and_then(|s| std::str::from_utf8(s).ok())
                        .and_then(|s| s.parse::<u64>().ok())
                        .unwrap_or(0);
                    self.count(checked_out_bytes(size, path_len))?;
                }
                // A submodule link (`commit`) is checked out as an empty folder, submodules off
                // or not, with an entry in the index: it counts as one, or a tree of millions of
                // links would pass the cap.
                Some(b"commit") => self.count(FOLDER_BYTES + INDEX_ENTRY_BYTES + path_len)?,
                Some(b"tree") => self.count(FOLDER_BYTES)?,
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ref_names() {
        for ok in [
            "main",
            "feature/x",
            "v1.2.3",
            "refs/heads/main",
            "release-2024_01",
        ] {
            validate_ref_name(ok).unwrap();
        }
        for bad in [
            "", "-x", "a b", "a..b", "a~1", "a^", "a:b", "a?", "a*", "a[", "a\\b", "/a", "a/",
            "a.", "a.lock", "a/.b", "@", "a@{1}", "a//b", "é",
        ] {
            assert!(
                matches!(validate_ref_name(bad), Err(FetchError::InvalidRef { .. })),
                "{bad:?}"
            );
        }
        assert!(is_object_id(&"a".repeat(40)));
        assert!(is_object_id(&"A".repeat(64)));
        assert!(!is_object_id(&"a".repeat(39)));
        assert!(!is_object_id(&"g".repeat(40)));
    }

    #[test]
    fn tree_tally_counts_blobs_folders_and_submodule_links_across_chunks() {
        let listing = b"040000 tree dddd       -\tsrc\x00100644 blob aaaa     12\tsrc/a.rs\x00160000 commit bbbb       -\tsub\x00100755 blob cccc 30\tx y\0";
        let mut tally = TreeTally::new(10);
        for chunk in listing.chunks(7) {
            tally.feed(chunk).unwrap();
        }
        // Two blobs of a block each, two folders, and the index entries of the blobs and the
        // link, with their paths (`src/a.rs`, `sub`, `x y`).
        assert_eq!(
            (tally.files, tally.bytes),
            (
                4,
                2 * BLOCK_BYTES + 2 * FOLDER_BYTES + 3 * INDEX_ENTRY_BYTES + (8 + 3 + 3)
            )
        );
        assert_eq!(checked_out_bytes(0, 1), INDEX_ENTRY_BYTES + 1);
        assert_eq!(
            checked_out_bytes(4097, 0),
            2 * BLOCK_BYTES + INDEX_ENTRY_BYTES
        );
        let mut small = TreeTally::new(1);
        assert!(matches!(
            small.feed(listing),
            Err(FetchError::TooManyFiles { limit: 1 })
        ));
        // Submodule links alone: each becomes a folder at checkout.
        let links = b"160000 commit bbbb -\ta\x00160000 commit bbbb -\tb\x00";
        assert!(matches!(
            TreeTally::new(1).feed(links),
            Err(FetchError::TooManyFiles { limit: 1 })
        ));
    }

    /// A git that exited 128 having said `stderr`, under a 1 GiB memory cap.
    fn failed(stderr: &str) -> GitOutput {
        use std::os::unix::process::ExitStatusExt;
        GitOutput {
            status: std::process::ExitStatus::from_raw(128 << 8),
            stderr: stderr.to_owned(),
            memory_cap: 1 << 30,
        }
    }

    #[test]
    fn content_git_refuses_is_permanent_and_a_dropped_transfer_is_not() {
        for (stage, stderr) in [
            (
                Stage::Checkout,
                "error: invalid path 'src\\a.rs'\nfatal: unable to checkout working tree",
            ),
            (
                Stage::Fetch,
                "error: object 1d4f: badTimezone: invalid author/committer line - bad time zone\n\
                 fatal: fsck error in packed object\nfatal: fetch-pack: invalid index-pack output",
            ),
        ] {
            let e = classify_failure(stage, &failed(stderr), None);
            assert!(matches!(e, FetchError::Unusable { .. }), "{e}");
            assert!(e.is_permanent(), "{e}");
        }
        let dropped = classify_failure(
            Stage::Fetch,
            &failed("fatal: early EOF\nfatal: fetch-pack: invalid index-pack output"),
            None,
        );
        assert!(matches!(dropped, FetchError::Git { .. }), "{dropped}");
        assert!(!dropped.is_permanent());
    }

    #[test]
    fn only_an_object_id_and_a_valid_ref_name_reach_gits_command_line() {
        let resolved = |commit: &str, name: Option<&str>| ResolvedRef {
            requested: None,
            ref_name: name.map(str::to_owned),
            commit: commit.to_owned(),
        };
        let sha = "a".repeat(40);
        for fine in [None, Some("HEAD"), Some("main"), Some("refs/heads/main")] {
            check_fetchable(&resolved(&sha, fine)).unwrap();
        }
        for (commit, name) in [
            ("--upload-pack=touch /tmp/pwned #", None),
            (sha.as_str(), Some("--upload-pack=touch /tmp/pwned #")),
            (sha.as_str(), Some("-c")),
            ("a".repeat(39).as_str(), None),
            ("", None),
        ] {
            assert!(
                matches!(
                    check_fetchable(&resolved(commit, name)),
                    Err(FetchError::InvalidRef { .. })
                ),
                "{commit:?} {name:?}"
            );
        }
    }

    #[test]
    fn only_a_server_refusing_the_id_sends_the_fetch_to_the_ref_name() {
        let commit = "1d4f".repeat(10);
        for refusal in [
            format!("error: Server does not allow request for unadvertised object {commit}"),
            format!("fatal: remote error: upload-pack: not our ref {commit}"),
            format!("fatal: couldn't find remote ref {commit}"),
        ] {
            assert!(refused_the_id(&failed(&refusal), &commit), "{refusal}");
        }
        for passing in [
            "fatal: unable to access 'https://git.example/o/r/': Connection reset by peer",
            "error: RPC failed; HTTP 502 curl 22 The requested URL returned error: 502\n\
             fatal: expected flush after ref listing",
            "fatal: early EOF\nfatal: fetch-pack: invalid index-pack output",
            "fatal: Out of memory, malloc failed (tried to allocate 300000001 bytes)",
            "fatal: unable to access 'https://git.example/o/r/': Could not resolve host: git.example",
            "fatal: repository 'https://git.example/o/r/' not found",
        ] {
            assert!(!refused_the_id(&failed(passing), &commit), "{passing}");
        }
    }

    #[test]
    fn only_gits_own_shortage_of_memory_is_out_of_memory() {
        let ours = failed(
            "fatal: Out of memory, malloc failed (tried to allocate 300000001 bytes)\n\
             fatal: fetch-pack: invalid index-pack output",
        );
        assert!(matches!(
            classify_failure(Stage::Fetch, &ours, None),
            FetchError::OutOfMemory {
                stage: Stage::Fetch,
                limit: 1073741824
            }
        ));
        let mapped = failed("fatal: mmap failed: Cannot allocate memory");
        assert!(matches!(
            classify_failure(Stage::Checkout, &mapped, None),
            FetchError::OutOfMemory { .. }
        ));
        // Killed by a signal nobody here sent: the out-of-memory killer, most likely.
        let killed = GitOutput {
            status: std::os::unix::process::ExitStatusExt::from_raw(9),
            ..failed("")
        };
        let e = classify_failure(Stage::Fetch, &killed, None);
        assert!(
            matches!(
                e,
                FetchError::Killed {
                    stage: Stage::Fetch
                }
            ) && !e.is_permanent(),
            "{e:?}"
        );
        // The server ran short: not this repository's fault here, and it may pass.
        let theirs = failed(
            "remote: fatal: Out of memory, malloc failed\n\
             fatal: early EOF",
        );
        assert!(matches!(
            classify_failure(Stage::Fetch, &theirs, None),
            FetchError::Git { .. }
        ));
    }

    #[test]
    fn failures_that_cannot_pass_are_told_apart_from_the_networks() {
        // A plain 404 of a git-http-backend host.
        let gone = failed("fatal: repository 'https://git.example.org/o/r/' not found");
        assert!(matches!(
            classify_failure(Stage::Resolve, &gone, None),
            FetchError::RepositoryNotFound
        ));
        // A deleted branch whose name holds a network word.
        let branch = failed("fatal: couldn't find remote ref update-openssl");
        assert!(matches!(
            classify_failure(Stage::Fetch, &branch, Some("update-openssl")),
            FetchError::RefNotFound { .. }
        ));
        // TLS trouble, as git reports it.
        let tls = failed(
            "fatal: unable to access 'https://git.example.org/o/r/': SSL certificate problem: \
             self-signed certificate",
        );
        assert!(matches!(
            classify_failure(Stage::Resolve, &tls, None),
            FetchError::Unreachable { .. }
        ));
        let refused = failed(
            "fatal: unable to access 'https://git.example.org/o/r/': Failed to connect to \
             git.example.org port 443: Connection refused",
        );
        assert!(matches!(
            classify_failure(Stage::Resolve, &refused, None),
            FetchError::Unreachable { .. }
        ));
    }

    #[test]
    fn last_lines_redacts_and_truncates() {
        let text = "a\n\nremote: https://u:p@h/x\nb\nc";
        assert_eq!(
            last_lines(text),
            "https://***@h/x / b / c".replace("https", "remote: https")
        );
        assert!(last_lines(&"x".repeat(2000)).chars().count() <= 601);
    }
}
