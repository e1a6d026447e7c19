//! What every request handler shares: the database pool, the queue client (with the quota
//! hook), the quota service, the batching enqueuer, the rate limiter, the URL policy and pre-rendered documents.

use std::ops::Deref;
use std::sync::Arc;

use opentelemetry::metrics::Histogram;
use sqlx::PgPool;

/// Shared state; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

pub struct Inner {
    pub pool: PgPool,
    /// Queue client with [`quota::QuotaHook`] registered, so cancelling a waiting job releases
    /// its reservation in the same transaction.
    pub queue: queue::Client,
    pub quota: quota::Quota,
    /// API-key lookups, batched with concurrent ones.
    pub key_lookup: crate::batch::Batcher<crate::auth::KeyLookup>,
    /// Every `POST` that creates work enqueues through it, batched with concurrent ones.
    pub enqueuer: crate::enqueue::Enqueuer,
    /// `None` when rate limiting is disabled.
    pub limiter: Option<ratelimit::Limiter>,
    pub url_policy: inventory::UrlPolicy,
    pub resolve_limits: inventory::Limits,
    /// `git ls-remote` runs at once (`RESOLVE_CONCURRENCY`); more requests wait for a permit.
    pub resolves: Arc<tokio::sync::Semaphore>,
    /// Of which one user holds at most `RESOLVE_CONCURRENCY_PER_USER`; taken first, so a user's
    /// excess requests wait for their own permits, not in the shared queue.
    pub user_resolves: Arc<crate::user_permits::UserPermits>,
    /// Whose `X-Forwarded-For` names the client the rate limiter sees (`HTTP_TRUSTED_PROXIES`).
    pub trusted_proxies: crate::client_addr::TrustedProxies,
    pub admin_token: Option<String>,
    /// The memory that reads of large stored results share (`HTTP_LARGE_READ_MEMORY`).
    pub large_reads: crate::large_reads::LargeReads,
    pub request_duration: Histogram<f64>,
    pub openapi_json: String,
    pub docs_html: String,
}

impl AppState {
    pub fn new(inner: Inner) -> Self {
        AppState {
            inner: Arc::new(inner),
        }
    }
}

impl Deref for AppState {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.inner
    }
}
