//! `cargo bench -p quota --bench quota`: what a quota check's read of the standings costs as
//! users' billed usage grows, with used units read from the daily running totals (ADR 0011)
//! and, for reference, summed over the period's usage events as before that ADR. Prints a
//! markdown report; every number comes from this run.
//!
//! Each case bills `events` usage events to each of 16 users (a full batch's worth of distinct
//! users), spread over the current billing period up to now, then times the read of the 16
//! users' standings (`BENCH_READS` times, default 300) as the web service's batch runs it.

#![allow(clippy::print_stdout, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use chrono::Utc;
use common::Service;
use quota::{Quota, QuotaConfig, StandingRow, standings_cte};
use sqlx::postgres::PgArguments;
use sqlx::{Arguments, PgPool};
use testkit::TestDb;
use uuid::Uuid;

const USERS: usize = 16;

/// The standings read as it was before ADR 0011: the same statement, but with used units summed
/// over the period's events through their index.
const SUMMED_EVENTS: &str = "WITH quota_standing AS ( \
       SELECT i.ord, u.tier::text AS tier, \
         (SELECT COALESCE(SUM(e.amount), 0)::int8 FROM usage_events e \
           WHERE e.user_id = i.user_id AND e.event_type = i.event_type \
             AND e.occurred_at >= $3 AND e.occurred_at < $4) AS used, \
         COALESCE((SELECT t.reserved FROM quota_reserved_totals t \
                    WHERE t.user_id = i.user_id AND t.event_type = i.event_type), 0) \
         + (SELECT COALESCE(SUM(r.reserved_amount), 0)::int8 FROM quota_reservations r \
             WHERE r.user_id = i.user_id AND r.event_type = i.event_type \
               AND r.job_id IS NULL AND r.expires_at > now()) AS reserved \
       FROM unnest($1::uuid[], $2::text[]::fairlane_usage_event_type[]) \
            WITH ORDINALITY AS i(user_id, event_type, ord) \
       LEFT JOIN users u ON u.id = i.user_id \
     ) SELECT * FROM quota_standing";

struct Timings {
    mean: Duration,
    p99: Duration,
}

fn timings(mut samples: Vec<Duration>) -> Timings {
    samples.sort_unstable();
    let total: Duration = samples.iter().sum();
    let count = u32::try_from(samples.len()).unwrap();
    let p99 = samples[(samples.len() * 99 / 100).min(samples.len() - 1)];
    Timings {
        mean: total / count,
        p99,
    }
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1000.0)
}

async fn bill(pool: &PgPool, users: &[Uuid], events: usize) {
    sqlx::query("TRUNCATE usage_events")
        .execute(pool)
        .await
        .unwrap();
    if events > 0 {
        // Spread over the period so far, like real usage: one event every so often.
        sqlx::query(
            "INSERT INTO usage_events (user_id, event_type, amount, occurred_at) \
             SELECT u, 'analysis', 1, \
                    date_trunc('month', now()) + (now() - date_trunc('month', now())) * g / ($2 + 1) \
             FROM unnest($1::uuid[]) AS u, generate_series(1, $2) AS g",
        )
        .bind(users)
        .bind(i64::try_from(events).unwrap())
        .execute(pool)
        .await
        .unwrap();
    }
    // Best case for the summed read: index-only scans without heap fetches.
    sqlx::query("VACUUM ANALYZE usage_events")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("VACUUM ANALYZE quota_used_daily")
        .execute(pool)
        .await
        .unwrap();
}

/// Times `reads` runs of `sql` (the standings of `users`, one row each) on one connection,
/// with parameters from `bind`, made anew for each read as the web service's batches do.
async fn time_reads(
    pool: &PgPool,
    sql: &str,
    users: &[Uuid],
    reads: usize,
    bind: impl Fn(&mut PgArguments),
) -> Timings {
    let mut conn = pool.acquire().await.unwrap();
    let mut samples = Vec::with_capacity(reads);
    for _ in 0..reads {
        let mut args = PgArguments::default();
        bind(&mut args);
        let statement = sqlx::AssertSqlSafe(sql.to_owned());
        let started = Instant::now();
        let rows: Vec<StandingRow> = sqlx::query_as_with(statement, args)
            .fetch_all(&mut *conn)
            .await
            .unwrap();
        samples.push(started.elapsed());
        assert_eq!(rows.len(), users.len());
    }
    timings(samples)
}

async fn time_daily_totals(pool: &PgPool, quota: &Quota, users: &[Uuid], reads: usize) -> Timings {
    let sql = format!("WITH {} SELECT * FROM quota_standing", standings_cte(1));
    time_reads(pool, &sql, users, reads, |args| {
        let plan = quota.plan(users.iter().map(|u| (*u, Service::Analysis)), Utc::now());
        plan.bind_standings(args).unwrap();
    })
    .await
}

async fn time_summed_events(pool: &PgPool, quota: &Quota, users: &[Uuid], reads: usize) -> Timings {
    time_reads(pool, SUMMED_EVENTS, users, reads, |args| {
        let period = quota.period(Utc::now());
        args.add(users).unwrap();
        args.add(vec![Service::Analysis.as_str(); users.len()])
            .unwrap();
        args.add(period.start).unwrap();
        args.add(period.end).unwrap();
    })
    .await
}

#[tokio::main]
async fn main() {
    let reads = testkit::bench::env_usize("BENCH_READS", 300);
    let db = TestDb::new().await;
    let pool = db.pool.clone();
    let quota = Quota::new(QuotaConfig::default()).unwrap();
    let mut users = Vec::with_capacity(USERS);
    for n in 0..USERS {
        let id: Uuid = sqlx::query_scalar(
            "INSERT INTO users (name, tier) VALUES ($1, 'enterprise') RETURNING id",
        )
        .bind(format!("bench-{n}"))
        .fetch_one(&pool)
        .await
        .unwrap();
        users.push(id);
    }
    // The index the summed read used; ADR 0011's migration dropped it.
    sqlx::query(
        "CREATE INDEX usage_events_period ON usage_events (user_id, event_type, occurred_at) \
         INCLUDE (amount)",
    )
    .execute(&pool)
    .await
    .unwrap();

    println!(
        "| usage events per user (16 users) | standings read, daily totals: mean | p99 | used summed over events (before ADR 0011): mean | p99 |"
    );
    println!("|---:|---:|---:|---:|---:|");
    for events in [0, 100, 1_000, 5_000] {
        bill(&pool, &users, events).await;
        let used: i64 =
            sqlx::query_scalar("SELECT COALESCE(sum(used), 0)::int8 FROM quota_used_daily")
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(
            used,
            i64::try_from(events * USERS).unwrap(),
            "the totals follow the events"
        );
        let daily = time_daily_totals(&pool, &quota, &users, reads).await;
        let summed = time_summed_events(&pool, &quota, &users, reads).await;
        println!(
            "| {events} | {} | {} | {} | {} |",
            ms(daily.mean),
            ms(daily.p99),
            ms(summed.mean),
            ms(summed.p99)
        );
    }
    println!();
    println!(
        "Each cell: {reads} reads of the 16 users' standings on one connection, round trip included."
    );
}
