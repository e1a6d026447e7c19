//! Who is calling: the `Authorization: Bearer <api key>` of user routes and the admin token.
//!
//! [`authenticate`] runs before rate limiting on every `/v1` route and records an [`Identity`]
//! (so the limiter can describe the caller, and anonymous or bad-key traffic is limited per IP);
//! handlers then demand an [`AuthUser`], which turns anything but a valid key into a 401.

use std::collections::HashMap;

use axum::extract::{FromRequestParts, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use common::Tier;
use http::HeaderMap;
use http::request::Parts;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::batch::{BatchRun, Pending};
use crate::keys;
use crate::problem::Problem;
use crate::state::AppState;

/// An authenticated user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthUser {
    pub user_id: Uuid,
    /// Tier as stored (unknown names resolve to Free).
    pub tier: Tier,
    /// The public id of the key used.
    pub key_id: String,
}

/// What [`authenticate`] found out about a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    User(AuthUser),
    /// No `Authorization` header.
    Anonymous,
    /// Credentials were presented but are not valid; the reason is told to the client.
    Invalid(&'static str),
}

/// The bearer token of `headers`: `None` without an `Authorization` header, `Err` when it is
/// not `Bearer <token>` or is given more than once (one proxy or log reading the first and this
/// server another would disagree on who sent the request).
pub fn bearer(headers: &HeaderMap) -> Option<Result<&str, &'static str>> {
    let mut values = headers.get_all(http::header::AUTHORIZATION).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return Some(Err("the request has more than one Authorization header"));
    }
    let Ok(text) = value.to_str() else {
        return Some(Err("the Authorization header is not valid ASCII"));
    };
    let mut parts = text.trim().splitn(2, ' ');
    let scheme = parts.next().unwrap_or_default();
    let token = parts.next().unwrap_or_default().trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() {
        return Some(Err("the Authorization header must be `Bearer <api key>`"));
    }
    Some(Ok(token))
}

async fn identify(state: &AppState, headers: &HeaderMap) -> Result<Identity, Problem> {
    let token = match bearer(headers) {
        None => return Ok(Identity::Anonymous),
        Some(Err(reason)) => return Ok(Identity::Invalid(reason)),
        Some(Ok(token)) => token,
    };
    let Some(key_id) = keys::parse_id(token) else {
        return Ok(Identity::Invalid("the API key is malformed"));
    };
    let row = state
        .key_lookup
        .submit(key_id.to_owned())
        .await
        .map_err(|e| Problem::internal(&e))??;
    let Some((user_id, hash, revoked, tier)) = row else {
        return Ok(Identity::Invalid("the API key is not known"));
    };
    if !keys::matches(token, &hash) {
        return Ok(Identity::Invalid("the API key is not known"));
    }
    if revoked {
        return Ok(Identity::Invalid("the API key has been revoked"));
    }
    Ok(Identity::User(AuthUser {
        user_id,
        tier: Tier::resolve(Some(&tier)),
        key_id: key_id.to_owned(),
    }))
}

/// A stored API key: (user, SHA-256 of the key, revoked, the user's tier).
pub type StoredKey = (Uuid, Vec<u8>, bool, String);

/// A looked-up row: the key id, then the [`StoredKey`] fields.
type KeyRow = (String, Uuid, Vec<u8>, bool, String);

/// Looks up the API keys of concurrent requests in one statement per batch (see
/// [`crate::batch`]); every lookup still reads the database after its request arrived, so a
/// revocation is in force for every request that starts after it committed.
pub struct KeyLookup {
    /// The connections look-ups run on, held between batches.
    pub connections: crate::held::HeldConnections,
}

impl BatchRun for KeyLookup {
    type Item = String;
    type Output = Result<Option<StoredKey>, Problem>;

    fn shard_key(key_id: &String) -> u64 {
        key_id
            .bytes()
            .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)))
    }

    async fn run(&self, batch: Vec<Pending<Self>>) {
        // A key sent by several requests of the batch is looked up once.
        let mut ids: Vec<&str> = batch.iter().map(|p| p.item.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        let rows = self.look_up(&ids).await;
        match rows {
            Ok(rows) => {
                let found: HashMap<String, StoredKey> = rows
                    .into_iter()
                    .map(|(id, user, hash, revoked, tier)| (id, (user, hash, revoked, tier)))
                    .collect();
                for pending in batch {
                    let key = found.get(&pending.item).cloned();
                    pending.answer(Ok(key));
                }
            }
            Err(e) => {
                let problem = Problem::from(e);
                for pending in batch {
                    pending.answer(Err(problem.clone()));
                }
            }
        }
    }
}

