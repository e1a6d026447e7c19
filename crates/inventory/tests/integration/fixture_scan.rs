//! End to end over `file://`: a fixture repository with tests of every framework and look-alike
//! non-test files is analysed, and the exact inventory is asserted.

use inventory::model::{Framework, Inventory};
use inventory::scan::{SourceKind, scan_source};
use inventory::{Modifier, analyze};

use crate::support::{GitFixture, TempDir, leftovers, limits, policy};

const RUST_LIB: &str = r##"//! A library. Write `#[test]` above a function to add a test.
pub fn add(a: i32, b: i32) -> i32 {
    a + b
}

pub const HELP: &str = "#[test] fn in_a_string() {}";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_two_numbers() {
        assert_eq!(add(1, 2), 3);
    }

    #[test]
    #[ignore = "slow"]
    fn handles_overflow() {}

    // #[test]
    // fn commented_out() {}
}
"##;

const RUST_NOTES: &str = r##"//! How to write tests: put #[test] above a function.
/* #[test]
fn block_commented() {} */
pub fn raw() -> &'static str {
    r#"#[test] fn in_raw_string() {}"#
}
"##;

const RUST_INTEGRATION: &str = r#"use rstest::rstest;

#[tokio::test(flavor = "multi_thread")]
async fn server_starts() {}

#[rstest]
#[case(1)]
#[case(2)]
fn parses_numbers(#[case] n: u32) {
    assert!(n > 0);
}
"#;

const GO_NOT_TEST_FILE: &str = r#"package parse

import "testing"

func TestNotInATestFile(t *testing.T) {}
"#;

const GO_TEST: &str = r#"package parse

import "testing"

// func TestCommentedOut(t *testing.T) {}

func TestParse(t *testing.T) {
	t.Run("empty input", func(t *testing.T) {
		t.Run("with_spaces", func(t *testing.T) {})
	})
}

func TestHTTPServerStarts(t *testing.T) {
	t.Skip("needs a port")
}

func BenchmarkParse(b *testing.B) {}

func ExampleParse() {}
"#;

const GO_TESTDATA: &str = r#"package fixture

import "testing"

func TestInTestdata(t *testing.T) {}
"#;

const PY_HELPERS: &str = r#""""Helpers for tests.

def test_in_docstring():
    pass
