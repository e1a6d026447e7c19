//! The engine against real PostgreSQL, in one process: concurrency limits, every outcome, retries,
//! snoozes, cancellation, wake-up latency, shutdown, lost connections.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use queue::{CancelResult, Client, FailureKind, JobError, JobOutcome, JobState, NewJob, Workers};
use support::*;
use testkit::TestDb;

#[tokio::test]
async fn a_queue_never_runs_more_jobs_than_its_workers() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let current = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let mut workers = Workers::new();
    {
        let (current, peak) = (current.clone(), peak.clone());
        workers.register_fn::<Sleep, _, _>(move |_ctx, args| {
            let (current, peak) = (current.clone(), peak.clone());
            async move {
                let now = current.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(args.ms)).await;
                current.fetch_sub(1, Ordering::SeqCst);
                Ok(())
            }
        });
    }
    let jobs: Vec<_> = (0..60)
        .map(|_| NewJob::new(q("limited"), &Sleep { ms: 20 }).unwrap())
        .collect();
    client.insert_many(jobs).await.unwrap();
    let engine = start(&client, fast_config(), &[("limited", 4)], workers);
    eventually(Duration::from_secs(20), "all jobs completed", || async {
        (count_in_state(&db.pool, "completed").await == 60).then_some(())
    })
    .await;
    engine.stop().await;
    assert_eq!(
        peak.load(Ordering::SeqCst),
        4,
        "the limit is reached and never exceeded"
    );
}

#[tokio::test]
async fn failures_back_off_then_discard_keeping_every_error_and_panics_do_not_kill_the_worker() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let mut workers = Workers::new();
    workers.register_fn::<AlwaysFail, _, _>(|ctx, _| async move {
        Err(JobError::msg(format!(
            "attempt {} failed",
            ctx.job().attempt
        )))
    });
    workers.register_fn::<Panics, _, _>(|_, _| async move {
        panic!("handler exploded");
    });
    workers.register_fn::<Noop, _, _>(|_, _| async move { Ok(()) });
    let failing = client
        .insert(NewJob::new(q("q"), &AlwaysFail {}).unwrap().max_attempts(4))
        .await
        .unwrap()
        .job;
    let panicking = client
        .insert(NewJob::new(q("q"), &Panics {}).unwrap().max_attempts(2))
        .await
        .unwrap()
        .job;
    let mut config = fast_config();
    config.retry.base = Duration::from_millis(100);
    config.retry.jitter = 0.0;
    let engine = start(&client, config, &[("q", 2)], workers);
    let discarded = job_in_state(
        &client,
        failing.id,
        JobState::Discarded,
        Duration::from_secs(20),
        "failing job discarded",
    )
    .await;
    let errors = discarded.attempt_errors();
    assert_eq!(errors.len(), 4, "one error per attempt: {errors:?}");
    for (i, e) in errors.iter().enumerate() {
        assert_eq!(e.attempt, i as i16 + 1);
        assert_eq!(e.error, format!("attempt {} failed", i + 1));
        assert_eq!(e.kind, FailureKind::Error);
    }
    // Backoff grows: the gaps between attempts increase (100 ms, 200 ms, 400 ms, plus promotion).
    let gaps: Vec<f64> = errors
        .windows(2)
        .map(|w| (w[1].at - w[0].at).as_seconds_f64())
        .collect();
    assert!(
        gaps[0] >= 0.1 && gaps[1] >= 0.2 && gaps[2] >= 0.4,
        "gaps {gaps:?}"
    );
    assert!(gaps[2] > gaps[0], "gaps {gaps:?}");

    let panicked = job_in_state(
        &client,
        panicking.id,
        JobState::Discarded,
        Duration::from_secs(20),
        "panicking job discarded",
    )
    .await;
    let errors = panicked.attempt_errors();
    assert_eq!(errors.len(), 2);
    assert!(
        errors
            .iter()
            .all(|e| e.kind == FailureKind::Panic && e.error.contains("handler exploded"))
    );

    // The worker survived both: it still runs new jobs.
    let ok = client
        .insert(NewJob::new(q("q"), &Noop {}).unwrap())
        .await
        .unwrap()
        .job;
    eventually(
        Duration::from_secs(10),
        "worker still runs jobs",
        || async {
            (client.job(ok.id).await.unwrap().unwrap().state == JobState::Completed).then_some(())
        },
    )
    .await;
    engine.stop().await;
}

/// PostgreSQL refuses a NUL character in `text` and `jsonb`. A handler's output with one cannot
/// be stored: the attempt is recorded as failed with the reason (and the job retried, then
/// discarded) instead of being retried forever, and the completions around it are saved. A
/// failure message with one is stored with the character replaced.
#[tokio::test]
async fn an_end_the_database_refuses_is_recorded_as_a_failure_and_stalls_nothing() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let mut workers = Workers::new();
    workers.register_fn::<Unstorable, _, _>(|ctx, _| async move {
        ctx.set_output(&serde_json::json!({"text": "nul \u{0} inside"}))
            .unwrap();
        Ok(())
    });
    workers.register_fn::<AlwaysFail, _, _>(|_, _| async move {
        Err(JobError::msg("nul \u{0} in the message"))
    });
    workers.register_fn::<Noop, _, _>(|_, _| async move { Ok(()) });
    let unstorable = client
        .insert(NewJob::new(q("q"), &Unstorable {}).unwrap().max_attempts(2))
        .await
        .unwrap()
        .job;
    let failing = client
        .insert(NewJob::new(q("q"), &AlwaysFail {}).unwrap().max_attempts(1))
        .await
        .unwrap()
        .job;
    let noops: Vec<_> = (0..20)
        .map(|_| NewJob::new(q("q"), &Noop {}).unwrap())
        .collect();
    client.insert_many(noops).await.unwrap();
    let engine = start(&client, fast_config(), &[("q", 8)], workers);

    let discarded = job_in_state(
        &client,
        unstorable.id,
        JobState::Discarded,
        Duration::from_secs(20),
        "unstorable job discarded",
    )
    .await;
    let errors = discarded.attempt_errors();
    assert_eq!(errors.len(), 2, "one error per attempt: {errors:?}");
    for e in &errors {
        assert_eq!(e.kind, FailureKind::Error);
        assert!(
            e.error
                .starts_with("the end of this attempt (completed) could not be saved: "),
            "{}",
            e.error
        );
    }
    assert_eq!(discarded.output, None);
    let failed = job_in_state(
        &client,
        failing.id,
        JobState::Discarded,
        Duration::from_secs(20),
        "failing job discarded",
    )
    .await;
    assert_eq!(
        failed.attempt_errors()[0].error,
        "nul \u{fffd} in the message"
    );
    eventually(
        Duration::from_secs(20),
        "every other job completed",
        || async { (count_in_state(&db.pool, "completed").await == 20).then_some(()) },
    )
    .await;
    // The completer still persists new work.
    let later = client
        .insert(NewJob::new(q("q"), &Noop {}).unwrap())
        .await
        .unwrap()
        .job;
    eventually(Duration::from_secs(10), "a later job completed", || async {
        (client.job(later.id).await.unwrap().unwrap().state == JobState::Completed).then_some(())
    })
    .await;
    engine.stop().await;
}

#[tokio::test]
async fn a_job_snoozed_a_hundred_times_with_three_attempts_still_completes() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let mut workers = Workers::new();
    workers.register_fn::<SnoozeUntil, _, _>(|ctx, args| async move {
        if ctx.job().snoozes() < args.times {
            Err(JobError::Snooze(Duration::ZERO))
        } else {
            Ok(())
        }
    });
    let job = client
        .insert(
            NewJob::new(q("snoozy"), &SnoozeUntil { times: 100 })
                .unwrap()
                .max_attempts(3),
        )
        .await
        .unwrap()
        .job;
    let mut config = fast_config();
    config.promote_interval = Duration::from_millis(10);
    let engine = start(&client, config, &[("snoozy", 1)], workers);
    let done = eventually(Duration::from_secs(60), "snoozed job completed", || async {
        let j = client.job(job.id).await.unwrap().unwrap();
        j.state.is_final().then_some(j)
    })
    .await;
    engine.stop().await;
    assert_eq!(done.state, JobState::Completed);
    assert_eq!(done.snoozes(), 100);
    assert_eq!(done.attempt, 1, "snoozes give their attempt back");
    assert!(done.attempt_errors().is_empty());
}

/// "Park it": a snooze of `Duration::MAX` is cut to `MAX_SNOOZE` and the job waits, on its last
/// attempt too. Its end used to fail in PostgreSQL (a timestamp past the year 294276), which was
/// recorded as a failed attempt and discarded the job.
/// The job `id` once it has been snoozed (within 20 s).
async fn snoozed_once(client: &Client, id: i64) -> queue::JobRow {
    eventually(Duration::from_secs(20), "the job is snoozed", || async {
        let j = client
            .job(id)
            .await
            .expect("reading the job")
            .expect("the job exists");
        (j.snoozes() == 1).then_some(j)
    })
    .await
}

