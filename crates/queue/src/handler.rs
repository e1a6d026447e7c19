//! Handlers by job kind: the [`Worker`] trait a job type implements, and the [`Workers`] registry a
//! process runs with. A fetched job whose kind has no handler fails with a clear error and is
//! retried or discarded by the normal rules; it is never dropped.

use std::collections::HashMap;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use common::JobArgs;
use futures_util::future::BoxFuture;

use crate::context::JobContext;
use crate::job::FailureKind;
use crate::outcome::{JobError, JobOutcome};

/// Runs jobs whose arguments are `A`.
#[async_trait]
pub trait Worker<A: JobArgs>: Send + Sync + 'static {
    /// Does the work. Return `Ok(())` on success; see [`JobError`] for the other outcomes.
    async fn work(&self, ctx: &JobContext, args: A) -> Result<(), JobError>;

    /// This kind's timeout; `None` uses the engine default.
    fn timeout(&self) -> Option<Duration> {
        None
    }
}

/// A handler with its argument type erased, so handlers of all kinds live in one map.
pub(crate) trait ErasedHandler: Send + Sync + 'static {
    fn run<'a>(&'a self, ctx: &'a JobContext) -> BoxFuture<'a, JobOutcome>;
    fn timeout(&self) -> Option<Duration>;
}

struct TypedHandler<A, W> {
    worker: W,
    _args: PhantomData<fn() -> A>,
}

impl<A: JobArgs, W: Worker<A>> ErasedHandler for TypedHandler<A, W> {
    fn run<'a>(&'a self, ctx: &'a JobContext) -> BoxFuture<'a, JobOutcome> {
        Box::pin(async move {
            // Deserialize from a borrow: cloning the JSON tree per job costs more than the decode.
            let args = match A::deserialize(&ctx.job().args) {
                Ok(args) => args,
                Err(e) => {
                    return JobOutcome::Failed {
                        kind: FailureKind::InvalidArgs,
                        message: format!("arguments of `{}` job do not decode: {e}", A::KIND),
                    };
                }
            };
            match self.worker.work(ctx, args).await {
                Ok(()) => JobOutcome::Completed,
                Err(e) => e.into_outcome(),
            }
        })
    }

    fn timeout(&self) -> Option<Duration> {
        self.worker.timeout()
    }
}

/// A [`Worker`] made from an async closure.
pub struct FnWorker<F> {
    f: F,
    timeout: Option<Duration>,
}

impl<F> FnWorker<F> {
    pub fn new(f: F) -> Self {
        FnWorker { f, timeout: None }
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
}

#[async_trait]
impl<A, F, Fut> Worker<A> for FnWorker<F>
where
    A: JobArgs,
    F: Fn(JobContext, A) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), JobError>> + Send + 'static,
{
    async fn work(&self, ctx: &JobContext, args: A) -> Result<(), JobError> {
        (self.f)(ctx.clone(), args).await
    }

    fn timeout(&self) -> Option<Duration> {
        self.timeout
    }
}

/// The handlers a process runs, by job kind.
#[derive(Default, Clone)]
pub struct Workers {
    handlers: HashMap<&'static str, Arc<dyn ErasedHandler>>,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workers")
            .field("kinds", &self.kinds())
            .finish()
    }
}

impl Workers {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers the handler of `A::KIND`, replacing any earlier one.
    pub fn register<A: JobArgs, W: Worker<A>>(&mut self, worker: W) -> &mut Self {
        self.handlers.insert(
            A::KIND,
            Arc::new(TypedHandler::<A, W> {
                worker,
                _args: PhantomData,
            }),
        );
        self
    }

    /// Registers an async closure as the handler of `A::KIND`.
    pub fn register_fn<A, F, Fut>(&mut self, f: F) -> &mut Self
    where
        A: JobArgs,
        F: Fn(JobContext, A) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), JobError>> + Send + 'static,
    {
        self.register::<A, _>(FnWorker::new(f))
    }

    /// The registered kinds, sorted.
    pub fn kinds(&self) -> Vec<&'static str> {
        let mut kinds: Vec<_> = self.handlers.keys().copied().collect();
        kinds.sort_unstable();
        kinds
    }

    pub(crate) fn get(&self, kind: &str) -> Option<&Arc<dyn ErasedHandler>> {
        self.handlers.get(kind)
    }
}
