//! Finds Rust tests: functions carrying a test attribute (`#[test]`, `#[tokio::test]`,
//! `#[rstest]`, `#[test_case(..)]`, any `#[…::test]`), with their enclosing modules as suite.

use super::lexer::{Lang, Tok, Token, lex};
use super::{Found, Scopes, between, matching, suite_path};
use crate::model::{Framework, Modifier, TestCase};

/// Last segments of the attribute paths that make a function a test.
const TEST_ATTRIBUTES: [&str; 5] = [
    "test",
    "rstest",
    "test_case",
    "wasm_bindgen_test",
    "quickcheck",
];

/// Whether an attribute makes a function a test, by its last path segment (`rstest::rstest`,
/// `test_case::test_case`, `tokio::test`).
fn is_test_attribute(path: &str) -> bool {
    TEST_ATTRIBUTES.contains(&last_segment(path))
}

/// `case` of `rstest::case`.
fn last_segment(path: &str) -> &str {
    path.rsplit("::").next().unwrap_or(path)
}

/// The path of an attribute (`tokio::test` in `#[tokio::test(flavor = "…")]`).
fn attribute_path(tokens: &[Token<'_>]) -> String {
    let mut path = String::new();
    for t in tokens {
        match t.kind {
            Tok::Ident => path.push_str(t.text),
            Tok::Punct(b':') => path.push(':'),
            _ => break,
        }
    }
    path
}

pub(crate) fn scan(src: &str) -> Found {
    let toks = lex(src, Lang::Rust);
    let mut found = Found::default();
    // Open braces, module bodies named.
    let mut scopes: Scopes<String> = Scopes::new();
    let mut pending_mod: Option<String> = None;
    let mut attributes: Vec<String> = Vec::new();
    let mut i = 0;
    while i < toks.len() && !found.is_full() {
        let t = &toks[i];
        let next = toks.get(i + 1);
        match t.kind {
            Tok::Punct(b'#') => {
                let inner = next.is_some_and(|n| n.is_punct(b'!'));
                let open = if inner { i + 2 } else { i + 1 };
                if toks.get(open).is_some_and(|o| o.is_punct(b'[')) {
                    let close = matching(&toks, open);
                    if !inner {
                        attributes.push(attribute_path(between(&toks, open, close)));
                    }
                    i = close + 1;
                    continue;
                }
            }
            Tok::Ident if t.text == "mod" && next.is_some_and(|n| n.kind == Tok::Ident) => {
                pending_mod = next.map(|n| n.text.to_string());
                attributes.clear();
                i += 2;
                continue;
            }
            Tok::Ident if t.text == "fn" && next.is_some_and(|n| n.kind == Tok::Ident) => {
                if let Some(name) = next
                    && attributes.iter().any(|a| is_test_attribute(a))
                {
                    let skip = attributes.iter().any(|a| a == "ignore");
                    // `#[case(…)]`, `#[rstest::case(…)]`, a named `#[case::empty(…)]`, and
                    // `#[test_case(…)]`.
                    let parameterized = attributes.iter().any(|a| {
                        a.split("::")
                            .any(|segment| matches!(segment, "case" | "test_case"))
                    });
                    found.push_test(
                        Framework::Rust,
                        TestCase {
                            name: name.text.trim_start_matches("r#").to_string(),
                            suite: suite_path(scopes.named().map(String::as_str)),
                            line: name.line,
                            modifier: if skip { Modifier::Skip } else { Modifier::None },
                            parameterized,
                            display_name: None,
                        },
                    );
                }
                attributes.clear();
                i += 2;
                continue;
            }
            Tok::Punct(b'{') => {
                scopes.open(pending_mod.take());
                attributes.clear();
            }
            Tok::Punct(b'}') => {
                scopes.close();
                attributes.clear();
            }
            Tok::Punct(b';') => {
                pending_mod = None;
                attributes.clear();
            }
            _ => {}
        }
        i += 1;
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(src: &str) -> Vec<(String, String, u32, Modifier, bool)> {
        scan(src)
            .tests
            .into_iter()
            .map(|(_, t)| {
                (
                    t.suite.join("::"),
                    t.name,
                    t.line,
                    t.modifier,
                    t.parameterized,
                )
            })
            .collect()
    }

    #[test]
    fn named_rstest_cases_are_parameterized() {
        let found = scan(
            "#[rstest]\n#[case::empty(\"\")]\n#[case::one(\"a\")]\nfn len(#[case] s: &str) {}\n",
        );
        let tests: Vec<(&str, bool)> = found
            .tests
            .iter()
            .map(|(_, t)| (t.name.as_str(), t.parameterized))
            .collect();
        assert_eq!(tests, [("len", true)]);
    }

    #[test]
    fn finds_attributes_modules_and_modifiers() {
        let src = r##"
//! #[test] fn in_doc() {}
fn helper() { let s = "#[test] fn in_string() {}"; }
/* #[test] fn in_block() {} */
#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn plain() {}
    #[tokio::test(flavor = "multi_thread")]
    async fn tokio_one() {}
    #[test]
    #[ignore = "slow"]
    fn ignored() {}
    mod inner {
        #[rstest]
        #[case(1)]
        #[case(2)]
        fn cases(#[case] n: u32) {}
        #[sqlx::test]
        pub async fn with_db() {}
    }
    #[derive(Debug)]
    struct NotATest;
    fn not_a_test() {}
}
mod declared_elsewhere;
#[test_case(1 ; "one")]
fn top_level(n: u32) {}
macro_rules! gen { ($n:ident) => { #[test] fn $n() {} } }
"##;
        assert_eq!(
            names(src),
            [
                ("tests".into(), "plain".into(), 9, Modifier::None, false),
                (
                    "tests".into(),
                    "tokio_one".into(),
                    11,
                    Modifier::None,
                    false
                ),
                ("tests".into(), "ignored".into(), 14, Modifier::Skip, false),
                (
                    "tests::inner".into(),
                    "cases".into(),
                    19,
                    Modifier::None,
                    true
                ),
                (
                    "tests::inner".into(),
                    "with_db".into(),
                    21,
                    Modifier::None,
                    false
                ),
                (String::new(), "top_level".into(), 29, Modifier::None, true),
            ]
        );
    }

    #[test]
    fn qualified_test_attributes_count() {
        let found = names(
            "#[rstest::rstest]\n#[rstest::case(1)]\nfn a(x: u8) {}\n#[test_case::test_case(1)]\nfn b(_: u8) {}\n#[test_log::test]\nfn c() {}\n#[cfg(test)]\nfn not_a_test() {}\n",
        );
        let summary: Vec<_> = found.iter().map(|t| (t.1.as_str(), t.4)).collect();
        assert_eq!(summary, [("a", true), ("b", true), ("c", false)]);
    }

    #[test]
    fn deep_anonymous_braces_do_not_make_each_test_slower() {
        use crate::scan::MAX_TESTS_PER_FILE;
        // Each test used to walk every open brace: 900,000 of them, times the file's cap on tests.
        let src = format!(
            "mod m {{ {} {} }}",
            "{".repeat(900_000),
            "#[test] fn a() {}\n".repeat(MAX_TESTS_PER_FILE)
        );
        crate::scan::assert_fills_the_cap_quickly(scan, &src, "m");
    }
}
