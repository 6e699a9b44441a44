//! A gigabyte through a TCP stream route with flat memory (DESIGN.md §6); moved here from
//! `tests/integration/stream_routes.rs` to run alone (see `main.rs`).

use crate::common;
use common::*;

use std::io;
use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const DEADLINE: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gigabyte_through_a_stream_route_with_flat_memory() {
    const TOTAL: u64 = 1 << 30;
    const CHUNK: usize = 256 * 1024;
    let _alone = crate::ALONE.lock().await;
    let gateway = TestGateway::start().await;

    // A sink: counts what it reads and answers the count when the client ends its writes.
    let sink = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let sink_addr = sink.local_addr().unwrap();
    let sink_task = tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = sink.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let mut buffer = vec![0u8; 64 * 1024];
                let mut received: u64 = 0;
                loop {
                    match stream.read(&mut buffer).await {
                        Ok(0) => break,
                        Ok(n) => received += n as u64,
                        Err(_) => return,
                    }
                }
                let _ = stream.write_all(received.to_string().as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    let service = stream_service(
        &gateway,
        "sink",
        "tcp",
        &[json!({"host": "127.0.0.1", "port": sink_addr.port()})],
    )
    .await;
    let listen = free_addr();
    stream_route(&gateway, listen, None, service).await;
    wait_until("the sink answers", DEADLINE, || async {
        matches!(exchange(listen, b"1234").await, Ok(answer) if answer == b"4")
    })
    .await;

    let before = rss_kib();
    let mut peak = before;
    let mut stream = TcpStream::connect(listen).await.unwrap();
    let chunk = vec![b'z'; CHUNK];
    let mut sent: u64 = 0;
    let transfer = async {
        while sent < TOTAL {
            let take = (TOTAL - sent).min(CHUNK as u64) as usize;
            stream.write_all(&chunk[..take]).await?;
            sent += take as u64;
            if sent.is_multiple_of(64 << 20) {
                peak = peak.max(rss_kib());
            }
        }
        stream.shutdown().await?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await?;
        io::Result::Ok(answer)
    };
    let answer = tokio::time::timeout(Duration::from_secs(300), transfer)
        .await
        .expect("1 GiB in time")
        .expect("1 GiB transfer");
    peak = peak.max(rss_kib());
    sink_task.abort();
    assert_eq!(String::from_utf8_lossy(&answer), TOTAL.to_string());
    let growth_mib = peak.saturating_sub(before) / 1024;
    assert!(
        growth_mib < 64,
        "resident memory grew by {growth_mib} MiB moving 1 GiB"
    );
}
