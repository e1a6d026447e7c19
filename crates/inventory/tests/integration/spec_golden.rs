//! The behaviour specification of a known inventory, compared with an exact Markdown text.

use inventory::model::{FileInventory, Framework, Inventory, ScanStats, TestCase};
use inventory::{Modifier, Spec};

fn test(name: &str, suite: &[&str], line: u32, modifier: Modifier) -> TestCase {
    TestCase {
        name: name.into(),
        suite: suite.iter().map(|s| (*s).to_string()).collect(),
        line,
        modifier,
        parameterized: false,
        display_name: None,
    }
}

fn file(path: &str, framework: Framework, tests: Vec<TestCase>) -> FileInventory {
    FileInventory {
        path: path.into(),
        framework,
        tests,
        other: Vec::new(),
    }
}

fn known_inventory() -> Inventory {
    let mut each = test("accepts %s", &["login form"], 12, Modifier::None);
    each.parameterized = true;
    let mut titled = test("rejectsExpired", &["UserServiceTest"], 30, Modifier::None);
    titled.display_name = Some("rejects   expired tokens".into());
    Inventory::from_files(
        vec![
            file(
                "web/src/login.test.ts",
                Framework::Vitest,
                vec![
                    test("rejects expired tokens", &["login form"], 4, Modifier::None),
                    test("remembers the user", &["login form"], 10, Modifier::Skip),
                    each,
                    test(
                        "shows a *warning*",
                        &["login form", "when locked"],
                        15,
                        Modifier::Only,
                    ),
                    test("writes docs", &[], 20, Modifier::Todo),
                ],
            ),
            file(
                "go/server_test.go",
                Framework::Go,
                vec![
                    test("TestHTTPServerStarts", &[], 7, Modifier::None),
                    test("empty input", &["TestHTTPServerStarts"], 8, Modifier::None),
                    test(
                        "with_spaces",
                        &["TestHTTPServerStarts", "empty input"],
                        9,
                        Modifier::None,
                    ),
                ],
            ),
            file(
                "python/tests/test_login.py",
                Framework::Pytest,
                vec![
                    test("test_user_can_login", &[], 4, Modifier::None),
                    test(
                        "test_logout_clears_session",
                        &["TestLogout"],
                        22,
                        Modifier::None,
                    ),
                ],
            ),
            file(
                "src/UserServiceTest.java",
                Framework::Junit5,
                vec![
                    test(
                        "shouldReturnEmptyList",
                        &["UserServiceTest"],
                        12,
                        Modifier::None,
                    ),
                    titled,
                ],
            ),
            file(
                "src/lib.rs",
                Framework::Rust,
                vec![test("test_parse_JSON_body", &["tests"], 9, Modifier::Skip)],
            ),
        ],
        ScanStats::default(),
    )
}

const GOLDEN: &str = "\
# Behaviour specification

13 behaviours in 5 files (2 skipped, 1 focused, 1 to do).

## `go/server_test.go` (go)

- HTTP server starts
  - empty input
    - with spaces

## `python/tests/test_login.py` (pytest)

- user can login
- **logout**
  - logout clears session

## `src/UserServiceTest.java` (junit5)

- **user service**
  - should return empty list
  - rejects expired tokens

## `src/lib.rs` (rust)

- **tests**
  - parse JSON body _(skipped)_

## `web/src/login.test.ts` (vitest)

- **login form**
  - rejects expired tokens
  - remembers the user _(skipped)_
  - accepts %s _(each case)_
  - **when locked**
    - shows a \\*warning\\* _(focused)_
- writes docs _(to do)_
";

#[test]
fn markdown_matches_the_golden_text() {
    let spec = Spec::from_inventory(&known_inventory());
    assert_eq!(spec.to_markdown(), GOLDEN);
    assert_eq!(
        (spec.behaviours, spec.skipped, spec.focused, spec.todo),
        (13, 2, 1, 1)
    );
    // The structure serialises and round-trips.
    let json = serde_json::to_value(&spec).unwrap();
    assert_eq!(json["files"][0]["nodes"][0]["kind"], "behaviour");
    assert_eq!(json["files"][0]["nodes"][0]["title"], "HTTP server starts");
    assert_eq!(
        json["files"][0]["nodes"][0]["children"][0]["title"],
        "empty input"
    );
    assert_eq!(json["files"][1]["nodes"][1]["kind"], "suite");
    let back: Spec = serde_json::from_value(json).unwrap();
    assert_eq!(back, spec);
}

#[test]
fn a_single_behaviour_uses_singular_words() {
    let inventory = Inventory::from_files(
        vec![file(
            "a_test.go",
            Framework::Go,
            vec![test("TestUserCanLogin", &[], 3, Modifier::None)],
        )],
        ScanStats::default(),
    );
    assert_eq!(
        Spec::from_inventory(&inventory).to_markdown(),
        "# Behaviour specification\n\n1 behaviour in 1 file.\n\n## `a_test.go` (go)\n\n- user can login\n"
    );
}
