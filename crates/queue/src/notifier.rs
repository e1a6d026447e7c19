//! One LISTEN connection per process, fanned out to callbacks by channel.
//!
//! Notifications are hints, never the only path: whenever the listening connection is lost and
//! re-established, every callback is told "maybe missed" (payload `None`) so that producers fetch
//! and electors re-check instead of waiting for the next poll.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;

/// Called with `Some(payload)` for a notification and `None` after a reconnect. Must be quick.
pub type NotificationCallback = Arc<dyn Fn(Option<&str>) + Send + Sync>;

/// Registers callbacks, then runs the listener until shutdown.
#[derive(Default, Clone)]
pub struct Notifier {
    callbacks: HashMap<String, Vec<NotificationCallback>>,
}

impl std::fmt::Debug for Notifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notifier")
            .field("channels", &self.callbacks.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Notifier {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn subscribe(&mut self, channel: &str, callback: NotificationCallback) {
        self.callbacks
            .entry(channel.to_owned())
            .or_default()
            .push(callback);
    }

    fn dispatch(&self, channel: &str, payload: Option<&str>) {
        if let Some(callbacks) = self.callbacks.get(channel) {
            for cb in callbacks {
                cb(payload);
            }
        }
    }

    fn dispatch_all_missed(&self) {
        for callbacks in self.callbacks.values() {
            for cb in callbacks {
                cb(None);
            }
        }
    }

    /// Listens until `shutdown`, reconnecting with backoff after any failure.
    pub async fn run(self, pool: PgPool, shutdown: CancellationToken) {
        if self.callbacks.is_empty() {
            return;
        }
        let channels: Vec<&str> = self.callbacks.keys().map(String::as_str).collect();
        let mut backoff = Duration::from_millis(50);
        let mut first_connect = true;
        while !shutdown.is_cancelled() {
            let connected = async {
                let mut listener = PgListener::connect_with(&pool).await?;
                listener.ignore_pool_close_event(true);
                listener.listen_all(channels.iter().copied()).await?;
                Ok::<_, sqlx::Error>(listener)
            };
            let mut listener = tokio::select! {
                () = shutdown.cancelled() => return,
                result = connected => match result {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::warn!(error = %e, "notification listener could not connect; retrying");
                        tokio::select! {
                            () = shutdown.cancelled() => return,
                            () = tokio::time::sleep(backoff) => {}
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                        continue;
                    }
                }
            };
            backoff = Duration::from_millis(50);
            if !first_connect {
                tracing::info!("notification listener reconnected");
            }
            first_connect = false;
            // Whatever was sent before LISTEN took effect, on the first connection as after a
            // reconnect, was missed: a job inserted between a producer's first fetch and this
            // moment would otherwise wait for the poll interval.
            self.dispatch_all_missed();
            loop {
                let next = tokio::select! {
                    () = shutdown.cancelled() => return,
                    next = listener.try_recv() => next,
                };
                match next {
                    Ok(Some(n)) => self.dispatch(n.channel(), Some(n.payload())),
                    Ok(None) => {
                        // The connection dropped; PgListener reconnects on the next call.
                        tracing::info!("notification listener lost its connection; reconnecting");
                        self.dispatch_all_missed();
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "notification listener failed; reconnecting");
                        self.dispatch_all_missed();
                        break;
                    }
                }
            }
        }
    }
}
