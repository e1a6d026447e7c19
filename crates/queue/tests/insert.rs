//! Inserting jobs: transactions, uniqueness under concurrency, batches and bulk COPY.

mod support;

use queue::{Client, JobState, NewJob, insert};
use support::{Noop, Tag, q};
use testkit::TestDb;

#[tokio::test]
async fn rolled_back_insert_leaves_no_job_and_committed_one_exists() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());

    let mut tx = db.pool.begin().await.unwrap();
    let inserted = client
        .insert_tx(&mut tx, NewJob::new(q("default"), &Noop {}).unwrap())
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert!(client.job(inserted.job.id).await.unwrap().is_none());

    let mut tx = db.pool.begin().await.unwrap();
    let inserted = client
        .insert_tx(&mut tx, NewJob::new(q("default"), &Noop {}).unwrap())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let job = client.job(inserted.job.id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Available);
    assert_eq!(job.kind, "noop");
}

#[tokio::test]
async fn fifty_concurrent_inserts_with_one_unique_key_make_one_job() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(50));
    let mut tasks = Vec::new();
    for n in 0..50 {
        let client = client.clone();
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            let job = NewJob::new(q("default"), &Tag { n })
                .unwrap()
                .unique_key("repo:42");
            barrier.wait().await;
            client.insert(job).await.unwrap()
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    let fresh: Vec<_> = results.iter().filter(|r| !r.duplicate).collect();
    assert_eq!(fresh.len(), 1, "exactly one insert wins");
    let id = fresh[0].job.id;
    assert!(
        results.iter().all(|r| r.job.id == id),
        "every duplicate reports the winning job"
    );
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM fairlane_job")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(total, 1);
}

/// Two batches sharing their unique keys, taken in opposite orders, both learn the outcome: every
/// key is inserted once and the other batch reports that job, and neither fails with a deadlock
/// (each insert of a key waits for the transaction that inserted it first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_taking_shared_unique_keys_in_opposite_orders_never_deadlock() {
    const KEYS: u64 = 300;
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    for round in 0..20 {
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(2));
        let batch = |descending: bool| {
            let (client, barrier) = (client.clone(), barrier.clone());
            tokio::spawn(async move {
                let mut keys: Vec<u64> = (0..KEYS).collect();
                if descending {
                    keys.reverse();
                }
                let jobs = keys
                    .iter()
                    .map(|&n| {
                        NewJob::new(q("default"), &Tag { n })
                            .unwrap()
                            .unique_key(format!("r{round}-k{n}"))
                    })
                    .collect();
                barrier.wait().await;
                client.insert_many(jobs).await
            })
        };
        let (up, down) = (batch(false), batch(true));
        let up = up.await.unwrap().expect("the ascending batch");
        let down = down.await.unwrap().expect("the descending batch");
        // Both see the same job for each key, inserted by exactly one of them, in input order.
        for (i, r) in up.iter().enumerate() {
            let d = &down[down.len() - 1 - i];
            assert_eq!(r.job.id, d.job.id, "round {round}, key {i}");
            assert_ne!(r.duplicate, d.duplicate, "round {round}, key {i}");
            assert_eq!(r.job.args["n"].as_u64(), Some(i as u64));
        }
    }
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM fairlane_job")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(total, 20 * KEYS as i64);
}

#[tokio::test]
async fn unique_key_is_free_again_once_the_job_is_final() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let first = client
        .insert(NewJob::new(q("default"), &Noop {}).unwrap().unique_key("k"))
        .await
        .unwrap();
    client.cancel(first.job.id).await.unwrap();
    let second = client
        .insert(NewJob::new(q("default"), &Noop {}).unwrap().unique_key("k"))
        .await
        .unwrap();
    assert!(!second.duplicate);
    assert_ne!(second.job.id, first.job.id);
}

#[tokio::test]
async fn insert_many_keeps_order_and_reports_duplicates_within_the_batch() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let jobs = vec![
        NewJob::new(q("a"), &Tag { n: 0 }).unwrap(),
        NewJob::new(q("a"), &Tag { n: 1 }).unwrap().unique_key("u"),
        NewJob::new(q("b"), &Tag { n: 2 }).unwrap(),
        NewJob::new(q("a"), &Tag { n: 3 }).unwrap().unique_key("u"),
        NewJob::new(q("a"), &Tag { n: 4 })
            .unwrap()
            .scheduled_at(chrono::Utc::now() + chrono::Duration::hours(1)),
    ];
    let results = client.insert_many(jobs).await.unwrap();
    let ns: Vec<u64> = results
        .iter()
        .map(|r| r.job.args["n"].as_u64().unwrap())
        .collect();
    assert_eq!(
        ns,
        [0, 1, 2, 1, 4],
        "results in input order; duplicate shows the holder"
    );
    assert_eq!(
        results.iter().map(|r| r.duplicate).collect::<Vec<_>>(),
        [false, false, false, true, false]
    );
    assert_eq!(results[2].job.queue, "b");
    assert_eq!(results[4].job.state, JobState::Scheduled);
}

