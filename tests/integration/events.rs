//! The live view's API through real sockets: the SSE event stream (snapshot first, increasing
//! ids, resume, filter, a stuck client cut off while another keeps receiving, streams ending at
//! shutdown), target histories with their reasons, and `/session`.

use crate::common;

use std::time::Duration;

use common::registry::Registry;
use common::{
    heavy_discovered_service, stuck_event_client, wait_until, ApiError, TestGateway, Upstream,
    ADMIN_TOKEN,
};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::io::AsyncReadExt;
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(10);

/// One Server-Sent Event.
#[derive(Debug, Clone)]
pub(crate) struct Sse {
    pub(crate) id: Option<u64>,
    pub(crate) event: String,
    pub(crate) data: Value,
}

/// An event-stream client reading through reqwest.
pub(crate) struct Stream {
    response: reqwest::Response,
    buffer: String,
}

impl Stream {
    pub(crate) async fn open(
        gateway: &TestGateway,
        query: &str,
        last_event_id: Option<u64>,
    ) -> Stream {
        let mut request = gateway
            .http
            .get(gateway.admin_url(&format!("/api/v1/events{query}")))
            .bearer_auth(ADMIN_TOKEN);
        if let Some(id) = last_event_id {
            request = request.header("last-event-id", id.to_string());
        }
        let response = request.send().await.expect("events answer");
        assert_eq!(response.status(), 200);
        assert_eq!(
            response.headers()["content-type"].to_str().unwrap(),
            "text/event-stream"
        );
        Stream {
            response,
            buffer: String::new(),
        }
    }

    /// The next event (comments skipped); None when the stream ended.
    async fn next(&mut self) -> Option<Sse> {
        self.next_within(WAIT).await
    }

    /// The next event, failing after `wait`.
    async fn next_within(&mut self, wait: Duration) -> Option<Sse> {
        let deadline = Instant::now() + wait;
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let frame: String = self.buffer.drain(..end + 2).collect();
                if let Some(event) = parse(&frame) {
                    return Some(event);
                }
                continue;
            }
            let chunk = tokio::time::timeout_at(deadline, self.response.chunk())
                .await
                .unwrap_or_else(|_| panic!("an event within {wait:?}"))
                .expect("the stream reads");
            self.buffer
                .push_str(std::str::from_utf8(&chunk?).expect("UTF-8 events"));
        }
    }

    /// Events until one matches (returns it), failing after 10 s.
    pub(crate) async fn until(&mut self, what: &str, matches: impl Fn(&Sse) -> bool) -> Sse {
        self.until_within(what, WAIT, matches).await
    }

    /// Events until one matches (returns it), failing after `wait`.
    async fn until_within(
        &mut self,
        what: &str,
        wait: Duration,
        matches: impl Fn(&Sse) -> bool,
    ) -> Sse {
        let deadline = Instant::now() + wait;
        loop {
            assert!(Instant::now() < deadline, "no event: {what}");
            let event = self
                .next_within(deadline.saturating_duration_since(Instant::now()))
                .await
                .unwrap_or_else(|| panic!("stream ended before {what}"));
            if matches(&event) {
                return event;
            }
        }
    }
}

fn parse(frame: &str) -> Option<Sse> {
    let mut id = None;
    let mut event = None;
    let mut data = None;
    for line in frame.lines() {
        if let Some(value) = line.strip_prefix("id: ") {
            id = value.parse().ok();
        } else if let Some(value) = line.strip_prefix("event: ") {
            event = Some(value.to_owned());
        } else if let Some(value) = line.strip_prefix("data: ") {
            data = Some(serde_json::from_str(value).expect("data is JSON"));
        }
    }
    Some(Sse {
        id,
        event: event?,
        data: data?,
    })
}

fn target_change(event: &Sse, target: i64, change: &str) -> bool {
    event.event == "target" && event.data["target_id"] == target && event.data["change"] == change
}

async fn web_service(gateway: &TestGateway, name: &str, extra: Value) -> i64 {
    let mut body = json!({"name": name});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    gateway.create("/api/v1/services", body).await
}

