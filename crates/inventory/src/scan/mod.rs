//! Walks a checked-out tree and inventories its tests per file and framework.
//!
//! Which files are read: every `.rs` and `.java` file; Go `*_test.go`; Python `test*.py` and
//! `*_test.py`; JavaScript/TypeScript (`js jsx ts tsx mjs cjs mts cts`) named `*.test.*` or
//! `*.spec.*` or lying under a `__tests__/` directory. The walk skips hidden directories (`.git`,
//! `.venv`, …), dependency and build output directories (see [`SKIPPED_DIRECTORIES`]) and Go's
//! `testdata/`, never follows symbolic links, and skips files over the size cap.

mod go;
mod java;
mod js;
mod lexer;
mod python;
mod rust;

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::fs;
use std::io;
use std::path::Path;

use crate::model::{FileInventory, Framework, Inventory, OtherFunction, ScanStats, TestCase};
use lexer::{Tok, Token};

/// Directory names never descended into (besides every name starting with `.`).
pub const SKIPPED_DIRECTORIES: [&str; 15] = [
    "node_modules",
    "bower_components",
    "jspm_packages",
    "vendor",
    "target",
    "dist",
    "build",
    "venv",
    "__pycache__",
    "site-packages",
    "coverage",
    "htmlcov",
    "testdata",
    "__fixtures__",
    "__snapshots__",
];

const JS_EXTENSIONS: [&str; 8] = ["js", "jsx", "ts", "tsx", "mjs", "cjs", "mts", "cts"];

