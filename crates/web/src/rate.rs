//! Rate limiting middleware (SPEC §7): describes each `/v1` request to [`ratelimit::Limiter`]
//! (user, tier or `anonymous`, client address, route template, method, key id), refuses with a
//! 429 `rate_limited` problem, and puts the limit headers on every limited route's response.

use std::net::{IpAddr, SocketAddr};

use axum::extract::{ConnectInfo, MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use ratelimit::{DescriptorKey, RateLimitOutcome, RateLimitRequest, ceil_seconds};

use crate::auth::Identity;
use crate::problem::Problem;
use crate::state::AppState;

/// The request as the limiter sees it.
pub fn describe(
    identity: Option<&Identity>,
    remote: Option<IpAddr>,
    route: &str,
    method: &str,
) -> RateLimitRequest {
    let mut request = RateLimitRequest::new()
        .with(DescriptorKey::Route, route)
        .with(DescriptorKey::Method, method);
    if let Some(addr) = remote {
        request.set(DescriptorKey::RemoteAddress, limited_address(addr));
    }
    match identity {
        Some(Identity::User(user)) => {
            request.set(DescriptorKey::UserId, user.user_id.to_string());
            request.set(DescriptorKey::Tier, user.tier.as_str());
            request.set(DescriptorKey::ApiKey, user.key_id.clone());
        }
        Some(Identity::Anonymous | Identity::Invalid(_)) | None => {
            request.set(DescriptorKey::Tier, "anonymous");
        }
    }
    request
}

/// The `remote_address` a client is limited by: an IPv4 address itself (also when written as
/// IPv4-mapped IPv6), an IPv6 address its /64 (`2001:db8:1:2::/64`). One IPv6 host is usually
/// handed a whole /64, so per-address budgets would give it 2^64 of them.
pub fn limited_address(addr: IpAddr) -> String {
    match addr {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.to_string(),
            None => {
                let network = u128::from(v6) & !(u128::from(u64::MAX));
                format!("{}/64", std::net::Ipv6Addr::from(network))
            }
        },
    }
}

/// A structured-field string (RFC 8941): quotes and backslashes escaped, other non-printables
/// dropped.
fn sf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => {}
        }
    }
    out.push('"');
    out
}

/// The limit headers for `outcome` (none when no rule, or only `unlimited` or shadow-mode ones,
/// applied).
///
/// The remaining count never exceeds the limit: a token or leaky bucket whose `burst` is larger
/// than its `requests_per_unit` holds more than the policy's quota when full, and headers saying
/// `r=99` of `q=10` contradict each other. A client is told it may spend up to the quota now,
/// which the bucket holds.
pub fn limit_headers(outcome: &RateLimitOutcome) -> Vec<(HeaderName, String)> {
    let Some(headline) = outcome.headline() else {
        return Vec::new();
    };
    let Some(policy) = headline.policy else {
        return Vec::new();
    };
    let mut d = headline.decision;
    d.remaining = d.remaining.min(d.limit);
    let reset = ceil_seconds(d.reset);
    let name = sf_string(&headline.rule.id);
    let window = policy.unit.seconds();
    vec![
        (
            HeaderName::from_static("x-ratelimit-limit"),
            d.limit.to_string(),
        ),
        (
            HeaderName::from_static("x-ratelimit-remaining"),
            d.remaining.to_string(),
        ),
        (
            HeaderName::from_static("x-ratelimit-reset"),
            reset.to_string(),
        ),
        (
            HeaderName::from_static("ratelimit-policy"),
            format!("{name};q={};w={window}", d.limit),
        ),
        (
            HeaderName::from_static("ratelimit"),
            format!("{name};r={};t={reset}", d.remaining),
        ),
    ]
}

fn apply(headers: &mut HeaderMap, list: Vec<(HeaderName, String)>) {
    for (name, value) in list {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(name, value);
        }
    }
}

