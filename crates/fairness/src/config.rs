//! Fairness settings, named after their environment variables (SPEC §4).

use std::time::Duration;

use common::Tier;
use serde::{Deserialize, Serialize};

/// The longest `FAIRNESS_SNOOZE_DURATION` and `FAIRNESS_SNOOZE_JITTER` accepted: a snooze only
/// waits for one of the user's running jobs to end, and slots are re-checked at every wake-up.
pub const MAX_SNOOZE: Duration = Duration::from_secs(3600);

/// Per-tier limits and the snooze used when a job arrives over its user's limit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FairnessConfig {
    /// `FAIRNESS_ENABLED`: false removes every limit.
    pub fairness_enabled: bool,
    pub fairness_free_limit: u32,
    pub fairness_pro_limit: u32,
    pub fairness_pro_plus_limit: u32,
    pub fairness_enterprise_limit: u32,
    /// Base snooze for an over-limit job that reached a worker without the gate.
    #[serde(with = "humantime_serde")]
    pub fairness_snooze_duration: Duration,
    /// Up to this much random delay is added to each snooze, so snoozed jobs do not wake together.
    #[serde(with = "humantime_serde")]
    pub fairness_snooze_jitter: Duration,
    /// How long a user's tier is cached (a tier change applies within this time; at most 60 s).
    #[serde(with = "humantime_serde")]
    pub fairness_tier_cache_ttl: Duration,
    /// `FAIRNESS_FETCH_GATE`: admit jobs at fetch time (the default). When false, jobs are fetched
    /// freely and the middleware snoozes over-limit ones, as in ADR-10 (but counted fleet-wide).
    pub fairness_fetch_gate: bool,
}

impl Default for FairnessConfig {
    fn default() -> Self {
        FairnessConfig {
            fairness_enabled: true,
            fairness_free_limit: 1,
            fairness_pro_limit: 3,
            fairness_pro_plus_limit: 3,
            fairness_enterprise_limit: 5,
            fairness_snooze_duration: Duration::from_secs(30),
            fairness_snooze_jitter: Duration::from_secs(10),
            fairness_tier_cache_ttl: Duration::from_secs(30),
            fairness_fetch_gate: true,
        }
    }
}

impl FairnessConfig {
    /// The concurrent-job limit of `tier`.
    pub fn limit(&self, tier: Tier) -> u32 {
        match tier {
            Tier::Free => self.fairness_free_limit,
            Tier::Pro => self.fairness_pro_limit,
            Tier::ProPlus => self.fairness_pro_plus_limit,
            Tier::Enterprise => self.fairness_enterprise_limit,
        }
    }

    /// Refuses settings that would stall users forever or break the tier-change promise.
    pub fn validate(&self) -> Result<(), String> {
        for tier in Tier::ALL {
            if self.limit(tier) == 0 {
                return Err(format!(
                    "FAIRNESS_{}_LIMIT must be at least 1 (0 would never run that tier's jobs)",
                    tier.as_str().to_ascii_uppercase()
                ));
            }
        }
        if self.fairness_tier_cache_ttl > Duration::from_secs(60) {
            return Err(
                "FAIRNESS_TIER_CACHE_TTL must be at most 60s (tier changes apply within a minute)"
                    .into(),
            );
        }
        if self.fairness_snooze_duration.is_zero() {
            return Err("FAIRNESS_SNOOZE_DURATION must be greater than zero".into());
        }
        for (name, d) in [
            ("FAIRNESS_SNOOZE_DURATION", self.fairness_snooze_duration),
            ("FAIRNESS_SNOOZE_JITTER", self.fairness_snooze_jitter),
        ] {
            if d > MAX_SNOOZE {
                return Err(format!(
                    "{name} must be at most 1h (a snooze only waits for a slot of the user's to free), got {d:?}"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_adr10() {
        let c = FairnessConfig::default();
        assert_eq!(
            Tier::ALL.map(|t| c.limit(t)),
            [1, 3, 3, 5],
            "free, pro, pro plus, enterprise"
        );
        assert_eq!(c.fairness_snooze_duration, Duration::from_secs(30));
        assert_eq!(c.fairness_snooze_jitter, Duration::from_secs(10));
        c.validate().unwrap();
    }

    #[test]
    fn zero_limits_and_slow_tier_changes_are_refused() {
        let c = FairnessConfig {
            fairness_pro_limit: 0,
            ..FairnessConfig::default()
        };
        assert!(c.validate().unwrap_err().contains("FAIRNESS_PRO_LIMIT"));
        let c = FairnessConfig {
            fairness_tier_cache_ttl: Duration::from_secs(120),
            ..FairnessConfig::default()
        };
        assert!(c.validate().unwrap_err().contains("60s"));
    }

    #[test]
    fn snoozes_longer_than_an_hour_are_refused_by_name() {
        let huge = Duration::from_secs(u64::MAX);
        let c = FairnessConfig {
            fairness_snooze_duration: huge,
            ..FairnessConfig::default()
        };
        assert!(
            c.validate()
                .unwrap_err()
                .starts_with("FAIRNESS_SNOOZE_DURATION must be at most 1h"),
        );
        let c = FairnessConfig {
            fairness_snooze_jitter: MAX_SNOOZE + Duration::from_secs(1),
            ..FairnessConfig::default()
        };
        assert!(
            c.validate()
                .unwrap_err()
                .starts_with("FAIRNESS_SNOOZE_JITTER must be at most 1h"),
        );
        let c = FairnessConfig {
            fairness_snooze_duration: MAX_SNOOZE,
            fairness_snooze_jitter: MAX_SNOOZE,
            ..FairnessConfig::default()
        };
        c.validate().unwrap();
    }
}
