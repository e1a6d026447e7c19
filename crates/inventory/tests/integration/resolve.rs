//! Ref resolution without cloning (`git ls-remote`) and fetching at a resolved commit.

use inventory::fetch::{FetchError, fetch, fetch_commit, resolve_ref};
use inventory::url_policy::vet_url;

use crate::support::{GitFixture, TempDir, leftovers, limits, policy};

#[tokio::test]
async fn a_moving_ref_resolves_to_each_commit_and_a_fixed_one_identically() {
    let repo = GitFixture::new("resolve-moving");
    repo.write("a.txt", "one");
    let first = repo.commit("first");
    let root = TempDir::new("resolve-moving-work");
    let limits = limits(root.path());
    let url = vet_url(&repo.url(), &policy()).await.unwrap();

    let main_1 = resolve_ref(&url, Some("main"), &limits).await.unwrap();
    let head_1 = resolve_ref(&url, None, &limits).await.unwrap();
    assert_eq!(main_1.commit, first);
    assert_eq!(main_1.ref_name.as_deref(), Some("refs/heads/main"));
    assert_eq!(head_1.commit, first);
    assert_eq!(head_1.ref_name.as_deref(), Some("HEAD"));
    // Same commit, same answer.
    assert_eq!(
        resolve_ref(&url, Some("main"), &limits).await.unwrap(),
        main_1
    );

    repo.write("a.txt", "two");
    let second = repo.commit("second");
    assert_ne!(first, second);
    let main_2 = resolve_ref(&url, Some("main"), &limits).await.unwrap();
    assert_eq!(main_2.commit, second);
    assert_ne!(main_2.commit, main_1.commit);
    assert_eq!(
        resolve_ref(&url, Some("refs/heads/main"), &limits)
            .await
            .unwrap()
            .commit,
        second
    );

    // Fetching the first resolution still gets the first commit (fetched by id).
    let checkout = fetch_commit(&url, &main_1, &limits).await.unwrap();
    assert_eq!(checkout.commit(), first);
    assert_eq!(
        std::fs::read_to_string(checkout.path().join("a.txt")).unwrap(),
        "one"
    );
    let folder = checkout.folder().to_path_buf();
    assert!(folder.exists());
    drop(checkout);
    assert!(!folder.exists());
    assert_eq!(leftovers(&limits.work_root), Vec::<String>::new());
}

#[tokio::test]
async fn tags_commit_ids_and_missing_refs() {
    let repo = GitFixture::new("resolve-tags");
    repo.write("a.txt", "one");
    let first = repo.commit("first");
    repo.git(&["tag", "-a", "v1.0", "-m", "release"]);
    repo.git(&["tag", "light"]);
    repo.git(&["branch", "feature"]);
    repo.write("a.txt", "two");
    let second = repo.commit("second");
    let root = TempDir::new("resolve-tags-work");
    let limits = limits(root.path());
    let url = vet_url(&repo.url(), &policy()).await.unwrap();

    // An annotated tag resolves to the commit it points at, not the tag object.
    let tag = resolve_ref(&url, Some("v1.0"), &limits).await.unwrap();
    assert_eq!(tag.commit, first);
    assert_eq!(tag.ref_name.as_deref(), Some("refs/tags/v1.0"));
    assert_eq!(
        resolve_ref(&url, Some("light"), &limits)
            .await
            .unwrap()
            .commit,
        first
    );
    assert_eq!(
        resolve_ref(&url, Some("feature"), &limits)
            .await
            .unwrap()
            .commit,
        first
    );

    // A full commit id is taken as is, without asking the remote.
    let upper = second.to_uppercase();
    let by_id = resolve_ref(&url, Some(&upper), &limits).await.unwrap();
    assert_eq!(by_id.commit, second);
    assert_eq!(by_id.ref_name, None);

    match resolve_ref(&url, Some("nope"), &limits).await {
        Err(FetchError::RefNotFound { git_ref, hint }) => {
            assert_eq!(git_ref, "nope");
            assert_eq!(hint, "");
        }
        other => panic!("{other:?}"),
    }
    let short = &first[..7];
    let err = resolve_ref(&url, Some(short), &limits).await.unwrap_err();
    assert!(err.to_string().contains("full 40-character id"), "{err}");
    assert!(matches!(
        resolve_ref(&url, Some("bad..ref"), &limits).await,
        Err(FetchError::InvalidRef { .. })
    ));

    // Fetching by tag name checks out the tagged commit.
    let checkout = fetch(&url, Some("v1.0"), &limits).await.unwrap();
    assert_eq!(checkout.commit(), first);
    drop(checkout);
    assert_eq!(leftovers(&limits.work_root), Vec::<String>::new());
}

#[tokio::test]
async fn missing_repositories_commits_and_empty_repositories() {
    let root = TempDir::new("resolve-missing-work");
    let limits = limits(root.path());

    let gone = format!("file://{}/does-not-exist", root.path().display());
    let url = vet_url(&gone, &policy()).await.unwrap();
    let err = resolve_ref(&url, None, &limits).await.unwrap_err();
    assert!(matches!(err, FetchError::RepositoryNotFound), "{err}");
    assert!(err.is_permanent());

    let empty = GitFixture::new("resolve-empty");
    let url = vet_url(&empty.url(), &policy()).await.unwrap();
    let err = resolve_ref(&url, None, &limits).await.unwrap_err();
    assert!(matches!(err, FetchError::EmptyRepository), "{err}");

    // A well-formed commit id the repository does not have fails at fetch time.
    let repo = GitFixture::new("resolve-unknown-commit");
    repo.write("a", "a");
    repo.commit("a");
    let url = vet_url(&repo.url(), &policy()).await.unwrap();
    let unknown = "0123456789abcdef0123456789abcdef01234567";
    let err = fetch(&url, Some(unknown), &limits).await.unwrap_err();
    assert!(
        matches!(&err, FetchError::RefNotFound { git_ref, .. } if git_ref == unknown),
        "{err}"
    );
    assert_eq!(leftovers(&limits.work_root), Vec::<String>::new());
}

/// A repository above the work folder (a deploy checkout that holds `ANALYZER_WORK_DIR`) lends
/// git none of its config: `git ls-remote`, run in a scratch folder that is no repository, used
/// to search upwards and read it, so its `url.<base>.insteadOf` sent a vetted URL elsewhere.
#[tokio::test]
async fn a_repository_above_the_work_folder_lends_git_no_config() {
    let wanted = GitFixture::new("ceiling-wanted");
    wanted.write("a.txt", "wanted");
    let commit = wanted.commit("wanted");
    let elsewhere = GitFixture::new("ceiling-elsewhere");
    elsewhere.write("b.txt", "elsewhere");
    elsewhere.commit("elsewhere");
    let above = GitFixture::new("ceiling-above");
    above.git(&[
        "config",
        &format!("url.{}.insteadOf", elsewhere.url()),
        &wanted.url(),
    ]);
    let limits = limits(above.path());
    let url = vet_url(&wanted.url(), &policy()).await.unwrap();
    let resolved = resolve_ref(&url, Some("main"), &limits).await.unwrap();
    assert_eq!(resolved.commit, commit);
}
