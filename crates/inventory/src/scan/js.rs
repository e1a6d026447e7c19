//! Finds JavaScript/TypeScript tests (Jest, Vitest, Mocha, Playwright): `describe`/`context`/
//! `suite` blocks nesting into suites, `it`/`test`/`specify` calls as tests, with `.skip`,
//! `.only`, `.todo`, `x…`/`f…` prefixes as modifiers and `.each`/`.for` as parameterized.
//! Also tells which runner a file is written for, from its imports and globals.

use super::lexer::{Lang, Tok, Token, lex};
use super::{Brackets, Found, MAX_NAME_CHARS, MAX_TESTS_PER_FILE, suite_path};
use crate::model::{Framework, Modifier, TestCase};

/// The most tokens a non-literal test title's expression may have.
const MAX_TITLE_EXPRESSION_TOKENS: usize = 256;

const SUITE_FUNCTIONS: [&str; 6] = [
    "describe",
    "context",
    "suite",
    "fdescribe",
    "xdescribe",
    "xcontext",
];
const TEST_FUNCTIONS: [&str; 7] = ["it", "test", "specify", "fit", "xit", "xtest", "xspecify"];
/// Chain members that keep a call a suite/test call; any other member (`test.step`,
/// `test.beforeEach`, `describe.configure`…) means it is not one.
const KNOWN_MEMBERS: [&str; 16] = [
    "skip",
    "only",
    "todo",
    "each",
    "for",
    "concurrent",
    "sequential",
    "serial",
    "parallel",
    "failing",
    "fails",
    "fixme",
    "fail",
    "skipIf",
    "runIf",
    "describe",
];
/// Members that take their own argument list (or a tagged template) before the real call.
const CALLED_MEMBERS: [&str; 4] = ["each", "for", "skipIf", "runIf"];

