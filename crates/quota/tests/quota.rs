//! Quota against real PostgreSQL: the reservation race under real concurrency, billing exactly
//! once through the real queue, release on cancel, usage, cleanup and the reservations gauge.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use common::{AnalysisArgs, Service, Tier, select_queue};
use queue::{CancelResult, Client, Engine, EngineConfig, JobState, NewJob, Transition, Workers};
use quota::{Quota, QuotaConfig, QuotaError, QuotaHook};
use sqlx::PgPool;
use testkit::TestDb;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

async fn user(pool: &PgPool, tier: &str) -> Uuid {
    let (id,): (Uuid,) = sqlx::query_as(
        "INSERT INTO users (name, tier) VALUES ('t', $1::text::fairlane_tier) RETURNING id",
    )
    .bind(tier)
    .fetch_one(pool)
    .await
    .unwrap();
    id
}

async fn seed_usage(pool: &PgPool, user: Uuid, event: &str, amount: i32) {
    sqlx::query(
        "INSERT INTO usage_events (user_id, event_type, amount) \
         VALUES ($1, $2::text::fairlane_usage_event_type, $3)",
    )
    .bind(user)
    .bind(event)
    .bind(amount)
    .execute(pool)
    .await
    .unwrap();
}

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    let (n,): (i64,) = sqlx::query_as(sql).fetch_one(pool).await.unwrap();
    n
}