/// Bounds for a scan.
#[derive(Debug, Clone)]
pub struct ScanOptions {
    /// Candidate files larger than this are skipped (counted in [`ScanStats::files_too_large`]).
    pub max_file_bytes: u64,
    /// The walk stops with [`ScanError::TooManyFiles`] after visiting more regular files.
    pub max_files: u64,
    /// Directories deeper than this are not descended into.
    pub max_depth: usize,
    /// The walk stops with [`ScanError::TooManyTests`] once the files scanned hold more tests:
    /// an inventory must fit a database row, and a worker's memory, whatever the repository.
    pub max_tests: u64,
    /// The walk stops with [`ScanError::TooLarge`] once the tests found take more memory than
    /// this ([`test_bytes`]): a test records its whole suite path, so a file of deeply nested
    /// suites with long titles holds far more than its tests' count suggests.
    pub max_test_bytes: u64,
    /// The walk stops with [`ScanError::TimedOut`] at the first file or folder it reaches after
    /// this: a caller that gave up waiting (its job timed out) does not leave a thread scanning
    /// on.
    pub deadline: Option<std::time::Instant>,
    /// Set by the caller to stop the walk ([`ScanError::Cancelled`]) at the next file or folder:
    /// a job cancelled by its user does not leave its scan running.
    pub cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

/// The bytes `text` takes in an inventory: the larger of its length in memory and as a JSON
/// string, where a control character is written `\u00XX` (six bytes for one), and a quote or a
/// backslash is escaped; plus a `String`'s own size. A name or path of control characters (git
/// allows them in file names) is six times larger stored than scanned.
pub fn stored_bytes(text: &str) -> u64 {
    let escapes: u64 = text
        .bytes()
        .map(|b| match b {
            b'"' | b'\\' => 1,
            0..0x20 => 5,
            _ => 0,
        })
        .sum();
    text.len() as u64 + escapes + size_of::<String>() as u64
}

/// The bytes a test takes in an inventory ([`stored_bytes`] of its name, suites and display
/// name) and the rest of the record.
pub fn test_bytes(test: &TestCase) -> u64 {
    const RECORD: u64 = size_of::<TestCase>() as u64;
    RECORD
        + stored_bytes(&test.name)
        + test.suite.iter().map(|s| stored_bytes(s)).sum::<u64>()
        + test.display_name.as_deref().map_or(0, stored_bytes)
}

/// The bytes a Go benchmark, fuzz target or example takes in an inventory: its name
/// ([`stored_bytes`]) and the rest of the record.
pub fn other_bytes(other: &OtherFunction) -> u64 {
    size_of::<OtherFunction>() as u64 + stored_bytes(&other.name)
}

/// The bytes one file's entry of an inventory takes: its path ([`stored_bytes`]: a path is up to
/// 4 KB, and copied into each framework's entry of its file), the record, and its tests and
/// other functions.
pub fn file_bytes(file: &FileInventory) -> u64 {
    size_of::<FileInventory>() as u64
        + stored_bytes(&file.path)
        + file.tests.iter().map(test_bytes).sum::<u64>()
        + file.other.iter().map(other_bytes).sum::<u64>()
}

/// The most bytes one file's tests may take ([`test_bytes`]); its scanner stops there, as at
/// [`MAX_TESTS_PER_FILE`], and the walk then finds the repository's cap passed. Names are capped
/// in characters, up to four bytes each, and a test copies its whole suite path: 10,000 tests
/// under 32 suites of 300 four-byte characters took 380 MB before the repository's cap was
/// checked, after the file.
pub const MAX_TEST_BYTES_PER_FILE: u64 = MAX_TEST_BYTES_PER_REPOSITORY;

/// The most bytes the files of one inventory may take ([`file_bytes`]: paths, names and suite
/// paths, in memory or as JSON, whichever is larger): 64 MiB, a few times what the largest real
/// repositories need, and well under PostgreSQL's limit for the `jsonb` that stores it. An
/// analyzer runs several jobs at once.
pub const MAX_TEST_BYTES_PER_REPOSITORY: u64 = 64 * 1024 * 1024;

impl Default for ScanOptions {
    fn default() -> Self {
        ScanOptions {
            max_file_bytes: 1024 * 1024,
            max_files: 200_000,
            max_depth: 64,
            max_tests: MAX_TESTS_PER_REPOSITORY,
            max_test_bytes: MAX_TEST_BYTES_PER_REPOSITORY,
            deadline: None,
            cancel: None,
        }
    }
}

/// Why a scan failed.
#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    /// The tree could not be read.
    #[error("could not read `{path}` while scanning: {source}")]
    Io {
        /// Path relative to the scanned root.
        path: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The tree has more files than allowed.
    #[error("the tree has more than {limit} files")]
    TooManyFiles {
        /// The cap.
        limit: u64,
    },
    /// The tree has more tests than an inventory may hold.
    #[error("the tree has more than {limit} tests")]
    TooManyTests {
        /// The cap.
        limit: u64,
    },
    /// The tests found take more memory than an inventory may hold.
    #[error("the tree's tests take more than {limit} bytes (names and suites)")]
    TooLarge {
        /// The cap.
        limit: u64,
    },
    /// The scan passed its [`ScanOptions::deadline`].
    #[error("scanning the tree for tests took longer than allowed")]
    TimedOut,
    /// The caller stopped the scan ([`ScanOptions::cancel`]).
    #[error("the scan was stopped")]
    Cancelled,
}

/// The most tests one inventory holds (about 100 MB as JSON at the longest names).
pub const MAX_TESTS_PER_REPOSITORY: u64 = 500_000;

/// What the language scanners report for one file.
#[derive(Debug, Default)]
pub(crate) struct Found {
    pub(crate) tests: Vec<(Framework, TestCase)>,
    pub(crate) other: Vec<OtherFunction>,
    /// What the recorded entries take ([`test_bytes`], [`other_bytes`]).
    pub(crate) bytes: u64,
}

/// The most tests, and Go benchmarks, fuzz targets and examples, recorded for one file; a
/// scanner stops there. A crafted file could otherwise make the inventory, and the analyzer's
/// memory, grow without bound.
pub const MAX_TESTS_PER_FILE: usize = 10_000;

/// The longest name (test, suite, display name) recorded, in characters; longer ones are cut,
/// ending in `…`.
pub const MAX_NAME_CHARS: usize = 300;

/// The most enclosing suites recorded for a test (the outermost ones); deeper suites still
/// count their tests. Go subtests deeper than this are not looked for.
pub const MAX_SUITE_DEPTH: usize = 32;

impl Found {
    /// Whether the file's cap ([`MAX_TESTS_PER_FILE`], [`MAX_TEST_BYTES_PER_FILE`]) is
    /// reached: the scanner stops.
    pub(crate) fn is_full(&self) -> bool {
        self.tests.len() + self.other.len() >= MAX_TESTS_PER_FILE
            || self.bytes >= MAX_TEST_BYTES_PER_FILE
    }

    /// Records a Go benchmark, fuzz target or example (nothing once the cap is reached), its name
    /// capped.
    pub(crate) fn push_other(&mut self, mut other: OtherFunction) {
        if self.is_full() {
            return;
        }
        if other.name.chars().count() > MAX_NAME_CHARS {
            other.name = capped(&other.name);
        }
        self.bytes += other_bytes(&other);
        self.other.push(other);
    }