async fn history(gateway: &TestGateway, target: i64) -> Vec<Value> {
    let (status, body) = gateway
        .api("GET", &format!("/api/v1/targets/{target}/history"), None)
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["target_id"], target);
    body["items"].as_array().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_starts_with_a_snapshot_then_each_change_with_its_reason() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("u1").await;
    let service = web_service(
        &gateway,
        "web",
        json!({"ejection": {"failures": 2, "failure_statuses": [503], "base_ejection_ms": 60000}}),
    )
    .await;
    gateway.route_all_to(service).await;

    let mut stream = Stream::open(&gateway, "", None).await;
    let snapshot = stream.next().await.unwrap();
    assert_eq!(snapshot.event, "snapshot");
    let last_id = snapshot.data["last_id"].as_u64().unwrap();
    assert_eq!(snapshot.id, Some(last_id));
    assert!(
        snapshot.data["services"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["name"] == "web" && s["panic_picks"] == 0),
        "{}",
        snapshot.data
    );

    let target = gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            json!({"host": "127.0.0.1", "port": upstream.addr.port()}),
        )
        .await;
    let added = stream
        .until("target added", |e| target_change(e, target, "added"))
        .await;
    assert!(added.id.unwrap() > last_id);
    assert_eq!(added.data["reason"], "created by configuration");
    assert_eq!(added.data["service_id"], service);
    assert_eq!(added.data["target"]["state"], "active");
    assert_eq!(added.data["target"]["in_flight"], 0);

    let path = format!("/api/v1/targets/{target}");
    gateway
        .api("PATCH", &path, Some(json!({"enabled": false})))
        .await;
    let disabled = stream
        .until("target disabled", |e| target_change(e, target, "disabled"))
        .await;
    assert_eq!(disabled.data["reason"], "disabled by configuration");
    assert_eq!(disabled.data["target"]["enabled"], false);
    assert!(disabled.id > added.id);
    gateway
        .api("PATCH", &path, Some(json!({"enabled": true, "weight": 7})))
        .await;
    stream
        .until("target enabled", |e| target_change(e, target, "enabled"))
        .await;
    let updated = stream
        .until("target updated", |e| target_change(e, target, "updated"))
        .await;
    assert_eq!(updated.data["to"], "weight 100 → 7");

    // Passive ejection happens on the request path; the control task reports it with its cause.
    for _ in 0..2 {
        let response = gateway.get("/status/503").await;
        assert_eq!(response.status(), 503);
    }
    let ejected = stream
        .until("target ejected", |e| target_change(e, target, "ejected"))
        .await;
    assert_eq!(ejected.data["reason"], "2 failures in 30 s: HTTP 503");
    assert!(
        ejected.data["target"]["ejected_until"].is_string(),
        "{:?}",
        ejected
    );
    assert_eq!(ejected.data["target"]["ejections"], 1);

    let entries = history(&gateway, target).await;
    let changes: Vec<&str> = entries
        .iter()
        .map(|e| e["change"].as_str().unwrap())
        .collect();
    assert_eq!(
        changes,
        ["ejected", "updated", "enabled", "disabled", "added"],
        "{entries:?}"
    );
    assert_eq!(entries[0]["reason"], "2 failures in 30 s: HTTP 503");
    assert_eq!(entries[0]["id"], ejected.id.unwrap());

    // The target deleted: its removal is told, and its history is still answered.
    let (status, _) = gateway.api("DELETE", &path, None).await;
    assert_eq!(status, 204);
    let removed = stream
        .until("target removed", |e| target_change(e, target, "removed"))
        .await;
    assert_eq!(removed.data["reason"], "deleted by configuration");
    assert!(removed.data["target"].is_null());
    assert_eq!(history(&gateway, target).await[0]["change"], "removed");
    let (status, _) = gateway
        .api("GET", "/api/v1/targets/999999/history", None)
        .await;
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn last_event_id_resumes_and_an_unknown_position_gets_a_fresh_snapshot() {
    let gateway = TestGateway::start().await;
    let service = web_service(&gateway, "web", json!({})).await;
    let mut stream = Stream::open(&gateway, "", None).await;
    stream.next().await.unwrap();
    let mut ids = Vec::new();
    for port in [9001, 9002, 9003] {
        gateway
            .create(
                &format!("/api/v1/services/{service}/targets"),
                json!({"host": "127.0.0.1", "port": port}),
            )
            .await;
        let added = stream
            .until("added", |e| {
                e.event == "target" && e.data["change"] == "added"
            })
            .await;
        ids.push(added.id.unwrap());
    }
    assert!(ids.windows(2).all(|pair| pair[0] < pair[1]), "{ids:?}");

    let mut resumed = Stream::open(&gateway, "", Some(ids[0])).await;
    let next = resumed.next().await.unwrap();
    assert_eq!(next.event, "target", "no snapshot when resuming: {next:?}");
    let after = resumed.next().await.unwrap();
    assert_eq!([next.id.unwrap(), after.id.unwrap()], [ids[1], ids[2]]);

    // From another life of the gateway (ids start again after a restart): a snapshot.
    let mut lost = Stream::open(&gateway, "", Some(1_000_000)).await;
    let first = lost.next().await.unwrap();
    assert_eq!(first.event, "snapshot");
    assert_eq!(first.data["targets"].as_array().unwrap().len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_filter_passes_only_that_service() {
    let gateway = TestGateway::start().await;
    let a = web_service(&gateway, "a", json!({})).await;
    let b = web_service(&gateway, "b", json!({})).await;
    let mut stream = Stream::open(&gateway, &format!("?service_id={a}"), None).await;
    let snapshot = stream.next().await.unwrap();
    let names: Vec<&str> = snapshot.data["services"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["a"]);
    for service in [b, a] {
        gateway
            .create(
                &format!("/api/v1/services/{service}/targets"),
                json!({"host": "127.0.0.1", "port": 9000}),
            )
            .await;
    }
    let first = stream.next().await.unwrap();
    assert_eq!(first.data["service_id"], a, "{first:?}");

    let (status, body) = gateway
        .api("GET", "/api/v1/events?service_id=abc", None)
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(ApiError::read(&body).field.as_deref(), Some("service_id"));
    let (status, _) = gateway
        .api("GET", "/api/v1/events?service_id=424242", None)
        .await;
    assert_eq!(status, 404);
    let (status, _) = gateway.api_as(None, "GET", "/api/v1/events", None).await;
    assert_eq!(status, 401);
}

/// A route driven over its rate with real requests: one `route` event when it starts refusing
/// (not one per request), naming the limit, the refusals and why, and one when it has refused
/// nothing for 10 s; both pass the route's service filter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_over_its_rate_trips_once_then_clears() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("u1").await;
    let service = web_service(&gateway, "web", json!({})).await;
    gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            json!({"host": "127.0.0.1", "port": upstream.addr.port()}),
        )
        .await;
    let route = gateway
        .create(
            "/api/v1/routes",
            json!({"name": "api", "service_id": service,
                   "rate_limit": {"requests_per_second": 1, "burst": 1, "key": "route"}}),
        )
        .await;
    let mut stream = Stream::open(&gateway, &format!("?service_id={service}"), None).await;
    assert_eq!(stream.next().await.unwrap().event, "snapshot");

    // Requests until one is refused, then a few more refused within the same look or the next.
    wait_until("the route refuses a request", WAIT, || async {
        gateway.get("/").await.status() == StatusCode::TOO_MANY_REQUESTS
    })
    .await;
    for _ in 0..5 {
        gateway.get("/").await;
    }
    let tripped = stream
        .until("the rate limit tripping", |e| e.event == "route")
        .await;
    let data = &tripped.data;
    assert_eq!(
        (
            &data["route_id"],
            &data["name"],
            &data["service_id"],
            &data["change"],
            &data["limit"]
        ),
        (
            &json!(route),
            &json!("api"),
            &json!(service),
            &json!("tripped"),
            &json!("rate_limit")
        ),
        "{data}"
    );
    let refused = data["refused"].as_u64().unwrap();
    assert!(refused >= 1, "{data}");
    assert!(data["refused_total"].as_u64().unwrap() >= refused, "{data}");
    let reason = data["reason"].as_str().unwrap();
    assert!(
        reason.ends_with(": over 1 requests per second for the whole route, burst 1"),
        "{reason}"
    );
    assert!(
        reason.starts_with(&format!("{refused} request")),
        "{reason}"
    );

    // Quiet: the next route event is the limit clearing, at least 10 s after it tripped.
    let cleared = stream
        .until_within("the rate limit clearing", Duration::from_secs(30), |e| {
            e.event == "route"
        })
        .await;
    let data = &cleared.data;
    assert_eq!(
        (
            &data["route_id"],
            &data["change"],
            &data["limit"],
            &data["refused"]
        ),
        (
            &json!(route),
            &json!("cleared"),
            &json!("rate_limit"),
            &json!(0)
        ),
        "{data}"
    );
    assert_eq!(data["reason"], "no request refused for 10 s");
    let at = |event: &Sse| {
        chrono::DateTime::parse_from_rfc3339(event.data["at"].as_str().unwrap()).unwrap()
    };
    let quiet = at(&cleared) - at(&tripped);
    assert!(quiet >= chrono::Duration::seconds(10), "{quiet}");
    assert!(cleared.id > tripped.id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_client_is_cut_off_while_another_keeps_receiving() {
    let dir = std::sync::Arc::new(tempfile::tempdir().unwrap());
    let mut config = common::test_config(dir.path());
    config.admin.event_client_queue = 32;
    let gateway = TestGateway::start_with(dir, config).await;
    let service = web_service(&gateway, "web", json!({})).await;
    let target = gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            json!({"host": "127.0.0.1", "port": 9000, "metadata": {"padding": "x".repeat(16_000)}}),
        )
        .await;

    let mut stuck = stuck_event_client(&gateway).await;
    let mut reader = Stream::open(&gateway, "", None).await;
    reader.next().await.unwrap();
    // Each change is one event of about 16 KB, 6 MB in all: more than the stuck client's socket
    // buffers hold. The reader takes each as it comes.
    let mut last_id = 0;
    for weight in 1..=400 {
        gateway
            .api(
                "PATCH",
                &format!("/api/v1/targets/{target}"),
                Some(json!({"weight": weight})),
            )
            .await;
        let event = reader
            .until("the weight change", |e| target_change(e, target, "updated"))
            .await;
        last_id = event.id.unwrap();
    }

    // The stuck client's stream ended early: it reads what was buffered, then the close.
    let mut received = Vec::new();
    let read_all = tokio::time::timeout(WAIT, stuck.read_to_end(&mut received)).await;
    assert!(read_all.is_ok(), "the stuck client was not cut off");
    let text = String::from_utf8_lossy(&received);
    assert!(
        text.starts_with("HTTP/1.1 200"),
        "{}",
        &text[..text.len().min(200)]
    );
    let ids: Vec<u64> = text
        .lines()
        .filter_map(|line| line.strip_prefix("id: ")?.parse().ok())
        .collect();
    assert!(
        ids.iter().max().copied().unwrap_or(0) < last_id,
        "the stuck client got everything ({} frames)",
        ids.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_source_lifecycle_changes_carry_their_details() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("h1").await;
    let service = web_service(
        &gateway,
        "checked",
        json!({"health_check": {"path": "/", "interval_ms": 100, "timeout_ms": 500,
                                "healthy_threshold": 1, "unhealthy_threshold": 2}}),
    )
    .await;
    let mut stream = Stream::open(&gateway, "", None).await;
    stream.next().await.unwrap();
    let target = gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            json!({"host": "127.0.0.1", "port": upstream.addr.port()}),
        )
        .await;
    let healthy = stream
        .until("healthy", |e| {
            target_change(e, target, "health") && e.data["to"] == "healthy"
        })
        .await;
    assert_eq!(healthy.data["reason"], "1 passed check: HTTP 200");
    upstream.stop();
    let unhealthy = stream
        .until("unhealthy", |e| {
            target_change(e, target, "health") && e.data["to"] == "unhealthy"
        })
        .await;
    let reason = unhealthy.data["reason"].as_str().unwrap();
    assert!(reason.starts_with("2 failed checks: "), "{reason}");
    // The deciding check travels with the event, before the check round is stored.
    let check = &unhealthy.data["target"]["last_check"];
    assert_eq!(check["passed"], false, "{unhealthy:?}");
    assert!(
        reason.ends_with(check["detail"].as_str().unwrap()),
        "{check}"
    );
    assert_eq!(unhealthy.data["from"], "healthy");

    // A source: pending → healthy, then failing with its error.
    let registry = Registry::start().await;
    registry.set_json(json!([{"key": "a", "host": "127.0.0.1", "port": 9999}]));
    let source = gateway
        .create(
            &format!("/api/v1/services/{service}/discovery-sources"),
            json!({"name": "registry", "provider": "http",
                   "config": {"url": registry.url("/v1/endpoints"), "interval_ms": 200}}),
        )
        .await;
    let created = stream
        .until("source created", |e| {
            e.event == "config" && e.data["kind"] == "discovery_source"
        })
        .await;
    assert_eq!(created.data["change"], "created");
    assert_eq!(created.data["object"]["name"], "registry");
    assert!(
        created.data["object"].get("config").is_none(),
        "no config (secrets) in events: {:?}",
        created
    );
    // Its targets are told first, then the source's new state with their counts.
    let discovered = added_reason(&mut stream, "discovered").await;
    assert_eq!(discovered, "discovered by source registry");
    let up = stream
        .until("source healthy", |e| {
            e.event == "source" && e.data["to"] == "healthy"
        })
        .await;
    assert_eq!(up.data["source_id"], source);
    assert_eq!(up.data["from"], "pending");
    assert_eq!(up.data["status"]["endpoints"]["active"], 1, "{up:?}");
    registry.set_raw(500, "text/plain", "broken");
    let down = stream
        .until("source failing", |e| {
            e.event == "source" && e.data["to"] == "failing"
        })
        .await;
    let reason = down.data["reason"].as_str().unwrap();
    assert!(reason.contains("500"), "{reason}");
    assert_eq!(down.data["status"]["last_error"], down.data["reason"]);
}

/// The reason of the next discovered target's `added` event.
async fn added_reason(stream: &mut Stream, what: &str) -> String {
    let added = stream
        .until(what, |e| {
            e.event == "target" && e.data["change"] == "added" && !e.data["source_id"].is_null()
        })
        .await;
    added.data["reason"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_names_the_role_and_streams_end_when_the_gateway_stops() {
    let mut gateway = TestGateway::start().await;
    let (status, session) = gateway.api("GET", "/api/v1/session", None).await;
    assert_eq!(status, 200);
    assert_eq!(session["role"], "admin");
    let (_, token) = gateway
        .api(
            "POST",
            "/api/v1/tokens",
            Some(json!({"name": "wall", "role": "viewer"})),
        )
        .await;
    let viewer = token["token"].as_str().unwrap();
    let (status, session) = gateway
        .api_as(Some(viewer), "GET", "/api/v1/session", None)
        .await;
    assert_eq!(status, 200);
    assert_eq!(session, json!({"role": "viewer", "name": "wall"}));
    let (status, _) = gateway
        .api_as(Some("raahi_wrong"), "GET", "/api/v1/session", None)
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);

    let mut stream = Stream::open(&gateway, "", None).await;
    stream.next().await.unwrap();
    let running = gateway.gateway.take().unwrap();
    tokio::time::timeout(WAIT, running.shutdown())
        .await
        .expect("shutdown does not wait for event streams");
    while stream.next().await.is_some() {}
}

/// One `/metrics` series, asked on a connection of its own (closed after).
async fn metric(gateway: &TestGateway, series: &str) -> u64 {
    let text = common::raw_http(
        gateway.admin,
        "GET /metrics HTTP/1.1\r\nHost: raahi\r\nConnection: close\r\n\r\n",
    )
    .await;
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} missing from /metrics:\n{text}"))
}

const SNAPSHOTS_BUILT: &str = "raahi_admin_event_snapshots_built_total";
const SNAPSHOTS_SHARED: &str = "raahi_admin_event_snapshots_shared_total";
const STREAMS_OPEN: &str = "raahi_admin_event_streams";
const HELD_BYTES: &str = "raahi_admin_event_stream_held_bytes";
const CUT_FOR_BUDGET: &str = "raahi_admin_event_streams_cut_off_total{reason=\"budget\"}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_never_read_share_one_snapshot_while_other_calls_answer() {
    const CLIENTS: u64 = 40;
    let dir = std::sync::Arc::new(tempfile::tempdir().unwrap());
    let mut config = common::test_config(dir.path());
    // The sharing alone, without the budget cutting anyone off.
    config.admin.event_stream_budget_bytes = 1 << 30;
    let gateway = std::sync::Arc::new(TestGateway::start_with(dir, config).await);
    let _registry = heavy_discovered_service(&gateway, 64, WAIT).await;
    let built_before = metric(&gateway, SNAPSHOTS_BUILT).await;
    let shared_before = metric(&gateway, SNAPSHOTS_SHARED).await;

    let started = Instant::now();
    let connecting = {
        let gateway = gateway.clone();
        tokio::spawn(async move {
            let clients = (0..CLIENTS).map(|_| stuck_event_client(&gateway));
            futures_util::future::join_all(clients).await
        })
    };
    let asked = Instant::now();
    let (status, _) = gateway.api("GET", "/api/v1/services", None).await;
    assert_eq!(status, 200);
    let answered_in = asked.elapsed();
    let _stuck = connecting.await.unwrap();
    common::wait_until("every client's stream open", WAIT, || async {
        metric(&gateway, STREAMS_OPEN).await == CLIENTS
    })
    .await;
    let elapsed = started.elapsed();

    let built = metric(&gateway, SNAPSHOTS_BUILT).await - built_before;
    let shared = metric(&gateway, SNAPSHOTS_SHARED).await - shared_before;
    assert_eq!(built + shared, CLIENTS, "one frame per client");
    // Nothing changed meanwhile: a frame is built again only once it is a second old.
    assert!(
        built <= elapsed.as_secs() + 1,
        "{built} snapshots built for {CLIENTS} clients in {elapsed:?}"
    );
    assert!(
        answered_in < Duration::from_secs(2),
        "another admin call took {answered_in:?} while the clients connected"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_stream_budget_cuts_off_clients_past_it() {
    const BUDGET: u64 = 8 << 20;
    let dir = std::sync::Arc::new(tempfile::tempdir().unwrap());
    let mut config = common::test_config(dir.path());
    config.admin.event_stream_budget_bytes = BUDGET;
    let gateway = TestGateway::start_with(dir, config).await;
    // A snapshot of about 6 MB: a stuck client's sockets take a part (about 3 MB on
    // loopback), it holds the rest.
    let _registry = heavy_discovered_service(&gateway, 400, WAIT).await;
    let mut stuck = Vec::new();
    for _ in 0..8 {
        stuck.push(stuck_event_client(&gateway).await);
    }
    common::wait_until("a client cut off for the budget", WAIT, || async {
        metric(&gateway, CUT_FOR_BUDGET).await >= 1
    })
    .await;
    let held = metric(&gateway, HELD_BYTES).await;
    assert!(held > 0 && held <= BUDGET, "{held} bytes held");

    // A client cut off reads the end of its (empty) stream, then the close.
    let ends = stuck.iter_mut().map(|client| {
        Box::pin(async move {
            let mut received = Vec::new();
            client.read_to_end(&mut received).await.map(|_| received)
        })
    });
    let (ended, _, _) = tokio::time::timeout(WAIT, futures_util::future::select_all(ends))
        .await
        .expect("a client cut off sees its stream end");
    let text = String::from_utf8_lossy(&ended.unwrap()).into_owned();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(!text.contains("event: snapshot"), "{text}");
    assert!(text.ends_with("\r\n0\r\n\r\n"), "{text}");

    // Gone, they hold nothing; a reading client is served again.
    drop(stuck);
    common::wait_until("nothing held", WAIT, || async {
        metric(&gateway, HELD_BYTES).await == 0
    })
    .await;
    let mut reader = Stream::open(&gateway, "", None).await;
    assert_eq!(reader.next().await.unwrap().event, "snapshot");
}