#[tokio::test]
async fn an_endless_snooze_parks_the_job_instead_of_failing_it() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let mut workers = Workers::new();
    workers.register_fn::<Noop, _, _>(
        |_ctx, _args| async move { Err(JobError::Snooze(Duration::MAX)) },
    );
    let job = client
        .insert(NewJob::new(q("parked"), &Noop {}).unwrap().max_attempts(1))
        .await
        .unwrap()
        .job;
    let engine = start(&client, fast_config(), &[("parked", 1)], workers);
    let parked = snoozed_once(&client, job.id).await;
    engine.stop().await;
    assert_eq!(parked.state, JobState::Scheduled);
    assert!(parked.attempt_errors().is_empty());
    let years = (parked.scheduled_at - chrono::Utc::now()).num_days() / 365;
    assert!((99..=100).contains(&years), "{years} years");

    // The same from a middleware's own outcome, which no handler's error went through.
    struct Parks;
    #[async_trait::async_trait]
    impl queue::Middleware for Parks {
        async fn handle(&self, _ctx: &queue::JobContext, _next: queue::Next<'_>) -> JobOutcome {
            JobOutcome::Snoozed(Duration::MAX)
        }
    }
    let job = client
        .insert(NewJob::new(q("parked"), &Noop {}).unwrap().max_attempts(1))
        .await
        .unwrap()
        .job;
    let mut workers = Workers::new();
    workers.register_fn::<Noop, _, _>(|_ctx, _args| async move { Ok(()) });
    let engine = run_engine(
        queue::Engine::builder(client.clone())
            .name("test")
            .config(fast_config())
            .workers(workers)
            .queue(q("parked"), 1)
            .middleware(Arc::new(Parks))
            .build()
            .unwrap(),
    );
    let parked = snoozed_once(&client, job.id).await;
    engine.stop().await;
    assert_eq!(parked.state, JobState::Scheduled);
}

#[tokio::test]
async fn unknown_kinds_fail_clearly_and_follow_the_retry_rules() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let mut workers = Workers::new();
    workers.register_fn::<Noop, _, _>(|_, _| async { Ok(()) });
    let job = client
        .insert(
            NewJob::new(q("q"), &Unregistered {})
                .unwrap()
                .max_attempts(2),
        )
        .await
        .unwrap()
        .job;
    let engine = start(&client, fast_config(), &[("q", 1)], workers);
    let done = job_in_state(
        &client,
        job.id,
        JobState::Discarded,
        Duration::from_secs(10),
        "unknown kind discarded",
    )
    .await;
    engine.stop().await;
    let errors = done.attempt_errors();
    assert_eq!(errors.len(), 2);
    assert_eq!(errors[0].kind, FailureKind::UnknownKind);
    assert!(
        errors[0]
            .error
            .contains("no handler is registered for job kind `unregistered`")
            && errors[0].error.contains("noop"),
        "{}",
        errors[0].error
    );
}

#[tokio::test]
async fn timeouts_are_failures_and_invalid_arguments_are_reported() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let mut workers = Workers::new();
    workers.register::<Sleep, _>(
        queue::FnWorker::new(|_ctx, args: Sleep| async move {
            tokio::time::sleep(Duration::from_millis(args.ms)).await;
            Ok(())
        })
        .with_timeout(Duration::from_millis(100)),
    );
    let slow = client
        .insert(
            NewJob::new(q("q"), &Sleep { ms: 5_000 })
                .unwrap()
                .max_attempts(1),
        )
        .await
        .unwrap()
        .job;
    let garbled = client
        .insert(
            NewJob::from_json("sleep", q("q"), serde_json::json!({"ms": "soon"}))
                .unwrap()
                .max_attempts(1),
        )
        .await
        .unwrap()
        .job;
    let engine = start(&client, fast_config(), &[("q", 2)], workers);
    for (id, kind, needle) in [
        (slow.id, FailureKind::Timeout, "timed out after 100ms"),
        (garbled.id, FailureKind::InvalidArgs, "do not decode"),
    ] {
        let done = job_in_state(
            &client,
            id,
            JobState::Discarded,
            Duration::from_secs(10),
            "job discarded",
        )
        .await;
        let e = &done.attempt_errors()[0];
        assert_eq!(e.kind, kind);
        assert!(e.error.contains(needle), "{}", e.error);
    }
    engine.stop().await;
}

#[tokio::test]
async fn cancel_stops_running_jobs_and_cancels_waiting_ones() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let started = Arc::new(tokio::sync::Notify::new());
    let mut workers = Workers::new();
    {
        let started = started.clone();
        workers.register_fn::<Sleep, _, _>(move |ctx, args| {
            let started = started.clone();
            async move {
                started.notify_one();
                tokio::select! {
                    () = ctx.cancelled() => Err(JobError::msg("stopped early")),
                    () = tokio::time::sleep(Duration::from_millis(args.ms)) => Ok(()),
                }
            }
        });
    }
    let running = client
        .insert(NewJob::new(q("q"), &Sleep { ms: 60_000 }).unwrap())
        .await
        .unwrap()
        .job;
    let waiting = client
        .insert(
            NewJob::new(q("q"), &Sleep { ms: 1 })
                .unwrap()
                .scheduled_at(chrono::Utc::now() + chrono::Duration::hours(1)),
        )
        .await
        .unwrap()
        .job;
    let engine = start(&client, fast_config(), &[("q", 1)], workers);
    tokio::time::timeout(Duration::from_secs(10), started.notified())
        .await
        .expect("job started");
    assert!(matches!(
        client.cancel(running.id).await.unwrap(),
        Some(CancelResult::Requested(_))
    ));
    let done = eventually(Duration::from_secs(10), "running job cancelled", || async {
        let j = client.job(running.id).await.unwrap().unwrap();
        j.state.is_final().then_some(j)
    })
    .await;
    assert_eq!(done.state, JobState::Cancelled);

    match client.cancel(waiting.id).await.unwrap() {
        Some(CancelResult::Cancelled(j)) => assert_eq!(j.state, JobState::Cancelled),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        client.cancel(waiting.id).await.unwrap(),
        Some(CancelResult::AlreadyFinal(_))
    ));
    assert!(client.cancel(999_999).await.unwrap().is_none());
    engine.stop().await;
}

#[tokio::test]
async fn notify_wakes_an_idle_queue_long_before_its_poll_interval() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut workers = Workers::new();
    workers.register_fn::<Tag, _, _>(move |ctx, _| {
        let tx = tx.clone();
        async move {
            let wait = chrono::Utc::now() - ctx.job().created_at;
            let _ = tx.send(wait.as_seconds_f64());
            Ok(())
        }
    });
    let mut config = fast_config();
    config.poll_interval = Duration::from_secs(5);
    let engine = start(&client, config, &[("idle", 2)], workers);
    wait_for_listener(&db.pool).await;
    let mut latencies = Vec::new();
    for n in 0..20 {
        client
            .insert(NewJob::new(q("idle"), &Tag { n }).unwrap())
            .await
            .unwrap();
        let seconds = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("job started")
            .unwrap();
        latencies.push(seconds);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    engine.stop().await;
    latencies.sort_by(f64::total_cmp);
    let median = latencies[10];
    // Polling alone would start them 2.5 s after insert on average; a notified wake-up takes
    // milliseconds, and half a second leaves room for a loaded machine.
    assert!(
        median < 0.5,
        "median insert-to-start {median:.4}s with a 5 s poll interval: {latencies:?}"
    );
}

/// Workers whose `Sleep` handler sleeps for its `ms`, or answers a stop with `on_stop()`.
fn stoppable_sleepers(on_stop: fn() -> JobError) -> Workers {
    let mut workers = Workers::new();
    workers.register_fn::<Sleep, _, _>(move |ctx, args| async move {
        tokio::select! {
            () = ctx.cancelled() => Err(on_stop()),
            () = tokio::time::sleep(Duration::from_millis(args.ms)) => Ok(()),
        }
    });
    workers
}

/// Inserts a `Sleep` job of `ms` into queue `q`.
async fn insert_sleep(client: &Client, ms: u64) -> queue::JobRow {
    client
        .insert(NewJob::new(q("q"), &Sleep { ms }).expect("a valid job"))
        .await
        .expect("inserting a sleep job")
        .job
}

/// Starts `workers` on queue `q` with two slots and a 1 s shutdown timeout, and waits until the
/// two jobs inserted before run.
async fn start_with_both_running(db: &TestDb, client: &Client, workers: Workers) -> Running {
    let mut config = fast_config();
    config.shutdown_timeout = Duration::from_secs(1);
    let engine = start(client, config, &[("q", 2)], workers);
    eventually(Duration::from_secs(10), "both running", || async {
        (count_in_state(&db.pool, "running").await == 2).then_some(())
    })
    .await;
    engine
}

