//! Shared helpers for the queue's integration tests: fast engine settings, test job kinds, polling.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::time::Duration;

use queue::{Client, Engine, EngineConfig, JobRow, JobState, QueueName, RetryPolicy, Workers};
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Engine settings that exercise every path in milliseconds instead of seconds.
pub fn fast_config() -> EngineConfig {
    EngineConfig {
        poll_interval: Duration::from_millis(200),
        fetch_cooldown: Duration::from_millis(1),
        heartbeat_interval: Duration::from_millis(200),
        rescue_after: Duration::from_millis(1000),
        orphan_grace: Duration::from_millis(500),
        promote_interval: Duration::from_millis(50),
        rescue_interval: Duration::from_millis(200),
        clean_interval: Duration::from_millis(200),
        leader_ttl: Duration::from_millis(1000),
        cancel_grace: Duration::from_millis(300),
        shutdown_timeout: Duration::from_secs(2),
        job_timeout: Duration::from_secs(30),
        retry: RetryPolicy {
            base: Duration::from_millis(10),
            factor: 2.0,
            max: Duration::from_secs(1),
            jitter: 0.1,
        },
        ..EngineConfig::default()
    }
}

pub fn q(name: &str) -> QueueName {
    QueueName::new(name).unwrap()
}

/// A running engine that is shut down (and awaited) by `stop`.
pub struct Running {
    pub shutdown: CancellationToken,
    pub handle: JoinHandle<Result<(), queue::QueueError>>,
    pub worker_id: String,
}

impl Running {
    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .expect("engine did not stop within 30 s")
            .expect("engine task panicked")
            .expect("engine returned an error");
    }
}

pub fn start(
    client: &Client,
    config: EngineConfig,
    queues: &[(&str, usize)],
    workers: Workers,
) -> Running {
    let mut builder = Engine::builder(client.clone())
        .name("test")
        .config(config)
        .workers(workers);
    for (name, n) in queues {
        builder = builder.queue(q(name), *n);
    }
    run_engine(builder.build().unwrap())
}

/// Runs an engine built by the test (with middleware, say) until [`Running::stop`].
pub fn run_engine(engine: Engine) -> Running {
    let worker_id = engine.worker_id().to_owned();
    let shutdown = CancellationToken::new();
    let handle = tokio::spawn(engine.run(shutdown.clone()));
    Running {
        shutdown,
        handle,
        worker_id,
    }
}

pub use testkit::eventually;

/// Waits up to `timeout` (failing with `what`) until job `id` is in `state`, and returns it then.
pub async fn job_in_state(
    client: &Client,
    id: i64,
    state: JobState,
    timeout: Duration,
    what: &str,
) -> JobRow {
    eventually(timeout, what, || async {
        let j = client.job(id).await.unwrap().unwrap();
        (j.state == state).then_some(j)
    })
    .await
}

