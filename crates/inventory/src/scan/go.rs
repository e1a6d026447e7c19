//! Finds Go tests in `*_test.go` files: `func TestXxx(t *testing.T)`, testify-style suite methods
//! `func (s *Suite) TestXxx()`, subtests `t.Run("name", func(t *testing.T) {…})` (nested, where
//! the name is a literal), and benchmarks, fuzz targets and examples reported apart.

use super::lexer::{Lang, Tok, Token, lex};
use super::{Brackets, Found, MAX_SUITE_DEPTH, between, capped};
use crate::model::{Framework, Modifier, OtherFunction, OtherKind, TestCase};

/// Whether `name` is `prefix` followed by nothing or by a character that is not lowercase, the
/// rule `go test` applies.
fn has_go_prefix(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix)
        .is_some_and(|rest| rest.chars().next().is_none_or(|c| !c.is_lowercase()))
}

/// If `params` is exactly `name *testing.<kind>`, the parameter name.
fn testing_param<'s>(params: &[Token<'s>], kind: &str) -> Option<&'s str> {
    match params {
        [name, star, pkg, dot, ty]
            if name.kind == Tok::Ident
                && star.is_punct(b'*')
                && pkg.is_ident("testing")
                && dot.is_punct(b'.')
                && ty.is_ident(kind) =>
        {
            Some(name.text)
        }
        _ => None,
    }
}

