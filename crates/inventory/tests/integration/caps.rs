//! The caps: bytes, files and time; and that checkout folders disappear in every case
//! (success, error, timeout, cancellation, panic) and after crashes (`sweep_stale`).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use inventory::fetch::{
    Checkout, FetchError, Limits, Stage, fetch, process_start_time, sweep_stale,
};
use inventory::url_policy::vet_url;
use inventory::{AnalyzeError, analyze};

use crate::support::{
    GitFixture, TempDir, leftovers, limits, policy, processes_mentioning, random_bytes,
};

fn capped(root: &Path, max_bytes: u64, max_files: u64) -> Limits {
    Limits {
        max_bytes,
        max_files,
        poll_interval: Duration::from_millis(10),
        ..limits(root)
    }
}

/// Fetches `repo` at `git_ref` under `root` within `max_bytes` and `max_files`; returns the caps
/// (whose `work_root` the test checks for leftovers) and what the fetch gave.
async fn fetch_capped(
    repo: &GitFixture,
    git_ref: Option<&str>,
    root: &Path,
    max_bytes: u64,
    max_files: u64,
) -> (Limits, Result<Checkout, FetchError>) {
    let limits = capped(root, max_bytes, max_files);
    let url = vet_url(&repo.url(), &policy()).await.unwrap();
    let fetched = fetch(&url, git_ref, &limits).await;
    (limits, fetched)
}

#[tokio::test]
async fn an_incompressible_repository_over_the_byte_cap_fails_while_fetching() {
    let repo = GitFixture::new("caps-random");
    repo.write("small.txt", "fine");
    repo.write("blob.bin", random_bytes(8 * 1024 * 1024));
    repo.commit("big");
    let root = TempDir::new("caps-random-work");
    let limits = capped(root.path(), 1024 * 1024, 1000);
    let err = analyze(&repo.url(), None, &limits, &policy())
        .await
        .unwrap_err();
    match &err {
        AnalyzeError::Fetch(FetchError::TooLarge { stage, limit }) => {
            assert_eq!(*stage, Stage::Fetch);
            assert_eq!(*limit, 1024 * 1024);
        }
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains("too large"), "{err}");
    assert!(err.is_permanent());
    assert_eq!(leftovers(&limits.work_root), Vec::<String>::new());
}