#[tokio::test]
async fn shutdown_lets_jobs_finish_and_hands_back_those_past_the_deadline() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let workers = stoppable_sleepers(|| JobError::msg("interrupted"));
    let quick = insert_sleep(&client, 500).await;
    let slow = insert_sleep(&client, 60_000).await;
    let engine = start_with_both_running(&db, &client, workers).await;
    let worker_id = engine.worker_id.clone();
    let later = insert_sleep(&client, 1).await;
    engine.stop().await;
    let quick = client.job(quick.id).await.unwrap().unwrap();
    let slow = client.job(slow.id).await.unwrap().unwrap();
    let later = client.job(later.id).await.unwrap().unwrap();
    assert_eq!(
        quick.state,
        JobState::Completed,
        "finished within the deadline"
    );
    assert_eq!(
        slow.state,
        JobState::Available,
        "handed back for another worker"
    );
    assert_eq!(slow.attempt, 0, "the interrupted attempt does not count");
    assert_eq!(slow.attempt_errors()[0].kind, FailureKind::Interrupted);
    // Worded for the job's owner, with the worker (a host and process name) kept apart.
    assert!(
        !slow.attempt_errors()[0].error.contains(&worker_id),
        "{:?}",
        slow.attempt_errors()
    );
    assert_eq!(slow.attempt_errors()[0].worker, Some(worker_id));
    assert_eq!(
        later.state,
        JobState::Available,
        "nothing new fetched after shutdown"
    );
    let workers_left: i64 = sqlx::query_scalar("SELECT count(*) FROM fairlane_worker")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(workers_left, 0, "the worker deregistered");
}

/// Shutdown does not wait for ever on a statement that does not return: with the worker rows
/// locked by another session, the heartbeat's update and the deregistration both hang, and the
/// engine still stops within its bounds (the worker row stays, to be reaped as stale).
#[tokio::test]
async fn shutdown_ends_even_when_the_database_stops_answering_its_statements() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let engine = start(&client, fast_config(), &[("q", 1)], Workers::new());
    eventually(Duration::from_secs(10), "the worker registered", || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM fairlane_worker")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        (n == 1).then_some(())
    })
    .await;
    let mut blocker = db.pool.begin().await.unwrap();
    sqlx::query("SELECT FROM fairlane_worker FOR UPDATE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    // Let a heartbeat start and hang behind the lock.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = std::time::Instant::now();
    engine.shutdown.cancel();
    let stopped = tokio::time::timeout(Duration::from_secs(20), engine.handle).await;
    blocker.rollback().await.unwrap();
    stopped
        .expect("the engine did not stop while its statements hung")
        .expect("engine task panicked")
        .expect("engine returned an error");
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "it did wait for the stuck statements first: {:?}",
        started.elapsed()
    );
}

/// A handler that answers `ctx.cancelled()` with a cancel, the natural idiom, does not cancel
/// its job for good when the stop is a shutdown: the job is handed back like a failed one, with
/// the attempt refunded, while a user's cancel of another running job still cancels it.
#[tokio::test]
async fn a_handler_that_cancels_on_shutdown_hands_its_job_back() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let workers = stoppable_sleepers(|| JobError::Cancel("stopped".into()));
    let by_user = insert_sleep(&client, 60_000).await;
    let by_deploy = insert_sleep(&client, 60_001).await;
    let engine = start_with_both_running(&db, &client, workers).await;
    client.cancel(by_user.id).await.unwrap();
    eventually(Duration::from_secs(10), "the user's cancel", || async {
        let job = client.job(by_user.id).await.unwrap().unwrap();
        (job.state == JobState::Cancelled).then_some(())
    })
    .await;
    engine.stop().await;
    let by_deploy = client.job(by_deploy.id).await.unwrap().unwrap();
    assert_eq!(by_deploy.state, JobState::Available, "handed back");
    assert_eq!(
        by_deploy.attempt, 0,
        "the interrupted attempt does not count"
    );
    assert_eq!(by_deploy.attempt_errors()[0].kind, FailureKind::Interrupted);
}

/// A handler that blocks its thread cannot be interrupted: its executor, and with it the
/// completions' channel, stays alive. Shutdown still ends within its bound (deadline, cancel
/// grace, then 10 s for the completer) instead of waiting for the handler, leaving that job
/// `running` for the rescuer. The handler is released only after the assertions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_even_when_a_handler_blocks_its_thread() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let (release, blocked) = std::sync::mpsc::channel::<()>();
    let blocked = Arc::new(std::sync::Mutex::new(blocked));
    let mut workers = Workers::new();
    workers.register_fn::<Sleep, _, _>(move |_, _| {
        let blocked = Arc::clone(&blocked);
        async move {
            let _ = blocked
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(120));
            Ok(())
        }
    });
    let stuck = client
        .insert(NewJob::new(q("q"), &Sleep { ms: 0 }).unwrap())
        .await
        .unwrap()
        .job;
    let mut config = fast_config();
    config.shutdown_timeout = Duration::from_millis(200);
    let engine = start(&client, config, &[("q", 1)], workers);
    eventually(Duration::from_secs(10), "the job running", || async {
        (count_in_state(&db.pool, "running").await == 1).then_some(())
    })
    .await;
    // `stop` itself fails the test if the engine takes 30 s (the handler would take 120 s).
    engine.stop().await;
    let stuck = client.job(stuck.id).await.unwrap().unwrap();
    assert_eq!(stuck.state, JobState::Running, "left for the rescuer");
    release.send(()).unwrap();
}

/// A run whose job was handed back and fetched again (the same attempt number, as after a
/// hand-back or a fetch lost in a database crash) ends nothing: its failure is not recorded over
/// the new run, and its end does not make this process forget the new run (which the heartbeat
/// would then hand back while it runs).
#[tokio::test]
async fn an_old_run_of_a_job_fetched_again_ends_nothing() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let first_ended = Arc::new(AtomicUsize::new(0));
    let release = Arc::new([tokio::sync::Notify::new(), tokio::sync::Notify::new()]);
    let mut workers = Workers::new();
    {
        let (runs, first_ended, release) = (runs.clone(), first_ended.clone(), release.clone());
        workers.register_fn::<Tag, _, _>(move |_, _| {
            let (runs, first_ended, release) = (runs.clone(), first_ended.clone(), release.clone());
            async move {
                let run = runs.fetch_add(1, Ordering::SeqCst);
                release[run.min(1)].notified().await;
                if run == 0 {
                    first_ended.store(1, Ordering::SeqCst);
                    Err(JobError::msg("the first run failed"))
                } else {
                    Ok(())
                }
            }
        });
    }
    let job = client
        .insert(NewJob::new(q("q"), &Tag { n: 1 }).unwrap())
        .await
        .unwrap()
        .job;
    // No rescue here (a slow heartbeat on a busy machine must not take the second run's job).
    let mut config = fast_config();
    config.rescue_after = Duration::from_secs(30);
    let engine = start(&client, config, &[("q", 2)], workers);
    eventually(Duration::from_secs(10), "the first run started", || async {
        (runs.load(Ordering::SeqCst) == 1).then_some(())
    })
    .await;
    // Handed back behind the first run's back, as the heartbeat's hand-back does.
    sqlx::query(
        "UPDATE fairlane_job SET state = 'available', attempt = attempt - 1, scheduled_at = now() \
         WHERE id = $1",
    )
    .bind(job.id)
    .execute(&db.pool)
    .await
    .unwrap();
    eventually(
        Duration::from_secs(10),
        "the second run started",
        || async { (runs.load(Ordering::SeqCst) == 2).then_some(()) },
    )
    .await;
    release[0].notify_one();
    eventually(Duration::from_secs(10), "the first run ended", || async {
        (first_ended.load(Ordering::SeqCst) == 1).then_some(())
    })
    .await;
    // Long enough for the first run's completion to be persisted and for several heartbeats
    // (200 ms) past the hand-back's grace (500 ms).
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let during = client.job(job.id).await.unwrap().unwrap();
    assert_eq!(
        during.state,
        JobState::Running,
        "the second run still holds it"
    );
    assert_eq!(during.attempt, 1);
    assert!(
        during.attempt_errors().is_empty(),
        "{:?}",
        during.attempt_errors()
    );
    release[1].notify_one();
    let done = job_in_state(
        &client,
        job.id,
        JobState::Completed,
        Duration::from_secs(10),
        "the second run completed",
    )
    .await;
    assert!(done.attempt_errors().is_empty());
    assert_eq!(runs.load(Ordering::SeqCst), 2, "no third run");
    engine.stop().await;
}