/// Waits until a session of the test database is listening for notifications (the engine's
/// notifier), so that a wake-up sent from now on reaches it; then lets the producers go idle.
pub async fn wait_for_listener(pool: &sqlx::PgPool) {
    eventually(
        Duration::from_secs(20),
        "the engine's LISTEN session",
        || async {
            let listening: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND query ILIKE 'LISTEN%'",
            )
            .fetch_one(pool)
            .await
            .unwrap();
            (listening > 0).then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
}

pub async fn count_in_state(pool: &sqlx::PgPool, state: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM fairlane_job WHERE state::text = $1")
        .bind(state)
        .fetch_one(pool)
        .await
        .unwrap()
}

macro_rules! job_args {
    ($name:ident, $kind:literal { $($field:ident : $ty:ty),* $(,)? }) => {
        #[derive(Debug, Clone, Serialize, Deserialize)]
        pub struct $name { $(pub $field: $ty),* }
        impl queue::JobArgs for $name { const KIND: &'static str = $kind; }
    };
}

job_args!(Noop, "noop" {});
job_args!(Sleep, "sleep" { ms: u64 });
job_args!(AlwaysFail, "always_fail" {});
job_args!(Panics, "panics" {});
job_args!(SnoozeUntil, "snooze_until" { times: i64 });
job_args!(Unregistered, "unregistered" {});
job_args!(Tag, "tag" { n: u64 });
job_args!(Unstorable, "unstorable" {});

/// A transition hook that fails on the transitions `refuses` picks, as a hook with a bug or a
/// constraint on one job would, and accepts every other one.
pub struct RefusingHook<F>(pub F);

#[async_trait::async_trait]
impl<F> queue::TransitionHook for RefusingHook<F>
where
    F: Fn(&queue::Transition) -> bool + Send + Sync + 'static,
{
    async fn on_transitions(
        &self,
        _conn: &mut sqlx::PgConnection,
        transitions: &[queue::Transition],
    ) -> Result<(), queue::BoxError> {
        match transitions.iter().find(|t| (self.0)(t)) {
            Some(t) => Err(format!("hook refuses job {} becoming {:?}", t.job_id, t.state).into()),
            None => Ok(()),
        }
    }
}

/// Puts `ids` in `running` as attempt 1 of `worker`, fetched `ago_ms` milliseconds ago.
pub async fn mark_running(pool: &sqlx::PgPool, ids: &[i64], worker: &str, ago_ms: i64) {
    sqlx::query(
        "UPDATE fairlane_job SET state = 'running', attempt = 1, \
         attempted_at = now() - $3 * interval '1 millisecond', attempted_by = ARRAY[$2] \
         WHERE id = ANY($1)",
    )
    .bind(ids)
    .bind(worker)
    .bind(ago_ms)
    .execute(pool)
    .await
    .unwrap();
}

pub async fn state_of(pool: &sqlx::PgPool, id: i64) -> String {
    sqlx::query_scalar("SELECT state::text FROM fairlane_job WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A transition hook that refuses every transition of one job (none until [`poison`]) until it
/// is [`cure`]d.
///
/// [`poison`]: PoisonedJob::poison
/// [`cure`]: PoisonedJob::cure
#[derive(Default)]
pub struct PoisonedJob(std::sync::atomic::AtomicI64);

impl PoisonedJob {
    pub fn poison(&self, id: i64) {
        self.0.store(id, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn cure(&self) {
        self.0.store(0, std::sync::atomic::Ordering::SeqCst);
    }
}

#[async_trait::async_trait]
impl queue::TransitionHook for PoisonedJob {
    async fn on_transitions(
        &self,
        conn: &mut sqlx::PgConnection,
        transitions: &[queue::Transition],
    ) -> Result<(), queue::BoxError> {
        let poisoned = self.0.load(std::sync::atomic::Ordering::SeqCst);
        RefusingHook(move |t: &queue::Transition| t.job_id == poisoned)
            .on_transitions(conn, transitions)
            .await
    }
}

/// Inserts `n` no-op jobs into `queue`; returns their ids.
pub async fn insert_noops(client: &Client, queue: &str, n: usize) -> Vec<i64> {
    let jobs = (0..n).map(|_| queue::NewJob::new(q(queue), &Noop {}).unwrap());
    client
        .insert_many(jobs.collect())
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.job.id)
        .collect()
}

/// Makes `worker`'s heartbeat look an hour old from now on, whatever it writes (a trigger on
/// `fairlane_worker`): a live worker the rescuer takes for dead, as when its heartbeat cannot
/// reach the database.
pub async fn keep_heartbeat_stale(pool: &sqlx::PgPool, worker: &str) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE FUNCTION stale_heartbeat() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.id = '{worker}' THEN NEW.heartbeat_at := now() - interval '1 hour'; \
         END IF; RETURN NEW; END $$"
    )))
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "CREATE TRIGGER stale_heartbeat BEFORE INSERT OR UPDATE ON fairlane_worker \
         FOR EACH ROW EXECUTE FUNCTION stale_heartbeat()",
    )
    .execute(pool)
    .await
    .unwrap();
}
