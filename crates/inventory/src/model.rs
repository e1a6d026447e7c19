//! The serialisable test inventory: files, frameworks, tests, modifiers and totals.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// A test framework (or test convention) a file's tests belong to.
///
/// Serialised in snake_case (`rust`, `go`, `pytest`, `unittest`, `jest`, `vitest`, `mocha`,
/// `playwright`, `junit4`, `junit5`, `testng`). The declaration order is the sort order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Framework {
    /// Rust's built-in harness and attribute macros (`#[test]`, `#[tokio::test]`, `#[rstest]`…).
    Rust,
    /// Go's `testing` package (`func TestXxx(t *testing.T)` in `*_test.go`).
    Go,
    /// pytest functions and `Test*` classes.
    Pytest,
    /// Python `unittest.TestCase` subclasses.
    Unittest,
    /// Jest (also the fallback for JavaScript/TypeScript test files of unknown runner).
    Jest,
    /// Vitest.
    Vitest,
    /// Mocha.
    Mocha,
    /// Playwright Test (`@playwright/test`).
    Playwright,
    /// JUnit 4 (`org.junit.Test`).
    Junit4,
    /// JUnit 5 / Jupiter (`org.junit.jupiter`), also the fallback for Java files without imports.
    Junit5,
    /// TestNG (`org.testng`).
    Testng,
}

impl Framework {
    /// Every framework, in sort order.
    pub const ALL: [Framework; 11] = [
        Framework::Rust,
        Framework::Go,
        Framework::Pytest,
        Framework::Unittest,
        Framework::Jest,
        Framework::Vitest,
        Framework::Mocha,
        Framework::Playwright,
        Framework::Junit4,
        Framework::Junit5,
        Framework::Testng,
    ];

    /// The serialised name (`rust`, `junit5`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Framework::Rust => "rust",
            Framework::Go => "go",
            Framework::Pytest => "pytest",
            Framework::Unittest => "unittest",
            Framework::Jest => "jest",
            Framework::Vitest => "vitest",
            Framework::Mocha => "mocha",
            Framework::Playwright => "playwright",
            Framework::Junit4 => "junit4",
            Framework::Junit5 => "junit5",
            Framework::Testng => "testng",
        }
    }

    /// The programming language of the framework.
    pub fn language(self) -> Language {
        match self {
            Framework::Rust => Language::Rust,
            Framework::Go => Language::Go,
            Framework::Pytest | Framework::Unittest => Language::Python,
            Framework::Jest | Framework::Vitest | Framework::Mocha | Framework::Playwright => {
                Language::JavaScript
            }
            Framework::Junit4 | Framework::Junit5 | Framework::Testng => Language::Java,
        }
    }
}

impl fmt::Display for Framework {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A source language the scanner understands (JavaScript covers TypeScript too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Language {
    /// Rust.
    Rust,
    /// Go.
    Go,
    /// Python.
    Python,
    /// JavaScript and TypeScript.
    JavaScript,
    /// Java.
    Java,
}

/// How a test is marked in source, beyond simply existing.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Modifier {
    /// Runs normally.
    #[default]
    None,
    /// Unconditionally skipped or disabled (`.skip`, `xit`, `#[ignore]`, `@Disabled`,
    /// `@pytest.mark.skip`, a leading `t.Skip()` …), directly or through its suite.
    Skip,
    /// Focused (`.only`, `fit`, `fdescribe`): the runner runs only focused tests.
    Only,
    /// A placeholder without a body (`it.todo`).
    Todo,
}

impl Modifier {
    /// The serialised name.
    pub fn as_str(self) -> &'static str {
        match self {
            Modifier::None => "none",
            Modifier::Skip => "skip",
            Modifier::Only => "only",
            Modifier::Todo => "todo",
        }
    }
}

/// One test found in a file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TestCase {
    /// The name as written: function/method name, or the literal string of `it("…")`/`t.Run("…")`
    /// (for a non-literal name, the source text of the expression).
    pub name: String,
    /// Enclosing suites, outermost first: Rust modules, Go parent tests, Python/Java classes,
    /// JavaScript `describe` titles.
    pub suite: Vec<String>,
    /// 1-based line of the test's name.
    pub line: u32,
    /// Skip / only / todo marking, including what the test inherits from its suites.
    pub modifier: Modifier,
    /// Whether the test runs once per parameter set (`.each`, `@ParameterizedTest`,
    /// `@pytest.mark.parametrize`, `#[case]`, `#[test_case]`).
    pub parameterized: bool,
    /// An explicit human title (JUnit 5 `@DisplayName`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
}

/// A Go function that the `testing` package runs but that is not a test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OtherKind {
    /// `func BenchmarkXxx(b *testing.B)`.
    Benchmark,
    /// `func FuzzXxx(f *testing.F)`.
    Fuzz,
    /// `func ExampleXxx()`.
    Example,
}

/// A benchmark, fuzz target or example, reported apart from tests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OtherFunction {
    /// Which kind of function.
    pub kind: OtherKind,
    /// Its name.
    pub name: String,
    /// 1-based line of the name.
    pub line: u32,
}

