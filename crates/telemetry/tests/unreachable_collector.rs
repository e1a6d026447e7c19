//! A collector that accepts connections but never answers must not hang shutdown: exports are
//! bounded by `otlp_export_timeout`, and dropping the guard on an async (current-thread)
//! runtime's thread returns. One global `init` per process: this file.

use std::sync::mpsc;
use std::time::Duration;

use telemetry::TelemetryConfig;

#[test]
fn shutdown_returns_when_the_collector_never_answers() {
    // Bound but never accepted: the kernel completes connections into the backlog, requests
    // are written, and no response ever comes.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let config = TelemetryConfig {
        otel_exporter_otlp_endpoint: Some(format!("http://{}", silent.local_addr().unwrap())),
        otlp_export_timeout: Duration::from_millis(300),
        ..TelemetryConfig::for_service("fairlane-silent", "0.0.1")
    };

    let (done_tx, done_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let guard = telemetry::init(&config).unwrap();
            let counter = opentelemetry::global::meter("fairlane")
                .u64_counter("fairlane.jobs")
                .build();
            counter.add(1, &[]);
            tracing::info_span!("request").in_scope(|| tracing::info!("about to shut down"));
            tokio::task::yield_now().await;
            // Dropped on the runtime's only thread, as `main` ending would do.
            drop(guard);
        });
        done_tx.send(()).unwrap();
    });
    // A generous liveness bound, far above timeout + the SDK's 5 s metric shutdown wait:
    // failing it means shutdown hung, not that it was slow.
    done_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("telemetry shutdown hung on an unresponsive collector");
    drop(silent);
}
