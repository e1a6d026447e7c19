//! The limiter front: several limits per request, shadow mode, blocked and unlimited rules, the
//! deny cache against real Redis, and hot reload of the rules file.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{redis_url, temp_dir, unique_prefix};
use ratelimit::{
    Backend, DecisionKind, DecisionSource, DescriptorKey, Limiter, LimiterConfig, ManualClock,
    MemoryBackend, MemoryConfig, RateLimitRequest, RedisBackend, RedisConfig, RuleLimit, RuleSet,
    Unit,
};

const T0: u64 = 1_700_000_000 * 1_000_000;

fn memory_backend() -> Arc<dyn Backend> {
    Arc::new(MemoryBackend::new(
        &MemoryConfig::default(),
        Arc::new(ManualClock::new(T0)),
    ))
}

/// No reloads, and a deadline no healthy Redis misses even on a loaded machine (a first call
/// connects and loads the script): these tests are about decisions, not the deadline, which
/// `redis_failover.rs` covers, so a `Fallback` here is a failure.
fn static_config() -> LimiterConfig {
    LimiterConfig {
        reload_interval: None,
        deadline: Duration::from_secs(2),
        ..LimiterConfig::default()
    }
}

fn user(id: &str) -> RateLimitRequest {
    RateLimitRequest::new()
        .with(DescriptorKey::UserId, id)
        .with(DescriptorKey::Tier, "free")
        .with(DescriptorKey::RemoteAddress, "192.0.2.1")
}

fn limiter(rules: &str, config: LimiterConfig) -> Limiter {
    let rules = RuleSet::parse_fairlane(rules, "test.yaml").expect("valid rules");
    Limiter::new(rules, memory_backend(), config)
}

#[tokio::test]
async fn a_request_is_denied_if_any_enforced_limit_denies_it() {
    let limiter = limiter(
        r#"
domain: multi
descriptors:
  - key: user_id
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 2}
"#,
        static_config(),
    );
    for _ in 0..2 {
        let outcome = limiter.check(&user("a")).await;
        assert!(outcome.allowed);
        assert_eq!(outcome.limits.len(), 2);
        // Headers describe the tightest limit.
        let headline = outcome.headline().expect("limits");
        assert_eq!(&*headline.rule.id, "multi:remote_address");
    }
    let outcome = limiter.check(&user("a")).await;
    assert!(!outcome.allowed);
    let denial = outcome.headline().expect("denial");
    assert_eq!(&*denial.rule.id, "multi:remote_address");
    assert_eq!(denial.kind, DecisionKind::Limited);
    assert_eq!(denial.decision.remaining, 0);
    assert!(outcome.retry_after().is_some_and(|d| d > Duration::ZERO));
    let stats = limiter.stats();
    assert_eq!((stats.allowed, stats.limited), (5, 1));
}

#[tokio::test]
async fn shadow_rules_never_deny_but_count_would_be_denials() {
    let limiter = limiter(
        r#"
domain: shadow
descriptors:
  - key: user_id
    rate_limit: {unit: minute, requests_per_unit: 2}
    shadow_mode: true
"#,
        static_config(),
    );
    for i in 0..5 {
        let outcome = limiter.check(&user("s")).await;
        assert!(outcome.allowed, "request {i}");
        let limit = &outcome.limits[0];
        let expected = if i < 2 {
            DecisionKind::Allowed
        } else {
            DecisionKind::ShadowLimited
        };
        assert_eq!(limit.kind, expected, "request {i}");
        assert_eq!(outcome.retry_after(), None);
    }
    let stats = limiter.stats();
    assert_eq!(
        (stats.allowed, stats.shadow_limited, stats.limited),
        (2, 3, 0)
    );
}

#[tokio::test]
async fn global_shadow_mode_never_denies() {
    let config = LimiterConfig {
        global_shadow_mode: true,
        ..static_config()
    };
    let limiter = limiter(
        r#"
domain: global-shadow
descriptors:
  - key: user_id
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: remote_address
    value: 192.0.2.1
    rate_limit: {unit: minute, requests_per_unit: 0}
"#,
        config,
    );
    for _ in 0..4 {
        assert!(limiter.check(&user("g")).await.allowed);
    }
    let stats = limiter.stats();
    // user_id: 1 allowed + 3 shadow; the blocked address: 4 shadow.
    assert_eq!(
        (stats.allowed, stats.shadow_limited, stats.limited),
        (1, 7, 0)
    );
}