/// The running totals the triggers keep equal the linked reservations, exactly, and the daily
/// used totals equal the usage events.
async fn assert_totals_exact(pool: &PgPool) {
    assert_used_exact(pool).await;
    let drift: Vec<(Uuid, String, i64, i64)> = sqlx::query_as(
        "SELECT coalesce(t.user_id, r.user_id), coalesce(t.event_type, r.event_type)::text, \
                coalesce(t.reserved, 0), coalesce(r.reserved, 0) \
         FROM quota_reserved_totals t \
         FULL JOIN (SELECT user_id, event_type, sum(reserved_amount)::int8 AS reserved \
                    FROM quota_reservations WHERE job_id IS NOT NULL GROUP BY 1, 2) r \
           ON r.user_id = t.user_id AND r.event_type = t.event_type \
         WHERE coalesce(t.reserved, 0) <> coalesce(r.reserved, 0)",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(drift.is_empty(), "totals drifted: {drift:?}");
}

/// An analysis job of `user`, in the lane of `tier`.
fn analysis_job(user: Uuid, tier: Tier) -> NewJob {
    let args = AnalysisArgs {
        user_id: Some(user),
        analysis_id: Uuid::new_v4(),
        repository: "https://example.com/r.git".into(),
        git_ref: None,
    };
    NewJob::new(select_queue(Service::Analysis, tier, false), &args).unwrap()
}

fn quota() -> Quota {
    Quota::new(QuotaConfig::default()).unwrap()
}

/// An analysis unit of `user` reserved (without a job: to be linked later) and committed.
async fn committed_reservation(pool: &PgPool, quota: &Quota, user: Uuid) -> quota::Reservation {
    let mut tx = pool.begin().await.unwrap();
    let reservation = quota
        .reserve(&mut tx, user, Service::Analysis, Utc::now())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    reservation
}

/// Reserve + job insert + link in one transaction, the way the web service does it.
async fn reserve_and_enqueue(
    pool: &PgPool,
    client: &Client,
    quota: &Quota,
    user: Uuid,
) -> Result<i64, QuotaError> {
    enqueue(pool, client, quota, user, false).await
}

/// Check, insert the job, reserve with its id (`link_later`: ADR-21's order instead — reserve,
/// insert the job, attach).
async fn enqueue(
    pool: &PgPool,
    client: &Client,
    quota: &Quota,
    user: Uuid,
    link_later: bool,
) -> Result<i64, QuotaError> {
    let mut tx = pool.begin().await.unwrap();
    if !link_later {
        let grant = quota
            .check(&mut tx, user, Service::Analysis, Utc::now())
            .await?;
        let inserted = client
            .insert_tx(&mut tx, analysis_job(user, grant.tier))
            .await
            .unwrap();
        let reservation = grant.reserve(&mut tx, Some(inserted.job.id)).await?;
        assert_eq!(reservation.amount, 1);
        tx.commit().await.unwrap();
        return Ok(inserted.job.id);
    }
    let reservation = quota
        .reserve(&mut tx, user, Service::Analysis, Utc::now())
        .await?;
    let inserted = client
        .insert_tx(&mut tx, analysis_job(user, reservation.tier))
        .await
        .unwrap();
    reservation.attach_job(&mut tx, inserted.job.id).await?;
    tx.commit().await.unwrap();
    Ok(inserted.job.id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_reservations_never_exceed_the_limit() {
    let db = TestDb::new().await;
    let pool = db.pool_with(40).await;
    let client = Client::new(pool.clone());
    let quota = quota();
    let user = user(&pool, "enterprise").await;
    for round in 0..10 {
        sqlx::query("DELETE FROM usage_events")
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query("DELETE FROM quota_reservations")
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query("DELETE FROM fairlane_job")
            .execute(&pool)
            .await
            .unwrap();
        seed_usage(&pool, user, "analysis", 4998).await;
        let mut tasks = Vec::new();
        for i in 0..60 {
            let (pool, client, quota) = (pool.clone(), client.clone(), quota.clone());
            // Both ways of reserving, racing each other.
            tasks.push(tokio::spawn(async move {
                enqueue(&pool, &client, &quota, user, i % 2 == 1).await
            }));
        }
        let mut ok = 0;
        let mut exceeded = 0;
        for t in tasks {
            match t.await.unwrap() {
                Ok(_) => ok += 1,
                Err(QuotaError::Exceeded(e)) => {
                    assert_eq!(e.limit, 5000);
                    assert_eq!(e.used, 4998);
                    assert_eq!(e.reserved, 2);
                    assert_eq!(e.tier, Tier::Enterprise);
                    exceeded += 1;
                }
                Err(e) => panic!("unexpected error {e}"),
            }
        }
        assert_eq!((ok, exceeded), (2, 58), "round {round}");
        assert_eq!(
            count(
                &pool,
                "SELECT COALESCE(SUM(reserved_amount),0)::int8 FROM quota_reservations"
            )
            .await,
            2
        );
        assert_eq!(count(&pool, "SELECT count(*) FROM fairlane_job").await, 2);
        assert_eq!(
            count(
                &pool,
                "SELECT count(*) FROM quota_reservations WHERE job_id IS NULL"
            )
            .await,
            0
        );
    }
    assert_totals_exact(&db.pool).await;
}

/// The check split as the web service sends it: `BEGIN` and the lock in one simple query, then
/// the standings in a statement of their own. A check that had to wait for another holder of the
/// user's lock sees what that holder committed, so the last unit is granted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_check_that_waited_for_the_lock_sees_the_holders_reservation() {
    let db = TestDb::new().await;
    the_split_check_that_waited_sees_the_holders_reservation(&db, db.pool.clone()).await;
}

/// A database whose sessions default to REPEATABLE READ (an operator's `ALTER DATABASE`), on a
/// pool that sets nothing: the split check's `BEGIN` says READ COMMITTED itself, so a check that
/// waited for the lock still sees the holder's reservation; `check`, which runs in its caller's
/// transaction, refuses to decide rather than read a snapshot older than the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_never_decide_on_a_snapshot_older_than_the_lock() {
    let db = TestDb::new().await;
    db.set_default_isolation("repeatable read").await;
    let pool = db.pool_with(4).await;
    the_split_check_that_waited_sees_the_holders_reservation(&db, pool.clone()).await;

    let quota = quota();
    let user = user(&pool, "free").await;
    let mut tx = pool.begin().await.unwrap();
    let refused = quota
        .check(&mut tx, user, Service::Analysis, Utc::now())
        .await;
    assert!(
        matches!(&refused, Err(QuotaError::NotReadCommitted(level)) if level == "repeatable read"),
        "{refused:?}"
    );
    tx.rollback().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        .execute(&mut *tx)
        .await
        .unwrap();
    let grant = quota
        .check(&mut tx, user, Service::Analysis, Utc::now())
        .await
        .unwrap();
    grant.reserve(&mut tx, None).await.unwrap();
    tx.commit().await.unwrap();
}

async fn the_split_check_that_waited_sees_the_holders_reservation(db: &TestDb, pool: PgPool) {
    let client = Client::new(pool.clone());
    let quota = quota();
    let user = user(&db.pool, "free").await;
    seed_usage(&db.pool, user, "analysis", 49).await; // limit 50: one unit left
    let request = [(user, Service::Analysis)];

    // The first holder takes the lock and reserves the last unit, and keeps its transaction open.
    let mut first_conn = pool.acquire().await.unwrap();
    let (mut first, grants) = split_check(&client, &quota, &mut first_conn, &request).await;
    let grant = grants.into_iter().next().unwrap().unwrap();
    let inserted = first.insert(analysis_job(user, grant.tier)).await.unwrap();
    grant
        .reserve(&mut first, Some(inserted.job.id))
        .await
        .unwrap();

    // The second check blocks on the lock until the first commits.
    let second = {
        let (pool, client, quota) = (pool.clone(), client.clone(), quota.clone());
        tokio::spawn(async move {
            let mut conn = pool.acquire().await.unwrap();
            let (tx, outcome) = split_check(&client, &quota, &mut conn, &request).await;
            tx.rollback().await.unwrap();
            outcome
        })
    };
    // Seen waiting for a lock by the server, not merely unfinished after a while.
    testkit::eventually(
        Duration::from_secs(10),
        "the second check to wait for the lock",
        || async {
            assert!(
                !second.is_finished(),
                "the second check did not wait for the lock"
            );
            (!testkit::lock_waiting_statements(&db.pool).await.is_empty()).then_some(())
        },
    )
    .await;
    assert!(!second.is_finished());
    first.commit().await.unwrap();
    let outcome = second.await.unwrap();
    assert!(
        matches!(&outcome[0], Err(QuotaError::Exceeded(x)) if x.used == 49 && x.reserved == 1),
        "{outcome:?}"
    );
}

/// The standings of `plan`, read through [`quota::standings_cte`] in a statement of their own.
async fn standings(
    conn: &mut sqlx::PgConnection,
    plan: &quota::CheckPlan,
) -> Vec<quota::StandingRow> {
    let mut args = sqlx::postgres::PgArguments::default();
    plan.bind_standings(&mut args).unwrap();
    let sql = format!(
        "WITH {} SELECT ord, tier, used, reserved, read_at FROM quota_standing",
        quota::standings_cte(1)
    );
    sqlx::query_as_with(sqlx::AssertSqlSafe(sql), args)
        .fetch_all(conn)
        .await
        .unwrap()
}

/// Begins a transaction on `conn` with the lock of `requests`' users, as the web service does,
/// then reads their standings in a statement of its own and decides `requests`.
async fn split_check<'c>(
    client: &Client,
    quota: &Quota,
    conn: &'c mut sqlx::PgConnection,
    requests: &[(Uuid, Service)],
) -> (queue::QueueTx<'c>, Vec<Result<quota::Grant, QuotaError>>) {
    let plan = quota.plan(requests.iter().copied(), Utc::now());
    let mut tx = client.begin_on_with(conn, &plan.lock_sql()).await.unwrap();
    let rows = standings(&mut tx, &plan).await;
    let grants = quota.decide(&plan, &rows, requests).unwrap();
    (tx, grants)
}

