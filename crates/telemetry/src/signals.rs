//! Shutdown on SIGTERM or SIGINT, the same in every service binary. The signal streams are
//! created before [`on_shutdown_signal`] returns, so from then on either signal means "shut
//! down", never the default action (the process dying with a non-zero status). Creating them
//! inside a spawned task instead would leave a window, until that task first runs, in which a
//! SIGTERM kills the process.

use tokio::signal::unix::{SignalKind, signal};

/// Listens for SIGTERM and SIGINT from now on; on the first of them, logs it and calls
/// `on_signal` (once). Must be called inside a Tokio runtime. Fails only when the handlers
/// cannot be installed.
pub fn on_shutdown_signal(on_signal: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = terminate.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = interrupt.recv() => tracing::info!("SIGINT: shutting down"),
        }
        on_signal();
    });
    Ok(())
}
