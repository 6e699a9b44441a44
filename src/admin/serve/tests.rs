//! The admin connections' timers, in paused time over in-memory pipes: hyper's header timer
//! for HTTP/1.1, the idle check for HTTP/2, and answers in flight that keep either open.

use super::*;
use axum::routing::get;
use http_body_util::{BodyExt, Empty};
use tokio::io::{duplex, AsyncReadExt, AsyncWriteExt, DuplexStream};

const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
const HTTP2_IDLE: Duration = Duration::from_secs(60);
/// `/slow` answers a tick every 10 s, ten times: longer than either timeout.
const TICK: Duration = Duration::from_secs(10);
const TICKS: usize = 10;

fn app() -> Router {
    Router::new().route("/", get(|| async { "ok" })).route(
        "/slow",
        get(|| async {
            Body::from_stream(futures_util::stream::unfold(0, |sent| async move {
                if sent == TICKS {
                    return None;
                }
                tokio::time::sleep(TICK).await;
                Some((Ok::<_, Infallible>(Bytes::from_static(b"tick\n")), sent + 1))
            }))
        }),
    )
}

fn protocols() -> Arc<Protocols> {
    Arc::new(Protocols::new(&ListenerSettings {
        header_timeout: HEADER_TIMEOUT,
        http2_idle_timeout: HTTP2_IDLE,
        max_connections: 10,
        shutdown_grace: Duration::from_secs(30),
    }))
}

/// An HTTP/1.1 connection being served; the sender stops the "listener".
fn http1_connection() -> (
    DuplexStream,
    JoinHandle<hyper::Result<()>>,
    watch::Sender<bool>,
) {
    let (client, server) = duplex(64 * 1024);
    let (stop, shutdown) = watch::channel(false);
    let protocols = protocols();
    let served =
        tokio::spawn(async move { serve_http1(server, app(), &protocols.http1, shutdown).await });
    (client, served, stop)
}

/// Reads until `needle` has arrived; returns everything read.
async fn read_until(client: &mut DuplexStream, needle: &str) -> String {
    let mut seen = Vec::new();
    let mut buffer = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains(needle) {
        let read = client.read(&mut buffer).await.unwrap();
        assert!(
            read > 0,
            "closed before {needle:?}: {:?}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buffer[..read]);
    }
    String::from_utf8_lossy(&seen).into_owned()
}

/// What the client reads until the server closes, which must be within an hour.
async fn closed(client: &mut DuplexStream) -> Vec<u8> {
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(3600), client.read_to_end(&mut rest))
        .await
        .expect("the server closes the connection")
        .unwrap();
    rest
}

#[tokio::test(start_paused = true)]
async fn http1_a_head_not_sent_whole_is_closed_after_the_header_timeout() {
    let (mut client, served, _stop) = http1_connection();
    let started = Instant::now();
    client
        .write_all(b"GET / HTTP/1.1\r\nHost: admin\r\n")
        .await
        .unwrap();
    let answer = closed(&mut client).await;
    assert_eq!(started.elapsed(), HEADER_TIMEOUT);
    assert!(answer.is_empty(), "{answer:?}");
    assert!(served.await.unwrap().is_err(), "a header timeout");
}