/// The billing period is the database's, not the caller's guess: a web host whose clock is
/// behind (or a check that waited for its lock across the period's end) must not read the
/// previous period's empty usage and grant what the current period has already spent, and a
/// clock ahead must not skip to the next period's. The split check's `decide` refuses standings
/// read outside its plan's period instead of deciding on them.
#[tokio::test]
async fn the_check_and_the_usage_count_the_databases_billing_period_whatever_the_callers_clock() {
    let db = TestDb::new().await;
    let quota = quota();
    let (free, other) = (user(&db.pool, "free").await, user(&db.pool, "free").await);
    // The free specview limit, 5, all billed in the database's current month.
    seed_usage(&db.pool, free, "specview", 5).await;
    seed_usage(&db.pool, other, "specview", 5).await;
    let (db_now,): (chrono::DateTime<Utc>,) = sqlx::query_as("SELECT now()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let period = quota.period(db_now);
    let behind = period.start - chrono::Duration::milliseconds(1);
    let ahead = period.end + chrono::Duration::milliseconds(1);
    for (user, clock) in [(free, behind), (other, ahead)] {
        let mut tx = db.pool.begin().await.unwrap();
        let refused = quota
            .check(&mut tx, user, Service::Specview, clock)
            .await
            .unwrap_err();
        let QuotaError::Exceeded(x) = refused else {
            panic!("expected quota_exceeded at {clock}, got {refused:?}");
        };
        assert_eq!((x.used, x.limit, x.period), (5, 5, period), "at {clock}");
        // The analysis quota of the same period is untouched.
        let grant = quota
            .check(&mut tx, user, Service::Analysis, clock)
            .await
            .unwrap();
        assert_eq!(grant.period, period);
        // The current usage shown is that period's too.
        let usage = quota.current_usage(&mut tx, user, clock).await.unwrap();
        let specview = usage
            .events
            .iter()
            .find(|e| e.event_type == Service::Specview)
            .unwrap();
        assert_eq!(
            (specview.used, specview.period_start, specview.period_end),
            (5, period.start, period.end),
            "usage at {clock}"
        );
        tx.rollback().await.unwrap();
    }

    // Standings read for a plan of another period are refused by `decide`, and `replan` names
    // the database's period.
    let client = Client::new(db.pool.clone());
    let mut conn = db.pool.acquire().await.unwrap();
    let plan = quota.plan([(free, Service::Specview)], behind);
    let mut tx = client
        .begin_on_with(&mut conn, &plan.lock_sql())
        .await
        .unwrap();
    let rows = standings(&mut tx, &plan).await;
    assert_eq!(rows[0].used, 0, "the plan's own period, October, is empty");
    let error = quota
        .decide(&plan, &rows, &[(free, Service::Specview)])
        .unwrap_err();
    assert!(
        matches!(error, QuotaError::StandingsOutsidePeriod { .. }),
        "{error:?}"
    );
    assert_eq!(quota.replan(&plan, &rows).unwrap().period(), period);
    let (settled, rows) = quota.settle_period(&mut tx, plan, rows).await.unwrap();
    assert_eq!((settled.period(), rows[0].used), (period, 5));
    assert!(quota.replan(&settled, &rows).is_none());
    let refused = quota
        .decide(&settled, &rows, &[(free, Service::Specview)])
        .unwrap()
        .pop()
        .unwrap();
    assert!(
        matches!(refused, Err(QuotaError::Exceeded(_))),
        "{refused:?}"
    );
    tx.rollback().await.unwrap();
}

#[tokio::test]
async fn a_rolled_back_transaction_leaves_no_reservation() {
    let db = TestDb::new().await;
    let quota = quota();
    let user = user(&db.pool, "free").await;
    let mut tx = db.pool.begin().await.unwrap();
    quota
        .reserve(&mut tx, user, Service::Specview, Utc::now())
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM quota_reservations").await,
        0
    );
    let usage = quota
        .usage(&mut db.pool.acquire().await.unwrap(), user, Utc::now())
        .await
        .unwrap();
    assert!(usage.events.iter().all(|e| e.reserved == 0 && e.used == 0));
}

#[tokio::test]
async fn unknown_users_and_unknown_tiers() {
    let db = TestDb::new().await;
    let quota = quota();
    let mut conn = db.pool.acquire().await.unwrap();
    let missing = Uuid::new_v4();
    assert!(matches!(
        quota.reserve(&mut conn, missing, Service::Analysis, Utc::now()).await,
        Err(QuotaError::UnknownUser(id)) if id == missing
    ));
    // A tier value this build does not know (added by a later migration) is treated as Free.
    sqlx::query("ALTER TYPE fairlane_tier ADD VALUE 'gold'")
        .execute(&mut *conn)
        .await
        .unwrap();
    let gold = user(&db.pool, "gold").await;
    let usage = quota.usage(&mut conn, gold, Utc::now()).await.unwrap();
    assert_eq!(usage.tier, Tier::Free);
    assert_eq!(usage.events[0].limit, 50);
    assert_eq!(usage.events[1].limit, 5);
}

#[tokio::test]
async fn usage_reports_used_reserved_and_the_period() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let quota = quota();
    let user = user(&db.pool, "pro").await;
    seed_usage(&db.pool, user, "analysis", 7).await;
    seed_usage(&db.pool, user, "specview", 2).await;
    // Usage of an earlier month does not count.
    sqlx::query(
        "INSERT INTO usage_events (user_id, event_type, amount, occurred_at) \
         VALUES ($1, 'analysis', 100, now() - interval '40 days')",
    )
    .bind(user)
    .execute(&db.pool)
    .await
    .unwrap();
    reserve_and_enqueue(&db.pool, &client, &quota, user)
        .await
        .unwrap();
    let now = Utc::now();
    let usage = quota
        .usage(&mut db.pool.acquire().await.unwrap(), user, now)
        .await
        .unwrap();
    assert_eq!(usage.tier, Tier::Pro);
    let analysis = &usage.events[0];
    assert_eq!(analysis.event_type, Service::Analysis);
    assert_eq!(
        (analysis.used, analysis.reserved, analysis.limit),
        (7, 1, 1000)
    );
    assert!(analysis.period_start <= now && now < analysis.period_end);
    let specview = &usage.events[1];
    assert_eq!(
        (specview.used, specview.reserved, specview.limit),
        (2, 0, 100)
    );
}

fn transition(job_id: i64, state: JobState) -> Transition {
    Transition {
        job_id,
        queue: "analysis_default".into(),
        kind: "analysis".into(),
        user_id: None,
        state,
    }
}

