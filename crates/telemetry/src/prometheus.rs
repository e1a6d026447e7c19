//! Prometheus text exposition (format 0.0.4) of the OpenTelemetry SDK's metrics, collected on
//! demand through a pull reader, with OpenTelemetry's Prometheus name translation.
//!
//! Translation (OpenTelemetry "Prometheus and OpenMetrics compatibility"):
//! - characters outside `[a-zA-Z0-9_:]` become `_`, runs of `_` collapse, a leading digit gets `_`;
//! - the unit is appended unless the name already ends with it: `s` → `_seconds`, `ms` →
//!   `_milliseconds`, `By` → `_bytes`, `a/b` → `_a_per_b`, `1` → `_ratio` (gauges only); parts in
//!   braces (`{job}`) are annotations and add nothing;
//! - monotonic sums are counters and end in `_total`; non-monotonic sums and gauges are gauges;
//! - explicit-bucket histograms become `_bucket{le}` (cumulative, with `+Inf`), `_sum`, `_count`.
//!
//! Attribute keys are sanitised like names (`.` → `_`; keys that collide after that have their
//! values joined with `;`). Resource attributes appear once, as `target_info{...} 1`. Scope
//! name/version are not added as labels (all Fairlane instruments share the `fairlane` meter).
//! Exponential histograms have no 0.0.4 form and are skipped; exemplars are not exposed.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, Metric, MetricData, ResourceMetrics};
use opentelemetry_sdk::metrics::reader::MetricReader;
use opentelemetry_sdk::metrics::{
    Aggregation, Instrument, InstrumentKind, ManualReader, Pipeline, Stream, Temporality,
};

/// The `Content-Type` of [`render_prometheus`]'s output.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Bucket boundaries for histograms measured in seconds (unit `s`): 1 ms to 10 min, so that a
/// job's wait and run time (minutes, for a queue that falls behind or an analysis near its
/// timeout) are measured as well as a request's latency. `histogram_quantile` never answers
/// above the largest finite boundary, so an alert's threshold must stay below it.
pub const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];

/// A metrics View: every histogram whose unit is `s` gets [`SECONDS_BUCKETS`]. [`crate::init`]
/// installs it, so latency histograms share buckets across services and dashboards. A View wins
/// over an instrument's own `with_boundaries` advice; instruments in other units keep theirs.
pub fn seconds_histogram_view(instrument: &Instrument) -> Option<Stream> {
    if instrument.kind() != InstrumentKind::Histogram || instrument.unit() != "s" {
        return None;
    }
    Stream::builder()
        .with_aggregation(Aggregation::ExplicitBucketHistogram {
            boundaries: SECONDS_BUCKETS.to_vec(),
            record_min_max: true,
        })
        .build()
        .ok()
}

/// A pull reader for an SDK `MeterProvider` that renders Prometheus text on demand.
///
/// Cloning shares the reader: register one clone with
/// `SdkMeterProvider::builder().with_reader(reader.clone())` and keep another to render.
#[derive(Debug, Clone)]
pub struct PrometheusReader {
    reader: Arc<ManualReader>,
}

impl Default for PrometheusReader {
    fn default() -> Self {
        PrometheusReader::new()
    }
}

impl PrometheusReader {
    /// A reader with cumulative temporality, as Prometheus expects.
    pub fn new() -> Self {
        PrometheusReader {
            reader: Arc::new(
                ManualReader::builder()
                    .with_temporality(Temporality::Cumulative)
                    .build(),
            ),
        }
    }

    /// Collects the provider's current metrics and renders them. Before the reader is
    /// registered, or after the provider shut down, this is the empty string.
    pub fn render(&self) -> String {
        let mut metrics = ResourceMetrics::default();
        match self.reader.collect(&mut metrics) {
            Ok(()) => encode(&metrics),
            Err(_) => String::new(),
        }
    }
}

impl MetricReader for PrometheusReader {
    fn register_pipeline(&self, pipeline: Weak<Pipeline>) {
        self.reader.register_pipeline(pipeline);
    }

    fn collect(&self, rm: &mut ResourceMetrics) -> OTelSdkResult {
        self.reader.collect(rm)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.reader.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.reader.shutdown_with_timeout(timeout)
    }

