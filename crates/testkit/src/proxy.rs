//! A TCP proxy for tests whose server must move or stop answering: a failover that points a name
//! at a new primary ([`TcpProxy::forward_to`]), or a database whose network path goes silent
//! ([`TcpProxy::blackhole`]: open connections are cut, new ones are accepted and never answered,
//! as behind a dropped route or a frozen load balancer), or that goes silent without a cut
//! ([`TcpProxy::stall`]: open connections stay open and carry nothing more, as when a path's
//! packets are dropped and neither end is told).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Where new connections go.
#[derive(Debug, Clone)]
enum Mode {
    Forward(String),
    Blackhole,
}

/// A proxy on a port of 127.0.0.1; it stops (and drops every connection) when dropped.
#[derive(Debug)]
pub struct TcpProxy {
    addr: SocketAddr,
    mode: Arc<Mutex<Mode>>,
    /// Bumped to cut every open connection.
    cuts: watch::Sender<u64>,
    /// Bumped to stop every open connection from carrying data.
    stalls: watch::Sender<u64>,
    accepting: JoinHandle<()>,
}

impl TcpProxy {
    /// Forwards every connection to `upstream` (`host:port`).
    pub async fn start(upstream: impl Into<String>) -> TcpProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("binding a proxy port: {e}"));
        let addr = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("the proxy's address: {e}"));
        let mode = Arc::new(Mutex::new(Mode::Forward(upstream.into())));
        let (cuts, _) = watch::channel(0);
        let (stalls, _) = watch::channel(0);
        let accepting = tokio::spawn({
            let mode = Arc::clone(&mode);
            let cuts = cuts.clone();
            let stalls = stalls.clone();
            async move {
                while let Ok((inbound, _)) = listener.accept().await {
                    // Subscribed before the mode is read: a `blackhole` or `stall` in between
                    // still reaches this connection (each sets the mode, then bumps a version).
                    let cut = cuts.subscribe();
                    let stall = stalls.subscribe();
                    let mode = mode.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    tokio::spawn(relay(inbound, mode, cut, stall));
                }
            }
        });
        TcpProxy {
            addr,
            mode,
            cuts,
            stalls,
            accepting,
        }
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections made from now on go to `upstream`; open ones stay where they are.
    pub fn forward_to(&self, upstream: impl Into<String>) {
        *self.mode.lock().unwrap_or_else(|e| e.into_inner()) = Mode::Forward(upstream.into());
    }

    /// Cuts every open connection; new ones are accepted and never answered.
    pub fn blackhole(&self) {
        *self.mode.lock().unwrap_or_else(|e| e.into_inner()) = Mode::Blackhole;
        self.cuts.send_modify(|n| *n += 1);
    }

    /// Open connections stay open and carry nothing more, in either direction; new ones are
    /// accepted and never answered. [`TcpProxy::forward_to`] forwards new connections again.
    pub fn stall(&self) {
        *self.mode.lock().unwrap_or_else(|e| e.into_inner()) = Mode::Blackhole;
        self.stalls.send_modify(|n| *n += 1);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accepting.abort();
        // Every relay's receiver sees the channel close once the accept loop's sender is gone.
        self.cuts.send_modify(|n| *n += 1);
    }
}

/// Serves one accepted connection in `mode` until the next cut; a stall keeps both ends open,
/// silent, until then.
async fn relay(
    mut inbound: TcpStream,
    mode: Mode,
    mut cut: watch::Receiver<u64>,
    mut stall: watch::Receiver<u64>,
) {
    match mode {
        Mode::Forward(upstream) => {
            let Ok(mut outbound) = TcpStream::connect(&upstream).await else {
                return;
            };
            tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => return,
                _ = cut.changed() => return,
                _ = stall.changed() => {}
            }
            let _held_open = (inbound, outbound);
            let _ = cut.changed().await;
        }
        // Held open, unread, until the proxy goes.
        Mode::Blackhole => while cut.changed().await.is_ok() {},
    }
}
