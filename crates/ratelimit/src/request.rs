//! The descriptor values a request carries (`user_id`, `tier`, …), as the rules see them.

use std::fmt;

/// A descriptor key Fairlane's web service can fill from a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DescriptorKey {
    /// The authenticated user's id; absent for unauthenticated requests.
    UserId,
    /// The user's tier (`free`, `pro`, `pro_plus`, `enterprise`); `anonymous` when unauthenticated.
    Tier,
    /// The client's IP address.
    RemoteAddress,
    /// The matched route template, e.g. `/v1/analyses` (never the raw path with ids in it).
    Route,
    /// The HTTP method, upper case (`POST`).
    Method,
    /// An identifier of the API key used (its id or hash, never the secret itself).
    ApiKey,
}

impl DescriptorKey {
    /// Every key, in the order of [`DescriptorKey::index`].
    pub const ALL: [DescriptorKey; 6] = [
        DescriptorKey::UserId,
        DescriptorKey::Tier,
        DescriptorKey::RemoteAddress,
        DescriptorKey::Route,
        DescriptorKey::Method,
        DescriptorKey::ApiKey,
    ];

    /// The name used in rules files.
    pub const fn as_str(self) -> &'static str {
        match self {
            DescriptorKey::UserId => "user_id",
            DescriptorKey::Tier => "tier",
            DescriptorKey::RemoteAddress => "remote_address",
            DescriptorKey::Route => "route",
            DescriptorKey::Method => "method",
            DescriptorKey::ApiKey => "api_key",
        }
    }

    /// The key with this rules-file name, if Fairlane knows it.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == name)
    }

    /// Position in [`DescriptorKey::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for DescriptorKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one request looks like to the limiter: a value for each descriptor key it has.
///
/// ```
/// use ratelimit::{DescriptorKey, RateLimitRequest};
/// let req = RateLimitRequest::new()
///     .with(DescriptorKey::UserId, "42")
///     .with(DescriptorKey::Tier, "pro")
///     .with(DescriptorKey::Route, "/v1/analyses")
///     .with(DescriptorKey::Method, "POST");
/// assert_eq!(req.get(DescriptorKey::Tier), Some("pro"));
/// assert_eq!(req.get(DescriptorKey::ApiKey), None);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RateLimitRequest {
    values: [Option<String>; 6],
}

impl RateLimitRequest {
    /// A request with no descriptor values.
    pub fn new() -> Self {
        Self::default()
    }

    /// This request with `key` set to `value`.
    pub fn with(mut self, key: DescriptorKey, value: impl Into<String>) -> Self {
        self.set(key, value);
        self
    }

    /// Set `key` to `value`.
    pub fn set(&mut self, key: DescriptorKey, value: impl Into<String>) {
        self.values[key.index()] = Some(value.into());
    }

    /// Remove `key`.
    pub fn unset(&mut self, key: DescriptorKey) {
        self.values[key.index()] = None;
    }

    /// The value of `key`, if the request has it.
    pub fn get(&self, key: DescriptorKey) -> Option<&str> {
        self.values[key.index()].as_deref()
    }
}
