//! Affinity (issue 35, TRAFFIC.md §5) through real sockets: `ring_hash` and `maglev` send each
//! hash key (header, query, cookie, client address; for tcp, the client address) to one target,
//! follow a discovered target's provider key, move only the keys of a target that cannot take
//! them and bring them back, agree across two gateways on one PostgreSQL database, and spread a
//! hot key under `hash_balance_factor`; session cookies pin a client to its target through a
//! scale-out and a rolling replacement (draining targets keep their sessions until removed, then
//! the sessions are re-pinned and counted), and a new target on an old address receives none of
//! the old sessions. The runtime view and the validation of the new fields are checked along the
//! way.

use crate::common;
use crate::common::postgres;
use common::registry::Registry;
use common::*;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::sync::Semaphore;

/// Longest wait for anything the gateway does on its own with the short timers used here.
const WAIT: Duration = Duration::from_secs(10);
/// The default session cookie.
const COOKIE: &str = "raahi-session";
/// The header the hashing services here hash on.
const USER: &str = "x-user";

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// One answer through the proxy.
struct Answer {
    status: u16,
    /// The upstream's name, for a 200.
    body: String,
    set_cookies: Vec<String>,
}

impl Answer {
    /// The value and Max-Age of the session cookie `name` this answer sets, checking the whole
    /// `Set-Cookie`: `name=<50 hex>; Path=/[; Max-Age=N]; HttpOnly; SameSite=Lax`. None when it
    /// sets none.
    fn cookie(&self, name: &str) -> Option<(String, Option<u64>)> {
        let prefix = format!("{name}=");
        let mut found = self
            .set_cookies
            .iter()
            .filter(|set| set.starts_with(&prefix));
        let set = found.next()?;
        assert!(
            found.next().is_none(),
            "one {name} cookie: {:?}",
            self.set_cookies
        );
        let parts: Vec<&str> = set.split("; ").collect();
        let value = parts[0][prefix.len()..].to_owned();
        assert!(
            value.len() == 50 && value.bytes().all(|b| b.is_ascii_hexdigit()),
            "the session cookie is 50 hex characters: {set}"
        );
        let (max_age, rest) = match parts.get(2).and_then(|p| p.strip_prefix("Max-Age=")) {
            Some(seconds) => (Some(seconds.parse().expect("a number")), &parts[3..]),
            None => (None, &parts[2..]),
        };
        assert_eq!(parts.get(1), Some(&"Path=/"), "{set}");
        assert_eq!(rest, ["HttpOnly", "SameSite=Lax"], "{set}");
        Some((value, max_age))
    }

    /// The default session cookie's value this answer sets, which carries no Max-Age (the
    /// services here set no timeouts unless a test says so); None when it sets none.
    fn session(&self) -> Option<String> {
        let (value, max_age) = self.cookie(COOKIE)?;
        assert_eq!(
            max_age, None,
            "no timeouts, no Max-Age: {:?}",
            self.set_cookies
        );
        Some(value)
    }
}

/// A GET of `path` through the proxy with `headers`, on `client`.
async fn send_on(
    client: &reqwest::Client,
    gateway: &TestGateway,
    path: &str,
    headers: &[(&str, &str)],
) -> Answer {
    let mut request = client.get(gateway.proxy_url(path));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.expect("proxy answers");
    let status = response.status().as_u16();
    let set_cookies = response
        .headers()
        .get_all("set-cookie")
        .iter()
        .map(|value| value.to_str().unwrap_or_default().to_owned())
        .collect();
    let body = response.text().await.unwrap_or_default();
    Answer {
        status,
        body,
        set_cookies,
    }
}

async fn send(gateway: &TestGateway, path: &str, headers: &[(&str, &str)]) -> Answer {
    send_on(&gateway.http, gateway, path, headers).await
}

/// The upstream that answered a GET of `path` with `headers`, which must answer 200.
async fn upstream_of(gateway: &TestGateway, path: &str, headers: &[(&str, &str)]) -> String {
    let answer = send(gateway, path, headers).await;
    assert_eq!(
        answer.status, 200,
        "GET {path} {headers:?}: {}",
        answer.body
    );
    answer.body
}

/// A service from `body`, one operator target (weight 100) per upstream and a catch-all route;
/// its id and its target ids by upstream name.
async fn service_on(
    gateway: &TestGateway,
    body: Value,
    upstreams: &[Upstream],
) -> (i64, BTreeMap<String, i64>) {
    let service = gateway.create("/api/v1/services", body).await;
    let mut targets = BTreeMap::new();
    for upstream in upstreams {
        let id = gateway
            .create(
                &format!("/api/v1/services/{service}/targets"),
                target(upstream, 100, 0),
            )
            .await;
        targets.insert(upstream.name.clone(), id);
    }
    gateway.route_all_to(service).await;
    (service, targets)
}

async fn upstreams(names: &[&str]) -> Vec<Upstream> {
    let mut started = Vec::new();
    for name in names {
        started.push(Upstream::start(name).await);
    }
    started
}

/// `GET /api/v1/services/{service}/runtime`: the service as the data path has it.
async fn runtime(gateway: &TestGateway, service: i64) -> Value {
    gateway
        .get_ok(&format!("/api/v1/services/{service}/runtime"))
        .await
}

/// Polls the runtime view until `done` holds; returns that view.
async fn wait_runtime(
    gateway: &TestGateway,
    service: i64,
    what: &str,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let done = &done;
    wait_until(&format!("service {service}: {what}"), WAIT, || async move {
        let view = runtime(gateway, service).await;
        if done(&view) {
            Ok(view)
        } else {
            Err(view)
        }
    })
    .await
}

/// Ids of the targets in rotation in a runtime view.
fn rotation(view: &Value) -> BTreeSet<i64> {
    view["targets"]
        .as_array()
        .unwrap_or_else(|| panic!("a runtime view has targets: {view}"))
        .iter()
        .map(|target| target["id"].as_i64().expect("a target id"))
        .collect()
}

/// Ids of the draining targets that keep their sessions in a runtime view.
fn draining(view: &Value) -> BTreeSet<i64> {
    view["sessions"]["draining"]
        .as_array()
        .unwrap_or_else(|| panic!("a runtime view with sessions: {view}"))
        .iter()
        .map(|target| target["id"].as_i64().expect("a target id"))
        .collect()
}

