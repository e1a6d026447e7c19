//! Fairness with a real engine and real PostgreSQL, in one process: the gate, the wake-up hook,
//! and the snoozing middleware.

#![allow(clippy::unwrap_used, clippy::needless_pass_by_value)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Lane, Service, Tier};
use fairness::{FairnessConfig, FairnessGate, FairnessHook, FairnessMiddleware, TierCache};
use queue::{Client, Engine, EngineConfig, JobError, JobState, NewJob, QueueName, Workers};
use serde::{Deserialize, Serialize};
use testkit::TestDb;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Probe {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    user_id: Option<Uuid>,
    ms: u64,
}
impl queue::JobArgs for Probe {
    const KIND: &'static str = "probe";
}

/// One handler run: who, when it started and ended (relative to the test start).
#[derive(Debug, Clone)]
struct Run {
    job: i64,
    user: Option<Uuid>,
    start: Duration,
    end: Duration,
}

struct Harness {
    db: TestDb,
    client: Client,
    runs: Arc<Mutex<Vec<Run>>>,
    t0: Instant,
}

fn engine_config() -> EngineConfig {
    EngineConfig {
        poll_interval: Duration::from_secs(5), // prove wake-ups come from NOTIFY, not polling
        heartbeat_interval: Duration::from_millis(200),
        rescue_after: Duration::from_secs(1),
        promote_interval: Duration::from_millis(20),
        leader_ttl: Duration::from_secs(1),
        shutdown_timeout: Duration::from_secs(5),
        ..EngineConfig::default()
    }
}

fn fast_fairness() -> FairnessConfig {
    FairnessConfig {
        fairness_snooze_duration: Duration::from_millis(50),
        fairness_snooze_jitter: Duration::from_millis(20),
        fairness_tier_cache_ttl: Duration::from_millis(500),
        ..FairnessConfig::default()
    }
}

impl Harness {
    async fn new() -> Harness {
        let db = TestDb::new().await;
        let client = Client::new(db.pool.clone()).with_hooks(vec![Arc::new(FairnessHook::new(
            &Service::Analysis.queues(),
        ))]);
        Harness {
            db,
            client,
            runs: Arc::new(Mutex::new(Vec::new())),
            t0: Instant::now(),
        }
    }

    async fn user(&self, tier: Tier) -> Uuid {
        sqlx::query_scalar(
            "INSERT INTO users (name, tier) VALUES ('u', $1::fairlane_tier) RETURNING id",
        )
        .bind(tier.as_str())
        .fetch_one(&self.db.pool)
        .await
        .unwrap()
    }

    async fn set_tier(&self, user: Uuid, tier: Tier) {
        sqlx::query("UPDATE users SET tier = $2::fairlane_tier WHERE id = $1")
            .bind(user)
            .bind(tier.as_str())
            .execute(&self.db.pool)
            .await
            .unwrap();
    }

    fn queue(lane: Lane) -> QueueName {
        Service::Analysis.queue(lane)
    }

    async fn enqueue(&self, lane: Lane, user: Option<Uuid>, ms: u64, n: usize) -> Vec<i64> {
        let jobs = (0..n)
            .map(|_| {
                NewJob::new(Self::queue(lane), &Probe { user_id: user, ms })
                    .unwrap()
                    .max_attempts(3)
            })
            .collect();
        self.client
            .insert_many(jobs)
            .await
            .unwrap()
            .into_iter()
            .map(|i| i.job.id)
            .collect()
    }

