//! The data path streams a gigabyte each way with flat memory (DESIGN.md §6); moved here from
//! `tests/integration/proxy.rs` to run alone (see `main.rs`).

use crate::common;
use crate::RssPeak;
use common::*;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use std::time::Instant;

use http_body_util::BodyExt;

const GIB: u64 = 1 << 30;
const MEMORY_BUDGET_KIB: u64 = 100 * 1024;

/// Uploads `warm_up` bytes, then `size` bytes through `gateway` (whose route leads to
/// `sink`), and returns how much this process's RSS grew at its peak during the second
/// upload, in KiB, checking that every byte arrived.
async fn upload_growth(gateway: &TestGateway, sink: &Upstream, warm_up: u64, size: u64) -> u64 {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<GeneratedBody>();
    let client = &client;
    let upload = |size| async move {
        let request = hyper::Request::post(gateway.proxy_url("/upload"))
            .body(GeneratedBody::new(size))
            .unwrap();
        let response = client.request(request).await.expect("upload answered");
        assert_eq!(response.status(), 200);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"sink");
    };
    // Warm up the connections on every hop before the baseline.
    upload(warm_up).await;
    let before = rss_kib();
    let peak = RssPeak::start();
    upload(size).await;
    let peak = peak.finish();
    let seen = sink.last_seen();
    assert_eq!(seen.method, "POST");
    assert_eq!(
        seen.body_len as u64, size,
        "upload arrived with the wrong size"
    );
    assert_eq!(sink.body_bytes.load(Ordering::SeqCst), warm_up + size);
    peak.saturating_sub(before)
}