/// A job whose fetch committed but whose reply was lost is `running` for a worker that never
/// got it. A cancel requested meanwhile is all the user knows of it: when the heartbeat hands the
/// job back, it is cancelled, not made runnable again (and run, and billed, after the cancel).
#[tokio::test]
async fn a_cancel_requested_for_a_job_whose_fetch_reply_was_lost_is_kept() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let mut workers = Workers::new();
    {
        let runs = runs.clone();
        workers.register_fn::<Tag, _, _>(move |_, _| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        });
    }
    let later = chrono::Utc::now() + chrono::Duration::hours(1);
    let job = client
        .insert(
            NewJob::new(q("q"), &Tag { n: 1 })
                .unwrap()
                .scheduled_at(later),
        )
        .await
        .unwrap()
        .job;
    // A grace far longer than the steps below can take, so the hand-back cannot come before
    // the cancel.
    let mut config = fast_config();
    config.orphan_grace = Duration::from_secs(3);
    let engine = start(&client, config, &[("q", 2)], workers);
    // The fetch that committed for this engine while its reply was lost.
    sqlx::query(
        "UPDATE fairlane_job SET state = 'running', attempt = 1, attempted_at = now(), \
             attempted_by = ARRAY[$2] WHERE id = $1",
    )
    .bind(job.id)
    .bind(&engine.worker_id)
    .execute(&db.pool)
    .await
    .unwrap();
    assert!(matches!(
        client.cancel(job.id).await.unwrap(),
        Some(CancelResult::Requested(_))
    ));
    let ended = eventually(
        Duration::from_secs(30),
        "the lost job handed back",
        || async {
            let j = client.job(job.id).await.unwrap().unwrap();
            (j.state != JobState::Running).then_some(j)
        },
    )
    .await;
    assert_eq!(ended.state, JobState::Cancelled);
    assert!(ended.finalized_at.is_some());
    // Several polls and heartbeats later, it has still never run.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(
        client.job(job.id).await.unwrap().unwrap().state,
        JobState::Cancelled
    );
    engine.stop().await;
}

/// A transition hook that panics on the transitions of one job, or of every job (`None`).
struct PanickingHook(Option<i64>);

#[async_trait::async_trait]
impl queue::TransitionHook for PanickingHook {
    async fn on_transitions(
        &self,
        _conn: &mut sqlx::PgConnection,
        transitions: &[queue::Transition],
    ) -> Result<(), queue::BoxError> {
        assert!(
            self.0
                .is_some_and(|job| transitions.iter().all(|t| t.job_id != job)),
            "hook exploded"
        );
        Ok(())
    }
}

/// A completer that stops while the engine runs (here: a hook panicked while a completion was
/// saved) can save no run's end. The engine then stops on its own and says so, instead of
/// fetching on into jobs that stay `running`; it deregisters, so the rescuer takes them.
#[tokio::test]
async fn an_engine_whose_completer_stopped_stops_and_says_so() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone()).with_hooks(vec![Arc::new(PanickingHook(None))]);
    let mut workers = Workers::new();
    workers.register_fn::<Tag, _, _>(|_, _| async { Ok(()) });
    let job = client
        .insert(NewJob::new(q("q"), &Tag { n: 1 }).unwrap())
        .await
        .unwrap()
        .job;
    let engine = start(&client, fast_config(), &[("q", 2)], workers);
    let ended = ended_on_its_own(engine.handle).await;
    assert!(
        matches!(ended, Err(queue::QueueError::CompleterStopped)),
        "{ended:?}"
    );
    let workers_left: i64 = sqlx::query_scalar("SELECT count(*) FROM fairlane_worker")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(workers_left, 0, "deregistered");
    let stuck = client.job(job.id).await.unwrap().unwrap();
    assert_eq!(stuck.state, JobState::Running, "left for the rescuer");
}

/// What an engine that stops by itself (no shutdown asked) ended with, within 30 s.
async fn ended_on_its_own(
    handle: tokio::task::JoinHandle<Result<(), queue::QueueError>>,
) -> Result<(), queue::QueueError> {
    tokio::time::timeout(Duration::from_secs(30), handle)
        .await
        .expect("the engine stops on its own")
        .expect("engine task panicked")
}

/// A worker that runs `Noop` jobs for `ms` milliseconds, ignoring cancellation.
fn slow_noops(ms: u64) -> Workers {
    let mut workers = Workers::new();
    workers.register_fn::<Noop, _, _>(move |_, _| async move {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok(())
    });
    workers
}

/// The number of maintenance leases held.
async fn leases(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM fairlane_leader")
        .fetch_one(pool)
        .await
        .expect("count the leases")
}

/// A hook that panics while the leader rescues a dead worker's job ends the maintenance task.
/// The engine then stops and says so, like when its completer stopped, rather than running on
/// with a lease that keeps every other replica from maintaining, and nothing promoted, rescued
/// or cleaned. The lease is let go at once, not after the drain of its running jobs.
#[tokio::test]
async fn an_engine_whose_maintenance_panicked_stops_and_says_so() {
    let db = TestDb::new().await;
    let plain = Client::new(db.pool.clone());
    let poisoned = insert_noops(&plain, "elsewhere", 1).await[0];
    mark_running(&db.pool, &[poisoned], "dead-worker", 60_000).await;
    insert_noops(&plain, "q", 1).await;
    let client =
        Client::new(db.pool.clone()).with_hooks(vec![Arc::new(PanickingHook(Some(poisoned)))]);
    let engine = start(&client, fast_config(), &[("q", 1)], slow_noops(5_000));
    eventually(Duration::from_secs(10), "elected", || async {
        (leases(&db.pool).await == 1).then_some(())
    })
    .await;
    eventually(Duration::from_secs(10), "the lease let go", || async {
        (leases(&db.pool).await == 0).then_some(())
    })
    .await;
    assert!(
        !engine.handle.is_finished(),
        "the lease was kept until the drain ended"
    );
    let ended = ended_on_its_own(engine.handle).await;
    assert!(
        matches!(ended, Err(queue::QueueError::BackgroundTaskPanicked)),
        "{ended:?}"
    );
    assert_eq!(state_of(&db.pool, poisoned).await, "running");
}

/// A hook that panics in a repair (here the hand-back of a job this worker never received) ends
/// the repairs' task and stops the engine, but not the heartbeat: while the engine drains its
/// running job, the worker stays alive in its row, so no rescuer runs that job a second time.
#[tokio::test]
async fn a_repair_that_panicked_stops_the_engine_but_not_its_heartbeat() {
    let db = TestDb::new().await;
    let plain = Client::new(db.pool.clone());
    let poisoned = insert_noops(&plain, "elsewhere", 1).await[0];
    let draining = insert_noops(&plain, "q", 1).await[0];
    let client =
        Client::new(db.pool.clone()).with_hooks(vec![Arc::new(PanickingHook(Some(poisoned)))]);
    let config = queue::EngineConfig {
        maintenance: false,
        ..fast_config()
    };
    let engine = start(&client, config.clone(), &[("q", 1)], slow_noops(5_000));
    // The engine has a job of 5 s to drain when the repair panics.
    eventually(
        Duration::from_secs(10),
        "the job to drain to run",
        || async { (state_of(&db.pool, draining).await == "running").then_some(()) },
    )
    .await;
    // A job this worker never received: the first repair hands it back, and the hook panics.
    mark_running(&db.pool, &[poisoned], &engine.worker_id, 1_000).await;
    let mut oldest_heartbeat = Duration::ZERO;
    let mut samples = 0;
    let mut ended = None;
    let mut handle = engine.handle;
    for _ in 0..300 {
        if let Ok(result) = tokio::time::timeout(Duration::from_millis(100), &mut handle).await {
            ended = Some(result.expect("engine task panicked"));
            break;
        }
        let age: Option<f64> = sqlx::query_scalar(
            "SELECT extract(epoch FROM now() - heartbeat_at)::float8 FROM fairlane_worker \
             WHERE id = $1",
        )
        .bind(&engine.worker_id)
        .fetch_optional(&db.pool)
        .await
        .unwrap();
        if let Some(age) = age {
            oldest_heartbeat = oldest_heartbeat.max(Duration::from_secs_f64(age.max(0.0)));
            samples += 1;
        }
    }
    let ended = ended.expect("the engine stops on its own");
    assert!(
        matches!(ended, Err(queue::QueueError::BackgroundTaskPanicked)),
        "{ended:?}"
    );
    // The drain (until the job ended or its grace ran out) was watched, a sample every 100 ms
    // or so; the job was finished or handed back by its own worker, not left for a rescuer.
    assert!(
        samples >= 5,
        "the heartbeat was looked at {samples} times while the engine drained"
    );
    assert_ne!(state_of(&db.pool, draining).await, "running");
    assert!(
        oldest_heartbeat < config.rescue_after,
        "the heartbeat went {oldest_heartbeat:?} stale while the engine drained"
    );
}

