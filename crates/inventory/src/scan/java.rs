//! Finds Java tests: methods annotated `@Test`, `@ParameterizedTest`, `@RepeatedTest`,
//! `@TestFactory` or `@TestTemplate` (JUnit 4/5, TestNG), with enclosing classes (nested ones
//! too) as suite, `@Disabled`/`@Ignore` (on the method or a class) as skip and `@DisplayName`.

use super::lexer::{Lang, Tok, Token, dotted_name, dotted_span, lex};
use super::{Found, Scopes, between, matching, suite_path};
use crate::model::{Framework, Modifier, TestCase};

const TEST_ANNOTATIONS: [&str; 5] = [
    "Test",
    "ParameterizedTest",
    "RepeatedTest",
    "TestFactory",
    "TestTemplate",
];
const MULTI_RUN_ANNOTATIONS: [&str; 4] = [
    "ParameterizedTest",
    "RepeatedTest",
    "TestFactory",
    "TestTemplate",
];
const SKIP_ANNOTATIONS: [&str; 2] = ["Disabled", "Ignore"];

struct Annotation {
    /// Full dotted name as written (`org.junit.Test` or `Test`).
    name: String,
    /// The first string argument, if any (`@DisplayName("…")`).
    text: Option<String>,
}

impl Annotation {
    fn simple_name(&self) -> &str {
        self.name.rsplit('.').next().unwrap_or(&self.name)
    }
}

struct ClassScope {
    name: String,
    skip: bool,
}