    /// Starts an engine on the three analysis queues (`workers` each) with fairness wired as in
    /// the worker services.
    fn start(
        &self,
        workers: usize,
        fairness: FairnessConfig,
    ) -> (CancellationToken, tokio::task::JoinHandle<()>) {
        let runs = self.runs.clone();
        let t0 = self.t0;
        let mut registry = Workers::new();
        registry.register_fn::<Probe, _, _>(move |ctx, args| {
            let runs = runs.clone();
            async move {
                let start = t0.elapsed();
                tokio::time::sleep(Duration::from_millis(args.ms)).await;
                runs.lock().unwrap().push(Run {
                    job: ctx.id(),
                    user: args.user_id,
                    start,
                    end: t0.elapsed(),
                });
                Ok::<(), JobError>(())
            }
        });
        let queues = Service::Analysis.queues();
        let tiers = Arc::new(TierCache::new(fairness.fairness_tier_cache_ttl));
        let mut builder = Engine::builder(self.client.clone())
            .name("fairness-test")
            .config(engine_config())
            .workers(registry)
            .middleware(Arc::new(FairnessMiddleware::new(
                self.db.pool.clone(),
                "analysis",
                &queues,
                fairness.clone(),
                tiers,
            )));
        if fairness.fairness_fetch_gate {
            builder =
                builder.fetch_gate(Arc::new(FairnessGate::new("analysis", &queues, fairness)));
        }
        for q in queues {
            builder = builder.queue(q, workers);
        }
        let engine = builder.build().unwrap();
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        let handle = tokio::spawn(async move { engine.run(token).await.unwrap() });
        (shutdown, handle)
    }

    async fn wait_completed(&self, ids: &[i64], timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let done: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM fairlane_job WHERE id = ANY($1) AND state = 'completed'",
            )
            .bind(ids)
            .fetch_one(&self.db.pool)
            .await
            .unwrap();
            if done == ids.len() as i64 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "only {done} of {} completed",
                ids.len()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    fn runs_of(&self, user: Uuid) -> Vec<Run> {
        let mut runs: Vec<Run> = self
            .runs
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.user == Some(user))
            .cloned()
            .collect();
        runs.sort_by_key(|r| r.start);
        runs
    }
}

/// The most runs of `runs` that overlap in time.
fn peak_concurrency(runs: &[Run]) -> usize {
    let mut events: Vec<(Duration, i32)> = runs
        .iter()
        .flat_map(|r| [(r.start, 1), (r.end, -1)])
        .collect();
    // Ends sort before starts at the same instant: touching runs do not overlap.
    events.sort_by_key(|(t, d)| (*t, *d));
    let (mut now, mut peak) = (0i32, 0i32);
    for (_, d) in events {
        now += d;
        peak = peak.max(now);
    }
    peak as usize
}

async fn stop(shutdown: CancellationToken, handle: tokio::task::JoinHandle<()>) {
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), handle)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn adr10_scenario_free_user_gets_one_slot_and_pro_jobs_do_not_wait_behind_it() {
    let h = Harness::new().await;
    let free = h.user(Tier::Free).await;
    let pro = h.user(Tier::Pro).await;
    // One lane with five workers: the Free user's ten jobs go in first.
    let mut ids = h.enqueue(Lane::Default, Some(free), 150, 10).await;
    ids.extend(h.enqueue(Lane::Default, Some(pro), 150, 3).await);
    let (shutdown, handle) = h.start(5, fast_fairness());
    h.wait_completed(&ids, Duration::from_secs(30)).await;
    stop(shutdown, handle).await;

    let free_runs = h.runs_of(free);
    let pro_runs = h.runs_of(pro);
    assert_eq!(free_runs.len(), 10);
    assert_eq!(pro_runs.len(), 3);
    assert_eq!(
        peak_concurrency(&free_runs),
        1,
        "Free user never has more than one running"
    );
    assert_eq!(
        peak_concurrency(&pro_runs),
        3,
        "Pro user's three run together"
    );
    let second_free_start = free_runs[1].start;
    assert!(
        pro_runs.iter().all(|r| r.start < second_free_start),
        "Pro jobs start before the Free user's second job: {pro_runs:?} vs {second_free_start:?}"
    );
    let snoozed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM fairlane_job WHERE (metadata->>'snoozes') IS NOT NULL",
    )
    .fetch_one(&h.db.pool)
    .await
    .unwrap();
    assert_eq!(snoozed, 0, "the gate delays without snoozing or churning");
}