#[tokio::test]
async fn lost_database_connections_lose_and_double_nothing() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    sqlx::query("CREATE TABLE runs (job_id bigint NOT NULL, attempt int NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let log_pool = db.pool_with(4).await;
    let mut workers = Workers::new();
    workers.register_fn::<Sleep, _, _>(move |ctx, args| {
        let log_pool = log_pool.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(args.ms)).await;
            sqlx::query("INSERT INTO runs VALUES ($1, $2)")
                .bind(ctx.id())
                .bind(i32::from(ctx.job().attempt))
                .execute(&log_pool)
                .await
                .map_err(JobError::from)?;
            Ok(())
        }
    });
    let jobs: Vec<_> = (0..400)
        .map(|_| NewJob::new(q("q"), &Sleep { ms: 5 }).unwrap())
        .collect();
    client.insert_many(jobs).await.unwrap();
    let engine = start(&client, fast_config(), &[("q", 8)], workers);
    let mut completed_at_kills = Vec::new();
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let completed: i64 =
            sqlx::query_scalar("SELECT count(*) FROM fairlane_job WHERE state = 'completed'")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        completed_at_kills.push(completed);
        db.terminate_connections().await;
    }
    // The connections were lost while jobs were being worked, not after.
    assert!(completed_at_kills[0] < 400, "{completed_at_kills:?}");
    eventually(Duration::from_secs(60), "all 400 completed", || async {
        let n: Option<i64> =
            sqlx::query_scalar("SELECT count(*) FROM fairlane_job WHERE state = 'completed'")
                .fetch_one(&db.pool)
                .await
                .ok();
        (n == Some(400)).then_some(())
    })
    .await;
    engine.stop().await;
    let not_final: i64 =
        sqlx::query_scalar("SELECT count(*) FROM fairlane_job WHERE state <> 'completed'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(not_final, 0);
    // A job may run again if its first run's completion was lost with a connection, but a job is
    // never completed twice: each completed job has exactly one successful attempt recorded as
    // its final attempt.
    let mismatched: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM fairlane_job j WHERE NOT EXISTS \
         (SELECT 1 FROM runs r WHERE r.job_id = j.id AND r.attempt = j.attempt)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(mismatched, 0);
    // And no attempt ran twice: a second run is a new attempt, fetched anew.
    let doubled: Vec<(i64, i32)> = sqlx::query_as(
        "SELECT job_id, attempt FROM runs GROUP BY job_id, attempt HAVING count(*) > 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(doubled, []);
}

#[tokio::test]
async fn jobs_of_a_worker_that_stopped_heartbeating_are_rescued() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    // A worker that died: its row is stale and its job is still marked running.
    sqlx::query(
        "INSERT INTO fairlane_worker (id, hostname, pid, heartbeat_at) \
         VALUES ('dead-worker', 'h', 1, now() - interval '1 hour')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let orphan = client
        .insert(NewJob::new(q("q"), &Noop {}).unwrap())
        .await
        .unwrap()
        .job;
    let exhausted = client
        .insert(NewJob::new(q("q"), &Noop {}).unwrap().max_attempts(1))
        .await
        .unwrap()
        .job;
    sqlx::query(
        "UPDATE fairlane_job SET state = 'running', attempt = 1, attempted_at = now(), \
         attempted_by = '{dead-worker}' WHERE id = ANY($1)",
    )
    .bind(vec![orphan.id, exhausted.id])
    .execute(&db.pool)
    .await
    .unwrap();
    let mut workers = Workers::new();
    workers.register_fn::<Noop, _, _>(|_, _| async { Ok(()) });
    let engine = start(&client, fast_config(), &[("q", 1)], workers);
    let rescued = job_in_state(
        &client,
        orphan.id,
        JobState::Completed,
        Duration::from_secs(15),
        "orphan rescued and run",
    )
    .await;
    let exhausted = client.job(exhausted.id).await.unwrap().unwrap();
    engine.stop().await;
    assert_eq!(rescued.attempt_errors()[0].kind, FailureKind::Rescued);
    // The owner reads what happened; the operator, which worker it was.
    let error = &rescued.attempt_errors()[0];
    assert_eq!(
        error.error,
        "the worker running it stopped heartbeating; job rescued"
    );
    assert_eq!(error.worker.as_deref(), Some("dead-worker"));
    assert_eq!(exhausted.state, JobState::Discarded, "no attempts left");
    let dead: i64 =
        sqlx::query_scalar("SELECT count(*) FROM fairlane_worker WHERE id = 'dead-worker'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(dead, 0, "dead worker row reaped");
}

/// An engine without maintenance (the test rescues as a leader would) whose `Noop` handler
/// holds each run until `release` is notified.
struct HeldRuns {
    client: Client,
    engine: Running,
    release: Arc<tokio::sync::Notify>,
    config: queue::EngineConfig,
}

impl HeldRuns {
    fn start(db: &TestDb) -> HeldRuns {
        let client = Client::new(db.pool.clone());
        let release = Arc::new(tokio::sync::Notify::new());
        let mut workers = Workers::new();
        let handler_release = Arc::clone(&release);
        workers.register_fn::<Noop, _, _>(move |_, _| {
            let release = Arc::clone(&handler_release);
            async move {
                release.notified().await;
                Ok(())
            }
        });
        let config = queue::EngineConfig {
            maintenance: false,
            ..fast_config()
        };
        let engine = start(&client, config.clone(), &[("q", 1)], workers);
        HeldRuns {
            client,
            engine,
            release,
            config,
        }
    }

    /// Inserts a job with one attempt and waits until its run is held.
    async fn held_job(&self, db: &TestDb) -> i64 {
        let job = self
            .client
            .insert(NewJob::new(q("q"), &Noop {}).expect("job").max_attempts(1))
            .await
            .expect("insert")
            .job;
        eventually(Duration::from_secs(10), "the job running", || async {
            (state_of(&db.pool, job.id).await == "running").then_some(())
        })
        .await;
        job.id
    }

    /// A rescue now leaves the live run of `job` alone, and, released, the run completes it.
    async fn assert_not_rescued_and_completed(self, db: &TestDb, job: i64) {
        let waker = queue::wake::Waker::new(db.pool.clone());
        let rescued = queue::maintenance::rescue_dead_workers(
            &db.pool,
            &[],
            &waker,
            self.config.rescue_after,
        )
        .await
        .expect("rescue");
        assert!(rescued.is_empty(), "a live run was rescued: {rescued:?}");
        self.release.notify_one();
        let done = eventually(Duration::from_secs(10), "the job completed", || async {
            let j = self
                .client
                .job(job)
                .await
                .expect("look up")
                .expect("the job");
            j.state.is_final().then_some(j)
        })
        .await;
        self.engine.stop().await;
        assert_eq!(
            done.state,
            JobState::Completed,
            "{:?}",
            done.attempt_errors()
        );
    }
}

/// A worker cut off from the database long enough to be taken for dead is rescued and its row
/// deleted; when the database comes back, its producer may fetch before its heartbeat registers
/// it again. That run is live, and the rescuer leaves it alone: a job is rescued only once it has
/// been running for `rescue_after` too, by which time a live worker has heartbeated again.
/// (A trigger keeps this worker's heartbeat stale, as if it had not registered yet.)
#[tokio::test]
async fn a_job_fetched_by_a_worker_not_yet_registered_again_is_not_rescued() {
    let db = TestDb::new().await;
    let runs = HeldRuns::start(&db);
    keep_heartbeat_stale(&db.pool, &runs.engine.worker_id).await;
    // What the leader's rescue of a worker it took for dead does to its row.
    sqlx::query("DELETE FROM fairlane_worker WHERE id = $1")
        .bind(&runs.engine.worker_id)
        .execute(&db.pool)
        .await
        .unwrap();
    let job = runs.held_job(&db).await;
    runs.assert_not_rescued_and_completed(&db, job).await;
}

/// A lock on the job table held longer than `rescue_after` (an index built without
/// `CONCURRENTLY`, a `VACUUM FULL`) holds back the heartbeat's repairs, which update job rows,
/// but not the heartbeat itself: the worker stays alive in its row, and a rescuer that runs once
/// the lock is gone leaves its runs alone.
#[tokio::test]
async fn a_lock_on_the_job_table_does_not_stop_the_heartbeat() {
    let db = TestDb::new().await;
    let runs = HeldRuns::start(&db);
    let job = runs.held_job(&db).await;
    let mut locker = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE fairlane_job IN SHARE MODE")
        .execute(&mut *locker)
        .await
        .unwrap();
    tokio::time::sleep(runs.config.rescue_after + Duration::from_millis(500)).await;
    let heartbeat_age_ms: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM now() - heartbeat_at)::float8 * 1000 \
         FROM fairlane_worker WHERE id = $1",
    )
    .bind(&runs.engine.worker_id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        heartbeat_age_ms < runs.config.rescue_after.as_millis() as f64,
        "the heartbeat stopped behind the lock: {heartbeat_age_ms} ms old"
    );
    locker.commit().await.unwrap();
    runs.assert_not_rescued_and_completed(&db, job).await;
}

