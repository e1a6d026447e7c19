//! The [`Limiter`]: rules + backend → a decision per request, with a deadline on the backend,
//! fail-open or in-memory fallback, a circuit breaker, a deny cache, shadow mode, hot reload of
//! the rules file and the `fairlane.ratelimit.decisions` counter.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use opentelemetry::KeyValue;
use opentelemetry::metrics::Counter;

use crate::backend::{
    Backend, BackendError, MemoryBackend, MemoryConfig, RedisBackend, RedisConfig,
};
use crate::circuit::{Admission, CircuitBreaker, Transition};
use crate::deny_cache::{DenyCache, DenyEntry};
use crate::policy::{MICROS_PER_SECOND, Policy};
use crate::request::RateLimitRequest;
use crate::rules::{MatchedRule, Rule, RuleLimit, RuleSet, RulesError};

/// What to do when the backend fails or misses the deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailureMode {
    /// Allow the request (decision `failed_open`).
    FailOpen,
    /// Decide with this process's in-memory limiter (limits become per replica meanwhile).
    #[default]
    FallbackToMemory,
}

/// Tuning of the [`Limiter`]. `Default` gives the production values.
#[derive(Debug, Clone)]
pub struct LimiterConfig {
    /// Longest wait for the backend before failing open / falling back (default 20 ms).
    pub deadline: Duration,
    /// What a backend failure turns into (default: in-memory fallback).
    pub on_backend_failure: FailureMode,
    /// Consecutive failures that open the circuit (default 3).
    pub circuit_failure_threshold: u32,
    /// How long an open circuit skips the backend before one probe (default 1 s).
    pub circuit_cooldown: Duration,
    /// Whether to deny locally the counters known to be over their limit (default on).
    pub deny_cache: bool,
    /// Size cap of the deny cache (default 100 000).
    pub deny_cache_max_entries: usize,
    /// Never deny; count would-be denials as `shadow_limited` (default off).
    pub global_shadow_mode: bool,
    /// How often the rules file is checked for changes; `None` disables reloading (default 2 s).
    pub reload_interval: Option<Duration>,
    /// Sizing of the in-memory backend (primary without Redis, else the fallback).
    pub memory: MemoryConfig,
    /// Redis key prefix used by [`Limiter::from_file`] (default `fairlane:rl:`).
    pub redis_key_prefix: String,
}

impl Default for LimiterConfig {
    fn default() -> Self {
        LimiterConfig {
            deadline: Duration::from_millis(20),
            on_backend_failure: FailureMode::FallbackToMemory,
            circuit_failure_threshold: 3,
            circuit_cooldown: Duration::from_secs(1),
            deny_cache: true,
            deny_cache_max_entries: 100_000,
            global_shadow_mode: false,
            reload_interval: Some(Duration::from_secs(2)),
            memory: MemoryConfig::default(),
            redis_key_prefix: "fairlane:rl:".to_owned(),
        }
    }
}

/// The limiter could not be built.
#[derive(Debug, thiserror::Error)]
pub enum LimiterError {
    #[error(transparent)]
    Rules(#[from] RulesError),
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// The kind of a decision, as counted in `fairlane_ratelimit_decisions_total{decision}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DecisionKind {
    Allowed,
    Limited,
    /// Over the limit, but the rule (or the limiter) is in shadow mode: allowed.
    ShadowLimited,
    /// The backend failed or was too slow and the limiter is configured to fail open.
    FailedOpen,
}

impl DecisionKind {
    /// The metric attribute value.
    pub const fn as_str(self) -> &'static str {
        match self {
            DecisionKind::Allowed => "allowed",
            DecisionKind::Limited => "limited",
            DecisionKind::ShadowLimited => "shadow_limited",
            DecisionKind::FailedOpen => "failed_open",
        }
    }
}

