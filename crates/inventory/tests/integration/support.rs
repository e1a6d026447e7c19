//! Test helpers: the URL policy and limits the tests use, and the git fixtures of `testkit`.

use std::path::Path;
use std::time::Duration;

use inventory::{Limits, UrlPolicy};

pub(crate) use testkit::git_fixture::{
    GitFixture, TempDir, entries as leftovers, processes_mentioning, random_bytes,
};

/// Test policy: file URLs allowed, everything else as in production.
pub(crate) fn policy() -> UrlPolicy {
    UrlPolicy::with_file_urls(true)
}

/// Default limits with checkouts under `root/work`.
pub(crate) fn limits(root: &Path) -> Limits {
    Limits {
        work_root: root.join("work"),
        total_time: Duration::from_secs(60),
        ..Limits::default()
    }
}
