//! Services, lanes and the routing rule of seed ADR-16: `{service}_{lane}`, where paid tiers go to
//! `priority`, Free (and anything unknown) to `default`, and the scheduler's work to `scheduled`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::queue_name::QueueName;
use crate::tier::Tier;

/// A kind of work, served by one worker service (`analysis` by `analyzer-worker`, `specview` by
/// `specgen-worker`). Also the quota event type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Service {
    Analysis,
    Specview,
}

/// One of the three lanes every service has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Lane {
    /// Pro, Pro Plus and Enterprise requests.
    Priority,
    /// Free (and unknown-tier) requests.
    Default,
    /// Background work enqueued by the scheduler.
    Scheduled,
}

impl Service {
    pub const ALL: [Service; 2] = [Service::Analysis, Service::Specview];

    /// The base of the queue names and the quota event type.
    pub const fn as_str(self) -> &'static str {
        match self {
            Service::Analysis => "analysis",
            Service::Specview => "specview",
        }
    }

    /// The service's queue in `lane`.
    pub fn queue(self, lane: Lane) -> QueueName {
        // Both halves come from fixed ASCII alphabets, so the name is always valid.
        QueueName::new(format!("{}_{}", self.as_str(), lane.as_str()))
            .unwrap_or_else(|e| unreachable!("built-in queue name is invalid: {e}"))
    }

    /// All three queues of the service, in lane order (priority, default, scheduled).
    pub fn queues(self) -> [QueueName; 3] {
        Lane::ALL.map(|lane| self.queue(lane))
    }
}

impl Lane {
    pub const ALL: [Lane; 3] = [Lane::Priority, Lane::Default, Lane::Scheduled];

    pub const fn as_str(self) -> &'static str {
        match self {
            Lane::Priority => "priority",
            Lane::Default => "default",
            Lane::Scheduled => "scheduled",
        }
    }

    /// The lane a user request of `tier` goes to.
    pub const fn for_tier(tier: Tier) -> Lane {
        if tier.is_paid() {
            Lane::Priority
        } else {
            Lane::Default
        }
    }
}

/// Seed ADR-16's `SelectQueue`: scheduled work goes to `_scheduled`; otherwise paid tiers to
/// `_priority` and Free to `_default`. (Unknown tiers are Free by the time they are a [`Tier`].)
pub fn select_queue(service: Service, tier: Tier, is_scheduled: bool) -> QueueName {
    let lane = if is_scheduled {
        Lane::Scheduled
    } else {
        Lane::for_tier(tier)
    };
    service.queue(lane)
}

impl fmt::Display for Service {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A service name that is not `analysis` or `specview`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown service `{0}` (expected analysis or specview)")]
pub struct UnknownService(pub String);

impl FromStr for Service {
    type Err = UnknownService;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "analysis" => Ok(Service::Analysis),
            "specview" => Ok(Service::Specview),
            _ => Err(UnknownService(s.to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_names_match_adr16() {
        assert_eq!(
            Service::Analysis.queues().map(|q| q.to_string()),
            [
                "analysis_priority",
                "analysis_default",
                "analysis_scheduled"
            ]
        );
        assert_eq!(
            Service::Specview.queues().map(|q| q.to_string()),
            [
                "specview_priority",
                "specview_default",
                "specview_scheduled"
            ]
        );
    }

    #[test]
    fn select_queue_routes_every_tier() {
        let cases = [
            (Tier::Free, "analysis_default"),
            (Tier::Pro, "analysis_priority"),
            (Tier::ProPlus, "analysis_priority"),
            (Tier::Enterprise, "analysis_priority"),
        ];
        for (tier, want) in cases {
            assert_eq!(select_queue(Service::Analysis, tier, false).as_str(), want);
        }
        let unknown = Tier::resolve(Some("gold"));
        assert_eq!(
            select_queue(Service::Specview, unknown, false).as_str(),
            "specview_default"
        );
    }

    #[test]
    fn scheduled_wins_over_tier() {
        for tier in Tier::ALL {
            assert_eq!(
                select_queue(Service::Analysis, tier, true).as_str(),
                "analysis_scheduled"
            );
        }
    }

    #[test]
    fn service_parses_its_own_name() {
        for s in Service::ALL {
            assert_eq!(s.as_str().parse::<Service>(), Ok(s));
        }
        assert!("analyses".parse::<Service>().is_err());
    }
}
