//! Event-stream clients that never read: their snapshot is shared, so memory does not grow
//! with their number (the admin listener's part of issue 31). Runs alone (see `main.rs`).

use crate::common;
use common::*;

use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(30);
const CLIENTS: u64 = 100;
const TARGETS: u16 = 400;

/// One `/metrics` series, asked on a connection of its own (closed after).
async fn metric(gateway: &TestGateway, series: &str) -> u64 {
    let text = raw_http(
        gateway.admin,
        "GET /metrics HTTP/1.1\r\nHost: raahi\r\nConnection: close\r\n\r\n",
    )
    .await;
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} missing from /metrics:\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_clients_that_never_read_share_their_snapshot() {
    let _alone = crate::ALONE.lock().await;
    let dir = std::sync::Arc::new(tempfile::tempdir().unwrap());
    let mut config = test_config(dir.path());
    // The sharing alone: the budget (which would cut most of them off) is out of the way.
    config.admin.event_stream_budget_bytes = 1 << 40;
    let gateway = TestGateway::start_with(dir, config).await;
    // A snapshot of about 6 MB, twice what a loopback socket takes in: each client that never
    // reads leaves hyper holding the rest.
    let _registry = heavy_discovered_service(&gateway, TARGETS, DEADLINE).await;
    // One client first, so what every connection costs anyway is in the baseline's allocator.
    let mut clients = vec![stuck_event_client(&gateway).await];
    wait_until("the first stream open", DEADLINE, || async {
        metric(&gateway, "raahi_admin_event_streams").await == 1
    })
    .await;

    let before = rss_kib();
    let connecting = (1..CLIENTS).map(|_| stuck_event_client(&gateway));
    clients.extend(futures_util::future::join_all(connecting).await);
    // While the gateway serves them, other admin calls are answered.
    let slowest = std::cell::Cell::new(Duration::ZERO);
    wait_until("every stream open", DEADLINE, || async {
        let asked = std::time::Instant::now();
        let (status, _) = gateway.api("GET", "/api/v1/services", None).await;
        assert_eq!(status, 200);
        slowest.set(slowest.get().max(asked.elapsed()));
        metric(&gateway, "raahi_admin_event_streams").await == CLIENTS
    })
    .await;
    let after = rss_kib();
    let slowest = slowest.get();
    let growth_mib = after.saturating_sub(before) / 1024;
    println!(
        "{CLIENTS} event clients that never read: resident memory {} -> {} MiB; \
         slowest other admin call meanwhile {slowest:?}",
        before / 1024,
        after / 1024
    );
    // Before snapshots were shared: about 3 MiB per client.
    assert!(
        growth_mib < 40,
        "resident memory grew by {growth_mib} MiB for {} more clients",
        CLIENTS - 1
    );
    assert!(
        slowest < Duration::from_secs(2),
        "another admin call took {slowest:?} while the clients connected"
    );
    drop(clients);
}