/// Who made a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecisionSource {
    /// The configured backend (Redis, or memory when there is no Redis).
    Backend,
    /// The in-memory fallback, because the backend failed or its circuit is open.
    Fallback,
    /// The local deny cache (the counter was known to be over its limit).
    DenyCache,
    /// The rule alone (`unlimited`, or `requests_per_unit: 0`): no counter involved.
    Rule,
    /// Nobody: the backend failed and the limiter failed open.
    None,
}

/// The numbers behind one limit's decision, as the response headers need them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Whether the algorithm let the request pass (false also for shadow-limited requests).
    pub allowed: bool,
    /// Requests per unit of the rule (`u64::MAX` for `unlimited`).
    pub limit: u64,
    /// Requests that would still pass now.
    pub remaining: u64,
    /// Time until the counter is fully reset.
    pub reset: Duration,
    /// When not allowed: earliest time a retry could pass (a lower bound).
    pub retry_after: Option<Duration>,
}

/// The decision for one matched rule.
#[derive(Debug, Clone)]
pub struct LimitOutcome {
    pub rule: Arc<Rule>,
    /// The limit enforced (`None` for `unlimited`; [`Policy::blocked`] for blocked rules).
    pub policy: Option<Policy>,
    pub kind: DecisionKind,
    /// Decided in shadow mode (the rule's or the limiter's): it never denies, and it is left out
    /// of [`RateLimitOutcome::headline`] so that it changes nothing a client sees.
    pub shadow: bool,
    pub source: DecisionSource,
    pub decision: Decision,
}

/// The decision for a request: denied if any enforced (non-shadow) limit denied it.
#[derive(Debug, Clone)]
pub struct RateLimitOutcome {
    pub allowed: bool,
    /// One entry per rule that applied (empty when no rule matched).
    pub limits: Vec<LimitOutcome>,
}

impl RateLimitOutcome {
    /// The limit the response headers should describe: when denied, the enforced denial with
    /// the longest `retry_after`; otherwise the enforced counted limit with the fewest requests
    /// left. Shadow-mode limits are never it, even when over their limit.
    pub fn headline(&self) -> Option<&LimitOutcome> {
        if self.allowed {
            self.limits
                .iter()
                .filter(|l| l.policy.is_some() && !l.shadow)
                .min_by_key(|l| (l.decision.remaining, l.decision.limit))
        } else {
            self.limits
                .iter()
                .filter(|l| l.kind == DecisionKind::Limited)
                .max_by_key(|l| l.decision.retry_after)
        }
    }

    /// When denied: how long the client should wait (the longest of the enforced denials).
    pub fn retry_after(&self) -> Option<Duration> {
        if self.allowed {
            return None;
        }
        self.headline().and_then(|l| l.decision.retry_after)
    }
}

/// Counts kept by the limiter (also exported as OpenTelemetry counters).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LimiterStats {
    pub allowed: u64,
    pub limited: u64,
    pub shadow_limited: u64,
    pub failed_open: u64,
    /// Decisions made by the in-memory fallback.
    pub fallback_decisions: u64,
    /// Backend calls that returned an error.
    pub backend_errors: u64,
    /// Backend calls that missed the deadline.
    pub backend_timeouts: u64,
    /// Decisions that did not call the backend because its circuit was open.
    pub circuit_open_skips: u64,
    /// Denials served from the deny cache.
    pub deny_cache_hits: u64,
    /// Successful rule reloads.
    pub reloads: u64,
    /// Rule files refused on reload (the old rules stayed).
    pub reload_failures: u64,
}

#[derive(Default)]
struct StatCounters {
    allowed: AtomicU64,
    limited: AtomicU64,
    shadow_limited: AtomicU64,
    failed_open: AtomicU64,
    fallback_decisions: AtomicU64,
    backend_errors: AtomicU64,
    backend_timeouts: AtomicU64,
    circuit_open_skips: AtomicU64,
    deny_cache_hits: AtomicU64,
    reloads: AtomicU64,
    reload_failures: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Why the backend gave no verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BackendFailure {
    Error,
    Timeout,
    CircuitOpen,
}

impl BackendFailure {
    const fn as_str(self) -> &'static str {
        match self {
            BackendFailure::Error => "error",
            BackendFailure::Timeout => "timeout",
            BackendFailure::CircuitOpen => "circuit_open",
        }
    }
}