/// Middleware: runs after [`crate::auth::authenticate`]. The client's address is the TCP peer's,
/// or the one its `X-Forwarded-For` names when the peer is a trusted proxy
/// ([`crate::client_addr::TrustedProxies::client`]).
pub async fn limit(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if state.limiter.is_none() {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let identity = parts.extensions.get::<Identity>();
    match verdict(&state, identity, &parts).await {
        Err(refused) => refused,
        Ok(headers) => {
            let mut response = next.run(Request::from_parts(parts, body)).await;
            apply(response.headers_mut(), headers);
            response
        }
    }
}

/// An admin request refused for its credentials (no token, a wrong one): charged to the
/// client's address like any unauthenticated call, so guesses at the admin token are limited,
/// and answered 429 once that budget is spent. A request with the right token is never charged.
pub async fn refused_admin(state: &AppState, parts: &Parts, refusal: Problem) -> Response {
    match verdict(state, None, parts).await {
        Err(refused) => refused,
        Ok(headers) => {
            let mut response = refusal.into_response();
            apply(response.headers_mut(), headers);
            response
        }
    }
}

/// The limiter's verdict on a request of `identity`: the limit headers for its answer, or the
/// complete 429 answer. No limiter, no headers.
async fn verdict(
    state: &AppState,
    identity: Option<&Identity>,
    parts: &Parts,
) -> Result<Vec<(HeaderName, String)>, Response> {
    let Some(limiter) = state.limiter.as_ref() else {
        return Ok(Vec::new());
    };
    let route = parts
        .extensions
        .get::<MatchedPath>()
        .map_or_else(|| parts.uri.path().to_owned(), |m| m.as_str().to_owned());
    let remote = parts
        .extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| state.trusted_proxies.client(c.0, &parts.headers));
    let request = describe(identity, remote, &route, parts.method.as_str());
    let outcome = limiter.check(&request).await;
    let headers = limit_headers(&outcome);
    if !outcome.allowed {
        let retry = outcome.retry_after().map_or(1, |d| ceil_seconds(d).max(1));
        let limit = outcome.headline().map(|h| h.decision.limit);
        let mut problem = Problem::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limited",
            format!("too many requests; retry in {retry} s"),
        )
        .with("retry_after", retry);
        if let Some(limit) = limit {
            problem = problem.with("limit", limit);
        }
        let mut response = problem.into_response();
        apply(response.headers_mut(), headers);
        if let Ok(v) = HeaderValue::from_str(&retry.to_string()) {
            response.headers_mut().insert(http::header::RETRY_AFTER, v);
        }
        return Err(response);
    }
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ratelimit::{Limiter, LimiterConfig, MemoryBackend, MemoryConfig};

    use super::*;
    use crate::auth::AuthUser;

    /// A limiter of `rules` (Fairlane YAML) over the in-memory backend, without reloads.
    fn memory_limiter(rules: &str) -> Limiter {
        let rules = ratelimit::RuleSet::parse_fairlane(rules, "test.yaml").unwrap();
        let backend = Arc::new(MemoryBackend::with_system_clock(&MemoryConfig::default()));
        let config = LimiterConfig {
            reload_interval: None,
            ..LimiterConfig::default()
        };
        Limiter::new(rules, backend, config)
    }

    /// The limiter's decision on an anonymous `GET /v1/usage` from `addr`.
    async fn anonymous_usage(limiter: &Limiter, addr: IpAddr) -> RateLimitOutcome {
        limiter
            .check(&describe(None, Some(addr), "/v1/usage", "GET"))
            .await
    }

    #[test]
    fn descriptors_of_users_and_anonymous_callers() {
        let user = Identity::User(AuthUser {
            user_id: uuid::Uuid::nil(),
            tier: common::Tier::ProPlus,
            key_id: "00112233aabbccdd".into(),
        });
        let addr: IpAddr = "10.1.2.3".parse().unwrap();
        let r = describe(Some(&user), Some(addr), "/v1/jobs/{id}", "GET");
        assert_eq!(r.get(DescriptorKey::Tier), Some("pro_plus"));
        assert_eq!(r.get(DescriptorKey::ApiKey), Some("00112233aabbccdd"));
        assert_eq!(r.get(DescriptorKey::RemoteAddress), Some("10.1.2.3"));
        assert_eq!(r.get(DescriptorKey::Route), Some("/v1/jobs/{id}"));
        assert_eq!(
            r.get(DescriptorKey::UserId),
            Some(uuid::Uuid::nil().to_string().as_str())
        );
        let anon = describe(
            Some(&Identity::Invalid("x")),
            Some(addr),
            "/v1/usage",
            "GET",
        );
        assert_eq!(anon.get(DescriptorKey::Tier), Some("anonymous"));
        assert_eq!(anon.get(DescriptorKey::UserId), None);
        assert_eq!(anon.get(DescriptorKey::ApiKey), None);
    }

    #[test]
    fn ipv6_clients_are_limited_by_their_64() {
        for (addr, limited) in [
            ("192.0.2.1", "192.0.2.1"),
            ("::ffff:192.0.2.1", "192.0.2.1"),
            ("2001:db8:1:2:aaaa:bbbb:cccc:dddd", "2001:db8:1:2::/64"),
            ("2001:db8:1:2::1", "2001:db8:1:2::/64"),
            ("::1", "::/64"),
        ] {
            assert_eq!(limited_address(addr.parse().unwrap()), limited, "{addr}");
        }
    }

    #[tokio::test]
    async fn addresses_of_one_ipv6_64_share_the_anonymous_budget() {
        let limiter = memory_limiter(
            "domain: web\n\
             descriptors:\n\
             \x20 - key: tier\n\
             \x20   value: anonymous\n\
             \x20   descriptors:\n\
             \x20     - key: remote_address\n\
             \x20       rate_limit: {unit: minute, requests_per_unit: 30, algorithm: sliding_window}\n",
        );
        let mut allowed = 0;
        for host in 1..=31u16 {
            let addr = IpAddr::V6(std::net::Ipv6Addr::new(0x2001, 0xdb8, 7, 7, host, 0, 0, 1));
            let outcome = anonymous_usage(&limiter, addr).await;
            allowed += u32::from(outcome.allowed);
        }
        assert_eq!(allowed, 30);
        let elsewhere: IpAddr = "2001:db8:7:8::1".parse().unwrap();
        let outcome = anonymous_usage(&limiter, elsewhere).await;
        assert!(outcome.allowed, "another /64 has its own budget");
    }

    #[tokio::test]
    async fn the_429_of_a_blocked_address_carries_every_limit_header() {
        let limiter = memory_limiter(
            "domain: web\n\
             descriptors:\n\
             \x20 - key: remote_address\n\
             \x20   value: 198.51.100.7\n\
             \x20   rate_limit: {unit: hour, requests_per_unit: 0}\n",
        );
        let addr: IpAddr = "198.51.100.7".parse().unwrap();
        let outcome = anonymous_usage(&limiter, addr).await;
        assert!(!outcome.allowed);
        let headers = limit_headers(&outcome);
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_str()))
            .collect();
        let name = "\"web:remote_address=198.51.100.7\"";
        assert_eq!(
            headers,
            [
                ("x-ratelimit-limit", "0"),
                ("x-ratelimit-remaining", "0"),
                ("x-ratelimit-reset", "3600"),
                ("ratelimit-policy", &format!("{name};q=0;w=3600")),
                ("ratelimit", &format!("{name};r=0;t=3600")),
            ]
        );
    }

    #[tokio::test]
    async fn a_shadow_rule_over_its_limit_leaves_the_headers_of_an_allowed_request_alone() {
        let limiter = memory_limiter(
            "domain: web\n\
             descriptors:\n\
             \x20 - key: route\n\
             \x20   rate_limit: {unit: minute, requests_per_unit: 10}\n\
             \x20 - key: remote_address\n\
             \x20   rate_limit: {unit: minute, requests_per_unit: 1}\n\
             \x20   shadow_mode: true\n",
        );
        let addr: IpAddr = "192.0.2.9".parse().unwrap();
        let request = describe(None, Some(addr), "/v1/usage", "GET");
        limiter.check(&request).await;
        let outcome = limiter.check(&request).await;
        assert!(outcome.allowed);
        let headers = limit_headers(&outcome);
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_str()))
            .collect();
        assert!(
            headers.contains(&("x-ratelimit-limit", "10")),
            "{headers:?}"
        );
        assert!(
            headers.contains(&("x-ratelimit-remaining", "8")),
            "{headers:?}"
        );
    }

    #[tokio::test]
    async fn a_burst_above_the_rate_never_shows_more_remaining_than_the_limit() {
        let limiter = memory_limiter(
            "domain: web\n\
             descriptors:\n\
             \x20 - key: route\n\
             \x20   rate_limit: {unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 100}\n",
        );
        let request = describe(None, None, "/v1/usage", "GET");
        for n in 0..95 {
            let outcome = limiter.check(&request).await;
            assert!(outcome.allowed, "request {n}");
            let headers = limit_headers(&outcome);
            let value = |name: &str| {
                headers
                    .iter()
                    .find(|(h, _)| h.as_str() == name)
                    .map(|(_, v)| v.clone())
                    .unwrap()
            };
            let (limit, remaining): (u64, u64) = (
                value("x-ratelimit-limit").parse().unwrap(),
                value("x-ratelimit-remaining").parse().unwrap(),
            );
            assert_eq!(limit, 10);
            assert!(remaining <= limit, "request {n}: {headers:?}");
            assert!(value("ratelimit").contains(&format!(";r={remaining};")));
        }
    }

    #[test]
    fn structured_field_strings_are_escaped() {
        assert_eq!(sf_string(r#"a"b\c"#), r#""a\"b\\c""#);
        assert_eq!(
            sf_string("fairlane:tier=free/user_id"),
            "\"fairlane:tier=free/user_id\""
        );
    }
}
