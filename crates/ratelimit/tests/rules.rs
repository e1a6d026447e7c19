//! Rules files: the Envoy README examples and Fairlane's shipped rules parse; every invalid
//! configuration is refused with a message naming the file, the YAML path, the line and the
//! problem.

use std::path::{Path, PathBuf};

use ratelimit::{Algorithm, DescriptorKey, Policy, RateLimitRequest, RuleLimit, RuleSet, Unit};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/envoy")
        .join(name)
}

fn parse_envoy(name: &str) -> RuleSet {
    let path = fixture(name);
    let text = std::fs::read_to_string(&path).expect("fixture");
    RuleSet::parse(&text, name).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn every_envoy_readme_example_parses() {
    let examples = [
        ("example1.yaml", "mongo_cps", 2),
        ("example2.yaml", "messaging", 2),
        ("example3.yaml", "edge_proxy_per_ip", 2),
        ("example4a.yaml", "example4", 1),
        ("example4b.yaml", "example4", 1),
        ("example5.yaml", "internal", 2),
        ("example6.yaml", "example6", 2),
        ("example7.yaml", "example7", 2),
        ("example8.yaml", "example8", 2),
        ("example9.yaml", "example9", 1),
    ];
    for (file, domain, rules) in examples {
        let set = parse_envoy(file);
        assert_eq!(set.domain(), domain, "{file}");
        assert_eq!(set.rules().len(), rules, "{file}");
    }
}

#[test]
fn envoy_examples_mean_what_the_readme_says() {
    // Example 1: Envoy's default is a fixed window.
    let set = parse_envoy("example1.yaml");
    assert_eq!(
        set.rule("mongo_cps:database=users").map(|r| r.limit),
        Some(RuleLimit::Limited(Policy::new(
            Algorithm::FixedWindow,
            Unit::Second,
            500
        )))
    );
    // Example 3: a value with 0 per unit is blocked.
    let set = parse_envoy("example3.yaml");
    assert_eq!(
        set.rule("edge_proxy_per_ip:remote_address=50.0.0.5")
            .map(|r| r.limit),
        Some(RuleLimit::Blocked { unit: Unit::Second })
    );
    let set = parse_envoy("example5.yaml");
    assert_eq!(
        set.rule("internal:ldap").map(|r| r.limit),
        Some(RuleLimit::Unlimited)
    );
    let set = parse_envoy("example6.yaml");
    assert!(
        set.rule("example6:service/user=user-a")
            .is_some_and(|r| r.shadow_mode)
    );
    let set = parse_envoy("example7.yaml");
    let replacing = set
        .rule("example7:key_2=value_2/user=bkthomps")
        .expect("rule");
    assert_eq!(replacing.replaces, ["specific_limit"]);
    let set = parse_envoy("example8.yaml");
    assert!(set.rule("example8:key1").is_some_and(|r| r.detailed_metric));
}

#[test]
fn fairlane_parsing_refuses_keys_a_request_never_carries() {
    let text = std::fs::read_to_string(fixture("example1.yaml")).expect("fixture");
    let err = RuleSet::parse_fairlane(&text, "example1.yaml")
        .expect_err("`database` is not a Fairlane descriptor key")
        .to_string();
    assert!(err.contains("example1.yaml"), "{err}");
    assert!(err.contains("descriptors[0].key"), "{err}");
    assert!(err.contains("unknown descriptor key `database`"), "{err}");
    assert!(
        err.contains("user_id, tier, remote_address, route, method, api_key"),
        "{err}"
    );
    assert!(err.contains("line 4"), "{err}");
}

fn shipped_rules() -> RuleSet {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/ratelimit/rules.yaml");
    RuleSet::load_file(&path).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn shipped_default_rules_parse_and_cover_every_tier() {
    let rules = shipped_rules();
    assert_eq!(rules.domain(), "fairlane");
    let request = |tier: &str| {
        RateLimitRequest::new()
            .with(DescriptorKey::UserId, "u-1")
            .with(DescriptorKey::Tier, tier)
            .with(DescriptorKey::RemoteAddress, "203.0.113.9")
    };
    let mut previous_rate = 0;
    for tier in ["free", "pro", "pro_plus", "enterprise"] {
        // Any route: the general per-user limit only.
        let general = rules.match_request(&request(tier).with(DescriptorKey::Route, "/v1/usage"));
        assert_eq!(general.len(), 1, "{tier}");
        let RuleLimit::Limited(policy) = general[0].rule.limit else {
            panic!("{tier}: not a limit");
        };
        assert!(policy.requests_per_unit > previous_rate, "tiers must grow");
        previous_rate = policy.requests_per_unit;
        // Enqueue routes: the general limit and a tighter one.
        for route in ["/v1/analyses", "/v1/specviews"] {
            let enqueue = rules.match_request(
                &request(tier)
                    .with(DescriptorKey::Route, route)
                    .with(DescriptorKey::Method, "POST"),
            );
            assert_eq!(enqueue.len(), 2, "{tier} {route}");
            let RuleLimit::Limited(tight) = enqueue[1].rule.limit else {
                panic!("{tier} {route}: not a limit");
            };
            assert!(tight.requests_per_unit < policy.requests_per_unit);
            // Reading a job is not an enqueue.
            let get = rules.match_request(
                &request(tier)
                    .with(DescriptorKey::Route, route)
                    .with(DescriptorKey::Method, "GET"),
            );
            assert_eq!(get.len(), 1, "{tier} GET {route}");
        }
    }
    // Unauthenticated: per IP.
    let anonymous = rules.match_request(
        &RateLimitRequest::new()
            .with(DescriptorKey::Tier, "anonymous")
            .with(DescriptorKey::RemoteAddress, "203.0.113.9")
            .with(DescriptorKey::Route, "/v1/analyses")
            .with(DescriptorKey::Method, "POST"),
    );
    assert_eq!(anonymous.len(), 1);
    assert_eq!(
        anonymous[0].counter_key,
        "{fairlane|tier=anonymous|remote_address=203.0.113.9}:sw:60"
    );
}

/// Parse `yaml` as `bad.yaml` and return the error message.
fn refused(yaml: &str) -> String {
    match RuleSet::parse_fairlane(yaml, "bad.yaml") {
        Ok(_) => panic!("accepted:\n{yaml}"),
        Err(e) => {
            let message = e.to_string();
            assert!(message.starts_with("rules file `bad.yaml`: "), "{message}");
            message
        }
    }
}

fn assert_mentions(message: &str, parts: &[&str]) {
    for part in parts {
        assert!(message.contains(part), "`{part}` missing from: {message}");
    }
}

#[test]
fn unknown_fields_are_refused() {
    let m = refused("domain: d\ndescriptors:\n  - key: user_id\n    keyy: x\n");
    assert_mentions(&m, &["descriptors[0]", "unknown field `keyy`", "line 4"]);
    let m = refused(
        "domain: d\ndescriptors:\n  - key: user_id\n    rate_limit:\n      unit: second\n      requests_per_minute: 5\n",
    );
    assert_mentions(
        &m,
        &[
            "descriptors[0].rate_limit",
            "unknown field `requests_per_minute`",
            "line 6",
        ],
    );
    let m = refused("domain: d\ncolour: blue\n");
    assert_mentions(&m, &["unknown field `colour`", "line 2"]);
}

#[test]
fn unknown_unit_is_refused_with_its_full_path() {
    let m = refused(
        r#"domain: d
descriptors:
  - key: tier
  - key: route
    descriptors:
      - key: user_id
        rate_limit:
          unit: week
          requests_per_unit: 5
"#,
    );
    assert_mentions(
        &m,
        &[
            "descriptors[1].descriptors[0].rate_limit.unit",
            "unknown unit `week`, expected one of `second`, `minute`, `hour`, `day`",
            "line 8",
        ],
    );
    let m = refused(
        "domain: d\ndescriptors:\n  - key: user_id\n    rate_limit: {unit: 60, requests_per_unit: 5}\n",
    );
    assert_mentions(
        &m,
        &[
            "descriptors[0].rate_limit.unit",
            "unknown unit `60`",
            "line 4",
        ],
    );
}

#[test]
fn units_are_read_in_any_case() {
    // Envoy's ratelimit service upper-cases the unit, so its files may use any case.
    for (written, unit) in [
        ("second", Unit::Second),
        ("MINUTE", Unit::Minute),
        ("Minute", Unit::Minute),
        ("hOUR", Unit::Hour),
        ("DAY", Unit::Day),
    ] {
        let yaml = format!(
            "domain: d\ndescriptors:\n  - key: user_id\n    rate_limit: {{unit: {written}, requests_per_unit: 5}}\n"
        );
        let rules = RuleSet::parse_fairlane(&yaml, "any-case.yaml")
            .unwrap_or_else(|e| panic!("`unit: {written}` refused: {e}"));
        assert_eq!(
            rules.rules()[0].limit,
            RuleLimit::Limited(Policy::new(Algorithm::FixedWindow, unit, 5)),
            "{written}"
        );
        let matched =
            rules.match_request(&RateLimitRequest::new().with(DescriptorKey::UserId, "1"));
        assert_eq!(
            matched[0].counter_key,
            format!("{{d|user_id=1}}:fw:{}", unit.seconds())
        );
    }
}

#[test]
fn unknown_algorithm_is_refused() {
    let m = refused(
        "domain: d\ndescriptors:\n  - key: user_id\n    rate_limit: {unit: second, requests_per_unit: 5, algorithm: gcra}\n",
    );
    assert_mentions(
        &m,
        &[
            "descriptors[0].rate_limit.algorithm",
            "unknown variant `gcra`",
            "token_bucket",
            "line 4",
        ],
    );
}

#[test]
fn duplicate_descriptors_are_refused() {
    let m = refused(
        r#"domain: d
descriptors:
  - key: tier
    value: free
  - key: tier
    value: pro
  - key: tier
    value: free
"#,
    );
    assert_mentions(
        &m,
        &[
            "descriptors[2]",
            "duplicate descriptor: key `tier` with value `free`",
            "already defined at descriptors[0]",
            "line 7",
        ],
    );
    let m = refused(
        r#"domain: d
descriptors:
  - key: route
    descriptors:
      - key: user_id
        rate_limit: {unit: second, requests_per_unit: 1}
      - key: user_id
        rate_limit: {unit: second, requests_per_unit: 2}
"#,
    );
    assert_mentions(
        &m,
        &[
            "descriptors[0].descriptors[1]",
            "key `user_id` without a value",
            "line 7",
        ],
    );
    // The same key+value under different parents is fine.
    RuleSet::parse_fairlane(
        "domain: d\ndescriptors:\n  - key: tier\n    descriptors: [{key: user_id}]\n  - key: route\n    descriptors: [{key: user_id}]\n",
        "ok.yaml",
    )
    .expect("not siblings");
}

#[test]
fn empty_or_missing_domain_is_refused() {
    let m = refused("domain: \"\"\ndescriptors: []\n");
    assert_mentions(&m, &["domain", "must not be empty", "line 1"]);
    let m = refused("descriptors: []\n");
    assert_mentions(&m, &["missing field `domain`"]);
}

#[test]
fn unlimited_with_a_limit_is_refused() {
    let m = refused(
        "domain: d\ndescriptors:\n  - key: api_key\n    rate_limit:\n      unlimited: true\n      unit: second\n      requests_per_unit: 5\n",
    );
    assert_mentions(
        &m,
        &[
            "descriptors[0].rate_limit",
            "`unlimited: true` cannot be combined with a limit (`unit`, `requests_per_unit`)",
            "line 5",
        ],
    );
}

#[test]
fn zero_requests_per_unit_is_refused_except_to_block_one_value() {
    let m = refused(
        "domain: d\ndescriptors:\n  - key: user_id\n    rate_limit: {unit: second, requests_per_unit: 0}\n",
    );
    assert_mentions(
        &m,
        &[
            "descriptors[0].rate_limit.requests_per_unit",
            "must be at least 1",
            "line 4",
        ],
    );
    // A wildcard value is not one value.
    let m = refused(
        "domain: d\ndescriptors:\n  - key: remote_address\n    value: 10.*\n    rate_limit: {unit: second, requests_per_unit: 0}\n",
    );
    assert_mentions(&m, &["requests_per_unit", "must be at least 1"]);
}

#[test]
fn burst_is_refused_where_it_means_nothing() {
    let m = refused(
        "domain: d\ndescriptors:\n  - key: user_id\n    rate_limit: {unit: second, requests_per_unit: 5, burst: 10}\n",
    );
    assert_mentions(
        &m,
        &[
            "descriptors[0].rate_limit.burst",
            "`burst` applies only to token_bucket and leaky_bucket, not fixed_window (the default",
            "line 4",
        ],
    );
    let m = refused(
        "domain: d\ndescriptors:\n  - key: user_id\n    rate_limit:\n      unit: second\n      requests_per_unit: 5\n      algorithm: sliding_log\n      burst: 10\n",
    );
    assert_mentions(
        &m,
        &[
            "descriptors[0].rate_limit.burst",
            "not sliding_log",
            "line 8",
        ],
    );
    let m = refused(
        "domain: d\ndescriptors:\n  - key: user_id\n    rate_limit: {unit: second, requests_per_unit: 5, algorithm: token_bucket, burst: 0}\n",
    );
    assert_mentions(&m, &["rate_limit.burst", "`burst` must be at least 1"]);
}

#[test]
fn incomplete_or_mistyped_limits_are_refused() {
    let m = refused(
        "domain: d\ndescriptors:\n  - key: user_id\n    rate_limit: {requests_per_unit: 5}\n",
    );
    assert_mentions(
        &m,
        &["descriptors[0].rate_limit", "missing `unit`", "line 4"],
    );
    let m = refused("domain: d\ndescriptors:\n  - key: user_id\n    rate_limit: {unit: hour}\n");
    assert_mentions(&m, &["missing `requests_per_unit`"]);
    let m = refused(
        "domain: d\ndescriptors:\n  - key: user_id\n    rate_limit: {unit: hour, requests_per_unit: ten}\n",
    );
    assert_mentions(
        &m,
        &[
            "descriptors[0].rate_limit.requests_per_unit",
            "invalid type",
            "line 4",
        ],
    );
    let m = refused(
        "domain: d\ndescriptors:\n  - key: user_id\n    rate_limit: {unit: hour, requests_per_unit: -3}\n",
    );
    assert_mentions(&m, &["requests_per_unit", "line 4"]);
    let m = refused(
        "domain: d\ndescriptors:\n  - key: user_id\n    rate_limit: {unit: hour, requests_per_unit: 100000, algorithm: sliding_log}\n",
    );
    assert_mentions(
        &m,
        &[
            "sliding_log keeps one entry per allowed request",
            "use sliding_window",
        ],
    );
}

#[test]
fn descriptor_mistakes_are_refused() {
    let m = refused("domain: d\ndescriptors:\n  - value: x\n");
    assert_mentions(&m, &["descriptors[0]", "missing field `key`", "line 3"]);
    let m = refused("domain: d\ndescriptors:\n  - key: \"\"\n");
    assert_mentions(
        &m,
        &["descriptors[0].key", "`key` must not be empty", "line 3"],
    );
    let m = refused(
        "domain: d\ndescriptors:\n  - key: user-id\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
    );
    assert_mentions(
        &m,
        &[
            "descriptors[0].key",
            "unknown descriptor key `user-id`",
            "line 3",
        ],
    );
    let m = refused("domain: d\ndescriptors:\n  - key: tier\n    value: \"\"\n");
    assert_mentions(&m, &["descriptors[0].value", "must not be empty", "line 4"]);
    let m = refused("domain: d\ndescriptors:\n  - key: tier\n    shadow_mode: true\n");
    assert_mentions(
        &m,
        &[
            "descriptors[0].shadow_mode",
            "needs a `rate_limit`",
            "line 4",
        ],
    );
    let m = refused(
        "domain: d\ndescriptors:\n  - key: user_id\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      replaces: [{name: nobody}]\n",
    );
    assert_mentions(
        &m,
        &[
            "descriptors[0].rate_limit.replaces[0].name",
            "`replaces` names `nobody`",
            "line 7",
        ],
    );
}

#[test]
fn a_rule_replacing_itself_is_refused() {
    // Matching drops every rule a `replaces` names, so this rule would never apply; Envoy refuses
    // it as well.
    let m = refused(
        r#"domain: d
descriptors:
  - key: user_id
    rate_limit:
      unit: second
      requests_per_unit: 1
      name: mine
      replaces:
        - name: other
        - name: mine
  - key: tier
    rate_limit:
      unit: second
      requests_per_unit: 1
      name: other
"#,
    );
    assert_mentions(
        &m,
        &[
            "descriptors[0].rate_limit.replaces[1].name",
            "`replaces` names `mine`, this rate_limit's own `name`",
            "cannot replace itself",
            "line 10",
        ],
    );
}

#[test]
fn broken_yaml_and_empty_files_are_refused() {
    let m = refused("domain: d\ndescriptors:\n  - key: user_id\n   rate_limit: {\n");
    assert_mentions(&m, &["line"]);
    let m = refused("  \n");
    assert_mentions(&m, &["the file is empty"]);
    let m = refused("domain: d\ndescriptors: {key: user_id}\n");
    assert_mentions(&m, &["descriptors", "invalid type", "expected a sequence"]);
}

#[test]
fn a_missing_file_is_refused_with_its_name() {
    let err = RuleSet::load_file(Path::new("/nonexistent/rules.yaml"))
        .expect_err("no such file")
        .to_string();
    assert_mentions(&err, &["cannot read rules file `/nonexistent/rules.yaml`"]);
}

#[test]
fn scalar_values_are_read_as_strings() {
    let set = RuleSet::parse_fairlane(
        "domain: d\ndescriptors:\n  - key: user_id\n    value: 42\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        "t",
    )
    .expect("valid");
    let m = set.match_request(&RateLimitRequest::new().with(DescriptorKey::UserId, "42"));
    assert_eq!(m.len(), 1);
    assert_eq!(&*m[0].rule.id, "d:user_id=42");
}
