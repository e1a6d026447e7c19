//! Request coalescing: concurrent requests that each need the same kind of database work are
//! served together, one batch per round of statements, instead of one round each.
//!
//! A [`Batcher`] has `shards` queues, each with one collector; an item goes to the shard of its
//! [`BatchRun::shard_key`], so items with the same key (the same user) never run in two
//! batches at once and keep their order, and batches running side by side never wait for each
//! other's row locks. A collector waits for the first item, takes whatever else is already
//! queued (up to `max_batch`) and runs the batch; items that arrive meanwhile form the next one.
//! Nothing waits for a batch to fill: an idle server runs a batch of one at once, and a busy one
//! gathers as many items as arrive while the previous batch runs — the idea of PostgreSQL's
//! group commit.
//!
//! Collectors run on a [`BatchThread`]: a thread of their own with a single-threaded Tokio runtime,
//! whose I/O driver serves only their database connections. On the server's runtime a
//! collector's reply from PostgreSQL waited behind the HTTP tasks its previous batch had just
//! woken, and a batch is four round trips one after the other (ADR 0012).

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures_util::FutureExt;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::{mpsc, oneshot};
use tokio_util::task::TaskTracker;

/// The work a [`Batcher`] does for a batch.
pub trait BatchRun: Send + Sync + 'static {
    type Item: Send + 'static;
    type Output: Send + 'static;

    /// Which shard an item belongs to (items of one key are served in order, one batch at a
    /// time).
    fn shard_key(item: &Self::Item) -> u64;

    /// Serves `batch`, answering each request with [`Pending::answer`]. A request dropped
    /// unanswered fails with [`BatchFailed`]. [`Pending::is_abandoned`] tells whether its
    /// caller still waits, so the runner can leave out work nobody wants any more.
    fn run(&self, batch: Vec<Pending<Self>>) -> impl Future<Output = ()> + Send;
}

/// A request in a batch: the item and the way to answer it.
pub struct Pending<R: BatchRun + ?Sized> {
    pub item: R::Item,
    reply: oneshot::Sender<R::Output>,
}

impl<R: BatchRun + ?Sized> Pending<R> {
    /// The caller stopped waiting (its request was dropped, e.g. by a timeout).
    pub fn is_abandoned(&self) -> bool {
        self.reply.is_closed()
    }

    /// Answers the caller (a no-op if it stopped waiting).
    pub fn answer(self, output: R::Output) {
        let _ = self.reply.send(output);
    }
}

/// The batcher stopped (its runtime is shutting down) or the batch panicked; the item's fate is
/// unknown only in the latter case, which is logged.
#[derive(Debug, thiserror::Error)]
#[error("the request batch did not complete")]
pub struct BatchFailed;

/// Submits items to the collectors. Cheap to clone; the collectors stop once every clone is
/// dropped and their queues are drained.
pub struct Batcher<R: BatchRun> {
    shards: Arc<[mpsc::Sender<Pending<R>>]>,
}

impl<R: BatchRun> Clone for Batcher<R> {
    fn clone(&self) -> Self {
        Batcher {
            shards: Arc::clone(&self.shards),
        }
    }
}

impl<R: BatchRun> Batcher<R> {
    /// Starts `shards` collectors (at least one) on `thread`, each running batches of at most
    /// `max_batch` items (at least one).
    pub fn start(thread: &BatchThread, runner: R, max_batch: usize, shards: usize) -> Self {
        let max_batch = max_batch.max(1);
        let runner = Arc::new(runner);
        let shards: Vec<_> = (0..shards.max(1))
            .map(|_| {
                let (sender, receiver) = mpsc::channel(max_batch * 2);
                thread.tracker.spawn_on(
                    collect(Arc::clone(&runner), receiver, max_batch),
                    &thread.handle,
                );
                sender
            })
            .collect();
        Batcher {
            shards: Arc::from(shards),
        }
    }

    /// Queues `item` and waits for its output. If the caller stops waiting (a dropped request),
    /// an item not yet taken into a batch is skipped; one already running completes.
    pub async fn submit(&self, item: R::Item) -> Result<R::Output, BatchFailed> {
        let shard = R::shard_key(&item) % self.shards.len() as u64;
        let sender = &self.shards[usize::try_from(shard).unwrap_or(0)];
        let (reply, output) = oneshot::channel();
        sender
            .send(Pending { item, reply })
            .await
            .map_err(|_| BatchFailed)?;
        output.await.map_err(|_| BatchFailed)
    }
}