    fn temporality(&self, kind: InstrumentKind) -> Temporality {
        self.reader.temporality(kind)
    }
}

static GLOBAL_READER: OnceLock<PrometheusReader> = OnceLock::new();

/// Remembers the reader [`crate::init`] attached to the global meter provider.
pub(crate) fn set_global_reader(reader: PrometheusReader) {
    // init refuses to run twice (the tracing subscriber can be set once), so this is first.
    let _ = GLOBAL_READER.set(reader);
}

/// The Prometheus text (format 0.0.4, see [`PROMETHEUS_CONTENT_TYPE`]) of every metric recorded
/// through the global meter provider installed by [`crate::init`]. A binary serves it on
/// `GET /metrics`. Empty before `init` and after the guard shut telemetry down.
pub fn render_prometheus() -> String {
    GLOBAL_READER
        .get()
        .map(PrometheusReader::render)
        .unwrap_or_default()
}

/// The Prometheus metric type of a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrometheusType {
    /// A monotonic sum.
    Counter,
    /// A gauge or a non-monotonic sum.
    Gauge,
    /// An explicit-bucket histogram.
    Histogram,
}

impl PrometheusType {
    fn as_str(self) -> &'static str {
        match self {
            PrometheusType::Counter => "counter",
            PrometheusType::Gauge => "gauge",
            PrometheusType::Histogram => "histogram",
        }
    }
}

/// The Prometheus family name of an OpenTelemetry metric (see the module docs for the rules).
/// `("fairlane.job.wait", "s", Histogram)` → `fairlane_job_wait_seconds`;
/// `("fairlane.jobs", "{job}", Counter)` → `fairlane_jobs_total`.
pub fn prometheus_name(name: &str, unit: &str, kind: PrometheusType) -> String {
    let mut base = sanitize_name(name);
    if kind == PrometheusType::Counter
        && let Some(stripped) = base.strip_suffix("_total")
    {
        base.truncate(stripped.len());
    }
    if let Some(suffix) = unit_suffix(unit, kind) {
        let already = base == suffix || base.ends_with(&format!("_{suffix}"));
        if !already {
            if !base.ends_with('_') {
                base.push('_');
            }
            base.push_str(&suffix);
        }
    }
    if kind == PrometheusType::Counter {
        if !base.ends_with('_') {
            base.push('_');
        }
        base.push_str("total");
    }
    base
}

/// Replaces characters Prometheus does not allow in names with `_`, collapses runs of `_`, and
/// prefixes `_` when the name would start with a digit.
fn sanitize_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 1);
    for c in name.chars() {
        let c = if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
            c
        } else {
            '_'
        };
        if c == '_' && out.ends_with('_') {
            continue;
        }
        out.push(c);
    }
    if out.starts_with(|c: char| c.is_ascii_digit()) {
        out.insert(0, '_');
    }
    if out.is_empty() {
        out.push('_');
    }
    out
}

/// A label name: invalid characters become `_`; a leading digit gets the prefix `key_`; the names
/// Prometheus keeps for itself (`le`, which a histogram's buckets carry, and `__…`) get the
/// prefix `key_` too, so a sample never carries one label twice.
fn sanitize_label(key: &str) -> String {
    let mut out: String = key
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if out.starts_with(|c: char| c.is_ascii_digit()) || out.starts_with("__") || out == "le" {
        out.insert_str(0, "key_");
    }
    if out.is_empty() {
        out.push('_');
    }
    out
}

/// The name suffix for a UCUM unit, or `None` when the unit adds nothing.
fn unit_suffix(unit: &str, kind: PrometheusType) -> Option<String> {
    // `{...}` parts are annotations ("{job}", "{request}/s").
    let mut plain = String::with_capacity(unit.len());
    let mut depth = 0usize;
    for c in unit.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            _ if depth == 0 => plain.push(c),
            _ => {}
        }
    }
    let plain = plain.trim();
    if plain.is_empty() {
        return None;
    }
    if plain == "1" {
        return (kind == PrometheusType::Gauge).then(|| "ratio".to_owned());
    }
    let word = match plain.split_once('/') {
        Some((per, over)) => {
            let (per, over) = (per.trim(), over.trim());
            let over = unit_word(over, true);
            if per.is_empty() || per == "1" {
                format!("per_{over}")
            } else {
                format!("{}_per_{over}", unit_word(per, false))
            }
        }
        None => unit_word(plain, false).into_owned(),
    };
    let suffix = sanitize_name(&word);
    let suffix = suffix.trim_matches('_');
    (!suffix.is_empty()).then(|| suffix.to_owned())
}

