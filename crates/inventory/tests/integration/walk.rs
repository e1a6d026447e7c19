//! The tree walk on its own (no git): exclusions, symlinks, the size cap and the file cap.

use inventory::scan::{ScanError, ScanOptions, scan_tree};

use crate::support::TempDir;

fn write(root: &std::path::Path, rel: &str, contents: &str) {
    let path = root.join(rel);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, contents).unwrap();
}

#[test]
fn skips_excluded_folders_symlinks_and_oversized_files() {
    let dir = TempDir::new("walk");
    let root = dir.path();
    let test_fn = "#[test]\nfn counted() {}\n";
    write(root, "src/lib.rs", test_fn);
    write(root, ".hidden/lib.rs", test_fn);
    write(root, "target/debug/build.rs", test_fn);
    write(root, "vendor/dep/lib.rs", test_fn);
    write(
        root,
        "pkg/testdata/x_test.go",
        "package x\nfunc TestX(t *testing.T) {}\n",
    );
    let big = format!("{test_fn}// {}\n", "x".repeat(4096));
    write(root, "src/big.rs", &big);
    // A symlink to a test file and one to a folder outside the tree: neither is followed.
    let outside = TempDir::new("walk-outside");
    write(outside.path(), "outside.rs", test_fn);
    std::os::unix::fs::symlink(root.join("src/lib.rs"), root.join("src/link.rs")).unwrap();
    std::os::unix::fs::symlink(outside.path(), root.join("escape")).unwrap();

    let options = ScanOptions {
        max_file_bytes: 1024,
        ..ScanOptions::default()
    };
    let inventory = scan_tree(root, &options).unwrap();
    let paths: Vec<_> = inventory.files.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(paths, ["src/lib.rs"]);
    assert_eq!(inventory.totals.overall.tests, 1);
    assert_eq!(inventory.stats.files_too_large, 1);
    assert_eq!(inventory.stats.symlinks_skipped, 2);
    assert_eq!(inventory.stats.files_scanned, 1);
    assert_eq!(inventory.stats.files_visited, 2);

    let capped = ScanOptions {
        max_files: 1,
        ..ScanOptions::default()
    };
    assert!(matches!(
        scan_tree(root, &capped),
        Err(ScanError::TooManyFiles { limit: 1 })
    ));
    let few_tests = ScanOptions {
        max_tests: 0,
        ..ScanOptions::default()
    };
    assert!(matches!(
        scan_tree(root, &few_tests),
        Err(ScanError::TooManyTests { limit: 0 })
    ));
    assert_stops_at_a_past_deadline(root);
}

/// Go benchmarks, fuzz targets and examples count towards the repository's caps like tests: a
/// few files of tiny `func ExampleN() {}` lines used to pass every cap, however many they held.
#[test]
fn go_benchmarks_and_examples_count_towards_the_repository_caps() {
    let dir = TempDir::new("walk-examples");
    let source = format!(
        "package p\n{}",
        (0..4_000)
            .map(|n| format!("func Example{n}() {{}}\nfunc Benchmark{n}(b *testing.B) {{}}\n"))
            .collect::<String>()
    );
    for n in 0..3 {
        write(dir.path(), &format!("p{n}/x_test.go"), &source);
    }
    let inventory = scan_tree(dir.path(), &ScanOptions::default()).unwrap();
    assert_eq!(inventory.totals.overall.examples, 12_000);
    assert_eq!(inventory.totals.overall.benchmarks, 12_000);
    let few = ScanOptions {
        max_tests: 20_000,
        ..ScanOptions::default()
    };
    assert!(matches!(
        scan_tree(dir.path(), &few),
        Err(ScanError::TooManyTests { limit: 20_000 })
    ));
    let small = ScanOptions {
        max_test_bytes: 1 << 20,
        ..ScanOptions::default()
    };
    assert!(matches!(
        scan_tree(dir.path(), &small),
        Err(ScanError::TooLarge { limit: 1_048_576 })
    ));
}

