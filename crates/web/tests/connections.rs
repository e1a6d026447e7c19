//! The accept loop against raw sockets: a client that trickles its headers, sends none, or stops
//! reading its responses is disconnected at `HTTP_HEADER_READ_TIMEOUT`; at most `HTTP_MAX_CONNECTIONS` are served at once,
//! and the next is served as soon as one closes; shutdown waits for a client still sending headers
//! no longer than `HTTP_REQUEST_TIMEOUT`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::{Duration, Instant};

use support::{TestServer, config};
use testkit::TestDb;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const PROBE: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: fairlane\r\n\r\n";

/// Reads until the peer closes; returns what it sent and when it closed.
async fn read_to_close(stream: &mut TcpStream, within: Duration) -> (Vec<u8>, Instant) {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(within, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .expect("the server closes the connection");
    (seen, Instant::now())
}

/// Reads the start of one response.
async fn status_line(stream: &mut TcpStream, within: Duration) -> Option<String> {
    let mut buf = [0u8; 512];
    match tokio::time::timeout(within, stream.read(&mut buf)).await {
        Ok(Ok(n)) if n > 0 => String::from_utf8_lossy(&buf[..n])
            .lines()
            .next()
            .map(str::to_owned),
        _ => None,
    }
}

#[tokio::test]
async fn a_client_that_trickles_its_headers_is_disconnected_at_the_header_timeout() {
    let db = TestDb::new().await;
    let mut config = config(&db);
    config.http_header_read_timeout = Duration::from_secs(1);
    let s = TestServer::start(config).await;

    // A slow client: one header line, then a byte now and then, never the blank line.
    let mut slow = TcpStream::connect(s.addr).await.unwrap();
    let began = Instant::now();
    slow.write_all(b"GET /healthz HTTP/1.1\r\n").await.unwrap();
    let trickle = tokio::spawn(async move {
        // Long enough (20 s) that a server restarting its timer on every byte would still
        // hold the connection well past the bound below.
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if slow.write_all(b"X").await.is_err() {
                return slow;
            }
        }
        slow
    });
    let mut slow = trickle.await.unwrap();
    let (_, closed) = read_to_close(&mut slow, Duration::from_secs(30)).await;
    let held = closed - began;
    assert!(held < Duration::from_secs(15), "held for {held:?}");

    // An idle connection (no request at all) goes the same way; a prompt client is served.
    let mut idle = TcpStream::connect(s.addr).await.unwrap();
    read_to_close(&mut idle, Duration::from_secs(10)).await;
    let mut prompt = TcpStream::connect(s.addr).await.unwrap();
    prompt.write_all(PROBE).await.unwrap();
    let line = status_line(&mut prompt, Duration::from_secs(5)).await;
    assert_eq!(line.as_deref(), Some("HTTP/1.1 200 OK"));
    s.stop().await;
}

#[tokio::test]
async fn connections_beyond_the_cap_wait_until_one_closes() {
    let db = TestDb::new().await;
    let mut config = config(&db);
    config.http_max_connections = 2;
    config.http_header_read_timeout = Duration::from_secs(30);
    let s = TestServer::start(config).await;

    // Two connections hold both slots (served once, then kept alive).
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut c = TcpStream::connect(s.addr).await.unwrap();
        c.write_all(PROBE).await.unwrap();
        let line = status_line(&mut c, Duration::from_secs(5)).await;
        assert_eq!(line.as_deref(), Some("HTTP/1.1 200 OK"));
        held.push(c);
    }
    // A third is accepted by the kernel but not served while both are open.
    let mut third = TcpStream::connect(s.addr).await.unwrap();
    third.write_all(PROBE).await.unwrap();
    assert_eq!(status_line(&mut third, Duration::from_secs(1)).await, None);
    // One closes: the third is served.
    drop(held.pop());
    let line = status_line(&mut third, Duration::from_secs(5)).await;
    assert_eq!(line.as_deref(), Some("HTTP/1.1 200 OK"));
    s.stop().await;
}

#[tokio::test]
async fn shutdown_does_not_wait_for_a_client_still_sending_headers() {
    let db = TestDb::new().await;
    let mut config = config(&db);
    config.http_header_read_timeout = Duration::from_secs(60);
    config.http_request_timeout = Duration::from_secs(1);
    let s = TestServer::start(config).await;
    let mut slow = TcpStream::connect(s.addr).await.unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: fairlane\r\n")
        .await
        .unwrap();
    // Let the server read what was sent, so the connection is mid-headers, not idle. (On a
    // loaded machine it may not have yet; the test then covers an idle connection instead,
    // which must close at once: it cannot pass by waiting.)
    tokio::time::sleep(Duration::from_millis(300)).await;
    let began = Instant::now();
    s.stop().await;
    let took = began.elapsed();
    assert!(took < Duration::from_secs(5), "shutdown took {took:?}");
    read_to_close(&mut slow, Duration::from_secs(5)).await;
}

/// A client that asks for responses and never reads them shuts its window; the server's write
/// then waits on the socket. Such a connection is closed once a write has made no progress for
/// the header timeout, so it cannot hold a connection slot for ever.
#[tokio::test]
async fn a_client_that_stops_reading_is_disconnected_and_frees_its_slot() {
    let db = TestDb::new().await;
    let mut config = config(&db);
    config.http_header_read_timeout = Duration::from_secs(1);
    config.http_max_connections = 1;
    let s = TestServer::start(config).await;

    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stuck = socket.connect(s.addr).await.unwrap();
    let request = b"GET /openapi.json HTTP/1.1\r\nHost: fairlane\r\n\r\n";
    let mut pipelined = Vec::new();
    for _ in 0..400 {
        pipelined.extend_from_slice(request);
    }
    stuck.write_all(&pipelined).await.unwrap();

    // The only slot is the stuck client's until the server gives up on it.
    let began = Instant::now();
    let mut next = TcpStream::connect(s.addr).await.unwrap();
    next.write_all(PROBE).await.unwrap();
    let line = status_line(&mut next, Duration::from_secs(30)).await;
    assert_eq!(
        line.as_deref(),
        Some("HTTP/1.1 200 OK"),
        "after {:?}",
        began.elapsed()
    );
    drop(stuck);
    s.stop().await;
}