/// The thread batch collectors run on: a single-threaded Tokio runtime of its own. Connections
/// opened from it ([`BatchThread::pool`]) are driven by its I/O driver, so a collector is woken
/// as soon as PostgreSQL answers, however busy the server's runtime is.
///
/// [`BatchThread::stop`] (or dropping it) lets the thread end once every collector on it has
/// stopped (each stops when its [`Batcher`] is dropped and its queue is drained); it then closes
/// its pools.
#[derive(Debug)]
pub struct BatchThread {
    handle: tokio::runtime::Handle,
    tracker: TaskTracker,
    pools: Arc<std::sync::Mutex<Vec<PgPool>>>,
    /// Dropping it tells the thread to end when its collectors have.
    stop: oneshot::Sender<()>,
    /// Resolves when the thread has closed its pools.
    done: oneshot::Receiver<()>,
}

impl BatchThread {
    /// Starts the thread, named `name`.
    pub fn start(name: &str) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let tracker = TaskTracker::new();
        let pools: Arc<std::sync::Mutex<Vec<PgPool>>> = Arc::default();
        let (stop, stopped) = oneshot::channel::<()>();
        let (finished, done) = oneshot::channel::<()>();
        let (collectors, opened) = (tracker.clone(), Arc::clone(&pools));
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                runtime.block_on(async move {
                    // Resolves (with an error) when the sender is dropped.
                    let _ = stopped.await;
                    collectors.close();
                    collectors.wait().await;
                    let pools =
                        std::mem::take(&mut *opened.lock().unwrap_or_else(|e| e.into_inner()));
                    for pool in pools {
                        pool.close().await;
                    }
                });
                let _ = finished.send(());
            })?;
        Ok(BatchThread {
            handle,
            tracker,
            pools,
            stop,
            done,
        })
    }

    /// A pool of at most `max_connections` connections like `pool`'s (same server, same
    /// session settings), opened from this thread, for its collectors; closed when the thread
    /// ends.
    pub fn pool(&self, pool: &PgPool, max_connections: u32) -> PgPool {
        // The pool's own tasks start on the runtime entered here, and its connections are opened
        // by the collectors' acquires, which run on this thread.
        let _entered = self.handle.enter();
        let own = PgPoolOptions::new()
            .max_connections(max_connections.max(1))
            .acquire_timeout(std::time::Duration::from_secs(10))
            .connect_lazy_with((*pool.connect_options()).clone());
        self.pools
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(own.clone());
        own
    }

    /// Lets the thread end once its collectors have (drop their [`Batcher`]s first) and waits up
    /// to `patience` for it to close its pools; says whether it did.
    pub async fn stop(self, patience: std::time::Duration) -> bool {
        let BatchThread { stop, done, .. } = self;
        drop(stop);
        tokio::time::timeout(patience, done).await.is_ok()
    }
}

