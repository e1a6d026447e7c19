//! Fairlane's HTTP API (SPEC §6): users enqueue analyses and specviews, follow their jobs and
//! read their quota; admins manage users, tiers and API keys.
//!
//! [`run`] serves until the shutdown token fires, then stops accepting, finishes in-flight
//! requests and returns. [`Server`] does the same in two steps, so tests and benchmarks can learn
//! the bound address. The binary (`main.rs`) adds the CLI, telemetry and signal handling.

pub mod admin;
pub mod auth;
pub mod batch;
pub mod cli;
pub mod client_addr;
pub mod commit_claim;
pub mod conditional;
pub mod config;
pub mod docs;
pub mod enqueue;
pub mod extract;
pub mod held;
pub mod keys;
pub mod large_reads;
pub mod middleware;
pub mod openapi;
pub mod problem;
pub mod rate;
pub mod routes;
pub mod serve;
pub mod state;
pub mod user_permits;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::response::IntoResponse;
use axum::routing::{get, patch, post};
use http::{HeaderValue, StatusCode};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use config::WebConfig;
pub use problem::Problem;
pub use state::AppState;

/// Maps a quota error to its response: 429 `quota_exceeded` with the numbers and `Retry-After`
/// to the end of the billing period, counted on the database's clock (the period's own) from
/// when the standings were read: a web host whose clock runs ahead would tell a client to retry
/// every second until the database's period ended, one running behind to wait too long.
pub fn quota_problem(e: quota::QuotaError) -> Problem {
    let now = match &e {
        quota::QuotaError::Exceeded(x) => x.read_at,
        _ => chrono::Utc::now(),
    };
    quota_problem_at(e, now)
}

/// [`quota_problem`] as of `now`. `Retry-After` is rounded up to whole seconds: a client that
/// waits exactly that long is past the period's end, not a fraction of a second before it.
fn quota_problem_at(e: quota::QuotaError, now: chrono::DateTime<chrono::Utc>) -> Problem {
    match e {
        quota::QuotaError::Exceeded(x) => {
            let retry = ratelimit::ceil_seconds(x.period.remaining(now)).max(1);
            Problem::new(
                StatusCode::TOO_MANY_REQUESTS,
                "quota_exceeded",
                format!(
                    "the {} quota of this billing period is used up: {} used + {} reserved of {}; it resets at {}",
                    x.event_type,
                    x.used,
                    x.reserved,
                    x.limit,
                    x.period.end.to_rfc3339()
                ),
            )
            .with("event_type", x.event_type.as_str())
            .with("tier", x.tier.as_str())
            .with("used", x.used)
            .with("reserved", x.reserved)
            .with("requested", x.requested)
            .with("limit", x.limit)
            .with("period_start", x.period.start.to_rfc3339())
            .with("period_end", x.period.end.to_rfc3339())
            .header(
                http::header::RETRY_AFTER,
                HeaderValue::from_str(&retry.to_string())
                    .unwrap_or(HeaderValue::from_static("3600")),
            )
        }
        quota::QuotaError::UnknownUser(_) => {
            Problem::unauthorized("the API key's user no longer exists")
        }
        quota::QuotaError::Database(e) => Problem::from(e),
        other => Problem::internal(&other),
    }
}