struct Metrics {
    decisions: Counter<u64>,
    backend_failures: Counter<u64>,
}

struct RulesFile {
    path: PathBuf,
    /// The last content seen (applied or refused), to act once per change.
    last_text: Mutex<String>,
}

struct Inner {
    rules: RwLock<Arc<RuleSet>>,
    rules_file: Option<RulesFile>,
    backend: Arc<dyn Backend>,
    fallback: Arc<MemoryBackend>,
    breaker: CircuitBreaker,
    deny_cache: Option<DenyCache>,
    config: LimiterConfig,
    stats: StatCounters,
    metrics: Metrics,
}

/// Rate limiter front: cheap to clone, share it across the web service.
#[derive(Clone)]
pub struct Limiter {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("backend", &self.inner.backend.name())
            .field("domain", &self.rules().domain())
            .finish_non_exhaustive()
    }
}

impl Limiter {
    /// A limiter over fixed `rules` (no file, no reloading).
    pub fn new(rules: RuleSet, backend: Arc<dyn Backend>, config: LimiterConfig) -> Limiter {
        Self::build(rules, None, backend, config)
    }

    /// A limiter over the rules file at `path`, reloaded every `config.reload_interval` when
    /// called inside a Tokio runtime. A file that does not parse is refused here with a message
    /// naming the file, the YAML path, the line and the problem.
    pub fn from_rules_file(
        path: impl AsRef<Path>,
        backend: Arc<dyn Backend>,
        config: LimiterConfig,
    ) -> Result<Limiter, LimiterError> {
        let path = path.as_ref().to_path_buf();
        let text = std::fs::read_to_string(&path).map_err(|source| RulesError::Read {
            file: path.display().to_string(),
            source,
        })?;
        let rules = RuleSet::parse_fairlane(&text, &path.display().to_string())?;
        let file = RulesFile {
            path,
            last_text: Mutex::new(text),
        };
        let limiter = Self::build(rules, Some(file), backend, config);
        limiter.spawn_reloader();
        Ok(limiter)
    }

    /// The usual construction: rules from `rules_path`, counters in Redis at `redis_url` if
    /// given (connected lazily: Redis may be down at start), else in memory.
    pub fn from_file(
        rules_path: impl AsRef<Path>,
        redis_url: Option<&str>,
        config: LimiterConfig,
    ) -> Result<Limiter, LimiterError> {
        let backend: Arc<dyn Backend> = match redis_url {
            Some(url) => Arc::new(RedisBackend::new(
                &RedisConfig::new(url).with_key_prefix(config.redis_key_prefix.clone()),
            )?),
            None => Arc::new(MemoryBackend::with_system_clock(&config.memory)),
        };
        Self::from_rules_file(rules_path, backend, config)
    }

    fn build(
        rules: RuleSet,
        rules_file: Option<RulesFile>,
        backend: Arc<dyn Backend>,
        config: LimiterConfig,
    ) -> Limiter {
        let meter = opentelemetry::global::meter("fairlane");
        let metrics = Metrics {
            decisions: meter
                .u64_counter("fairlane.ratelimit.decisions")
                .with_description("Rate limit decisions by rule and outcome")
                .build(),
            backend_failures: meter
                .u64_counter("fairlane.ratelimit.backend_failures")
                .with_description("Rate limit backend calls that failed, timed out or were skipped")
                .build(),
        };
        Limiter {
            inner: Arc::new(Inner {
                rules: RwLock::new(Arc::new(rules)),
                rules_file,
                fallback: Arc::new(MemoryBackend::with_system_clock(&config.memory)),
                breaker: CircuitBreaker::new(
                    config.circuit_failure_threshold,
                    config.circuit_cooldown,
                ),
                deny_cache: (config.deny_cache && !backend.is_local())
                    .then(|| DenyCache::new(config.deny_cache_max_entries)),
                backend,
                config,
                stats: StatCounters::default(),
                metrics,
            }),
        }
    }