#[tokio::test]
async fn a_freed_slot_starts_the_users_next_job_within_a_second() {
    let h = Harness::new().await;
    let free = h.user(Tier::Free).await;
    let ids = h.enqueue(Lane::Default, Some(free), 1000, 2).await;
    let (shutdown, handle) = h.start(3, fast_fairness());
    h.wait_completed(&ids, Duration::from_secs(20)).await;
    stop(shutdown, handle).await;
    let runs = h.runs_of(free);
    let gap = runs[1].start.saturating_sub(runs[0].end);
    assert!(runs[1].start >= runs[0].end, "never overlapping: {runs:?}");
    assert!(
        gap < Duration::from_secs(1),
        "second started {gap:?} after the first ended"
    );
}

#[tokio::test]
async fn a_heavy_backlog_does_not_delay_another_user() {
    let h = Harness::new().await;
    let heavy = h.user(Tier::Free).await;
    let other = h.user(Tier::Free).await;
    let backlog = h.enqueue(Lane::Default, Some(heavy), 200, 10_000).await;
    let (shutdown, handle) = h.start(3, fast_fairness());
    // Let the heavy user's first job start, then submit B's.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let submitted = h.t0.elapsed();
    let mine = h.enqueue(Lane::Default, Some(other), 10, 1).await;
    h.wait_completed(&mine, Duration::from_secs(10)).await;
    stop(shutdown, handle).await;
    let run = &h.runs_of(other)[0];
    let waited = run.start.saturating_sub(submitted);
    assert!(
        waited < Duration::from_secs(1),
        "B waited {waited:?} behind 10,000 jobs"
    );
    let heavy_runs = h.runs_of(heavy);
    assert!(peak_concurrency(&heavy_runs) <= 1);
    let still_waiting: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM fairlane_job WHERE id = ANY($1) AND state = 'available' AND attempt = 0",
    )
    .bind(&backlog)
    .fetch_one(&h.db.pool)
    .await
    .unwrap();
    assert!(
        still_waiting > 9_900,
        "the backlog was not churned through: {still_waiting} untouched"
    );
}

/// A fetch of 100 from a lane where 300 users wait (6,000 jobs, stored interleaved with another
/// lane's 6,000), on a table `ANALYZE` has seen: the gate reads the lane in fetch order and
/// stops, so it holds the advisory locks of the users it scanned, not of every user with a
/// waiting job (which would also keep other replicas from admitting them).
#[tokio::test]
async fn the_gate_locks_only_the_users_it_scans_even_on_an_analyzed_backlog() {
    let h = Harness::new().await;
    let mut pro = Vec::new();
    let mut free = Vec::new();
    for _ in 0..300 {
        pro.push(h.user(Tier::Pro).await);
        free.push(h.user(Tier::Free).await);
    }
    // Arrival order interleaves the users and the lanes, as many users' requests do.
    let job = |lane: Lane, user: Uuid| {
        NewJob::new(
            Harness::queue(lane),
            &Probe {
                user_id: Some(user),
                ms: 10,
            },
        )
        .unwrap()
    };
    let jobs: Vec<NewJob> = (0..20)
        .flat_map(|_| pro.iter().zip(&free))
        .flat_map(|(&p, &f)| [job(Lane::Priority, p), job(Lane::Default, f)])
        .collect();
    h.client.insert_many(jobs).await.unwrap();
    sqlx::query("ANALYZE fairlane_job")
        .execute(&h.db.pool)
        .await
        .unwrap();
    let gate = FairnessGate::new(
        Service::Analysis.as_str(),
        &Service::Analysis.queues(),
        fast_fairness(),
    );

    let mut tx = queue::begin_fetch(&h.db.pool).await.unwrap();
    let admitted = queue::FetchGate::select(&gate, &mut tx, &Harness::queue(Lane::Priority), 100)
        .await
        .unwrap();
    let locked_users: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.rollback().await.unwrap();

    assert_eq!(admitted.len(), 100);
    // The gate scans up to twice its limit for candidates.
    assert!(
        locked_users <= 200,
        "a fetch of 100 held {locked_users} users' advisory locks"
    );
}