/// Where a hashing service reads its key from.
#[derive(Clone, Copy)]
enum Carry {
    Header(&'static str),
    Query(&'static str),
    Cookie(&'static str),
}

/// The upstream of a request carrying `key` as `carry` says.
async fn upstream_for_key(gateway: &TestGateway, carry: Carry, key: &str) -> String {
    match carry {
        Carry::Header(name) => upstream_of(gateway, "/", &[(name, key)]).await,
        Carry::Query(name) => upstream_of(gateway, &format!("/?{name}={key}"), &[]).await,
        Carry::Cookie(name) => {
            let cookie = format!("theme=dark; {name}={key}");
            upstream_of(gateway, "/", &[("cookie", &cookie)]).await
        }
    }
}

/// The upstream each key reaches, asking every key once per round for `rounds` rounds (other
/// keys' requests in between); fails when a key reaches two upstreams.
async fn key_owners(
    gateway: &TestGateway,
    carry: Carry,
    keys: &[String],
    rounds: usize,
) -> BTreeMap<String, String> {
    let mut owners: BTreeMap<String, String> = BTreeMap::new();
    for round in 0..rounds {
        for key in keys {
            let upstream = upstream_for_key(gateway, carry, key).await;
            let first = owners
                .entry(key.clone())
                .or_insert_with(|| upstream.clone());
            assert_eq!(
                *first, upstream,
                "key {key:?} reached {first} first, then {upstream} in round {round}"
            );
        }
    }
    owners
}

fn keys(count: usize) -> Vec<String> {
    (0..count).map(|i| format!("user-{i}")).collect()
}

/// The distinct upstreams among the owners.
fn distinct(owners: &BTreeMap<String, String>) -> BTreeSet<&str> {
    owners.values().map(String::as_str).collect()
}

/// A new client's first request (no cookie) to `path`: its upstream and the session cookie its
/// answer must set.
async fn new_session(gateway: &TestGateway, path: &str) -> (String, String) {
    let answer = send(gateway, path, &[]).await;
    assert_eq!(answer.status, 200, "GET {path}: {}", answer.body);
    let cookie = answer
        .session()
        .unwrap_or_else(|| panic!("a first request gets a session: {:?}", answer.set_cookies));
    (answer.body, cookie)
}

/// A request of the session `cookie` to `path`.
async fn in_session(gateway: &TestGateway, path: &str, cookie: &str) -> Answer {
    let header = format!("{COOKIE}={cookie}");
    let answer = send(gateway, path, &[("cookie", &header)]).await;
    assert_eq!(
        answer.status, 200,
        "GET {path} in a session: {}",
        answer.body
    );
    answer
}

/// Asserts that each session's request reaches its upstream and sets no cookie (the session
/// holds as it is).
async fn assert_sessions_hold(gateway: &TestGateway, sessions: &[(String, String)], when: &str) {
    for (upstream, cookie) in sessions {
        let answer = in_session(gateway, "/", cookie).await;
        assert_eq!(
            &answer.body, upstream,
            "{when}: a session of {upstream} reached {}",
            answer.body
        );
        assert_eq!(
            answer.session(),
            None,
            "{when}: a held session gets no new cookie"
        );
    }
}

fn repinned_series(service: &str) -> String {
    format!("raahi_session_repinned_total{{service=\"{service}\"}}")
}

fn endpoint(key: &str, upstream: &Upstream) -> Value {
    json!({"key": key, "host": "127.0.0.1", "port": upstream.addr.port()})
}

/// A service from `body` with a catch-all route and an `http` source on `registry` (refreshed
/// only when asked), whose draining targets are removed after `removal_grace_ms`; waits for
/// `active` targets. Returns the service and the source.
async fn discovered_service(
    gateway: &TestGateway,
    body: Value,
    registry: &Registry,
    removal_grace_ms: u64,
    active: u64,
) -> (i64, i64) {
    let service = gateway.create("/api/v1/services", body).await;
    gateway.route_all_to(service).await;
    let source = gateway
        .create(
            &format!("/api/v1/services/{service}/discovery-sources"),
            json!({
                "name": "registry",
                "provider": "http",
                "config": {"url": registry.url("/v1/endpoints"), "interval_ms": 600_000,
                           "timeout_ms": 1_000},
                "removal_grace_ms": removal_grace_ms,
                "removal_guard": null,
            }),
        )
        .await;
    wait_status(gateway, source, "every endpoint active", |status| {
        status.endpoints == counts(active, 0, 0)
    })
    .await;
    wait_runtime(gateway, service, "every target in rotation", |view| {
        rotation(view).len() as u64 == active
    })
    .await;
    (service, source)
}

/// A service body with session persistence (the default cookie, no timeouts).
fn sticky(name: &str) -> Value {
    json!({"name": name, "session_persistence": {}})
}

/// Forces a refresh of the source (202).
async fn refresh(gateway: &TestGateway, source: i64) {
    let path = format!("/api/v1/discovery-sources/{source}/refresh");
    let (status, body) = gateway.api("POST", &path, None).await;
    assert_eq!(status, StatusCode::ACCEPTED, "POST {path}: {body}");
}

/// The service's target ids by provider key.
async fn ids_by_key(gateway: &TestGateway, service: i64) -> BTreeMap<String, i64> {
    gateway
        .targets(service)
        .await
        .into_iter()
        .map(|target| (target.key().to_owned(), target.id))
        .collect()
}

/// `count` sessions started one after another (round robin spreads them evenly).
async fn start_sessions(gateway: &TestGateway, count: usize) -> Vec<(String, String)> {
    let mut sessions = Vec::new();
    for _ in 0..count {
        sessions.push(new_session(gateway, "/").await);
    }
    sessions
}

// ---------------------------------------------------------------------------------------------
// 1, 2. The same key reaches the same target
// ---------------------------------------------------------------------------------------------

/// Five upstreams under `policy` on header `x-user` (configured as `X-User`), and a sixth as a
/// backup (priority 1): 50 keys asked three times each reach one upstream per key, spread over
/// several of the first tier; keyless requests go round robin; the runtime view shows each
/// tier's table (`sizes`: for five targets of weight 100, then one) and shares summing to 1 in
/// each tier.
async fn same_key_same_target(policy: &str, sizes: [u64; 2]) {
    let gateway = TestGateway::start().await;
    let ups = upstreams(&["u0", "u1", "u2", "u3", "u4"]).await;
    let (service, mut targets) = service_on(
        &gateway,
        json!({"name": "hashed", "lb_policy": policy, "hash_on": {"header": "X-User"}}),
        &ups,
    )
    .await;
    let backup = Upstream::start("backup").await;
    let backup_id = gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            target(&backup, 100, 1),
        )
        .await;
    targets.insert(backup.name.clone(), backup_id);
    wait_runtime(&gateway, service, "the backup tier", |view| {
        rotation(view).contains(&backup_id)
    })
    .await;

    let owners = key_owners(&gateway, Carry::Header(USER), &keys(50), 3).await;
    let used = distinct(&owners);
    assert!(
        used.len() >= 3,
        "50 keys spread over several of 5 upstreams: {owners:?}"
    );

    // No key: round robin, every request answered.
    let mut keyless = BTreeSet::new();
    for _ in 0..10 {
        keyless.insert(upstream_of(&gateway, "/", &[]).await);
    }
    assert!(
        keyless.len() >= 2,
        "keyless requests go round robin, not to one target: {keyless:?}"
    );
    assert_eq!(backup.hits(), 0, "the backup tier takes nothing");

    let view = runtime(&gateway, service).await;
    assert_eq!(view["lb_policy"], policy, "{view}");
    let hashing = &view["hashing"];
    assert_eq!(hashing["hash_on"], json!({"header": USER}), "{view}");
    assert_eq!(hashing["hash_balance_factor"], Value::Null, "{view}");
    assert_eq!(
        hashing["in_flight"],
        Value::Null,
        "kept only when bounded: {view}"
    );
    let tiers = hashing["tiers"].as_array().expect("tiers");
    assert_eq!(tiers.len(), 2, "{view}");
    for (tier, size) in tiers.iter().zip(sizes) {
        assert_eq!(tier["size"], size, "{view}");
        assert!(tier["memory_bytes"].as_u64().unwrap_or(0) > 0, "{view}");
    }
    assert_eq!(tiers[0]["priority"], 0, "{view}");
    assert_eq!(tiers[1]["priority"], 1, "{view}");
    assert_eq!(view["sessions"], Value::Null, "{view}");
    let listed = rotation(&view);
    assert_eq!(
        listed,
        targets.values().copied().collect::<BTreeSet<i64>>(),
        "{view}"
    );
    let mut sums = [0.0f64; 2];
    for target in view["targets"].as_array().expect("targets") {
        let share = target["hash_share"]
            .as_f64()
            .unwrap_or_else(|| panic!("a hashed target has a hash_share: {view}"));
        assert!(share > 0.0, "{view}");
        let tier = usize::from(target["id"] == backup_id);
        sums[tier] += share;
    }
    for sum in sums {
        assert!(
            (sum - 1.0).abs() < 1e-6,
            "shares sum to 1 per tier: {sums:?}: {view}"
        );
    }
}

#[tokio::test]
async fn ring_hash_sends_each_header_key_to_one_target() {
    // 100 points per target at weight 100.
    same_key_same_target("ring_hash", [500, 100]).await;
}

#[tokio::test]
async fn maglev_sends_each_header_key_to_one_target() {
    // The smallest primes of the ladder at or above 100 × the tier's targets.
    same_key_same_target("maglev", [2039, 2039]).await;
}

/// `hash_on` a query parameter, a cookie and the client's address: each key keeps to one
/// upstream and different keys spread. The client addresses are 127.0.0.2 to 127.0.0.17,
/// each a client of its own.
#[tokio::test]
async fn query_cookie_and_client_address_keys_route_consistently() {
    let gateway = TestGateway::start().await;
    let ups = upstreams(&["q0", "q1", "q2", "q3"]).await;
    let (service, _) = service_on(
        &gateway,
        json!({"name": "keys", "lb_policy": "ring_hash", "hash_on": {"query": "user"}}),
        &ups,
    )
    .await;
    let keys = keys(24);

    let by_query = key_owners(&gateway, Carry::Query("user"), &keys, 2).await;
    assert!(distinct(&by_query).len() >= 2, "{by_query:?}");
    // Another parameter is no key: round robin.
    let mut keyless = BTreeSet::new();
    for _ in 0..8 {
        keyless.insert(upstream_of(&gateway, "/?other=user-0", &[]).await);
    }
    assert!(keyless.len() >= 2, "keyless: round robin: {keyless:?}");

    let path = format!("/api/v1/services/{service}");
    // `hash_on` is replaced whole by a PATCH (a merge would leave two keys).
    let patch = json!({"hash_on": {"cookie": "user"}});
    let (status, body) = gateway.api("PATCH", &path, Some(patch)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    wait_runtime(&gateway, service, "hashing on the cookie", |view| {
        view["hashing"]["hash_on"] == json!({"cookie": "user"})
    })
    .await;
    let by_cookie = key_owners(&gateway, Carry::Cookie("user"), &keys, 2).await;
    assert!(distinct(&by_cookie).len() >= 2, "{by_cookie:?}");

    let (status, body) = gateway
        .api("PATCH", &path, Some(json!({"hash_on": "client_ip"})))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    wait_runtime(&gateway, service, "hashing on the client address", |view| {
        view["hashing"]["hash_on"] == "client_ip"
    })
    .await;
    let mut by_address: BTreeMap<u8, String> = BTreeMap::new();
    for last in 2..18u8 {
        let client = reqwest::Client::builder()
            .local_address(IpAddr::V4(Ipv4Addr::new(127, 0, 0, last)))
            .build()
            .unwrap();
        let mut seen = BTreeSet::new();
        for _ in 0..3 {
            // A header of another key changes nothing: the address is the key.
            let answer = send_on(&client, &gateway, "/", &[(USER, "anyone")]).await;
            assert_eq!(answer.status, 200, "{}", answer.body);
            seen.insert(answer.body);
        }
        assert_eq!(seen.len(), 1, "client 127.0.0.{last} reached {seen:?}");
        by_address.insert(last, seen.pop_first().expect("one upstream"));
    }
    let used: BTreeSet<&String> = by_address.values().collect();
    assert!(
        used.len() >= 2,
        "16 client addresses spread over several upstreams: {by_address:?}"
    );
}

/// The upstream that answers a plain HTTP/1.1 request sent over a TCP connection from
/// 127.0.0.`last` to `listen`; None when the connection fails or the answer is not a 200.
async fn tcp_upstream_from(last: u8, listen: SocketAddr) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let socket = tokio::net::TcpSocket::new_v4().ok()?;
    socket.bind(SocketAddr::from(([127, 0, 0, last], 0))).ok()?;
    let mut stream = socket.connect(listen).await.ok()?;
    let request = b"GET / HTTP/1.1\r\nHost: l4\r\nConnection: close\r\n\r\n";
    stream.write_all(request).await.ok()?;
    let mut answer = Vec::new();
    tokio::time::timeout(WAIT, stream.read_to_end(&mut answer))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&answer);
    let (head, body) = text.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_owned())
}