#[tokio::test]
async fn a_compressible_repository_over_the_byte_cap_is_refused_before_checkout() {
    // 16 MiB of zeros packs to a few KiB: the fetch passes, the tree listing refuses it.
    let repo = GitFixture::new("caps-zeros");
    repo.write("zeros.bin", vec![0u8; 16 * 1024 * 1024]);
    repo.commit("zeros");
    let root = TempDir::new("caps-zeros-work");
    let (limits, fetched) = fetch_capped(&repo, None, root.path(), 1024 * 1024, 1000).await;
    let err = fetched.unwrap_err();
    assert!(
        matches!(
            err,
            FetchError::TooLarge {
                stage: Stage::Checkout,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(leftovers(&limits.work_root), Vec::<String>::new());
}

#[tokio::test]
async fn a_blob_that_inflates_past_the_memory_cap_fails_the_fetch() {
    // 192 MiB of zeros: a pack of a few hundred KiB, far under the byte cap, that git's
    // index-pack inflates whole in memory to hash it. Repacked, so the serving side (a local
    // upload-pack, under the same cap) copies it without inflating.
    let repo = GitFixture::new("caps-memory");
    repo.write("zeros.bin", vec![0u8; 192 * 1024 * 1024]);
    repo.commit("zeros");
    repo.git(&["repack", "-a", "-d", "-q"]);
    let root = TempDir::new("caps-memory-work");
    let url = vet_url(&repo.url(), &policy()).await.unwrap();
    let limits = Limits {
        max_git_memory: 128 * 1024 * 1024,
        ..capped(root.path(), 64 * 1024 * 1024, 1000)
    };
    let err = fetch(&url, None, &limits).await.unwrap_err();
    match &err {
        FetchError::OutOfMemory { stage, limit } => {
            assert_eq!(*stage, Stage::Fetch);
            assert_eq!(*limit, 128 * 1024 * 1024);
        }
        other => panic!("{other}"),
    }
    assert_eq!(
        err.to_string(),
        "the repository needs more memory than allowed: over 134217728 bytes while fetching"
    );
    assert!(err.is_permanent());
    assert_eq!(leftovers(&limits.work_root), Vec::<String>::new());

    // With room for the blob, the same fetch passes and the byte cap refuses the checkout.
    let roomy = Limits {
        max_git_memory: 1024 * 1024 * 1024,
        ..limits.clone()
    };
    let err = fetch(&url, None, &roomy).await.unwrap_err();
    assert!(
        matches!(
            err,
            FetchError::TooLarge {
                stage: Stage::Checkout,
                ..
            }
        ),
        "{err}"
    );
}

#[tokio::test]
async fn too_many_files_are_refused_before_checkout() {
    let repo = GitFixture::new("caps-files");
    for i in 0..150 {
        repo.write(&format!("dir{}/f{i}.txt", i % 7), format!("{i}"));
    }
    repo.commit("many");
    let root = TempDir::new("caps-files-work");
    let (limits, fetched) = fetch_capped(&repo, None, root.path(), 64 * 1024 * 1024, 100).await;
    let err = fetched.unwrap_err();
    assert!(
        matches!(err, FetchError::TooManyFiles { limit: 100 }),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "the repository has too many files and folders: more than 100"
    );
    assert_eq!(leftovers(&limits.work_root), Vec::<String>::new());

    // The same repository within the caps (150 files in 7 folders) checks out fully.
    let (_, fetched) = fetch_capped(&repo, None, root.path(), 64 * 1024 * 1024, 157).await;
    let checkout = fetched.unwrap();
    assert!(checkout.path().join("dir3/f3.txt").is_file());
    drop(checkout);
    assert_eq!(leftovers(&limits.work_root), Vec::<String>::new());
}

/// A repository whose commit object is a FIFO: `git ls-remote` works (refs only), but serving
/// the commit blocks forever on opening it, like a server that stalls mid-fetch.
fn stalling_repository(tag: &str) -> (GitFixture, String) {
    let repo = GitFixture::new(tag);
    repo.write("a.txt", "a");
    let commit = repo.commit("a");
    repo.stall(&commit);
    (repo, commit)
}

#[tokio::test]
async fn a_stalled_fetch_is_killed_at_the_time_cap() {
    let (repo, commit) = stalling_repository("caps-stall");
    let root = TempDir::new("caps-stall-work");
    let limits = Limits {
        total_time: Duration::from_secs(2),
        ..limits(root.path())
    };
    let url = vet_url(&repo.url(), &policy()).await.unwrap();
    let repo_path = repo.path().display().to_string();

    // By commit id: no ls-remote, so the stall hits `git fetch`.
    let started = Instant::now();
    let err = fetch(&url, Some(&commit), &limits).await.unwrap_err();
    let elapsed = started.elapsed();
    match &err {
        FetchError::TimedOut { stage, limit } => {
            assert_eq!(*stage, Stage::Fetch);
            assert_eq!(*limit, Duration::from_secs(2));
        }
        other => panic!("{other}"),
    }
    assert!(
        err.to_string().starts_with("timed out while fetching"),
        "{err}"
    );
    // Generous bound: only proves the cap, not the speed, ended it.
    assert!(elapsed < Duration::from_secs(30), "{elapsed:?}");
    assert_eq!(leftovers(&limits.work_root), Vec::<String>::new());
    // The whole process group is gone: nothing still serves the fixture.
    assert_eq!(processes_mentioning(&repo_path), Vec::new());

    // By branch: serving the ref listing stalls too, and resolving is capped the same way.
    let resolve_capped = Limits {
        resolve_time: Duration::from_secs(1),
        ..limits.clone()
    };
    let err = fetch(&url, Some("main"), &resolve_capped)
        .await
        .unwrap_err();
    assert!(
        matches!(err, FetchError::TimedOut { stage: Stage::Resolve, limit } if limit == Duration::from_secs(1)),
        "{err}"
    );
    assert_eq!(leftovers(&limits.work_root), Vec::<String>::new());
    assert_eq!(processes_mentioning(&repo_path), Vec::new());
}

#[tokio::test]
async fn a_cancelled_fetch_kills_git_and_removes_its_folder() {
    let (repo, _) = stalling_repository("caps-cancel");
    let root = TempDir::new("caps-cancel-work");
    let limits = limits(root.path());
    let url = vet_url(&repo.url(), &policy()).await.unwrap();
    let repo_path = repo.path().display().to_string();
    // Wait until git is actually stuck serving the repository, then drop the future.
    let mut fetching = Box::pin(fetch(&url, None, &limits));
    let mut saw_git = false;
    for _ in 0..200 {
        tokio::select! {
            result = &mut fetching => panic!("fetch finished: {result:?}"),
            () = tokio::time::sleep(Duration::from_millis(25)) => {}
        }
        if processes_mentioning(&repo_path)
            .iter()
            .any(|(_, cmdline)| cmdline.contains("upload-pack"))
        {
            saw_git = true;
            break;
        }
    }
    assert!(saw_git, "git never started serving the fixture");
    assert_eq!(leftovers(&limits.work_root).len(), 1);
    drop(fetching);
    // Killing is immediate; reaping may take a moment.
    let mut remaining = processes_mentioning(&repo_path);
    for _ in 0..100 {
        if remaining.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        remaining = processes_mentioning(&repo_path);
    }
    assert_eq!(remaining, Vec::new());
    assert_eq!(leftovers(&limits.work_root), Vec::<String>::new());
}

#[tokio::test]
async fn a_panic_while_holding_a_checkout_removes_its_folder() {
    let repo = GitFixture::new("caps-panic");
    repo.write("a.txt", "a");
    repo.commit("a");
    let root = TempDir::new("caps-panic-work");
    let limits = limits(root.path());
    let url = vet_url(&repo.url(), &policy()).await.unwrap();
    let checkout = fetch(&url, None, &limits).await.unwrap();
    let folder = checkout.folder().to_path_buf();
    assert!(checkout.path().join("a.txt").is_file());
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let _held = checkout;
        panic!("worker bug");
    }));
    assert!(outcome.is_err());
    assert!(!folder.exists());
    assert_eq!(leftovers(&limits.work_root), Vec::<String>::new());
}