#[tokio::test]
async fn insert_many_without_unique_keys_keeps_order_fields_and_states() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let later = chrono::Utc::now() + chrono::Duration::hours(1);
    let jobs = vec![
        NewJob::new(q("a"), &Tag { n: 0 }).unwrap().priority(3),
        NewJob::new(q("b"), &Tag { n: 1 })
            .unwrap()
            .scheduled_at(later),
        NewJob::new(q("a"), &Tag { n: 2 }).unwrap().max_attempts(2),
    ];
    let results = client.insert_many(jobs).await.unwrap();
    let got: Vec<(u64, &str, JobState, i16, i16)> = results
        .iter()
        .map(|r| {
            assert!(!r.duplicate);
            let j = &r.job;
            let n = j.args["n"].as_u64().unwrap();
            (n, j.queue.as_str(), j.state, j.priority, j.max_attempts)
        })
        .collect();
    assert_eq!(
        got,
        [
            (0, "a", JobState::Available, 3, 25),
            (1, "b", JobState::Scheduled, 1, 25),
            (2, "a", JobState::Available, 1, 2),
        ]
    );
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM fairlane_job")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(stored, 3);
}

#[tokio::test]
async fn bulk_copy_writes_every_job_with_its_fields() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let later = chrono::Utc::now() + chrono::Duration::minutes(5);
    let jobs: Vec<NewJob> = (0..5000)
        .map(|n| {
            let job = NewJob::new(q("bulk"), &Tag { n })
                .unwrap()
                .priority(((n % 4) + 1) as i16)
                .max_attempts(7)
                .metadata("batch", serde_json::json!("b1"));
            if n % 10 == 0 {
                job.scheduled_at(later)
            } else {
                job
            }
        })
        .collect();
    assert_eq!(client.insert_bulk(&jobs).await.unwrap(), 5000);
    let rows: Vec<(i64, String, i16, i16, serde_json::Value)> = sqlx::query_as(
        "SELECT (args->>'n')::int8, state::text, priority, max_attempts, metadata \
         FROM fairlane_job ORDER BY (args->>'n')::int8",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 5000);
    for (n, state, priority, max_attempts, metadata) in rows {
        assert_eq!(priority, ((n % 4) + 1) as i16);
        assert_eq!(max_attempts, 7);
        assert_eq!(metadata["batch"], "b1");
        let want = if n % 10 == 0 {
            "scheduled"
        } else {
            "available"
        };
        assert_eq!(state, want, "job {n}");
    }
}

/// A bulk load dates its jobs by the database's clock (`now()`, its transaction's start) like
/// every other insert path, not by this host's.
#[tokio::test]
async fn bulk_copy_dates_jobs_by_the_databases_clock() {
    let db = TestDb::new().await;
    let mut tx = db.pool.begin().await.unwrap();
    let started: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    // This host's clock moves on; the transaction's does not.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let jobs = [NewJob::new(q("bulk"), &Noop {}).unwrap()];
    assert_eq!(insert::insert_bulk(&mut tx, &jobs).await.unwrap(), 1);
    let (scheduled_at, state): (chrono::DateTime<chrono::Utc>, String) =
        sqlx::query_as("SELECT scheduled_at, state::text FROM fairlane_job")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
    assert_eq!((scheduled_at, state.as_str()), (started, "available"));
}

#[tokio::test]
async fn bulk_copy_refuses_unique_keys_and_changes_nothing() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let jobs = vec![
        NewJob::new(q("bulk"), &Noop {}).unwrap(),
        NewJob::new(q("bulk"), &Noop {}).unwrap().unique_key("x"),
    ];
    let err = insert::insert_bulk(&mut conn, &jobs).await.unwrap_err();
    assert!(err.to_string().contains("unique keys"), "{err}");
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM fairlane_job")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(total, 0);
}

#[tokio::test]
async fn invalid_jobs_are_refused_before_touching_the_database() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let bad = NewJob::new(q("a"), &Noop {}).unwrap().priority(9);
    let err = client.insert(bad).await.unwrap_err();
    assert!(err.to_string().contains("priority"), "{err}");
    // The queue's own metadata keys, whichever insert path.
    for key in insert::QUEUE_METADATA_KEYS {
        let bad = NewJob::new(q("a"), &Noop {})
            .unwrap()
            .metadata(key, serde_json::json!("x"));
        let err = client.insert(bad.clone()).await.unwrap_err();
        assert!(
            err.to_string().contains(&format!("metadata key `{key}`")),
            "{err}"
        );
        let err = client.insert_bulk(&[bad]).await.unwrap_err();
        assert!(err.to_string().contains(key), "{err}");
    }
    // A user id in the one form PostgreSQL's uuid does not take.
    let err = NewJob::from_json(
        "x",
        q("a"),
        serde_json::json!({"user_id": "urn:uuid:7d6f0a48-1f5e-4f3e-9d7e-0c6c1e4f7b10"}),
    )
    .unwrap_err();
    assert!(err.to_string().contains("must be a user's UUID"), "{err}");
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM fairlane_job")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(count, 0, "nothing written");
}