async fn collect<R: BatchRun>(
    runner: Arc<R>,
    mut receiver: mpsc::Receiver<Pending<R>>,
    max_batch: usize,
) {
    while let Some(first) = receiver.recv().await {
        let mut batch = vec![first];
        while batch.len() < max_batch {
            match receiver.try_recv() {
                Ok(pending) => batch.push(pending),
                Err(_) => break,
            }
        }
        batch.retain(|pending| !pending.is_abandoned());
        if batch.is_empty() {
            continue;
        }
        let count = batch.len();
        // A panicking batch must not take the collector with it. Its requests are dropped
        // unanswered as it unwinds, so their callers fail. It runs in place, not as a task of
        // its own: a task per batch would cost a hop through the scheduler and copies of a
        // large future.
        if let Err(panic) = AssertUnwindSafe(runner.run(batch)).catch_unwind().await {
            let message = common::report::panic_text(&*panic).unwrap_or("(no message)");
            tracing::error!(
                requests = count,
                panic = message,
                "a request batch panicked"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::held::tests::{is_connected, wait_until_disconnected};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// Doubles numbers, records batch sizes, panics on 13, answers nothing for 99.
    #[derive(Default)]
    struct Doubler {
        sizes: std::sync::Mutex<Vec<usize>>,
        running: AtomicUsize,
        most_running: AtomicUsize,
        /// Notified as each batch starts.
        started: tokio::sync::Notify,
    }

    impl BatchRun for Arc<Doubler> {
        type Item = u64;
        type Output = u64;
        fn shard_key(item: &u64) -> u64 {
            *item
        }
        async fn run(&self, batch: Vec<Pending<Self>>) {
            let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.most_running.fetch_max(now, Ordering::SeqCst);
            self.sizes.lock().unwrap().push(batch.len());
            self.started.notify_one();
            tokio::time::sleep(Duration::from_millis(20)).await;
            self.running.fetch_sub(1, Ordering::SeqCst);
            assert!(!batch.iter().any(|p| p.item == 13), "unlucky");
            if batch.iter().any(|p| p.item == 99) {
                return;
            }
            for p in batch {
                let doubled = p.item * 2;
                p.answer(doubled);
            }
        }
    }

    fn thread() -> BatchThread {
        BatchThread::start("batch-test").unwrap()
    }

    #[tokio::test]
    async fn concurrent_items_share_batches_and_each_gets_its_own_output() {
        let doubler = Arc::new(Doubler::default());
        let batcher = Batcher::start(&thread(), Arc::clone(&doubler), 8, 2);
        let tasks: Vec<_> = (100..140u64)
            .map(|i| {
                let b = batcher.clone();
                tokio::spawn(async move { (i, b.submit(i).await.unwrap()) })
            })
            .collect();
        for t in tasks {
            let (i, out) = t.await.unwrap();
            assert_eq!(out, i * 2);
        }
        let sizes = doubler.sizes.lock().unwrap().clone();
        assert_eq!(sizes.iter().sum::<usize>(), 40);
        assert!(sizes.iter().all(|&s| s <= 8), "{sizes:?}");
        assert!(sizes.len() < 40, "items were batched: {sizes:?}");
        assert_eq!(doubler.most_running.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_lone_item_runs_at_once() {
        let batcher = Batcher::start(&thread(), Arc::new(Doubler::default()), 64, 1);
        let started = std::time::Instant::now();
        assert_eq!(batcher.submit(4).await.unwrap(), 8);
        assert!(started.elapsed() < Duration::from_secs(1));
    }

    #[tokio::test]
    async fn a_panicking_or_unanswered_batch_fails_its_items_and_the_batcher_goes_on() {
        let batcher = Batcher::start(&thread(), Arc::new(Doubler::default()), 1, 1);
        assert!(batcher.submit(13).await.is_err());
        assert!(batcher.submit(99).await.is_err());
        assert_eq!(batcher.submit(5).await.unwrap(), 10);
    }

    #[tokio::test]
    async fn requests_abandoned_before_their_batch_are_skipped() {
        let doubler = Arc::new(Doubler::default());
        let batcher = Batcher::start(&thread(), Arc::clone(&doubler), 8, 1);
        let busy = {
            let b = batcher.clone();
            tokio::spawn(async move { b.submit(1).await })
        };
        doubler.started.notified().await;
        // Queued behind the running batch, then given up on.
        let gave_up = tokio::time::timeout(Duration::from_millis(1), batcher.submit(2)).await;
        assert!(gave_up.is_err());
        assert_eq!(busy.await.unwrap().unwrap(), 2);
        assert_eq!(batcher.submit(3).await.unwrap(), 6);
        assert_eq!(*doubler.sizes.lock().unwrap(), vec![1, 1]);
    }

    #[tokio::test]
    async fn items_of_one_shard_run_one_batch_at_a_time_in_order() {
        let doubler = Arc::new(Doubler::default());
        let batcher = Batcher::start(&thread(), Arc::clone(&doubler), 4, 2);
        // Even numbers all land on shard 0.
        let tasks: Vec<_> = (0..20u64)
            .map(|i| {
                let b = batcher.clone();
                tokio::spawn(async move { b.submit(200 + 2 * i).await.unwrap() })
            })
            .collect();
        for (i, t) in tasks.into_iter().enumerate() {
            assert_eq!(t.await.unwrap(), 2 * (200 + 2 * i as u64));
        }
        assert_eq!(doubler.most_running.load(Ordering::SeqCst), 1);
    }

    /// Answers every item with the backend serving the batch and the name of the thread it ran
    /// on.
    struct Backend {
        pool: PgPool,
    }

    impl BatchRun for Backend {
        type Item = ();
        type Output = (i32, String);
        fn shard_key(_: &()) -> u64 {
            0
        }
        async fn run(&self, batch: Vec<Pending<Self>>) {
            let (pid,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()")
                .fetch_one(&self.pool)
                .await
                .unwrap();
            let thread = std::thread::current().name().unwrap_or_default().to_owned();
            for p in batch {
                p.answer((pid, thread.clone()));
            }
        }
    }

    #[tokio::test]
    async fn collectors_run_on_the_batch_thread_and_its_stop_closes_their_connections() {
        let db = testkit::TestDb::new().await;
        let thread = BatchThread::start("batch-db-test").unwrap();
        let batcher = Batcher::start(
            &thread,
            Backend {
                pool: thread.pool(&db.pool, 1),
            },
            8,
            1,
        );
        let (pid, name) = batcher.submit(()).await.unwrap();
        assert_eq!(name, "batch-db-test");
        assert!(is_connected(&db.pool, pid).await);

        drop(batcher);
        assert!(thread.stop(Duration::from_secs(10)).await);
        wait_until_disconnected(&db.pool, pid, "the batch thread's connection is still open").await;
    }

    #[tokio::test]
    async fn stop_waits_for_collectors_whose_batcher_is_still_alive() {
        let thread = BatchThread::start("batch-test-alive").unwrap();
        let batcher = Batcher::start(&thread, Arc::new(Doubler::default()), 8, 1);
        assert!(!thread.stop(Duration::from_millis(100)).await);
        // The collector still serves until its batcher is dropped.
        assert_eq!(batcher.submit(21).await.unwrap(), 42);
    }
}
