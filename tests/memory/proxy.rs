//! The data path streams a gigabyte each way with flat memory (DESIGN.md §6); moved here from
//! `tests/integration/proxy.rs` to run alone (see `main.rs`).

use crate::common;
use crate::RssPeak;
use common::*;

use std::sync::atomic::Ordering;
use std::time::Instant;

use http_body_util::BodyExt;

const GIB: u64 = 1 << 30;
const MEMORY_BUDGET_KIB: u64 = 100 * 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_gib_upload_streams_with_flat_memory() {
    let _alone = crate::ALONE.lock().await;
    let gateway = TestGateway::start().await;
    let sink = Upstream::start("sink").await;
    let service = gateway
        .service_with_targets("sink", &[target(&sink, 1, 0)])
        .await;
    gateway.route_all_to(service).await;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<GeneratedBody>();

    // Warm up the connections on every hop before the baseline.
    let warm = hyper::Request::post(gateway.proxy_url("/upload"))
        .body(GeneratedBody::new(1 << 20))
        .unwrap();
    let response = client.request(warm).await.unwrap();
    assert_eq!(response.status(), 200);
    response.into_body().collect().await.unwrap();

    let before = rss_kib();
    let peak = RssPeak::start();
    let started = Instant::now();
    let request = hyper::Request::post(gateway.proxy_url("/upload"))
        .body(GeneratedBody::new(GIB))
        .unwrap();
    let response = client.request(request).await.expect("upload answered");
    assert_eq!(response.status(), 200);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"sink");
    let peak = peak.finish();

    let seen = sink.last_seen();
    assert_eq!(seen.method, "POST");
    assert_eq!(
        seen.body_len as u64, GIB,
        "upload arrived with the wrong size"
    );
    assert_eq!(sink.body_bytes.load(Ordering::SeqCst), GIB + (1 << 20));
    let growth = peak.saturating_sub(before);
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