    /// Records a test (nothing once the cap is reached), its names capped.
    pub(crate) fn push_test(&mut self, framework: Framework, mut test: TestCase) {
        if self.is_full() {
            return;
        }
        if test.name.chars().count() > MAX_NAME_CHARS {
            test.name = capped(&test.name);
        }
        if let Some(display) = &test.display_name
            && display.chars().count() > MAX_NAME_CHARS
        {
            test.display_name = Some(capped(display));
        }
        // PostgreSQL's text and jsonb cannot hold NUL: a title written with one (`"\0"` in a
        // string literal) would make the whole inventory unstorable, on every retry.
        for name in std::iter::once(&mut test.name)
            .chain(test.display_name.as_mut())
            .chain(test.suite.iter_mut())
        {
            if name.contains('\0') {
                *name = name.replace('\0', "\u{fffd}");
            }
        }
        self.bytes += test_bytes(&test);
        self.tests.push((framework, test));
    }
}

/// `name` cut to [`MAX_NAME_CHARS`] characters, the last of them `…` when it was longer.
pub(crate) fn capped(name: &str) -> String {
    match name.char_indices().nth(MAX_NAME_CHARS - 1) {
        Some((cut, _)) if name.chars().count() > MAX_NAME_CHARS => format!("{}…", &name[..cut]),
        _ => name.to_owned(),
    }
}

/// The suite path a test records: the outermost [`MAX_SUITE_DEPTH`] suites, names capped. Built
/// per test, so its cost must not grow with how deep or long a crafted file's suites are.
pub(crate) fn suite_path<'n>(names: impl IntoIterator<Item = &'n str>) -> Vec<String> {
    names
        .into_iter()
        .take(MAX_SUITE_DEPTH)
        .map(capped)
        .collect()
}

/// Scans `src` with `scan`, which must find [`MAX_TESTS_PER_FILE`] tests, the first in `suite`,
/// within 10 s: about 0.1 s in a debug build, where walking every open brace per test (the
/// quadratic scan [`Scopes`] replaced) took about 40 s.
#[cfg(test)]
pub(crate) fn assert_fills_the_cap_quickly(scan: fn(&str) -> Found, src: &str, suite: &str) {
    let started = std::time::Instant::now();
    let found = scan(src);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(found.tests.len(), MAX_TESTS_PER_FILE);
    assert_eq!(found.tests[0].1.suite, [suite]);
}

/// The open braces of a brace-scoped language, and the named scopes (modules, classes) among
/// them. A test's suite is read from the named ones only: walking every open brace per test
/// would take time growing with the square of a crafted file (`{` a million times, then tests).
#[derive(Debug)]
pub(crate) struct Scopes<T> {
    depth: usize,
    /// The named scopes, outermost first, each with the depth of its brace.
    named: Vec<(usize, T)>,
}

impl<T> Scopes<T> {
    pub(crate) fn new() -> Scopes<T> {
        Scopes {
            depth: 0,
            named: Vec::new(),
        }
    }

    /// A `{`: opens the scope `name`, or an anonymous one.
    pub(crate) fn open(&mut self, name: Option<T>) {
        self.depth += 1;
        if let Some(name) = name {
            self.named.push((self.depth, name));
        }
    }

    /// A `}`: closes the innermost scope and returns it if it was named. A `}` with nothing
    /// open changes nothing.
    pub(crate) fn close(&mut self) -> Option<T> {
        if self.depth == 0 {
            return None;
        }
        let closed = if self.innermost_is_named() {
            self.named.pop().map(|(_, name)| name)
        } else {
            None
        };
        self.depth -= 1;
        closed
    }

    /// Whether the innermost open scope is a named one (a test method directly in a class body).
    pub(crate) fn innermost_is_named(&self) -> bool {
        self.depth > 0 && self.named.last().is_some_and(|(d, _)| *d == self.depth)
    }

    /// The named scopes, outermost first.
    pub(crate) fn named(&self) -> impl Iterator<Item = &T> {
        self.named.iter().map(|(_, name)| name)
    }
}

/// Every bracket's match, found in one pass: what [`matching`] answers, without walking the rest
/// of the file for each bracket asked about. A scanner that asks for every call of a file of
/// nested calls (`describe(describe(…))`) would otherwise take time growing with the square of
/// the file.
pub(crate) struct Brackets(Vec<usize>);

