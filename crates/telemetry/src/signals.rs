//! Shutdown on SIGTERM or SIGINT, the same in every service binary. The signal streams are
//! created before [`shutdown_on_signals`] returns, so from then on either signal means "shut
//! down", never the default action (the process dying with a non-zero status). Creating them
//! inside a spawned task instead would leave a window, until that task first runs, in which a
//! SIGTERM kills the process. The same signal again means "now": a second Ctrl-C (or `kill`)
//! ends a drain that would otherwise run its full bound.

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// The exit status of a process ended by a repeated signal: what a shell reports for a process
/// the signal killed (128 + its number), so a supervisor reads it as that signal's doing.
pub fn forced_exit_status(kind: SignalKind) -> i32 {
    128 + kind.as_raw_value()
}

/// A token cancelled on the first SIGTERM or SIGINT from now on (logged). A second signal of
/// the same kind ends the process at once, with [`forced_exit_status`], without waiting for the
/// drain: what is in flight is left as a `kill -9` leaves it (a request's transaction rolls back,
/// a running job is rescued and runs again). A SIGTERM after a SIGINT does not: `cargo xtask dev`
/// and process managers follow a terminal's Ctrl-C with their own SIGTERM, and expect a drain.
/// Must be called inside a Tokio runtime. Fails only when the handlers cannot be installed.
pub fn shutdown_on_signals() -> std::io::Result<CancellationToken> {
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let shutdown = CancellationToken::new();
    let cancel = shutdown.clone();
    tokio::spawn(async move {
        let (name, kind, again) = tokio::select! {
            _ = terminate.recv() => ("SIGTERM", SignalKind::terminate(), &mut terminate),
            _ = interrupt.recv() => ("SIGINT", SignalKind::interrupt(), &mut interrupt),
        };
        tracing::info!("{name}: shutting down (send it again to exit at once)");
        cancel.cancel();
        if again.recv().await.is_some() {
            tracing::warn!("{name} again: exiting without finishing the drain");
            std::process::exit(forced_exit_status(kind));
        }
    });
    Ok(shutdown)
}