#[tokio::test]
async fn the_hook_bills_completed_jobs_once_and_releases_failed_ones() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let quota = quota();
    let user = user(&db.pool, "pro").await;
    let a = reserve_and_enqueue(&db.pool, &client, &quota, user)
        .await
        .unwrap();
    let b = reserve_and_enqueue(&db.pool, &client, &quota, user)
        .await
        .unwrap();
    let c = reserve_and_enqueue(&db.pool, &client, &quota, user)
        .await
        .unwrap();
    let d = reserve_and_enqueue(&db.pool, &client, &quota, user)
        .await
        .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let batch = [
        transition(a, JobState::Completed),
        transition(b, JobState::Discarded),
        transition(c, JobState::Cancelled),
        transition(d, JobState::Retryable),
    ];
    let effect = quota::end_reservations(&mut conn, &batch).await.unwrap();
    assert_eq!((effect.released, effect.billed), (3, 1));
    // Replaying the same transitions changes nothing.
    let again = quota::end_reservations(&mut conn, &batch).await.unwrap();
    assert_eq!((again.released, again.billed), (0, 0));
    let billed: Vec<(i64, i32)> =
        sqlx::query_as("SELECT job_id, amount FROM usage_events WHERE job_id IS NOT NULL")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(billed, vec![(a, 1)]);
    let left: Vec<(i64,)> = sqlx::query_as("SELECT job_id FROM quota_reservations")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, vec![(d,)], "the retryable job keeps its reservation");
    assert_totals_exact(&db.pool).await;
}

/// Jobs whose ids already stand on usage events (usage imported with its old job ids, or ids
/// handed out again after `fairlane_job` was restored apart from `usage_events`) are billed when
/// they complete, through the hook and through cleanup alike: a bill is keyed by the
/// reservation it ends, which only one of them can delete.
#[tokio::test]
async fn a_job_whose_id_an_older_usage_event_holds_is_billed_all_the_same() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let quota = quota();
    let user = user(&db.pool, "pro").await;
    let by_hook = reserve_and_enqueue(&db.pool, &client, &quota, user)
        .await
        .unwrap();
    let by_cleanup = reserve_and_enqueue(&db.pool, &client, &quota, user)
        .await
        .unwrap();
    for job in [by_hook, by_cleanup] {
        sqlx::query(
            "INSERT INTO usage_events (user_id, event_type, amount, job_id) \
             VALUES ($1, 'analysis', 7, $2)",
        )
        .bind(user)
        .bind(job)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let mut conn = db.pool.acquire().await.unwrap();
    let effect = quota::end_reservations(&mut conn, &[transition(by_hook, JobState::Completed)])
        .await
        .unwrap();
    assert_eq!((effect.released, effect.billed), (1, 1));
    // Finished by a process without the hook: cleanup bills it.
    sqlx::query("UPDATE fairlane_job SET state = 'completed', finalized_at = now() WHERE id = $1")
        .bind(by_cleanup)
        .execute(&db.pool)
        .await
        .unwrap();
    let report = quota::cleanup(&db.pool, Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!((report.final_job, report.billed), (1, 1));
    // Neither is billed twice by a replay.
    let again = quota::end_reservations(&mut conn, &[transition(by_hook, JobState::Completed)])
        .await
        .unwrap();
    assert_eq!((again.released, again.billed), (0, 0));
    assert_eq!(
        quota::cleanup(&db.pool, Duration::from_secs(3600))
            .await
            .unwrap(),
        quota::CleanupReport::default()
    );
    let usage = quota.usage(&mut conn, user, Utc::now()).await.unwrap();
    assert_eq!(
        (usage.events[0].used, usage.events[0].reserved),
        (7 + 7 + 1 + 1, 0)
    );
    // The new bills are named by their reservations, the ids being taken.
    let unnamed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM usage_events WHERE job_id IS NULL AND reservation_id IS NOT NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(unnamed, 2);
    // The previous release's binaries, still running during a rolling update, bill with
    // `ON CONFLICT (job_id)`: the schema must still accept that.
    sqlx::query(
        "INSERT INTO usage_events (user_id, event_type, amount, job_id) \
         VALUES ($1, 'analysis', 1, $2) ON CONFLICT (job_id) DO NOTHING",
    )
    .bind(user)
    .bind(by_hook)
    .execute(&db.pool)
    .await
    .unwrap();
    assert_totals_exact(&db.pool).await;
}

#[tokio::test]
async fn cancelling_a_waiting_job_through_the_queue_releases_its_reservation() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone()).with_hooks(vec![Arc::new(QuotaHook::new())]);
    let quota = quota();
    let user = user(&db.pool, "free").await;
    let job = reserve_and_enqueue(&db.pool, &client, &quota, user)
        .await
        .unwrap();
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM quota_reservations").await,
        1
    );
    let result = client.cancel(job).await.unwrap().unwrap();
    assert!(matches!(result, CancelResult::Cancelled(_)));
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM quota_reservations").await,
        0
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM usage_events").await,
        0
    );
    assert_totals_exact(&db.pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_completed_by_a_real_engine_are_billed_exactly_once() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone()).with_hooks(vec![Arc::new(QuotaHook::new())]);
    let quota = quota();
    let user = user(&db.pool, "pro").await;
    let mut jobs = Vec::new();
    for _ in 0..20 {
        jobs.push(
            reserve_and_enqueue(&db.pool, &client, &quota, user)
                .await
                .unwrap(),
        );
    }
    let mut workers = Workers::new();
    // Every third job fails once before succeeding: retries keep the reservation.
    workers.register_fn::<AnalysisArgs, _, _>(|ctx, _args| async move {
        if ctx.id() % 3 == 0 && ctx.job().attempt == 1 {
            return Err(queue::JobError::msg("first attempt fails"));
        }
        Ok(())
    });
    let config = EngineConfig {
        poll_interval: Duration::from_millis(100),
        promote_interval: Duration::from_millis(50),
        retry: queue::RetryPolicy {
            base: Duration::from_millis(10),
            factor: 1.0,
            max: Duration::from_millis(20),
            jitter: 0.0,
        },
        ..EngineConfig::default()
    };
    let engine = Engine::builder(client.clone())
        .config(config)
        .queue(select_queue(Service::Analysis, Tier::Pro, false), 4)
        .workers(workers)
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    let handle = tokio::spawn(engine.run(shutdown.clone()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let done = count(
            &db.pool,
            "SELECT count(*) FROM fairlane_job WHERE state = 'completed'",
        )
        .await;
        if done == 20 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {done} of 20 completed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    handle.await.unwrap().unwrap();
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM quota_reservations").await,
        0
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM usage_events").await,
        20
    );
    assert_eq!(
        count(&db.pool, "SELECT count(DISTINCT job_id) FROM usage_events").await,
        20
    );
    let usage = quota
        .usage(&mut db.pool.acquire().await.unwrap(), user, Utc::now())
        .await
        .unwrap();
    assert_eq!((usage.events[0].used, usage.events[0].reserved), (20, 0));
    assert_totals_exact(&db.pool).await;
}