impl Brackets {
    pub(crate) fn of(toks: &[Token<'_>]) -> Brackets {
        let mut closes: Vec<usize> = (0..toks.len()).collect();
        let mut open: [Vec<usize>; 3] = Default::default();
        for (k, t) in toks.iter().enumerate() {
            match t.kind {
                Tok::Punct(b'(') => open[0].push(k),
                Tok::Punct(b'[') => open[1].push(k),
                Tok::Punct(b'{') => open[2].push(k),
                Tok::Punct(c @ (b')' | b']' | b'}')) => {
                    let kind = match c {
                        b')' => 0,
                        b']' => 1,
                        _ => 2,
                    };
                    if let Some(o) = open[kind].pop() {
                        closes[o] = k;
                    }
                }
                _ => {}
            }
        }
        // Unclosed: the last index, as `matching` says.
        let last = toks.len().saturating_sub(1);
        for o in open.into_iter().flatten() {
            closes[o] = last.max(o);
        }
        Brackets(closes)
    }

    /// [`matching`]`(toks, open)` for the tokens this was made of.
    pub(crate) fn matching(&self, open: usize) -> usize {
        self.0.get(open).copied().unwrap_or(open)
    }
}

/// The tokens strictly between the bracket at `open` and its match `close` from [`matching`]:
/// none when the source ends at an unclosed bracket (then `close` is `open` itself).
pub(crate) fn between<'s, 't>(toks: &'s [Token<'t>], open: usize, close: usize) -> &'s [Token<'t>] {
    toks.get(open + 1..close).unwrap_or(&[])
}

/// The index of the bracket closing the one at `open` (same kind), or the last index if the
/// source is unbalanced (`open` itself when it is the last token: slice with [`between`]).
pub(crate) fn matching(toks: &[Token<'_>], open: usize) -> usize {
    let (o, c) = match toks.get(open).map(|t| &t.kind) {
        Some(Tok::Punct(b'(')) => (b'(', b')'),
        Some(Tok::Punct(b'[')) => (b'[', b']'),
        Some(Tok::Punct(b'{')) => (b'{', b'}'),
        _ => return open,
    };
    let mut depth = 0usize;
    for (k, t) in toks.iter().enumerate().skip(open) {
        if t.kind == Tok::Punct(o) {
            depth += 1;
        } else if t.kind == Tok::Punct(c) {
            depth -= 1;
            if depth == 0 {
                return k;
            }
        }
    }
    toks.len().saturating_sub(1).max(open)
}

/// Which scanner a file needs, from its path alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    /// Any `.rs` file.
    Rust,
    /// A `*_test.go` file.
    Go,
    /// A `test*.py` or `*_test.py` file.
    Python,
    /// A JavaScript/TypeScript test file.
    JavaScript,
    /// Any `.java` file.
    Java,
}

impl SourceKind {
    /// Classifies a `/`-separated relative path; `None` if the file is not scanned.
    pub fn of_path(path: &str) -> Option<SourceKind> {
        let file = path.rsplit('/').next().unwrap_or(path);
        let (stem, ext) = file.rsplit_once('.')?;
        match ext {
            "rs" => Some(SourceKind::Rust),
            "java" => Some(SourceKind::Java),
            "go" if stem.ends_with("_test") => Some(SourceKind::Go),
            "py" if stem.starts_with("test") || stem.ends_with("_test") => Some(SourceKind::Python),
            e if JS_EXTENSIONS.contains(&e) => {
                let marked = stem.ends_with(".test")
                    || stem.ends_with(".spec")
                    || stem.contains(".test.")
                    || stem.contains(".spec.");
                let under_tests = path.split('/').rev().skip(1).any(|d| d == "__tests__");
                (marked || under_tests).then_some(SourceKind::JavaScript)
            }
            _ => None,
        }
    }
}

/// Inventories one file's source. `js_fallback` is the framework for JavaScript files that name
/// none themselves. Returns one entry per framework found (possibly none).
pub fn scan_source(
    path: &str,
    kind: SourceKind,
    source: &str,
    js_fallback: Framework,
) -> Vec<FileInventory> {
    // A UTF-8 byte-order mark would otherwise stick to the first word (`\u{feff}def`).
    let source = source.strip_prefix('\u{feff}').unwrap_or(source);
    let found = match kind {
        SourceKind::Rust => rust::scan(source),
        SourceKind::Go => go::scan(source),
        SourceKind::Python => python::scan(source),
        SourceKind::JavaScript => js::scan(source, js_fallback),
        SourceKind::Java => java::scan(source),
    };
    let mut by_framework: BTreeMap<Framework, FileInventory> = BTreeMap::new();
    for (framework, test) in found.tests {
        by_framework
            .entry(framework)
            .or_insert_with(|| empty_file(path, framework))
            .tests
            .push(test);
    }
    if !found.other.is_empty() {
        by_framework
            .entry(Framework::Go)
            .or_insert_with(|| empty_file(path, Framework::Go))
            .other = found.other;
    }
    by_framework.into_values().collect()
}

