//! The pool against a real HTTP/2 server (the h2 crate's) on loopback.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::net::TcpListener;
use tokio::sync::Notify;

use super::*;
use crate::proxy::body::UpstreamRequestBody;
use crate::proxy::budget::{Budget, Reservation};
use crate::snapshot::ServiceCounters;

#[derive(Clone, Default)]
struct Behaviour {
    max_concurrent_streams: Option<u32>,
    /// Refuse the first stream of each connection with REFUSED_STREAM.
    refuse_first: bool,
    /// Hold every answer until released.
    hold: Option<Arc<Notify>>,
    /// After this many streams on a connection, shut it down gracefully (GOAWAY).
    goaway_after: Option<usize>,
}

struct Origin {
    address: String,
    accepted: Arc<AtomicUsize>,
    closed: Arc<AtomicUsize>,
    answered: Arc<AtomicUsize>,
}

async fn origin(behaviour: Behaviour) -> Origin {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let accepted = Arc::new(AtomicUsize::new(0));
    let closed = Arc::new(AtomicUsize::new(0));
    let answered = Arc::new(AtomicUsize::new(0));
    let counts = (accepted.clone(), closed.clone(), answered.clone());
    tokio::spawn(async move {
        loop {
            let (socket, _) = listener.accept().await.unwrap();
            counts.0.fetch_add(1, Ordering::SeqCst);
            let behaviour = behaviour.clone();
            let closed = counts.1.clone();
            let answered = counts.2.clone();
            tokio::spawn(async move {
                serve(socket, behaviour, answered).await;
                closed.fetch_add(1, Ordering::SeqCst);
            });
        }
    });
    Origin {
        address,
        accepted,
        closed,
        answered,
    }
}

async fn serve(socket: tokio::net::TcpStream, behaviour: Behaviour, answered: Arc<AtomicUsize>) {
    let mut builder = h2::server::Builder::new();
    if let Some(max) = behaviour.max_concurrent_streams {
        builder.max_concurrent_streams(max);
    }
    let Ok(mut connection) = builder.handshake::<_, Bytes>(socket).await else {
        return;
    };
    let mut streams = 0;
    while let Some(Ok((request, mut respond))) = connection.accept().await {
        streams += 1;
        if behaviour.refuse_first && streams == 1 {
            respond.send_reset(h2::Reason::REFUSED_STREAM);
            continue;
        }
        if behaviour.goaway_after == Some(streams) {
            connection.graceful_shutdown();
        }
        let hold = behaviour.hold.clone();
        let answered = answered.clone();
        tokio::spawn(async move {
            let mut body = request.into_body();
            let mut length = 0;
            while let Some(Ok(data)) = body.data().await {
                length += data.len();
                let _ = body.flow_control().release_capacity(data.len());
            }
            if let Some(hold) = hold {
                hold.notified().await;
            }
            let response = Response::builder().status(200).body(()).unwrap();
            let Ok(mut send) = respond.send_response(response, false) else {
                return;
            };
            let _ = send.send_data(Bytes::from(format!("{length}")), false);
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", "0".parse().unwrap());
            let _ = send.send_trailers(trailers);
            answered.fetch_add(1, Ordering::SeqCst);
        });
    }
}

fn settings() -> H2Settings {
    H2Settings {
        connect_timeout: Duration::from_secs(2),
        idle_timeout: Duration::from_secs(60),
        keepalive: None,
        max_streams_per_connection: 100,
        max_connections: None,
    }
}

fn pool(origin: &Origin, settings: H2Settings) -> Arc<H2Target> {
    Arc::new(H2Target::new(
        origin.address.clone(),
        settings,
        Arc::new(ServiceCounters::default()),
    ))
}

fn request(origin: &Origin) -> Request<()> {
    Request::post(format!("http://{}/echo", origin.address))
        .body(())
        .unwrap()
}

fn body(text: &'static str) -> UpstreamRequestBody {
    UpstreamRequestBody::Buffered {
        data: Some(Bytes::from_static(text.as_bytes())),
        trailers: None,
        _reservation: Arc::new(Reservation::new(&Budget::standalone(1 << 20))),
    }
}

/// Sends one request and reads its whole answer: the body and the grpc-status trailer.
async fn exchange(pool: &Arc<H2Target>, origin: &Origin) -> Result<(String, String), H2Error> {
    let response = pool.send(request(origin), body("hello")).await?;
    assert_eq!(response.status(), StatusCode::OK);
    let collected = response.into_body().collect().await.unwrap();
    let trailers = collected.trailers().cloned().unwrap_or_default();
    let status = trailers
        .get("grpc-status")
        .map(|value| value.to_str().unwrap().to_owned())
        .unwrap_or_default();
    Ok((
        String::from_utf8(collected.to_bytes().to_vec()).unwrap(),
        status,
    ))
}

