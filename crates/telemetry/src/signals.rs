//! Shutdown on SIGTERM or SIGINT, the same in every service binary. The signal streams are
//! created before [`shutdown_on_signals`] returns, so from then on either signal means "shut
//! down", never the default action (the process dying with a non-zero status). Creating them
//! inside a spawned task instead would leave a window, until that task first runs, in which a
//! SIGTERM kills the process.

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// A token cancelled on the first SIGTERM or SIGINT from now on (logged). Must be called inside
/// a Tokio runtime. Fails only when the handlers cannot be installed.
pub fn shutdown_on_signals() -> std::io::Result<CancellationToken> {
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let shutdown = CancellationToken::new();
    let cancel = shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = terminate.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = interrupt.recv() => tracing::info!("SIGINT: shutting down"),
        }
        cancel.cancel();
    });
    Ok(shutdown)
}
