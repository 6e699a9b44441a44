//! The periodic resync on PostgreSQL (issue 38): it backs up lost notifications by reading the
//! change log since the gateway's position, counted as `changed`; it reads everything only when
//! the log cannot say (trimmed past the position), and a reconnected listener reads everything.
//!
//! A lost notification is made faithfully: the write runs under the gateway's own instance name
//! (`application_name`), and a gateway's listener skips its own instance's notifications, as it
//! must, since it applied those changes itself. The change is in the log all the same.

use crate::common;
use crate::common::postgres;

use common::*;

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;
use sqlx::Connection;

/// Longest wait for anything the gateway does on its own with the short timers used here.
const WAIT: Duration = Duration::from_secs(10);
const INSTANCE: &str = "gw-a";
/// A resync period short enough for a test, long enough that several happen in a wait.
const RESYNC_MS: u64 = 300;
/// How often a wait looks again.
const POLL: Duration = Duration::from_millis(50);

/// One gateway on `database`, resyncing every `resync_ms`.
async fn gateway(database: &str, resync_ms: u64) -> TestGateway {
    let dir = Arc::new(tempfile::tempdir().expect("temp dir"));
    let mut config = cluster_config(database, INSTANCE, 1_500);
    config.cluster.resync_ms = resync_ms;
    TestGateway::start_with(dir, config).await
}

/// `raahi_control_reloads_total{kind=...}`.
async fn reloads(gateway: &TestGateway, kind: &str) -> u64 {
    let metrics = gateway.metrics_text().await;
    let series = format!(r#"raahi_control_reloads_total{{kind="{kind}"}} "#);
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(series.as_str()))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} missing from /metrics:\n{metrics}"))
}

/// A connection that writes as the gateway itself: its listener ignores the notifications.
async fn as_the_gateway(database: &str) -> sqlx::PgConnection {
    let options = sqlx::postgres::PgConnectOptions::from_str(database)
        .expect("database url")
        .application_name(INSTANCE);
    sqlx::PgConnection::connect_with(&options)
        .await
        .expect("connects")
}