/// The tests of one framework in one file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileInventory {
    /// Path relative to the repository root, `/`-separated.
    pub path: String,
    /// The framework these tests belong to (a file may appear once per framework).
    pub framework: Framework,
    /// Tests in source order.
    pub tests: Vec<TestCase>,
    /// Benchmarks, fuzz targets and examples (Go), in source order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub other: Vec<OtherFunction>,
}

/// Counts for one framework or for the whole inventory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Counts {
    /// Files (file × framework entries).
    pub files: u64,
    /// Tests of every modifier.
    pub tests: u64,
    /// Tests whose modifier is `skip`.
    pub skipped: u64,
    /// Tests whose modifier is `only`.
    pub only: u64,
    /// Tests whose modifier is `todo`.
    pub todo: u64,
    /// Go benchmarks.
    pub benchmarks: u64,
    /// Go fuzz targets.
    pub fuzz: u64,
    /// Go examples.
    pub examples: u64,
}

impl Counts {
    fn add_file(&mut self, file: &FileInventory) {
        self.files += 1;
        for test in &file.tests {
            self.tests += 1;
            match test.modifier {
                Modifier::None => {}
                Modifier::Skip => self.skipped += 1,
                Modifier::Only => self.only += 1,
                Modifier::Todo => self.todo += 1,
            }
        }
        for other in &file.other {
            match other.kind {
                OtherKind::Benchmark => self.benchmarks += 1,
                OtherKind::Fuzz => self.fuzz += 1,
                OtherKind::Example => self.examples += 1,
            }
        }
    }
}

/// Totals per framework and overall.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Totals {
    /// Everything.
    pub overall: Counts,
    /// Per framework (only frameworks that occur).
    pub by_framework: BTreeMap<Framework, Counts>,
}

/// What the walk left out, so a reader knows the inventory's blind spots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ScanStats {
    /// Regular files looked at (after directory exclusions).
    pub files_visited: u64,
    /// Candidate source files read and scanned.
    pub files_scanned: u64,
    /// Candidate source files skipped for being larger than the size cap.
    pub files_too_large: u64,
    /// Symbolic links not followed.
    pub symlinks_skipped: u64,
    /// Candidate source files a scanner failed on (a bug in Fairlane, logged), and files or
    /// folders whose full path is too long to open: left out, and the rest of the tree scanned.
    /// Absent from inventories stored before it existed.
    #[serde(default)]
    pub files_unscannable: u64,
}

/// The test inventory of a source tree.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Inventory {
    /// One entry per file and framework with at least one test or other function, sorted by path
    /// then framework.
    pub files: Vec<FileInventory>,
    /// Totals.
    pub totals: Totals,
    /// What the walk saw and skipped.
    pub stats: ScanStats,
}

impl Inventory {
    /// Builds an inventory from file entries: drops empty entries, sorts by (path, framework) and
    /// computes totals.
    pub fn from_files(mut files: Vec<FileInventory>, stats: ScanStats) -> Inventory {
        files.retain(|f| !f.tests.is_empty() || !f.other.is_empty());
        files.sort_by(|a, b| (&a.path, a.framework).cmp(&(&b.path, b.framework)));
        let mut totals = Totals::default();
        for file in &files {
            totals.overall.add_file(file);
            totals
                .by_framework
                .entry(file.framework)
                .or_default()
                .add_file(file);
        }
        Inventory {
            files,
            totals,
            stats,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn test(name: &str, modifier: Modifier) -> TestCase {
        TestCase {
            name: name.into(),
            suite: vec![],
            line: 1,
            modifier,
            parameterized: false,
            display_name: None,
        }
    }

    #[test]
    fn from_files_sorts_drops_empty_and_totals() {
        let files = vec![
            FileInventory {
                path: "b.rs".into(),
                framework: Framework::Rust,
                tests: vec![test("a", Modifier::Skip), test("b", Modifier::None)],
                other: vec![],
            },
            FileInventory {
                path: "a_test.go".into(),
                framework: Framework::Go,
                tests: vec![test("TestA", Modifier::Only)],
                other: vec![OtherFunction {
                    kind: OtherKind::Benchmark,
                    name: "BenchmarkA".into(),
                    line: 3,
                }],
            },
            FileInventory {
                path: "empty.rs".into(),
                framework: Framework::Rust,
                tests: vec![],
                other: vec![],
            },
        ];
        let inv = Inventory::from_files(files, ScanStats::default());
        let paths: Vec<_> = inv.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, ["a_test.go", "b.rs"]);
        assert_eq!(inv.totals.overall.files, 2);
        assert_eq!(inv.totals.overall.tests, 3);
        assert_eq!(inv.totals.overall.skipped, 1);
        assert_eq!(inv.totals.overall.only, 1);
        assert_eq!(inv.totals.overall.benchmarks, 1);
        assert_eq!(inv.totals.by_framework[&Framework::Rust].tests, 2);
        assert_eq!(inv.totals.by_framework[&Framework::Go].tests, 1);
        let json = serde_json::to_value(&inv).unwrap();
        assert_eq!(json["files"][1]["framework"], "rust");
        assert_eq!(json["files"][1]["tests"][0]["modifier"], "skip");
        assert_eq!(json["totals"]["by_framework"]["go"]["benchmarks"], 1);
        let back: Inventory = serde_json::from_value(json).unwrap();
        assert_eq!(back, inv);
    }
}