/// Whether the block opening at `open` starts with an unconditional `<var>.Skip…(`.
fn leading_skip(toks: &[Token<'_>], open: usize, var: &str) -> bool {
    matches!(
        toks.get(open + 1..open + 4),
        Some([v, dot, call]) if v.is_ident(var) && dot.is_punct(b'.')
            && matches!(call.text, "Skip" | "Skipf" | "SkipNow")
    )
}

fn test_case(name: &str, suite: Vec<String>, line: u32, skip: bool) -> TestCase {
    TestCase {
        name: name.to_string(),
        suite,
        line,
        modifier: if skip { Modifier::Skip } else { Modifier::None },
        parameterized: false,
        display_name: None,
    }
}

pub(crate) fn scan(src: &str) -> Found {
    let toks = lex(src, Lang::Go);
    // Every bracket's match in one pass: a file of unclosed brackets (`func f(` a hundred
    // thousand times) costs one walk, not one walk to its end per function.
    let brackets = Brackets::of(&toks);
    let mut found = Found::default();
    let mut depth = 0usize;
    let mut i = 0;
    while i < toks.len() && !found.is_full() {
        let t = &toks[i];
        if t.is_punct(b'{') {
            depth += 1;
        } else if t.is_punct(b'}') {
            depth = depth.saturating_sub(1);
        } else if depth == 0
            && t.is_ident("func")
            && let Some(next) = function(&toks, &brackets, i, &mut found)
        {
            i = next;
            continue;
        }
        i += 1;
    }
    found
}

/// The `{` opening the body of a function whose parameters close at `close_params`, if it has
/// one. Go ends a signature at the end of its line (the body's `{` must be on the line where
/// the results end), so the search stops there, stepping over bracketed results: a bodyless
/// `func f() int64` (assembly, `//go:linkname`) does not take the next function's body. The
/// results are at most [`MAX_RESULT_TOKENS`] tokens (a bracketed group counts as one): on a line
/// of bodyless functions each search would otherwise walk to the line's end, once per function.
fn body_open(toks: &[Token<'_>], brackets: &Brackets, close_params: usize) -> Option<usize> {
    let mut line = toks.get(close_params)?.line;
    let mut k = close_params + 1;
    for _ in 0..MAX_RESULT_TOKENS {
        let t = toks.get(k)?;
        if t.line != line {
            return None;
        }
        if t.is_punct(b'{') {
            return Some(k);
        }
        if t.is_punct(b'(') || t.is_punct(b'[') {
            k = brackets.matching(k);
            line = toks.get(k)?.line;
        }
        k += 1;
    }
    None
}

/// The most tokens between a signature's parameters and its body's `{`, bracketed groups counted
/// once: real results (`(int, error)`, `func(string) bool`, `*pkg.Type[K, V]`) take a handful.
const MAX_RESULT_TOKENS: usize = 64;

/// The most tokens in a method's receiver (`(s *Suite)`, `(m *Map[K, V])`); a longer "receiver"
/// is not one (an unclosed bracket), and is not searched.
const MAX_RECEIVER_TOKENS: usize = 32;

/// Handles a top-level `func` at `at`; returns the index after its body.
fn function(
    toks: &[Token<'_>],
    brackets: &Brackets,
    at: usize,
    found: &mut Found,
) -> Option<usize> {
    let mut j = at + 1;
    let mut receiver: Option<String> = None;
    if toks.get(j)?.is_punct(b'(') {
        let close = brackets.matching(j);
        if close.saturating_sub(j) > MAX_RECEIVER_TOKENS {
            return None;
        }
        receiver = between(toks, j, close)
            .iter()
            .rev()
            .find(|t| t.kind == Tok::Ident)
            .map(|t| t.text.to_string());
        j = close + 1;
    }
    let name = toks.get(j).filter(|t| t.kind == Tok::Ident)?;
    let open_params = j + 1;
    if !toks.get(open_params)?.is_punct(b'(') {
        return None;
    }
    let close_params = brackets.matching(open_params);
    let params = between(toks, open_params, close_params);
    let body_open = body_open(toks, brackets, close_params)?;
    let body_close = brackets.matching(body_open);

    let other = |kind| OtherFunction {
        kind,
        name: name.text.to_string(),
        line: name.line,
    };
    match (&receiver, name.text) {
        (None, n) if has_go_prefix(n, "Test") => {
            if let Some(var) = testing_param(params, "T") {
                let skip = leading_skip(toks, body_open, var);
                found.push_test(Framework::Go, test_case(n, Vec::new(), name.line, skip));
                subtests(
                    toks,
                    brackets,
                    Body {
                        from: body_open + 1,
                        to: body_close,
                        var,
                        suite: &[capped(n)],
                        skipped: skip,
                    },
                    found,
                );
            }
        }
        (Some(recv), n) if has_go_prefix(n, "Test") && params.is_empty() => {
            found.push_test(
                Framework::Go,
                test_case(n, vec![capped(recv)], name.line, false),
            );
        }
        (None, n) if has_go_prefix(n, "Benchmark") && testing_param(params, "B").is_some() => {
            found.push_other(other(OtherKind::Benchmark));
        }
        (None, n) if has_go_prefix(n, "Fuzz") && testing_param(params, "F").is_some() => {
            found.push_other(other(OtherKind::Fuzz));
        }
        (None, n) if has_go_prefix(n, "Example") && params.is_empty() => {
            found.push_other(other(OtherKind::Example));
        }
        _ => {}
    }
    Some(body_close + 1)
}

/// The body of a test or subtest, as its subtests see it.
#[derive(Clone, Copy)]
struct Body<'a> {
    /// The tokens inside its braces: `from..to`.
    from: usize,
    to: usize,
    /// The name of its `*testing.T` parameter.
    var: &'a str,
    /// The suite path of its subtests.
    suite: &'a [String],
    /// Whether it is skipped, and so its subtests too.
    skipped: bool,
}

/// Records the `var.Run("literal", …)` calls of `body` as children of its suite, and recurses
/// into their `func(t *testing.T) {…}` bodies.
fn subtests(toks: &[Token<'_>], brackets: &Brackets, body: Body<'_>, found: &mut Found) {
    let Body {
        from,
        to,
        var,
        suite,
        skipped: parent_skipped,
    } = body;
    let mut j = from;
    while j < to.min(toks.len()) && !found.is_full() {
        let is_run = matches!(
            toks.get(j..j + 4),
            Some([v, dot, run, open]) if v.is_ident(var) && dot.is_punct(b'.')
                && run.is_ident("Run") && open.is_punct(b'(')
        );
        if !is_run {
            j += 1;
            continue;
        }
        let open = j + 3;
        let close = brackets.matching(open);
        if let Some(name_tok) = toks.get(open + 1)
            && let Some(name) = name_tok.str_value()
        {
            let mut skip = parent_skipped;
            let mut child_body = None;
            // `, func(<v> *testing.T) {`
            if toks.get(open + 2).is_some_and(|t| t.is_punct(b','))
                && toks.get(open + 3).is_some_and(|t| t.is_ident("func"))
                && toks.get(open + 4).is_some_and(|t| t.is_punct(b'('))
            {
                let pclose = brackets.matching(open + 4);
                if let Some(child_var) = testing_param(between(toks, open + 4, pclose), "T")
                    && toks.get(pclose + 1).is_some_and(|t| t.is_punct(b'{'))
                {
                    let body_open = pclose + 1;
                    skip = skip || leading_skip(toks, body_open, child_var);
                    child_body = Some((body_open, brackets.matching(body_open), child_var));
                }
            }
            found.push_test(
                Framework::Go,
                test_case(name, suite.to_vec(), name_tok.line, skip),
            );
            // Deeper subtests are not looked for: the path, copied per test, stays bounded, and
            // so does the recursion.
            if let Some((body_open, body_close, child_var)) = child_body
                && suite.len() < MAX_SUITE_DEPTH
            {
                let mut child_suite = suite.to_vec();
                child_suite.push(capped(name));
                subtests(
                    toks,
                    brackets,
                    Body {
                        from: body_open + 1,
                        to: body_close,
                        var: child_var,
                        suite: &child_suite,
                        skipped: skip,
                    },
                    found,
                );
            }
        }
        j = close + 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_tests_subtests_and_others() {
        let src = r#"package x
import "testing"
// func TestCommented(t *testing.T) {}
func TestParse(t *testing.T) {
	t.Run("empty input", func(t *testing.T) {
		t.Run("with_spaces", func(t *testing.T) {})
	})
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { t.Run("hidden", nil) })
	}
	t.Run(`raw`, helper)
}
func Test(t *testing.T) { t.Skip("later") }
func Testlower(t *testing.T) {}
func TestWrongParam(b *testing.B) {}
func helperTest(t *testing.T) {}
func BenchmarkParse(b *testing.B) {}
func FuzzParse(f *testing.F) {}
func ExampleParse() {}
func (s *StoreSuite) TestSaves() {}
func (s *StoreSuite) SetupTest() {}
"#;
        let found = scan(src);
        let tests: Vec<_> = found
            .tests
            .iter()
            .map(|(_, t)| (t.suite.join("/"), t.name.as_str(), t.line, t.modifier))
            .collect();
        assert_eq!(
            tests,
            [
                (String::new(), "TestParse", 4, Modifier::None),
                ("TestParse".into(), "empty input", 5, Modifier::None),
                (
                    "TestParse/empty input".into(),
                    "with_spaces",
                    6,
                    Modifier::None
                ),
                ("TestParse".into(), "raw", 11, Modifier::None),
                (String::new(), "Test", 13, Modifier::Skip),
                ("StoreSuite".into(), "TestSaves", 20, Modifier::None),
            ]
        );
        let others: Vec<_> = found
            .other
            .iter()
            .map(|o| (o.kind, o.name.as_str()))
            .collect();
        assert_eq!(
            others,
            [
                (OtherKind::Benchmark, "BenchmarkParse"),
                (OtherKind::Fuzz, "FuzzParse"),
                (OtherKind::Example, "ExampleParse"),
            ]
        );
    }

    #[test]
    fn a_bodyless_function_does_not_take_the_next_tests_body() {
        let src = "package x\n\
                   import \"testing\"\n\
                   //go:linkname nanotime runtime.nanotime\n\
                   func nanotime() int64\n\
                   func stub() (int, error)\n\
                   func TestAfter(t *testing.T) {\n\
                   \tt.Run(\"inner\", func(t *testing.T) {})\n\
                   }\n\
                   func TestMultiLineResults(t *testing.T) (\n\
                   \tx int,\n\
                   ) {\n\
                   }\n";
        let names: Vec<String> = scan(src)
            .tests
            .iter()
            .map(|(_, t)| format!("{}/{}", t.suite.join("/"), t.name))
            .collect();
        assert_eq!(
            names,
            ["/TestAfter", "TestAfter/inner", "/TestMultiLineResults"]
        );
    }

    /// A file of functions whose brackets never close is scanned in one pass: every bracket's
    /// match is found once, where looking it up per function walked to the end of the file
    /// each time (quadratic: about a minute for this file, with the worker's thread held).
    #[test]
    fn unclosed_brackets_cost_one_pass_not_one_per_function() {
        let src = format!("package x\n{}", "func f(".repeat(200_000));
        let started = std::time::Instant::now();
        let found = scan(&src);
        assert!(found.tests.is_empty());
        let took = started.elapsed();
        // A bound a hundred times above what one pass takes on a slow machine in a debug
        // build, and far below what the quadratic walk took.
        assert!(took < std::time::Duration::from_secs(10), "took {took:?}");
    }

    /// A line of bodyless functions, and receivers that never close, cost one pass too: the
    /// search for a body's `{` stopped only at the end of the line, and the receiver's name was
    /// looked for back from the end of the file, once per function.
    #[test]
    fn bodyless_functions_on_one_line_cost_one_pass() {
        for src in [
            format!("package x\n{}", "func a() ".repeat(100_000)),
            format!(
                "package x\n{}{}",
                "func(".repeat(50_000),
                ",".repeat(50_000)
            ),
        ] {
            let started = std::time::Instant::now();
            assert!(scan(&src).tests.is_empty());
            let took = started.elapsed();
            assert!(took < std::time::Duration::from_secs(10), "took {took:?}");
        }
        // Results still reach the body across a func type and bracketed groups.
        let src = "package x\nimport \"testing\"\n\
                   func TestMaker(t *testing.T) func(map[string]int) (bool, error) {\n}\n";
        assert_eq!(scan(src).tests.len(), 1);
    }
}