/// A service `web` on `upstream` with a route `/web`, serving; the id of its one target.
async fn web_service(gateway: &TestGateway, upstream: &Upstream) -> i64 {
    let service = gateway
        .service_with_targets("web", &[target(upstream, 100, 0)])
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "web", "service_id": service, "path_prefix": "/web"}),
        )
        .await;
    wait_until("the route serves", WAIT, || serves(gateway, "first")).await;
    let (status, targets) = gateway
        .api("GET", &format!("/api/v1/services/{service}/targets"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{targets}");
    targets["items"][0]["id"].as_i64().expect("a target id")
}

async fn serves(gateway: &TestGateway, body: &str) -> bool {
    gateway.fetch_status("/web").await == (200, body.to_owned())
}

/// Moves `target` to `upstream`'s port without a notification the gateway acts on; with
/// `trim`, the same transaction trims the change log past it, as `trim_change_log` does once
/// the change is older than the retention (atomically here, so the gateway cannot read the
/// change from the log before it is trimmed).
async fn move_target_unnotified(database: &str, target: i64, upstream: &Upstream, trim: bool) {
    let mut connection = as_the_gateway(database).await;
    let mut transaction = connection.begin().await.expect("begins");
    sqlx::query("UPDATE targets SET port = $1 WHERE id = $2")
        .bind(i64::from(upstream.addr.port()))
        .bind(target)
        .execute(&mut *transaction)
        .await
        .expect("target moved");
    if trim {
        sqlx::query("DELETE FROM config_changes")
            .execute(&mut *transaction)
            .await
            .expect("log trimmed");
        sqlx::query(
            "UPDATE config_change_floor \
             SET position = pg_current_xact_id()::TEXT::BIGINT WHERE id = 1",
        )
        .execute(&mut *transaction)
        .await
        .expect("floor raised");
    }
    transaction.commit().await.expect("commits");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_whose_notification_is_lost_arrives_by_the_periodic_read_of_the_log() {
    let database = postgres::fresh_database().await;
    let a = gateway(&database, RESYNC_MS).await;
    let first = Upstream::start("first").await;
    let second = Upstream::start("second").await;
    let target = web_service(&a, &first).await;
    // Past the start's reloads: periodic resyncs are running.
    let started_changed = reloads(&a, "changed").await;
    wait_until("periodic resyncs run", WAIT, || async {
        reloads(&a, "changed").await + reloads(&a, "full").await >= started_changed + 3
    })
    .await;
    let full = reloads(&a, "full").await;
    let changed = reloads(&a, "changed").await;

    move_target_unnotified(&database, target, &second, false).await;
    wait_until("the unnotified change serves", WAIT, || async {
        for _ in 0..4 {
            if !serves(&a, "second").await {
                return false;
            }
        }
        true
    })
    .await;
    assert_eq!(
        reloads(&a, "full").await,
        full,
        "the periodic resync read the change log, not everything"
    );
    assert!(reloads(&a, "changed").await > changed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_position_behind_the_trimmed_log_reloads_everything_then_reads_the_log_again() {
    let database = postgres::fresh_database().await;
    let a = gateway(&database, RESYNC_MS).await;
    let first = Upstream::start("first").await;
    let second = Upstream::start("second").await;
    let target = web_service(&a, &first).await;
    let full = reloads(&a, "full").await;

    move_target_unnotified(&database, target, &second, true).await;
    wait_until("the change trimmed from the log serves", WAIT, || {
        serves(&a, "second")
    })
    .await;
    assert!(
        reloads(&a, "full").await > full,
        "the log could not say: everything was read"
    );
    // The whole read took a new position past the trim (once any other test's transaction
    // open on the shared server since before it has ended): resyncs read only the log again.
    let deadline = Instant::now() + WAIT;
    let mut full_seen = reloads(&a, "full").await;
    let mut changed_seen = reloads(&a, "changed").await;
    loop {
        let full = reloads(&a, "full").await;
        let changed = reloads(&a, "changed").await;
        if full != full_seen {
            (full_seen, changed_seen) = (full, changed);
        } else if changed >= changed_seen + 3 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no three resyncs in a row read only the log: {full} full, {changed} changed"
        );
        tokio::time::sleep(POLL).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_on_postgres_reads_everything_once_at_start() {
    let database = postgres::fresh_database().await;
    // No periodic resync within the test: what the listener's first connection asks is seen.
    let a = gateway(&database, 600_000).await;
    wait_until(
        "the listener's first connection reads the log",
        WAIT,
        || async { reloads(&a, "changed").await >= 1 },
    )
    .await;
    assert_eq!(
        reloads(&a, "full").await,
        1,
        "only the start reads everything"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_that_reconnects_reloads_everything() {
    let database = postgres::fresh_database().await;
    let a = gateway(&database, 600_000).await;
    let first = Upstream::start("first").await;
    let second = Upstream::start("second").await;
    let target = web_service(&a, &first).await;
    let full = reloads(&a, "full").await;

    // A change the gateway has not read (its notification never acted on), then the listener
    // loses its connection: the reconnect reads everything (the database may be another one
    // after a failover or a restore), the change with it.
    move_target_unnotified(&database, target, &second, false).await;
    assert!(serves(&a, "first").await, "not read before the reconnect");
    let mut admin = postgres_admin(&database).await;
    let terminated: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = $1 AND query ILIKE 'LISTEN%'",
    )
    .bind(INSTANCE)
    .fetch_all(&mut admin)
    .await
    .expect("listener terminated");
    assert_eq!(terminated, vec![true], "one listener connection");
    wait_until(
        "the change made while the listener was away serves",
        WAIT,
        || serves(&a, "second"),
    )
    .await;
    assert!(
        reloads(&a, "full").await > full,
        "the reconnect read everything"
    );
}

async fn postgres_admin(database: &str) -> sqlx::PgConnection {
    sqlx::PgConnection::connect(database)
        .await
        .expect("connects")
}