/// Which runner the file's own imports or globals name, if any.
pub(crate) fn detect_framework(toks: &[Token<'_>]) -> Option<Framework> {
    let mut by_global = None;
    for (k, t) in toks.iter().enumerate() {
        match &t.kind {
            // A module named by an import: `from '…'`, `import '…'`, `require('…')` or
            // `import('…')`; the same words in any other string (`toBe('mocha')`) say nothing.
            Tok::Str(v) if is_module_source(toks, k) => match v.as_str() {
                "vitest" => return Some(Framework::Vitest),
                "@playwright/test" => return Some(Framework::Playwright),
                "mocha" => return Some(Framework::Mocha),
                "@jest/globals" => return Some(Framework::Jest),
                _ => {}
            },
            Tok::Ident
                if by_global.is_none() && toks.get(k + 1).is_some_and(|n| n.is_punct(b'.')) =>
            {
                let member = toks.get(k + 2).map_or("", |m| m.text);
                if t.text == "jest" {
                    by_global = Some(Framework::Jest);
                } else if t.text == "vi"
                    && matches!(member, "fn" | "mock" | "spyOn" | "useFakeTimers")
                {
                    by_global = Some(Framework::Vitest);
                }
            }
            _ => {}
        }
    }
    by_global
}

/// Whether the string at `k` names a module: it follows `from` or `import`, or is the
/// argument of `require(…)` or `import(…)`.
fn is_module_source(toks: &[Token<'_>], k: usize) -> bool {
    let before = |back: usize| k.checked_sub(back).and_then(|i| toks.get(i));
    before(1).is_some_and(|t| t.is_ident("from") || t.is_ident("import"))
        || (before(1).is_some_and(|t| t.is_punct(b'('))
            && before(2).is_some_and(|t| t.is_ident("require") || t.is_ident("import")))
}

struct OpenSuite {
    name: String,
    modifier: Modifier,
    /// Index of the closing `)` of the suite call.
    end: usize,
}

/// Scans a test file; `fallback` is the framework to use when the file names none (from the
/// nearest `package.json`, else Jest).
pub(crate) fn scan(src: &str, fallback: Framework) -> Found {
    let toks = lex(src, Lang::Js);
    let framework = detect_framework(&toks).unwrap_or(fallback);
    let brackets = Brackets::of(&toks);
    let mut found = Found::default();
    let mut suites: Vec<OpenSuite> = Vec::new();
    // Suite calls count towards the cap as well: each costs its suite's modifiers per test.
    let mut calls = 0;
    let mut i = 0;
    while i < toks.len() && calls < MAX_TESTS_PER_FILE {
        while suites.last().is_some_and(|s| s.end <= i) {
            suites.pop();
        }
        if let Some(call) = parse_call(&toks, &brackets, i) {
            calls += 1;
            let own = call.modifier;
            if call.is_suite {
                suites.push(OpenSuite {
                    name: call.name,
                    modifier: own,
                    end: call.close,
                });
            } else {
                let inherited: Vec<Modifier> = suites.iter().map(|s| s.modifier).collect();
                let modifier = effective_modifier(own, &inherited);
                found.push_test(
                    framework,
                    TestCase {
                        name: call.name,
                        suite: suite_path(suites.iter().map(|s| s.name.as_str())),
                        line: toks[i].line,
                        modifier,
                        parameterized: call.parameterized,
                        display_name: None,
                    },
                );
            }
            i = call.open + 1;
            continue;
        }
        i += 1;
    }
    found
}

/// Skip anywhere on the path wins; then the test's own todo; then focus anywhere.
fn effective_modifier(own: Modifier, inherited: &[Modifier]) -> Modifier {
    let all = || std::iter::once(own).chain(inherited.iter().copied());
    if all().any(|m| m == Modifier::Skip) {
        Modifier::Skip
    } else if own == Modifier::Todo {
        Modifier::Todo
    } else if all().any(|m| m == Modifier::Only) {
        Modifier::Only
    } else {
        Modifier::None
    }
}

struct Call {
    is_suite: bool,
    name: String,
    modifier: Modifier,
    parameterized: bool,
    /// Index of the `(` of the call that carries the name.
    open: usize,
    /// Index of its closing `)`.
    close: usize,
}

/// Recognises `describe(…)`, `it.skip(…)`, `test.each([...])(…)`, `test.describe.serial(…)`…
/// starting at token `i`.
fn parse_call(toks: &[Token<'_>], brackets: &Brackets, i: usize) -> Option<Call> {
    let base = toks.get(i).filter(|t| t.kind == Tok::Ident)?;
    let is_suite_base = SUITE_FUNCTIONS.contains(&base.text);
    if !is_suite_base && !TEST_FUNCTIONS.contains(&base.text) {
        return None;
    }
    if i > 0 {
        let prev = &toks[i - 1];
        // A member access (`regex.test(`), or a declaration (`function test(`).
        if prev.is_punct(b'.') || prev.is_ident("function") {
            return None;
        }
    }
    let mut members: Vec<&str> = Vec::new();
    let mut j = i + 1;
    while toks.get(j).is_some_and(|t| t.is_punct(b'.')) {
        let member = toks.get(j + 1).filter(|t| t.kind == Tok::Ident)?;
        if !KNOWN_MEMBERS.contains(&member.text) {
            return None;
        }
        members.push(member.text);
        j += 2;
        if CALLED_MEMBERS.contains(&member.text) {
            // TypeScript type arguments first: `.each<Case>([…])`.
            if toks.get(j).is_some_and(|t| t.is_punct(b'<')) {
                j = type_arguments_end(toks, j)? + 1;
            }
            match toks.get(j) {
                Some(t) if t.is_punct(b'(') => j = brackets.matching(j) + 1,
                Some(t) if matches!(t.kind, Tok::Str(_)) => j += 1,
                _ => return None,
            }
        }
    }
    let open = j;
    if !toks.get(open)?.is_punct(b'(') {
        return None;
    }
    let close = brackets.matching(open);
    let first = toks.get(open + 1)?;
    // A method named `test` or `it` (`{ test(val) { … } }`, TypeScript's `test(s: string):
    // boolean`) is defined here, not called.
    if toks.get(close + 1).is_some_and(|t| t.is_punct(b'{'))
        || (first.kind == Tok::Ident && toks.get(open + 2).is_some_and(|t| t.is_punct(b':')))
    {
        return None;
    }
    if is_playwright_annotation(toks, brackets, base.text, &members, open, close) {
        return None;
    }
    // A literal title is the whole first argument only if an argument list's `,` or `)` follows
    // it: `'adds ' + n` is an expression, named by its source text below.
    let literal = first.str_value().filter(|_| {
        toks.get(open + 2)
            .is_some_and(|t| t.is_punct(b',') || t.is_punct(b')'))
    });
    let name = match literal {
        Some(v) => v.to_string(),
        None => {
            // A non-literal title: the expression's source text, up to its comma.
            let end = argument_end(toks, brackets, open + 1, close)?;
            if end == open + 1 {
                return None;
            }
            source_span(toks, open + 1, end)
        }
    };
    let is_suite = is_suite_base || members.contains(&"describe");
    let mut modifier = Modifier::None;
    if base.text.starts_with('x') {
        modifier = Modifier::Skip;
    } else if base.text.starts_with('f') {
        modifier = Modifier::Only;
    }
    for m in &members {
        match *m {
            "skip" | "fixme" => modifier = Modifier::Skip,
            "only" if modifier == Modifier::None => modifier = Modifier::Only,
            "todo" if modifier == Modifier::None => modifier = Modifier::Todo,
            _ => {}
        }
    }
    Some(Call {
        is_suite,
        name,
        modifier,
        parameterized: members.iter().any(|m| matches!(*m, "each" | "for")),
        open,
        close,
    })
}

/// Whether `test.skip(…)`, `test.fixme(…)` or `test.fail(…)` is one of Playwright's annotations
/// inside a test, not a test: no arguments, or a condition (not a lone string: a title) with at
/// most a description string after it. `test.skip('title', body)`, Jest's
/// `test.skip(name, fn)` and a pending `test.skip('title')` stay tests.
fn is_playwright_annotation(
    toks: &[Token<'_>],
    brackets: &Brackets,
    base: &str,
    members: &[&str],
    open: usize,
    close: usize,
) -> bool {
    if base != "test" || !matches!(members, ["skip" | "fixme" | "fail"]) {
        return false;
    }
    // Three are enough to tell: an annotation takes two at most.
    let Some(args) = leading_arguments(toks, brackets, open, close, 3) else {
        return false;
    };
    let lone_string =
        |(from, to): (usize, usize)| to == from + 1 && toks[from].str_value().is_some();
    match args.as_slice() {
        [] => true,
        [condition] => !lone_string(*condition),
        [condition, description] => !lone_string(*condition) && lone_string(*description),
        _ => false,
    }
}

/// The token ranges (`from..to`) of the first `max` arguments of the call whose `(` is at `open`
/// and `)` at `close` (a trailing comma leaves nothing after it); `None` if one of them is no
/// short expression ([`argument_end`]).
fn leading_arguments(
    toks: &[Token<'_>],
    brackets: &Brackets,
    open: usize,
    close: usize,
    max: usize,
) -> Option<Vec<(usize, usize)>> {
    let mut args = Vec::new();
    let mut from = open + 1;
    while from < close && args.len() < max {
        let end = argument_end(toks, brackets, from, close)?;
        args.push((from, end));
        from = end + 1;
    }
    Some(args)
}

/// Where the call argument starting at token `from` ends: the `,` after it, or the call's `)`
/// at `close`, stepping over bracketed parts. An argument is a short expression: one longer
/// than [`MAX_TITLE_EXPRESSION_TOKENS`] steps, or running past `close`, gives `None` (so an
/// unclosed call does not make every call before it walk to the end of the file).
fn argument_end(
    toks: &[Token<'_>],
    brackets: &Brackets,
    from: usize,
    close: usize,
) -> Option<usize> {
    let mut end = from;
    let mut steps = 0;
    while end < close && !toks[end].is_punct(b',') {
        steps += 1;
        if steps > MAX_TITLE_EXPRESSION_TOKENS {
            return None;
        }
        end = match toks[end].kind {
            Tok::Punct(b'(' | b'[' | b'{') => brackets.matching(end) + 1,
            _ => end + 1,
        };
    }
    (end <= close).then_some(end)
}

/// The index of the `>` closing the type argument list opened by the `<` at `open`, if it closes
/// within a few dozen tokens and before any parenthesis (the call's arguments).
fn type_arguments_end(toks: &[Token<'_>], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (k, t) in toks.iter().enumerate().skip(open).take(64) {
        match t.kind {
            Tok::Punct(b'<') => depth += 1,
            Tok::Punct(b'>') => {
                depth -= 1;
                if depth == 0 {
                    return Some(k);
                }
            }
            Tok::Punct(b'(' | b')') => return None,
            _ => {}
        }
    }
    None
}

/// The source text of `toks[from..to]`, stopped once it is longer than a recorded name can be.
fn source_span(toks: &[Token<'_>], from: usize, to: usize) -> String {
    let mut out = String::new();
    for (k, t) in toks[from..to].iter().enumerate() {
        if out.len() > 4 * MAX_NAME_CHARS {
            break;
        }
        if k > 0 {
            let prev = &toks[from + k - 1];
            if prev.start + prev.text.len() < t.start {
                out.push(' ');
            }
        }
        out.push_str(t.text);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tests(src: &str) -> Vec<(String, String, Modifier, bool)> {
        scan(src, Framework::Jest)
            .tests
            .into_iter()
            .map(|(_, t)| (t.suite.join(" > "), t.name, t.modifier, t.parameterized))
            .collect()
    }

    #[test]
    fn playwright_annotations_inside_a_test_are_not_tests() {
        let src = r#"
import { test } from '@playwright/test';
test('a', async ({ browserName }) => {
  test.skip(browserName === 'firefox', 'later');
  test.fixme();
  test.fail(browserName === 'webkit');
  test.skip(({ browserName }) => browserName === 'firefox', 'later');
});
test.skip('b', async ({ page }) => {});
test.fail('c', async function ({ page }) {});
it.skip(titleOf('d'), () => {});
test.describe.skip(() => {
  test('e', async () => {});
});
test.skip(c.name, c.run);
it.skip(c.name, c.run);
test.skip('pending');
"#;
        let names: Vec<(String, Modifier)> = tests(src)
            .into_iter()
            .map(|(_, name, modifier, _)| (name, modifier))
            .collect();
        assert_eq!(
            names,
            [
                ("a".to_owned(), Modifier::None),
                ("b".to_owned(), Modifier::Skip),
                ("c".to_owned(), Modifier::None),
                ("titleOf('d')".to_owned(), Modifier::Skip),
                ("e".to_owned(), Modifier::Skip),
                ("c.name".to_owned(), Modifier::Skip),
                ("c.name".to_owned(), Modifier::Skip),
                ("pending".to_owned(), Modifier::Skip),
            ]
        );
    }

    #[test]
    fn methods_named_test_are_not_tests() {
        let src = r#"
expect.addSnapshotSerializer({ test(val) { return !!val; }, print(v) { return ''; } });
interface Matcher { test(s: string): boolean }
class Suite { it(done) { done(); } }
it('still a test', () => {});
"#;
        let names: Vec<String> = tests(src).into_iter().map(|(_, name, _, _)| name).collect();
        assert_eq!(names, ["still a test"]);
    }

    #[test]
    fn a_concatenated_title_is_named_by_its_source() {
        let src = "it('adds ' + n + ' items', () => {});\nit('plain', () => {});\n";
        let names: Vec<String> = tests(src).into_iter().map(|(_, name, _, _)| name).collect();
        assert_eq!(names, ["'adds ' + n + ' items'", "plain"]);
    }

    #[test]
    fn typescript_type_arguments_on_each_are_read_past() {
        let src = r#"
describe.each<{ name: string; n: number }>([{ name: 'a', n: 1 }])('suite $name', () => {
  test.each<Case>([[1, 2]])('adds %i', (a, b) => {});
  it.each<[number, Array<string>]>([[1, ['x']]])('nested %i', () => {});
});
"#;
        assert_eq!(
            tests(src),
            [
                (
                    "suite $name".to_owned(),
                    "adds %i".to_owned(),
                    Modifier::None,
                    true
                ),
                (
                    "suite $name".to_owned(),
                    "nested %i".to_owned(),
                    Modifier::None,
                    true
                ),
            ]
        );
    }

    #[test]
    fn nests_suites_and_reads_modifiers() {
        let src = r#"
import { describe, it, expect } from 'vitest';
// it('commented out', () => {})
/* test('block comment', () => {}) */
describe('UserService', () => {
  it('creates a user', async () => {
    expect(/it\('x'\)/.test(s)).toBe(true);
  });
  it.skip("rejects expired tokens", () => {});
  describe.only(`admin ${role}`, () => {
    test('can delete', () => {});
    xit('is skipped by x', () => {});
  });
  it.each([[1, 2], [2, 3]])('adds %i', (a, b) => {});
  test.each`
    a | b
  `('table $a', () => {});
  it.todo('writes docs');
});
xdescribe('Legacy', function () {
  fit('focused but skipped', function () {});
});
describe(UserService, () => { specify('by class', () => {}) });
function test(name) { return name; }
const result = helper.test('not a test');
test.step('not a test either', () => {});
"#;
        assert_eq!(
            tests(src),
            [
                (
                    "UserService".into(),
                    "creates a user".into(),
                    Modifier::None,
                    false
                ),
                (
                    "UserService".into(),
                    "rejects expired tokens".into(),
                    Modifier::Skip,
                    false
                ),
                (
                    "UserService > admin ${role}".into(),
                    "can delete".into(),
                    Modifier::Only,
                    false
                ),
                (
                    "UserService > admin ${role}".into(),
                    "is skipped by x".into(),
                    Modifier::Skip,
                    false
                ),
                ("UserService".into(), "adds %i".into(), Modifier::None, true),
                (
                    "UserService".into(),
                    "table $a".into(),
                    Modifier::None,
                    true
                ),
                (
                    "UserService".into(),
                    "writes docs".into(),
                    Modifier::Todo,
                    false
                ),
                (
                    "Legacy".into(),
                    "focused but skipped".into(),
                    Modifier::Skip,
                    false
                ),
                (
                    "UserService".into(),
                    "by class".into(),
                    Modifier::None,
                    false
                ),
            ]
        );
        assert_eq!(scan(src, Framework::Jest).tests[0].0, Framework::Vitest);
    }

    #[test]
    fn playwright_describe_and_framework_detection() {
        let src = "import { test } from '@playwright/test';\ntest.describe.serial('checkout', () => {\n  test('pays', async ({ page }) => {});\n  test.describe.configure({ mode: 'serial' });\n});";
        let found = scan(src, Framework::Jest);
        assert_eq!(found.tests.len(), 1);
        assert_eq!(found.tests[0].0, Framework::Playwright);
        assert_eq!(found.tests[0].1.suite, ["checkout"]);
        let jest = scan("jest.mock('x');\ntest('a', () => {})", Framework::Mocha);
        assert_eq!(jest.tests[0].0, Framework::Jest);
        let fallback = scan("test('a', () => {})", Framework::Mocha);
        assert_eq!(fallback.tests[0].0, Framework::Mocha);
    }

    /// Calls whose non-literal title never reaches a comma or a close (an unclosed call, many
    /// times) cost one bounded look each, not a walk to the end of the file per call.
    #[test]
    fn unclosed_titles_cost_a_bounded_look_each() {
        let src = format!("it(name {}", "it(x + ".repeat(100_000));
        let started = std::time::Instant::now();
        let found = tests(&src);
        assert!(found.len() <= MAX_TESTS_PER_FILE);
        let took = started.elapsed();
        assert!(took < std::time::Duration::from_secs(10), "took {took:?}");
        // Short expressions still name their test.
        assert_eq!(
            tests("it(name + fmt(n, [1, 2]), () => {});")[0].1,
            "name + fmt(n, [1, 2])"
        );
    }

    /// PostgreSQL cannot store NUL: a title with one, raw or escaped, keeps its place with
    /// U+FFFD instead of making the whole inventory unstorable.
    #[test]
    fn a_nul_in_a_title_is_replaced() {
        let found = tests(
            "describe('s\u{0}uite', () => { it('a\u{0}b', () => {}); it('c\\0d', () => {}); });",
        );
        let names: Vec<(String, String)> = found
            .into_iter()
            .map(|(suite, name, ..)| (suite, name))
            .collect();
        assert!(
            names
                .iter()
                .all(|(s, n)| !s.contains('\0') && !n.contains('\0')),
            "{names:?}"
        );
        assert_eq!(
            names[0],
            ("s\u{fffd}uite".to_owned(), "a\u{fffd}b".to_owned())
        );
    }

    /// The runner comes from the file's imports, not from any string that spells a runner.
    #[test]
    fn the_runner_is_read_from_imports_only() {
        let framework = |src: &str| detect_framework(&lex(src, Lang::Js));
        assert_eq!(
            framework("it('picks', () => { expect(pick()).toBe('mocha'); });"),
            None
        );
        assert_eq!(
            framework("import { it } from 'vitest';"),
            Some(Framework::Vitest)
        );
        assert_eq!(framework("import 'mocha';"), Some(Framework::Mocha));
        assert_eq!(
            framework("const { test } = require('@playwright/test');"),
            Some(Framework::Playwright)
        );
        assert_eq!(
            framework("const m = await import('vitest');"),
            Some(Framework::Vitest)
        );
    }
}