/// A tcp service under `maglev` on `"client_ip"` (the only key a byte stream has): each client
/// address's connections reach one upstream, and addresses spread.
#[tokio::test]
async fn a_tcp_service_hashes_connections_by_client_address() {
    let gateway = TestGateway::start().await;
    let ups = upstreams(&["t0", "t1", "t2", "t3"]).await;
    let targets: Vec<Value> = ups.iter().map(|u| target(u, 100, 0)).collect();
    let service = stream_service(&gateway, "l4", "tcp", &targets).await;
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{service}"),
            Some(json!({"lb_policy": "maglev", "hash_on": "client_ip"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let listen = free_addr();
    stream_route(&gateway, listen, None, service).await;
    wait_runtime(&gateway, service, "maglev", |view| {
        view["lb_policy"] == "maglev"
    })
    .await;
    wait_until("the stream route listens", WAIT, || {
        tcp_upstream_from(2, listen)
    })
    .await;

    let mut by_address: BTreeMap<u8, String> = BTreeMap::new();
    for last in 2..18u8 {
        let mut seen = BTreeSet::new();
        for _ in 0..3 {
            let upstream = tcp_upstream_from(last, listen).await;
            seen.insert(upstream.expect("a 200 through the stream route"));
        }
        assert_eq!(seen.len(), 1, "client 127.0.0.{last} reached {seen:?}");
        by_address.insert(last, seen.pop_first().expect("one upstream"));
    }
    let used: BTreeSet<&String> = by_address.values().collect();
    assert!(used.len() >= 2, "addresses spread: {by_address:?}");
}

// ---------------------------------------------------------------------------------------------
// 3. Unavailable targets
// ---------------------------------------------------------------------------------------------

/// Under `policy`, a disabled target's keys move to others; enabled again, its keys come back.
/// Disabling takes the target out of rotation, so its tier's table is rebuilt without it: on a
/// ring no other key moves; Maglev's rebuild may move up to `others_may_move` of the other
/// keys (its disruption, about 0.6/N measured; a table rebuilt at random would move 80 %).
/// Then, under `ring_hash`, a new target takes keys only from the others (a key stays or moves
/// to it). `key_count` keys are tried.
async fn disabled_targets_keys_move_and_return(
    policy: &str,
    key_count: usize,
    others_may_move: f64,
) {
    let gateway = TestGateway::start().await;
    let ups = upstreams(&["r0", "r1", "r2", "r3", "r4"]).await;
    let (service, targets) = service_on(
        &gateway,
        json!({"name": "off", "lb_policy": policy, "hash_on": {"header": USER}}),
        &ups,
    )
    .await;
    let keys = keys(key_count);
    let before = key_owners(&gateway, Carry::Header(USER), &keys, 1).await;
    let victim = before[&keys[0]].clone();
    let victim_id = targets[&victim];
    let upstream = ups.iter().find(|u| u.name == victim).expect("victim");

    let path = format!("/api/v1/targets/{victim_id}");
    let (status, body) = gateway
        .api("PATCH", &path, Some(json!({"enabled": false})))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    wait_runtime(&gateway, service, "the disabled target out", |view| {
        !rotation(view).contains(&victim_id) && rotation(view).len() == 4
    })
    .await;
    let hits = upstream.hits();
    let during = key_owners(&gateway, Carry::Header(USER), &keys, 1).await;
    assert_eq!(upstream.hits(), hits, "the disabled target gets nothing");
    assert_moved_at_most(&before, &during, &victim, others_may_move);

    let (status, body) = gateway
        .api("PATCH", &path, Some(json!({"enabled": true})))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    wait_runtime(&gateway, service, "the target back", |view| {
        rotation(view).contains(&victim_id)
    })
    .await;
    let after = key_owners(&gateway, Carry::Header(USER), &keys, 1).await;
    assert_eq!(after, before, "every key is back where it was");
    if policy != "ring_hash" {
        return;
    }

    let newcomer = Upstream::start("r5").await;
    let newcomer_id = gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            target(&newcomer, 100, 0),
        )
        .await;
    let view = wait_runtime(&gateway, service, "the new target in", |view| {
        rotation(view).contains(&newcomer_id)
    })
    .await;
    let share = view["targets"]
        .as_array()
        .expect("targets")
        .iter()
        .find(|t| t["id"] == newcomer_id)
        .and_then(|t| t["hash_share"].as_f64())
        .expect("a share");
    assert!(share > 0.0, "the new target owns part of the ring: {view}");
    let grown = key_owners(&gateway, Carry::Header(USER), &keys, 1).await;
    for (key, owner) in &before {
        let now = &grown[key];
        assert!(
            now == owner || now == "r5",
            "key {key} of {owner} moved to {now}, not to the new target"
        );
    }
}

#[tokio::test]
async fn ring_hash_moves_only_a_disabled_targets_keys_and_brings_them_back() {
    disabled_targets_keys_move_and_return("ring_hash", 100, 0.0).await;
}

#[tokio::test]
async fn maglev_moves_a_disabled_targets_keys_and_few_others_and_brings_them_back() {
    // Enough keys that a rebuilt table (which moves about 1–3 % of the others' keys) shows.
    disabled_targets_keys_move_and_return("maglev", 600, 0.10).await;
}

/// `maglev` with health checks: the keys of a target that stops answering checks move to their
/// next choices, every other key stays (its table is not rebuilt); healthy again, they return.
#[tokio::test]
async fn maglev_skips_an_unhealthy_target_for_its_keys_only_and_returns_to_it() {
    let gateway = TestGateway::start().await;
    let ups = upstreams(&["m0", "m1", "m2", "m3", "m4"]).await;
    let (service, targets) = service_on(
        &gateway,
        json!({"name": "mag", "lb_policy": "maglev", "hash_on": {"header": USER},
               "health_check": {"path": "/", "interval_ms": 100, "timeout_ms": 200,
                                "healthy_threshold": 1, "unhealthy_threshold": 1}}),
        &ups,
    )
    .await;
    let keys = keys(50);
    let before = key_owners(&gateway, Carry::Header(USER), &keys, 1).await;
    let victim = before[&keys[0]].clone();
    let victim_id = targets[&victim];
    let upstream = ups.iter().find(|u| u.name == victim).expect("victim");
    let unavailable = |available: bool| {
        move |view: &Value| {
            view["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|t| t["id"] == victim_id && t["available"] == available)
        }
    };

    upstream.stop();
    let view = wait_runtime(
        &gateway,
        service,
        "the stopped target unavailable",
        unavailable(false),
    )
    .await;
    let tiers = view["hashing"]["tiers"].clone();
    let during = key_owners(&gateway, Carry::Header(USER), &keys, 2).await;
    assert_moved_only(&before, &during, &victim);
    assert_eq!(
        runtime(&gateway, service).await["hashing"]["tiers"],
        tiers,
        "an unhealthy target is skipped, its table kept"
    );

    let back = Upstream::start_on(&victim, upstream.addr).await;
    wait_runtime(
        &gateway,
        service,
        "the target available again",
        unavailable(true),
    )
    .await;
    let after = key_owners(&gateway, Carry::Header(USER), &keys, 1).await;
    assert_eq!(after, before, "every key is back where it was");
    assert!(
        back.hits() > 0,
        "the returned upstream serves its keys again"
    );
}

/// A discovered target hashes by its provider key, not its address: when the registry moves a
/// key to another address, the keys of that target follow it to the new address and no other
/// key moves (the table is the same).
#[tokio::test]
async fn a_discovered_target_keeps_its_keys_when_its_address_changes() {
    let gateway = TestGateway::start().await;
    let ups = upstreams(&["d0", "d1", "d2", "d3", "moved"]).await;
    let registry = Registry::start().await;
    let mut listed: Vec<Value> = ups[..4].iter().map(|u| endpoint(&u.name, u)).collect();
    registry.set_json(Value::Array(listed.clone()));
    let body = json!({"name": "keyed", "lb_policy": "maglev", "hash_on": {"header": USER}});
    let (service, source) = discovered_service(&gateway, body, &registry, 60_000, 4).await;
    let keys = keys(40);
    let before = key_owners(&gateway, Carry::Header(USER), &keys, 1).await;
    let tiers = runtime(&gateway, service).await["hashing"]["tiers"].clone();

    // Key d0 now at the address of upstream "moved".
    listed[0]["port"] = json!(ups[4].addr.port());
    registry.set_json(Value::Array(listed));
    refresh(&gateway, source).await;
    let moved_to = ups[4].addr.to_string();
    let view = wait_runtime(&gateway, service, "d0 at its new address", |view| {
        view["targets"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|t| t["address"] == moved_to.as_str())
    })
    .await;
    assert_eq!(view["hashing"]["tiers"], tiers, "the same table");
    let after = key_owners(&gateway, Carry::Header(USER), &keys, 1).await;
    let expected: BTreeMap<String, String> = before
        .iter()
        .map(|(key, owner)| {
            let owner = if owner == "d0" { "moved" } else { owner };
            (key.clone(), owner.to_owned())
        })
        .collect();
    assert!(before.values().any(|owner| owner == "d0"), "{before:?}");
    assert_eq!(after, expected, "d0's keys follow its provider key");
}

/// The victim's keys all moved to other upstreams; every other key stayed.
fn assert_moved_only(
    before: &BTreeMap<String, String>,
    during: &BTreeMap<String, String>,
    victim: &str,
) {
    assert_moved_at_most(before, during, victim, 0.0);
}

/// Every key of `victim` left it, and at most `share` of the other keys moved.
fn assert_moved_at_most(
    before: &BTreeMap<String, String>,
    during: &BTreeMap<String, String>,
    victim: &str,
    share: f64,
) {
    let mut moved = 0;
    let mut strayed = Vec::new();
    for (key, owner) in before {
        let now = &during[key];
        if owner == victim {
            assert_ne!(now, victim, "key {key} left {victim}");
            moved += 1;
        } else if now != owner {
            strayed.push(format!("{key}: {owner} -> {now}"));
        }
    }
    assert!(moved > 0, "the victim had keys");
    let unaffected = before.len() - moved;
    assert!(
        strayed.len() as f64 <= share * unaffected as f64,
        "{} of {unaffected} keys of targets unaffected by {victim} moved: {strayed:?}",
        strayed.len()
    );
}

// ---------------------------------------------------------------------------------------------
// 4. Two gateways on one store
// ---------------------------------------------------------------------------------------------

/// Two instances on one PostgreSQL database send each of 100 keys to the same upstream, under
/// `ring_hash` and then `maglev`, and honour each other's session cookies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_one_store_agree_on_every_key_and_session() {
    let database = postgres::fresh_database().await;
    let mut instances = Vec::new();
    for id in ["gw-a", "gw-b"] {
        let dir = Arc::new(tempfile::tempdir().expect("temp dir"));
        instances.push(TestGateway::start_with(dir, cluster_config(&database, id, 1_500)).await);
    }
    let (a, b) = (&instances[0], &instances[1]);
    let ups = upstreams(&["p0", "p1", "p2", "p3", "p4"]).await;
    let (service, targets) = service_on(
        a,
        json!({"name": "shared", "lb_policy": "ring_hash", "hash_on": {"header": USER}}),
        &ups,
    )
    .await;
    let all: BTreeSet<i64> = targets.values().copied().collect();
    let keys = keys(100);
    // The route arrives at b separately from the service.
    for gateway in [a, b] {
        wait_until("the route serves on both", WAIT, || async {
            gateway.fetch_status("/").await.0 == 200
        })
        .await;
    }

    for policy in ["ring_hash", "maglev"] {
        if policy == "maglev" {
            let (status, body) = b
                .api(
                    "PATCH",
                    &format!("/api/v1/services/{service}"),
                    Some(json!({"lb_policy": "maglev"})),
                )
                .await;
            assert_eq!(status, StatusCode::OK, "{body}");
        }
        for gateway in [a, b] {
            wait_runtime(gateway, service, &format!("{policy} on all 5"), |view| {
                view["lb_policy"] == policy && rotation(view) == all
            })
            .await;
        }
        let on_a = key_owners(a, Carry::Header(USER), &keys, 1).await;
        let on_b = key_owners(b, Carry::Header(USER), &keys, 1).await;
        assert!(distinct(&on_a).len() >= 3, "{policy}: {on_a:?}");
        let differ: Vec<_> = keys.iter().filter(|key| on_a[*key] != on_b[*key]).collect();
        assert!(
            differ.is_empty(),
            "{policy}: the gateways disagree on {} keys, e.g. {:?}",
            differ.len(),
            differ.first()
        );
        assert_eq!(
            runtime(a, service).await["hashing"]["tiers"],
            runtime(b, service).await["hashing"]["tiers"],
            "{policy}: the same tables"
        );
    }

    // A session begun on a holds on b: its cookie names the target, by an id both share.
    let (status, body) = a
        .api(
            "PATCH",
            &format!("/api/v1/services/{service}"),
            Some(json!({"session_persistence": {}})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    for gateway in [a, b] {
        wait_runtime(gateway, service, "sessions on", |view| {
            view["sessions"]["cookie"] == COOKIE
        })
        .await;
    }
    // Keyless first requests go round robin on a; each then carries a key that hashes elsewhere.
    let sessions = start_sessions(a, 10).await;
    let spread: BTreeSet<&String> = sessions.iter().map(|(upstream, _)| upstream).collect();
    assert!(spread.len() >= 2, "{sessions:?}");
    for (upstream, cookie) in &sessions {
        let header = format!("{COOKIE}={cookie}");
        for key in &keys[..5] {
            let answer = send(b, "/", &[("cookie", &header), (USER, key)]).await;
            assert_eq!(answer.status, 200, "{}", answer.body);
            assert_eq!(
                &answer.body, upstream,
                "b honours a's session over the hash key"
            );
            assert_eq!(answer.session(), None, "a held session gets no new cookie");
        }
    }
    assert_eq!(b.metric(&repinned_series("shared")).await, 0);
}

// ---------------------------------------------------------------------------------------------
// 5, 6. Sessions through discovery changes
// ---------------------------------------------------------------------------------------------

/// Thirty sessions on three discovered targets all stay with their targets when the registry
/// grows to six; new clients reach the new targets too.
#[tokio::test]
async fn sessions_survive_a_scale_out_from_three_to_six_targets() {
    let gateway = TestGateway::start().await;
    let ups = upstreams(&["s0", "s1", "s2", "s3", "s4", "s5"]).await;
    let registry = Registry::start().await;
    let listed = |count: usize| {
        Value::Array(
            ups[..count]
                .iter()
                .map(|upstream| endpoint(&upstream.name, upstream))
                .collect(),
        )
    };
    registry.set_json(listed(3));
    let (service, source) =
        discovered_service(&gateway, sticky("shop"), &registry, 60_000, 3).await;

    let sessions = start_sessions(&gateway, 30).await;
    for upstream in &ups[..3] {
        let on = sessions.iter().filter(|(u, _)| *u == upstream.name).count();
        assert_eq!(on, 10, "round robin spreads new sessions: {sessions:?}");
    }
    assert_sessions_hold(&gateway, &sessions, "before the scale-out").await;

    registry.set_json(listed(6));
    refresh(&gateway, source).await;
    wait_status(&gateway, source, "six active", |status| {
        status.endpoints == counts(6, 0, 0)
    })
    .await;
    wait_runtime(&gateway, service, "six targets in rotation", |view| {
        rotation(view).len() == 6
    })
    .await;
    let first_hits: Vec<usize> = ups.iter().map(Upstream::hits).collect();
    for round in 0..2 {
        assert_sessions_hold(
            &gateway,
            &sessions,
            &format!("after the scale-out, round {round}"),
        )
        .await;
    }
    assert_eq!(
        ups[3..].iter().map(Upstream::hits).sum::<usize>(),
        first_hits[3..].iter().sum::<usize>(),
        "no old session reached a new target"
    );
    // New clients are spread over all six.
    let fresh = start_sessions(&gateway, 12).await;
    let reached: BTreeSet<&str> = fresh.iter().map(|(u, _)| u.as_str()).collect();
    assert_eq!(
        reached.len(),
        6,
        "new sessions reach every target: {fresh:?}"
    );
    assert_eq!(gateway.metric(&repinned_series("shop")).await, 0);
    assert_eq!(runtime(&gateway, service).await["sessions"]["repinned"], 0);
}

/// Three discovered targets a, b, c with sessions are replaced one at a time by a2, b2, c2.
/// Each replaced target drains: it keeps serving its sessions and takes no new ones, while the
/// surviving targets keep theirs; once the drained targets are removed, their sessions are
/// re-pinned (a new cookie, counted once each) and then hold on their new targets.
#[tokio::test]
async fn a_rolling_replacement_keeps_sessions_until_removal_then_repins_them() {
    // Long enough to check a drained target's sessions right after its drain, even on a busy
    // machine; short enough to wait for the removals.
    const GRACE_MS: u64 = 2_000;
    let gateway = TestGateway::start().await;
    let old = upstreams(&["a", "b", "c"]).await;
    let new = upstreams(&["a2", "b2", "c2"]).await;
    let registry = Registry::start().await;
    let mut listed: Vec<Value> = old.iter().map(|u| endpoint(&u.name, u)).collect();
    registry.set_json(Value::Array(listed.clone()));
    let (service, source) =
        discovered_service(&gateway, sticky("rolling"), &registry, GRACE_MS, 3).await;
    let old_ids = ids_by_key(&gateway, service).await;
    let sessions = start_sessions(&gateway, 30).await;
    let repinned = repinned_series("rolling");
    assert_eq!(gateway.metric(&repinned).await, 0);

    let mut drained: BTreeSet<String> = BTreeSet::new();
    for (step, (leaving, coming)) in old.iter().zip(&new).enumerate() {
        let leaving_id = old_ids[&leaving.name];
        listed[step] = endpoint(&coming.name, coming);
        registry.set_json(Value::Array(listed.clone()));
        refresh(&gateway, source).await;
        let view = wait_runtime(
            &gateway,
            service,
            &format!("{} draining, {} in rotation", leaving.name, coming.name),
            |view| {
                draining(view).contains(&leaving_id)
                    && !rotation(view).contains(&leaving_id)
                    && rotation(view).len() == 3
            },
        )
        .await;
        let shown = view["sessions"]["draining"]
            .as_array()
            .expect("draining targets")
            .iter()
            .find(|t| t["id"] == leaving_id)
            .cloned()
            .expect("the drained target");
        assert_eq!(shown["address"], leaving.addr.to_string(), "{view}");
        assert_eq!(shown["available"], true, "{view}");
        assert_eq!(shown["in_flight"], 0, "{view}");
        drained.insert(leaving.name.clone());

        // The sessions of the target just drained and of the survivors hold. (Targets drained
        // at earlier steps may be gone already: checked once they surely are, below.)
        let held: Vec<(String, String)> = sessions
            .iter()
            .filter(|(upstream, _)| *upstream == leaving.name || !drained.contains(upstream))
            .cloned()
            .collect();
        assert_sessions_hold(
            &gateway,
            &held,
            &format!("step {step}: {} draining", leaving.name),
        )
        .await;
        // New clients never start a session on a draining target.
        for (upstream, _) in start_sessions(&gateway, 6).await {
            assert!(
                !drained.contains(&upstream),
                "step {step}: a new session began on draining {upstream}"
            );
        }
        let (status, target) = gateway
            .api("GET", &format!("/api/v1/targets/{leaving_id}"), None)
            .await;
        assert!(
            status == StatusCode::OK && target["state"] == "draining",
            "step {step}: the checks must run within the drain (raise GRACE_MS): {status} {target}"
        );
    }
    assert_eq!(
        gateway.metric(&repinned).await,
        0,
        "no session moved while draining"
    );

    wait_runtime(&gateway, service, "the drained targets removed", |view| {
        draining(view).is_empty()
    })
    .await;
    for id in old_ids.values() {
        let (status, body) = gateway
            .api("GET", &format!("/api/v1/targets/{id}"), None)
            .await;
        assert_eq!(status, StatusCode::NOT_FOUND, "removed: {body}");
    }
    let old_hits: usize = old.iter().map(Upstream::hits).sum();
    let new_names: BTreeSet<&str> = new.iter().map(|u| u.name.as_str()).collect();
    let mut moved = Vec::new();
    for (upstream, cookie) in &sessions {
        let answer = in_session(&gateway, "/", cookie).await;
        assert!(
            new_names.contains(answer.body.as_str()),
            "a session of removed {upstream} re-pinned to {}",
            answer.body
        );
        let renewed = answer
            .session()
            .unwrap_or_else(|| panic!("a re-pinned session gets a new cookie"));
        assert_ne!(&renewed, cookie);
        moved.push((answer.body, renewed));
    }
    assert_eq!(old.iter().map(Upstream::hits).sum::<usize>(), old_hits);
    assert_eq!(
        gateway.metric(&repinned).await,
        30,
        "each re-pin counted once"
    );
    assert_eq!(runtime(&gateway, service).await["sessions"]["repinned"], 30);
    assert_sessions_hold(&gateway, &moved, "after the re-pin").await;
    assert_eq!(gateway.metric(&repinned).await, 30);
}

// ---------------------------------------------------------------------------------------------
// 7. Cookies name targets, not addresses
// ---------------------------------------------------------------------------------------------

/// A target deleted and created again on the same address is a new target: the old cookie is
/// re-pinned (a new cookie, counted), not taken for its session. A cookie of another service
/// is no session of this one (a new one, not counted as re-pinned).
#[tokio::test]
async fn a_new_target_on_an_old_address_receives_no_old_session() {
    let gateway = TestGateway::start().await;
    let x = Upstream::start("x").await;
    let sticky = gateway
        .service_with_targets(
            "sticky",
            &[json!({"host": "127.0.0.1", "port": x.addr.port()})],
        )
        .await;
    let path = format!("/api/v1/services/{sticky}");
    let (status, body) = gateway
        .api("PATCH", &path, Some(json!({"session_persistence": {}})))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        body["session_persistence"],
        json!({"cookie": COOKIE, "absolute_timeout_s": null, "idle_timeout_s": null}),
        "{body}"
    );
    let other = gateway
        .service_with_targets("other", &[target(&x, 100, 0)])
        .await;
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{other}"),
            Some(json!({"session_persistence": {"cookie": COOKIE}})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    for (name, service) in [("sticky", sticky), ("other", other)] {
        gateway
            .create(
                "/api/v1/routes",
                json!({"name": name, "service_id": service, "path_prefix": format!("/{name}")}),
            )
            .await;
        wait_runtime(&gateway, service, "sessions on", |view| {
            view["sessions"]["cookie"] == COOKIE
        })
        .await;
    }
    let series = repinned_series("sticky");

    let (_, old_cookie) = new_session(&gateway, "/sticky").await;
    let held = in_session(&gateway, "/sticky", &old_cookie).await;
    assert_eq!(held.session(), None, "a live session gets no new cookie");

    let old_id = gateway.targets(sticky).await[0].id;
    let (status, body) = gateway
        .api("DELETE", &format!("/api/v1/targets/{old_id}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    let new_id = gateway
        .create(
            &format!("/api/v1/services/{sticky}/targets"),
            json!({"host": "127.0.0.1", "port": x.addr.port()}),
        )
        .await;
    assert_ne!(new_id, old_id, "target ids are never reused");
    wait_runtime(&gateway, sticky, "only the new target", |view| {
        rotation(view) == BTreeSet::from([new_id])
    })
    .await;
    assert_eq!(gateway.metric(&series).await, 0);

    let answer = in_session(&gateway, "/sticky", &old_cookie).await;
    assert_eq!(answer.body, "x");
    let new_cookie = answer
        .session()
        .expect("the old cookie is re-pinned: a new cookie");
    assert_ne!(new_cookie, old_cookie);
    assert_eq!(gateway.metric(&series).await, 1, "the re-pin is counted");
    assert_eq!(runtime(&gateway, sticky).await["sessions"]["repinned"], 1);
    let held = in_session(&gateway, "/sticky", &new_cookie).await;
    assert_eq!(held.session(), None, "the new session holds");
    assert_eq!(gateway.metric(&series).await, 1);

    // Another service's cookie (same name) starts a session there; nothing was re-pinned.
    let answer = in_session(&gateway, "/other", &new_cookie).await;
    let fresh = answer
        .session()
        .expect("another service's cookie is no session: a new one");
    assert_ne!(fresh, new_cookie);
    assert_eq!(gateway.metric(&repinned_series("other")).await, 0);
    assert_eq!(runtime(&gateway, other).await["sessions"]["repinned"], 0);
}

/// With `idle_timeout_s`, every answer of a session renews its cookie (Max-Age, last use) on
/// the same target, which is no re-pin.
#[tokio::test]
async fn an_idle_timeout_renews_the_cookie_on_the_same_target() {
    let gateway = TestGateway::start().await;
    let ups = upstreams(&["i0", "i1", "i2"]).await;
    let (service, _) = service_on(
        &gateway,
        json!({"name": "idle", "session_persistence":
               {"cookie": "cart", "idle_timeout_s": 600, "absolute_timeout_s": 3600}}),
        &ups,
    )
    .await;
    let cookie_of = |answer: &Answer| -> String {
        let (value, max_age) = answer
            .cookie("cart")
            .unwrap_or_else(|| panic!("a cart cookie: {:?}", answer.set_cookies));
        assert_eq!(max_age, Some(600), "the idle timeout is what is left");
        value
    };
    let first = send(&gateway, "/", &[]).await;
    assert_eq!(first.status, 200);
    let mut cookie = cookie_of(&first);
    for _ in 0..6 {
        let header = format!("cart={cookie}");
        let answer = send(&gateway, "/", &[("cookie", &header)]).await;
        assert_eq!(answer.body, first.body, "the session holds");
        cookie = cookie_of(&answer);
    }
    assert_eq!(gateway.metric(&repinned_series("idle")).await, 0);
    assert_eq!(
        runtime(&gateway, service).await["sessions"]["cookie"],
        "cart"
    );
}

/// With `absolute_timeout_s`, a session ends that long after it began however busy it is: the
/// next request starts a new session (a new cookie), which is no re-pin. Values Raahi did not
/// write (an address, another layout) are no session either.
#[tokio::test]
async fn an_expired_or_foreign_cookie_starts_a_new_session_without_a_repin() {
    let gateway = TestGateway::start().await;
    let ups = upstreams(&["e0", "e1", "e2"]).await;
    service_on(
        &gateway,
        json!({"name": "brief", "session_persistence": {"absolute_timeout_s": 1}}),
        &ups,
    )
    .await;
    let series = repinned_series("brief");
    let first = send(&gateway, "/", &[]).await;
    let (cookie, max_age) = first.cookie(COOKIE).expect("a session");
    assert_eq!(max_age, Some(1), "{:?}", first.set_cookies);

    // Held until it ends, then a new session.
    let ended = wait_until("the session ends after 1 s", WAIT, || async {
        let answer = in_session(&gateway, "/", &cookie).await;
        match answer.cookie(COOKIE) {
            Some((renewed, _)) => Ok(renewed),
            None if answer.body == first.body => Err(format!("held on {}", answer.body)),
            None => panic!("a live session left {} for {}", first.body, answer.body),
        }
    })
    .await;
    assert_ne!(ended, cookie);
    assert_eq!(
        gateway.metric(&series).await,
        0,
        "an ended session is no re-pin"
    );

    let address = ups[0].addr.to_string();
    let other_layout = format!("02{}", &ended[2..]);
    for foreign in [address.as_str(), other_layout.as_str(), "0", ""] {
        let header = format!("{COOKIE}={foreign}");
        let answer = send(&gateway, "/", &[("cookie", &header)]).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert!(
            answer.cookie(COOKIE).is_some(),
            "{foreign:?} is no session: a new one"
        );
    }
    assert_eq!(gateway.metric(&series).await, 0);
}

// ---------------------------------------------------------------------------------------------
// 8. Validation and views
// ---------------------------------------------------------------------------------------------

/// Each bad affinity setting is a 422 naming its field, on create and on patch, storing
/// nothing; a plain service's runtime view has no hashing, no sessions and no shares.
#[tokio::test]
async fn affinity_settings_are_validated_naming_the_field() {
    let gateway = TestGateway::start().await;
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "ring_hash without a key",
            json!({"name": "v", "lb_policy": "ring_hash"}),
            "hash_on",
        ),
        (
            "maglev without a key",
            json!({"name": "v", "lb_policy": "maglev"}),
            "hash_on",
        ),
        (
            "a key for round robin",
            json!({"name": "v", "hash_on": {"header": USER}}),
            "hash_on",
        ),
        (
            "a bad header name",
            json!({"name": "v", "lb_policy": "maglev", "hash_on": {"header": "x user"}}),
            "hash_on.header",
        ),
        (
            "a factor under 100",
            json!({"name": "v", "lb_policy": "maglev", "hash_on": "client_ip",
                   "hash_balance_factor": 99}),
            "hash_balance_factor",
        ),
        (
            "a factor without hashing",
            json!({"name": "v", "hash_balance_factor": 125}),
            "hash_balance_factor",
        ),
        (
            "sessions on tcp",
            json!({"name": "v", "protocol": "tcp", "session_persistence": {}}),
            "session_persistence",
        ),
        (
            "a bad cookie name",
            json!({"name": "v", "session_persistence": {"cookie": "a;b"}}),
            "session_persistence.cookie",
        ),
        (
            "a zero idle timeout",
            json!({"name": "v", "session_persistence": {"idle_timeout_s": 0}}),
            "session_persistence.idle_timeout_s",
        ),
    ];
    for (what, body, field) in cases {
        let answer = gateway.api("POST", "/api/v1/services", Some(body)).await;
        assert_error(what, &answer, 422, "validation_failed", Some(field));
    }
    let (_, list) = gateway.api("GET", "/api/v1/services", None).await;
    assert_eq!(list["items"], json!([]), "nothing stored: {list}");

    let plain = upstreams(&["plain"]).await;
    let (service, targets) = service_on(&gateway, json!({"name": "plain"}), &plain).await;
    let path = format!("/api/v1/services/{service}");
    let stored = gateway.get_ok(&path).await;
    assert_eq!(stored["lb_policy"], "round_robin", "{stored}");
    assert_eq!(stored["hash_on"], Value::Null, "{stored}");
    assert_eq!(stored["hash_balance_factor"], Value::Null, "{stored}");
    assert_eq!(stored["session_persistence"], Value::Null, "{stored}");
    let answer = gateway
        .api("PATCH", &path, Some(json!({"lb_policy": "maglev"})))
        .await;
    assert_error(
        "patch to maglev without a key",
        &answer,
        422,
        "validation_failed",
        Some("hash_on"),
    );
    assert_eq!(
        gateway.get_ok(&path).await,
        stored,
        "a refused patch stores nothing"
    );

    let view = runtime(&gateway, service).await;
    assert_eq!(view["lb_policy"], "round_robin", "{view}");
    assert_eq!(view["hashing"], Value::Null, "{view}");
    assert_eq!(view["sessions"], Value::Null, "{view}");
    assert_eq!(view["targets"][0]["id"], targets["plain"], "{view}");
    assert_eq!(view["targets"][0]["hash_share"], Value::Null, "{view}");
    let answer = send(&gateway, "/", &[]).await;
    assert_eq!(answer.status, 200);
    assert!(answer.set_cookies.is_empty(), "no sessions, no cookie");
}

// ---------------------------------------------------------------------------------------------
// 9. Bounded load
// ---------------------------------------------------------------------------------------------

/// Upstreams that hold each request until the test lets it go, then answer 200 with their name
/// and close the connection.
struct HeldUpstreams {
    names: Vec<String>,
    addrs: Vec<SocketAddr>,
    /// Requests that reached each upstream.
    arrived: Vec<Arc<AtomicUsize>>,
    /// One permit lets one held request answer.
    release: Arc<Semaphore>,
}

impl HeldUpstreams {
    async fn start(count: usize) -> HeldUpstreams {
        let release = Arc::new(Semaphore::new(0));
        let mut held = HeldUpstreams {
            names: Vec::new(),
            addrs: Vec::new(),
            arrived: Vec::new(),
            release: release.clone(),
        };
        for index in 0..count {
            let name = format!("h{index}");
            let arrived = Arc::new(AtomicUsize::new(0));
            let (addr, _) = {
                let (name, arrived, release) = (name.clone(), arrived.clone(), release.clone());
                counting_origin(move |mut stream| {
                    let (name, arrived, release) = (name.clone(), arrived.clone(), release.clone());
                    async move {
                        use tokio::io::AsyncWriteExt;
                        read_head(&mut stream).await;
                        arrived.fetch_add(1, Ordering::SeqCst);
                        release.acquire().await.expect("open").forget();
                        let answer = format!(
                            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{name}",
                            name.len()
                        );
                        let _ = stream.write_all(answer.as_bytes()).await;
                        let _ = stream.shutdown().await;
                    }
                })
                .await
            };
            held.names.push(name);
            held.addrs.push(addr);
            held.arrived.push(arrived);
        }
        held
    }

    fn arrived(&self) -> Vec<usize> {
        self.arrived
            .iter()
            .map(|count| count.load(Ordering::SeqCst))
            .collect()
    }
}

/// `count` concurrent requests with the one key `hot`, held at the upstreams: waits until all
/// arrived and returns how many each upstream holds, and the requests (to finish them).
async fn hold_hot_requests(
    gateway: &TestGateway,
    held: &HeldUpstreams,
    count: usize,
) -> (Vec<usize>, Vec<tokio::task::JoinHandle<(u16, String)>>) {
    let before = held.arrived();
    let requests = (0..count)
        .map(|_| {
            let request = gateway.http.get(gateway.proxy_url("/")).header(USER, "hot");
            tokio::spawn(async move {
                let response = request.send().await.expect("proxy answers");
                let status = response.status().as_u16();
                (status, response.text().await.unwrap_or_default())
            })
        })
        .collect();
    let now = wait_until(
        &format!("{count} requests held at the upstreams"),
        WAIT,
        || async {
            let now = held.arrived();
            let total: usize = now.iter().zip(&before).map(|(n, b)| n - b).sum();
            if total == count {
                Ok(now)
            } else {
                Err(format!("{total} arrived: {now:?}"))
            }
        },
    )
    .await;
    let holding = now.iter().zip(&before).map(|(n, b)| n - b).collect();
    (holding, requests)
}

/// Lets the held requests go; each answers 200 from an upstream, as many from each as it held.
async fn finish(
    held: &HeldUpstreams,
    holding: &[usize],
    requests: Vec<tokio::task::JoinHandle<(u16, String)>>,
) {
    held.release.add_permits(requests.len());
    let mut answered = vec![0; holding.len()];
    for request in requests {
        let (status, body) = request.await.expect("request task");
        assert_eq!(status, 200, "{body}");
        let index = held.names.iter().position(|n| *n == body).expect("a name");
        answered[index] += 1;
    }
    assert_eq!(answered, holding);
}

/// `hash_balance_factor: 125`: 20 concurrent requests of one key spread so that no target holds
/// more than 125 % of the mean (5 of 20 over 5 targets); without the factor all 20 go to the
/// key's one target.
#[tokio::test]
async fn a_balance_factor_spreads_one_hot_key_over_several_targets() {
    let gateway = TestGateway::start().await;
    let held = HeldUpstreams::start(5).await;
    let service = gateway
        .create(
            "/api/v1/services",
            json!({"name": "hot", "lb_policy": "ring_hash", "hash_on": {"header": USER},
                   "hash_balance_factor": 125}),
        )
        .await;
    for addr in &held.addrs {
        gateway
            .create(
                &format!("/api/v1/services/{service}/targets"),
                json!({"host": "127.0.0.1", "port": addr.port()}),
            )
            .await;
    }
    gateway.route_all_to(service).await;

    let (holding, requests) = hold_hot_requests(&gateway, &held, 20).await;
    let used = holding.iter().filter(|&&n| n > 0).count();
    assert!(
        used >= 3,
        "one hot key spreads under the bound: {holding:?}"
    );
    assert!(
        holding.iter().all(|&n| n <= 5),
        "no target above 125 % of the mean load (5): {holding:?}"
    );
    let view = runtime(&gateway, service).await;
    assert_eq!(view["hashing"]["hash_balance_factor"], 125, "{view}");
    assert_eq!(view["hashing"]["in_flight"], 20, "{view}");
    finish(&held, &holding, requests).await;
    wait_runtime(&gateway, service, "nothing in flight", |view| {
        view["hashing"]["in_flight"] == 0
    })
    .await;

    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{service}"),
            Some(json!({"hash_balance_factor": null})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    wait_runtime(&gateway, service, "no bound", |view| {
        view["hashing"]["hash_balance_factor"].is_null()
    })
    .await;
    let (holding, requests) = hold_hot_requests(&gateway, &held, 20).await;
    assert_eq!(
        holding.iter().filter(|&&n| n > 0).count(),
        1,
        "unbounded, a key has one target: {holding:?}"
    );
    finish(&held, &holding, requests).await;
}

/// A canary split of one service by subsets: each session stays with the backend whose subset
/// holds its target, whatever the weights say; a backend set to weight 0 keeps none of its
/// sessions (they are re-pinned, counted, into the other subset).
#[tokio::test]
async fn sessions_on_a_split_by_subsets_stay_with_their_backend_until_it_is_weighed_out() {
    let gateway = TestGateway::start().await;
    let ups = upstreams(&["v1-a", "v1-b", "v2-a", "v2-b"]).await;
    let service = gateway
        .create(
            "/api/v1/services",
            json!({"name": "shop", "session_persistence": {}}),
        )
        .await;
    for upstream in &ups {
        let version = &upstream.name[..2];
        let mut body = target(upstream, 100, 0);
        body["metadata"] = json!({ "version": version });
        gateway
            .create(&format!("/api/v1/services/{service}/targets"), body)
            .await;
    }
    let route = gateway
        .create(
            "/api/v1/routes",
            json!({"name": "split", "backends": [
                {"service_id": service, "weight": 50, "subset": {"version": "v1"}},
                {"service_id": service, "weight": 50, "subset": {"version": "v2"}}]}),
        )
        .await;
    let mut sessions = Vec::new();
    for _ in 0..20 {
        sessions.push(new_session(&gateway, "/").await);
    }
    let on_v2 = sessions
        .iter()
        .filter(|(up, _)| up.starts_with("v2"))
        .count();
    assert!(
        (5..=15).contains(&on_v2),
        "the split shares sessions: {on_v2} of 20 on v2"
    );
    // Each session's requests go to its own subset's backend, not to the first backend.
    assert_sessions_hold(&gateway, &sessions, "a 50/50 split").await;
    assert_sessions_hold(&gateway, &sessions, "again").await;
    assert_eq!(gateway.metric(&repinned_series("shop")).await, 0);

    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/routes/{route}"),
            Some(json!({"backends": [
                {"service_id": service, "weight": 50, "subset": {"version": "v1"}},
                {"service_id": service, "weight": 0, "subset": {"version": "v2"}}]})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    wait_until("the v2 backend weighed out", WAIT, || async {
        let answer = send(&gateway, "/", &[]).await;
        (answer.status == 200 && answer.body.starts_with("v1")).then_some(())
    })
    .await;
    for (upstream, cookie) in &sessions {
        let answer = in_session(&gateway, "/", cookie).await;
        if upstream.starts_with("v1") {
            assert_eq!(&answer.body, upstream, "a v1 session stays");
            assert_eq!(answer.session(), None);
        } else {
            assert!(
                answer.body.starts_with("v1"),
                "a v2 session moved: {}",
                answer.body
            );
            assert!(answer.session().is_some(), "and got a new cookie");
        }
    }
    assert_eq!(
        gateway.metric(&repinned_series("shop")).await,
        on_v2 as u64,
        "every v2 session re-pinned once"
    );
}

/// A draining target still serving its sessions is health-checked like one in rotation: when it
/// dies, the runtime view shows it unavailable and its sessions are re-pinned at once, with no
/// attempt on it.
#[tokio::test]
async fn a_draining_target_keeping_sessions_is_still_health_checked() {
    let gateway = TestGateway::start().await;
    let ups = upstreams(&["d-a", "d-b"]).await;
    let registry = Registry::start().await;
    registry.set_json(json!([endpoint("a", &ups[0]), endpoint("b", &ups[1])]));
    let body = json!({"name": "checked", "session_persistence": {},
        "health_check": {"path": "/", "interval_ms": 100, "timeout_ms": 200,
                         "healthy_threshold": 1, "unhealthy_threshold": 1}});
    let (service, source) = discovered_service(&gateway, body, &registry, 60_000, 2).await;
    let ids = ids_by_key(&gateway, service).await;
    let mut on_a = None;
    for _ in 0..10 {
        let (upstream, cookie) = new_session(&gateway, "/").await;
        if upstream == "d-a" {
            on_a = Some(cookie);
            break;
        }
    }
    let cookie = on_a.expect("round robin gives d-a a session within 10");

    registry.set_json(json!([endpoint("b", &ups[1])]));
    refresh(&gateway, source).await;
    wait_runtime(&gateway, service, "d-a draining", |view| {
        draining(view).contains(&ids["a"])
    })
    .await;
    assert_eq!(
        in_session(&gateway, "/", &cookie).await.body,
        "d-a",
        "draining keeps it"
    );

    ups[0].stop();
    wait_runtime(
        &gateway,
        service,
        "the dead draining target unavailable",
        |view| {
            view["sessions"]["draining"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|t| t["id"] == ids["a"] && t["available"] == false)
        },
    )
    .await;
    let answer = in_session(&gateway, "/", &cookie).await;
    assert_eq!(answer.body, "d-b");
    assert!(answer.session().is_some(), "re-pinned with a new cookie");
    assert_eq!(gateway.metric(&repinned_series("checked")).await, 1);
}
