//! Rules files in the Envoy/Lyft ratelimit format, extended with `algorithm` and `burst`:
//! parsing, validation with located messages, and matching a request against the rule trees.
//!
//! Matching model (documented in docs/ratelimit.md): every top-level descriptor tree is walked
//! against the request's descriptor map. Among siblings with the same key, an exact `value`
//! beats a wildcard `value*` (longest prefix first), which beats a key-only descriptor. The
//! deepest matched descriptor carrying a `rate_limit` on each branch applies, and its counter is
//! keyed by the domain plus the matched (key, actual value) pairs.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Deserializer};

use crate::policy::{Algorithm, Policy, Unit};
use crate::request::{DescriptorKey, RateLimitRequest};
use crate::yaml_locate::{Segment, YamlPath, locate};

/// Largest accepted `requests_per_unit` and `burst`: keeps the scaled integer arithmetic exact in
/// Rust (`u64`). The Redis scripts compute in doubles, exact only up to 2⁵³ scaled units (see
/// docs/ratelimit.md for the margin beyond).
pub const MAX_REQUESTS_PER_UNIT: u64 = 100_000_000;

/// Largest `requests_per_unit` for `sliding_log`, which stores one entry per allowed request.
pub const MAX_SLIDING_LOG_REQUESTS: u64 = 10_000;

/// A rules file that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum RulesError {
    /// The file could not be read.
    #[error("cannot read rules file `{file}`: {source}")]
    Read {
        file: String,
        #[source]
        source: std::io::Error,
    },
    /// The file is not a valid rules file; `message` names the YAML path, the problem and,
    /// where known, the line and column.
    #[error("rules file `{file}`: {message}")]
    Invalid {
        file: String,
        message: String,
        /// One-based line of the offending node, when known.
        line: Option<usize>,
    },
}

/// What a matched rule does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleLimit {
    /// `rate_limit: {unlimited: true}`: matched, counted as allowed, never limited.
    Unlimited,
    /// `requests_per_unit: 0` on a descriptor with an exact value (Envoy's way to ban a value).
    Blocked { unit: Unit },
    /// A real limit.
    Limited(Policy),
}

/// One descriptor that carries a `rate_limit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Stable, low-cardinality id for metrics and logs: the domain and the descriptor path with
    /// keys and *configured* values, e.g. `fairlane:tier=free/user_id`.
    pub id: Arc<str>,
    /// The YAML path of the descriptor, e.g. `descriptors[0].descriptors[1]`.
    pub yaml_path: String,
    pub limit: RuleLimit,
    /// Count would-be denials but never deny.
    pub shadow_mode: bool,
    /// `rate_limit.name` (Envoy), for `replaces`.
    pub name: Option<String>,
    /// `rate_limit.replaces[].name` (Envoy): rules with these names are dropped when this one
    /// applies to the same request.
    pub replaces: Vec<String>,
    /// `detailed_metric` (Envoy); accepted but not used: metric labels never carry request values.
    pub detailed_metric: bool,
    /// `}:<algorithm tag>:<unit seconds>`, which ends each of this rule's counter keys; written
    /// when the rules load. Empty for unlimited and blocked rules, which keep no state.
    counter_key_tail: String,
}

/// A rule that applies to a request, with the key of the counter it uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatchedRule {
    pub rule: Arc<Rule>,
    /// `{domain|key=value|…}:<algorithm tag>:<unit seconds>`; the braces are a Redis Cluster
    /// hash tag. Empty for unlimited and blocked rules, which keep no state.
    pub counter_key: String,
}

/// A parsed, validated rules file, ready for matching.
#[derive(Debug, Clone)]
pub struct RuleSet {
    domain: String,
    /// `{` and the escaped domain: how every counter key starts.
    key_head: String,
    source: String,
    roots: Vec<KeyGroup>,
    rules: Vec<Arc<Rule>>,
}

#[derive(Debug, Clone)]
struct Node {
    rule: Option<Arc<Rule>>,
    children: Vec<KeyGroup>,
}

