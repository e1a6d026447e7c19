//! Admin operations (users, tiers, API keys), shared by the admin HTTP endpoints and the
//! `web admin …` subcommands.

use chrono::{DateTime, Utc};
use common::Tier;
use serde::Serialize;
use sqlx::PgPool;
use utoipa::ToSchema;
use uuid::Uuid;

use crate::keys;

/// A subscription tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TierName {
    Free,
    Pro,
    ProPlus,
    Enterprise,
}

/// A user.
#[derive(Debug, Clone, Serialize, ToSchema, sqlx::FromRow)]
pub struct UserView {
    pub id: Uuid,
    pub name: String,
    /// `free`, `pro`, `pro_plus` or `enterprise`.
    pub tier: String,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// A newly issued API key. `key` is shown this once and never again.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct IssuedKeyView {
    /// The key's public id (for revocation and logs).
    pub key_id: String,
    /// The secret key, for `Authorization: Bearer <key>`.
    pub key: String,
    pub user_id: Uuid,
    pub created_at: DateTime<Utc>,
}

/// A revoked API key.
#[derive(Debug, Clone, Serialize, ToSchema, sqlx::FromRow)]
pub struct RevokedKeyView {
    pub key_id: String,
    pub user_id: Uuid,
    pub revoked_at: DateTime<Utc>,
}

/// Why an admin operation was refused.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    NotFound(String),
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Randomness(#[from] keys::RandomnessError),
}

/// Strict tier parsing for admins: a typo is an error, not a silent Free.
pub fn parse_tier(tier: &str) -> Result<Tier, AdminError> {
    tier.parse::<Tier>()
        .map_err(|e| AdminError::Invalid(format!("tier: {e}")))
}

/// A display name as stored: trimmed, 1 to 200 characters, no NUL (PostgreSQL's `text` cannot
/// hold U+0000, and would refuse the insert).
fn check_name(name: &str) -> Result<&str, AdminError> {
    if name.contains('\0') {
        return Err(AdminError::Invalid(
            "name: must not contain NUL characters (U+0000)".into(),
        ));
    }
    let name = name.trim();
    let len = name.chars().count();
    if !(1..=200).contains(&len) {
        return Err(AdminError::Invalid(format!(
            "name: must be 1 to 200 characters after trimming, got {len}"
        )));
    }
    Ok(name)
}

const USER_COLUMNS: &str = "id, name, tier::text AS tier, created_at, updated_at";

pub async fn create_user(pool: &PgPool, name: &str, tier: Tier) -> Result<UserView, AdminError> {
    let name = check_name(name)?;
    let user = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO users (name, tier) VALUES ($1, $2::text::fairlane_tier) RETURNING {USER_COLUMNS}"
    )))
    .bind(name)
    .bind(tier.as_str())
    .fetch_one(pool)
    .await?;
    Ok(user)
}

pub async fn set_tier(pool: &PgPool, user_id: Uuid, tier: Tier) -> Result<UserView, AdminError> {
    let user: Option<UserView> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "UPDATE users SET tier = $2::text::fairlane_tier, updated_at = now() WHERE id = $1 \
         RETURNING {USER_COLUMNS}"
    )))
    .bind(user_id)
    .bind(tier.as_str())
    .fetch_optional(pool)
    .await?;
    user.ok_or_else(|| AdminError::NotFound(format!("no user `{user_id}`")))
}

pub async fn issue_key(pool: &PgPool, user_id: Uuid) -> Result<IssuedKeyView, AdminError> {
    let issued = keys::generate()?;
    let row: Option<(DateTime<Utc>,)> = sqlx::query_as(
        "INSERT INTO api_keys (id, user_id, key_hash) \
         SELECT $1, id, $3 FROM users WHERE id = $2 RETURNING created_at",
    )
    .bind(&issued.id)
    .bind(user_id)
    .bind(issued.hash.as_slice())
    .fetch_optional(pool)
    .await?;
    let Some((created_at,)) = row else {
        return Err(AdminError::NotFound(format!("no user `{user_id}`")));
    };
    Ok(IssuedKeyView {
        key_id: issued.id,
        key: issued.key,
        user_id,
        created_at,
    })
}