async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !condition() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_body_and_trailers_go_both_ways() {
    let origin = origin(Behaviour::default()).await;
    let pool = pool(&origin, settings());
    let (body, status) = exchange(&pool, &origin).await.unwrap();
    assert_eq!(body, "5", "the origin read the whole upload");
    assert_eq!(status, "0", "trailers come through");
}

/// The stream that made the pool open its connection carries how long that took; the next
/// one, on the same connection, carries nothing.
#[tokio::test]
async fn only_the_stream_that_opened_its_connection_carries_the_connect_time() {
    use crate::proxy::connect_timing::ConnectTiming;
    let origin = origin(Behaviour::default()).await;
    let pool = pool(&origin, settings());
    let first = pool.send(request(&origin), body("a")).await.unwrap();
    let timing = first
        .extensions()
        .get::<ConnectTiming>()
        .expect("the opening stream's answer carries the connect time");
    assert!(timing.connect < Duration::from_secs(2));
    first.into_body().collect().await.unwrap();
    let second = pool.send(request(&origin), body("b")).await.unwrap();
    assert!(second.extensions().get::<ConnectTiming>().is_none());
    second.into_body().collect().await.unwrap();
}

#[tokio::test]
async fn concurrent_requests_share_one_connection() {
    let hold = Arc::new(Notify::new());
    let origin = origin(Behaviour {
        hold: Some(hold.clone()),
        ..Behaviour::default()
    })
    .await;
    let pool = pool(&origin, settings());
    let calls: Vec<_> = (0..50)
        .map(|_| {
            let pool = pool.clone();
            let request = request(&origin);
            tokio::spawn(async move { pool.send(request, body("x")).await.map(|_| ()) })
        })
        .collect();
    eventually("50 streams open", || {
        pool.counters.h2_streams.load(Ordering::SeqCst) == 50
    })
    .await;
    assert_eq!(origin.accepted.load(Ordering::SeqCst), 1);
    assert_eq!(pool.counters.h2_connections.load(Ordering::SeqCst), 1);
    hold.notify_waiters();
    for call in calls {
        call.await.unwrap().unwrap();
    }
    eventually("streams given back", || {
        pool.counters.h2_streams.load(Ordering::SeqCst) == 0
    })
    .await;
}

#[tokio::test]
async fn a_connection_opens_only_when_the_others_are_full() {
    let hold = Arc::new(Notify::new());
    let origin = origin(Behaviour {
        hold: Some(hold.clone()),
        max_concurrent_streams: Some(4),
        ..Behaviour::default()
    })
    .await;
    let pool = pool(
        &origin,
        H2Settings {
            max_streams_per_connection: 10,
            ..settings()
        },
    );
    // The target's SETTINGS are known once the first connection is up.
    exchange_released(&pool, &origin, &hold).await;
    let calls: Vec<_> = (0..12)
        .map(|_| {
            let pool = pool.clone();
            let request = request(&origin);
            tokio::spawn(async move { pool.send(request, body("x")).await.map(|_| ()) })
        })
        .collect();
    eventually("12 streams open", || {
        pool.counters.h2_streams.load(Ordering::SeqCst) == 12
    })
    .await;
    assert_eq!(
        origin.accepted.load(Ordering::SeqCst),
        3,
        "12 streams at 4 per connection (the target's limit, under ours)"
    );
    hold.notify_waiters();
    for call in calls {
        call.await.unwrap().unwrap();
    }
}