#[tokio::test(start_paused = true)]
async fn http1_an_idle_keep_alive_connection_is_closed_after_the_header_timeout() {
    let (mut client, served, _stop) = http1_connection();
    client
        .write_all(b"GET / HTTP/1.1\r\nHost: admin\r\n\r\n")
        .await
        .unwrap();
    let answer = read_until(&mut client, "\r\n\r\nok").await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let answered = Instant::now();
    let rest = closed(&mut client).await;
    assert_eq!(answered.elapsed(), HEADER_TIMEOUT);
    assert!(rest.is_empty(), "{rest:?}");
    let _ = served.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn http1_an_answer_longer_than_the_timeout_is_not_idle() {
    let (mut client, served, _stop) = http1_connection();
    let started = Instant::now();
    client
        .write_all(b"GET /slow HTTP/1.1\r\nHost: admin\r\n\r\n")
        .await
        .unwrap();
    let answer = read_until(&mut client, "\r\n0\r\n\r\n").await;
    assert_eq!(answer.matches("tick").count(), TICKS, "{answer}");
    assert_eq!(started.elapsed(), TICK * TICKS as u32);
    // Then it rests, and closes a header timeout later.
    closed(&mut client).await;
    assert_eq!(started.elapsed(), TICK * TICKS as u32 + HEADER_TIMEOUT);
    let _ = served.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn http1_shutdown_closes_an_idle_connection_and_lets_an_answer_finish() {
    let (mut idle, idle_served, stop_idle) = http1_connection();
    idle.write_all(b"GET / HTTP/1.1\r\nHost: admin\r\n\r\n")
        .await
        .unwrap();
    read_until(&mut idle, "\r\n\r\nok").await;
    let (mut busy, busy_served, stop_busy) = http1_connection();
    busy.write_all(b"GET /slow HTTP/1.1\r\nHost: admin\r\n\r\n")
        .await
        .unwrap();
    read_until(&mut busy, "tick").await;
    let stopped = Instant::now();
    stop_idle.send_replace(true);
    stop_busy.send_replace(true);
    idle_served.await.unwrap().unwrap();
    assert_eq!(
        stopped.elapsed(),
        Duration::ZERO,
        "the idle one closes at once"
    );
    let answer = read_until(&mut busy, "\r\n0\r\n\r\n").await;
    assert_eq!(answer.matches("tick").count(), TICKS - 1);
    busy_served.await.unwrap().unwrap();
    assert_eq!(stopped.elapsed(), TICK * (TICKS as u32 - 1));
}

/// An HTTP/2 connection being served, and a client on it.
async fn http2_connection() -> (
    hyper::client::conn::http2::SendRequest<Empty<Bytes>>,
    JoinHandle<hyper::Result<()>>,
) {
    let (client, server) = duplex(64 * 1024);
    let (stop, shutdown) = watch::channel(false);
    let protocols = protocols();
    let served = tokio::spawn(async move {
        let _stop = stop;
        let http2 = &protocols.http2;
        serve_http2(server, app(), http2, protocols.http2_idle_timeout, shutdown).await
    });
    let (sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(client))
            .await
            .unwrap();
    tokio::spawn(connection);
    (sender, served)
}

async fn http2_get(
    sender: &mut hyper::client::conn::http2::SendRequest<Empty<Bytes>>,
    path: &str,
) -> String {
    let request = Request::get(format!("http://admin{path}"))
        .body(Empty::new())
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&body).into_owned()
}

#[tokio::test(start_paused = true)]
async fn http2_a_connection_without_a_stream_closes_after_the_idle_timeout() {
    let (mut sender, served) = http2_connection().await;
    assert_eq!(http2_get(&mut sender, "/").await, "ok");
    let answered = Instant::now();
    // Ended either way: GOAWAY acknowledged, or the client closing first.
    let _ = served.await.unwrap();
    let idle = answered.elapsed();
    // Checked every quarter of the timeout; a request seen at a check counts as use until the
    // next one. Closed once the client acknowledged the GOAWAY.
    assert!(
        idle >= HTTP2_IDLE && idle <= HTTP2_IDLE + HTTP2_IDLE / 2 + IDLE_CLOSE_GRACE,
        "{idle:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn http2_a_stream_longer_than_the_idle_timeout_keeps_its_connection() {
    let (mut sender, served) = http2_connection().await;
    let started = Instant::now();
    let answer = http2_get(&mut sender, "/slow").await;
    assert_eq!(answer.matches("tick").count(), TICKS, "{answer}");
    assert_eq!(started.elapsed(), TICK * TICKS as u32);
    assert!(!served.is_finished());
    // The same connection still serves.
    assert_eq!(http2_get(&mut sender, "/").await, "ok");
}

#[tokio::test(start_paused = true)]
async fn the_idle_clock_counts_from_the_last_request() {
    let counts = Arc::new(StreamCounts::default());
    let mut idle = IdleClock::new(&counts);
    tokio::time::advance(Duration::from_secs(5)).await;
    assert_eq!(idle.idle_for(&counts), Duration::from_secs(5));
    let open = OpenStream::start(&counts);
    tokio::time::advance(Duration::from_secs(5)).await;
    assert_eq!(idle.idle_for(&counts), Duration::ZERO, "a request is open");
    tokio::time::advance(Duration::from_secs(5)).await;
    drop(open);
    assert_eq!(
        idle.idle_for(&counts),
        Duration::ZERO,
        "it was open at the last check"
    );
    tokio::time::advance(Duration::from_secs(3)).await;
    assert_eq!(idle.idle_for(&counts), Duration::from_secs(3));
    // One that came and went between two checks counts as use.
    drop(OpenStream::start(&counts));
    tokio::time::advance(Duration::from_secs(3)).await;
    assert_eq!(idle.idle_for(&counts), Duration::ZERO);
}
