//! A short-lived cache of users' tiers, so a fetch does not read the `users` table for users it
//! saw a moment ago. Entries expire after the configured TTL (at most 60 s), which bounds how long
//! a tier change takes to apply.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use common::Tier;
use sqlx::PgConnection;
use tokio::time::Instant;
use uuid::Uuid;

use crate::FairnessError;
use crate::store;

#[derive(Debug)]
pub struct TierCache {
    ttl: Duration,
    entries: Mutex<HashMap<Uuid, (Tier, Instant)>>,
}

impl TierCache {
    pub fn new(ttl: Duration) -> Self {
        TierCache {
            ttl,
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// Tiers of `users`; unknown users are Free (seed ADR-10's default).
    pub async fn tiers(
        &self,
        conn: &mut PgConnection,
        users: impl IntoIterator<Item = Uuid>,
    ) -> Result<HashMap<Uuid, Tier>, FairnessError> {
        let now = Instant::now();
        let mut found = HashMap::new();
        let mut missing = Vec::new();
        {
            let entries = self
                .entries
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for user in users {
                match entries.get(&user) {
                    Some((tier, at)) if now.duration_since(*at) < self.ttl => {
                        found.insert(user, *tier);
                    }
                    _ => missing.push(user),
                }
            }
        }
        if missing.is_empty() {
            return Ok(found);
        }
        let fetched = store::tiers(conn, &missing).await?;
        let mut entries = self
            .entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if entries.len() > 100_000 {
            entries.retain(|_, (_, at)| now.duration_since(*at) < self.ttl);
        }
        for user in missing {
            let tier = fetched.get(&user).copied().unwrap_or(Tier::Free);
            entries.insert(user, (tier, now));
            found.insert(user, tier);
        }
        Ok(found)
    }
}