/// The framework named by the file's imports (or fully qualified annotations). The class that
/// supplies `@Test` decides (`org.junit.Test`, `org.junit.jupiter.api.Test`,
/// `org.testng.annotations.Test`): JUnit 4 tests may well use JUnit 5's assertions. Without
/// it, any JUnit 5 name makes the file JUnit 5, then TestNG, then JUnit 4.
fn detect_framework(toks: &[Token<'_>]) -> Framework {
    let mut junit5 = false;
    let mut junit4 = false;
    let mut testng = false;
    for (k, t) in toks.iter().enumerate() {
        let qualified = if t.is_ident("import") {
            // `import static org.junit.Assert.assertEquals;` names the class after `static`.
            let from = if toks.get(k + 1).is_some_and(|n| n.is_ident("static")) {
                k + 2
            } else {
                k + 1
            };
            dotted_name(toks.get(from..).unwrap_or(&[]))
        } else if t.is_punct(b'@') {
            dotted_name(&toks[k + 1..])
        } else {
            continue;
        };
        match qualified.as_str() {
            "org.junit.Test" => return Framework::Junit4,
            "org.junit.jupiter.api.Test" => return Framework::Junit5,
            "org.testng.annotations.Test" => return Framework::Testng,
            _ => {}
        }
        if qualified.starts_with("org.junit.jupiter") {
            junit5 = true;
        } else if qualified.starts_with("org.testng") {
            testng = true;
        } else if qualified.starts_with("org.junit.") {
            junit4 = true;
        }
    }
    if junit5 {
        Framework::Junit5
    } else if testng {
        Framework::Testng
    } else if junit4 {
        Framework::Junit4
    } else {
        Framework::Junit5
    }
}

pub(crate) fn scan(src: &str) -> Found {
    let toks = lex(src, Lang::Java);
    let framework = detect_framework(&toks);
    let mut found = Found::default();
    // Open braces, class bodies named; and how many of those classes are skipped.
    let mut scopes: Scopes<ClassScope> = Scopes::new();
    let mut skipped_classes = 0usize;
    let mut annotations: Vec<Annotation> = Vec::new();
    let mut pending_class: Option<ClassScope> = None;
    let mut i = 0;
    while i < toks.len() && !found.is_full() {
        let t = &toks[i];
        let prev_is_dot = i > 0 && toks[i - 1].is_punct(b'.');
        match t.kind {
            Tok::Punct(b'@')
                if toks
                    .get(i + 1)
                    .is_some_and(|n| n.kind == Tok::Ident && n.text != "interface") =>
            {
                let (name, width) = dotted_span(&toks[i + 1..]);
                let mut next = i + 1 + width;
                let mut text = None;
                if toks.get(next).is_some_and(|n| n.is_punct(b'(')) {
                    let close = matching(&toks, next);
                    text = between(&toks, next, close)
                        .iter()
                        .find_map(|a| a.str_value().map(str::to_string));
                    next = close + 1;
                }
                annotations.push(Annotation { name, text });
                i = next;
                continue;
            }
            Tok::Ident
                if matches!(t.text, "class" | "interface" | "enum" | "record")
                    && !prev_is_dot
                    && toks.get(i + 1).is_some_and(|n| n.kind == Tok::Ident) =>
            {
                let skip = annotations
                    .iter()
                    .any(|a| SKIP_ANNOTATIONS.contains(&a.simple_name()));
                pending_class = Some(ClassScope {
                    name: toks[i + 1].text.to_string(),
                    skip,
                });
                annotations.clear();
                i += 2;
                continue;
            }
            Tok::Ident
                if toks.get(i + 1).is_some_and(|n| n.is_punct(b'(')) && !annotations.is_empty() =>
            {
                let is_test = annotations
                    .iter()
                    .any(|a| TEST_ANNOTATIONS.contains(&a.simple_name()));
                let in_class = scopes.innermost_is_named();
                if is_test && in_class {
                    let skip = annotations
                        .iter()
                        .any(|a| SKIP_ANNOTATIONS.contains(&a.simple_name()))
                        || skipped_classes > 0;
                    found.push_test(
                        framework,
                        TestCase {
                            name: t.text.to_string(),
                            suite: suite_path(scopes.named().map(|c| c.name.as_str())),
                            line: t.line,
                            modifier: if skip { Modifier::Skip } else { Modifier::None },
                            parameterized: annotations
                                .iter()
                                .any(|a| MULTI_RUN_ANNOTATIONS.contains(&a.simple_name())),
                            display_name: annotations
                                .iter()
                                .find(|a| a.simple_name() == "DisplayName")
                                .and_then(|a| a.text.clone()),
                        },
                    );
                }
                annotations.clear();
            }
            Tok::Punct(b'{') => {
                let class = pending_class.take();
                skipped_classes += usize::from(class.as_ref().is_some_and(|c| c.skip));
                scopes.open(class);
                annotations.clear();
            }
            Tok::Punct(b'}') => {
                if scopes.close().is_some_and(|c| c.skip) {
                    skipped_classes = skipped_classes.saturating_sub(1);
                }
                annotations.clear();
            }
            Tok::Punct(b';' | b'=') => annotations.clear(),
            _ => {}
        }
        i += 1;
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_annotated_methods_in_nested_classes() {
        let src = r#"package x;
import org.junit.jupiter.api.*;
import org.junit.jupiter.params.ParameterizedTest;

@DisplayName("Users")
class UserServiceTest {
    // @Test void commented() {}
    String s = "@Test void inString() {}";

    @Test
    void createsUser() {}

    @ParameterizedTest
    @ValueSource(strings = {"a", "b"})
    void acceptsNames(String name) {}

    @Test @Disabled("later") public void disabledOne() throws Exception {}

    @RepeatedTest(3) void repeats() {}

    @Test
    @DisplayName("rejects expired tokens")
    void rejectsExpired() {
        Object o = new Object() { public String toString() { return ""; } };
    }

    void helper() {}

    @Nested
    @Disabled
    class WhenAdmin {
        @TestFactory
        Stream<DynamicTest> dynamicTests() { return Stream.empty(); }
    }

    @Override
    public String toString() { return Foo.class.getName(); }
}
"#;
        let found = scan(src);
        let tests: Vec<_> = found
            .tests
            .iter()
            .map(|(f, t)| {
                assert_eq!(*f, Framework::Junit5);
                (
                    t.suite.join("$"),
                    t.name.as_str(),
                    t.line,
                    t.modifier,
                    t.parameterized,
                    t.display_name.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            tests,
            [
                (
                    "UserServiceTest".into(),
                    "createsUser",
                    11,
                    Modifier::None,
                    false,
                    None
                ),
                (
                    "UserServiceTest".into(),
                    "acceptsNames",
                    15,
                    Modifier::None,
                    true,
                    None
                ),
                (
                    "UserServiceTest".into(),
                    "disabledOne",
                    17,
                    Modifier::Skip,
                    false,
                    None
                ),
                (
                    "UserServiceTest".into(),
                    "repeats",
                    19,
                    Modifier::None,
                    true,
                    None
                ),
                (
                    "UserServiceTest".into(),
                    "rejectsExpired",
                    23,
                    Modifier::None,
                    false,
                    Some("rejects expired tokens")
                ),
                (
                    "UserServiceTest$WhenAdmin".into(),
                    "dynamicTests",
                    33,
                    Modifier::Skip,
                    true,
                    None
                ),
            ]
        );
    }

    #[test]
    fn junit4_and_testng_detection() {
        let j4 = scan(
            "import org.junit.Test;\npublic class ATest { @Test(expected = X.class) public void a() {} @Ignore @Test public void b() {} }",
        );
        assert!(j4.tests.iter().all(|(f, _)| *f == Framework::Junit4));
        assert_eq!(j4.tests.len(), 2);
        assert_eq!(j4.tests[1].1.modifier, Modifier::Skip);
        let ng = scan("import org.testng.annotations.Test;\nclass B { @Test void c() {} }");
        assert_eq!(ng.tests[0].0, Framework::Testng);
        // A static import alone says JUnit 4 too.
        let static_only = scan(
            "import static org.junit.Assert.assertEquals;\nclass C { @Test public void d() {} }",
        );
        assert_eq!(static_only.tests[0].0, Framework::Junit4);
    }

    #[test]
    fn the_class_that_supplies_test_decides_the_framework() {
        // JUnit 4 tests may use JUnit 5's assertions.
        let mixed = scan(
            "import static org.junit.jupiter.api.Assertions.*;\nimport org.junit.Test;\nclass A { @Test public void a() {} }",
        );
        assert_eq!(mixed.tests[0].0, Framework::Junit4);
        let jupiter = scan(
            "import org.junit.Assert;\nimport org.junit.jupiter.api.Test;\nclass A { @Test void a() {} }",
        );
        assert_eq!(jupiter.tests[0].0, Framework::Junit5);
    }

    #[test]
    fn a_skipped_class_skips_only_the_tests_inside_it() {
        let found = scan(
            "class A { @Disabled class B { @Test void b() {} class C { @Test void c() {} } } @Test void a() {} }\nclass D { @Test void d() {} }",
        );
        let tests: Vec<_> = found
            .tests
            .iter()
            .map(|(_, t)| (t.suite.join("$"), t.name.as_str(), t.modifier))
            .collect();
        assert_eq!(
            tests,
            [
                ("A$B".to_owned(), "b", Modifier::Skip),
                ("A$B$C".to_owned(), "c", Modifier::Skip),
                ("A".to_owned(), "a", Modifier::None),
                ("D".to_owned(), "d", Modifier::None),
            ]
        );
    }

    #[test]
    fn deep_anonymous_braces_do_not_make_each_test_slower() {
        use crate::scan::MAX_TESTS_PER_FILE;
        // Each test used to walk every open brace: 900,000 of them, times the file's cap on tests.
        let src = format!(
            "{} class A {{ {} }}",
            "{".repeat(900_000),
            "@Test void a() {}\n".repeat(MAX_TESTS_PER_FILE)
        );
        crate::scan::assert_fills_the_cap_quickly(scan, &src, "A");
    }
}