/// A scan of `root` whose deadline has passed stops with `TimedOut`.
fn assert_stops_at_a_past_deadline(root: &std::path::Path) {
    let past_deadline = ScanOptions {
        deadline: Some(std::time::Instant::now()),
        ..ScanOptions::default()
    };
    assert!(matches!(
        scan_tree(root, &past_deadline),
        Err(ScanError::TimedOut)
    ));
}

#[test]
fn a_cancelled_scan_stops() {
    let dir = TempDir::new("walk-cancel");
    write(dir.path(), "a/b/lib.rs", "#[test] fn t() {}");
    let cancel = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let cancelled = ScanOptions {
        cancel: Some(cancel),
        ..ScanOptions::default()
    };
    assert!(matches!(
        scan_tree(dir.path(), &cancelled),
        Err(ScanError::Cancelled)
    ));
}

/// Deeply nested suites with long titles: each test records its whole suite path, so three
/// files of 3,000 tests under 32 suites of 300 characters take about 90 MB, past the default
/// budget, though they hold few tests and are small on disk.
#[test]
fn tests_whose_names_and_suites_take_too_much_memory_are_refused() {
    let dir = TempDir::new("walk-heavy");
    let title = "x".repeat(300);
    let mut source = String::new();
    for _ in 0..32 {
        source.push_str(&format!("describe('{title}', () => {{\n"));
    }
    source.push_str(&"it('a', () => {});\n".repeat(3_000));
    for _ in 0..32 {
        source.push_str("});\n");
    }
    for n in 0..3 {
        write(dir.path(), &format!("heavy{n}.test.js"), &source);
    }
    let refused = scan_tree(dir.path(), &ScanOptions::default());
    assert!(
        matches!(
            refused,
            Err(ScanError::TooLarge {
                limit: inventory::scan::MAX_TEST_BYTES_PER_REPOSITORY
            })
        ),
        "{refused:?}"
    );
    // One such file fits.
    let one = TempDir::new("walk-heavy-one");
    write(one.path(), "heavy.test.js", &source);
    let inventory = scan_tree(one.path(), &ScanOptions::default()).unwrap();
    assert_eq!(inventory.totals.overall.tests, 3_000);
}

/// A file's scanner stops once its tests take the file's budget, not after the whole file:
/// 32 nested suites of 300 four-byte characters over 9,968 tests (a 200 KB file, under the
/// count cap) took 380 MB of a worker's memory before the repository's cap was checked. The
/// walk still refuses it.
#[test]
fn a_file_of_long_nested_suites_stops_at_its_byte_budget() {
    let title = "\u{1d54f}".repeat(300);
    let mut source = String::new();
    for _ in 0..32 {
        source.push_str(&format!("describe('{title}', () => {{\n"));
    }
    source.push_str(&"it('x', () => {});\n".repeat(9_968));
    for _ in 0..32 {
        source.push_str("});\n");
    }
    let found = inventory::scan::scan_source(
        "heavy.test.js",
        inventory::scan::SourceKind::JavaScript,
        &source,
        inventory::Framework::Jest,
    );
    let recorded: u64 = found
        .iter()
        .flat_map(|f| &f.tests)
        .map(inventory::scan::test_bytes)
        .sum();
    let one = inventory::scan::test_bytes(&found[0].tests[0]);
    assert!(
        recorded < inventory::scan::MAX_TEST_BYTES_PER_FILE + one,
        "{recorded} bytes recorded for one file"
    );
    let dir = TempDir::new("walk-wide-suites");
    write(dir.path(), "heavy.test.js", &source);
    let refused = scan_tree(dir.path(), &ScanOptions::default());
    assert!(
        matches!(refused, Err(ScanError::TooLarge { .. })),
        "{refused:?}"
    );
}