fn empty_file(path: &str, framework: Framework) -> FileInventory {
    FileInventory {
        path: path.to_string(),
        framework,
        tests: Vec::new(),
        other: Vec::new(),
    }
}

/// Walks `root` and inventories every test file in it. Blocking: call it from
/// `spawn_blocking` in async code.
pub fn scan_tree(root: &Path, options: &ScanOptions) -> Result<Inventory, ScanError> {
    let mut walker = Walker {
        root,
        options,
        stats: ScanStats::default(),
        files: Vec::new(),
        tests: 0,
        test_bytes: 0,
        js_hints: HashMap::new(),
    };
    walker.walk_dir(root, "", 0)?;
    Ok(Inventory::from_files(walker.files, walker.stats))
}

struct Walker<'a> {
    root: &'a Path,
    options: &'a ScanOptions,
    stats: ScanStats,
    files: Vec<FileInventory>,
    /// The tests in `files`.
    tests: u64,
    /// Their [`test_bytes`].
    test_bytes: u64,
    /// Nearest-`package.json` runner per relative directory.
    js_hints: HashMap<String, Option<Framework>>,
}

fn io_error(path: &str, source: io::Error) -> ScanError {
    ScanError::Io {
        path: if path.is_empty() {
            ".".into()
        } else {
            path.into()
        },
        source,
    }
}

impl Walker<'_> {
    /// `Err` once the caller cancelled the scan or its deadline passed.
    fn check_stop(&self) -> Result<(), ScanError> {
        if self
            .options
            .cancel
            .as_ref()
            .is_some_and(|cancel| cancel.load(std::sync::atomic::Ordering::Relaxed))
        {
            return Err(ScanError::Cancelled);
        }
        if self
            .options
            .deadline
            .is_some_and(|deadline| std::time::Instant::now() >= deadline)
        {
            return Err(ScanError::TimedOut);
        }
        Ok(())
    }

    fn walk_dir(&mut self, dir: &Path, rel: &str, depth: usize) -> Result<(), ScanError> {
        // Here too, not only per source file: a tree of folders without one would never stop.
        self.check_stop()?;
        let Some(listing) = self.unless_too_long(rel, fs::read_dir(dir))? else {
            return Ok(());
        };
        // Names only: a folder's whole listing is held at once, and a full path per entry (up
        // to 4 KB each in a crafted tree) would take a thousand times the names' memory.
        let mut entries: Vec<(String, OsString, fs::FileType)> = Vec::new();
        for entry in listing {
            let entry = entry.map_err(|e| io_error(rel, e))?;
            let file_type = entry.file_type().map_err(|e| io_error(rel, e))?;
            let file_name = entry.file_name();
            let name = file_name.to_string_lossy().into_owned();
            entries.push((name, file_name, file_type));
        }
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, file_name, file_type) in entries {
            let path = dir.join(&file_name);
            let child_rel = if rel.is_empty() {
                name.clone()
            } else {
                format!("{rel}/{name}")
            };
            if file_type.is_symlink() {
                self.stats.symlinks_skipped += 1;
            } else if file_type.is_dir() {
                if !name.starts_with('.')
                    && !SKIPPED_DIRECTORIES.contains(&name.as_str())
                    && depth < self.options.max_depth
                {
                    self.walk_dir(&path, &child_rel, depth + 1)?;
                }
            } else if file_type.is_file() {
                self.stats.files_visited += 1;
                if self.stats.files_visited > self.options.max_files {
                    return Err(ScanError::TooManyFiles {
                        limit: self.options.max_files,
                    });
                }
                self.visit_file(&path, &child_rel)?;
            }
        }
        Ok(())
    }

    fn visit_file(&mut self, path: &Path, rel: &str) -> Result<(), ScanError> {
        let Some(kind) = SourceKind::of_path(rel) else {
            return Ok(());
        };
        self.check_stop()?;
        let Some(meta) = self.unless_too_long(rel, fs::symlink_metadata(path))? else {
            return Ok(());
        };
        let len = meta.len();
        if len > self.options.max_file_bytes {
            self.stats.files_too_large += 1;
            return Ok(());
        }
        let bytes = fs::read(path).map_err(|e| io_error(rel, e))?;
        let source = String::from_utf8_lossy(&bytes);
        self.stats.files_scanned += 1;
        let fallback = if kind == SourceKind::JavaScript {
            let dir = rel.rsplit_once('/').map_or("", |(d, _)| d);
            self.js_hint(dir).unwrap_or(Framework::Jest)
        } else {
            Framework::Jest
        };
        // A scanner bug on one odd file must not fail the whole analysis (and its retries).
        match std::panic::catch_unwind(|| scan_source(rel, kind, &source, fallback)) {
            Ok(found) => {
                // Benchmarks, fuzz targets and examples count like tests: each is an entry of
                // the inventory as well.
                self.tests += found
                    .iter()
                    .map(|f| (f.tests.len() + f.other.len()) as u64)
                    .sum::<u64>();
                if self.tests > self.options.max_tests {
                    return Err(ScanError::TooManyTests {
                        limit: self.options.max_tests,
                    });
                }
                self.test_bytes += found.iter().map(file_bytes).sum::<u64>();
                if self.test_bytes > self.options.max_test_bytes {
                    return Err(ScanError::TooLarge {
                        limit: self.options.max_test_bytes,
                    });
                }
                self.files.extend(found);
            }
            Err(_) => {
                self.stats.files_unscannable += 1;
                tracing::error!(path = rel, "a scanner failed on this file; it is left out");
            }
        }
        Ok(())
    }

    /// What opening `rel` gave, or `None` for a file or folder whose full path is longer than
    /// the system takes (`ENAMETOOLONG`), which is left out and counted: git checks out by paths
    /// relative to the checkout, so it writes paths up to 4 KB that the walk, under the
    /// checkout's own folder, cannot open. Failing the scan for it failed the analysis, and each
    /// of its retries, the same way.
    fn unless_too_long<T>(
        &mut self,
        rel: &str,
        opened: io::Result<T>,
    ) -> Result<Option<T>, ScanError> {
        match opened {
            Ok(opened) => Ok(Some(opened)),
            Err(e) if e.kind() == io::ErrorKind::InvalidFilename => {
                self.stats.files_unscannable += 1;
                tracing::warn!(
                    path_bytes = rel.len(),
                    "a path in the checkout is too long to open; it is left out"
                );
                Ok(None)
            }
            Err(e) => Err(io_error(rel, e)),
        }
    }

    /// The runner named by the nearest `package.json` at or above `dir` (inside the root) that
    /// names one: a workspace package of a monorepo often leaves its runner to the root's.
    fn js_hint(&mut self, dir: &str) -> Option<Framework> {
        if let Some(hint) = self.js_hints.get(dir) {
            return *hint;
        }
        let own = self.package_json_runner(dir).flatten();
        let hint = match own {
            Some(found) => Some(found),
            None if dir.is_empty() => None,
            None => {
                let parent = dir.rsplit_once('/').map_or("", |(p, _)| p);
                self.js_hint(parent)
            }
        };
        self.js_hints.insert(dir.to_string(), hint);
        hint
    }

    /// `None` if `dir` has no readable `package.json`; `Some(runner)` if it has one.
    fn package_json_runner(&self, dir: &str) -> Option<Option<Framework>> {
        let path = if dir.is_empty() {
            self.root.join("package.json")
        } else {
            self.root.join(dir).join("package.json")
        };
        let meta = fs::symlink_metadata(&path).ok()?;
        if !meta.is_file() || meta.len() > self.options.max_file_bytes {
            return None;
        }
        let json: serde_json::Value = serde_json::from_slice(&fs::read(&path).ok()?).ok()?;
        Some(runner_from_package_json(&json))
    }
}

