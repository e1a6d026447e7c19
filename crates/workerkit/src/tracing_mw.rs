//! Continues the trace of the request that enqueued a job: the job's span becomes a child of the
//! W3C context stored in its metadata (`trace`), so one trace runs from the API into the worker.

use std::collections::BTreeMap;

use async_trait::async_trait;
use queue::{JobContext, JobOutcome, Middleware, Next};
use tracing::Instrument;

/// The outermost middleware of every worker service.
#[derive(Debug, Clone, Copy)]
pub struct TraceMiddleware;

#[async_trait]
impl Middleware for TraceMiddleware {
    async fn handle(&self, ctx: &JobContext, next: Next<'_>) -> JobOutcome {
        let job = ctx.job();
        let span = tracing::info_span!(
            "job.process",
            otel.name = %format!("process {}", job.kind),
            otel.kind = "consumer",
            messaging.system = "fairlane",
            messaging.operation.name = "process",
            messaging.destination.name = %job.queue,
            messaging.message.id = job.id,
            job.kind = %job.kind,
            job.attempt = job.attempt,
        );
        if let Some(carrier) = job
            .metadata
            .get(telemetry::JOB_METADATA_TRACE_KEY)
            .and_then(|v| serde_json::from_value::<BTreeMap<String, String>>(v.clone()).ok())
            && let Err(e) = telemetry::set_parent_from(&span, &carrier)
        {
            tracing::debug!(error = %e, "job carries an unusable trace context");
        }
        next.run(ctx).instrument(span).await
    }
}