"""


def make_user(name="x"):
    return {"name": name}


class UserFactory:
    def build(self):
        return make_user()
"#;

const PY_LOGIN: &str = r#"import pytest


def test_user_can_login():
    assert True


async def test_async_login():
    assert True


@pytest.mark.skip(reason="flaky")
def test_skipped():
    pass


# def test_commented_out():
#     pass


class TestLogout:
    def test_logout_clears_session(self):
        pass

    def helper(self):
        pass
"#;

const PY_MODELS: &str = r#"import unittest


class UserModelTest(unittest.TestCase):
    def test_save(self):
        pass

    def testDelete(self):
        pass

    def helper(self):
        pass
"#;

const TS_LOGIN: &str = r#"import { describe, it, test, expect } from 'vitest';

describe('login form', () => {
  it('rejects expired tokens', () => {
    expect(true).toBe(true);
  });

  // it('commented out', () => {});

  it.skip('remembers the user', () => {});

  test.each([['a'], ['b']])('accepts %s', (name) => {});

  describe('when locked', () => {
    it.only(`shows a warning`, () => {});
  });
});
"#;

const JS_API: &str = r#"const request = require('./request');

describe('api', function () {
  it('returns json', async function () {
    const body = await request('/x');
    if (!/json/.test(body)) throw new Error('no');
  });
  xit('retries on failure', function () {});
});
"#;

const JS_NOT_A_TEST: &str = r#"export function test(value) {
  return value > 0;
}

test('not a test');
describe('not a suite either');
"#;

const JAVA_JUNIT5: &str = r#"package com.example;

import org.junit.jupiter.api.Disabled;
import org.junit.jupiter.api.Nested;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.params.ParameterizedTest;
import org.junit.jupiter.params.provider.ValueSource;

class UserServiceTest {
    @Test
    void createsUser() {}

    @ParameterizedTest
    @ValueSource(strings = {"a", "b"})
    void acceptsNames(String name) {}

    @Test
    @Disabled("later")
    void deletesUser() {}

    // @Test void commentedOut() {}

    @Nested
    class WhenAdmin {
        @Test
        void canDeleteOthers() {}
    }
}
"#;

const JAVA_JUNIT4: &str = r#"package com.example;

import org.junit.Ignore;
import org.junit.Test;

public class LegacyTest {
    @Test
    public void legacyWorks() {}

    @Ignore
    @Test
    public void ignoredOne() {}
}
"#;

const JAVA_MAIN: &str = r#"package com.example;

public class UserService {
    /** Annotate methods with @Test to test them. */
    public String help() {
        return "@Test void x() {}";
    }
}
"#;

fn build_fixture() -> (GitFixture, String) {
    let repo = GitFixture::new("fixture-scan");
    repo.write("src/lib.rs", RUST_LIB);
    repo.write("src/notes.rs", RUST_NOTES);
    repo.write("tests/api.rs", RUST_INTEGRATION);
    repo.write("go/parse/parse.go", GO_NOT_TEST_FILE);
    repo.write("go/parse/parse_test.go", GO_TEST);
    repo.write("go/parse/testdata/fixture_test.go", GO_TESTDATA);
    repo.write("python/tests/test_helpers.py", PY_HELPERS);
    repo.write("python/tests/test_login.py", PY_LOGIN);
    repo.write("python/tests/test_models.py", PY_MODELS);
    repo.write(
        "web/package.json",
        r#"{"devDependencies": {"jest": "29.0.0"}}"#,
    );
    repo.write("web/src/login.test.ts", TS_LOGIN);
    repo.write("web/src/__tests__/api.js", JS_API);
    repo.write("web/src/util.js", JS_NOT_A_TEST);
    repo.write(
        "web/node_modules/lib/index.test.js",
        "it('in node_modules', () => {});\n",
    );
    repo.write("web/dist/app.test.js", "it('in dist', () => {});\n");
    repo.write(
        "java/src/test/java/com/example/UserServiceTest.java",
        JAVA_JUNIT5,
    );
    repo.write(
        "java/src/test/java/com/example/LegacyTest.java",
        JAVA_JUNIT4,
    );
    repo.write("java/src/main/java/com/example/UserService.java", JAVA_MAIN);
    repo.write(
        "docs/testing.md",
        "Name tests `test_*` and use `#[test]`.\n",
    );
    let commit = repo.commit("fixture");
    (repo, commit)
}

/// One line per test: `path (framework) | suite > … > name | line | modifier [| each]`.
fn describe(inventory: &Inventory) -> Vec<String> {
    let mut lines = Vec::new();
    for file in &inventory.files {
        for test in &file.tests {
            let mut path = test.suite.clone();
            path.push(test.name.clone());
            let mut line = format!(
                "{} ({}) | {} | {} | {}",
                file.path,
                file.framework,
                path.join(" > "),
                test.line,
                test.modifier.as_str()
            );
            if test.parameterized {
                line.push_str(" | each");
            }
            lines.push(line);
        }
    }
    lines
}

#[tokio::test]
async fn inventories_every_framework_exactly() {
    let (repo, commit) = build_fixture();
    let root = TempDir::new("fixture-scan-work");
    let limits = limits(root.path());
    let analysis = analyze(&repo.url(), None, &limits, &policy())
        .await
        .unwrap();
    assert_eq!(analysis.commit, commit);
    assert_eq!(analysis.repository, repo.url());

    let expected = [
        "go/parse/parse_test.go (go) | TestParse | 7 | none",
        "go/parse/parse_test.go (go) | TestParse > empty input | 8 | none",
        "go/parse/parse_test.go (go) | TestParse > empty input > with_spaces | 9 | none",
        "go/parse/parse_test.go (go) | TestHTTPServerStarts | 13 | skip",
        "java/src/test/java/com/example/LegacyTest.java (junit4) | LegacyTest > legacyWorks | 8 | none",
        "java/src/test/java/com/example/LegacyTest.java (junit4) | LegacyTest > ignoredOne | 12 | skip",
        "java/src/test/java/com/example/UserServiceTest.java (junit5) | UserServiceTest > createsUser | 11 | none",
        "java/src/test/java/com/example/UserServiceTest.java (junit5) | UserServiceTest > acceptsNames | 15 | none | each",
        "java/src/test/java/com/example/UserServiceTest.java (junit5) | UserServiceTest > deletesUser | 19 | skip",
        "java/src/test/java/com/example/UserServiceTest.java (junit5) | UserServiceTest > WhenAdmin > canDeleteOthers | 26 | none",
        "python/tests/test_login.py (pytest) | test_user_can_login | 4 | none",
        "python/tests/test_login.py (pytest) | test_async_login | 8 | none",
        "python/tests/test_login.py (pytest) | test_skipped | 13 | skip",
        "python/tests/test_login.py (pytest) | TestLogout > test_logout_clears_session | 22 | none",
        "python/tests/test_models.py (unittest) | UserModelTest > test_save | 5 | none",
        "python/tests/test_models.py (unittest) | UserModelTest > testDelete | 8 | none",
        "src/lib.rs (rust) | tests > adds_two_numbers | 13 | none",
        "src/lib.rs (rust) | tests > handles_overflow | 19 | skip",
        "tests/api.rs (rust) | server_starts | 4 | none",
        "tests/api.rs (rust) | parses_numbers | 9 | none | each",
        "web/src/__tests__/api.js (jest) | api > returns json | 4 | none",
        "web/src/__tests__/api.js (jest) | api > retries on failure | 8 | skip",
        "web/src/login.test.ts (vitest) | login form > rejects expired tokens | 4 | none",
        "web/src/login.test.ts (vitest) | login form > remembers the user | 10 | skip",
        "web/src/login.test.ts (vitest) | login form > accepts %s | 12 | none | each",
        "web/src/login.test.ts (vitest) | login form > when locked > shows a warning | 15 | only",
    ];
    assert_eq!(describe(&analysis.inventory), expected);

    let inv = &analysis.inventory;
    let go = &inv.files[0];
    let others: Vec<_> = go.other.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(others, ["BenchmarkParse", "ExampleParse"]);

    assert_eq!(inv.totals.overall.files, 9);
    assert_eq!(inv.totals.overall.tests, 26);
    assert_eq!(inv.totals.overall.skipped, 7);
    assert_eq!(inv.totals.overall.only, 1);
    assert_eq!(inv.totals.overall.benchmarks, 1);
    assert_eq!(inv.totals.overall.examples, 1);
    let per: Vec<(Framework, u64)> = inv
        .totals
        .by_framework
        .iter()
        .map(|(f, c)| (*f, c.tests))
        .collect();
    assert_eq!(
        per,
        [
            (Framework::Rust, 4),
            (Framework::Go, 4),
            (Framework::Pytest, 4),
            (Framework::Unittest, 2),
            (Framework::Jest, 2),
            (Framework::Vitest, 4),
            (Framework::Junit4, 2),
            (Framework::Junit5, 4),
        ]
    );
    // Look-alikes were read but yielded nothing.
    for path in [
        "src/notes.rs",
        "python/tests/test_helpers.py",
        "java/src/main/java/com/example/UserService.java",
    ] {
        assert!(
            !inv.files.iter().any(|f| f.path == path),
            "{path} should have no tests"
        );
    }
    assert!(inv.stats.files_scanned >= 12, "{:?}", inv.stats);
    assert_eq!(
        inv.files
            .iter()
            .filter(|f| f.tests.iter().any(|t| t.modifier == Modifier::Todo))
            .count(),
        0
    );

    // Deterministic: a second run gives the same JSON, and the checkout folders are gone.
    let again = analyze(&repo.url(), Some("main"), &limits, &policy())
        .await
        .unwrap();
    assert_eq!(
        serde_json::to_string(&again.inventory).unwrap(),
        serde_json::to_string(&analysis.inventory).unwrap()
    );
    assert_eq!(leftovers(&limits.work_root), Vec::<String>::new());
}

#[tokio::test]
async fn file_urls_are_refused_unless_allowed() {
    let (repo, _) = build_fixture();
    let root = TempDir::new("fixture-refused");
    let err = analyze(
        &repo.url(),
        None,
        &limits(root.path()),
        &inventory::UrlPolicy::default(),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(
            err,
            inventory::AnalyzeError::Refused(inventory::UrlError::FileUrlsNotAllowed)
        ),
        "{err}"
    );
    assert!(err.is_permanent());
}

/// Non-ASCII text in the places a scanner slices: strings, raw strings, templates, names.
const UNICODE_EDGES: [(SourceKind, &str); 5] = [
    (
        SourceKind::Go,
        "package p\nfunc TestÉté(t *testing.T) {\n\tt.Run(`sous-test é`, func(t *testing.T) {})\n}\n",
    ),
    (
        SourceKind::JavaScript,
        "describe(`suite ü ${x}`, () => {\n  it.each<Case>([[1]])('cas %i ø', (n) => {});\n});\n",
    ),
    (
        SourceKind::Python,
        "import pytest\n@pytest.mark.parametrize('x', ['é'])\ndef test_ünï(x):\n    \"\"\"dóc\"\"\"\n",
    ),
    (
        SourceKind::Rust,
        "#[cfg(test)]\nmod tësts {\n    #[test]\n    fn ß() { let s = r#\"é\"#; }\n}\n",
    ),
    (
        SourceKind::Java,
        "import static org.junit.Assert.*;\nclass T {\n  @DisplayName(\"é\")\n  @Test void ü() {}\n}\n",
    ),
];

/// A file may end anywhere (a truncated or malformed source): every prefix of every fixture
/// source, cut after each character, is scanned without a panic.
#[test]
fn every_prefix_of_every_fixture_source_scans_without_panicking() {
    let fixtures = [
        (SourceKind::Rust, RUST_LIB),
        (SourceKind::Rust, RUST_NOTES),
        (SourceKind::Rust, RUST_INTEGRATION),
        (SourceKind::Go, GO_NOT_TEST_FILE),
        (SourceKind::Go, GO_TEST),
        (SourceKind::Go, GO_TESTDATA),
        (SourceKind::Python, PY_HELPERS),
        (SourceKind::Python, PY_LOGIN),
        (SourceKind::Python, PY_MODELS),
        (SourceKind::JavaScript, TS_LOGIN),
        (SourceKind::JavaScript, JS_API),
        (SourceKind::JavaScript, JS_NOT_A_TEST),
        (SourceKind::Java, JAVA_JUNIT5),
        (SourceKind::Java, JAVA_JUNIT4),
        (SourceKind::Java, JAVA_MAIN),
    ];
    let mut failures = Vec::new();
    for (kind, source) in fixtures.into_iter().chain(UNICODE_EDGES) {
        let cuts = source.char_indices().map(|(i, _)| i).chain([source.len()]);
        for cut in cuts {
            let prefix = &source[..cut];
            let scanned =
                std::panic::catch_unwind(|| scan_source("t", kind, prefix, Framework::Jest));
            if scanned.is_err() {
                let last_line = prefix.lines().last().unwrap_or_default();
                failures.push(format!(
                    "{kind:?} cut after {cut} bytes, ending {last_line:?}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
