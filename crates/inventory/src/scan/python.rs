//! Finds Python tests: pytest functions (`def test*` at module level, `async def` too) and methods
//! of `Test*` classes, and unittest methods (`def test*`) of classes deriving from a `…TestCase`
//! base (directly or through a class of the same file). Decorators give skip and parametrize.

use std::collections::HashSet;

use super::lexer::{Lang, Tok, Token, dotted_name, dotted_span, lex};
use super::{Found, matching, suite_path};
use crate::model::{Framework, Modifier, TestCase};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ScopeKind {
    /// A class deriving from a `TestCase`.
    UnittestClass,
    /// A `Test*` class pytest collects.
    PytestClass,
    /// Any other class.
    OtherClass,
    /// A function body (nothing inside is collected).
    Function,
}

struct Scope {
    indent: u32,
    kind: ScopeKind,
    name: String,
    skip: bool,
    /// A class decorated with `@pytest.mark.parametrize`: each of its tests runs per case.
    parameterized: bool,
}

#[derive(Default)]
struct Decorators {
    skip: bool,
    parameterized: bool,
}

impl Decorators {
    fn add(&mut self, dotted: &str) {
        let last = dotted.rsplit('.').next().unwrap_or(dotted);
        match last {
            "skip" => self.skip = true,
            "parametrize" | "parameterize" | "expand" => self.parameterized = true,
            _ => {}
        }
    }
}

/// Splits the file's tokens into logical lines: a new one starts at the first token of a
/// physical line when no bracket is open and the previous line did not end in `\`.
fn logical_lines<'a, 's>(toks: &'a [Token<'s>]) -> Vec<&'a [Token<'s>]> {
    let mut lines = Vec::new();
    let mut start = 0;
    let mut depth = 0i32;
    for (k, t) in toks.iter().enumerate() {
        let continued = k > 0 && toks[k - 1].is_punct(b'\\');
        if k > start && t.indent.is_some() && depth <= 0 && !continued {
            lines.push(&toks[start..k]);
            start = k;
        }
        match t.kind {
            Tok::Punct(b'(' | b'[' | b'{') => depth += 1,
            Tok::Punct(b')' | b']' | b'}') => depth -= 1,
            _ => {}
        }
    }
    if start < toks.len() {
        lines.push(&toks[start..]);
    }
    lines
}

pub(crate) fn scan(src: &str) -> Found {
    let toks = lex(src, Lang::Python);
    let mut found = Found::default();
    let mut scopes: Vec<Scope> = Vec::new();
    let mut testcase_classes: HashSet<String> = HashSet::new();
    let mut decorators = Decorators::default();

    for line in logical_lines(&toks) {
        if found.is_full() {
            break;
        }
        let indent = line[0].indent.unwrap_or(0);
        while scopes.last().is_some_and(|s| s.indent >= indent) {
            scopes.pop();
        }
        let first = &line[0];
        if first.is_punct(b'@') {
            decorators.add(&dotted_name(&line[1..]));
            continue;
        }
        if first.is_ident("class") && line.get(1).is_some_and(|t| t.kind == Tok::Ident) {
            let name = line[1].text.to_string();
            let bases = class_bases(line);
            let derives_testcase = bases.iter().any(|b| {
                let last = b.rsplit('.').next().unwrap_or(b);
                last.ends_with("TestCase") || testcase_classes.contains(last)
            });
            let in_class_chain = scopes.iter().all(|s| s.kind == ScopeKind::PytestClass);
            let kind = if derives_testcase {
                testcase_classes.insert(name.clone());
                ScopeKind::UnittestClass
            } else if name.starts_with("Test") && in_class_chain {
                ScopeKind::PytestClass
            } else {
                ScopeKind::OtherClass
            };
            let skip = decorators.skip || scopes.iter().any(|s| s.skip);
            let parameterized = decorators.parameterized || scopes.iter().any(|s| s.parameterized);
            scopes.push(Scope {
                indent,
                kind,
                name,
                skip,
                parameterized,
            });
            decorators = Decorators::default();
            continue;
        }
        let def_at = if first.is_ident("async") { 1 } else { 0 };
        if line.get(def_at).is_some_and(|t| t.is_ident("def"))
            && let Some(name_tok) = line.get(def_at + 1).filter(|t| t.kind == Tok::Ident)
        {
            let framework = match scopes.last().map(|s| s.kind) {
                None => Some(Framework::Pytest),
                Some(ScopeKind::UnittestClass) => Some(Framework::Unittest),
                Some(ScopeKind::PytestClass)
                    if scopes.iter().all(|s| s.kind == ScopeKind::PytestClass) =>
                {
                    Some(Framework::Pytest)
                }
                _ => None,
            };
            if let Some(framework) = framework
                && name_tok.text.starts_with("test")
            {
                let skip = decorators.skip || scopes.iter().any(|s| s.skip);
                found.push_test(
                    framework,
                    TestCase {
                        name: name_tok.text.to_string(),
                        suite: suite_path(scopes.iter().map(|s| s.name.as_str())),
                        line: name_tok.line,
                        modifier: if skip { Modifier::Skip } else { Modifier::None },
                        parameterized: decorators.parameterized
                            || scopes.iter().any(|s| s.parameterized),
                        display_name: None,
                    },
                );
            }
            scopes.push(Scope {
                indent,
                kind: ScopeKind::Function,
                name: name_tok.text.to_string(),
                skip: false,
                parameterized: false,
            });
        }
        decorators = Decorators::default();
    }
    found
}

