//! The queue's OpenTelemetry instruments. Names follow OTel conventions and become the SPEC §8
//! Prometheus names (`fairlane.jobs` → `fairlane_jobs_total`, `fairlane.job.wait` in seconds →
//! `fairlane_job_wait_seconds`, …) in the telemetry crate's exposition. Histograms in seconds get
//! their buckets (1 ms to 10 min) from the telemetry crate's view, which every service installs.

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Gauge, Histogram, UpDownCounter};

#[derive(Debug, Clone)]
pub(crate) struct QueueMetrics {
    jobs: Counter<u64>,
    wait: Histogram<f64>,
    duration: Histogram<f64>,
    busy: UpDownCounter<i64>,
    max: Gauge<i64>,
}

impl QueueMetrics {
    pub(crate) fn new() -> Self {
        let meter = opentelemetry::global::meter("fairlane");
        QueueMetrics {
            jobs: meter
                .u64_counter("fairlane.jobs")
                .with_unit("{job}")
                .with_description("Job attempts finished, by queue, kind and outcome")
                .build(),
            wait: meter
                .f64_histogram("fairlane.job.wait")
                .with_unit("s")
                .with_description(
                    "Time from a job being due (scheduled_at) to its attempt starting",
                )
                .build(),
            duration: meter
                .f64_histogram("fairlane.job.duration")
                .with_unit("s")
                .with_description("Time a job attempt ran in its handler")
                .build(),
            busy: meter
                .i64_up_down_counter("fairlane.workers.busy")
                .with_unit("{worker}")
                .with_description("Workers currently running a job, by queue")
                .build(),
            max: meter
                .i64_gauge("fairlane.workers.max")
                .with_unit("{worker}")
                .with_description("Configured workers per queue in this process")
                .build(),
        }
    }

    pub(crate) fn record_max(&self, queue: &KeyValue, max: usize) {
        self.max.record(
            i64::try_from(max).unwrap_or(i64::MAX),
            std::slice::from_ref(queue),
        );
    }

    pub(crate) fn started(&self, queue: &KeyValue, wait_seconds: f64) {
        self.busy.add(1, std::slice::from_ref(queue));
        self.wait
            .record(wait_seconds.max(0.0), std::slice::from_ref(queue));
    }

    pub(crate) fn finished(&self, queue: &KeyValue, kind: &str, seconds: f64) {
        self.busy.add(-1, std::slice::from_ref(queue));
        self.duration.record(
            seconds,
            &[queue.clone(), KeyValue::new("kind", kind.to_owned())],
        );
    }

    pub(crate) fn outcome(&self, queue: &str, kind: &str, outcome: &'static str) {
        self.jobs.add(
            1,
            &[
                KeyValue::new("queue", queue.to_owned()),
                KeyValue::new("kind", kind.to_owned()),
                KeyValue::new("outcome", outcome),
            ],
        );
    }
}