#[tokio::test]
async fn blocked_and_unlimited_rules_need_no_counter() {
    let limiter = limiter(
        r#"
domain: special
descriptors:
  - key: remote_address
    value: 198.51.100.7
    rate_limit: {unit: hour, requests_per_unit: 0}
  - key: api_key
    value: internal-probe
    rate_limit: {unlimited: true}
"#,
        static_config(),
    );
    let blocked = limiter
        .check(&RateLimitRequest::new().with(DescriptorKey::RemoteAddress, "198.51.100.7"))
        .await;
    assert!(!blocked.allowed);
    assert_eq!(blocked.limits[0].source, DecisionSource::Rule);
    assert_eq!(blocked.retry_after(), Some(Duration::from_secs(3600)));
    let probe = RateLimitRequest::new().with(DescriptorKey::ApiKey, "internal-probe");
    for _ in 0..100 {
        let outcome = limiter.check(&probe).await;
        assert!(outcome.allowed);
        assert!(
            outcome.headline().is_none(),
            "no limit headers for unlimited"
        );
    }
    assert!(
        limiter
            .check(&RateLimitRequest::new().with(DescriptorKey::RemoteAddress, "203.0.113.1"))
            .await
            .limits
            .is_empty()
    );
}

#[tokio::test]
async fn a_blocked_rule_is_described_as_a_limit_of_zero_per_unit() {
    let limiter = limiter(
        r#"
domain: banned
descriptors:
  - key: remote_address
    value: 198.51.100.7
    rate_limit: {unit: hour, requests_per_unit: 0}
"#,
        static_config(),
    );
    let outcome = limiter
        .check(&RateLimitRequest::new().with(DescriptorKey::RemoteAddress, "198.51.100.7"))
        .await;
    assert!(!outcome.allowed);
    let headline = outcome.headline().expect("the blocking rule");
    // The response headers are built from the policy: without one a 429 carries no limit headers.
    let policy = headline.policy.expect("a policy for the limit headers");
    assert_eq!((policy.requests_per_unit, policy.unit), (0, Unit::Hour));
    assert_eq!(headline.decision.limit, 0);
    assert_eq!(headline.decision.remaining, 0);
    assert_eq!(headline.decision.reset, Duration::from_secs(3600));
    assert_eq!(outcome.retry_after(), Some(Duration::from_secs(3600)));
}

#[tokio::test]
async fn shadow_rules_over_their_limit_leave_the_headline_to_the_enforced_ones() {
    let limiter = limiter(
        r#"
domain: shadow-headline
descriptors:
  - key: user_id
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 1}
    shadow_mode: true
"#,
        static_config(),
    );
    for n in 1..=3u64 {
        let outcome = limiter.check(&user("h")).await;
        assert!(outcome.allowed, "request {n}");
        let headline = outcome.headline().expect("the enforced limit");
        assert_eq!(&*headline.rule.id, "shadow-headline:user_id", "request {n}");
        assert_eq!(headline.decision.remaining, 100 - n, "request {n}");
    }
    // Still counted as would-be denials.
    let stats = limiter.stats();
    assert_eq!(
        (stats.allowed, stats.shadow_limited, stats.limited),
        (4, 2, 0)
    );
}

#[tokio::test]
async fn global_shadow_mode_puts_no_limit_in_the_headline() {
    let config = LimiterConfig {
        global_shadow_mode: true,
        ..static_config()
    };
    let limiter = limiter(
        r#"
domain: global-shadow-headline
descriptors:
  - key: user_id
    rate_limit: {unit: minute, requests_per_unit: 1}
"#,
        config,
    );
    for n in 0..3 {
        let outcome = limiter.check(&user("gh")).await;
        assert!(outcome.allowed, "request {n}");
        assert!(outcome.headline().is_none(), "request {n}");
    }
    let stats = limiter.stats();
    assert_eq!((stats.allowed, stats.shadow_limited), (1, 2));
}

