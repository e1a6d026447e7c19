//! Turns an [`Inventory`] into a behaviour specification: per file, a tree of suites and
//! behaviours whose titles are readable sentences, plus a stable Markdown rendering.
//!
//! # Sentences
//!
//! [`sentence`] turns a test name into words: a name that already contains spaces is prose and
//! is kept (whitespace collapsed); an identifier loses a `test`/`Test`/`test_` prefix and a
//! `_test`/`Test` suffix, is split at `_`, `-`, `.` and camel-case boundaries, and each word is
//! lower-cased unless it is an acronym (`HTTP`, `IDs`). So `test_user_can_login` and
//! `TestUserCanLogin` read "user can login", `shouldReturnEmptyList` "should return empty list",
//! `TestHTTPServerStarts` "HTTP server starts". JUnit `@DisplayName` titles are used verbatim.
//! JavaScript suite titles (`describe("…")`) are kept as written; other suite names (Rust
//! modules, Python/Java classes, Go parent tests and subtests) go through [`sentence`].
//!
//! # Markdown format (stable)
//!
//! ```text
//! # Behaviour specification
//!
//! <B> behaviours in <F> files (<k> skipped, <o> focused, <t> to do).
//!
//! ## `<path>` (<framework>)
//!
//! - <behaviour sentence>
//! - <behaviour sentence> _(each case)_ _(skipped)_
//! - **<suite title>**
//!   - <behaviour sentence>
//!   - <behaviour with subtests>
//!     - <subtest sentence>
//! ```
//!
//! Files appear in inventory order (path, then framework). Within a file, nodes keep source
//! order; a suite appears where its first test appears. Behaviour lines carry `_(each case)_`
//! when parameterized, then `_(skipped)_`, `_(focused)_` or `_(to do)_`. The parenthesis of the
//! summary lists only non-zero counts and is left out when all are zero ("1 behaviour in 1 file.").
//! An empty inventory renders "No tests found." under the heading. Markdown-significant
//! characters in titles are backslash-escaped (`&` and `~` included), and so is a start Markdown
//! would read as structure (`-`, `+`, `=`, `1.`, `2)`); control characters show as spaces and an
//! empty title as `(untitled)`; indentation is two spaces per level; the text ends with exactly
//! one newline.

use serde::{Deserialize, Serialize};

use crate::model::{Framework, Inventory, Language, Modifier, TestCase};

/// A behaviour specification.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spec {
    /// One entry per inventory file entry, in inventory order.
    pub files: Vec<SpecFile>,
    /// Number of behaviours (tests).
    pub behaviours: u64,
    /// Behaviours marked skipped.
    pub skipped: u64,
    /// Behaviours marked focused (`only`).
    pub focused: u64,
    /// Behaviours marked to do.
    pub todo: u64,
}

/// The behaviours of one file and framework.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecFile {
    /// Relative path.
    pub path: String,
    /// Framework.
    pub framework: Framework,
    /// Top-level nodes in source order.
    pub nodes: Vec<SpecNode>,
}

/// Whether a node is a grouping or a test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeKind {
    /// A suite (describe block, module, class) that is not itself a test.
    Suite,
    /// A test; it has children when it declares subtests (Go).
    Behaviour,
}

/// A suite or behaviour with its readable title.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecNode {
    /// Suite or behaviour.
    pub kind: NodeKind,
    /// The name as found in source.
    pub name: String,
    /// The readable title.
    pub title: String,
    /// Line of a behaviour (`None` for suites).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub line: Option<u32>,
    /// A behaviour's modifier (`none` for suites).
    pub modifier: Modifier,
    /// Whether a behaviour runs once per case.
    pub parameterized: bool,
    /// Nested nodes in source order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<SpecNode>,
}

impl Spec {
    /// Builds the specification of an inventory.
    pub fn from_inventory(inventory: &Inventory) -> Spec {
        let mut spec = Spec {
            files: Vec::new(),
            behaviours: 0,
            skipped: 0,
            focused: 0,
            todo: 0,
        };
        for file in &inventory.files {
            if file.tests.is_empty() {
                continue;
            }
            let mut nodes: Vec<SpecNode> = Vec::new();
            let mut named = NodeIndex::new();
            for test in &file.tests {
                spec.behaviours += 1;
                match test.modifier {
                    Modifier::None => {}
                    Modifier::Skip => spec.skipped += 1,
                    Modifier::Only => spec.focused += 1,
                    Modifier::Todo => spec.todo += 1,
                }
                insert(&mut nodes, &mut named, file.framework, test);
            }
            spec.files.push(SpecFile {
                path: file.path.clone(),
                framework: file.framework,
                nodes,
            });
        }
        spec
    }