/// A completion whose connection goes silent (a failover to another host, a dropped route:
/// nothing answers and nothing is cut) is given up at the engine's database timeout, its
/// connection closed, and persisted on a fresh one. Without a deadline it waited for the
/// kernel to give up on the connection (about 15 minutes), with the job `running` and the
/// heartbeat, on a connection of its own, keeping it from the rescuer.
#[tokio::test]
async fn a_completion_on_a_connection_gone_silent_is_persisted_on_a_fresh_one() {
    let db = TestDb::new().await;
    let proxy = testkit::proxy::TcpProxy::start(db.server_address()).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&db.url_through(proxy.addr()))
        .await
        .unwrap();
    let client = Client::new(pool);
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let mut workers = Workers::new();
    {
        let release = release.clone();
        workers.register_fn::<Noop, _, _>(move |_, _| {
            let release = release.clone();
            async move {
                release
                    .acquire()
                    .await
                    .map_err(|e| JobError::msg(e.to_string()))?
                    .forget();
                Ok(())
            }
        });
    }
    let first = client
        .insert(NewJob::new(q("q"), &Noop {}).unwrap())
        .await
        .unwrap()
        .job;
    let config = queue::EngineConfig {
        database_timeout: Duration::from_secs(1),
        ..fast_config()
    };
    let engine = start(&client, config, &[("q", 2)], workers);
    eventually(Duration::from_secs(10), "the job running", || async {
        (state_of(&db.pool, first.id).await == "running").then_some(())
    })
    .await;
    // Every open connection of the engine goes silent; new ones reach the database again.
    proxy.stall();
    proxy.forward_to(db.server_address());
    release.add_permits(1);
    eventually(Duration::from_secs(30), "the job completed", || async {
        (state_of(&db.pool, first.id).await == "completed").then_some(())
    })
    .await;
    // And the engine fetches and completes new work.
    let second = client
        .insert(NewJob::new(q("q"), &Noop {}).unwrap())
        .await
        .unwrap()
        .job;
    release.add_permits(1);
    eventually(Duration::from_secs(30), "a later job completed", || async {
        (state_of(&db.pool, second.id).await == "completed").then_some(())
    })
    .await;
    let reruns: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM fairlane_job WHERE attempt <> 1 OR jsonb_array_length(errors) > 0",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(reruns, 0, "a job was rescued or run again");
    engine.stop().await;
}

/// A fetch held up by a lock on the job table dates its run from when it got through, not from
/// when its transaction began. Dated from the beginning, a run fetched after a wait longer than
/// the orphan grace looked, to a repair running just then, like one whose fetch reply was lost:
/// it was handed back (attempt given back) while this worker started it, and ran twice at once.
#[tokio::test]
async fn a_fetch_held_up_by_a_lock_dates_its_run_from_when_it_got_through() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let mut workers = Workers::new();
    workers.register_fn::<Noop, _, _>(|_, _| async move { Ok(()) });
    let job = client
        .insert(NewJob::new(q("q"), &Noop {}).unwrap())
        .await
        .unwrap()
        .job;
    // Writes wait; reads (the heartbeat's, the engine's start) go on.
    let mut locker = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE fairlane_job IN SHARE MODE")
        .execute(&mut *locker)
        .await
        .unwrap();
    let config = fast_config();
    let engine = start(&client, config.clone(), &[("q", 1)], workers);
    eventually(
        Duration::from_secs(20),
        "a fetch waiting for the lock",
        || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock' \
                   AND query LIKE '%SET state = ''running''%'",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap();
            (waiting > 0).then_some(())
        },
    )
    .await;
    tokio::time::sleep(config.orphan_grace * 3).await;
    let released_at: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&mut *locker)
        .await
        .unwrap();
    locker.commit().await.unwrap();
    let done = job_in_state(
        &client,
        job.id,
        JobState::Completed,
        Duration::from_secs(20),
        "the job completed",
    )
    .await;
    let attempted_at = done.attempted_at.expect("a completed job was attempted");
    assert!(
        attempted_at >= released_at,
        "the run is dated {attempted_at}, before the lock was released at {released_at}"
    );
    assert_eq!(done.attempt, 1);
    assert!(
        done.attempt_errors().is_empty(),
        "{:?}",
        done.attempt_errors()
    );
    engine.stop().await;
}

/// Why the first run of a job with `max_attempts` attempts was stopped, on an engine whose
/// heartbeat looks stale (a trigger keeps it so, as if it could not reach the database) and whose
/// run a rescue takes while it goes on; a second run completes at once. Returns the reason the
/// first run was told, the job, and the engine (still running).
async fn take_a_live_run(
    db: &TestDb,
    client: &Client,
    max_attempts: i16,
) -> (Option<queue::CancelReason>, i64, Running) {
    let (told, mut reason) = tokio::sync::mpsc::unbounded_channel();
    let mut workers = Workers::new();
    workers.register_fn::<Noop, _, _>(move |ctx, _| {
        let told = told.clone();
        async move {
            if ctx.job().attempt > 1 {
                return Ok(());
            }
            ctx.cancelled().await;
            let _ = told.send(ctx.cancel_reason());
            Err(JobError::msg("stopped"))
        }
    });
    let config = queue::EngineConfig {
        maintenance: false,
        ..fast_config()
    };
    let engine = start(client, config.clone(), &[("q", 2)], workers);
    let job = client
        .insert(
            NewJob::new(q("q"), &Noop {})
                .expect("job")
                .max_attempts(max_attempts),
        )
        .await
        .expect("insert")
        .job;
    eventually(Duration::from_secs(10), "the job running", || async {
        (state_of(&db.pool, job.id).await == "running").then_some(())
    })
    .await;
    keep_heartbeat_stale(&db.pool, &engine.worker_id).await;
    // The run must be as old as the rescue window before it is rescued.
    tokio::time::sleep(config.rescue_after + config.heartbeat_interval).await;
    let waker = queue::wake::Waker::new(db.pool.clone());
    let rescued =
        queue::maintenance::rescue_dead_workers(&db.pool, &[], &waker, config.rescue_after)
            .await
            .expect("rescue");
    assert_eq!(rescued.len(), 1, "{rescued:?}");
    let told = tokio::time::timeout(Duration::from_secs(5), reason.recv())
        .await
        .expect("the rescued run went on")
        .expect("the handler reported");
    (told, job.id, engine)
}

/// A worker whose heartbeat could not reach the database long enough looks dead, and its runs
/// are rescued while it still runs them. Once it reaches the database again, it stops those runs
/// (reason `Taken`) instead of running on beside whoever runs the job now.
#[tokio::test]
async fn a_run_rescued_from_a_live_worker_is_stopped_there() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let (told, job, engine) = take_a_live_run(&db, &client, 1).await;
    assert_eq!(told, Some(queue::CancelReason::Taken));
    engine.stop().await;
    // Its end is not saved over the rescue's.
    assert_eq!(state_of(&db.pool, job).await, "discarded");
}

/// As above, but the rescued job has attempts left, and this worker fetches it again at once:
/// the new run replaces the old one in the worker's books, and the old one is stopped then
/// (reason `Taken`), where the repairs could no longer reach it. The new run completes the job.
#[tokio::test]
async fn a_rescued_run_is_stopped_when_its_job_is_fetched_here_again() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let (told, job, engine) = take_a_live_run(&db, &client, 2).await;
    assert_eq!(told, Some(queue::CancelReason::Taken));
    let done = eventually(Duration::from_secs(10), "the job completed", || async {
        let j = client.job(job).await.unwrap().unwrap();
        j.state.is_final().then_some(j)
    })
    .await;
    engine.stop().await;
    assert_eq!(
        done.state,
        JobState::Completed,
        "{:?}",
        done.attempt_errors()
    );
    assert_eq!(done.attempt, 2);
}

#[tokio::test]
async fn cleaner_deletes_final_jobs_past_retention_only() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(
            client
                .insert(NewJob::new(q("q"), &Noop {}).unwrap())
                .await
                .unwrap()
                .job
                .id,
        );
    }
    // old completed, old cancelled, recent completed, still available
    sqlx::query(
        "UPDATE fairlane_job SET state = 'completed', finalized_at = now() - interval '25 hours' WHERE id = $1;",
    )
    .bind(ids[0])
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE fairlane_job SET state = 'cancelled', finalized_at = now() - interval '2 days' WHERE id = $1",
    )
    .bind(ids[1])
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE fairlane_job SET state = 'completed', finalized_at = now() - interval '1 hour' WHERE id = $1",
    )
    .bind(ids[2])
    .execute(&db.pool)
    .await
    .unwrap();
    let deleted = queue::maintenance::clean_finalized(&db.pool, &queue::EngineConfig::default())
        .await
        .unwrap();
    assert_eq!(deleted, 1, "only the completed job older than 24 h");
    let left: Vec<i64> = sqlx::query_scalar("SELECT id FROM fairlane_job ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, ids[1..].to_vec(), "cancelled jobs are kept 7 days");
}