/// A database pool for `config` (connected lazily: the service starts while PostgreSQL is down,
/// and `/readyz` says so). Its sessions use generic plans: every statement of the API is an
/// index look-up or a batch over arrays, whose custom plans PostgreSQL would otherwise re-plan
/// on every execution (12% more `POST` throughput measured, docs/benchmarks.md).
///
/// No statement of the API waits for a lock for longer than `DATABASE_LOCK_TIMEOUT` (a user's
/// row held by a stuck session elsewhere would otherwise stall every enqueue batch behind it),
/// and no transaction of it stays idle for longer than `HTTP_REQUEST_TIMEOUT` (one that does is
/// a web process frozen mid-batch: the server ends its session and so releases its locks for
/// everyone else). There is no statement timeout: a commit that runs past the request's timeout
/// is answered `timeout_outcome_unknown` and must still be able to finish.
pub fn pool(config: &WebConfig) -> anyhow::Result<PgPool> {
    let lock_timeout = common::config::postgres_millis(config.database_lock_timeout);
    let request_timeout = common::config::postgres_millis(config.http_request_timeout);
    let options = connect_options(config)?.options([
        ("plan_cache_mode", "force_generic_plan"),
        ("lock_timeout", lock_timeout.as_str()),
        (
            "idle_in_transaction_session_timeout",
            request_timeout.as_str(),
        ),
    ]);
    Ok(PgPoolOptions::new()
        .max_connections(config.database_max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(options))
}

/// The connect options of `config`'s database, with only the queue's session settings
/// ([`queue::config::session_settings`]) and no timeouts: each caller sets its own.
fn connect_options(config: &WebConfig) -> anyhow::Result<PgConnectOptions> {
    let options = config.check_connections().map_err(anyhow::Error::msg)?;
    Ok(queue::config::session_settings(options))
}

/// The connect options `web migrate` uses: the server's defaults but READ COMMITTED; the lock
/// timeout of each statement is `MIGRATION_LOCK_TIMEOUT` ([`schema::migrate_patiently`]).
pub fn migration_options(config: &WebConfig) -> anyhow::Result<PgConnectOptions> {
    connect_options(config)
}

/// The address-space cap of the `git ls-remote` that resolves a branch or tag.
pub const RESOLVE_GIT_MEMORY: u64 = 256 * 1024 * 1024;

/// Builds the shared state (rate limiter, quota, queue client with the quota hook, the
/// batching enqueuer and key look-up, whose collectors run on `batch_thread`). Must be called
/// inside a Tokio runtime (the wake-up sender starts on it).
pub fn build_state(
    config: &WebConfig,
    pool: PgPool,
    batch_thread: &batch::BatchThread,
) -> anyhow::Result<AppState> {
    config
        .validate()
        .map_err(anyhow::Error::msg)
        .context("invalid configuration")?;
    let quota = quota::Quota::new(config.quota.clone()).context("quota configuration")?;
    let limiter = if config.ratelimit_enabled {
        Some(
            ratelimit::Limiter::from_file(
                &config.ratelimit_rules,
                config.redis_url.as_deref(),
                ratelimit::LimiterConfig {
                    deadline: config.ratelimit_deadline,
                    ..ratelimit::LimiterConfig::default()
                },
            )
            .with_context(|| format!("rate limiter (rules {})", config.ratelimit_rules))?,
        )
    } else {
        None
    };
    // A user's cancel of a waiting job releases its reservation and fails its record in the
    // cancel's transaction, through the same hooks the workers' engines run.
    let queue = queue::Client::new(pool.clone()).with_hooks(vec![
        Arc::new(quota::QuotaHook::new()),
        Arc::new(records::RecordHook::new()),
    ]);
    // Wake-ups are sent from this runtime, not from the batch thread whose commits ask for them.
    queue.start_waker();
    // The collectors run on a thread of their own, with connections of their own (ADR 0012).
    // One collector: on a busy server, bigger batches cost less per request than parallel ones.
    let key_lookup = batch::Batcher::start(
        batch_thread,
        auth::KeyLookup {
            connections: held::HeldConnections::new(batch_thread.pool(&pool, 2)),
        },
        64,
        1,
    );
    let enqueue_collectors = config.enqueue_batch_concurrency;
    let enqueuer = batch::Batcher::start(
        batch_thread,
        enqueue::EnqueueRunner {
            queue: queue.clone(),
            quota: quota.clone(),
            connections: held::HeldConnections::new(batch_thread.pool(
                &pool,
                u32::try_from(enqueue_collectors + 1).unwrap_or(u32::MAX),
            )),
        },
        config.enqueue_batch_max,
        enqueue_collectors,
    );
    let url_policy = config
        .url_policy()
        .map_err(anyhow::Error::msg)
        .context("invalid configuration")?;
    let resolve_limits = inventory::Limits {
        resolve_time: config.resolve_timeout,
        // `ls-remote` holds the remote's ref list; git needs far less than a fetch (a TLS
        // handshake and an HTTP exchange run in 64 MiB).
        max_git_memory: RESOLVE_GIT_MEMORY,
        ..inventory::Limits::default()
    };
    let request_duration = opentelemetry::global::meter("fairlane")
        .f64_histogram("http.server.request.duration")
        .with_unit("s")
        .with_description("Duration of HTTP requests by route template, method and status")
        .build();
    let openapi_json = openapi::document_json();
    let doc: serde_json::Value = serde_json::from_str(&openapi_json)?;
    Ok(AppState::new(state::Inner {
        pool,
        queue,
        quota,
        key_lookup,
        enqueuer,
        limiter,
        url_policy,
        resolve_limits,
        resolves: Arc::new(tokio::sync::Semaphore::new(config.resolve_concurrency)),
        user_resolves: user_permits::UserPermits::new(
            config
                .resolve_concurrency_per_user
                .min(config.resolve_concurrency),
        ),
        trusted_proxies: config.trusted_proxies().map_err(anyhow::Error::msg)?,
        admin_token: config.admin_token.clone(),
        large_reads: large_reads::LargeReads::new(config.http_large_read_memory),
        request_duration,
        docs_html: docs::render(&doc),
        openapi_json,
    }))
}

async fn not_found() -> Problem {
    Problem::not_found("no such route; see /docs")
}

async fn method_not_allowed() -> Problem {
    Problem::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this route does not support the method; see /docs",
    )
}