/// The siblings that share one key, indexed for most-specific-first lookup.
#[derive(Debug, Clone)]
struct KeyGroup {
    key: String,
    /// `|`, the escaped key and `=`: what a match of this group adds to a counter key.
    key_segment: String,
    request_key: Option<DescriptorKey>,
    exact: HashMap<String, Node>,
    /// Wildcard (`value*`) siblings, longest prefix first.
    prefixes: Vec<(String, Node)>,
    any: Option<Box<Node>>,
}

impl RuleSet {
    /// Parse a rules document in the Envoy format (any descriptor key accepted). `source` names
    /// the document in error messages (normally the file path).
    pub fn parse(text: &str, source: &str) -> Result<RuleSet, RulesError> {
        parse(text, source, false)
    }

    /// Parse a rules document for Fairlane: like [`RuleSet::parse`], but descriptor keys must be
    /// ones a Fairlane request carries ([`DescriptorKey`]), so a typo cannot silently never match.
    pub fn parse_fairlane(text: &str, source: &str) -> Result<RuleSet, RulesError> {
        parse(text, source, true)
    }

    /// Read and [`RuleSet::parse_fairlane`] a rules file.
    pub fn load_file(path: &Path) -> Result<RuleSet, RulesError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| RulesError::Read {
            file: file.clone(),
            source,
        })?;
        RuleSet::parse_fairlane(&text, &file)
    }

    /// The `domain`.
    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// Where the rules came from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Every descriptor that carries a `rate_limit`, in file order.
    pub fn rules(&self) -> &[Arc<Rule>] {
        &self.rules
    }

    /// The rule with this id.
    pub fn rule(&self, id: &str) -> Option<&Arc<Rule>> {
        self.rules.iter().find(|r| &*r.id == id)
    }

    /// The rules that apply to `request`, each with its counter key; `replaces` already applied.
    pub fn match_request(&self, request: &RateLimitRequest) -> Vec<MatchedRule> {
        let mut out = Vec::new();
        let mut identity = String::with_capacity(64);
        identity.push_str(&self.key_head);
        walk(&self.roots, request, &mut identity, &mut out);
        if out.iter().any(|m| !m.rule.replaces.is_empty()) {
            let replaced: HashSet<&str> = out
                .iter()
                .flat_map(|m| m.rule.replaces.iter().map(String::as_str))
                .collect();
            let keep: Vec<bool> = out
                .iter()
                .map(|m| m.rule.name.as_deref().is_none_or(|n| !replaced.contains(n)))
                .collect();
            let mut keep = keep.into_iter();
            out.retain(|_| keep.next().unwrap_or(true));
        }
        out
    }
}

/// Walk the groups at one level; returns whether anything below matched a rule.
fn walk(
    groups: &[KeyGroup],
    request: &RateLimitRequest,
    identity: &mut String,
    out: &mut Vec<MatchedRule>,
) -> bool {
    let mut matched_any = false;
    for group in groups {
        let Some(value) = group.request_key.and_then(|k| request.get(k)) else {
            continue;
        };
        let Some(node) = group.best_match(value) else {
            continue;
        };
        let mark = identity.len();
        identity.push_str(&group.key_segment);
        push_escaped(identity, value);
        let deeper = walk(&node.children, request, identity, out);
        if !deeper && let Some(rule) = &node.rule {
            out.push(MatchedRule {
                rule: Arc::clone(rule),
                counter_key: counter_key(identity, rule),
            });
            matched_any = true;
        }
        matched_any |= deeper;
        identity.truncate(mark);
    }
    matched_any
}

fn counter_key(identity: &str, rule: &Rule) -> String {
    let tail = &rule.counter_key_tail;
    if tail.is_empty() {
        return String::new();
    }
    let mut key = String::with_capacity(identity.len() + tail.len());
    key.push_str(identity);
    key.push_str(tail);
    key
}