#[tokio::test]
async fn jobs_inserted_in_a_queue_transaction_start_promptly_after_commit_and_vanish_on_rollback() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut workers = Workers::new();
    workers.register_fn::<Tag, _, _>(move |ctx, args| {
        let tx = tx.clone();
        async move {
            let wait = chrono::Utc::now() - ctx.job().created_at;
            let _ = tx.send((args.n, wait.as_seconds_f64()));
            Ok(())
        }
    });
    let mut config = fast_config();
    config.poll_interval = Duration::from_secs(5);
    let engine = start(&client, config, &[("txq", 2)], workers);
    wait_for_listener(&db.pool).await;

    // Rolled back: never runs.
    let mut qtx = client.begin().await.unwrap();
    qtx.insert(NewJob::new(q("txq"), &Tag { n: 1 }).unwrap())
        .await
        .unwrap();
    qtx.rollback().await.unwrap();

    // Committed together with another write: runs promptly, although nothing was NOTIFYed inside
    // the transaction.
    let mut qtx = client.begin().await.unwrap();
    sqlx::query("CREATE TABLE side_effect (x int)")
        .execute(&mut *qtx)
        .await
        .unwrap();
    qtx.insert(NewJob::new(q("txq"), &Tag { n: 2 }).unwrap())
        .await
        .unwrap();
    qtx.commit().await.unwrap();
    let (n, wait) = tokio::time::timeout(Duration::from_secs(3), rx.recv())
        .await
        .expect("committed job started long before the 5 s poll")
        .unwrap();
    assert_eq!(n, 2);
    assert!(wait < 1.0, "started {wait:.3}s after insert");
    engine.stop().await;
    assert!(rx.try_recv().is_err(), "the rolled-back job never ran");
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM fairlane_job")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(total, 1);
}

#[tokio::test]
async fn another_process_is_woken_through_notify_after_commit() {
    // Two clients with separate pools stand for two processes: the engine's client never sees
    // the inserting client's local wake-up, only the NOTIFY its waker sends after commit.
    let db = TestDb::new().await;
    let engine_client = Client::new(db.pool_with(5).await);
    let inserting = Client::new(db.pool_with(5).await);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut workers = Workers::new();
    workers.register_fn::<Tag, _, _>(move |_ctx, args| {
        let tx = tx.clone();
        async move {
            let _ = tx.send(args.n);
            Ok(())
        }
    });
    let mut config = fast_config();
    config.poll_interval = Duration::from_secs(5);
    let engine = start(&engine_client, config, &[("remote", 2)], workers);
    wait_for_listener(&db.pool).await;
    for n in 0..5 {
        let started = tokio::time::Instant::now();
        let mut qtx = inserting.begin().await.unwrap();
        qtx.insert(NewJob::new(q("remote"), &Tag { n }).unwrap())
            .await
            .unwrap();
        qtx.commit().await.unwrap();
        let got = tokio::time::timeout(Duration::from_secs(3), rx.recv())
            .await
            .expect("woken through NOTIFY, not the 5 s poll")
            .unwrap();
        assert_eq!(got, n);
        // Far below the 5 s poll, with room for a busy machine.
        assert!(started.elapsed() < Duration::from_secs(2));
    }
    engine.stop().await;
}

/// Runs a batch of completions with more than one job past a 100 ms statement timeout (as a
/// slow hook on a server with `statement_timeout` set would), and a single one slowly but
/// within it, counting the batches of more than one job it saw.
struct TimingOutBatches(Arc<AtomicUsize>);

#[async_trait::async_trait]
impl queue::TransitionHook for TimingOutBatches {
    async fn on_transitions(
        &self,
        conn: &mut sqlx::PgConnection,
        transitions: &[queue::Transition],
    ) -> Result<(), queue::BoxError> {
        if !transitions.iter().all(|t| t.state == JobState::Completed) {
            return Ok(());
        }
        if transitions.len() > 1 {
            self.0.fetch_add(1, Ordering::SeqCst);
            sqlx::query("SET LOCAL statement_timeout = '100ms'")
                .execute(&mut *conn)
                .await?;
        }
        // A single completion takes long enough for the others to queue up behind it.
        sqlx::query("SELECT pg_sleep(0.3)")
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}

/// A batch of completions that runs past the statement timeout every time is split, and its jobs
/// completed one by one; retried whole (a timeout is no refusal), it stayed `running` for ever,
/// and the completer with it.
#[tokio::test]
async fn a_batch_that_always_times_out_is_split_instead_of_retried_for_ever() {
    let db = TestDb::new().await;
    let batches = Arc::new(AtomicUsize::new(0));
    let client =
        Client::new(db.pool.clone()).with_hooks(vec![Arc::new(TimingOutBatches(batches.clone()))]);
    let mut workers = Workers::new();
    workers.register_fn::<Noop, _, _>(|_, _| async { Ok(()) });
    let noops: Vec<_> = (0..8)
        .map(|_| NewJob::new(q("q"), &Noop {}).unwrap())
        .collect();
    client.insert_many(noops).await.unwrap();
    let engine = start(&client, fast_config(), &[("q", 8)], workers);
    eventually(Duration::from_secs(30), "every job completed", || async {
        (count_in_state(&db.pool, "completed").await == 8).then_some(())
    })
    .await;
    engine.stop().await;
    assert!(
        batches.load(Ordering::SeqCst) > 0,
        "no batch of more than one completion was tried"
    );
    let errors: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM fairlane_job WHERE jsonb_array_length(errors) > 0 OR attempt <> 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(errors, 0, "a job was recorded as failed or ran again");
}

/// A hook that refuses every end of one kind's attempts (its completion, and the failure the
/// completer records instead) leaves those runs unsaved. The heartbeat hands them back with
/// their attempt used, so the job runs once per attempt and is discarded at the last, whose
/// failure the hook accepts, instead of being handed back with its attempt given back and run
/// for ever.
#[tokio::test]
async fn a_job_whose_every_end_a_hook_refuses_runs_out_of_attempts_instead_of_running_forever() {
    let db = TestDb::new().await;
    let hook = RefusingHook(|t: &queue::Transition| {
        t.kind == "tag" && matches!(t.state, JobState::Completed | JobState::Retryable)
    });
    let client = Client::new(db.pool.clone()).with_hooks(vec![Arc::new(hook)]);
    let runs = Arc::new(AtomicUsize::new(0));
    let mut workers = Workers::new();
    {
        let runs = runs.clone();
        workers.register_fn::<Tag, _, _>(move |_, _| {
            runs.fetch_add(1, Ordering::SeqCst);
            async { Ok(()) }
        });
    }
    workers.register_fn::<Noop, _, _>(|_, _| async { Ok(()) });
    let job = client
        .insert(NewJob::new(q("q"), &Tag { n: 1 }).unwrap().max_attempts(3))
        .await
        .unwrap()
        .job;
    let noops: Vec<_> = (0..10)
        .map(|_| NewJob::new(q("q"), &Noop {}).unwrap())
        .collect();
    client.insert_many(noops).await.unwrap();
    let engine = start(&client, fast_config(), &[("q", 4)], workers);
    let discarded = job_in_state(
        &client,
        job.id,
        JobState::Discarded,
        Duration::from_secs(30),
        "the job discarded",
    )
    .await;
    eventually(
        Duration::from_secs(10),
        "the other jobs completed",
        || async { (count_in_state(&db.pool, "completed").await == 10).then_some(()) },
    )
    .await;
    engine.stop().await;
    assert_eq!(runs.load(Ordering::SeqCst), 3, "one run per attempt");
    let errors = discarded.attempt_errors();
    assert_eq!(
        errors.iter().map(|e| e.attempt).collect::<Vec<_>>(),
        [1, 2, 3],
        "{errors:?}"
    );
    for e in &errors[..2] {
        assert_eq!(e.kind, FailureKind::Error);
        assert!(
            e.error.contains("could not save the end of this attempt"),
            "{}",
            e.error
        );
    }
    assert!(
        errors[2]
            .error
            .starts_with("the end of this attempt (completed) could not be saved: "),
        "{}",
        errors[2].error
    );
}

/// A rescue whose hooks fail on one dead worker's job still rescues every other one, one by one;
/// the refused job stays `running` and is rescued at a later pass once the hook takes it.
#[tokio::test]
async fn a_job_the_hooks_refuse_to_rescue_does_not_hold_back_the_others() {
    let db = TestDb::new().await;
    let poison = Arc::new(PoisonedJob::default());
    let hooks: Vec<Arc<dyn queue::TransitionHook>> = vec![poison.clone()];
    let ids = insert_noops(&Client::new(db.pool.clone()), "q", 3).await;
    poison.poison(ids[1]);
    mark_running(&db.pool, &ids, "dead-worker", 1_000).await;
    let waker = queue::wake::Waker::new(db.pool.clone());
    let stale = Duration::from_millis(100);

    let rescued = queue::maintenance::rescue_dead_workers(&db.pool, &hooks, &waker, stale)
        .await
        .expect("a refused job does not fail the rescue");
    let mut rescued_ids: Vec<i64> = rescued.iter().map(|t| t.job_id).collect();
    rescued_ids.sort_unstable();
    assert_eq!(rescued_ids, [ids[0], ids[2]]);
    assert_eq!(state_of(&db.pool, ids[0]).await, "available");
    assert_eq!(state_of(&db.pool, ids[1]).await, "running");
    assert_eq!(state_of(&db.pool, ids[2]).await, "available");

    poison.cure();
    let rescued = queue::maintenance::rescue_dead_workers(&db.pool, &hooks, &waker, stale)
        .await
        .unwrap();
    assert_eq!(
        rescued.iter().map(|t| t.job_id).collect::<Vec<_>>(),
        [ids[1]]
    );
    assert_eq!(state_of(&db.pool, ids[1]).await, "available");
}

/// The heartbeat's hand-back of jobs this worker was given but never received goes on for the
/// others when the hooks refuse one; that one is handed back at a later heartbeat once the hook
/// takes it.
#[tokio::test]
async fn an_orphan_the_hooks_refuse_to_hand_back_does_not_hold_back_the_others() {
    let db = TestDb::new().await;
    let poison = Arc::new(PoisonedJob::default());
    let client = Client::new(db.pool.clone()).with_hooks(vec![poison.clone()]);
    // In a queue this engine does not work, so that jobs handed back stay `available`.
    let ids = insert_noops(&client, "elsewhere", 3).await;
    poison.poison(ids[1]);
    let engine = start(&client, fast_config(), &[("q", 1)], Workers::new());
    mark_running(&db.pool, &ids, &engine.worker_id, 1_000).await;

    eventually(
        Duration::from_secs(15),
        "the others handed back",
        || async {
            let first = state_of(&db.pool, ids[0]).await;
            let last = state_of(&db.pool, ids[2]).await;
            (first == "available" && last == "available").then_some(())
        },
    )
    .await;
    tokio::time::sleep(fast_config().heartbeat_interval * 3).await;
    assert_eq!(state_of(&db.pool, ids[1]).await, "running");

    poison.cure();
    eventually(
        Duration::from_secs(15),
        "the refused one handed back later",
        || async { (state_of(&db.pool, ids[1]).await == "available").then_some(()) },
    )
    .await;
    engine.stop().await;
}

/// A job fetched again and again (a fairness snooze, hand-backs) keeps only its newest 100
/// workers in `attempted_by`: its row does not grow with every fetch.
#[tokio::test]
async fn attempted_by_keeps_the_newest_hundred_workers() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let job = client
        .insert(NewJob::new(q("q"), &Tag { n: 1 }).unwrap())
        .await
        .unwrap()
        .job;
    sqlx::query(
        "UPDATE fairlane_job SET attempted_by = \
           ARRAY(SELECT 'old-' || g FROM generate_series(1, 150) g) \
         WHERE id = $1",
    )
    .bind(job.id)
    .execute(&db.pool)
    .await
    .unwrap();
    let mut workers = Workers::new();
    workers.register_fn::<Tag, _, _>(|_, _| async { Ok(()) });
    let engine = start(&client, fast_config(), &[("q", 1)], workers);
    let done = job_in_state(
        &client,
        job.id,
        JobState::Completed,
        Duration::from_secs(20),
        "the job completed",
    )
    .await;
    let worker_id = engine.worker_id.clone();
    engine.stop().await;
    assert_eq!(done.attempted_by.len(), 100);
    assert_eq!(done.attempted_by[0], "old-52");
    assert_eq!(done.attempted_by[98], "old-150");
    assert_eq!(done.attempted_by[99], worker_id);
}