/// Revokes a key (idempotent: revoking a revoked key reports the first revocation). An id not of
/// the form [`keys::is_id`] names no key and is not looked up (it could hold a NUL, which
/// PostgreSQL would refuse).
pub async fn revoke_key(pool: &PgPool, key_id: &str) -> Result<RevokedKeyView, AdminError> {
    // A whole key (id and secret), even with quotes, a `Bearer ` prefix or spaces around it, is
    // refused with what to pass instead, and never echoed: "no API key" would read as if the
    // leaked key were harmless while it stays in force.
    if let Some(id) = keys::find_key_id(key_id) {
        return Err(AdminError::Invalid(format!(
            "that is a whole API key, secret included; pass its id `{id}` to revoke it"
        )));
    }
    // Only what could be an id is repeated back: a longer text may hold part of a secret.
    let not_found = || {
        let length = key_id.chars().count();
        if length <= keys::ID_LEN {
            AdminError::NotFound(format!("no API key `{}`", key_id.escape_debug()))
        } else {
            AdminError::NotFound(format!(
                "no API key: a key id is {} hexadecimal characters, this is {length} long",
                keys::ID_LEN
            ))
        }
    };
    if !keys::is_id(key_id) {
        return Err(not_found());
    }
    let row: Option<RevokedKeyView> = sqlx::query_as(
        "UPDATE api_keys SET revoked_at = COALESCE(revoked_at, now()) WHERE id = $1 \
         RETURNING id AS key_id, user_id, revoked_at",
    )
    .bind(key_id)
    .fetch_optional(pool)
    .await?;
    row.ok_or_else(not_found)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The functions the HTTP endpoints and the `web admin` subcommands share refuse a NUL
    /// before PostgreSQL sees it (it would refuse the statement: a database error, a 500).
    #[tokio::test]
    async fn nul_characters_are_refused_before_the_database() {
        let db = testkit::TestDb::new().await;
        for name in ["a\0b", "\0", " Ada\0 "] {
            let e = create_user(&db.pool, name, Tier::Free).await.unwrap_err();
            assert!(
                matches!(&e, AdminError::Invalid(m) if m.contains("NUL")),
                "{name:?}: {e:?}"
            );
        }
        let user = create_user(&db.pool, "Ada", Tier::Free).await.unwrap();
        let issued = issue_key(&db.pool, user.id).await.unwrap();
        for key_id in ["\0", "0123456789abcde\0", &format!("{}\0", issued.key_id)] {
            let e = revoke_key(&db.pool, key_id).await.unwrap_err();
            // Repeated back (escaped) only when no longer than an id.
            let shown = key_id.chars().count() <= keys::ID_LEN;
            assert!(
                matches!(&e, AdminError::NotFound(m) if m.contains("\\0") == shown),
                "{e:?}"
            );
        }
        assert!(parse_tier("free\0").is_err());
        let (users, revoked): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM users), \
                    (SELECT count(*) FROM api_keys WHERE revoked_at IS NOT NULL)",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!((users, revoked), (1, 0));
        revoke_key(&db.pool, &issued.key_id).await.unwrap();
    }

    /// An operator who pastes the whole leaked key is told to pass its id, and the secret is
    /// not repeated back.
    #[tokio::test]
    async fn revoking_by_the_whole_key_names_the_id_to_pass() {
        let db = testkit::TestDb::new().await;
        let user = create_user(&db.pool, "Ada", Tier::Free).await.unwrap();
        let issued = issue_key(&db.pool, user.id).await.unwrap();
        // The key's end (base64url: it may hold `_` too).
        let secret = issued.key[issued.key.len() - keys::SECRET_LEN..].to_owned();
        for pasted in [
            issued.key.clone(),
            format!("\"{}\"", issued.key),
            format!("{} ", issued.key),
            format!("Bearer {}", issued.key),
        ] {
            let e = revoke_key(&db.pool, &pasted).await.unwrap_err();
            let AdminError::Invalid(message) = &e else {
                panic!("{pasted}: {e:?}");
            };
            assert!(
                message.contains(&format!("`{}`", issued.key_id)),
                "{message}"
            );
            assert!(
                !message.contains(&secret),
                "the secret is echoed: {message}"
            );
        }
        // Part of a key (a truncated paste) is not repeated back either.
        let truncated = &issued.key[..issued.key.len() - 5];
        let e = revoke_key(&db.pool, truncated).await.unwrap_err();
        let AdminError::NotFound(message) = &e else {
            panic!("{e:?}");
        };
        assert!(!message.contains(&secret[..20]), "echoed: {message}");
        // An id-sized typo is, to be recognised.
        let e = revoke_key(&db.pool, "0123456789abcdeg").await.unwrap_err();
        assert!(e.to_string().contains("`0123456789abcdeg`"), "{e}");
        let (revoked,): (i64,) =
            sqlx::query_as("SELECT count(*) FROM api_keys WHERE revoked_at IS NOT NULL")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert_eq!(revoked, 0, "nothing was revoked by a refused request");
    }
}