#[tokio::test]
async fn the_deny_cache_spares_redis_until_retry_after() {
    let backend = Arc::new(
        RedisBackend::connect(
            &RedisConfig::new(redis_url()).with_key_prefix(unique_prefix("deny-cache")),
        )
        .await
        .expect("redis"),
    );
    let rules = RuleSet::parse_fairlane(
        r#"
domain: deny
descriptors:
  - key: user_id
    rate_limit: {unit: second, requests_per_unit: 5, algorithm: token_bucket, burst: 1}
"#,
        "t",
    )
    .expect("rules");
    let limiter = Limiter::new(rules, backend, static_config());
    let first = limiter.check(&user("d")).await;
    assert!(first.allowed);
    assert_eq!(first.limits[0].source, DecisionSource::Backend);
    let denied = limiter.check(&user("d")).await;
    assert!(!denied.allowed);
    assert_eq!(denied.limits[0].source, DecisionSource::Backend);
    let retry_after = denied.retry_after().expect("denied");
    assert!(retry_after <= Duration::from_millis(200), "{retry_after:?}");
    let cached = limiter.check(&user("d")).await;
    assert!(!cached.allowed);
    assert_eq!(cached.limits[0].source, DecisionSource::DenyCache);
    assert!(cached.retry_after().expect("denied") <= retry_after);
    assert_eq!(limiter.stats().deny_cache_hits, 1);
    // Once retry_after has passed, Redis is asked again, and a token is there.
    tokio::time::sleep(retry_after).await;
    let again = limiter.check(&user("d")).await;
    assert_eq!(again.limits[0].source, DecisionSource::Backend);
    assert!(again.allowed);
}

fn write(path: &Path, text: &str) {
    // Write-then-rename, as deployment tools do, so a reader never sees half a file.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write rules");
    std::fs::rename(&tmp, path).expect("rename rules");
}

fn rules_with_limit(n: u64) -> String {
    format!(
        "domain: reload\ndescriptors:\n  - key: user_id\n    rate_limit: {{unit: minute, requests_per_unit: {n}}}\n"
    )
}

async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn allowed_count(limiter: &Limiter, id: &str, attempts: usize) -> usize {
    let mut allowed = 0;
    for _ in 0..attempts {
        if limiter.check(&user(id)).await.allowed {
            allowed += 1;
        }
    }
    allowed
}

#[tokio::test]
async fn rules_file_changes_apply_without_restart_and_broken_files_are_ignored() {
    let dir = temp_dir("reload");
    let path = dir.join("rules.yaml");
    write(&path, &rules_with_limit(2));
    let config = LimiterConfig {
        reload_interval: Some(Duration::from_millis(50)),
        ..LimiterConfig::default()
    };
    let limiter = Limiter::from_rules_file(&path, memory_backend(), config).expect("valid file");
    assert_eq!(allowed_count(&limiter, "r1", 5).await, 2);

    write(&path, &rules_with_limit(4));
    wait_until("the reload", || limiter.stats().reloads == 1).await;
    assert_eq!(allowed_count(&limiter, "r2", 6).await, 4);

    // A broken file is refused on reload; the old rules stay in force.
    write(
        &path,
        "domain: reload\ndescriptors:\n  - key: user_id\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n",
    );
    wait_until("the refusal", || limiter.stats().reload_failures == 1).await;
    assert_eq!(allowed_count(&limiter, "r3", 6).await, 4);
    // The same broken content is refused once, not at every poll.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(limiter.stats().reload_failures, 1);
    assert!(!limiter.reload_now().expect("unchanged"));

    // Fixing the file applies it.
    write(&path, &rules_with_limit(1));
    wait_until("the second reload", || limiter.stats().reloads == 2).await;
    assert_eq!(allowed_count(&limiter, "r4", 3).await, 1);
    std::fs::remove_dir_all(dir).expect("cleanup");
}

/// Publishes `text` as `rules.yaml` in `dir` the way the kubelet updates a ConfigMap volume:
/// the file is a link through `..data` to a timestamped folder; an update writes a new folder,
/// points a new `..data` link at it, renames that over the old link (atomic) and removes the
/// old folder. The file's own path never changes, and its link's mtime neither.
fn publish_like_a_config_map_volume(dir: &Path, version: u32, text: &str) {
    let folder = format!("..2024_01_01_00_00_{version:02}.000000000");
    std::fs::create_dir(dir.join(&folder)).expect("version folder");
    std::fs::write(dir.join(&folder).join("rules.yaml"), text).expect("write rules");
    let previous = std::fs::read_link(dir.join("..data")).ok();
    std::os::unix::fs::symlink(&folder, dir.join("..data_tmp")).expect("..data_tmp link");
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).expect("swap ..data");
    if let Some(previous) = previous {
        std::fs::remove_dir_all(dir.join(previous)).expect("remove the old version");
    }
    let file = dir.join("rules.yaml");
    if std::fs::symlink_metadata(&file).is_err() {
        std::os::unix::fs::symlink("..data/rules.yaml", &file).expect("rules.yaml link");
    }
}

