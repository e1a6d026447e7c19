//! Subscription tiers (Free, Pro, Pro Plus, Enterprise) and how they are parsed.
//!
//! Two ways in, on purpose: [`Tier::resolve`] is lenient (anything unknown or missing is Free, as
//! seed ADR-16 routes unknown tiers to the default lane), [`Tier::from_str`] is strict for places
//! where a typo must be an error (an admin creating a user with tier `gold`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A subscription tier. The wire and database form is the snake_case name (`pro_plus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    Free,
    Pro,
    ProPlus,
    Enterprise,
}

/// A tier name that is not one of the four known tiers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown tier `{0}` (expected one of: free, pro, pro_plus, enterprise)")]
pub struct UnknownTier(pub String);

impl Tier {
    /// Every tier, cheapest first.
    pub const ALL: [Tier; 4] = [Tier::Free, Tier::Pro, Tier::ProPlus, Tier::Enterprise];

    /// The canonical name, as stored in the database and shown in the API.
    pub const fn as_str(self) -> &'static str {
        match self {
            Tier::Free => "free",
            Tier::Pro => "pro",
            Tier::ProPlus => "pro_plus",
            Tier::Enterprise => "enterprise",
        }
    }

    /// Lenient resolution: a missing or unknown tier is Free.
    pub fn resolve(name: Option<&str>) -> Tier {
        name.and_then(|n| n.parse().ok()).unwrap_or(Tier::Free)
    }

    /// Whether the tier is a paid one (routed to the priority lane).
    pub const fn is_paid(self) -> bool {
        !matches!(self, Tier::Free)
    }
}

impl FromStr for Tier {
    type Err = UnknownTier;

    /// Strict parse: accepts the canonical names case-insensitively, plus `pro-plus`/`proplus`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "free" => Ok(Tier::Free),
            "pro" => Ok(Tier::Pro),
            "pro_plus" | "pro-plus" | "proplus" => Ok(Tier::ProPlus),
            "enterprise" => Ok(Tier::Enterprise),
            _ => Err(UnknownTier(s.to_owned())),
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_and_parse_round_trip() {
        for tier in Tier::ALL {
            assert_eq!(tier.as_str().parse::<Tier>(), Ok(tier));
            assert_eq!(tier.to_string(), tier.as_str());
        }
    }

    #[test]
    fn strict_parse_accepts_spellings_and_rejects_unknown() {
        assert_eq!("PRO_PLUS".parse::<Tier>(), Ok(Tier::ProPlus));
        assert_eq!("pro-plus".parse::<Tier>(), Ok(Tier::ProPlus));
        assert_eq!(" Enterprise ".parse::<Tier>(), Ok(Tier::Enterprise));
        assert_eq!("gold".parse::<Tier>(), Err(UnknownTier("gold".into())));
        assert!("".parse::<Tier>().is_err());
    }

    #[test]
    fn lenient_resolution_defaults_to_free() {
        assert_eq!(Tier::resolve(None), Tier::Free);
        assert_eq!(Tier::resolve(Some("platinum")), Tier::Free);
        assert_eq!(Tier::resolve(Some("")), Tier::Free);
        assert_eq!(Tier::resolve(Some("pro")), Tier::Pro);
    }

    #[test]
    fn serde_uses_snake_case() {
        assert_eq!(
            serde_json::to_string(&Tier::ProPlus).unwrap(),
            "\"pro_plus\""
        );
        let t: Tier = serde_json::from_str("\"enterprise\"").unwrap();
        assert_eq!(t, Tier::Enterprise);
        assert!(serde_json::from_str::<Tier>("\"gold\"").is_err());
    }

    #[test]
    fn only_free_is_unpaid() {
        assert!(!Tier::Free.is_paid());
        assert!(Tier::Pro.is_paid() && Tier::ProPlus.is_paid() && Tier::Enterprise.is_paid());
    }
}