/// The test runner a `package.json` depends on (Vitest, then Jest, then Mocha).
fn runner_from_package_json(json: &serde_json::Value) -> Option<Framework> {
    let has = |name: &str| {
        ["dependencies", "devDependencies", "peerDependencies"]
            .iter()
            .any(|section| json.get(section).and_then(|s| s.get(name)).is_some())
    };
    // Playwright last: its spec files import `test` (from `@playwright/test` or a fixtures
    // module), and a project with unit tests too keeps their runner for files that import none.
    if has("vitest") {
        Some(Framework::Vitest)
    } else if has("jest") || has("ts-jest") || has("react-scripts") {
        Some(Framework::Jest)
    } else if has("mocha") {
        Some(Framework::Mocha)
    } else if has("@playwright/test") {
        Some(Framework::Playwright)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn playwright_projects_are_known_by_their_package_json() {
        let project = serde_json::json!({"devDependencies": {"@playwright/test": "1.49.0"}});
        assert_eq!(
            runner_from_package_json(&project),
            Some(Framework::Playwright)
        );
        // With a unit-test runner beside it, files that import neither are that runner's.
        let both = serde_json::json!({"devDependencies": {"@playwright/test": "1", "jest": "29"}});
        assert_eq!(runner_from_package_json(&both), Some(Framework::Jest));
    }

    #[test]
    fn classifies_paths() {
        let cases = [
            ("src/lib.rs", Some(SourceKind::Rust)),
            ("pkg/parse_test.go", Some(SourceKind::Go)),
            ("pkg/parse.go", None),
            ("tests/test_login.py", Some(SourceKind::Python)),
            ("login_test.py", Some(SourceKind::Python)),
            ("tests.py", Some(SourceKind::Python)),
            ("helpers.py", None),
            ("a/b.test.ts", Some(SourceKind::JavaScript)),
            ("a/b.spec.jsx", Some(SourceKind::JavaScript)),
            ("a/b.test.stories.tsx", Some(SourceKind::JavaScript)),
            ("a/__tests__/b.mjs", Some(SourceKind::JavaScript)),
            ("__tests__.js", None),
            ("a/b.js", None),
            ("a/test.js", None),
            ("a/b.test.json", None),
            ("src/main/java/A.java", Some(SourceKind::Java)),
            ("Makefile", None),
        ];
        for (path, want) in cases {
            assert_eq!(SourceKind::of_path(path), want, "{path}");
        }
    }

    #[test]
    fn package_json_runner_order() {
        let v = serde_json::json!({"devDependencies": {"jest": "1", "vitest": "2"}});
        assert_eq!(runner_from_package_json(&v), Some(Framework::Vitest));
        let m = serde_json::json!({"dependencies": {"mocha": "1"}});
        assert_eq!(runner_from_package_json(&m), Some(Framework::Mocha));
        assert_eq!(runner_from_package_json(&serde_json::json!({})), None);
    }

    fn js(source: &str) -> Vec<TestCase> {
        scan_source("a.test.js", SourceKind::JavaScript, source, Framework::Jest)
            .into_iter()
            .flat_map(|f| f.tests)
            .collect()
    }

    #[test]
    fn a_file_records_at_most_its_cap_of_tests() {
        let source = "it('t', () => {});\n".repeat(MAX_TESTS_PER_FILE + 500);
        assert_eq!(js(&source).len(), MAX_TESTS_PER_FILE);
        let go = format!(
            "package x\n{}",
            (0..MAX_TESTS_PER_FILE + 5)
                .map(|n| format!("func Test{n}(t *testing.T) {{}}\n"))
                .collect::<String>()
        );
        let found = scan_source("x_test.go", SourceKind::Go, &go, Framework::Jest);
        assert_eq!(found[0].tests.len(), MAX_TESTS_PER_FILE);
    }

    /// Go benchmarks, fuzz targets and examples are entries of the inventory like tests: they
    /// share the file's cap, and their names are cut like tests' names.
    #[test]
    fn go_benchmarks_fuzz_targets_and_examples_share_the_file_cap_and_the_name_cap() {
        let go = format!(
            "package x
{}{}",
            (0..MAX_TESTS_PER_FILE)
                .map(|n| format!("func Example{n}() {{}}\nfunc Benchmark{n}(b *testing.B) {{}}\n"))
                .collect::<String>(),
            "func TestLate(t *testing.T) {}\n"
        );
        let found = scan_source("x_test.go", SourceKind::Go, &go, Framework::Jest);
        let entries: usize = found.iter().map(|f| f.tests.len() + f.other.len()).sum();
        assert_eq!(entries, MAX_TESTS_PER_FILE);

        let long = "A".repeat(MAX_NAME_CHARS * 300);
        let go =
            format!("package x\nfunc Example{long}() {{}}\nfunc Fuzz{long}(f *testing.F) {{}}\n");
        let found = scan_source("x_test.go", SourceKind::Go, &go, Framework::Jest);
        let names: Vec<&str> = found[0].other.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names.len(), 2);
        for name in names {
            assert_eq!(name.chars().count(), MAX_NAME_CHARS, "{}…", &name[..20]);
            assert!(name.ends_with('…'));
        }
    }

    #[test]
    fn long_names_are_cut_and_deep_suites_keep_their_outermost_levels() {
        let long = "n".repeat(MAX_NAME_CHARS * 3);
        let tests = js(&format!("it('{long}', () => {{}});"));
        assert_eq!(tests[0].name.chars().count(), MAX_NAME_CHARS);
        assert!(tests[0].name.ends_with('…'));
        assert!(tests[0].name.starts_with("nnn"));

        let depth = MAX_SUITE_DEPTH * 3;
        let source = format!(
            "{}it('deep', () => {{}});{}",
            (0..depth)
                .map(|d| format!("describe('{d}-{long}', () => {{\n"))
                .collect::<String>(),
            "});\n".repeat(depth)
        );
        let tests = js(&source);
        assert_eq!(tests.len(), 1);
        assert_eq!(tests[0].suite.len(), MAX_SUITE_DEPTH);
        assert!(tests[0].suite[0].starts_with("0-") && tests[0].suite[0].ends_with('…'));
        assert!(
            tests[0]
                .suite
                .iter()
                .all(|s| s.chars().count() == MAX_NAME_CHARS)
        );
    }

    #[test]
    fn calls_nested_in_calls_stay_bounded() {
        // `it(it(it(…)))`: each level a test named after the rest of the nest.
        let depth = 3_000;
        let source = format!("{}x{}", "it(".repeat(depth), ")".repeat(depth));
        let tests = js(&source);
        assert_eq!(tests.len(), depth);
        assert!(
            tests
                .iter()
                .all(|t| t.name.chars().count() <= MAX_NAME_CHARS)
        );

        let go = format!(
            "package x\nfunc TestDeep(t *testing.T) {{\n{}{}}}\n",
            (0..MAX_SUITE_DEPTH * 2)
                .map(|d| format!("t.Run(\"{d}\", func(t *testing.T) {{\n"))
                .collect::<String>(),
            "})\n".repeat(MAX_SUITE_DEPTH * 2)
        );
        let found = scan_source("x_test.go", SourceKind::Go, &go, Framework::Jest);
        let deepest = found[0].tests.iter().map(|t| t.suite.len()).max();
        assert_eq!(deepest, Some(MAX_SUITE_DEPTH));
    }

    #[test]
    fn brackets_found_in_one_pass_match_matching_everywhere() {
        let sources = [
            ("f(a(b), [c]) (", lexer::Lang::Js),
            ("{ ( ] ) [ } ( ( ) {", lexer::Lang::Js),
            (") ] } ( [ {", lexer::Lang::Js),
            (
                "describe('a', () => { it.each([[1], [2]])('b', (x) => { f(x[0]) }) })",
                lexer::Lang::Js,
            ),
            (
                "fn f() { let v = [(1, 2), (3, 4)]; g(&v[..]) }",
                lexer::Lang::Rust,
            ),
            ("", lexer::Lang::Go),
        ];
        for (source, lang) in sources {
            let toks = lexer::lex(source, lang);
            let brackets = Brackets::of(&toks);
            for k in 0..toks.len() {
                assert_eq!(
                    brackets.matching(k),
                    matching(&toks, k),
                    "{source:?} at {k}"
                );
            }
        }
    }

    #[test]
    fn a_file_of_nested_suite_calls_is_scanned_to_its_call_cap() {
        let depth = MAX_TESTS_PER_FILE * 3;
        let source = format!(
            "{}it('x', () => {{}}){}",
            "describe('s', ".repeat(depth),
            ")".repeat(depth)
        );
        assert!(js(&source).is_empty(), "the cap is reached before the test");
        let source = format!(
            "{}it('x', () => {{}}){}",
            "describe('s', ".repeat(40),
            ")".repeat(40)
        );
        let tests = js(&source);
        assert_eq!(tests.len(), 1);
        assert_eq!(tests[0].suite.len(), MAX_SUITE_DEPTH);
    }

    #[test]
    fn matching_handles_nesting_and_imbalance() {
        let toks = lexer::lex("f(a(b), [c]) (", lexer::Lang::Js);
        assert_eq!(matching(&toks, 1), 10);
        assert_eq!(matching(&toks, 11), 11);
    }

    #[test]
    fn a_byte_order_mark_does_not_hide_the_first_word() {
        let files = scan_source(
            "test_a.py",
            SourceKind::Python,
            "\u{feff}def test_a():\n    pass\n",
            Framework::Jest,
        );
        let names: Vec<&str> = files
            .iter()
            .flat_map(|f| f.tests.iter().map(|t| t.name.as_str()))
            .collect();
        assert_eq!(names, ["test_a"]);
    }

    #[test]
    fn scopes_name_only_named_braces() {
        let mut scopes: Scopes<&str> = Scopes::new();
        assert_eq!(
            scopes.close(),
            None,
            "a stray closing brace changes nothing"
        );
        scopes.open(Some("a"));
        assert!(scopes.innermost_is_named());
        scopes.open(None);
        assert!(!scopes.innermost_is_named());
        scopes.open(Some("b"));
        assert_eq!(scopes.named().copied().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(scopes.close(), Some("b"));
        assert_eq!(scopes.close(), None);
        assert_eq!(scopes.close(), Some("a"));
        assert_eq!(scopes.named().count(), 0);
    }
}
