//! Worker middleware: code wrapped around every job execution. A middleware may run the rest of the
//! chain (and look at or replace its outcome) or return any outcome without running it — snooze
//! included, which is how per-user fairness delays a job.

use std::sync::Arc;

use async_trait::async_trait;

use crate::context::JobContext;
use crate::handler::ErasedHandler;
use crate::outcome::JobOutcome;

/// One layer around job execution.
#[async_trait]
pub trait Middleware: Send + Sync + 'static {
    async fn handle(&self, ctx: &JobContext, next: Next<'_>) -> JobOutcome;
}

/// The rest of the chain after the current middleware, ending in the handler.
pub struct Next<'a> {
    rest: &'a [Arc<dyn Middleware>],
    handler: &'a dyn ErasedHandler,
}

impl<'a> Next<'a> {
    pub(crate) fn new(chain: &'a [Arc<dyn Middleware>], handler: &'a dyn ErasedHandler) -> Self {
        Next {
            rest: chain,
            handler,
        }
    }

    /// Runs the remaining middleware and the handler.
    pub async fn run(self, ctx: &JobContext) -> JobOutcome {
        match self.rest.split_first() {
            Some((first, rest)) => {
                first
                    .handle(
                        ctx,
                        Next {
                            rest,
                            handler: self.handler,
                        },
                    )
                    .await
            }
            None => self.handler.run(ctx).await,
        }
    }
}
