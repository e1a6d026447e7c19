//! Which metric and label names a PromQL expression refers to, so a dashboard check can compare
//! them with what Prometheus actually scraped, and its vector selectors with their matchers
//! ([`selectors`]), so a check can find one not scoped by the dashboard's namespace. A small
//! tokenizer, not a full parser: Prometheus itself is the parser of record (the check sends
//! every expression to it); this only finds names and selectors.
//!
//! - a metric name is an identifier that is not followed by `(`, `by` or `without` (that would be
//!   a function or an aggregation), is not a keyword, and is not inside `{…}`, `[…]` or a grouping clause;
//! - label names are the identifiers on the left of a matcher inside `{…}` and the identifiers in
//!   `by (…)`, `without (…)`, `on (…)`, `ignoring (…)`, `group_left (…)`, `group_right (…)`.

use std::collections::BTreeSet;

/// The names one expression refers to.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Names {
    pub metrics: BTreeSet<String>,
    pub labels: BTreeSet<String>,
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    /// Number or duration literal (`0.95`, `5m`, `1e3`).
    Number,
    /// A string literal's contents, escapes left as written.
    Str(String),
    /// A Grafana template variable (`$queue`, `${queue}`, `$__rate_interval`).
    Variable(String),
    Punct(char),
}

/// Why an expression could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PromqlError {
    #[error("unterminated string literal")]
    UnterminatedString,
    #[error("unexpected character {0:?}")]
    Unexpected(char),
    #[error("template variable left in the expression: {0}")]
    Variable(String),
}

const KEYWORDS: [&str; 11] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
];
const GROUPING: [&str; 6] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

fn tokenize(expr: &str) -> Result<Vec<Token>, PromqlError> {
    let chars: Vec<char> = expr.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '#' {
            // A comment runs to the end of the line.
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '"' || c == '\'' || c == '`' {
            let quote = c;
            i += 1;
            let start = i;
            loop {
                match chars.get(i) {
                    None => return Err(PromqlError::UnterminatedString),
                    Some('\\') if quote != '`' => i += 2,
                    Some(&d) if d == quote => {
                        i += 1;
                        break;
                    }
                    Some(_) => i += 1,
                }
            }
            tokens.push(Token::Str(chars[start..i - 1].iter().collect()));
        } else if c.is_ascii_digit()
            || (c == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit))
        {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
            tokens.push(Token::Number);
        } else if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
            {
                i += 1;
            }
            tokens.push(Token::Ident(chars[start..i].iter().collect()));
        } else if c == '$' {
            let start = i;
            i += 1;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || "_{}".contains(chars[i]))
            {
                i += 1;
            }
            tokens.push(Token::Variable(chars[start..i].iter().collect()));
        } else if "(){}[],=!~<>+-*/%^@:".contains(c) {
            tokens.push(Token::Punct(c));
            i += 1;
        } else {
            return Err(PromqlError::Unexpected(c));
        }
    }
    Ok(tokens)
}

/// One vector selector of an expression: `metric{label op "value", …}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selector {
    /// None for a selector of matchers alone (`{__name__=~"…"}`).
    pub metric: Option<String>,
    pub matchers: Vec<Matcher>,
}

/// One label matcher of a [`Selector`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matcher {
    pub label: String,
    /// `=`, `!=`, `=~` or `!~`.
    pub op: String,
    /// The string literal's contents, escapes as written; template variables left in place.
    pub value: String,
}

impl Matcher {
    /// Whether this matcher is `label op "value"` exactly.
    pub fn is(&self, label: &str, op: &str, value: &str) -> bool {
        self.label == label && self.op == op && self.value == value
    }
}

/// What a walk over an expression's tokens finds.
struct Walked {
    selectors: Vec<Selector>,
    /// Labels named in `by (…)`, `without (…)`, `on (…)` and the like.
    grouping_labels: BTreeSet<String>,
}

/// The matchers of the `{…}` that starts at `tokens[*i]`; leaves `*i` on its `}`.
fn matchers(tokens: &[Token], i: &mut usize) -> Vec<Matcher> {
    let mut found = Vec::new();
    *i += 1;
    while *i < tokens.len() && tokens[*i] != Token::Punct('}') {
        if let Token::Ident(label) = &tokens[*i] {
            let (op, value_at) = match (tokens.get(*i + 1), tokens.get(*i + 2)) {
                (Some(Token::Punct('=')), Some(Token::Punct('~'))) => ("=~", *i + 3),
                (Some(Token::Punct('!')), Some(Token::Punct('='))) => ("!=", *i + 3),
                (Some(Token::Punct('!')), Some(Token::Punct('~'))) => ("!~", *i + 3),
                (Some(Token::Punct('=')), _) => ("=", *i + 2),
                _ => {
                    *i += 1;
                    continue;
                }
            };
            let value = match tokens.get(value_at) {
                Some(Token::Str(value)) => value.clone(),
                _ => String::new(),
            };
            found.push(Matcher {
                label: label.clone(),
                op: op.to_owned(),
                value,
            });
            *i = value_at;
        }
        *i += 1;
    }
    found
}