/// The Prometheus word for a UCUM unit; `singular` for the part after `/` (`m/s` →
/// `meters_per_second`). Unknown units are used as written.
fn unit_word(unit: &str, singular: bool) -> Cow<'_, str> {
    let (plural, one) = match unit {
        "d" => ("days", "day"),
        "h" => ("hours", "hour"),
        "min" => ("minutes", "minute"),
        "s" => ("seconds", "second"),
        "ms" => ("milliseconds", "millisecond"),
        "us" => ("microseconds", "microsecond"),
        "ns" => ("nanoseconds", "nanosecond"),
        "By" => ("bytes", "byte"),
        "KiBy" => ("kibibytes", "kibibyte"),
        "MiBy" => ("mebibytes", "mebibyte"),
        "GiBy" => ("gibibytes", "gibibyte"),
        "TiBy" => ("tebibytes", "tebibyte"),
        "KBy" => ("kilobytes", "kilobyte"),
        "MBy" => ("megabytes", "megabyte"),
        "GBy" => ("gigabytes", "gigabyte"),
        "TBy" => ("terabytes", "terabyte"),
        "m" => ("meters", "meter"),
        "V" => ("volts", "volt"),
        "A" => ("amperes", "ampere"),
        "J" => ("joules", "joule"),
        "W" => ("watts", "watt"),
        "g" => ("grams", "gram"),
        "Cel" => ("celsius", "celsius"),
        "Hz" => ("hertz", "hertz"),
        "%" => ("percent", "percent"),
        "wk" => ("weeks", "week"),
        "mo" => ("months", "month"),
        "a" => ("years", "year"),
        other => return Cow::Borrowed(other),
    };
    Cow::Borrowed(if singular { one } else { plural })
}

/// Escapes a `# HELP` text: backslash and line feed.
fn escape_help(text: &str) -> String {
    text.replace('\\', "\\\\").replace('\n', "\\n")
}

/// Escapes a label value: backslash, double quote and line feed.
fn escape_label_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// Formats a sample value the way Prometheus parses it.
fn format_f64(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_owned()
    } else if v == f64::INFINITY {
        "+Inf".to_owned()
    } else if v == f64::NEG_INFINITY {
        "-Inf".to_owned()
    } else {
        format!("{v}")
    }
}

/// A sample value of any of the SDK's number types.
trait SampleValue: Copy {
    fn render(self) -> String;
}

impl SampleValue for f64 {
    fn render(self) -> String {
        format_f64(self)
    }
}

impl SampleValue for u64 {
    fn render(self) -> String {
        self.to_string()
    }
}

impl SampleValue for i64 {
    fn render(self) -> String {
        self.to_string()
    }
}

/// Label pairs of one series, sanitised, merged on collision and sorted by name.
type Labels = Vec<(String, String)>;