/// The dotted base-class names of a `class Name(Base, mod.Other, metaclass=M):` line.
fn class_bases(line: &[Token<'_>]) -> Vec<String> {
    let Some(open) = line.get(2).filter(|t| t.is_punct(b'(')).map(|_| 2) else {
        return Vec::new();
    };
    let close = matching(line, open);
    let mut bases = Vec::new();
    let mut k = open + 1;
    while k < close {
        let (name, width) = dotted_span(&line[k..close]);
        let is_keyword_arg = line.get(k + width).is_some_and(|t| t.is_punct(b'='));
        if !name.is_empty() && !is_keyword_arg {
            bases.push(name);
        }
        // Move past this argument.
        k += width.max(1);
        while k < close && !line[k].is_punct(b',') {
            k += 1;
        }
        k += 1;
    }
    bases
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tests(src: &str) -> Vec<(Framework, String, String, u32, Modifier, bool)> {
        scan(src)
            .tests
            .into_iter()
            .map(|(f, t)| {
                (
                    f,
                    t.suite.join("."),
                    t.name,
                    t.line,
                    t.modifier,
                    t.parameterized,
                )
            })
            .collect()
    }

    #[test]
    fn a_parametrized_class_parameterizes_its_tests() {
        let src = "import pytest\n\
                   @pytest.mark.parametrize(\"x\", [1, 2])\n\
                   class TestA:\n\
                   \x20   def test_a(self, x):\n\
                   \x20       pass\n\
                   \n\
                   class TestB:\n\
                   \x20   def test_b(self):\n\
                   \x20       pass\n";
        let parameterized: Vec<(String, bool)> =
            tests(src).into_iter().map(|t| (t.2, t.5)).collect();
        assert_eq!(
            parameterized,
            [("test_a".to_owned(), true), ("test_b".to_owned(), false)]
        );
    }

    #[test]
    fn finds_pytest_and_unittest_tests() {
        let src = r#"import unittest, pytest
# def test_commented(): pass
def helper():
    def test_nested(): pass
    """
    def test_in_docstring(): pass
    """

def test_top(): pass

@pytest.mark.parametrize("x", [
    1, 2,
])
async def test_async(
    x,
): pass

@pytest.mark.skip(reason="no")
def test_skipped(): pass

class TestGroup:
    def test_method(self): pass
    def helper(self): pass
    class TestInner:
        def test_deep(self): pass

class Base(unittest.TestCase):
    def testCamel(self): pass

class Derived(Base, metaclass=Meta):
    @unittest.skip("flaky")
    def test_derived(self): pass

@unittest.skip("all")
class TestSkippedCase(
    TestCase
):
    def test_a(self): pass

class Helper:
    def test_not_collected(self): pass
"#;
        assert_eq!(
            tests(src),
            [
                (
                    Framework::Pytest,
                    String::new(),
                    "test_top".into(),
                    9,
                    Modifier::None,
                    false
                ),
                (
                    Framework::Pytest,
                    String::new(),
                    "test_async".into(),
                    14,
                    Modifier::None,
                    true
                ),
                (
                    Framework::Pytest,
                    String::new(),
                    "test_skipped".into(),
                    19,
                    Modifier::Skip,
                    false
                ),
                (
                    Framework::Pytest,
                    "TestGroup".into(),
                    "test_method".into(),
                    22,
                    Modifier::None,
                    false
                ),
                (
                    Framework::Pytest,
                    "TestGroup.TestInner".into(),
                    "test_deep".into(),
                    25,
                    Modifier::None,
                    false
                ),
                (
                    Framework::Unittest,
                    "Base".into(),
                    "testCamel".into(),
                    28,
                    Modifier::None,
                    false
                ),
                (
                    Framework::Unittest,
                    "Derived".into(),
                    "test_derived".into(),
                    32,
                    Modifier::Skip,
                    false
                ),
                (
                    Framework::Unittest,
                    "TestSkippedCase".into(),
                    "test_a".into(),
                    38,
                    Modifier::Skip,
                    false
                ),
            ]
        );
    }

    #[test]
    fn tabs_and_backslash_continuations() {
        let src =
            "class TestT:\n\tdef test_tab(self): pass\nx = 1 + \\\n    2\ndef test_after(): pass\n";
        let names: Vec<_> = tests(src).into_iter().map(|t| t.2).collect();
        assert_eq!(names, ["test_tab", "test_after"]);
    }
}