impl KeyLookup {
    /// The stored keys among `ids`, read on a held connection. If that connection was kept from
    /// an earlier batch and has failed since (a restart, an idle kill), the read runs once more
    /// on a fresh one: it changes nothing, so running it again is always safe.
    async fn look_up(&self, ids: &[&str]) -> Result<Vec<KeyRow>, sqlx::Error> {
        let mut conn = self.connections.take().await?;
        let rows = match select_keys(&mut conn, ids).await {
            Err(e) if conn.may_retry_after(&e) => {
                tracing::warn!(
                    error = %e,
                    "the key look-up's kept connection failed; looking up again on a fresh one"
                );
                drop(conn);
                conn = self.connections.take_fresh().await?;
                select_keys(&mut conn, ids).await?
            }
            rows => rows?,
        };
        self.connections.keep(conn);
        Ok(rows)
    }
}

/// The statement of [`select_keys`]: a probe of `api_keys` by id per key, and of `users` by id per
/// key found (a scalar subquery), so its generic plan holds the primary keys as its conditions
/// whatever the statistics it was made from (ADR 0019): `k.id = ANY ($1)` joined to `users` was
/// planned on a fresh database as a hash join over a scan of every user, kept for the life of
/// the connection until an `ANALYZE`. A key whose user is gone is not found.
pub const SELECT_KEYS_SQL: &str = "\
    SELECT i.id, k.user_id, k.key_hash, k.revoked_at IS NOT NULL, k.tier \
    FROM unnest($1::text[]) AS i(id) \
    CROSS JOIN LATERAL ( \
      SELECT k.user_id, k.key_hash, k.revoked_at, \
             (SELECT u.tier::text FROM users u WHERE u.id = k.user_id) AS tier \
      FROM api_keys k WHERE k.id = i.id LIMIT 1 \
    ) k \
    WHERE k.tier IS NOT NULL";

/// One statement for the keys of a batch.
async fn select_keys(conn: &mut PgConnection, ids: &[&str]) -> Result<Vec<KeyRow>, sqlx::Error> {
    sqlx::query_as(SELECT_KEYS_SQL)
        .bind(ids)
        .fetch_all(conn)
        .await
}

/// Middleware: records the caller's [`Identity`] in the request extensions.
pub async fn authenticate(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    match identify(&state, req.headers()).await {
        Ok(identity) => {
            req.extensions_mut().insert(identity);
            next.run(req).await
        }
        Err(problem) => problem.into_response(),
    }
}

impl<S: Send + Sync> FromRequestParts<S> for AuthUser {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        match parts.extensions.get::<Identity>() {
            Some(Identity::User(user)) => Ok(user.clone()),
            Some(Identity::Invalid(reason)) => Err(Problem::unauthorized(*reason)),
            Some(Identity::Anonymous) | None => Err(Problem::unauthorized(
                "this endpoint needs an `Authorization: Bearer <api key>` header",
            )),
        }
    }
}

/// The admin caller (`Authorization: Bearer <ADMIN_TOKEN>`, compared in constant time).
#[derive(Debug, Clone, Copy)]
pub struct Admin;

impl FromRequestParts<AppState> for Admin {
    type Rejection = Response;

    /// A caller without the right token is refused 401, and limited as an unauthenticated
    /// caller of its address ([`crate::rate::refused_admin`]).
    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let Some(expected) = state.admin_token.as_deref() else {
            return Err(Problem::forbidden(
                "the admin API is disabled on this server (ADMIN_TOKEN is not set)",
            )
            .into_response());
        };
        let refusal = match bearer(&parts.headers) {
            Some(Ok(token)) if keys::secrets_equal(token, expected) => return Ok(Admin),
            None => Problem::unauthorized(
                "admin endpoints need an `Authorization: Bearer <admin token>` header",
            ),
            Some(Err(reason)) => Problem::unauthorized(reason),
            Some(Ok(_)) => Problem::unauthorized("the admin token is wrong"),
        };
        Err(crate::rate::refused_admin(state, parts, refusal).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            http::header::AUTHORIZATION,
            HeaderValue::from_str(value).unwrap(),
        );
        h
    }

    #[test]
    fn bearer_parsing() {
        assert_eq!(bearer(&HeaderMap::new()), None);
        assert_eq!(bearer(&headers("Bearer abc")), Some(Ok("abc")));
        assert_eq!(bearer(&headers("bearer   abc ")), Some(Ok("abc")));
        assert!(matches!(bearer(&headers("Basic abc")), Some(Err(_))));
        assert!(matches!(bearer(&headers("Bearer")), Some(Err(_))));
        assert!(matches!(bearer(&headers("Bearer ")), Some(Err(_))));
        let mut twice = headers("Bearer abc");
        twice.append(
            http::header::AUTHORIZATION,
            HeaderValue::from_static("Bearer def"),
        );
        assert_eq!(
            bearer(&twice),
            Some(Err("the request has more than one Authorization header"))
        );
    }
}