#[tokio::test]
async fn rules_in_a_config_map_volume_reload_when_the_kubelet_swaps_its_data_link() {
    let dir = temp_dir("configmap");
    publish_like_a_config_map_volume(&dir, 1, &rules_with_limit(2));
    let config = LimiterConfig {
        reload_interval: Some(Duration::from_millis(50)),
        ..LimiterConfig::default()
    };
    let limiter = Limiter::from_rules_file(dir.join("rules.yaml"), memory_backend(), config)
        .expect("valid file");
    assert_eq!(allowed_count(&limiter, "c1", 5).await, 2);

    publish_like_a_config_map_volume(&dir, 2, &rules_with_limit(4));
    wait_until("the reload", || limiter.stats().reloads == 1).await;
    assert_eq!(allowed_count(&limiter, "c2", 6).await, 4);

    publish_like_a_config_map_volume(&dir, 3, &rules_with_limit(1));
    wait_until("the second reload", || limiter.stats().reloads == 2).await;
    assert_eq!(allowed_count(&limiter, "c3", 3).await, 1);
    assert_eq!(limiter.stats().reload_failures, 0);
    std::fs::remove_dir_all(dir).expect("cleanup");
}

#[tokio::test]
async fn reload_now_reports_what_it_did() {
    let dir = temp_dir("reload-now");
    let path = dir.join("rules.yaml");
    write(&path, &rules_with_limit(2));
    let limiter =
        Limiter::from_rules_file(&path, memory_backend(), static_config()).expect("valid file");
    assert!(!limiter.reload_now().expect("unchanged"));
    write(
        &path,
        "domain: reload\ndescriptors:\n  - key: user_id\n    rate_limit: {unit: minute}\n",
    );
    let err = limiter.reload_now().expect_err("broken").to_string();
    assert!(err.contains("rules.yaml"), "{err}");
    assert!(
        err.contains("descriptors[0].rate_limit: missing `requests_per_unit`"),
        "{err}"
    );
    assert_eq!(limiter.rules().rules().len(), 1);
    write(&path, &rules_with_limit(3));
    assert!(limiter.reload_now().expect("valid"));
    assert_eq!(allowed_count(&limiter, "n", 5).await, 3);
    std::fs::remove_dir_all(dir).expect("cleanup");
}

#[tokio::test]
async fn a_broken_file_is_refused_at_construction() {
    let dir = temp_dir("broken");
    let path = dir.join("rules.yaml");
    write(
        &path,
        "domain: x\ndescriptors:\n  - key: user_id\n    rate_limit: {unit: second, requests_per_unit: 5, burst: 9}\n",
    );
    let err = Limiter::from_file(&path, None, LimiterConfig::default())
        .expect_err("burst on a fixed window")
        .to_string();
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert!(err.contains("descriptors[0].rate_limit.burst"), "{err}");
    assert!(err.contains("line 4"), "{err}");
    let missing = Limiter::from_file(dir.join("nope.yaml"), None, LimiterConfig::default())
        .expect_err("no file")
        .to_string();
    assert!(missing.contains("cannot read rules file"), "{missing}");
    std::fs::remove_dir_all(dir).expect("cleanup");
}

#[tokio::test]
async fn the_shipped_rules_run_end_to_end_on_redis() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/ratelimit/rules.yaml");
    let config = LimiterConfig {
        redis_key_prefix: unique_prefix("shipped"),
        ..static_config()
    };
    let limiter = Limiter::from_file(&path, Some(&redis_url()), config).expect("limiter");
    let enqueue = RateLimitRequest::new()
        .with(DescriptorKey::UserId, "e2e")
        .with(DescriptorKey::Tier, "free")
        .with(DescriptorKey::Route, "/v1/analyses")
        .with(DescriptorKey::Method, "POST");
    // Free tier: leaky bucket, burst 2 on analyses.
    let mut allowed = 0;
    for _ in 0..5 {
        let outcome = limiter.check(&enqueue).await;
        assert!(
            outcome
                .limits
                .iter()
                .all(|l| l.source != DecisionSource::Fallback)
        );
        if outcome.allowed {
            allowed += 1;
        }
    }
    assert_eq!(allowed, 2);
}