/// Append `value`, percent-encoding the characters that structure a counter key. They are all
/// ASCII, so the text between them is copied in whole runs, and most values in one.
fn push_escaped(out: &mut String, value: &str) {
    const fn escape(byte: u8) -> Option<&'static str> {
        match byte {
            b'%' => Some("%25"),
            b'{' => Some("%7B"),
            b'}' => Some("%7D"),
            b'|' => Some("%7C"),
            b'=' => Some("%3D"),
            _ => None,
        }
    }
    if !value.bytes().any(|byte| escape(byte).is_some()) {
        out.push_str(value);
        return;
    }
    let mut copied = 0;
    for (i, byte) in value.bytes().enumerate() {
        let Some(escape) = escape(byte) else {
            continue;
        };
        out.push_str(&value[copied..i]);
        out.push_str(escape);
        copied = i + 1;
    }
    out.push_str(&value[copied..]);
}

impl KeyGroup {
    fn best_match(&self, value: &str) -> Option<&Node> {
        if let Some(node) = self.exact.get(value) {
            return Some(node);
        }
        if let Some((_, node)) = self
            .prefixes
            .iter()
            .find(|(p, _)| value.starts_with(p.as_str()))
        {
            return Some(node);
        }
        self.any.as_deref()
    }
}

// ---------------------------------------------------------------------------------------------
// Raw file format (serde), then validation into the tree above.

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    domain: String,
    #[serde(default)]
    descriptors: Option<Vec<RawDescriptor>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDescriptor {
    key: String,
    #[serde(default, deserialize_with = "scalar_string")]
    value: Option<String>,
    #[serde(default)]
    rate_limit: Option<RawRateLimit>,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    detailed_metric: bool,
    #[serde(default)]
    descriptors: Option<Vec<RawDescriptor>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRateLimit {
    #[serde(default)]
    unit: Option<Unit>,
    #[serde(default)]
    requests_per_unit: Option<u64>,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    algorithm: Option<Algorithm>,
    #[serde(default)]
    burst: Option<u64>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    replaces: Option<Vec<RawReplace>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReplace {
    name: String,
}

/// Descriptor values are strings, but YAML reads `value: 42` or `value: true` as other scalars;
/// accept any scalar, as Envoy does.
fn scalar_string<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<String>, D::Error> {
    struct ScalarVisitor;
    impl serde::de::Visitor<'_> for ScalarVisitor {
        type Value = Option<String>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a string, number or boolean")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Some(v.to_owned()))
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    }
    deserializer.deserialize_any(ScalarVisitor)
}

struct Compiler<'a> {
    text: &'a str,
    source: &'a str,
    domain: String,
    fairlane_keys: bool,
    rules: Vec<Arc<Rule>>,
    /// `replaces` references to check once every name is known: (name, path of the reference).
    replace_refs: Vec<(String, YamlPath)>,
}

fn parse(text: &str, source: &str, fairlane_keys: bool) -> Result<RuleSet, RulesError> {
    if text.trim().is_empty() {
        return Err(RulesError::Invalid {
            file: source.to_owned(),
            message: "the file is empty (expected `domain:` and `descriptors:`)".to_owned(),
            line: None,
        });
    }
    let raw: RawConfig = serde_yaml::from_str(text).map_err(|err| RulesError::Invalid {
        file: source.to_owned(),
        message: err.to_string(),
        line: err.location().map(|l| l.line()),
    })?;
    let mut compiler = Compiler {
        text,
        source,
        domain: raw.domain.clone(),
        fairlane_keys,
        rules: Vec::new(),
        replace_refs: Vec::new(),
    };
    let root = YamlPath::default();
    if raw.domain.trim().is_empty() {
        return Err(compiler.error(&root.key("domain"), "`domain` must not be empty"));
    }
    let descriptors = raw.descriptors.unwrap_or_default();
    let roots = compiler.compile_level(&descriptors, &root.key("descriptors"), "")?;
    let names: HashSet<&str> = compiler
        .rules
        .iter()
        .filter_map(|r| r.name.as_deref())
        .collect();
    if let Some((name, path)) = compiler
        .replace_refs
        .iter()
        .find(|(name, _)| !names.contains(name.as_str()))
    {
        return Err(compiler.error(
            path,
            &format!("`replaces` names `{name}`, but no rate_limit has that `name`"),
        ));
    }
    let mut key_head = String::from("{");
    push_escaped(&mut key_head, &raw.domain);
    Ok(RuleSet {
        key_head,
        domain: raw.domain,
        source: source.to_owned(),
        roots,
        rules: compiler.rules,
    })
}