    /// The Markdown rendering described in the module documentation.
    pub fn to_markdown(&self) -> String {
        let mut out = String::from("# Behaviour specification\n\n");
        if self.files.is_empty() {
            out.push_str("No tests found.\n");
            return out;
        }
        let plural = |n: u64, one: &str, many: &str| {
            if n == 1 {
                format!("{n} {one}")
            } else {
                format!("{n} {many}")
            }
        };
        out.push_str(&plural(self.behaviours, "behaviour", "behaviours"));
        out.push_str(" in ");
        out.push_str(&plural(self.files.len() as u64, "file", "files"));
        let parts: Vec<String> = [
            (self.skipped, "skipped"),
            (self.focused, "focused"),
            (self.todo, "to do"),
        ]
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, what)| format!("{n} {what}"))
        .collect();
        if !parts.is_empty() {
            out.push_str(" (");
            out.push_str(&parts.join(", "));
            out.push(')');
        }
        out.push_str(".\n");
        for file in &self.files {
            out.push_str("\n## ");
            out.push_str(&code_span(&file.path));
            out.push_str(" (");
            out.push_str(file.framework.as_str());
            out.push_str(")\n\n");
            for node in &file.nodes {
                render_node(&mut out, node, 0);
            }
        }
        out
    }
}

fn render_node(out: &mut String, node: &SpecNode, depth: usize) {
    for _ in 0..depth {
        out.push_str("  ");
    }
    out.push_str("- ");
    match node.kind {
        NodeKind::Suite => {
            out.push_str("**");
            out.push_str(&item_text(&node.title));
            out.push_str("**");
        }
        NodeKind::Behaviour => {
            out.push_str(&item_text(&node.title));
            if node.parameterized {
                out.push_str(" _(each case)_");
            }
            match node.modifier {
                Modifier::None => {}
                Modifier::Skip => out.push_str(" _(skipped)_"),
                Modifier::Only => out.push_str(" _(focused)_"),
                Modifier::Todo => out.push_str(" _(to do)_"),
            }
        }
    }
    out.push('\n');
    for child in &node.children {
        render_node(out, child, depth + 1);
    }
}

/// The first node of each name a later test's suite path can name, by the path of indices of
/// its parent from the file's top level: suites, and in Go tests too (a Go test is the suite of
/// its subtests; elsewhere a test named like a suite stays a separate node). Looking a suite up
/// among its siblings one by one cost a file of thousands of suites sharing long names
/// seconds of comparisons.
type NodeIndex<'t> = std::collections::HashMap<(Vec<usize>, &'t str), usize>;

/// Places `test` in the tree under its suite path, creating suite nodes as needed.
fn insert<'t>(
    nodes: &mut Vec<SpecNode>,
    named: &mut NodeIndex<'t>,
    framework: Framework,
    test: &'t TestCase,
) {
    let mut level = nodes;
    let mut path: Vec<usize> = Vec::with_capacity(test.suite.len());
    for (depth, segment) in test.suite.iter().enumerate() {
        let index = *named
            .entry((path.clone(), segment.as_str()))
            .or_insert_with(|| {
                level.push(SpecNode {
                    kind: NodeKind::Suite,
                    name: segment.clone(),
                    title: suite_title(framework, depth, segment),
                    line: None,
                    modifier: Modifier::None,
                    parameterized: false,
                    children: Vec::new(),
                });
                level.len() - 1
            });
        path.push(index);
        level = &mut level[index].children;
    }
    let title = match &test.display_name {
        Some(display) => collapse_whitespace(display),
        None => sentence(&test.name),
    };
    level.push(SpecNode {
        kind: NodeKind::Behaviour,
        name: test.name.clone(),
        title,
        line: Some(test.line),
        modifier: test.modifier,
        parameterized: test.parameterized,
        children: Vec::new(),
    });
    if framework == Framework::Go {
        named
            .entry((path, test.name.as_str()))
            .or_insert(level.len() - 1);
    }
}