fn panic_response(_: Box<dyn std::any::Any + Send + 'static>) -> axum::response::Response {
    Problem::internal(&"a request handler panicked").into_response()
}

/// The router with every route and layer.
pub fn router(state: AppState, config: &WebConfig) -> Router {
    use routes::{admin as a, analyses, jobs, specviews, system, usage};
    // User routes: authenticate first (so the limiter knows the caller), then rate limit.
    let user = Router::new()
        .route("/v1/analyses", post(analyses::create).get(analyses::list))
        .route("/v1/analyses/{id}", get(analyses::get))
        .route(
            "/v1/specviews",
            post(specviews::create).get(specviews::list),
        )
        .route("/v1/specviews/{id}", get(specviews::get))
        .route("/v1/jobs/{id}", get(jobs::get).delete(jobs::cancel))
        .route("/v1/usage", get(usage::get))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            rate::limit,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::authenticate,
        ));
    let admin = Router::new()
        .route("/admin/users", post(a::create_user))
        .route("/admin/users/{id}", patch(a::update_user))
        .route("/admin/users/{id}/keys", post(a::issue_key))
        .route("/admin/keys/{key_id}", axum::routing::delete(a::revoke_key));
    let system = Router::new()
        .route("/healthz", get(system::healthz))
        .route("/readyz", get(system::readyz))
        .route("/metrics", get(system::metrics))
        .route("/openapi.json", get(system::openapi))
        .route("/docs", get(system::docs));
    with_layers(user.merge(admin).merge(system), state, config)
}

/// `routes` with the fallbacks and the layers every request goes through: body limit, timeout,
/// a panic turned into a 500 problem, and, outermost, the request span and duration metric, so
/// that timeouts and panics are measured like every other response.
pub fn with_layers(routes: Router<AppState>, state: AppState, config: &WebConfig) -> Router {
    let timeout = config.http_request_timeout;
    routes
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(config.http_body_limit))
        .layer(axum::middleware::from_fn(move |req, next| {
            middleware::timeout(timeout, req, next)
        }))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(
            panic_response,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            middleware::observe,
        ))
        .with_state(state)
}

/// A bound, not yet serving, HTTP server.
pub struct Server {
    listener: TcpListener,
    app: Router,
    limits: serve::ConnectionLimits,
    pool: PgPool,
    batch_thread: batch::BatchThread,
}

impl Server {
    /// Checks `config` (in [`build_state`], before anything is bound), builds the state and
    /// binds `config.http_addr`.
    pub async fn bind(config: &WebConfig) -> anyhow::Result<Server> {
        let pool = pool(config)?;
        Self::bind_with_pool(config, pool).await
    }

    /// [`Server::bind`] with an existing pool.
    pub async fn bind_with_pool(config: &WebConfig, pool: PgPool) -> anyhow::Result<Server> {
        sweep_stale_scratch().await;
        let batch_thread = batch::BatchThread::start("fairlane-batches")
            .context("starting the batch collectors' thread")?;
        let state = build_state(config, pool.clone(), &batch_thread)?;
        let app = router(state, config);
        let listener = TcpListener::bind(&config.http_addr)
            .await
            .with_context(|| format!("binding HTTP_ADDR {}", config.http_addr))?;
        let mut limits = config.connection_limits();
        if let Some(open_files) = serve::raise_open_file_limit() {
            let cap = serve::connection_cap(limits.max_connections, open_files);
            if cap < limits.max_connections {
                tracing::warn!(
                    configured = limits.max_connections,
                    serving = cap,
                    open_file_limit = open_files,
                    "HTTP_MAX_CONNECTIONS is more than this process may open files for; serving \
                     fewer connections at once, the rest wait in the backlog"
                );
                limits.max_connections = cap;
            }
        }
        Ok(Server {
            listener,
            app,
            limits,
            pool,
            batch_thread,
        })
    }

    pub fn local_addr(&self) -> anyhow::Result<SocketAddr> {
        Ok(self.listener.local_addr()?)
    }