impl Compiler<'_> {
    fn error(&self, path: &YamlPath, problem: &str) -> RulesError {
        let location = locate(self.text, path);
        let message = match location {
            Some((line, column)) => format!("{path}: {problem} at line {line} column {column}"),
            None => format!("{path}: {problem}"),
        };
        RulesError::Invalid {
            file: self.source.to_owned(),
            message,
            line: location.map(|(line, _)| line),
        }
    }

    /// Compile one list of sibling descriptors found at `path` (a `descriptors` key).
    fn compile_level(
        &mut self,
        descriptors: &[RawDescriptor],
        path: &YamlPath,
        id_prefix: &str,
    ) -> Result<Vec<KeyGroup>, RulesError> {
        let mut groups: Vec<KeyGroup> = Vec::new();
        let mut seen: HashMap<(&str, Option<&str>), usize> = HashMap::new();
        for (index, raw) in descriptors.iter().enumerate() {
            let here = path.child(Segment::Index(index));
            if raw.key.trim().is_empty() {
                return Err(self.error(&here.key("key"), "`key` must not be empty"));
            }
            let request_key = DescriptorKey::from_name(&raw.key);
            if self.fairlane_keys && request_key.is_none() {
                let known: Vec<&str> = DescriptorKey::ALL.iter().map(|k| k.as_str()).collect();
                return Err(self.error(
                    &here.key("key"),
                    &format!(
                        "unknown descriptor key `{}`; Fairlane requests carry only {}",
                        raw.key,
                        known.join(", ")
                    ),
                ));
            }
            if raw.value.as_deref().is_some_and(|v| v.is_empty()) {
                return Err(self.error(
                    &here.key("value"),
                    "`value` must not be empty (leave it out to match any value)",
                ));
            }
            if let Some(first) = seen.insert((raw.key.as_str(), raw.value.as_deref()), index) {
                let what = match &raw.value {
                    Some(v) => format!("key `{}` with value `{v}`", raw.key),
                    None => format!("key `{}` without a value", raw.key),
                };
                return Err(self.error(
                    &here,
                    &format!(
                        "duplicate descriptor: {what} is already defined at {}",
                        path.child(Segment::Index(first))
                    ),
                ));
            }
            let shown = match &raw.value {
                Some(v) => format!("{}={v}", raw.key),
                None => raw.key.clone(),
            };
            let id = if id_prefix.is_empty() {
                format!("{}:{shown}", self.domain)
            } else {
                format!("{id_prefix}/{shown}")
            };
            let node = self.compile_descriptor(raw, &here, &id)?;
            let group = match groups.iter_mut().position(|g| g.key == raw.key) {
                Some(i) => &mut groups[i],
                None => {
                    let mut key_segment = String::from("|");
                    push_escaped(&mut key_segment, &raw.key);
                    key_segment.push('=');
                    groups.push(KeyGroup {
                        key: raw.key.clone(),
                        key_segment,
                        request_key,
                        exact: HashMap::new(),
                        prefixes: Vec::new(),
                        any: None,
                    });
                    let last = groups.len() - 1;
                    &mut groups[last]
                }
            };
            match &raw.value {
                None => group.any = Some(Box::new(node)),
                Some(v) if v.ends_with('*') => {
                    group
                        .prefixes
                        .push((v.trim_end_matches('*').to_owned(), node));
                }
                Some(v) => {
                    group.exact.insert(v.clone(), node);
                }
            }
        }
        for group in &mut groups {
            group
                .prefixes
                .sort_by_key(|(prefix, _)| std::cmp::Reverse(prefix.len()));
        }
        Ok(groups)
    }

    fn compile_descriptor(
        &mut self,
        raw: &RawDescriptor,
        here: &YamlPath,
        id: &str,
    ) -> Result<Node, RulesError> {
        if raw.shadow_mode && raw.rate_limit.is_none() {
            return Err(self.error(
                &here.key("shadow_mode"),
                "`shadow_mode` needs a `rate_limit` on the same descriptor",
            ));
        }
        let rule = match &raw.rate_limit {
            None => None,
            Some(rate_limit) => {
                let at = here.key("rate_limit");
                let limit = self.compile_rate_limit(rate_limit, raw, &at)?;
                let mut replaces = Vec::new();
                for (i, r) in rate_limit.replaces.iter().flatten().enumerate() {
                    let rpath = at.key("replaces").child(Segment::Index(i)).key("name");
                    if r.name.trim().is_empty() {
                        return Err(self.error(&rpath, "`name` must not be empty"));
                    }
                    // Matching drops every rule named in a `replaces`, so a rule naming itself
                    // would never apply. Envoy refuses it too ("replaces should not contain
                    // name of same descriptor").
                    if rate_limit.name.as_deref() == Some(r.name.as_str()) {
                        return Err(self.error(
                            &rpath,
                            &format!(
                                "`replaces` names `{}`, this rate_limit's own `name`: a rule \
                                 cannot replace itself (it would never apply)",
                                r.name
                            ),
                        ));
                    }
                    self.replace_refs.push((r.name.clone(), rpath));
                    replaces.push(r.name.clone());
                }
                if rate_limit
                    .name
                    .as_deref()
                    .is_some_and(|n| n.trim().is_empty())
                {
                    return Err(self.error(&at.key("name"), "`name` must not be empty"));
                }
                let counter_key_tail = match limit {
                    RuleLimit::Limited(policy) => format!(
                        "}}:{}:{}",
                        policy.algorithm.key_tag(),
                        policy.unit.seconds()
                    ),
                    RuleLimit::Unlimited | RuleLimit::Blocked { .. } => String::new(),
                };
                let rule = Arc::new(Rule {
                    id: Arc::from(id),
                    yaml_path: here.to_string(),
                    limit,
                    shadow_mode: raw.shadow_mode,
                    name: rate_limit.name.clone(),
                    replaces,
                    detailed_metric: raw.detailed_metric,
                    counter_key_tail,
                });
                self.rules.push(Arc::clone(&rule));
                Some(rule)
            }
        };
        let children = match &raw.descriptors {
            Some(children) => self.compile_level(children, &here.key("descriptors"), id)?,
            None => Vec::new(),
        };
        Ok(Node { rule, children })
    }

    fn compile_rate_limit(
        &self,
        raw: &RawRateLimit,
        descriptor: &RawDescriptor,
        at: &YamlPath,
    ) -> Result<RuleLimit, RulesError> {
        if raw.unlimited {
            let mut extra = Vec::new();
            if raw.unit.is_some() {
                extra.push("`unit`");
            }
            if raw.requests_per_unit.is_some() {
                extra.push("`requests_per_unit`");
            }
            if raw.algorithm.is_some() {
                extra.push("`algorithm`");
            }
            if raw.burst.is_some() {
                extra.push("`burst`");
            }
            if !extra.is_empty() {
                return Err(self.error(
                    at,
                    &format!(
                        "`unlimited: true` cannot be combined with a limit ({})",
                        extra.join(", ")
                    ),
                ));
            }
            return Ok(RuleLimit::Unlimited);
        }
        let Some(unit) = raw.unit else {
            return Err(self.error(at, "missing `unit` (second, minute, hour or day)"));
        };
        let Some(requests_per_unit) = raw.requests_per_unit else {
            return Err(self.error(at, "missing `requests_per_unit`"));
        };
        let algorithm = raw.algorithm.unwrap_or_default();
        if let Some(burst) = raw.burst {
            if !algorithm.has_burst() {
                let default = if raw.algorithm.is_none() {
                    " (the default; set `algorithm: token_bucket` or `leaky_bucket`)"
                } else {
                    ""
                };
                return Err(self.error(
                    &at.key("burst"),
                    &format!(
                        "`burst` applies only to token_bucket and leaky_bucket, not {algorithm}{default}"
                    ),
                ));
            }
            if burst == 0 {
                return Err(self.error(&at.key("burst"), "`burst` must be at least 1"));
            }
            if burst > MAX_REQUESTS_PER_UNIT {
                return Err(self.error(
                    &at.key("burst"),
                    &format!("`burst` must be at most {MAX_REQUESTS_PER_UNIT}"),
                ));
            }
        }
        if requests_per_unit == 0 {
            let exact_value = descriptor
                .value
                .as_deref()
                .is_some_and(|v| !v.ends_with('*'));
            if !exact_value {
                return Err(self.error(
                    &at.key("requests_per_unit"),
                    "`requests_per_unit` must be at least 1 (0 would refuse every request; it is \
                     accepted only on a descriptor with an exact `value`, to block that value)",
                ));
            }
            if raw.burst.is_some() {
                return Err(self.error(
                    &at.key("burst"),
                    "`burst` has no meaning when `requests_per_unit` is 0 (the value is blocked)",
                ));
            }
            return Ok(RuleLimit::Blocked { unit });
        }
        if requests_per_unit > MAX_REQUESTS_PER_UNIT {
            return Err(self.error(
                &at.key("requests_per_unit"),
                &format!("`requests_per_unit` must be at most {MAX_REQUESTS_PER_UNIT}"),
            ));
        }
        if algorithm == Algorithm::SlidingLog && requests_per_unit > MAX_SLIDING_LOG_REQUESTS {
            return Err(self.error(
                &at.key("requests_per_unit"),
                &format!(
                    "sliding_log keeps one entry per allowed request, so `requests_per_unit` must \
                     be at most {MAX_SLIDING_LOG_REQUESTS}; use sliding_window for larger limits"
                ),
            ));
        }
        let policy = Policy::new(algorithm, unit, requests_per_unit)
            .with_burst(raw.burst.unwrap_or(requests_per_unit));
        Ok(RuleLimit::Limited(policy))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(pairs: &[(DescriptorKey, &str)]) -> RateLimitRequest {
        let mut r = RateLimitRequest::new();
        for (k, v) in pairs {
            r.set(*k, *v);
        }
        r
    }

    const RULES: &str = r#"
domain: fl
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: remote_address
    value: 10.0.0.1
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: tier
    value: free
    descriptors:
      - key: user_id
        rate_limit: {unit: minute, requests_per_unit: 60, algorithm: token_bucket, burst: 20}
  - key: tier
    value: pro
    descriptors:
      - key: user_id
        rate_limit: {unit: minute, requests_per_unit: 600}
  - key: route
    value: /v1/*
    descriptors:
      - key: user_id
        rate_limit: {unit: second, requests_per_unit: 5}
  - key: route
    value: /v1/analyses
    descriptors:
      - key: method
        value: POST
        descriptors:
          - key: user_id
            rate_limit: {unit: minute, requests_per_unit: 2, algorithm: sliding_log}
"#;

    #[test]
    fn most_specific_sibling_wins_and_each_tree_applies() {
        let rules = RuleSet::parse_fairlane(RULES, "t.yaml").expect("valid");
        let m = rules.match_request(&req(&[
            (DescriptorKey::RemoteAddress, "1.2.3.4"),
            (DescriptorKey::Tier, "free"),
            (DescriptorKey::UserId, "u1"),
            (DescriptorKey::Route, "/v1/analyses"),
            (DescriptorKey::Method, "POST"),
        ]));
        let ids: Vec<&str> = m.iter().map(|m| &*m.rule.id).collect();
        assert_eq!(
            ids,
            [
                "fl:remote_address",
                "fl:tier=free/user_id",
                "fl:route=/v1/analyses/method=POST/user_id"
            ]
        );
        assert_eq!(m[0].counter_key, "{fl|remote_address=1.2.3.4}:fw:1");
        assert_eq!(m[1].counter_key, "{fl|tier=free|user_id=u1}:tb:60");
        assert_eq!(
            m[2].counter_key,
            "{fl|route=/v1/analyses|method=POST|user_id=u1}:sl:60"
        );
    }

    #[test]
    fn exact_value_beats_wildcard_beats_key_only() {
        let rules = RuleSet::parse_fairlane(RULES, "t.yaml").expect("valid");
        let m = rules.match_request(&req(&[
            (DescriptorKey::RemoteAddress, "10.0.0.1"),
            (DescriptorKey::UserId, "u1"),
            (DescriptorKey::Route, "/v1/jobs/{id}"),
            (DescriptorKey::Method, "GET"),
        ]));
        let ids: Vec<&str> = m.iter().map(|m| &*m.rule.id).collect();
        assert_eq!(
            ids,
            ["fl:remote_address=10.0.0.1", "fl:route=/v1/*/user_id"]
        );
        assert_eq!(m[0].rule.limit, RuleLimit::Blocked { unit: Unit::Second });
        // Braces in a value are escaped so the hash tag stays intact.
        assert_eq!(
            m[1].counter_key,
            "{fl|route=/v1/jobs/%7Bid%7D|user_id=u1}:fw:1"
        );
    }

    #[test]
    fn escaping_encodes_each_structural_character_and_keeps_the_rest() {
        let escaped = |value: &str| {
            let mut out = String::from(">");
            push_escaped(&mut out, value);
            out
        };
        assert_eq!(escaped(""), ">");
        assert_eq!(escaped("plain-value_1.2"), ">plain-value_1.2");
        assert_eq!(escaped("%{}|="), ">%25%7B%7D%7C%3D");
        assert_eq!(escaped("=a%b{c}d|é→x="), ">%3Da%25b%7Bc%7Dd%7Cé→x%3D");
    }

    #[test]
    fn counter_keys_escape_the_domain_and_values_alike() {
        let text = r#"
domain: "a{b}|c=d%"
descriptors:
  - key: user_id
    rate_limit: {unit: hour, requests_per_unit: 5, algorithm: token_bucket}
"#;
        let rules = RuleSet::parse_fairlane(text, "t").expect("valid");
        let m = rules.match_request(&req(&[(DescriptorKey::UserId, "u|1=}")]));
        assert_eq!(m.len(), 1);
        assert_eq!(
            m[0].counter_key,
            "{a%7Bb%7D%7Cc%3Dd%25|user_id=u%7C1%3D%7D}:tb:3600"
        );
    }

    #[test]
    fn missing_keys_do_not_match() {
        let rules = RuleSet::parse_fairlane(RULES, "t.yaml").expect("valid");
        // Unauthenticated: no user_id, so only the per-IP rule applies.
        let m = rules.match_request(&req(&[
            (DescriptorKey::RemoteAddress, "1.2.3.4"),
            (DescriptorKey::Tier, "free"),
            (DescriptorKey::Route, "/v1/analyses"),
            (DescriptorKey::Method, "POST"),
        ]));
        assert_eq!(m.len(), 1);
        assert!(rules.match_request(&RateLimitRequest::new()).is_empty());
    }

    #[test]
    fn deepest_rule_on_a_branch_applies() {
        let text = r#"
domain: d
descriptors:
  - key: tier
    rate_limit: {unit: second, requests_per_unit: 100}
    descriptors:
      - key: user_id
        rate_limit: {unit: second, requests_per_unit: 5}
"#;
        let rules = RuleSet::parse_fairlane(text, "t").expect("valid");
        let m = rules.match_request(&req(&[(DescriptorKey::Tier, "pro")]));
        assert_eq!(&*m[0].rule.id, "d:tier");
        let m = rules.match_request(&req(&[
            (DescriptorKey::Tier, "pro"),
            (DescriptorKey::UserId, "7"),
        ]));
        assert_eq!(m.len(), 1);
        assert_eq!(&*m[0].rule.id, "d:tier/user_id");
    }

    #[test]
    fn replaces_drops_the_named_rule() {
        let text = r#"
domain: d
descriptors:
  - key: tier
    descriptors:
      - key: user_id
        rate_limit: {name: general, unit: second, requests_per_unit: 5}
  - key: route
    value: /v1/usage
    descriptors:
      - key: user_id
        rate_limit:
          replaces: [{name: general}]
          unit: second
          requests_per_unit: 50
"#;
        let rules = RuleSet::parse_fairlane(text, "t").expect("valid");
        let r = req(&[
            (DescriptorKey::Tier, "pro"),
            (DescriptorKey::UserId, "7"),
            (DescriptorKey::Route, "/v1/usage"),
        ]);
        let ids: Vec<String> = rules
            .match_request(&r)
            .iter()
            .map(|m| m.rule.id.to_string())
            .collect();
        assert_eq!(ids, ["d:route=/v1/usage/user_id"]);
    }
}