fn labels_of<'a>(attributes: impl Iterator<Item = &'a KeyValue>) -> Labels {
    // Sort by original key so that values of colliding keys join in a stable order.
    let mut pairs: Vec<(&str, Cow<'_, str>)> = attributes
        .map(|kv| (kv.key.as_str(), kv.value.as_str()))
        .collect();
    pairs.sort_by(|a, b| a.0.cmp(b.0));
    let mut merged: BTreeMap<String, String> = BTreeMap::new();
    for (key, value) in pairs {
        merged
            .entry(sanitize_label(key))
            .and_modify(|existing| {
                existing.push(';');
                existing.push_str(&value);
            })
            .or_insert_with(|| value.into_owned());
    }
    merged.into_iter().collect()
}

enum SeriesValue {
    Scalar(String),
    Histogram {
        /// (upper bound, cumulative count), ending with `+Inf`.
        buckets: Vec<(String, u64)>,
        sum: String,
        count: u64,
    },
}

struct Series {
    labels: Labels,
    value: SeriesValue,
}

struct Family {
    kind: PrometheusType,
    help: String,
    series: Vec<Series>,
}

/// Renders collected metrics as Prometheus text format 0.0.4: `target_info` first (from the
/// resource), then families sorted by name, series sorted by labels.
pub fn encode(metrics: &ResourceMetrics) -> String {
    let mut families: BTreeMap<String, Family> = BTreeMap::new();
    for scope in metrics.scope_metrics() {
        for metric in scope.metrics() {
            add_metric(&mut families, metric);
        }
    }

    let mut out = String::new();
    let resource = labels_of(
        metrics
            .resource()
            .iter()
            .map(|(k, v)| KeyValue::new(k.clone(), v.clone()))
            .collect::<Vec<_>>()
            .iter(),
    );
    if !resource.is_empty() && !families.contains_key("target_info") {
        out.push_str("# HELP target_info Target metadata\n# TYPE target_info gauge\n");
        write_sample(&mut out, "target_info", &resource, None, "1");
    }

    for (name, mut family) in families {
        if family.series.is_empty() {
            continue;
        }
        family.series.sort_by(|a, b| a.labels.cmp(&b.labels));
        if !family.help.is_empty() {
            let _ = writeln!(out, "# HELP {name} {}", escape_help(&family.help));
        }
        let _ = writeln!(out, "# TYPE {name} {}", family.kind.as_str());
        for series in &family.series {
            match &series.value {
                SeriesValue::Scalar(value) => {
                    write_sample(&mut out, &name, &series.labels, None, value);
                }
                SeriesValue::Histogram {
                    buckets,
                    sum,
                    count,
                } => {
                    let bucket_name = format!("{name}_bucket");
                    for (le, cumulative) in buckets {
                        write_sample(
                            &mut out,
                            &bucket_name,
                            &series.labels,
                            Some(le),
                            &cumulative.to_string(),
                        );
                    }
                    write_sample(&mut out, &format!("{name}_sum"), &series.labels, None, sum);
                    write_sample(
                        &mut out,
                        &format!("{name}_count"),
                        &series.labels,
                        None,
                        &count.to_string(),
                    );
                }
            }
        }
    }
    out
}

fn write_sample(out: &mut String, name: &str, labels: &Labels, le: Option<&str>, value: &str) {
    out.push_str(name);
    if !labels.is_empty() || le.is_some() {
        out.push('{');
        let mut first = true;
        let le_pair = le.map(|le| ("le", le));
        let pairs = labels
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .chain(le_pair);
        for (key, value) in pairs {
            if !first {
                out.push(',');
            }
            first = false;
            let _ = write!(out, "{key}=\"{}\"", escape_label_value(value));
        }
        out.push('}');
    }
    out.push(' ');
    out.push_str(value);
    out.push('\n');
}

fn add_metric(families: &mut BTreeMap<String, Family>, metric: &Metric) {
    let collected = match metric.data() {
        AggregatedMetrics::F64(data) => series_of(data),
        AggregatedMetrics::U64(data) => series_of(data),
        AggregatedMetrics::I64(data) => series_of(data),
    };
    let Some((kind, series)) = collected else {
        return;
    };
    let name = prometheus_name(metric.name(), metric.unit(), kind);
    let family = families.entry(name).or_insert_with(|| Family {
        kind,
        help: metric.description().to_owned(),
        series: Vec::new(),
    });
    // The same name with another type (possible only across meters) cannot share a family.
    if family.kind != kind {
        return;
    }
    if family.help.is_empty() {
        family.help = metric.description().to_owned();
    }
    family.series.extend(series);
}

fn series_of<T: SampleValue>(data: &MetricData<T>) -> Option<(PrometheusType, Vec<Series>)> {
    match data {
        MetricData::Gauge(gauge) => Some((
            PrometheusType::Gauge,
            gauge
                .data_points()
                .map(|p| Series {
                    labels: labels_of(p.attributes()),
                    value: SeriesValue::Scalar(p.value().render()),
                })
                .collect(),
        )),
        MetricData::Sum(sum) => {
            let kind = if sum.is_monotonic() {
                PrometheusType::Counter
            } else {
                PrometheusType::Gauge
            };
            Some((
                kind,
                sum.data_points()
                    .map(|p| Series {
                        labels: labels_of(p.attributes()),
                        value: SeriesValue::Scalar(p.value().render()),
                    })
                    .collect(),
            ))
        }
        MetricData::Histogram(histogram) => Some((
            PrometheusType::Histogram,
            histogram
                .data_points()
                .map(|p| {
                    let mut cumulative = 0u64;
                    let mut counts = p.bucket_counts();
                    let mut buckets: Vec<(String, u64)> = p
                        .bounds()
                        .map(|bound| {
                            cumulative += counts.next().unwrap_or(0);
                            (format_f64(bound), cumulative)
                        })
                        .collect();
                    buckets.push(("+Inf".to_owned(), p.count()));
                    Series {
                        labels: labels_of(p.attributes()),
                        value: SeriesValue::Histogram {
                            buckets,
                            sum: p.sum().render(),
                            count: p.count(),
                        },
                    }
                })
                .collect(),
        )),
        MetricData::ExponentialHistogram(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::metrics::MeterProvider as _;
    use opentelemetry_sdk::Resource;
    use opentelemetry_sdk::metrics::SdkMeterProvider;

    fn provider(resource: Resource) -> (SdkMeterProvider, PrometheusReader) {
        let reader = PrometheusReader::new();
        let provider = SdkMeterProvider::builder()
            .with_resource(resource)
            .with_reader(reader.clone())
            .with_view(seconds_histogram_view)
            .build();
        (provider, reader)
    }

    fn no_resource() -> Resource {
        Resource::builder_empty().build()
    }

    #[test]
    fn names_follow_the_compatibility_rules() {
        use PrometheusType::*;
        let table = [
            ("fairlane.queue.jobs", "", Gauge, "fairlane_queue_jobs"),
            ("fairlane.jobs", "{job}", Counter, "fairlane_jobs_total"),
            (
                "fairlane.job.wait",
                "s",
                Histogram,
                "fairlane_job_wait_seconds",
            ),
            (
                "fairlane.job.duration",
                "s",
                Histogram,
                "fairlane_job_duration_seconds",
            ),
            (
                "fairlane.workers.busy",
                "{worker}",
                Gauge,
                "fairlane_workers_busy",
            ),
            ("fairlane.workers.max", "", Gauge, "fairlane_workers_max"),
            (
                "fairlane.fairness.snoozes",
                "{snooze}",
                Counter,
                "fairlane_fairness_snoozes_total",
            ),
            (
                "fairlane.fairness.running",
                "",
                Gauge,
                "fairlane_fairness_running",
            ),
            (
                "fairlane.fairness.waiting",
                "{job}",
                Gauge,
                "fairlane_fairness_waiting",
            ),
            (
                "fairlane.quota.rejections",
                "",
                Counter,
                "fairlane_quota_rejections_total",
            ),
            (
                "fairlane.quota.reservations.active",
                "{reservation}",
                Gauge,
                "fairlane_quota_reservations_active",
            ),
            (
                "fairlane.ratelimit.decisions",
                "{decision}",
                Counter,
                "fairlane_ratelimit_decisions_total",
            ),
            (
                "http.server.request.duration",
                "s",
                Histogram,
                "http_server_request_duration_seconds",
            ),
            // Suffixes already present are not repeated.
            (
                "request.latency_seconds",
                "s",
                Histogram,
                "request_latency_seconds",
            ),
            ("requests_total", "", Counter, "requests_total"),
            (
                "bytes.sent_bytes_total",
                "By",
                Counter,
                "bytes_sent_bytes_total",
            ),
            // Other units and odd characters.
            ("payload.size", "By", Histogram, "payload_size_bytes"),
            ("cpu.utilization", "1", Gauge, "cpu_utilization_ratio"),
            ("retries", "1", Counter, "retries_total"),
            ("throughput", "{request}/s", Gauge, "throughput_per_second"),
            ("speed", "m/s", Gauge, "speed_meters_per_second"),
            ("io.time", "ms", Counter, "io_time_milliseconds_total"),
            ("weird--name!!x", "", Gauge, "weird_name_x"),
            ("9lives", "", Gauge, "_9lives"),
            ("ns:metric", "", Gauge, "ns:metric"),
        ];
        for (name, unit, kind, expected) in table {
            assert_eq!(
                prometheus_name(name, unit, kind),
                expected,
                "{name} [{unit}] {kind:?}"
            );
        }
    }

    #[test]
    fn label_keys_and_values_are_sanitised_and_escaped() {
        let labels = labels_of(
            [
                KeyValue::new("http.route", "/a\\b \"c\"\nd"),
                KeyValue::new("http_route", "second"),
                KeyValue::new("2xx", true),
                KeyValue::new("n", 5_i64),
                KeyValue::new("le", "x"),
                KeyValue::new("__name__", "y"),
                KeyValue::new("lead", "z"),
            ]
            .iter(),
        );
        assert_eq!(
            labels,
            vec![
                ("http_route".to_owned(), "/a\\b \"c\"\nd;second".to_owned()),
                ("key_2xx".to_owned(), "true".to_owned()),
                ("key___name__".to_owned(), "y".to_owned()),
                ("key_le".to_owned(), "x".to_owned()),
                ("lead".to_owned(), "z".to_owned()),
                ("n".to_owned(), "5".to_owned()),
            ]
        );
        assert_eq!(
            escape_label_value("/a\\b \"c\"\nd"),
            "/a\\\\b \\\"c\\\"\\nd"
        );
        assert_eq!(
            escape_help("line one\nback\\slash"),
            "line one\\nback\\\\slash"
        );
    }

    #[test]
    fn renders_counter_gauge_up_down_counter_and_histogram_exactly() {
        let (provider, reader) = provider(
            Resource::builder_empty()
                .with_attributes([
                    KeyValue::new("service.name", "fairlane-test"),
                    KeyValue::new("service.version", "1.2.3"),
                ])
                .build(),
        );
        let meter = provider.meter("fairlane");

        let jobs = meter
            .u64_counter("fairlane.jobs")
            .with_unit("{job}")
            .with_description("Jobs finished, by outcome")
            .build();
        jobs.add(
            3,
            &[
                KeyValue::new("queue", "analysis_default"),
                KeyValue::new("kind", "analyze"),
                KeyValue::new("outcome", "completed"),
            ],
        );
        jobs.add(
            1,
            &[
                KeyValue::new("queue", "analysis_default"),
                KeyValue::new("kind", "analyze"),
                KeyValue::new("outcome", "failed"),
            ],
        );

        let depth = meter
            .i64_gauge("fairlane.queue.jobs")
            .with_description("Jobs in a queue, by state")
            .build();
        depth.record(
            7,
            &[
                KeyValue::new("queue", "analysis_default"),
                KeyValue::new("state", "available"),
            ],
        );
        depth.record(
            -1,
            &[
                KeyValue::new("queue", "we\"ird\\q\nx"),
                KeyValue::new("state", "running"),
            ],
        );

        let busy = meter
            .i64_up_down_counter("fairlane.workers.busy")
            .with_unit("{worker}")
            .build();
        busy.add(5, &[KeyValue::new("queue", "analysis_default")]);
        busy.add(-2, &[KeyValue::new("queue", "analysis_default")]);

        let wait = meter
            .f64_histogram("fairlane.job.wait")
            .with_unit("s")
            .with_description("Time from scheduled_at to start")
            .build();
        // Binary fractions, so the sum below is exact.
        for v in [0.0009765625, 0.00390625, 0.125, 0.125, 75.0] {
            wait.record(v, &[KeyValue::new("queue", "analysis_default")]);
        }

        let text = reader.render();
        let expected = r#"# HELP target_info Target metadata
# TYPE target_info gauge
target_info{service_name="fairlane-test",service_version="1.2.3"} 1
# HELP fairlane_job_wait_seconds Time from scheduled_at to start
# TYPE fairlane_job_wait_seconds histogram
fairlane_job_wait_seconds_bucket{queue="analysis_default",le="0.001"} 1
fairlane_job_wait_seconds_bucket{queue="analysis_default",le="0.0025"} 1
fairlane_job_wait_seconds_bucket{queue="analysis_default",le="0.005"} 2
fairlane_job_wait_seconds_bucket{queue="analysis_default",le="0.01"} 2
fairlane_job_wait_seconds_bucket{queue="analysis_default",le="0.025"} 2
fairlane_job_wait_seconds_bucket{queue="analysis_default",le="0.05"} 2
fairlane_job_wait_seconds_bucket{queue="analysis_default",le="0.1"} 2
fairlane_job_wait_seconds_bucket{queue="analysis_default",le="0.25"} 4
fairlane_job_wait_seconds_bucket{queue="analysis_default",le="0.5"} 4
fairlane_job_wait_seconds_bucket{queue="analysis_default",le="1"} 4
fairlane_job_wait_seconds_bucket{queue="analysis_default",le="2.5"} 4
fairlane_job_wait_seconds_bucket{queue="analysis_default",le="5"} 4
fairlane_job_wait_seconds_bucket{queue="analysis_default",le="10"} 4
fairlane_job_wait_seconds_bucket{queue="analysis_default",le="30"} 4
fairlane_job_wait_seconds_bucket{queue="analysis_default",le="60"} 4
fairlane_job_wait_seconds_bucket{queue="analysis_default",le="120"} 5
fairlane_job_wait_seconds_bucket{queue="analysis_default",le="300"} 5
fairlane_job_wait_seconds_bucket{queue="analysis_default",le="600"} 5
fairlane_job_wait_seconds_bucket{queue="analysis_default",le="+Inf"} 5
fairlane_job_wait_seconds_sum{queue="analysis_default"} 75.2548828125
fairlane_job_wait_seconds_count{queue="analysis_default"} 5
# HELP fairlane_jobs_total Jobs finished, by outcome
# TYPE fairlane_jobs_total counter
fairlane_jobs_total{kind="analyze",outcome="completed",queue="analysis_default"} 3
fairlane_jobs_total{kind="analyze",outcome="failed",queue="analysis_default"} 1
# HELP fairlane_queue_jobs Jobs in a queue, by state
# TYPE fairlane_queue_jobs gauge
fairlane_queue_jobs{queue="analysis_default",state="available"} 7
fairlane_queue_jobs{queue="we\"ird\\q\nx",state="running"} -1
# TYPE fairlane_workers_busy gauge
fairlane_workers_busy{queue="analysis_default"} 3
"#;
        assert_eq!(text, expected);
        provider.shutdown().unwrap();
        assert_eq!(reader.render(), "", "nothing to read after shutdown");
    }

    #[test]
    fn observable_instruments_and_empty_families() {
        let (provider, reader) = provider(no_resource());
        let meter = provider.meter("fairlane");
        let _max = meter
            .u64_observable_gauge("fairlane.workers.max")
            .with_callback(|observer| {
                observer.observe(16, &[KeyValue::new("queue", "specview_default")]);
            })
            .build();
        let _seen = meter
            .f64_observable_counter("fairlane.cpu.time")
            .with_unit("s")
            .with_callback(|observer| observer.observe(1.5, &[]))
            .build();
        // Created but never recorded: no family at all.
        let _unused = meter.u64_counter("fairlane.quota.rejections").build();

        let text = reader.render();
        assert_eq!(
            text,
            "# TYPE fairlane_cpu_time_seconds_total counter\n\
             fairlane_cpu_time_seconds_total 1.5\n\
             # TYPE fairlane_workers_max gauge\n\
             fairlane_workers_max{queue=\"specview_default\"} 16\n"
        );
    }

    #[test]
    fn histograms_in_other_units_keep_their_own_boundaries() {
        let (provider, reader) = provider(no_resource());
        let meter = provider.meter("fairlane");
        let size = meter
            .u64_histogram("payload.size")
            .with_unit("By")
            .with_boundaries(vec![100.0, 1000.0])
            .build();
        size.record(50, &[]);
        size.record(5000, &[]);
        assert_eq!(
            reader.render(),
            "# TYPE payload_size_bytes histogram\n\
             payload_size_bytes_bucket{le=\"100\"} 1\n\
             payload_size_bytes_bucket{le=\"1000\"} 1\n\
             payload_size_bytes_bucket{le=\"+Inf\"} 2\n\
             payload_size_bytes_sum 5050\n\
             payload_size_bytes_count 2\n"
        );
    }

    #[test]
    fn special_float_values() {
        assert_eq!(format_f64(f64::NAN), "NaN");
        assert_eq!(format_f64(f64::INFINITY), "+Inf");
        assert_eq!(format_f64(f64::NEG_INFINITY), "-Inf");
        assert_eq!(format_f64(0.25), "0.25");
        assert_eq!(format_f64(60.0), "60");
    }
}