    /// Serves until `shutdown` fires; then stops accepting, lets in-flight requests finish and
    /// closes the pools.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let addr = self.local_addr()?;
        tracing::info!(%addr, "listening");
        serve::serve(self.listener, self.app, self.limits, shutdown).await;
        tracing::info!("HTTP server stopped; in-flight requests finished");
        // The state, and with it the batchers, went with the server: the collectors stop.
        if !self.batch_thread.stop(BATCH_THREAD_STOP_BOUND).await {
            tracing::warn!(bound = ?BATCH_THREAD_STOP_BOUND, "the batch collectors did not stop in time");
        }
        // Closing waits for every connection still checked out: one held by a statement on a
        // silent network (the wake-up sender's `pg_notify`, say) would hold the exit for ever.
        if tokio::time::timeout(POOL_CLOSE_BOUND, self.pool.close())
            .await
            .is_err()
        {
            tracing::warn!(bound = ?POOL_CLOSE_BOUND, "the database pool did not close in time");
        }
        Ok(())
    }
}

/// Removes the `git ls-remote` scratch folders of web processes that no longer run (killed
/// mid-request: `kill -9`, out of memory). A pod's temporary folder outlives its container, so
/// without this they would pile up across restarts until the folder's size limit is reached.
async fn sweep_stale_scratch() {
    let root = inventory::Limits::default().work_root;
    let shown = root.display().to_string();
    match tokio::task::spawn_blocking(move || inventory::sweep_stale(&root)).await {
        Ok(Ok(report)) if !report.removed.is_empty() => tracing::info!(
            removed = report.removed.len(),
            kept = report.kept.len(),
            work_dir = %shown,
            "removed scratch folders of web processes that no longer run"
        ),
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::warn!(
            error = %e,
            work_dir = %shown,
            "could not sweep stale scratch folders"
        ),
        Err(e) => tracing::warn!(error = %e, "the scratch folder sweep did not finish"),
    }
}

/// How long a shutdown waits for the batch collectors once the server has drained.
pub const BATCH_THREAD_STOP_BOUND: Duration = Duration::from_secs(10);

/// How long a shutdown waits for the pool's connections to close.
pub const POOL_CLOSE_BOUND: Duration = Duration::from_secs(3);

/// How long past its own timeout a request in progress at shutdown may take to be answered: a
/// request that times out just as the drain ends still gets its 503 (`timeout` or
/// `timeout_outcome_unknown`) written, instead of a reset that tells the client nothing.
pub const DRAIN_ANSWER_MARGIN: Duration = Duration::from_secs(2);

/// What a shutdown may take beyond the drain (`HTTP_REQUEST_TIMEOUT`) and the telemetry flush
/// ([`telemetry::TelemetryConfig::shutdown_bound`]): a deployment's grace period (after its
/// `preStop` wait) must cover all three.
pub const SHUTDOWN_OVERHEAD_BOUND: Duration = DRAIN_ANSWER_MARGIN
    .saturating_add(BATCH_THREAD_STOP_BOUND)
    .saturating_add(POOL_CLOSE_BOUND)
    .saturating_add(telemetry::runtime::LEFTOVER_BLOCKING_WAIT);

/// Serves the API with `config` until `shutdown` fires.
pub async fn run(config: WebConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    Server::bind(&config).await?.run(shutdown).await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use chrono::{Duration, TimeZone, Utc};
    use common::{Service, Tier};
    use quota::{BillingCycle, BillingPeriod, QuotaError, QuotaExceeded};
    use uuid::Uuid;

    use super::*;

    fn exceeded(period: BillingPeriod) -> QuotaError {
        QuotaError::Exceeded(Box::new(QuotaExceeded {
            user_id: Uuid::nil(),
            tier: Tier::Free,
            event_type: Service::Analysis,
            used: 50,
            reserved: 0,
            requested: 1,
            limit: 50,
            period,
            read_at: period.end - Duration::seconds(100),
        }))
    }

    fn retry_after(problem: Problem) -> String {
        let response = problem.into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        response.headers()[http::header::RETRY_AFTER]
            .to_str()
            .unwrap()
            .to_owned()
    }

    #[test]
    fn quota_retry_after_rounds_up_to_the_period_end() {
        let period = BillingCycle::Month
            .period_containing(Utc.with_ymd_and_hms(2026, 11, 26, 0, 0, 0).unwrap());
        let end = period.end;
        let at = |before: Duration| quota_problem_at(exceeded(period), end - before);
        assert_eq!(retry_after(at(Duration::milliseconds(5_900))), "6");
        assert_eq!(retry_after(at(Duration::milliseconds(5_001))), "6");
        assert_eq!(retry_after(at(Duration::seconds(5))), "5");
        // At or past the end (a clock a little ahead), still a positive wait.
        assert_eq!(retry_after(at(Duration::zero())), "1");
        assert_eq!(retry_after(at(Duration::seconds(-3))), "1");
        // Counted from the database's reading (100 s before the end), whatever this host's
        // clock says.
        assert_eq!(retry_after(quota_problem(exceeded(period))), "100");
    }
}