#[tokio::test]
async fn without_the_gate_over_limit_jobs_snooze_without_using_attempts() {
    let h = Harness::new().await;
    let free = h.user(Tier::Free).await;
    // One long job holds the Free user's slot; the second keeps snoozing (50-70 ms each) until it
    // is free: well over 20 snoozes, with max_attempts = 3.
    let first = h.enqueue(Lane::Default, Some(free), 3000, 1).await;
    let (shutdown, handle) = h.start(
        2,
        FairnessConfig {
            fairness_fetch_gate: false,
            ..fast_fairness()
        },
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = h.enqueue(Lane::Default, Some(free), 10, 1).await;
    let both: Vec<i64> = first.iter().chain(&second).copied().collect();
    h.wait_completed(&both, Duration::from_secs(30)).await;
    stop(shutdown, handle).await;
    let (snoozes, attempt, state): (i64, i16, JobState) = sqlx::query_as(
        "SELECT (metadata->>'snoozes')::int8, attempt, state FROM fairlane_job WHERE id = $1",
    )
    .bind(second[0])
    .fetch_one(&h.db.pool)
    .await
    .unwrap();
    assert_eq!(state, JobState::Completed);
    assert!(snoozes >= 20, "snoozed {snoozes} times");
    assert_eq!(attempt, 1, "snoozes do not use attempts");
    let runs = h.runs_of(free);
    assert_eq!(peak_concurrency(&runs), 1);
}

/// Without the gate, a user's jobs taken by one fetch while their slots are free do not snooze
/// each other: the first of them (by id) up to the limit run. With no jitter, snoozed jobs come
/// back together and are fetched together again, so counting one another they would never run.
#[tokio::test]
async fn without_the_gate_jobs_fetched_together_run_up_to_the_limit() {
    let h = Harness::new().await;
    let free = h.user(Tier::Free).await;
    let pro = h.user(Tier::Pro).await;
    let free_jobs = h.enqueue(Lane::Default, Some(free), 100, 3).await;
    let pro_jobs = h.enqueue(Lane::Default, Some(pro), 100, 5).await;
    let (shutdown, handle) = h.start(
        8,
        FairnessConfig {
            fairness_fetch_gate: false,
            fairness_snooze_jitter: Duration::ZERO,
            ..fast_fairness()
        },
    );
    let all: Vec<i64> = free_jobs.iter().chain(&pro_jobs).copied().collect();
    h.wait_completed(&all, Duration::from_secs(20)).await;
    stop(shutdown, handle).await;
    assert_eq!(peak_concurrency(&h.runs_of(free)), 1);
    assert_eq!(peak_concurrency(&h.runs_of(pro)), 3);
    // The first fetch took every job: the first of each user's, up to the limit, ran at once.
    let snoozes: Vec<i64> = sqlx::query_scalar(
        "SELECT coalesce((metadata->>'snoozes')::int8, 0) FROM fairlane_job \
         WHERE id = ANY($1) ORDER BY id",
    )
    .bind(&all)
    .fetch_all(&h.db.pool)
    .await
    .unwrap();
    let first_free = free_jobs.iter().min().unwrap();
    let mut first_pro = pro_jobs.clone();
    first_pro.sort_unstable();
    let ran_at_once: Vec<i64> = std::iter::once(*first_free)
        .chain(first_pro.into_iter().take(3))
        .collect();
    let mut sorted = all.clone();
    sorted.sort_unstable();
    for (id, n) in sorted.iter().zip(&snoozes) {
        if ran_at_once.contains(id) {
            assert_eq!(*n, 0, "job {id} snoozed although its user had a free slot");
        }
    }
}

/// A fleet part-way through switching the gate on or off: a replica with the gate admits a job
/// of a Free user (its fetch not yet committed) while a replica without it fetched the user's
/// other job. That job's check waits for the user's lock, which the gated fetch holds, and then
/// counts the admitted job and snoozes, instead of counting before the admission committed and
/// running beside it.
#[tokio::test]
async fn without_the_gate_a_check_waits_for_a_gated_fetch_admitting_the_same_user() {
    let h = Harness::new().await;
    let free = h.user(Tier::Free).await;
    let gated = h.enqueue(Lane::Default, Some(free), 100, 1).await[0];
    let ungated = h.enqueue(Lane::Priority, Some(free), 100, 1).await[0];
    let queues: Vec<String> = Service::Analysis
        .queues()
        .iter()
        .map(ToString::to_string)
        .collect();
    let limits = fairness::store::TierLimits::from_config(&FairnessConfig::default());

    // The gated replica's fetch, admitting the Free user's job, not committed yet.
    let mut fetch = queue::begin_fetch(&h.db.pool).await.unwrap();
    let admitted = fairness::store::lock_candidates(
        &mut fetch,
        Service::Analysis.as_str(),
        Harness::queue(Lane::Default).as_str(),
        &queues,
        &limits,
        1,
    )
    .await
    .unwrap();
    assert_eq!(admitted.len(), 1);
    assert_eq!(admitted[0].job_id, gated);
    sqlx::query(
        "UPDATE fairlane_job SET state = 'running', attempt = 1, attempted_at = now(), \
         attempted_by = ARRAY['gated-replica'] WHERE id = $1",
    )
    .bind(gated)
    .execute(&mut *fetch)
    .await
    .unwrap();

    let (shutdown, handle) = h.start(
        2,
        FairnessConfig {
            fairness_fetch_gate: false,
            fairness_snooze_duration: Duration::from_secs(30),
            ..fast_fairness()
        },
    );
    // The ungated replica fetches the other job at once; its check must not run it meanwhile.
    tokio::time::sleep(Duration::from_millis(700)).await;
    fetch.commit().await.unwrap();
    let snoozed = async {
        loop {
            let (state, snoozes): (String, Option<i64>) = sqlx::query_as(
                "SELECT state::text, (metadata->>'snoozes')::int8 FROM fairlane_job WHERE id = $1",
            )
            .bind(ungated)
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
            if state != "available" && state != "running" {
                return (state, snoozes);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let (state, snoozes) = tokio::time::timeout(Duration::from_secs(10), snoozed)
        .await
        .expect("the ungated job was never decided");
    stop(shutdown, handle).await;
    assert_eq!(
        (state.as_str(), snoozes),
        ("scheduled", Some(1)),
        "the ungated job ran beside the admitted one"
    );
    assert!(h.runs_of(free).is_empty(), "{} runs", h.runs_of(free).len());
}

/// A replica frozen mid-fetch keeps the user's lock until its session ends. A check without the
/// gate waits for that lock only so long, then snoozes the job briefly like after any failed
/// check, instead of holding a connection and a worker slot until the job times out.
#[tokio::test]
async fn without_the_gate_a_check_does_not_wait_long_for_a_user_lock_held_elsewhere() {
    let h = Harness::new().await;
    let free = h.user(Tier::Free).await;
    let mut frozen = h.db.pool.begin().await.unwrap();
    fairness::store::lock_user(&mut frozen, Service::Analysis.as_str(), free)
        .await
        .unwrap();
    let job = h.enqueue(Lane::Default, Some(free), 10, 1).await[0];
    let (shutdown, handle) = h.start(
        1,
        FairnessConfig {
            fairness_fetch_gate: false,
            ..fast_fairness()
        },
    );
    let snoozed = async {
        loop {
            let snoozes: Option<i64> = sqlx::query_scalar(
                "SELECT (metadata->>'snoozes')::int8 FROM fairlane_job WHERE id = $1",
            )
            .bind(job)
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
            if snoozes.is_some() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    // The lock is held until the job has snoozed; the check gives up after a second.
    tokio::time::timeout(Duration::from_secs(5), snoozed)
        .await
        .expect("the check waited for the lock");
    frozen.rollback().await.unwrap();
    h.wait_completed(&[job], Duration::from_secs(10)).await;
    stop(shutdown, handle).await;
}

#[tokio::test]
async fn a_tier_upgrade_raises_the_limit_without_restart_and_disabling_removes_limits() {
    let h = Harness::new().await;
    let user = h.user(Tier::Free).await;
    let before = h.enqueue(Lane::Default, Some(user), 300, 4).await;
    let (shutdown, handle) = h.start(5, fast_fairness());
    h.wait_completed(&before, Duration::from_secs(20)).await;
    assert_eq!(peak_concurrency(&h.runs_of(user)), 1);

    h.set_tier(user, Tier::Pro).await;
    tokio::time::sleep(Duration::from_millis(600)).await; // the test's tier cache TTL is 500 ms
    h.runs.lock().unwrap().clear();
    let after = h.enqueue(Lane::Default, Some(user), 300, 6).await;
    h.wait_completed(&after, Duration::from_secs(20)).await;
    stop(shutdown, handle).await;
    assert_eq!(
        peak_concurrency(&h.runs_of(user)),
        3,
        "Pro limit applies without restart"
    );

    // FAIRNESS_ENABLED=false: no limit at all.
    h.runs.lock().unwrap().clear();
    h.set_tier(user, Tier::Free).await;
    let unlimited = h.enqueue(Lane::Default, Some(user), 300, 5).await;
    let (shutdown, handle) = h.start(
        5,
        FairnessConfig {
            fairness_enabled: false,
            ..fast_fairness()
        },
    );
    h.wait_completed(&unlimited, Duration::from_secs(20)).await;
    stop(shutdown, handle).await;
    assert_eq!(peak_concurrency(&h.runs_of(user)), 5);
}

#[tokio::test]
async fn system_jobs_are_never_limited() {
    let h = Harness::new().await;
    let ids = h.enqueue(Lane::Scheduled, None, 200, 4).await;
    let (shutdown, handle) = h.start(4, fast_fairness());
    h.wait_completed(&ids, Duration::from_secs(20)).await;
    stop(shutdown, handle).await;
    let runs: Vec<Run> = h.runs.lock().unwrap().clone();
    assert_eq!(peak_concurrency(&runs), 4);
    assert!(runs.iter().all(|r| r.job > 0));
}

/// PostgreSQL's lock table is shared by every session and holds about
/// `max_locks_per_transaction × max_connections` locks (6,400 by default); when it is full,
/// every transaction that needs one more lock fails with "out of shared memory". A fetch that
/// admits thousands of users must not take a lock per user: the user locks are striped, so a
/// fetch holds at most [`fairness::store::USER_LOCK_STRIPES`] of them however many it admits
/// (and, as each is exclusive, every fetch of a service together holds no more).
#[tokio::test]
async fn a_fetch_admitting_thousands_of_users_holds_a_bounded_number_of_locks() {
    let h = Harness::new().await;
    let users: Vec<Uuid> = sqlx::query_scalar(
        "INSERT INTO users (name, tier) SELECT 'u' || g, 'pro' FROM generate_series(1, 3000) g \
         RETURNING id",
    )
    .fetch_all(&h.db.pool)
    .await
    .unwrap();
    let jobs: Vec<NewJob> = users
        .iter()
        .map(|&user| {
            NewJob::new(
                Harness::queue(Lane::Priority),
                &Probe {
                    user_id: Some(user),
                    ms: 1,
                },
            )
            .unwrap()
        })
        .collect();
    h.client.insert_many(jobs).await.unwrap();
    let gate = FairnessGate::new(
        Service::Analysis.as_str(),
        &Service::Analysis.queues(),
        fast_fairness(),
    );

    let mut tx = queue::begin_fetch(&h.db.pool).await.unwrap();
    let admitted = queue::FetchGate::select(&gate, &mut tx, &Harness::queue(Lane::Priority), 2900)
        .await
        .unwrap();
    let locks: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.rollback().await.unwrap();

    assert_eq!(admitted.len(), 2900, "every user has a free slot");
    let stripes = i64::from(fairness::store::USER_LOCK_STRIPES);
    assert!(
        locks <= stripes,
        "a fetch admitting 2,900 users held {locks} advisory locks (at most {stripes})"
    );
}

/// The gate reads each tier from the paid users only (`users_paid`, ADR 0015): a user at their
/// tier's limit is skipped and one below it is a candidate, for every tier; a user who is not in
/// `users`, or was downgraded to free, counts as free; and the count under the locks reports the
/// same tiers. The limits differ per tier here, so a mixed-up tier shows.
#[tokio::test]
async fn the_gate_reads_every_tier_from_the_paid_users_and_counts_the_rest_as_free() {
    let h = Harness::new().await;
    let limits = fairness::store::TierLimits {
        free: 1,
        pro: 2,
        pro_plus: 3,
        enterprise: 4,
    };
    let downgraded = h.user(Tier::Enterprise).await;
    h.set_tier(downgraded, Tier::Free).await;
    // (user, its tier as the gate must see it, jobs running, that tier's limit)
    let free = usize::try_from(limits.free).unwrap();
    let mut users = vec![
        (downgraded, Tier::Free, free, free),
        (Uuid::now_v7(), Tier::Free, free, free), // no `users` row
    ];
    for (tier, limit) in [
        (Tier::Free, limits.free),
        (Tier::Pro, limits.pro),
        (Tier::ProPlus, limits.pro_plus),
        (Tier::Enterprise, limits.enterprise),
    ] {
        let limit = usize::try_from(limit).unwrap();
        users.push((h.user(tier).await, tier, limit, limit)); // full
        users.push((h.user(tier).await, tier, limit - 1, limit)); // one slot left
    }
    let mut running = Vec::new();
    for &(user, _, n, _) in &users {
        running.extend(h.enqueue(Lane::Priority, Some(user), 1, n).await);
    }
    sqlx::query(
        "UPDATE fairlane_job SET state = 'running', attempt = 1, attempted_at = now(), \
         attempted_by = ARRAY['test-worker'] WHERE id = ANY($1)",
    )
    .bind(&running)
    .execute(&h.db.pool)
    .await
    .unwrap();
    for &(user, ..) in &users {
        h.enqueue(Lane::Default, Some(user), 1, 1).await;
    }
    let queues: Vec<String> = Service::Analysis
        .queues()
        .iter()
        .map(ToString::to_string)
        .collect();

    let mut tx = queue::begin_fetch(&h.db.pool).await.unwrap();
    let candidates = fairness::store::lock_candidates(
        &mut tx,
        Service::Analysis.as_str(),
        Harness::queue(Lane::Default).as_str(),
        &queues,
        &limits,
        100,
    )
    .await
    .unwrap();
    let all: Vec<Uuid> = users.iter().map(|u| u.0).collect();
    let counted = fairness::store::counts_and_tiers(&mut tx, &queues, &all)
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    let mut admitted: Vec<Uuid> = candidates.iter().filter_map(|c| c.user_id).collect();
    admitted.sort_unstable();
    let mut open: Vec<Uuid> = users
        .iter()
        .filter(|&&(_, _, n, limit)| n < limit)
        .map(|u| u.0)
        .collect();
    open.sort_unstable();
    assert_eq!(open.len(), 4, "one user of each tier has a slot left");
    assert_eq!(admitted, open, "exactly the users below their tier's limit");
    for &(user, tier, n, _) in &users {
        assert_eq!(
            counted.get(&user),
            Some(&(u32::try_from(n).unwrap(), tier)),
            "count and tier of {user}"
        );
    }

    // The jobs the gate holds back, as `fairlane_fairness_waiting` reports them: the waiting
    // job of each full user, under the tier the gate sees, in its queue; nothing else.
    let gauges = fairness::FairnessGauges::register(Service::Analysis.as_str(), &queues);
    gauges.refresh(&h.db.pool, &limits).await.unwrap();
    let waiting = gauges.waiting();
    let mut expected: BTreeMap<(String, Tier), i64> = BTreeMap::new();
    for &(_, tier, n, limit) in &users {
        if n >= limit {
            *expected
                .entry((Harness::queue(Lane::Default).to_string(), tier))
                .or_insert(0) += 1;
        }
    }
    assert_eq!(
        expected.values().sum::<i64>(),
        6,
        "two free users beyond the tiers' own"
    );
    for (key, n) in &waiting {
        assert_eq!(*n, expected.get(key).copied().unwrap_or(0), "{key:?}");
    }
    assert_eq!(waiting.len(), queues.len() * Tier::ALL.len());

    // The slots in use, as `fairlane_fairness_running` reports them: every running user job
    // by its user's tier, those of users at their limit included.
    let mut slots: BTreeMap<Tier, i64> = Tier::ALL.iter().map(|t| (*t, 0)).collect();
    for &(_, tier, n, _) in &users {
        *slots.entry(tier).or_insert(0) += i64::try_from(n).unwrap();
    }
    assert_eq!(gauges.running(), slots);

    // A count that fails reports nothing rather than the last counts as if current.
    let closed = h.db.pool_with(1).await;
    closed.close().await;
    assert!(gauges.refresh(&closed, &limits).await.is_err());
    assert!(gauges.waiting().is_empty(), "{:?}", gauges.waiting());
    assert!(gauges.running().is_empty(), "{:?}", gauges.running());
    gauges.refresh(&h.db.pool, &limits).await.unwrap();
    assert_eq!(gauges.running(), slots);
}

/// Without the gate, jobs taken by one fetch leave room for each other, and jobs of different
/// fetches count each other whole, even when the two fetches (of one worker and queue) started
/// in the same microsecond: a fetch is told apart by its transaction, not by its timestamp.
#[tokio::test]
async fn jobs_of_two_fetches_started_in_the_same_instant_count_each_other() {
    let h = Harness::new().await;
    let free = h.user(Tier::Free).await;
    let jobs = h.enqueue(Lane::Default, Some(free), 10, 2).await;
    let queues = vec![Harness::queue(Lane::Default).to_string()];
    let start = "UPDATE fairlane_job SET state = 'running', attempt = 1, \
                 attempted_at = '2026-11-27T00:00:00Z', attempted_by = '{worker-1}' \
                 WHERE id = ANY($1)";
    let mut conn = h.db.pool.acquire().await.unwrap();

    // One fetch: one transaction starts both.
    sqlx::query(start)
        .bind(&jobs)
        .execute(&h.db.pool)
        .await
        .unwrap();
    let others = fairness::store::other_running(&mut conn, &queues, free, jobs[0]).await;
    assert_eq!(others.unwrap(), 0);

    // Two fetches, one job each, same worker, same instant.
    for job in &jobs {
        sqlx::query(start)
            .bind(vec![*job])
            .execute(&h.db.pool)
            .await
            .unwrap();
    }
    let others = fairness::store::other_running(&mut conn, &queues, free, jobs[0]).await;
    assert_eq!(others.unwrap(), 1);
}