/// A remote backend that denies every request for a minute, each answer held back until the
/// test lets one through; `entered` is told when a decision starts.
struct GatedDenier {
    gate: tokio::sync::Semaphore,
    entered: tokio::sync::Notify,
}

#[async_trait::async_trait]
impl Backend for GatedDenier {
    async fn decide(
        &self,
        _counter_key: &str,
        _policy: &ratelimit::Policy,
    ) -> Result<ratelimit::BackendDecision, ratelimit::BackendError> {
        self.entered.notify_one();
        self.gate.acquire().await.expect("open").forget();
        Ok(ratelimit::BackendDecision {
            verdict: ratelimit::Verdict {
                allowed: false,
                remaining: 0,
                reset_us: 60_000_000,
                retry_after_us: 60_000_000,
            },
            clock_us: 0,
        })
    }

    fn name(&self) -> &'static str {
        "gated"
    }
}

/// A denial decided under the rules of before a reload, and answered after it, is not cached:
/// the new rules may allow what the old ones denied, and the cache is only ever a lower bound of
/// the rules in force.
#[tokio::test]
async fn a_denial_decided_under_the_old_rules_is_not_cached_after_a_reload() {
    let dir = temp_dir("deny-reload");
    let path = dir.join("rules.yaml");
    write(&path, &rules_with_limit(2));
    let backend = Arc::new(GatedDenier {
        gate: tokio::sync::Semaphore::new(0),
        entered: tokio::sync::Notify::new(),
    });
    let config = LimiterConfig {
        deadline: Duration::from_secs(30),
        ..static_config()
    };
    let limiter =
        Arc::new(Limiter::from_rules_file(&path, backend.clone(), config).expect("valid file"));
    let in_flight = tokio::spawn({
        let limiter = Arc::clone(&limiter);
        async move { limiter.check(&user("r")).await }
    });
    // The check is with the backend, under the old rules, before they change.
    backend.entered.notified().await;
    write(&path, &rules_with_limit(1000));
    assert!(limiter.reload_now().expect("valid"));
    backend.gate.add_permits(2);
    let old = in_flight.await.expect("check");
    assert_eq!(
        (old.allowed, old.limits[0].source),
        (false, DecisionSource::Backend)
    );
    let next = limiter.check(&user("r")).await;
    assert_eq!(
        next.limits[0].source,
        DecisionSource::Backend,
        "asked under the new rules, not answered from the old ones' denial"
    );
    assert_eq!(next.limits[0].decision.limit, 1000);
    std::fs::remove_dir_all(dir).expect("cleanup");
}

fn limit_in_force(limiter: &Limiter) -> u64 {
    match limiter.rules().rules()[0].limit {
        RuleLimit::Limited(policy) => policy.requests_per_unit,
        other => panic!("unexpected limit {other:?}"),
    }
}

/// Reloads racing each other while the file changes never put an older text in force after a
/// newer one: the limit seen in force only grows, and the newest text is in force at the end.
#[test]
fn concurrent_reloads_never_go_back_to_older_rules() {
    const VERSIONS: u64 = 400;
    let dir = temp_dir("reload-race");
    let path = dir.join("rules.yaml");
    write(&path, &rules_with_limit(1));
    let limiter =
        Limiter::from_rules_file(&path, memory_backend(), static_config()).expect("valid file");
    let writing = std::sync::atomic::AtomicBool::new(true);
    std::thread::scope(|scope| {
        for _ in 0..3 {
            scope.spawn(|| {
                while writing.load(std::sync::atomic::Ordering::Acquire) {
                    limiter.reload_now().expect("every version is valid");
                }
                limiter.reload_now().expect("every version is valid");
            });
        }
        let observer = scope.spawn(|| {
            let mut seen = vec![limit_in_force(&limiter)];
            while writing.load(std::sync::atomic::Ordering::Acquire) {
                let now = limit_in_force(&limiter);
                if Some(&now) != seen.last() {
                    seen.push(now);
                }
            }
            seen
        });
        for version in 2..=VERSIONS {
            write(&path, &rules_with_limit(version));
            std::thread::yield_now();
        }
        writing.store(false, std::sync::atomic::Ordering::Release);
        let seen = observer.join().expect("observer");
        assert!(
            seen.windows(2).all(|pair| pair[0] < pair[1]),
            "rules went back to an older version: {seen:?}"
        );
    });
    assert_eq!(limit_in_force(&limiter), VERSIONS);
    std::fs::remove_dir_all(dir).expect("cleanup");
}