#[tokio::test]
async fn cleanup_removes_orphans_bills_completed_ones_and_never_touches_a_live_jobs_reservation() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let quota = quota();
    let user = user(&db.pool, "enterprise").await;
    let live_old = reserve_and_enqueue(&db.pool, &client, &quota, user)
        .await
        .unwrap();
    let finished = reserve_and_enqueue(&db.pool, &client, &quota, user)
        .await
        .unwrap();
    let deleted = reserve_and_enqueue(&db.pool, &client, &quota, user)
        .await
        .unwrap();
    // A live job whose reservation is ancient and long past its TTL.
    sqlx::query(
        "UPDATE quota_reservations SET created_at = now() - interval '30 days', \
         expires_at = now() - interval '29 days' WHERE job_id = $1",
    )
    .bind(live_old)
    .execute(&db.pool)
    .await
    .unwrap();
    // A job finished by a process without the hook, and one deleted by the queue cleaner.
    sqlx::query("UPDATE fairlane_job SET state = 'completed', finalized_at = now() WHERE id = $1")
        .bind(finished)
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM fairlane_job WHERE id = $1")
        .bind(deleted)
        .execute(&db.pool)
        .await
        .unwrap();
    // Two reservations that never got a job: one past the TTL, one fresh.
    let mut tx = db.pool.begin().await.unwrap();
    quota
        .reserve(&mut tx, user, Service::Specview, Utc::now())
        .await
        .unwrap();
    quota
        .reserve(&mut tx, user, Service::Specview, Utc::now())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    sqlx::query(
        "UPDATE quota_reservations SET created_at = now() - interval '2 hours' \
         WHERE id = (SELECT id FROM quota_reservations WHERE job_id IS NULL LIMIT 1)",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    let mut conn = db.pool.acquire().await.unwrap();
    let active = quota::active_reservations(&mut conn).await.unwrap();
    // Live: the old live job's and both unlinked specview ones (the TTL counts from expires_at,
    // which the backdating above left in the future for one of them).
    assert_eq!(active[&Service::Analysis], 1);
    assert_eq!(active[&Service::Specview], 2);

    let report = quota::cleanup(&db.pool, Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(report.final_job, 1);
    assert_eq!(report.missing_job, 1);
    assert_eq!(report.expired_without_job, 1);
    assert_eq!(report.total(), 3);
    // The job that completed without the hook is billed now, not lost.
    assert_eq!(report.billed, 1);
    let left: Vec<(Option<i64>,)> =
        sqlx::query_as("SELECT job_id FROM quota_reservations ORDER BY job_id NULLS LAST")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(left, vec![(Some(live_old),), (None,)]);
    // Nothing more to do on a second run.
    assert_eq!(
        quota::cleanup(&db.pool, Duration::from_secs(3600))
            .await
            .unwrap(),
        quota::CleanupReport::default()
    );
    let billed: Vec<(Option<i64>, i32)> = sqlx::query_as("SELECT job_id, amount FROM usage_events")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(billed, vec![(Some(finished), 1)]);
    assert_totals_exact(&db.pool).await;
}

/// A backlog larger than a batch is cleaned in several transactions, each of at most a batch:
/// every orphan removed and billed once, the live job's reservation kept, whether the last batch
/// is full (12 of 3 a batch) or not (the second run finds nothing).
#[tokio::test]
async fn cleanup_works_through_a_backlog_in_batches() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let quota = quota();
    let user = user(&db.pool, "enterprise").await;
    let live = reserve_and_enqueue(&db.pool, &client, &quota, user)
        .await
        .unwrap();
    let mut finished = Vec::new();
    for _ in 0..12 {
        finished.push(
            reserve_and_enqueue(&db.pool, &client, &quota, user)
                .await
                .unwrap(),
        );
    }
    // Finished by a process without the hook.
    sqlx::query(
        "UPDATE fairlane_job SET state = 'completed', finalized_at = now() WHERE id = ANY($1)",
    )
    .bind(&finished)
    .execute(&db.pool)
    .await
    .unwrap();
    let report = quota::cleanup_in_batches(&db.pool, Duration::from_secs(3600), 3)
        .await
        .unwrap();
    assert_eq!(
        (report.final_job, report.billed, report.total()),
        (12, 12, 12)
    );
    let left: Vec<i64> = sqlx::query_scalar("SELECT job_id FROM quota_reservations")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, [live]);
    let mut billed: Vec<i64> = sqlx::query_scalar("SELECT job_id FROM usage_events")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    billed.sort_unstable();
    finished.sort_unstable();
    assert_eq!(billed, finished);
    assert_eq!(
        quota::cleanup_in_batches(&db.pool, Duration::from_secs(3600), 3)
            .await
            .unwrap(),
        quota::CleanupReport::default()
    );
    assert_totals_exact(&db.pool).await;
}