    fn spawn_reloader(&self) {
        let Some(interval) = self.inner.config.reload_interval else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("no Tokio runtime: rate limit rules will not be reloaded");
            return;
        };
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        runtime.spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            loop {
                ticker.tick().await;
                let Some(inner) = weak.upgrade() else { break };
                // Errors are logged and counted inside.
                let _ = inner.reload();
            }
        });
    }

    /// Re-read the rules file now. `Ok(true)`: new rules applied; `Ok(false)`: unchanged (or no
    /// file); `Err`: the new content was refused and the old rules stay (logged with
    /// `tracing::warn`, counted in `reload_failures`).
    pub fn reload_now(&self) -> Result<bool, RulesError> {
        self.inner.reload()
    }

    /// The rules in force.
    pub fn rules(&self) -> Arc<RuleSet> {
        self.inner.current_rules()
    }

    /// Counts so far.
    pub fn stats(&self) -> LimiterStats {
        let s = &self.inner.stats;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        LimiterStats {
            allowed: load(&s.allowed),
            limited: load(&s.limited),
            shadow_limited: load(&s.shadow_limited),
            failed_open: load(&s.failed_open),
            fallback_decisions: load(&s.fallback_decisions),
            backend_errors: load(&s.backend_errors),
            backend_timeouts: load(&s.backend_timeouts),
            circuit_open_skips: load(&s.circuit_open_skips),
            deny_cache_hits: load(&s.deny_cache_hits),
            reloads: load(&s.reloads),
            reload_failures: load(&s.reload_failures),
        }
    }

    /// Decide `request`: every rule that applies is checked (concurrently); the request is
    /// denied if any enforced limit denies it. Never fails: backend trouble turns into
    /// `failed_open` or a fallback decision within the deadline.
    pub async fn check(&self, request: &RateLimitRequest) -> RateLimitOutcome {
        // Before the rules: see `DenyCache::generation`.
        let generation = self
            .inner
            .deny_cache
            .as_ref()
            .map_or(0, DenyCache::generation);
        let rules = self.inner.current_rules();
        let matched = rules.match_request(request);
        let limits = match matched.len() {
            0 => Vec::new(),
            1 => {
                let mut matched = matched;
                let only = matched.pop().expect("length checked");
                vec![self.inner.decide_rule(only, generation).await]
            }
            _ => {
                futures_util::future::join_all(
                    matched
                        .into_iter()
                        .map(|m| self.inner.decide_rule(m, generation)),
                )
                .await
            }
        };
        let allowed = limits.iter().all(|l| l.kind != DecisionKind::Limited);
        RateLimitOutcome { allowed, limits }
    }
}

fn micros(us: u64) -> Duration {
    Duration::from_micros(us)
}