/// A gateway routing everything to a sink upstream, the route streaming bodies or not.
async fn gateway_to_sink(streaming: bool) -> (TestGateway, Upstream) {
    let gateway = TestGateway::start().await;
    let sink = Upstream::start("sink").await;
    let service = gateway
        .service_with_targets("sink", &[target(&sink, 1, 0)])
        .await;
    if streaming {
        gateway.route_all_streaming_to(service).await;
    } else {
        gateway.route_all_to(service).await;
    }
    (gateway, sink)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_gib_upload_streams_with_flat_memory() {
    let _alone = crate::ALONE.lock().await;
    // A route that streams bodies: with the defaults a gigabyte would be spooled first.
    let (gateway, sink) = gateway_to_sink(true).await;
    let started = Instant::now();
    let growth = upload_growth(&gateway, &sink, 1 << 20, GIB).await;
    assert!(
        growth < MEMORY_BUDGET_KIB,
        "RSS grew by {} MiB during a 1 GiB upload (took {:?})",
        growth / 1024,
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_gib_download_streams_with_flat_memory() {
    let _alone = crate::ALONE.lock().await;
    let gateway = TestGateway::start().await;
    let source = Upstream::start("source").await;
    let service = gateway
        .service_with_targets("source", &[target(&source, 1, 0)])
        .await;
    gateway.route_all_to(service).await;

    let mut warm = gateway.get("/bytes/1048576").await;
    assert_eq!(warm.status(), 200);
    while warm.chunk().await.unwrap().is_some() {}

    let before = rss_kib();
    let peak = RssPeak::start();
    let started = Instant::now();
    let mut response = gateway.get(&format!("/bytes/{GIB}")).await;
    assert_eq!(response.status(), 200);
    let mut received: u64 = 0;
    let mut next_sample: u64 = 0;
    while let Some(chunk) = response.chunk().await.expect("download continues") {
        received += chunk.len() as u64;
        if received >= next_sample {
            peak.sample();
            next_sample = received + (16 << 20);
        }
    }
    let peak = peak.finish();
    assert_eq!(received, GIB, "download ended with the wrong size");
    let growth = peak.saturating_sub(before);
    assert!(
        growth < MEMORY_BUDGET_KIB,
        "RSS grew by {} MiB during a 1 GiB download (took {:?})",
        growth / 1024,
        started.elapsed()
    );
}

/// A body too large for memory is spooled to disk, then sent: memory stays flat however large
/// it is (issue 31: a 200 MB upload with the defaults).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_200_mb_upload_spools_with_flat_memory() {
    let _alone = crate::ALONE.lock().await;
    let (gateway, sink) = gateway_to_sink(false).await;
    let started = Instant::now();
    let growth = upload_growth(&gateway, &sink, 2 << 20, 200 << 20).await;
    assert_eq!(
        gateway.metric("raahi_requests_spooled_total").await,
        2,
        "both bodies went through the spool"
    );
    assert!(
        growth < 32 * 1024,
        "RSS grew by {} MiB during a 200 MB spooled upload (took {:?})",
        growth / 1024,
        started.elapsed()
    );
}

/// Clients sending a body a byte per TCP segment (HTTP/1.1) or per DATA frame (HTTP/2) cost
/// about what they sent, not a read buffer per byte (issue 31: 4 KB per body byte before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_sent_a_byte_at_a_time_cost_what_they_hold() {
    const HTTP1_CLIENTS: usize = 400;
    const HTTP2_STREAMS: usize = 100;
    const BYTES_EACH: usize = 200;
    let _alone = crate::ALONE.lock().await;
    let (gateway, sink) = gateway_to_sink(false).await;
    // Warm the gateway's paths once so their first-use allocations are not counted.
    assert_eq!(gateway.get("/warm").await.status(), 200);

    let before = rss_kib();
    let peak = RssPeak::start();
    let sent = Arc::new(AtomicU64::new(0));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut clients = Vec::new();
    for _ in 0..HTTP1_CLIENTS {
        // Connected one by one: a burst of connects is the listen backlog's test, not this.
        let mut stream = tokio::net::TcpStream::connect(gateway.proxy).await.unwrap();
        stream.set_nodelay(true).unwrap();
        let sent = sent.clone();
        let mut stopped = stopped.clone();
        clients.push(tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            stream
                .write_all(
                    b"POST /upload HTTP/1.1\r\nHost: a.test\r\nContent-Length: 100000\r\n\r\n",
                )
                .await
                .unwrap();
            for _ in 0..BYTES_EACH {
                stream.write_all(b"b").await.unwrap();
                sent.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            let _ = stopped.wait_for(|stop| *stop).await;
        }));
    }
    let connection = tokio::net::TcpStream::connect(gateway.proxy).await.unwrap();
    let (mut sender, driver) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(connection),
    )
    .await
    .unwrap();
    tokio::spawn(driver);
    for _ in 0..HTTP2_STREAMS {
        sender.ready().await.unwrap();
        let sent = sent.clone();
        let stopped = stopped.clone();
        let body = http_body_util::StreamBody::new(Box::pin(futures_util::stream::unfold(
            (0usize, sent, stopped),
            |(count, sent, mut stopped)| async move {
                if count == BYTES_EACH {
                    // Hold the stream open, its body unfinished, until the test is done.
                    let _ = stopped.wait_for(|stop| *stop).await;
                    return None;
                }
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                sent.fetch_add(1, Ordering::Relaxed);
                Some((
                    Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(
                        Bytes::from_static(b"b"),
                    )),
                    (count + 1, sent, stopped),
                ))
            },
        )));
        let request = hyper::Request::post(gateway.proxy_url("/upload"))
            .header("content-length", "100000")
            .body(body)
            .unwrap();
        let response = sender.send_request(request);
        clients.push(tokio::spawn(async move {
            let _ = response.await;
        }));
    }
    let total = ((HTTP1_CLIENTS + HTTP2_STREAMS) * BYTES_EACH) as u64;
    wait_until(
        "every byte sent",
        std::time::Duration::from_secs(60),
        || async { sent.load(Ordering::Relaxed) == total },
    )
    .await;
    wait_until(
        "every byte held by the gateway",
        std::time::Duration::from_secs(10),
        || async { gateway.metric("raahi_request_body_memory_bytes").await >= total },
    )
    .await;
    let held = gateway.metric("raahi_request_body_memory_bytes").await;
    let peak = peak.finish();
    let growth = peak.saturating_sub(before);
    let _ = stop.send(true);
    for client in clients {
        client.abort();
    }
    assert_eq!(sink.hits(), 1, "only the warm-up reached the target");
    assert!(
        growth < 32 * 1024,
        "RSS grew by {} MiB for {} bodies of {BYTES_EACH} bytes sent a byte at a time",
        growth / 1024,
        HTTP1_CLIENTS + HTTP2_STREAMS
    );
    // The budget is charged with what is allocated: a small buffer per body, not per byte.
    assert!(
        held <= ((HTTP1_CLIENTS + HTTP2_STREAMS) * 4096) as u64,
        "{held} bytes charged"
    );
}