fn walk(tokens: &[Token]) -> Walked {
    let mut walked = Walked {
        selectors: Vec::new(),
        grouping_labels: BTreeSet::new(),
    };
    let mut i = 0;
    while i < tokens.len() {
        match &tokens[i] {
            Token::Punct('{') => {
                let matchers = matchers(tokens, &mut i);
                walked.selectors.push(Selector {
                    metric: None,
                    matchers,
                });
            }
            Token::Punct('[') => {
                while i < tokens.len() && tokens[i] != Token::Punct(']') {
                    i += 1;
                }
            }
            Token::Ident(word)
                if GROUPING.contains(&word.as_str())
                    && tokens.get(i + 1) == Some(&Token::Punct('(')) =>
            {
                i += 2;
                while i < tokens.len() && tokens[i] != Token::Punct(')') {
                    if let Token::Ident(label) = &tokens[i] {
                        walked.grouping_labels.insert(label.clone());
                    }
                    i += 1;
                }
            }
            Token::Ident(word) => {
                // `f(…)`, or an aggregation with its grouping first: `sum by (x) (…)`.
                let is_call = match tokens.get(i + 1) {
                    Some(Token::Punct('(')) => true,
                    Some(Token::Ident(next)) => next == "by" || next == "without",
                    _ => false,
                };
                // `Inf` and `NaN` are numbers, in any case.
                let is_number = ["inf", "nan"].contains(&word.to_ascii_lowercase().as_str());
                if !is_call && !is_number && !KEYWORDS.contains(&word.as_str()) {
                    let mut matchers_of_metric = Vec::new();
                    if tokens.get(i + 1) == Some(&Token::Punct('{')) {
                        i += 1;
                        matchers_of_metric = matchers(tokens, &mut i);
                    }
                    walked.selectors.push(Selector {
                        metric: Some(word.clone()),
                        matchers: matchers_of_metric,
                    });
                }
            }
            _ => {}
        }
        i += 1;
    }
    walked
}

/// The metric and label names `expr` refers to. Template variables must have been substituted.
pub fn names(expr: &str) -> Result<Names, PromqlError> {
    let tokens = tokenize(expr)?;
    if let Some(Token::Variable(name)) = tokens.iter().find(|t| matches!(t, Token::Variable(_))) {
        return Err(PromqlError::Variable(name.clone()));
    }
    let walked = walk(&tokens);
    let mut names = Names {
        labels: walked.grouping_labels,
        ..Names::default()
    };
    for selector in walked.selectors {
        names.metrics.extend(selector.metric);
        names
            .labels
            .extend(selector.matchers.into_iter().map(|m| m.label));
    }
    Ok(names)
}

/// Every vector selector of `expr`, in order. Template variables may be left in (a dashboard's
/// own expression, before Grafana substitutes them).
pub fn selectors(expr: &str) -> Result<Vec<Selector>, PromqlError> {
    Ok(walk(&tokenize(expr)?).selectors)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(items: &[&str]) -> BTreeSet<String> {
        items.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn finds_metrics_and_labels_of_dashboard_shapes() {
        let n = names(
            r#"histogram_quantile(0.95, sum by (queue, le) (rate(fairlane_job_wait_seconds_bucket{queue=~".+_priority"}[1m])))"#,
        )
        .unwrap();
        assert_eq!(n.metrics, set(&["fairlane_job_wait_seconds_bucket"]));
        assert_eq!(n.labels, set(&["queue", "le"]));

        let n = names(
            r#"sum(fairlane_workers_busy{queue="a", state!="x"}) / sum without (instance) (fairlane_workers_max) > bool 0.5"#,
        )
        .unwrap();
        assert_eq!(
            n.metrics,
            set(&["fairlane_workers_busy", "fairlane_workers_max"])
        );
        assert_eq!(n.labels, set(&["queue", "state", "instance"]));

        let n =
            names(r#"sum(rate(x_total[5m] offset 1h)) by (tier) or on (job) group_left (pod) up"#)
                .unwrap();
        assert_eq!(n.metrics, set(&["x_total", "up"]));
        assert_eq!(n.labels, set(&["tier", "job", "pod"]));
    }

    #[test]
    fn strings_durations_and_comments_are_not_names() {
        let n =
            names("count_over_time(m{a=\"by (x)\", b='y'}[1h:5m]) # trailing comment mentions z\n")
                .unwrap();
        assert_eq!(n.metrics, set(&["m"]));
        assert_eq!(n.labels, set(&["a", "b"]));
        let n = names("vector(1) * 1e3 > Inf or -inf < NaN").unwrap();
        assert!(n.metrics.is_empty() && n.labels.is_empty());
    }

    #[test]
    fn selectors_carry_their_matchers_with_variables_left_in() {
        let found = selectors(
            r#"sum by (queue) (rate(jobs_total{queue=~"$queue", namespace=~"${namespace}", state!="x", kind!~'a|b'}[$__rate_interval])) / on (queue) up or {__name__="m"}"#,
        )
        .unwrap();
        type Shape<'a> = (Option<&'a str>, Vec<(&'a str, &'a str, &'a str)>);
        let shapes: Vec<Shape<'_>> = found
            .iter()
            .map(|s| {
                (
                    s.metric.as_deref(),
                    s.matchers
                        .iter()
                        .map(|m| (m.label.as_str(), m.op.as_str(), m.value.as_str()))
                        .collect(),
                )
            })
            .collect();
        assert_eq!(
            shapes,
            vec![
                (
                    Some("jobs_total"),
                    vec![
                        ("queue", "=~", "$queue"),
                        ("namespace", "=~", "${namespace}"),
                        ("state", "!=", "x"),
                        ("kind", "!~", "a|b"),
                    ]
                ),
                (Some("up"), vec![]),
                (None, vec![("__name__", "=", "m")]),
            ]
        );
        assert!(found[0].matchers[1].is("namespace", "=~", "${namespace}"));
        assert!(!found[0].matchers[1].is("namespace", "=", "${namespace}"));
    }

    #[test]
    fn leftover_variables_and_bad_input_are_errors() {
        assert_eq!(
            names("rate(x[$__rate_interval])"),
            Err(PromqlError::Variable("$__rate_interval".into()))
        );
        assert_eq!(names("x{a=\"b}"), Err(PromqlError::UnterminatedString));
        assert_eq!(names("x ? y"), Err(PromqlError::Unexpected('?')));
    }
}