impl Inner {
    fn current_rules(&self) -> Arc<RuleSet> {
        Arc::clone(
            &self
                .rules
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    fn reload(&self) -> Result<bool, RulesError> {
        let Some(file) = &self.rules_file else {
            return Ok(false);
        };
        let name = file.path.display().to_string();
        // Locked from before the file is read until its rules are in force: two reloads at once
        // then read and apply one after the other. Otherwise one that read the older text could
        // put it in force after one that read the newer text, and keep it there.
        let mut last = file
            .last_text
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let text = match std::fs::read_to_string(&file.path) {
            Ok(text) => text,
            Err(source) => {
                bump(&self.stats.reload_failures);
                let err = RulesError::Read { file: name, source };
                tracing::warn!(error = %err, "rate limit rules not reloaded; keeping the old rules");
                return Err(err);
            }
        };
        if *last == text {
            return Ok(false);
        }
        let parsed = RuleSet::parse_fairlane(&text, &name);
        *last = text;
        match parsed {
            Ok(rules) => {
                let count = rules.rules().len();
                *self
                    .rules
                    .write()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(rules);
                if let Some(cache) = &self.deny_cache {
                    cache.clear();
                }
                bump(&self.stats.reloads);
                tracing::info!(file = %name, rules = count, "rate limit rules reloaded");
                Ok(true)
            }
            Err(err) => {
                bump(&self.stats.reload_failures);
                tracing::warn!(error = %err, "rate limit rules file refused; keeping the old rules");
                Err(err)
            }
        }
    }

    /// Decides one matched rule; `generation` is the deny cache's, read before the rules were.
    async fn decide_rule(&self, matched: MatchedRule, generation: u64) -> LimitOutcome {
        let MatchedRule { rule, counter_key } = matched;
        let shadow = self.config.global_shadow_mode || rule.shadow_mode;
        let outcome = match rule.limit {
            RuleLimit::Unlimited => LimitOutcome {
                policy: None,
                kind: DecisionKind::Allowed,
                shadow,
                source: DecisionSource::Rule,
                decision: Decision {
                    allowed: true,
                    limit: u64::MAX,
                    remaining: u64::MAX,
                    reset: Duration::ZERO,
                    retry_after: None,
                },
                rule,
            },
            RuleLimit::Blocked { unit } => LimitOutcome {
                policy: Some(Policy::blocked(unit)),
                kind: denied_kind(shadow),
                shadow,
                source: DecisionSource::Rule,
                decision: Decision {
                    allowed: false,
                    limit: 0,
                    remaining: 0,
                    reset: unit.duration(),
                    retry_after: Some(unit.duration()),
                },
                rule,
            },
            RuleLimit::Limited(policy) => {
                self.decide_limited(rule, &counter_key, policy, shadow, generation)
                    .await
            }
        };
        self.record(&outcome);
        outcome
    }

    async fn decide_limited(
        &self,
        rule: Arc<Rule>,
        counter_key: &str,
        policy: Policy,
        shadow: bool,
        generation: u64,
    ) -> LimitOutcome {
        if let Some(cache) = &self.deny_cache {
            let now = Instant::now();
            if let Some(entry) = cache.get(counter_key, now) {
                bump(&self.stats.deny_cache_hits);
                return LimitOutcome {
                    rule,
                    policy: Some(policy),
                    kind: denied_kind(shadow),
                    shadow,
                    source: DecisionSource::DenyCache,
                    decision: Decision {
                        allowed: false,
                        limit: entry.limit,
                        remaining: 0,
                        reset: entry.reset_at.saturating_duration_since(now),
                        retry_after: Some(entry.retry_at.saturating_duration_since(now)),
                    },
                };
            }
        }
        // Read only where the deny cache needs it: a clock read is a measurable share of a
        // local decision.
        let sent = self.deny_cache.as_ref().map(|_| Instant::now());
        let (verdict, source) = match self.call_backend(counter_key, &policy).await {
            Ok(verdict) => (verdict, DecisionSource::Backend),
            Err(failure) => {
                self.metrics.backend_failures.add(
                    1,
                    &[
                        KeyValue::new("reason", failure.as_str()),
                        KeyValue::new(
                            "action",
                            match self.config.on_backend_failure {
                                FailureMode::FailOpen => "fail_open",
                                FailureMode::FallbackToMemory => "fallback",
                            },
                        ),
                    ],
                );
                match self.config.on_backend_failure {
                    FailureMode::FailOpen => {
                        return LimitOutcome {
                            rule,
                            policy: Some(policy),
                            kind: DecisionKind::FailedOpen,
                            shadow,
                            source: DecisionSource::None,
                            decision: Decision {
                                allowed: true,
                                limit: policy.requests_per_unit,
                                remaining: policy.requests_per_unit,
                                reset: Duration::ZERO,
                                retry_after: None,
                            },
                        };
                    }
                    FailureMode::FallbackToMemory => {
                        bump(&self.stats.fallback_decisions);
                        let d = self.fallback.decide_now(counter_key, &policy);
                        (d.verdict, DecisionSource::Fallback)
                    }
                }
            }
        };
        if !verdict.allowed
            && source == DecisionSource::Backend
            && let Some(cache) = &self.deny_cache
            && let Some(sent) = sent
        {
            cache.insert(
                counter_key,
                DenyEntry {
                    retry_at: sent + micros(verdict.retry_after_us),
                    reset_at: sent + micros(verdict.reset_us),
                    limit: policy.requests_per_unit,
                },
                sent,
                generation,
            );
        }
        LimitOutcome {
            rule,
            policy: Some(policy),
            kind: if verdict.allowed {
                DecisionKind::Allowed
            } else {
                denied_kind(shadow)
            },
            shadow,
            source,
            decision: Decision {
                allowed: verdict.allowed,
                limit: policy.requests_per_unit,
                remaining: verdict.remaining,
                reset: micros(verdict.reset_us),
                retry_after: (!verdict.allowed).then(|| micros(verdict.retry_after_us)),
            },
        }
    }

    async fn call_backend(
        &self,
        counter_key: &str,
        policy: &Policy,
    ) -> Result<crate::algorithms::Verdict, BackendFailure> {
        if self.backend.is_local() {
            if let Some(decision) = self.backend.decide_in_process(counter_key, policy) {
                return Ok(decision.verdict);
            }
            return self
                .backend
                .decide(counter_key, policy)
                .await
                .map(|d| d.verdict)
                .map_err(|_| BackendFailure::Error);
        }
        let admission = self.breaker.admit();
        if admission == Admission::Skip {
            bump(&self.stats.circuit_open_skips);
            return Err(BackendFailure::CircuitOpen);
        }
        let result = tokio::time::timeout(
            self.config.deadline,
            self.backend.decide(counter_key, policy),
        )
        .await;
        let failure = match result {
            Ok(Ok(decision)) => {
                if self.breaker.record_success() == Transition::Closed {
                    tracing::info!(backend = self.backend.name(), "rate limit backend is back");
                }
                return Ok(decision.verdict);
            }
            Ok(Err(err)) => {
                bump(&self.stats.backend_errors);
                tracing::debug!(error = %err, probe = admission == Admission::Probe, "rate limit backend error");
                BackendFailure::Error
            }
            Err(_) => {
                bump(&self.stats.backend_timeouts);
                tracing::debug!(deadline = ?self.config.deadline, "rate limit backend missed the deadline");
                BackendFailure::Timeout
            }
        };
        if self.breaker.record_failure() == Transition::Opened {
            tracing::warn!(
                backend = self.backend.name(),
                reason = failure.as_str(),
                cooldown = ?self.config.circuit_cooldown,
                mode = ?self.config.on_backend_failure,
                "rate limit backend failing; not calling it until the cool-down is over"
            );
        }
        Err(failure)
    }

    fn record(&self, outcome: &LimitOutcome) {
        let counter = match outcome.kind {
            DecisionKind::Allowed => &self.stats.allowed,
            DecisionKind::Limited => &self.stats.limited,
            DecisionKind::ShadowLimited => &self.stats.shadow_limited,
            DecisionKind::FailedOpen => &self.stats.failed_open,
        };
        bump(counter);
        self.metrics.decisions.add(
            1,
            &[
                KeyValue::new("rule", Arc::clone(&outcome.rule.id)),
                KeyValue::new("decision", outcome.kind.as_str()),
            ],
        );
    }
}

fn denied_kind(shadow: bool) -> DecisionKind {
    if shadow {
        DecisionKind::ShadowLimited
    } else {
        DecisionKind::Limited
    }
}

/// Whole seconds, rounded up, for `Retry-After` / `X-RateLimit-Reset` style headers.
pub fn ceil_seconds(duration: Duration) -> u64 {
    let us = u64::try_from(duration.as_micros()).unwrap_or(u64::MAX);
    us.div_ceil(MICROS_PER_SECOND)
}