/// Paths count towards the repository's bytes as they are stored: a file name of control
/// characters is written six bytes a character in the inventory's JSON. 2,000 files of one tiny
/// test each under such names, a few MB on disk and 250 KB of test names, made 19 MB of JSON
/// under a 1 MiB cap.
#[test]
fn paths_count_towards_the_repository_cap_as_they_are_stored() {
    let dir = TempDir::new("walk-control-paths");
    let folder = (0..6)
        .map(|_| "\u{1}".repeat(250))
        .collect::<Vec<_>>()
        .join("/");
    let name = "\u{1}".repeat(200);
    for n in 0..2_000 {
        write(
            dir.path(),
            &format!("{folder}/{name}{n}.rs"),
            "#[test] fn a() {}\n",
        );
    }
    let small = ScanOptions {
        max_test_bytes: 1 << 20,
        ..ScanOptions::default()
    };
    let refused = scan_tree(dir.path(), &small);
    assert!(
        matches!(refused, Err(ScanError::TooLarge { limit: 1_048_576 })),
        "{:?}",
        refused.map(|i| serde_json::to_string(&i).map(|json| json.len()))
    );
    // Under the default cap it is stored, and its JSON is no larger than what was counted.
    let inventory = scan_tree(dir.path(), &ScanOptions::default()).unwrap();
    assert_eq!(inventory.totals.overall.tests, 2_000);
    let counted: u64 = inventory
        .files
        .iter()
        .map(inventory::scan::file_bytes)
        .sum();
    let json = serde_json::to_string(&inventory).unwrap().len() as u64;
    assert!(json <= counted, "{json} bytes of JSON, {counted} counted");
}

/// A path git wrote relative to the checkout but too long to open under the checkout's own
/// folder (`ENAMETOOLONG`) is left out and counted, and the rest is scanned: failing the scan
/// failed the analysis, and every retry, the same way.
#[test]
fn a_path_too_long_to_open_is_left_out() {
    let dir = TempDir::new("walk-long-path");
    write(dir.path(), "src/lib.rs", "#[test] fn kept() {}\n");
    // Built from the bottom up, each level moved into a new short folder: 17 levels of 250
    // bytes is over PATH_MAX (4,096) from the root, which no call with a full path can make.
    let level = "d".repeat(250);
    let mut chain = dir.path().join("chain0");
    std::fs::create_dir(&chain).unwrap();
    std::fs::write(chain.join("deep.rs"), "#[test] fn deep() {}\n").unwrap();
    for n in 1..=17 {
        let outer = dir.path().join(format!("chain{n}"));
        std::fs::create_dir(&outer).unwrap();
        std::fs::rename(&chain, outer.join(&level)).unwrap();
        chain = outer;
    }
    let inventory = scan_tree(dir.path(), &ScanOptions::default()).unwrap();
    let paths: Vec<_> = inventory.files.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(paths, ["src/lib.rs"]);
    assert!(
        inventory.stats.files_unscannable >= 1,
        "{:?}",
        inventory.stats
    );
}

#[test]
fn a_tree_of_folders_without_source_files_still_stops_at_the_deadline() {
    let dir = TempDir::new("walk-folders");
    let root = dir.path();
    std::fs::create_dir_all(root.join("a/b/c/d")).unwrap();
    write(root, "a/b/c/d/notes.txt", "not a source file");
    assert_stops_at_a_past_deadline(root);
}

#[test]
fn a_workspace_package_without_a_runner_takes_the_nearest_one_that_names_one() {
    let dir = TempDir::new("walk-monorepo");
    let root = dir.path();
    write(
        root,
        "package.json",
        r#"{"devDependencies": {"vitest": "1"}}"#,
    );
    write(root, "packages/app/package.json", r#"{"name": "app"}"#);
    write(
        root,
        "packages/app/src/a.test.js",
        "describe('a', () => { it('works', () => {}); });\n",
    );
    write(
        root,
        "packages/legacy/package.json",
        r#"{"devDependencies": {"mocha": "10"}}"#,
    );
    write(
        root,
        "packages/legacy/test/b.test.js",
        "it('still works', () => {});\n",
    );
    let inventory = scan_tree(root, &ScanOptions::default()).unwrap();
    let frameworks: Vec<_> = inventory
        .files
        .iter()
        .map(|f| (f.path.as_str(), f.framework))
        .collect();
    assert_eq!(
        frameworks,
        [
            ("packages/app/src/a.test.js", inventory::Framework::Vitest),
            (
                "packages/legacy/test/b.test.js",
                inventory::Framework::Mocha
            ),
        ]
    );
}