#[tokio::test]
async fn reserved_totals_follow_every_change_to_reservations() {
    let db = TestDb::new().await;
    let (a, b) = (user(&db.pool, "pro").await, user(&db.pool, "free").await);
    let reserve = |user: Uuid, event: &'static str, amount: i32, job: Option<i64>| {
        let pool = db.pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO quota_reservations (user_id, event_type, reserved_amount, job_id, expires_at) \
                 VALUES ($1, $2::text::fairlane_usage_event_type, $3, $4, now() + interval '1 hour')",
            )
            .bind(user)
            .bind(event)
            .bind(amount)
            .bind(job)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    let total = |user: Uuid, event: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT coalesce((SELECT reserved FROM quota_reserved_totals \
                   WHERE user_id = $1 AND event_type = $2::text::fairlane_usage_event_type), 0)",
            )
            .bind(user)
            .bind(event)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    reserve(a, "analysis", 2, Some(1)).await;
    reserve(a, "analysis", 3, Some(2)).await;
    reserve(a, "specview", 1, Some(3)).await;
    reserve(b, "analysis", 1, None).await; // unlinked: not in the total
    assert_eq!(total(a, "analysis").await, 5);
    assert_eq!(total(a, "specview").await, 1);
    assert_eq!(total(b, "analysis").await, 0);
    // Linking, re-pointing and resizing in one statement.
    sqlx::query(
        "UPDATE quota_reservations SET job_id = coalesce(job_id, 4), \
           reserved_amount = CASE WHEN job_id = 2 THEN 1 ELSE reserved_amount END",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(total(a, "analysis").await, 3);
    assert_eq!(total(b, "analysis").await, 1);
    assert_totals_exact(&db.pool).await;
    // The check sees the total plus live unlinked reservations, and nothing else.
    reserve(b, "analysis", 1, None).await;
    let usage = quota()
        .usage(&mut db.pool.acquire().await.unwrap(), b, Utc::now())
        .await
        .unwrap();
    assert_eq!(usage.events[0].reserved, 2);
    sqlx::query("UPDATE quota_reservations SET expires_at = now() - interval '1 second' WHERE job_id IS NULL")
        .execute(&db.pool)
        .await
        .unwrap();
    let usage = quota()
        .usage(&mut db.pool.acquire().await.unwrap(), b, Utc::now())
        .await
        .unwrap();
    assert_eq!(
        usage.events[0].reserved, 1,
        "an expired unlinked reservation no longer counts"
    );
    // Deleting some, deleting a user (cascading to both tables), truncating.
    sqlx::query("DELETE FROM quota_reservations WHERE job_id = 1")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(total(a, "analysis").await, 1);
    assert_totals_exact(&db.pool).await;
    sqlx::query("DELETE FROM users WHERE id = $1")
        .bind(b)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_totals_exact(&db.pool).await;
    sqlx::query("TRUNCATE quota_reservations")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(total(a, "analysis").await, 0);
    assert_totals_exact(&db.pool).await;
}

/// The daily used totals the triggers keep equal the usage events, exactly (days with a total
/// of zero may stay behind; they add nothing).
async fn assert_used_exact(pool: &PgPool) {
    let drift: Vec<(Uuid, String, chrono::NaiveDate, i64, i64)> = sqlx::query_as(
        "SELECT coalesce(t.user_id, e.user_id), coalesce(t.event_type, e.event_type)::text, \
                coalesce(t.day, e.day), coalesce(t.used, 0), coalesce(e.used, 0) \
         FROM quota_used_daily t \
         FULL JOIN (SELECT user_id, event_type, (occurred_at AT TIME ZONE 'UTC')::date AS day, \
                           sum(amount)::int8 AS used \
                    FROM usage_events GROUP BY 1, 2, 3) e \
           ON e.user_id = t.user_id AND e.event_type = t.event_type AND e.day = t.day \
         WHERE coalesce(t.used, 0) <> coalesce(e.used, 0)",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(drift.is_empty(), "daily used totals drifted: {drift:?}");
}

async fn bill_at(pool: &PgPool, user: Uuid, event: &str, amount: i32, at: &str) {
    sqlx::query(
        "INSERT INTO usage_events (user_id, event_type, amount, occurred_at) \
         VALUES ($1, $2::text::fairlane_usage_event_type, $3, $4::text::timestamptz)",
    )
    .bind(user)
    .bind(event)
    .bind(amount)
    .bind(at)
    .execute(pool)
    .await
    .unwrap();
}

fn at(s: &str) -> chrono::DateTime<Utc> {
    s.parse().unwrap()
}

async fn used(quota: &Quota, pool: &PgPool, user: Uuid, now: &str) -> (i64, i64) {
    let usage = quota
        .usage(&mut pool.acquire().await.unwrap(), user, at(now))
        .await
        .unwrap();
    (usage.events[0].used, usage.events[1].used)
}

#[tokio::test]
async fn used_totals_follow_every_change_to_usage_events_and_count_whole_utc_days() {
    let db = TestDb::new().await;
    let (a, b) = (user(&db.pool, "pro").await, user(&db.pool, "free").await);
    // Either side of both ends of April 2026, and an event billed from a session far east of
    // UTC, where it is already May: it is counted by its UTC day.
    bill_at(&db.pool, a, "analysis", 2, "2026-03-31T23:59:59.999Z").await;
    bill_at(&db.pool, a, "analysis", 3, "2026-04-01T00:00:00Z").await;
    bill_at(&db.pool, a, "analysis", 4, "2026-04-30T23:59:59.999Z").await;
    bill_at(&db.pool, a, "analysis", 5, "2026-05-01T00:00:00Z").await;
    bill_at(&db.pool, a, "specview", 1, "2026-04-15T08:00:00Z").await;
    bill_at(&db.pool, b, "analysis", 1, "2026-04-10T08:00:00Z").await;
    let mut east = db.pool.acquire().await.unwrap();
    sqlx::query("SET TIME ZONE 'Pacific/Kiritimati'")
        .execute(&mut *east)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO usage_events (user_id, event_type, amount, occurred_at) \
         VALUES ($1, 'analysis', 10, '2026-04-30T23:30:00Z')",
    )
    .bind(a)
    .execute(&mut *east)
    .await
    .unwrap();
    sqlx::query("RESET TIME ZONE")
        .execute(&mut *east)
        .await
        .unwrap();
    drop(east);
    assert_used_exact(&db.pool).await;

    let monthly = quota();
    assert_eq!(
        used(&monthly, &db.pool, a, "2026-04-20T12:00:00Z").await,
        (17, 1)
    );
    assert_eq!(
        used(&monthly, &db.pool, a, "2026-03-02T00:00:00Z").await,
        (2, 0)
    );
    assert_eq!(
        used(&monthly, &db.pool, a, "2026-05-31T23:59:59Z").await,
        (5, 0)
    );
    assert_eq!(
        used(&monthly, &db.pool, b, "2026-04-01T00:00:00Z").await,
        (1, 0)
    );
    let daily = Quota::new(QuotaConfig {
        quota_billing_period: quota::BillingCycle::Day,
        ..QuotaConfig::default()
    })
    .unwrap();
    assert_eq!(
        used(&daily, &db.pool, a, "2026-04-30T00:00:00Z").await,
        (14, 0)
    );
    assert_eq!(
        used(&daily, &db.pool, a, "2026-04-01T23:00:00Z").await,
        (3, 0)
    );

    // Moving events between users, days and amounts in one statement.
    sqlx::query(
        "UPDATE usage_events SET \
           user_id = CASE WHEN amount = 3 THEN $2 ELSE user_id END, \
           occurred_at = CASE WHEN amount = 4 THEN occurred_at + interval '1 ms' ELSE occurred_at END, \
           amount = CASE WHEN amount = 10 THEN 6 ELSE amount END \
         WHERE user_id = $1",
    )
    .bind(a)
    .bind(b)
    .execute(&db.pool)
    .await
    .unwrap();
    assert_used_exact(&db.pool).await;
    assert_eq!(
        used(&monthly, &db.pool, a, "2026-04-20T12:00:00Z").await,
        (6, 1)
    );
    assert_eq!(
        used(&monthly, &db.pool, a, "2026-05-20T12:00:00Z").await,
        (9, 0)
    );
    assert_eq!(
        used(&monthly, &db.pool, b, "2026-04-20T12:00:00Z").await,
        (4, 0)
    );

    // Deleting some, refusing to delete a user who has any (billing outlives the user), then
    // deleting them deliberately with the user's daily totals; truncating.
    sqlx::query("DELETE FROM usage_events WHERE amount = 5")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_used_exact(&db.pool).await;
    assert_eq!(
        used(&monthly, &db.pool, a, "2026-05-20T12:00:00Z").await,
        (4, 0)
    );
    let events_of_b = "SELECT count(*) FROM usage_events WHERE user_id = $1";
    let before: i64 = sqlx::query_scalar(events_of_b)
        .bind(b)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(before > 0);
    let refused = sqlx::query("DELETE FROM users WHERE id = $1")
        .bind(b)
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert_eq!(
        refused
            .as_database_error()
            .and_then(|d| d.constraint())
            .map(str::to_owned)
            .as_deref(),
        Some("usage_events_user_id_fkey"),
        "{refused}"
    );
    let after: i64 = sqlx::query_scalar(events_of_b)
        .bind(b)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(after, before, "the refused delete kept every event");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DELETE FROM usage_events WHERE user_id = '{b}'; DELETE FROM users WHERE id = '{b}'"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    assert_used_exact(&db.pool).await;
    sqlx::query("TRUNCATE usage_events")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_used_exact(&db.pool).await;
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM quota_used_daily").await,
        0
    );
    assert_eq!(
        used(&monthly, &db.pool, a, "2026-04-20T12:00:00Z").await,
        (0, 0)
    );
}

