//! Quota settings: limits per tier and event type, the cost of one request, the reservation TTL
//! and the billing period. Flat fields named after their environment variables
//! (`QUOTA_ANALYSIS_FREE_LIMIT` sets `quota_analysis_free_limit`), so a binary embeds this struct
//! with `#[serde(flatten)]` and `common::config::load` fills it from defaults, file and env.

use std::time::Duration;

use common::{Service, Tier};
use serde::{Deserialize, Serialize};

use crate::period::BillingCycle;

/// Everything the quota check needs to know. `Default` gives SPEC §5's values.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct QuotaConfig {
    pub quota_analysis_free_limit: u32,
    pub quota_analysis_pro_limit: u32,
    pub quota_analysis_pro_plus_limit: u32,
    pub quota_analysis_enterprise_limit: u32,
    pub quota_specview_free_limit: u32,
    pub quota_specview_pro_limit: u32,
    pub quota_specview_pro_plus_limit: u32,
    pub quota_specview_enterprise_limit: u32,
    /// Units one analysis request costs.
    pub quota_analysis_cost: u32,
    /// Units one specview request costs.
    pub quota_specview_cost: u32,
    /// How long a reservation that never got a job counts (and lives) before cleanup removes
    /// it. A reservation linked to a live job never expires.
    #[serde(with = "humantime_serde")]
    pub quota_reservation_ttl: Duration,
    /// The billing period usage is counted in (`month`, `week` or `day`, all UTC).
    pub quota_billing_period: BillingCycle,
}

impl Default for QuotaConfig {
    fn default() -> Self {
        QuotaConfig {
            quota_analysis_free_limit: 50,
            quota_analysis_pro_limit: 1000,
            quota_analysis_pro_plus_limit: 3000,
            quota_analysis_enterprise_limit: 5000,
            quota_specview_free_limit: 5,
            quota_specview_pro_limit: 100,
            quota_specview_pro_plus_limit: 300,
            quota_specview_enterprise_limit: 500,
            quota_analysis_cost: 1,
            quota_specview_cost: 1,
            quota_reservation_ttl: Duration::from_secs(3600),
            quota_billing_period: BillingCycle::Month,
        }
    }
}

/// A setting that makes no sense.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid quota configuration: {0}")]
pub struct InvalidQuotaConfig(pub String);

impl QuotaConfig {
    /// Units of `event_type` a user of `tier` may use per billing period.
    pub fn limit(&self, event_type: Service, tier: Tier) -> i64 {
        let units = match (event_type, tier) {
            (Service::Analysis, Tier::Free) => self.quota_analysis_free_limit,
            (Service::Analysis, Tier::Pro) => self.quota_analysis_pro_limit,
            (Service::Analysis, Tier::ProPlus) => self.quota_analysis_pro_plus_limit,
            (Service::Analysis, Tier::Enterprise) => self.quota_analysis_enterprise_limit,
            (Service::Specview, Tier::Free) => self.quota_specview_free_limit,
            (Service::Specview, Tier::Pro) => self.quota_specview_pro_limit,
            (Service::Specview, Tier::ProPlus) => self.quota_specview_pro_plus_limit,
            (Service::Specview, Tier::Enterprise) => self.quota_specview_enterprise_limit,
        };
        i64::from(units)
    }

    /// Units one request of `event_type` costs.
    pub fn cost(&self, event_type: Service) -> i64 {
        i64::from(match event_type {
            Service::Analysis => self.quota_analysis_cost,
            Service::Specview => self.quota_specview_cost,
        })
    }

    /// Checks relations the types cannot express.
    pub fn validate(&self) -> Result<(), InvalidQuotaConfig> {
        if self.quota_analysis_cost == 0 || self.quota_specview_cost == 0 {
            return Err(InvalidQuotaConfig(
                "QUOTA_ANALYSIS_COST and QUOTA_SPECVIEW_COST must be at least 1".into(),
            ));
        }
        // A reservation stores its amount in a PostgreSQL `integer`.
        if i32::try_from(self.quota_analysis_cost).is_err()
            || i32::try_from(self.quota_specview_cost).is_err()
        {
            return Err(InvalidQuotaConfig(format!(
                "QUOTA_ANALYSIS_COST and QUOTA_SPECVIEW_COST must be at most {}",
                i32::MAX
            )));
        }
        if self.quota_reservation_ttl.is_zero() {
            return Err(InvalidQuotaConfig(
                "QUOTA_RESERVATION_TTL must be longer than zero".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_spec_numbers() {
        let c = QuotaConfig::default();
        let analysis: Vec<i64> = Tier::ALL
            .iter()
            .map(|t| c.limit(Service::Analysis, *t))
            .collect();
        let specview: Vec<i64> = Tier::ALL
            .iter()
            .map(|t| c.limit(Service::Specview, *t))
            .collect();
        assert_eq!(analysis, [50, 1000, 3000, 5000]);
        assert_eq!(specview, [5, 100, 300, 500]);
        assert_eq!(c.cost(Service::Analysis), 1);
        assert_eq!(c.cost(Service::Specview), 1);
        assert_eq!(c.quota_reservation_ttl, Duration::from_secs(3600));
        assert_eq!(c.quota_billing_period, BillingCycle::Month);
        c.validate().unwrap();
    }

    #[test]
    fn env_names_are_flat() {
        let c: QuotaConfig = common::config::load_from(
            None,
            [
                ("QUOTA_ANALYSIS_FREE_LIMIT", "7"),
                ("QUOTA_SPECVIEW_ENTERPRISE_LIMIT", "9"),
                ("QUOTA_ANALYSIS_COST", "3"),
                ("QUOTA_RESERVATION_TTL", "15m"),
                ("QUOTA_BILLING_PERIOD", "day"),
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned())),
        )
        .unwrap();
        assert_eq!(c.limit(Service::Analysis, Tier::Free), 7);
        assert_eq!(c.limit(Service::Specview, Tier::Enterprise), 9);
        assert_eq!(c.cost(Service::Analysis), 3);
        assert_eq!(c.quota_reservation_ttl, Duration::from_secs(900));
        assert_eq!(c.quota_billing_period, BillingCycle::Day);
    }

    #[test]
    fn zero_cost_is_refused() {
        let c = QuotaConfig {
            quota_specview_cost: 0,
            ..QuotaConfig::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("COST"));
    }

    #[test]
    fn a_cost_a_reservation_cannot_hold_is_refused() {
        let c = QuotaConfig {
            quota_analysis_cost: u32::try_from(i32::MAX).unwrap() + 1,
            ..QuotaConfig::default()
        };
        let message = c.validate().unwrap_err().to_string();
        assert!(message.contains("at most 2147483647"), "{message}");
        let c = QuotaConfig {
            quota_analysis_cost: u32::try_from(i32::MAX).unwrap(),
            ..QuotaConfig::default()
        };
        assert!(c.validate().is_ok());
    }
}