/// One exchange against a holding origin.
async fn exchange_released(pool: &Arc<H2Target>, origin: &Origin, hold: &Arc<Notify>) {
    let call = {
        let pool = pool.clone();
        let request = request(origin);
        tokio::spawn(async move { pool.send(request, body("x")).await.map(|_| ()) })
    };
    eventually("the first stream is open", || {
        origin.accepted.load(Ordering::SeqCst) == 1
            && pool.counters.h2_streams.load(Ordering::SeqCst) == 1
    })
    .await;
    // `notify_waiters` wakes only who waits: release until the call is answered.
    while !call.is_finished() {
        hold.notify_waiters();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    call.await.unwrap().unwrap();
}

#[tokio::test]
async fn max_connections_caps_the_dials() {
    let hold = Arc::new(Notify::new());
    let origin = origin(Behaviour {
        hold: Some(hold.clone()),
        ..Behaviour::default()
    })
    .await;
    let pool = pool(
        &origin,
        H2Settings {
            max_streams_per_connection: 2,
            max_connections: Some(1),
            ..settings()
        },
    );
    let calls: Vec<_> = (0..6)
        .map(|_| {
            let pool = pool.clone();
            let request = request(&origin);
            tokio::spawn(async move { pool.send(request, body("x")).await.map(|_| ()) })
        })
        .collect();
    eventually("6 streams chosen", || {
        pool.counters.h2_streams.load(Ordering::SeqCst) == 6
    })
    .await;
    assert_eq!(origin.accepted.load(Ordering::SeqCst), 1);
    while calls.iter().any(|call| !call.is_finished()) {
        hold.notify_waiters();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for call in calls {
        call.await.unwrap().unwrap();
    }
    assert_eq!(origin.accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_refused_stream_is_unprocessed_and_the_next_goes_through() {
    let origin = origin(Behaviour {
        refuse_first: true,
        ..Behaviour::default()
    })
    .await;
    let pool = pool(&origin, settings());
    let error = exchange(&pool, &origin).await.unwrap_err();
    assert!(error.is_unprocessed(), "{error}");
    assert!(error.to_string().contains("REFUSED_STREAM"), "{error}");
    assert_eq!(pool.counters.h2_unprocessed.load(Ordering::SeqCst), 1);
    assert_eq!(exchange(&pool, &origin).await.unwrap().0, "5");
}

#[tokio::test]
async fn after_a_goaway_new_streams_go_to_a_new_connection() {
    let origin = origin(Behaviour {
        goaway_after: Some(1),
        ..Behaviour::default()
    })
    .await;
    let pool = pool(&origin, settings());
    assert_eq!(exchange(&pool, &origin).await.unwrap().0, "5");
    eventually("the first connection is retired", || {
        pool.lock().iter().all(|connection| connection.retired())
    })
    .await;
    assert_eq!(exchange(&pool, &origin).await.unwrap().0, "5");
    assert_eq!(origin.accepted.load(Ordering::SeqCst), 2);
    assert_eq!(origin.answered.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn an_idle_connection_closes_after_the_idle_timeout() {
    let origin = origin(Behaviour::default()).await;
    let pool = pool(
        &origin,
        H2Settings {
            idle_timeout: Duration::from_millis(200),
            ..settings()
        },
    );
    exchange(&pool, &origin).await.unwrap();
    assert_eq!(pool.counters.h2_connections.load(Ordering::SeqCst), 1);
    eventually("the idle connection closed", || {
        origin.closed.load(Ordering::SeqCst) == 1
    })
    .await;
    assert_eq!(pool.connection_count(), 0);
    assert_eq!(pool.counters.h2_connections.load(Ordering::SeqCst), 0);
    exchange(&pool, &origin).await.unwrap();
    assert_eq!(
        origin.accepted.load(Ordering::SeqCst),
        2,
        "a new one is dialled"
    );
}

#[tokio::test]
async fn a_busy_connection_outlives_the_idle_timeout() {
    let hold = Arc::new(Notify::new());
    let origin = origin(Behaviour {
        hold: Some(hold.clone()),
        ..Behaviour::default()
    })
    .await;
    let pool = pool(
        &origin,
        H2Settings {
            idle_timeout: Duration::from_millis(100),
            ..settings()
        },
    );
    let call = {
        let pool = pool.clone();
        let request = request(&origin);
        tokio::spawn(async move { pool.send(request, body("x")).await.map(|_| ()) })
    };
    eventually("the stream is open", || {
        pool.counters.h2_streams.load(Ordering::SeqCst) == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(origin.closed.load(Ordering::SeqCst), 0, "a stream is open");
    while !call.is_finished() {
        hold.notify_waiters();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    call.await.unwrap().unwrap();
}

/// A target that takes the connection and then reads nothing: no SETTINGS ack, no PING answer.
#[tokio::test]
async fn a_silent_target_is_caught_by_the_keepalive_ping() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (socket, _) = listener.accept().await.unwrap();
        // Held open, never read or written.
        std::future::pending::<()>().await;
        drop(socket);
    });
    let pool = Arc::new(H2Target::new(
        address.clone(),
        H2Settings {
            keepalive: Some(Duration::from_millis(200)),
            connect_timeout: Duration::from_millis(200),
            ..settings()
        },
        Arc::new(ServiceCounters::default()),
    ));
    let started = tokio::time::Instant::now();
    let request = Request::get(format!("http://{address}/")).body(()).unwrap();
    let error = tokio::time::timeout(
        Duration::from_secs(5),
        pool.send(request, UpstreamRequestBody::Empty),
    )
    .await
    .expect("the PING timeout ends the wait")
    .unwrap_err();
    assert!(matches!(error, H2Error::PingTimeout { .. }), "{error}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(400) && waited < Duration::from_secs(2),
        "keepalive + its timeout: {waited:?}"
    );
}

#[tokio::test]
async fn a_closed_port_is_a_dial_failure() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    drop(listener);
    let pool = Arc::new(H2Target::new(
        address.clone(),
        settings(),
        Arc::new(ServiceCounters::default()),
    ));
    let request = Request::get(format!("http://{address}/")).body(()).unwrap();
    let error = pool
        .send(request, UpstreamRequestBody::Empty)
        .await
        .unwrap_err();
    assert!(error.is_connect(), "{error}");
    assert_eq!(pool.connection_count(), 0, "the failed dial is forgotten");
}