#[test]
fn sweep_removes_folders_of_dead_processes_and_keeps_live_ones() {
    let root = TempDir::new("sweep");
    let make = |name: &str| {
        let dir = root.path().join(name);
        std::fs::create_dir_all(dir.join("repo/.git")).unwrap();
        std::fs::write(dir.join("repo/file"), "x").unwrap();
        dir
    };
    // A process that has exited.
    let mut dead = Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    // A process that is alive (another one than this test).
    let mut alive = Command::new("sleep").arg("30").spawn().unwrap();
    let alive_pid = alive.id() as i32;
    let alive_start = process_start_time(alive_pid);
    let own_pid = std::process::id() as i32;
    let own_start = process_start_time(own_pid);

    let dead_dir = make(&format!("fairlane-inv-{dead_pid}-0-1x0"));
    let alive_dir = make(&format!("fairlane-inv-{alive_pid}-{alive_start}-1x0"));
    let own_dir = make(&format!("fairlane-inv-{own_pid}-{own_start}-1x0"));
    // Our pid, but another start time: a previous process that had the same pid.
    let reused_dir = make(&format!("fairlane-inv-{own_pid}-{}-1x0", own_start + 1));
    let unrelated_dir = make("someone-elses-folder");
    let malformed_dir = make("fairlane-inv-notapid");
    std::fs::write(
        root.path().join("fairlane-inv-1-1-file"),
        "a file, not a folder",
    )
    .unwrap();

    let report = sweep_stale(root.path()).unwrap();
    alive.kill().unwrap();
    alive.wait().unwrap();

    let mut removed = report.removed.clone();
    removed.sort();
    let mut expected_removed = vec![dead_dir.clone(), reused_dir.clone()];
    expected_removed.sort();
    assert_eq!(removed, expected_removed);
    assert!(!dead_dir.exists() && !reused_dir.exists());
    for kept in [&alive_dir, &own_dir, &unrelated_dir, &malformed_dir] {
        assert!(kept.exists(), "{} should be kept", kept.display());
    }
    assert!(report.kept.contains(&alive_dir) && report.kept.contains(&own_dir));
    assert!(root.path().join("fairlane-inv-1-1-file").exists());

    // A missing root is fine.
    assert_eq!(
        sweep_stale(&root.path().join("absent")).unwrap(),
        Default::default()
    );
}