#[tokio::test]
async fn concurrent_billing_of_one_user_adds_up_exactly() {
    let db = TestDb::new().await;
    let (a, b) = (user(&db.pool, "pro").await, user(&db.pool, "pro").await);
    let tasks: Vec<_> = (0..8)
        .map(|task| {
            let pool = db.pool.clone();
            tokio::spawn(async move {
                for i in 0..40 {
                    // Each statement bills both users, in an order that differs between tasks:
                    // the totals are upserted in key order, so they cannot deadlock.
                    let (first, second) = if (task + i) % 2 == 0 { (a, b) } else { (b, a) };
                    sqlx::query(
                        "INSERT INTO usage_events (user_id, event_type, amount) \
                         VALUES ($1, 'analysis', 1), ($2, 'analysis', 2)",
                    )
                    .bind(first)
                    .bind(second)
                    .execute(&pool)
                    .await
                    .unwrap();
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    assert_used_exact(&db.pool).await;
    assert_eq!(
        count(
            &db.pool,
            "SELECT sum(used)::int8 FROM quota_used_daily WHERE event_type = 'analysis'"
        )
        .await,
        8 * 40 * 3
    );
}

#[tokio::test]
async fn the_daily_totals_migration_fills_them_from_the_events_already_billed() {
    let db = TestDb::new().await;
    let (a, b) = (user(&db.pool, "pro").await, user(&db.pool, "free").await);
    // Back to the schema before the migration (its table, triggers and functions gone, the
    // period index back, the migration not applied), then usage billed as it was then.
    sqlx::raw_sql(
        "DROP TABLE quota_used_daily; \
         DROP TRIGGER quota_used_on_insert ON usage_events; \
         DROP TRIGGER quota_used_on_update ON usage_events; \
         DROP TRIGGER quota_used_on_delete ON usage_events; \
         DROP TRIGGER quota_used_on_truncate ON usage_events; \
         DROP FUNCTION fairlane_quota_used_apply(); \
         DROP FUNCTION fairlane_quota_used_clear(); \
         CREATE INDEX usage_events_period ON usage_events (user_id, event_type, occurred_at) \
           INCLUDE (amount); \
         DELETE FROM _sqlx_migrations WHERE description = 'quota used daily'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    bill_at(&db.pool, a, "analysis", 2, "2026-03-31T23:59:59Z").await;
    bill_at(&db.pool, a, "analysis", 3, "2026-04-01T00:00:00Z").await;
    bill_at(&db.pool, a, "analysis", 4, "2026-04-01T12:00:00Z").await;
    bill_at(&db.pool, a, "specview", 1, "2026-04-15T08:00:00Z").await;
    bill_at(&db.pool, b, "analysis", 5, "2026-04-30T23:59:59Z").await;

    schema::migrate(&db.pool).await.unwrap();
    schema::check_applied(&db.pool).await.unwrap();
    assert_used_exact(&db.pool).await;
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM quota_used_daily").await,
        4,
        "one row per user, event type and UTC day"
    );
    let monthly = quota();
    assert_eq!(
        used(&monthly, &db.pool, a, "2026-04-20T12:00:00Z").await,
        (7, 1)
    );
    assert_eq!(
        used(&monthly, &db.pool, b, "2026-04-20T12:00:00Z").await,
        (5, 0)
    );
    // The triggers are in place again: billing after the migration keeps the totals.
    bill_at(&db.pool, b, "analysis", 1, "2026-04-02T00:00:00Z").await;
    assert_used_exact(&db.pool).await;
    assert!(
        !sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_indexes WHERE indexname = 'usage_events_period')"
        )
        .fetch_one(&db.pool)
        .await
        .unwrap(),
        "the period index is dropped"
    );
}

/// A transaction that began while a reservation still counted cannot link it once it has
/// expired: a check in between no longer counted it and granted its units to another request,
/// so linking it would count them twice. Expiry is judged by the clock when the link is made,
/// under the user's lock, not at the linking transaction's start.
#[tokio::test]
async fn a_reservation_that_expires_while_its_transaction_runs_cannot_be_attached() {
    let db = TestDb::new().await;
    let quota = Quota::new(QuotaConfig {
        quota_analysis_pro_limit: 1,
        ..QuotaConfig::default()
    })
    .unwrap();
    let user = user(&db.pool, "pro").await;
    let reservation = committed_reservation(&db.pool, &quota, user).await;
    sqlx::query(
        "UPDATE quota_reservations SET expires_at = clock_timestamp() + interval '1 second'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // The linking transaction starts while the reservation counts …
    let mut linking = db.pool.begin().await.unwrap();
    sqlx::query("SELECT now()")
        .execute(&mut *linking)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // … and after it expired, a check grants its unit to another request.
    let mut tx = db.pool.begin().await.unwrap();
    let grant = quota
        .check(&mut tx, user, Service::Analysis, Utc::now())
        .await
        .unwrap();
    grant.reserve(&mut tx, Some(2)).await.unwrap();
    tx.commit().await.unwrap();
    let attached = reservation.attach_job(&mut linking, 1).await;
    linking.commit().await.unwrap();
    assert!(
        matches!(attached, Err(QuotaError::UnknownReservation(_))),
        "{attached:?}"
    );
    let (reserved,): (i64,) = sqlx::query_as(
        "SELECT coalesce(sum(reserved), 0)::bigint FROM quota_reserved_totals WHERE user_id = $1",
    )
    .bind(user)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(reserved, 1, "more reserved than the limit of 1");
    assert_totals_exact(&db.pool).await;
}

/// A reservation links to one job, and only while it still counts: one that expired may have
/// had its units granted to others, so linking it would count them twice.
#[tokio::test]
async fn an_expired_or_linked_reservation_cannot_be_attached() {
    let db = TestDb::new().await;
    let quota = quota();
    let user = user(&db.pool, "pro").await;
    let reservation = committed_reservation(&db.pool, &quota, user).await;
    sqlx::query("UPDATE quota_reservations SET expires_at = now() - interval '1 second'")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    assert!(matches!(
        reservation.attach_job(&mut conn, 1).await,
        Err(QuotaError::UnknownReservation(_))
    ));
    sqlx::query("UPDATE quota_reservations SET expires_at = now() + interval '1 hour'")
        .execute(&db.pool)
        .await
        .unwrap();
    reservation.attach_job(&mut conn, 1).await.unwrap();
    assert!(matches!(
        reservation.attach_job(&mut conn, 2).await,
        Err(QuotaError::UnknownReservation(_))
    ));
    assert_totals_exact(&db.pool).await;
}

/// A cleanup running while reservations made earlier are linked to their jobs never takes a
/// linked reservation for an orphan: with a TTL of zero every unlinked reservation is a
/// candidate, so each link races a cleanup. A reservation the cleanup removed first cannot be
/// linked (its job is rolled back); one linked first stays with its live job.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cleanup_racing_links_never_removes_a_live_jobs_reservation() {
    const LINKERS: usize = 4;
    const ROUNDS: usize = 150;
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let quota = Arc::new(quota());
    let user = user(&db.pool, "enterprise").await;
    let linking = CancellationToken::new();
    let cleaner = {
        let pool = db.pool.clone();
        let linking = linking.clone();
        tokio::spawn(async move {
            let mut reports = Vec::new();
            while !linking.is_cancelled() {
                reports.push(quota::cleanup(&pool, Duration::ZERO).await.unwrap());
            }
            reports
        })
    };
    let linkers: Vec<_> = (0..LINKERS)
        .map(|_| {
            let pool = db.pool.clone();
            let client = client.clone();
            let quota = Arc::clone(&quota);
            tokio::spawn(async move {
                let (mut linked, mut refused) = (0_u64, 0_u64);
                for _ in 0..ROUNDS {
                    let reservation = committed_reservation(&pool, &quota, user).await;
                    let mut tx = pool.begin().await.unwrap();
                    let inserted = client
                        .insert_tx(&mut tx, analysis_job(user, reservation.tier))
                        .await
                        .unwrap();
                    match reservation.attach_job(&mut tx, inserted.job.id).await {
                        Ok(()) => {
                            tx.commit().await.unwrap();
                            linked += 1;
                        }
                        Err(QuotaError::UnknownReservation(_)) => {
                            tx.rollback().await.unwrap();
                            refused += 1;
                        }
                        Err(other) => panic!("attach failed: {other}"),
                    }
                }
                (linked, refused)
            })
        })
        .collect();
    let (mut linked, mut refused) = (0_u64, 0_u64);
    for linker in linkers {
        let (l, r) = linker.await.unwrap();
        linked += l;
        refused += r;
    }
    linking.cancel();
    let reports = cleaner.await.unwrap();
    let missing: u64 = reports.iter().map(|r| r.missing_job).sum();
    let expired: u64 = reports.iter().map(|r| r.expired_without_job).sum();
    assert_eq!(
        missing, 0,
        "a live job's reservation was removed as orphaned"
    );
    assert_eq!(
        expired, refused,
        "every refused link is one the cleanup removed"
    );
    assert!(
        linked > 0 && refused > 0,
        "the race was not exercised: {linked} linked, {refused} refused"
    );
    let unreserved_jobs = count(
        &db.pool,
        "SELECT count(*) FROM fairlane_job j \
         WHERE NOT EXISTS (SELECT 1 FROM quota_reservations r WHERE r.job_id = j.id)",
    )
    .await;
    assert_eq!(unreserved_jobs, 0);
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM quota_reservations").await,
        i64::try_from(linked).unwrap()
    );
    assert_totals_exact(&db.pool).await;
}
