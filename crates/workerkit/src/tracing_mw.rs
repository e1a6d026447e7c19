//! Continues the trace of the request that enqueued a job: each attempt runs in a `job.process`
//! span whose parent is the W3C context stored in the job's metadata (`trace`), so one trace
//! runs from the API into the worker, the attempt's middleware, handler and end included.

use std::collections::BTreeMap;

use queue::JobRow;

/// The span an attempt of `job` runs in ([`queue::EngineBuilder::job_span`]).
pub fn job_span(job: &JobRow) -> tracing::Span {
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
    span
}