fn suite_title(framework: Framework, _depth: usize, name: &str) -> String {
    if framework.language() == Language::JavaScript {
        collapse_whitespace(name)
    } else {
        sentence(name)
    }
}

fn collapse_whitespace(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Turns a test name into a readable sentence (see the module documentation).
pub fn sentence(name: &str) -> String {
    let prose = collapse_whitespace(name);
    if prose.is_empty() || prose.contains(' ') {
        return prose;
    }
    let core = strip_affixes(&prose);
    let words: Vec<String> = core
        .split(['_', '-', '.'])
        .flat_map(camel_words)
        .map(|w| readable_word(&w))
        .collect();
    if words.is_empty() {
        prose
    } else {
        words.join(" ")
    }
}

fn strip_affixes(name: &str) -> &str {
    let next_is_boundary = |rest: &str| {
        rest.chars()
            .next()
            .is_some_and(|c| c.is_uppercase() || c.is_ascii_digit() || c == '_')
    };
    let mut core = name;
    if let Some(rest) = core
        .strip_prefix("test_")
        .or_else(|| core.strip_prefix("Test_"))
    {
        core = rest;
    } else if let Some(rest) = core
        .strip_prefix("test")
        .or_else(|| core.strip_prefix("Test"))
        && next_is_boundary(rest)
    {
        core = rest.trim_start_matches('_');
    }
    for suffix in ["_tests", "_test", "Tests", "Test"] {
        if let Some(rest) = core.strip_suffix(suffix)
            && !rest.is_empty()
        {
            core = rest;
            break;
        }
    }
    if core.chars().any(char::is_alphanumeric) {
        core
    } else {
        name
    }
}

/// Splits a camel-case word: `HTTPServerStarts` → `HTTP`, `Server`, `Starts`; keeps `URLs`.
fn camel_words(segment: &str) -> Vec<String> {
    let chars: Vec<char> = segment.chars().collect();
    let mut words = Vec::new();
    let mut current = String::new();
    for (k, &c) in chars.iter().enumerate() {
        if k > 0 && c.is_uppercase() {
            let prev = chars[k - 1];
            let next = chars.get(k + 1).copied();
            let after_lower = prev.is_lowercase() || prev.is_ascii_digit();
            let acronym_end = prev.is_uppercase()
                && next.is_some_and(char::is_lowercase)
                && !(next == Some('s') && k + 2 == chars.len());
            if (after_lower || acronym_end) && !current.is_empty() {
                words.push(std::mem::take(&mut current));
            }
        }
        current.push(c);
    }
    if !current.is_empty() {
        words.push(current);
    }
    words
}

fn readable_word(word: &str) -> String {
    let upper = word.chars().filter(|c| c.is_uppercase()).count();
    let all_caps = word.chars().all(|c| c.is_uppercase() || c.is_ascii_digit());
    let plural_acronym = word
        .strip_suffix('s')
        .is_some_and(|stem| stem.chars().count() >= 2 && stem.chars().all(char::is_uppercase));
    if (upper >= 2 && all_caps) || plural_acronym {
        word.to_string()
    } else {
        word.to_lowercase()
    }
}

/// `text` with every character that means something inline backslash-escaped (`&` too, or an
/// entity such as `&amp;` in a test's name would show as `&`), and control characters (a line
/// break ends the list item) shown as spaces.
fn escape_markdown(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.push(' ');
            continue;
        }
        if matches!(
            c,
            '\\' | '`' | '*' | '_' | '[' | ']' | '<' | '>' | '#' | '|' | '&' | '~'
        ) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A list item's text: [`escape_markdown`], and a start that Markdown would read as structure
/// made plain: `-`, `+` or `=` (a nested list, a rule, a heading underline) and `1.` or `2)` (an
/// ordered list) are escaped, and an empty title is `(untitled)`.
fn item_text(title: &str) -> String {
    // Escaped (control characters made spaces) before the start is trimmed and looked at: a
    // title of `\u{1}- x` would otherwise start with a space and a list marker once escaped.
    let escaped = escape_markdown(title);
    let escaped = escaped.trim_start().to_owned();
    if escaped.is_empty() {
        return "(untitled)".to_owned();
    }
    if escaped.starts_with(['-', '+', '=']) {
        return format!("\\{escaped}");
    }
    let digits = escaped.bytes().take_while(u8::is_ascii_digit).count();
    if (1..=9).contains(&digits) && escaped[digits..].starts_with(['.', ')']) {
        return format!("{}\\{}", &escaped[..digits], &escaped[digits..]);
    }
    escaped
}

/// `text` as an inline code span that nothing in it can end: fenced by one backtick more than
/// its longest run of them, with line breaks and other control characters (a file name may hold
/// them) shown as spaces, since one would end the heading the span sits in.
fn code_span(text: &str) -> String {
    let text: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let longest_run = text.split(|c| c != '`').map(str::len).max().unwrap_or(0);
    let fence = "`".repeat(longest_run + 1);
    if longest_run > 0 {
        format!("{fence} {text} {fence}")
    } else {
        format!("{fence}{text}{fence}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of 20,000 suites (twice a scanned file's cap, so that the old cost shows) whose
    /// names share 290 bytes, each with a test, then a second test in each (found again by
    /// name): a suite's siblings used to be compared one by one, 4 × 10⁸ comparisons of 290
    /// bytes, 12 s in a debug build; now each is one look-up, under half a second. Go tests are
    /// suites of their subtests; other frameworks' tests are not.
    #[test]
    fn suites_are_found_by_name_in_time_linear_in_the_file() {
        let prefix = "s".repeat(290);
        let test = |name: String, suite: Vec<String>| TestCase {
            name,
            suite,
            line: 1,
            modifier: Modifier::None,
            parameterized: false,
            display_name: None,
        };
        let mut tests: Vec<TestCase> = (0..20_000)
            .map(|n| test("a".into(), vec![format!("{prefix}{n:05}")]))
            .collect();
        tests.extend((0..20_000).map(|n| test("b".into(), vec![format!("{prefix}{n:05}")])));
        let file = |framework, tests| crate::model::FileInventory {
            path: "x.test.js".into(),
            framework,
            tests,
            other: Vec::new(),
        };
        let inventory = Inventory::from_files(
            vec![file(Framework::Jest, tests)],
            crate::model::ScanStats::default(),
        );
        let started = std::time::Instant::now();
        let spec = Spec::from_inventory(&inventory);
        // Milliseconds in a debug build.
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        let nodes = &spec.files[0].nodes;
        assert_eq!(nodes.len(), 20_000);
        assert!(nodes.iter().all(|n| n.kind == NodeKind::Suite
            && n.children.iter().map(|c| c.name.as_str()).eq(["a", "b"])));

        // In Go a test is the suite of its subtests, the first of its name; elsewhere not.
        let go = vec![
            test("TestA".into(), vec![]),
            test("TestA".into(), vec![]),
            test("sub".into(), vec!["TestA".into()]),
        ];
        let js = vec![
            test("a".into(), vec![]),
            test("x".into(), vec!["a".into()]),
            test("y".into(), vec!["a".into()]),
        ];
        let inventory = Inventory::from_files(
            vec![file(Framework::Go, go), file(Framework::Jest, js)],
            crate::model::ScanStats::default(),
        );
        let spec = Spec::from_inventory(&inventory);
        let shape = |nodes: &[SpecNode]| -> Vec<(String, Vec<String>)> {
            nodes
                .iter()
                .map(|n| {
                    let children = n.children.iter().map(|c| c.name.clone()).collect();
                    (n.name.clone(), children)
                })
                .collect()
        };
        let by_framework = |f: Framework| {
            let file = spec.files.iter().find(|x| x.framework == f).unwrap();
            shape(&file.nodes)
        };
        assert_eq!(
            by_framework(Framework::Go),
            [
                ("TestA".into(), vec!["sub".into()]),
                ("TestA".into(), vec![])
            ]
        );
        assert_eq!(
            by_framework(Framework::Jest),
            [
                ("a".into(), vec![]),
                ("a".into(), vec!["x".into(), "y".into()])
            ]
        );
    }

    #[test]
    fn sentences() {
        let cases = [
            ("test_user_can_login", "user can login"),
            ("TestUserCanLogin", "user can login"),
            ("shouldReturnEmptyList", "should return empty list"),
            ("rejects expired tokens", "rejects expired tokens"),
            ("  rejects   expired\ttokens ", "rejects expired tokens"),
            ("returns_error_on_empty", "returns error on empty"),
            ("TestHTTPServerStarts", "HTTP server starts"),
            ("testParseJSON", "parse JSON"),
            ("test_parse_JSON_body", "parse JSON body"),
            ("TestReturnsAValue", "returns a value"),
            ("TestListsURLs", "lists URLs"),
            ("TestBase64Encoding", "base64 encoding"),
            ("UserServiceTest", "user service"),
            ("parse_works_test", "parse works"),
            ("tests", "tests"),
            ("testing_helpers", "testing helpers"),
            ("Test", "test"),
            ("test", "test"),
            ("TestIOError", "IO error"),
            (
                "givenUser_whenLogin_thenToken",
                "given user when login then token",
            ),
            ("TestLogin", "login"),
            ("with_spaces", "with spaces"),
            ("", ""),
        ];
        for (name, want) in cases {
            assert_eq!(sentence(name), want, "{name:?}");
        }
    }

    #[test]
    fn escapes_markdown() {
        assert_eq!(
            escape_markdown("a *b* [c](d) `e` <f> x_y"),
            "a \\*b\\* \\[c\\](d) \\`e\\` \\<f\\> x\\_y"
        );
        assert_eq!(code_span("a`b"), "`` a`b ``");
        assert_eq!(code_span("src/a.test.js"), "`src/a.test.js`");
        // A double backtick cannot close the span early and let HTML through.
        assert_eq!(
            code_span("a``<img src=x onerror=alert(1)>``b.test.js"),
            "``` a``<img src=x onerror=alert(1)>``b.test.js ```"
        );
        // A line break cannot end the heading.
        assert_eq!(code_span("a\n## b\r.test.js"), "`a ## b .test.js`");
        // An entity stays the text the test's name holds.
        assert_eq!(
            escape_markdown("escapes & to &amp; ~~x~~"),
            "escapes \\& to \\&amp; \\~\\~x\\~\\~"
        );
    }

    /// A list item's text never starts what Markdown reads as structure: a rule, a nested list,
    /// an ordered list; nor ends its item early with a line break.
    #[test]
    fn item_texts_start_as_text() {
        let cases = [
            ("--", "\\--"),
            ("---", "\\---"),
            ("- removes item", "\\- removes item"),
            ("+ x", "\\+ x"),
            ("=== heading?", "\\=== heading?"),
            ("1. Login", "1\\. Login"),
            ("2) step", "2\\) step"),
            ("2024 report", "2024 report"),
            (
                "12345678901. too long to be a list",
                "12345678901. too long to be a list",
            ),
            ("", "(untitled)"),
            ("   ", "(untitled)"),
            ("line\nbreak", "line break"),
            ("~~~", "\\~\\~\\~"),
            ("plain words", "plain words"),
            // Control characters before a marker are spaces, trimmed with the rest.
            (
                "\u{1}- admin cannot bypass auth",
                "\\- admin cannot bypass auth",
            ),
            ("\u{1}\u{1}\u{1}\u{1}\u{1}x", "x"),
            ("\u{1}1. x", "1\\. x"),
            ("\u{7f}", "(untitled)"),
        ];
        for (title, want) in cases {
            assert_eq!(item_text(title), want, "{title:?}");
        }
    }

    #[test]
    fn only_go_tests_hold_children() {
        use crate::model::{FileInventory, ScanStats};
        let case = |name: &str, suite: &[&str]| TestCase {
            name: name.into(),
            suite: suite.iter().map(|s| (*s).to_string()).collect(),
            line: 1,
            modifier: Modifier::None,
            parameterized: false,
            display_name: None,
        };
        let inventory = Inventory::from_files(
            vec![FileInventory {
                path: "a.test.js".into(),
                framework: Framework::Jest,
                tests: vec![case("login", &[]), case("works", &["login"])],
                other: Vec::new(),
            }],
            ScanStats::default(),
        );
        let spec = Spec::from_inventory(&inventory);
        let kinds: Vec<_> = spec.files[0]
            .nodes
            .iter()
            .map(|n| (n.kind, n.children.len()))
            .collect();
        assert_eq!(kinds, [(NodeKind::Behaviour, 0), (NodeKind::Suite, 1)]);
    }

    #[test]
    fn empty_inventory() {
        let spec = Spec::from_inventory(&Inventory::default());
        assert_eq!(
            spec.to_markdown(),
            "# Behaviour specification\n\nNo tests found.\n"
        );
    }
}