/// CPU time this process has used (user + system), from `/proc/self/stat`.
fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // The fields after the command name (which is in parentheses and may hold spaces).
    let after_name = stat.rfind(')').expect("a command name in parentheses") + 2;
    let fields: Vec<&str> = stat[after_name..].split(' ').collect();
    let ticks = |i: usize| fields[i].parse::<u64>().expect("a tick count");
    // utime and stime, the 14th and 15th fields of the line.
    let ticks = ticks(11) + ticks(12);
    // The kernel reports in USER_HZ, 100 per second on Linux.
    Duration::from_millis(ticks * 10)
}

/// Busy slots are a normal state (long jobs, full fleet): while every slot of a queue is busy
/// past its poll interval, the producer waits for a slot instead of spinning. It used to sleep
/// until the poll's instant, already past, and so burned a core for as long as the slots stayed
/// busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_whose_slots_are_all_busy_waits_without_spinning() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let mut workers = Workers::new();
    workers.register_fn::<Sleep, _, _>(|_ctx, args| async move {
        tokio::time::sleep(Duration::from_millis(args.ms)).await;
        Ok(())
    });
    let config = queue::EngineConfig {
        poll_interval: Duration::from_millis(100),
        ..fast_config()
    };
    let engine = start(&client, config, &[("busy", 1)], workers);
    let job = client
        .insert(NewJob::new(q("busy"), &Sleep { ms: 4_000 }).unwrap())
        .await
        .unwrap()
        .job
        .id;
    eventually(Duration::from_secs(10), "the job runs", || async {
        (state_of(&db.pool, job).await == "running").then_some(())
    })
    .await;
    let before = process_cpu();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let used = process_cpu() - before;
    eventually(Duration::from_secs(10), "the job completes", || async {
        (state_of(&db.pool, job).await == "completed").then_some(())
    })
    .await;
    engine.stop().await;
    // Heartbeats, promotion and maintenance cost a few milliseconds a second; a spinning
    // producer costs a whole core: 3 s here.
    assert!(
        used < Duration::from_millis(600),
        "{used:?} of CPU in 3 s with the only slot busy"
    );
}

/// A job keeps its newest `MAX_ATTEMPT_ERRORS` errors, each message cut at
/// `MAX_ERROR_MESSAGE_BYTES`: runs handed back give their attempt back, so a job interrupted at
/// every deploy grew its list without end, and a handler's error could be any length; the list
/// travels with every fetch and `GET /v1/jobs`.
#[tokio::test]
async fn a_job_keeps_its_newest_errors_each_cut_to_a_bounded_length() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let mut workers = Workers::new();
    workers.register_fn::<AlwaysFail, _, _>(|_, _| async move {
        Err(JobError::msg("e".repeat(100_000)))
    });
    let job = client
        .insert(NewJob::new(q("q"), &AlwaysFail {}).unwrap().max_attempts(1))
        .await
        .unwrap()
        .job;
    // A long life of hand-backs already: the list is full.
    sqlx::query(
        "UPDATE fairlane_job SET errors = (SELECT jsonb_agg(jsonb_build_object( \
             'attempt', 1, 'at', now(), 'kind', 'interrupted', 'error', 'handed back ' || i)) \
           FROM generate_series(1, $2) i) \
         WHERE id = $1",
    )
    .bind(job.id)
    .bind(i32::try_from(queue::MAX_ATTEMPT_ERRORS).unwrap())
    .execute(&db.pool)
    .await
    .unwrap();
    let engine = start(&client, fast_config(), &[("q", 1)], workers);
    let discarded = job_in_state(
        &client,
        job.id,
        JobState::Discarded,
        Duration::from_secs(20),
        "the job discarded",
    )
    .await;
    engine.stop().await;
    let errors = discarded.attempt_errors();
    assert_eq!(errors.len(), queue::MAX_ATTEMPT_ERRORS);
    assert_eq!(errors[0].error, "handed back 2", "the oldest was dropped");
    let newest = errors.last().unwrap();
    assert_eq!(newest.kind, FailureKind::Error);
    assert!(newest.error.starts_with("eeee") && newest.error.ends_with('…'));
    assert!(newest.error.len() <= queue::MAX_ERROR_MESSAGE_BYTES + '…'.len_utf8());
}

/// An output of more than `MAX_OUTPUT_BYTES` of JSON is refused when the handler sets it, and a
/// handler that passes the refusal on fails its attempt with the reason; the job keeps no output
/// (before, any size was stored in the job's row, which travels with every read of the job).
#[tokio::test]
async fn an_output_too_large_to_keep_is_refused() {
    let db = TestDb::new().await;
    let client = Client::new(db.pool.clone());
    let mut workers = Workers::new();
    workers.register_fn::<AlwaysFail, _, _>(|ctx, _| async move {
        ctx.set_output(&"x".repeat(queue::MAX_OUTPUT_BYTES))
            .map_err(JobError::from)?;
        Ok(())
    });
    let job = client
        .insert(NewJob::new(q("q"), &AlwaysFail {}).unwrap().max_attempts(1))
        .await
        .unwrap()
        .job;
    let engine = start(&client, fast_config(), &[("q", 1)], workers);
    let discarded = job_in_state(
        &client,
        job.id,
        JobState::Discarded,
        Duration::from_secs(20),
        "the job discarded",
    )
    .await;
    engine.stop().await;
    let errors = discarded.attempt_errors();
    assert_eq!(errors.len(), 1);
    assert!(
        errors[0]
            .error
            .contains("more than the 1048576 a job may keep"),
        "{}",
        errors[0].error
    );
    assert_eq!(discarded.output, None);
}