/// Small files count at what they take on disk: a block each, and their entry in git's index
/// (which holds every path). 3,000 one-byte files are 3 KB by their sizes and 12 MB checked
/// out, and used to pass a 4 MiB cap.
#[tokio::test]
async fn small_files_count_at_what_they_take_on_disk_before_checkout() {
    let repo = GitFixture::new("caps-small-files");
    for n in 0..3_000 {
        repo.write(&format!("f/{n}.txt"), "x");
    }
    repo.commit("many small files");
    let root = TempDir::new("caps-small-files-work");
    let (limits, fetched) = fetch_capped(&repo, None, root.path(), 4 * 1024 * 1024, 10_000).await;
    let err = fetched.unwrap_err();
    assert!(
        matches!(
            err,
            FetchError::TooLarge {
                stage: Stage::Checkout,
                limit: 4_194_304
            }
        ),
        "{err}"
    );
    assert_eq!(leftovers(&limits.work_root), Vec::<String>::new());
    // Within a cap that holds them, the checkout passes, and measures no more than reckoned.
    let (_, fetched) = fetch_capped(&repo, None, root.path(), 64 * 1024 * 1024, 10_000).await;
    let checkout = fetched.unwrap();
    let used = inventory::fetch::disk_usage(checkout.folder());
    assert!(
        (3_000 * 4096..64 * 1024 * 1024).contains(&used),
        "{used} bytes on disk"
    );
}

#[tokio::test]
async fn folders_count_against_the_file_cap_before_checkout() {
    // Three files, but at the end of a chain of twenty folders: a crafted tree can reference one
    // such chain a hundred thousand times, millions of folders for a few KiB of objects.
    let repo = GitFixture::new("caps-folders");
    let chain = vec!["d"; 20].join("/");
    for name in ["a", "b", "c"] {
        repo.write(&format!("{chain}/{name}.txt"), name);
    }
    repo.commit("deep");
    let root = TempDir::new("caps-folders-work");
    let (limits, fetched) = fetch_capped(&repo, None, root.path(), 64 * 1024 * 1024, 10).await;
    let err = fetched.unwrap_err();
    assert!(
        matches!(err, FetchError::TooManyFiles { limit: 10 }),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "the repository has too many files and folders: more than 10"
    );
    assert_eq!(leftovers(&limits.work_root), Vec::<String>::new());
}

#[tokio::test]
async fn the_repository_attributes_do_not_change_what_is_checked_out() {
    // `ident` expands every `$Id$` (47 bytes each) and `eol=crlf` adds a byte per line: a
    // checkout larger than the blobs counted before it, unless files are written as stored.
    let repo = GitFixture::new("caps-attributes");
    repo.write(".gitattributes", "* ident eol=crlf\n");
    repo.write("a.txt", "$Id$\nline\n");
    repo.commit("attributes");
    let root = TempDir::new("caps-attributes-work");
    let (_, fetched) = fetch_capped(&repo, None, root.path(), 64 * 1024 * 1024, 100).await;
    let checkout = fetched.unwrap();
    assert_eq!(
        std::fs::read_to_string(checkout.path().join("a.txt")).unwrap(),
        "$Id$\nline\n"
    );
}

#[tokio::test]
async fn a_tag_of_a_tree_is_refused_for_good() {
    // Like the Linux kernel's `v2.6.11-tree`: a ref that names a tree, not a commit. Every try
    // would end the same way, so it is not retried.
    let repo = GitFixture::new("tree-tag");
    repo.write("a.txt", "a");
    repo.commit("one");
    repo.git(&["tag", "tree-tag", "HEAD^{tree}"]);
    let root = TempDir::new("tree-tag-work");
    let (limits, fetched) =
        fetch_capped(&repo, Some("tree-tag"), root.path(), 64 * 1024 * 1024, 100).await;
    let err = fetched.unwrap_err();
    assert!(matches!(err, FetchError::Unusable { .. }), "{err:?}");
    assert!(err.is_permanent(), "{err:?}");
    assert_eq!(leftovers(&limits.work_root), Vec::<String>::new());
}