#[tokio::test]
async fn user_id_is_indexed_from_the_arguments() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let job = NewJob::from_json(
        "x",
        q("a"),
        serde_json::json!({"user_id": "7d6f0a48-1f5e-4f3e-9d7e-0c6c1e4f7b10"}),
    )
    .unwrap();
    let inserted = client.insert(job).await.unwrap();
    assert_eq!(
        inserted.job.user_id.map(|u| u.to_string()).as_deref(),
        Some("7d6f0a48-1f5e-4f3e-9d7e-0c6c1e4f7b10")
    );
    let system = client
        .insert(NewJob::new(q("a"), &Noop {}).unwrap())
        .await
        .unwrap();
    assert_eq!(system.job.user_id, None);
    let err = NewJob::from_json("x", q("a"), serde_json::json!({"user_id": "alice"})).unwrap_err();
    assert!(err.to_string().contains("must be a user's UUID"), "{err}");
}

#[tokio::test]
async fn a_composed_statement_links_sibling_rows_to_the_jobs_it_inserts_and_commits_with_them() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    sqlx::query("CREATE TABLE job_note (job_id bigint NOT NULL, note text NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let jobs: Vec<NewJob> = (0..5)
        .map(|n| NewJob::new(q("default"), &Tag { n }).unwrap())
        .collect();
    let notes: Vec<String> = (0..5).map(|n| format!("note {n}")).collect();
    let sql = format!(
        "WITH {}, noted AS ( \
           INSERT INTO job_note (job_id, note) \
           SELECT j.id, t.note FROM unnest($8::text[]) WITH ORDINALITY AS t(note, ord) \
           JOIN fairlane_new_job j ON j.ord = t.ord \
         ) \
         SELECT j.* FROM fairlane_inserted_job j JOIN fairlane_new_job n USING (id) \
         ORDER BY n.ord",
        queue::JobsCte::sql(1)
    );
    let bind = |jobs: Vec<NewJob>| {
        let mut args = sqlx::postgres::PgArguments::default();
        queue::JobsCte::new(jobs).unwrap().bind(&mut args).unwrap();
        sqlx::Arguments::add(&mut args, &notes).unwrap();
        args
    };

    // Rolled back: neither the jobs nor their notes exist.
    let mut tx = client.begin().await.unwrap();
    tx.insert_composed(sqlx::AssertSqlSafe(sql.clone()), bind(jobs.clone()), 5)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let count = |table: &'static str| {
        let pool = db.pool.clone();
        async move {
            let (n,): (i64,) =
                sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            n
        }
    };
    assert_eq!(
        (count("fairlane_job").await, count("job_note").await),
        (0, 0)
    );

    // Committed: every note names the job inserted for it, returned in input order.
    let mut tx = client.begin().await.unwrap();
    let rows = tx
        .insert_composed(sqlx::AssertSqlSafe(sql), bind(jobs), 5)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    for (n, row) in rows.iter().enumerate() {
        assert_eq!(row.state, JobState::Available);
        assert_eq!(row.queue, "default");
        let (args, note): (serde_json::Value, String) = sqlx::query_as(
            "SELECT j.args, t.note FROM fairlane_job j JOIN job_note t ON t.job_id = j.id \
             WHERE j.id = $1",
        )
        .bind(row.id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(
            (args["n"].as_u64(), note),
            (Some(n as u64), format!("note {n}"))
        );
    }

    // A unique job cannot be composed: a conflict would leave its sibling row without a job.
    let unique = NewJob::new(q("default"), &Tag { n: 9 })
        .unwrap()
        .unique_key("k");
    assert!(queue::JobsCte::new(vec![unique]).is_err());
}

/// A failing first statement fails the begin, and leaves the connection in an aborted transaction
/// that only closing it ends (which is why the web service closes such connections).
#[tokio::test]
async fn a_begin_whose_first_statement_fails_reports_it() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let mut conn = db.pool.acquire().await.unwrap();
    let err = client
        .begin_on_with(&mut conn, "SELECT 1 / 0")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("division by zero"), "{err}");
    let (status,): (String,) = sqlx::query_as("SELECT 'usable'")
        .fetch_one(&mut *conn)
        .await
        .map(|r: (String,)| r)
        .unwrap_or_else(|e| (e.to_string(),));
    assert!(status.contains("aborted"), "{status}");
    conn.close_on_drop();
}
