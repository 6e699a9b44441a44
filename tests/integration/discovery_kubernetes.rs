//! Kubernetes discovery through real sockets (DESIGN.md §4, watch rules and the Kubernetes
//! mapping): a gateway in-process follows a Service's EndpointSlices on a faithful fake of the
//! API server (`common::kubernetes`) with list + watch, and its data path follows pods becoming
//! ready, terminating and gone within a second; terminating pods finish their requests and serve
//! while nothing else can; ports are chosen by name; a 410 relist, a rotated token, RBAC refusals
//! and an outage are handled like any registry's.
//!
//! The pods are real upstream servers on one port at several loopback addresses (127.0.1.x, and
//! ::1 for IPv6), as pods of one Service share a container port.

use crate::common;

use common::kubernetes::{Ep, KubeFake, Slice, Svc, TargetPort};
use common::*;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{json, Value};

/// Longest wait for anything the gateway does on its own with the short timers used here.
const WAIT: Duration = Duration::from_secs(10);
/// How fast a slice change must reach the data path (the goal).
const PROPAGATION: Duration = Duration::from_secs(1);
pub(crate) const NAMESPACE: &str = "shop";
const TOKEN: &str = "eyJhbGciOiJSUzI1NiJ9.first";

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Pods of one Service: upstreams answering their name, all on one port, at 127.0.1.1,
/// 127.0.1.2, ... (and `::1` for a name starting with "v6").
pub(crate) struct Pods {
    port: u16,
    pub(crate) pods: Vec<Upstream>,
}

impl Pods {
    pub(crate) async fn start(names: &[&str]) -> Pods {
        for _ in 0..50 {
            let probe = std::net::TcpListener::bind("127.0.1.1:0").expect("bind 127.0.1.1");
            let port = probe.local_addr().unwrap().port();
            drop(probe);
            let addresses: Vec<SocketAddr> = names
                .iter()
                .enumerate()
                .map(|(index, name)| SocketAddr::new(address_for(index, name), port))
                .collect();
            // Every address must be free on this port before any upstream takes it.
            let free = addresses
                .iter()
                .all(|address| std::net::TcpListener::bind(address).is_ok());
            if !free {
                continue;
            }
            let mut pods = Vec::new();
            for (name, address) in names.iter().zip(addresses) {
                pods.push(Upstream::start_on(name, address).await);
            }
            return Pods { port, pods };
        }
        panic!("no port free on every loopback address");
    }

    pub(crate) fn ip(&self, name: &str) -> String {
        self.pod(name).addr.ip().to_string()
    }

    fn pod(&self, name: &str) -> &Upstream {
        self.pods
            .iter()
            .find(|pod| pod.name == name)
            .expect("a pod of that name")
    }

    /// A ready endpoint for pod `name`, with its pod name, node and zone.
    fn ready(&self, name: &str) -> Ep {
        Ep::new(&[&self.ip(name)])
            .pod(name)
            .node(&format!("node-{name}"))
            .zone("zone-a")
    }

    /// The endpoint of a pod that was asked to stop but still serves.
    fn terminating(&self, name: &str) -> Ep {
        self.ready(name)
            .ready(Some(false))
            .serving(Some(true))
            .terminating(Some(true))
    }

    fn key(&self, name: &str) -> String {
        SocketAddr::new(self.pod(name).addr.ip(), self.port).to_string()
    }
}

fn address_for(index: usize, name: &str) -> IpAddr {
    if name.starts_with("v6") {
        "::1".parse().unwrap()
    } else {
        format!("127.0.1.{}", index + 1).parse().unwrap()
    }
}

/// A slice `name` of Service `web` with one port named `http`.
pub(crate) fn slice(pods: &Pods, name: &str, endpoints: Vec<Ep>) -> Slice {
    let mut slice = Slice::new(NAMESPACE, name, "web").port(Some("http"), pods.port);
    for endpoint in endpoints {
        slice = slice.endpoint(endpoint);
    }
    slice
}

/// Service `web`: port 80 "http" to the pods' container port named "http".
fn web_service_object() -> Svc {
    Svc::new(NAMESPACE, "web").port(Some("http"), 80, Some(TargetPort::Name("http".into())))
}

pub(crate) struct Cluster {
    pub(crate) fake: KubeFake,
    token_dir: tempfile::TempDir,
}

impl Cluster {
    pub(crate) async fn start() -> Cluster {
        Self::with(KubeFake::start().await)
    }

    fn with(fake: KubeFake) -> Cluster {
        fake.require_token(Some(TOKEN));
        fake.apply_service(web_service_object());
        let token_dir = tempfile::tempdir().expect("a temporary directory");
        std::fs::write(token_dir.path().join("token"), TOKEN).unwrap();
        Cluster { fake, token_dir }
    }

    fn token_file(&self) -> String {
        self.token_dir.path().join("token").display().to_string()
    }

    /// Replaces the token file the way the kubelet does: a new file renamed over the old one.
    fn rotate_token(&self, token: &str) {
        let staged = self.token_dir.path().join("token.new");
        std::fs::write(&staged, token).unwrap();
        std::fs::rename(&staged, self.token_dir.path().join("token")).unwrap();
    }

    /// A `kubernetes` source for Service `web`, with `extra` merged into its config.
    pub(crate) fn source(&self, extra: Value) -> Value {
        let mut config = json!({
            "service": "web",
            "namespace": NAMESPACE,
            "api_server": self.fake.url(),
            "token_file": self.token_file(),
            "timeout_ms": 1_000,
        });
        for (key, value) in extra.as_object().expect("an object") {
            config[key] = value.clone();
        }
        json!({
            "name": "k8s",
            "provider": "kubernetes",
            "config": config,
            "stale_after_ms": 600_000,
            "removal_grace_ms": 2_000,
        })
    }
}

/// A service `web` with a catch-all route and `source`; returns (service, source).
async fn web_service(gateway: &TestGateway, source: Value) -> (i64, i64) {
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    gateway.route_all_to(service).await;
    let source = gateway
        .create(
            &format!("/api/v1/services/{service}/discovery-sources"),
            source,
        )
        .await;
    (service, source)
}

async fn fetch(gateway: &TestGateway) -> (u16, String) {
    gateway.fetch_status("/").await
}

/// Fetches until the proxy answers one of `bodies` `times` times in a row (and nothing else in
/// between); returns how long it took until that streak began.
async fn wait_serving_only(
    gateway: &TestGateway,
    bodies: &[&str],
    times: usize,
    within: Duration,
) -> Duration {
    let started = Instant::now();
    let what = format!("the proxy to serve only {bodies:?}, {times} times in a row");
    wait_until(&what, within, || async {
        // One burst of back-to-back requests; the first other answer ends it.
        let streak_began = started.elapsed();
        for _ in 0..times {
            let (status, got) = fetch(gateway).await;
            if status != 200 || !bodies.contains(&got.as_str()) {
                return Err(format!("it answers {status}: {got}"));
            }
        }
        Ok(streak_began)
    })
    .await
}

/// Fetches until `body` answers; returns how long that took.
async fn wait_served(gateway: &TestGateway, body: &str, within: Duration) -> Duration {
    let started = Instant::now();
    wait_until(&format!("{body} served"), within, || async {
        let (status, got) = fetch(gateway).await;
        if got == body {
            Ok(started.elapsed())
        } else {
            Err(format!("the proxy answers {status}: {got}"))
        }
    })
    .await
}

/// Outcomes the control task received for `source` (each set reported is one reconcile).
fn applied(gateway: &TestGateway, source: i64) -> (u64, u64) {
    let stats = gateway
        .gateway
        .as_ref()
        .expect("running")
        .control
        .source_stats();
    let stats = stats.get(&source).expect("the source runs");
    (
        stats.refreshes.load(Ordering::SeqCst),
        stats.failures.load(Ordering::SeqCst),
    )
}

/// Waits until the source's last answer is more than a second old, so the runner reads the next
/// change as soon as it comes (two reads of one watch are at least a second apart).
async fn wait_watch_idle(gateway: &TestGateway, source: i64) {
    let status = gateway.source_status(source).await;
    let last = status.last_refresh_at.expect("a refresh happened");
    wait_until("a second since the last answer", WAIT, || async {
        chrono::Utc::now() - last > chrono::TimeDelta::milliseconds(1_100)
    })
    .await;
}

/// The targets a source owns, by provider key.
async fn source_targets(gateway: &TestGateway, service: i64) -> HashMap<String, Target> {
    gateway
        .targets(service)
        .await
        .into_iter()
        .map(|target| (target.provider_key.clone().unwrap_or_default(), target))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Following the Service
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scaling_up_and_down_reaches_the_data_path_within_a_second() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["a", "b"]).await;
    cluster
        .fake
        .apply(slice(&pods, "web-x1", vec![pods.ready("a")]));
    let (service, source) = web_service(&gateway, cluster.source(json!({}))).await;
    wait_serving_only(&gateway, &["a"], 1, WAIT).await;
    let status = wait_status(&gateway, source, "watch connected", |s| {
        s.watch_connected() == Some(true)
    })
    .await;
    assert_eq!(status.state, "healthy", "{status}");
    assert_eq!(status.endpoints.active, 1, "{status}");
    assert_eq!(status.next_refresh_at, None, "{status}");
    assert_eq!(status.last_error, None, "{status}");
    assert_eq!(
        status.watch().index,
        Some(cluster.fake.resource_version().to_string()),
        "{status}"
    );
    let metrics = gateway.metrics_text().await;
    assert!(
        metrics.contains(
            "raahi_discovery_watch_connected{service=\"web\",source=\"k8s\",provider=\"kubernetes\"} 1"
        ),
        "{metrics}"
    );
    // The pod's name, node and zone travel with the target.
    let targets = source_targets(&gateway, service).await;
    let target = &targets[&pods.key("a")];
    assert_eq!(
        target.metadata,
        json!({"pod": "a", "node": "node-a", "zone": "zone-a"}),
        "{target}"
    );
    // One list, then a watch from its resource version with bookmarks; the token in its header.
    assert_eq!(cluster.fake.last_token().as_deref(), Some(TOKEN));
    wait_until("a watch is open", WAIT, || async {
        cluster.fake.open_watches() == 1
    })
    .await;
    let queries = cluster.fake.queries();
    // The get of the Service (no query), then the list of its slices.
    assert_eq!(queries[0], "", "{queries:?}");
    assert!(
        queries[1].contains("labelSelector=kubernetes.io%2Fservice-name%3Dweb"),
        "{queries:?}"
    );
    let watch = queries
        .iter()
        .find(|q| q.contains("watch=true") && q.contains("labelSelector"))
        .expect("a watch");
    assert!(watch.contains("allowWatchBookmarks=true"), "{watch}");
    assert!(watch.contains("timeoutSeconds=55"), "{watch}");
    assert!(!queries.iter().any(|q| q.contains(TOKEN)), "{queries:?}");

    // Scale up: the new pod takes traffic within a second, though nothing polls.
    wait_watch_idle(&gateway, source).await;
    cluster.fake.apply(slice(
        &pods,
        "web-x1",
        vec![pods.ready("a"), pods.ready("b")],
    ));
    wait_served(&gateway, "b", PROPAGATION).await;

    // Scale down: within a second the removed pod gets no new request.
    wait_watch_idle(&gateway, source).await;
    cluster
        .fake
        .apply(slice(&pods, "web-x1", vec![pods.ready("b")]));
    let only_b_from = wait_serving_only(&gateway, &["b"], 20, WAIT).await;
    assert!(
        only_b_from < PROPAGATION,
        "the removed pod still got requests {only_b_from:?} after the change"
    );
    let status = wait_status(&gateway, source, "one active, one draining", |s| {
        s.endpoints.active == 1 && s.endpoints.draining == 1
    })
    .await;
    assert_eq!(status.state, "healthy", "{status}");
    // The removal grace ends: the pod's target is gone.
    wait_status(&gateway, source, "the drained target removed", |s| {
        s.endpoints.draining == 0
    })
    .await;

    // The slice is deleted (the Service scaled to zero): an empty set, nothing served.
    cluster.fake.delete(NAMESPACE, "web-x1");
    wait_status(&gateway, source, "no active endpoint", |s| {
        s.endpoints.active == 0
    })
    .await;
    // The store (and so the status) shows the empty set a moment before the data path does: the
    // snapshot is built after the targets are written. Within a second nothing is served.
    wait_until("nothing served", PROPAGATION, || async {
        let (code, body) = fetch(&gateway).await;
        if code == 503 {
            Ok(())
        } else {
            Err(format!("{code} {body}"))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminating_pod_drains_and_its_request_in_flight_completes() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["old", "new"]).await;
    cluster
        .fake
        .apply(slice(&pods, "web-x1", vec![pods.ready("old")]));
    let (_, source) = web_service(&gateway, cluster.source(json!({}))).await;
    wait_serving_only(&gateway, &["old"], 1, WAIT).await;

    // A slow request is in flight on the old pod when the rollout starts.
    let proxy = gateway.proxy_url("/slow/1500");
    let in_flight = tokio::spawn(async move {
        let response = reqwest::get(proxy).await.expect("an answer");
        (response.status().as_u16(), response.text().await.unwrap())
    });
    wait_until("the slow request reached the old pod", WAIT, || async {
        pods.pod("old").hits.load(Ordering::SeqCst) >= 2
    })
    .await;
    cluster.fake.apply(slice(
        &pods,
        "web-x1",
        vec![pods.terminating("old"), pods.ready("new")],
    ));
    wait_serving_only(&gateway, &["new"], 20, WAIT).await;
    let status = wait_status(&gateway, source, "old draining", |s| {
        s.endpoints.active == 1 && s.endpoints.draining == 1
    })
    .await;
    assert_eq!(status.state, "healthy", "{status}");
    let (code, body) = in_flight.await.unwrap();
    assert_eq!(
        (code, body.as_str()),
        (200, "old"),
        "the request in flight completes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_every_pod_terminates_the_serving_ones_keep_the_service_up() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["a", "b", "c"]).await;
    cluster.fake.apply(slice(
        &pods,
        "web-x1",
        vec![pods.ready("a"), pods.ready("b")],
    ));
    let (service, source) = web_service(&gateway, cluster.source(json!({}))).await;
    wait_status(&gateway, source, "two active", |s| s.endpoints.active == 2).await;

    // Every pod terminates (a node drain, a Deployment deleted): they still serve, so they take
    // the traffic rather than the Service answering 503 (KEP-1669).
    cluster.fake.apply(slice(
        &pods,
        "web-x1",
        vec![pods.terminating("a"), pods.terminating("b")],
    ));
    wait_status(&gateway, source, "both terminating, still active", |s| {
        s.revision.is_some() && s.endpoints.active == 2
    })
    .await;
    wait_until("the targets say they are terminating", WAIT, || async {
        source_targets(&gateway, service)
            .await
            .values()
            .all(|target| target.metadata["terminating"] == true)
    })
    .await;
    wait_serving_only(&gateway, &["a", "b"], 20, WAIT).await;
    // One stops serving: the other carries on alone.
    cluster.fake.apply(slice(
        &pods,
        "web-x1",
        vec![
            pods.terminating("a").serving(Some(false)),
            pods.terminating("b"),
        ],
    ));
    wait_serving_only(&gateway, &["b"], 20, WAIT).await;
    // A ready pod appears: it alone takes new requests; the terminating one drains.
    cluster.fake.apply(slice(
        &pods,
        "web-x1",
        vec![pods.terminating("b"), pods.ready("c")],
    ));
    wait_serving_only(&gateway, &["c"], 20, WAIT).await;
    let status = wait_status(&gateway, source, "c active, b draining", |s| {
        s.endpoints.active == 1 && s.endpoints.draining >= 1
    })
    .await;
    assert_eq!(status.state, "healthy", "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_port_is_found_in_each_slice_and_shared_addresses_count_once() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["a", "b", "v6"]).await;
    // Two slices list pod a (as during a slice rebalance), each with a metrics port beside http;
    // an IPv6 slice carries the third pod.
    let with_metrics = |name: &str, endpoints: Vec<Ep>| {
        let mut slice = Slice::new(NAMESPACE, name, "web")
            .port(Some("metrics"), 9)
            .port(Some("http"), pods.port);
        for endpoint in endpoints {
            slice = slice.endpoint(endpoint);
        }
        slice
    };
    cluster.fake.apply_service(
        Svc::new(NAMESPACE, "web")
            .port(Some("metrics"), 9090, Some(TargetPort::Number(9)))
            .port(Some("http"), 80, Some(TargetPort::Name("http".into()))),
    );
    cluster
        .fake
        .apply(with_metrics("web-x1", vec![pods.ready("a")]));
    cluster.fake.apply(with_metrics(
        "web-x2",
        vec![pods.ready("a"), pods.ready("b")],
    ));
    cluster
        .fake
        .apply(with_metrics("web-v6", vec![Ep::new(&["::1"]).pod("v6")]).address_type("IPv6"));

    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    gateway.route_all_to(service).await;
    let path = format!("/api/v1/services/{service}/discovery-sources");
    let mut named = cluster.source(json!({"port": "http"}));
    named["name"] = json!("named");
    let named = gateway.create(&path, named).await;
    let mut unchosen = cluster.source(json!({}));
    unchosen["name"] = json!("unchosen");
    let unchosen = gateway.create(&path, unchosen).await;
    let mut missing = cluster.source(json!({"port": "grpc"}));
    missing["name"] = json!("missing");
    let missing = gateway.create(&path, missing).await;

    let status = wait_status(&gateway, named, "three active", |s| s.endpoints.active == 3).await;
    assert_eq!(status.state, "healthy", "{status}");
    let targets = source_targets(&gateway, service).await;
    for pod in ["a", "b", "v6"] {
        assert!(targets.contains_key(&pods.key(pod)), "{:?}", targets.keys());
    }
    assert_eq!(pods.key("v6"), format!("[::1]:{}", pods.port));
    wait_serving_only(&gateway, &["a", "b", "v6"], 1, WAIT).await;
    let mut seen = std::collections::HashSet::new();
    let started = Instant::now();
    while seen.len() < 3 {
        assert!(started.elapsed() < WAIT, "only {seen:?} answered");
        let (code, body) = fetch(&gateway).await;
        assert_eq!(code, 200, "{body}");
        seen.insert(body);
    }

    let status = wait_status(&gateway, unchosen, "failing", |s| s.state == "failing").await;
    let error = status.last_error.as_deref().unwrap_or_default();
    assert!(
        error.contains("several TCP ports")
            && error.contains("\"http\"")
            && error.contains("\"metrics\""),
        "{status}"
    );
    let status = wait_status(&gateway, missing, "failing", |s| s.state == "failing").await;
    let error = status.last_error.as_deref().unwrap_or_default();
    assert_eq!(
        error,
        format!(
            "registry {}/api/v1/namespaces/shop/services/web: spec.ports: Service shop/web has \
             no port named \"grpc\" (its ports: 9090 \"metrics\" → 9/TCP, 80 \"http\" → \
             http/TCP)",
            cluster.fake.url()
        ),
        "{status}"
    );
}

// ---------------------------------------------------------------------------------------------
// The watch's own rules
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_api_server_with_new_history_is_relisted_and_loses_nothing() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["a", "b", "c"]).await;
    cluster.fake.apply(slice(
        &pods,
        "web-x1",
        vec![pods.ready("a"), pods.ready("b")],
    ));
    let (_, source) = web_service(&gateway, cluster.source(json!({}))).await;
    wait_status(&gateway, source, "two active", |s| s.endpoints.active == 2).await;
    // The status shows the stored targets a moment before the data path serves them.
    wait_serving_only(&gateway, &["a", "b"], 1, WAIT).await;
    wait_until("a watch is open", WAIT, || async {
        cluster.fake.open_watches() == 1
    })
    .await;
    let lists = cluster.fake.lists();

    // Another Service changes (the watch, filtered by label, does not see it), then the server
    // restarts with its history compacted past the watch's resource version: the watch resumes,
    // gets 410 Gone, and lists again. Meanwhile a pod is added.
    cluster
        .fake
        .apply(Slice::new(NAMESPACE, "db-x1", "db").port(None, 5432));
    cluster.fake.restart_with_new_history();
    cluster.fake.apply(slice(
        &pods,
        "web-x1",
        vec![pods.ready("a"), pods.ready("b"), pods.ready("c")],
    ));
    // Nothing is lost while it relists: a and b keep answering until c joins them.
    let started = Instant::now();
    while fetch(&gateway).await.1 != "c" {
        let (code, body) = fetch(&gateway).await;
        assert!(
            code == 200 && (body == "a" || body == "b" || body == "c"),
            "{code} {body}"
        );
        assert!(started.elapsed() < WAIT, "c never served");
    }
    assert!(cluster.fake.lists() > lists, "a relist after 410");
    let status = wait_status(&gateway, source, "three active", |s| {
        s.endpoints.active == 3 && s.watch_connected() == Some(true)
    })
    .await;
    assert_eq!(status.endpoints.draining, 0, "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_watch_relists_without_a_failure() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["a", "b"]).await;
    cluster
        .fake
        .apply(slice(&pods, "web-x1", vec![pods.ready("a")]));
    let (_, source) = web_service(&gateway, cluster.source(json!({}))).await;
    wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    wait_until("a watch is open", WAIT, || async {
        cluster.fake.open_watches() == 1
    })
    .await;
    let lists = cluster.fake.lists();
    let (_, failures) = applied(&gateway, source);
    // Another Service changes (unseen: the watch is filtered by label and gets no bookmark),
    // the history is compacted past the watch's resource version, and the watch ends cleanly
    // (its timeoutSeconds): kube's watcher gets 410 on resuming, relists, and the source never
    // fails.
    cluster
        .fake
        .apply(Slice::new(NAMESPACE, "db-x1", "db").port(None, 5432));
    cluster.fake.compact();
    cluster.fake.close_watches();
    cluster.fake.apply(slice(
        &pods,
        "web-x1",
        vec![pods.ready("a"), pods.ready("b")],
    ));
    wait_served(&gateway, "b", WAIT).await;
    assert!(cluster.fake.lists() > lists, "relisted");
    let status = gateway.source_status(source).await;
    assert_eq!(status.state, "healthy", "{status}");
    assert_eq!(status.last_error, None, "{status}");
    assert_eq!(applied(&gateway, source).1, failures, "no failed refresh");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_file_replaced_on_disk_is_used_for_the_next_request() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["a", "b"]).await;
    cluster
        .fake
        .apply(slice(&pods, "web-x1", vec![pods.ready("a")]));
    let (_, source) = web_service(&gateway, cluster.source(json!({}))).await;
    wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    wait_until("a watch is open", WAIT, || async {
        cluster.fake.open_watches() == 1
    })
    .await;
    let (_, failures) = applied(&gateway, source);
    let watches = cluster.fake.watches();

    // The kubelet rotates the bound token; the API server stops accepting the old one. The open
    // watch ends (its timeout): the next request of the same watch carries the new token.
    let rotated = "eyJhbGciOiJSUzI1NiJ9.second";
    cluster.rotate_token(&format!("{rotated}\n"));
    cluster.fake.require_token(Some(rotated));
    cluster.fake.close_watches();
    wait_until("the watch resumed", WAIT, || async {
        cluster.fake.watches() > watches && cluster.fake.open_watches() == 1
    })
    .await;
    assert_eq!(cluster.fake.last_token().as_deref(), Some(rotated));
    cluster.fake.apply(slice(
        &pods,
        "web-x1",
        vec![pods.ready("a"), pods.ready("b")],
    ));
    wait_served(&gateway, "b", WAIT).await;
    let status = gateway.source_status(source).await;
    assert_eq!(status.last_error, None, "{status}");
    assert_eq!(
        applied(&gateway, source).1,
        failures,
        "no request was refused"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_watch_costs_no_request_and_no_reconcile_and_a_burst_is_one_set() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["a", "b", "c", "d"]).await;
    cluster
        .fake
        .apply(slice(&pods, "web-x1", vec![pods.ready("a")]));
    let (_, source) = web_service(&gateway, cluster.source(json!({}))).await;
    let settled = wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    wait_until("a watch is open", WAIT, || async {
        cluster.fake.open_watches() == 1
    })
    .await;
    let requests = cluster.fake.requests();
    let (reconciles, _) = applied(&gateway, source);

    // Bookmarks flow on the open watch (the API server sends one about every minute); slices of
    // other Services change. Neither costs a request or a reconcile.
    cluster
        .fake
        .set_bookmark_interval(Some(Duration::from_millis(100)));
    let other = Slice::new(NAMESPACE, "db-x1", "db")
        .port(None, 5432)
        .endpoint(Ep::new(&["10.9.9.9"]));
    cluster.fake.apply(other);
    // A counting window, not a wait for something to settle: the cost of idling is measured.
    let window = Instant::now();
    wait_until("a 1.5 s window of bookmarks", WAIT, || async {
        window.elapsed() > Duration::from_millis(1_500)
    })
    .await;
    wait_watch_idle(&gateway, source).await;
    assert_eq!(
        cluster.fake.requests(),
        requests,
        "no new request while idle"
    );
    assert_eq!(applied(&gateway, source).0, reconciles, "no reconcile");
    let now = gateway.source_status(source).await;
    assert_eq!(now.last_refresh_at, settled.last_refresh_at, "{now}");

    // Three slices change at once: read as one set (a second read at most).
    cluster.fake.set_bookmark_interval(None);
    cluster.fake.apply(slice(
        &pods,
        "web-x1",
        vec![pods.ready("a"), pods.ready("b")],
    ));
    cluster
        .fake
        .apply(slice(&pods, "web-x2", vec![pods.ready("c")]));
    cluster
        .fake
        .apply(slice(&pods, "web-x3", vec![pods.ready("d")]));
    wait_status(&gateway, source, "four active", |s| s.endpoints.active == 4).await;
    let reconciled = applied(&gateway, source).0 - reconciles;
    assert!(reconciled <= 2, "{reconciled} reconciles for a burst of 3");
    assert_eq!(
        cluster.fake.requests(),
        requests,
        "the burst came on the open watch"
    );
}

// ---------------------------------------------------------------------------------------------
// Failures
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_outage_is_failing_then_stale_then_back() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["a"]).await;
    cluster
        .fake
        .apply(slice(&pods, "web-x1", vec![pods.ready("a")]));
    let mut body = cluster.source(json!({}));
    body["stale_after_ms"] = json!(2_500);
    let (_, source) = web_service(&gateway, body).await;
    wait_serving_only(&gateway, &["a"], 1, WAIT).await;

    cluster.fake.stop();
    let status = wait_status(&gateway, source, "failing", |s| s.state == "failing").await;
    // Whichever watch notices first: the slices' or the Service's.
    let error = status.error();
    assert!(
        error.contains(&format!(
            "{}/apis/discovery.k8s.io/v1/namespaces/shop/endpointslices?labelSelector=kubernetes.io/service-name=web",
            cluster.fake.url()
        )) || error.contains(&format!(
            "{}/api/v1/namespaces/shop/services",
            cluster.fake.url()
        )),
        "{status}"
    );
    assert_eq!(status.watch_connected(), Some(false), "{status}");
    // Failing: the last known good set keeps serving.
    wait_serving_only(&gateway, &["a"], 3, WAIT).await;
    let status = wait_status(&gateway, source, "stale", |s| s.state == "stale").await;
    assert_eq!(status.endpoints.stale, 1, "{status}");

    cluster.fake.restart().await;
    let status = gateway
        .wait_source_status(source, "healthy", 2 * WAIT, |s| s.state == "healthy")
        .await;
    assert_eq!(status.endpoints.active, 1, "{status}");
    wait_serving_only(&gateway, &["a"], 3, WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_that_stops_answering_is_failing_within_the_wait() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["a"]).await;
    cluster
        .fake
        .apply(slice(&pods, "web-x1", vec![pods.ready("a")]));
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    gateway.route_all_to(service).await;
    let path = format!("/api/v1/services/{service}/discovery-sources");
    let mut watching = cluster.source(json!({"wait_ms": 1_000, "timeout_ms": 500}));
    watching["name"] = json!("watching");
    let watching = gateway.create(&path, watching).await;
    wait_status(&gateway, watching, "healthy", |s| s.state == "healthy").await;
    wait_until("a watch is open", WAIT, || async {
        cluster.fake.open_watches() == 1
    })
    .await;

    // The API server accepts connections and reads requests but answers nothing.
    cluster.fake.hang(true);
    let hung = Instant::now();
    // A new source: failing within timeout_ms.
    let mut listing = cluster.source(json!({"timeout_ms": 500}));
    listing["name"] = json!("listing");
    let listing = gateway.create(&path, listing).await;
    // Its first request, the get of the Service, is failing within timeout_ms.
    let status = wait_status(&gateway, listing, "failing", |s| s.state == "failing").await;
    assert_eq!(
        status.error(),
        format!(
            "registry {}/api/v1/namespaces/shop/services/web could not be fetched: no answer \
             within 500 ms (timeout_ms)",
            cluster.fake.url()
        ),
        "{status}"
    );
    // The open watch goes silent: within wait_ms + 5 s (kube-rs's margin) + timeout_ms and a
    // second's spacing, it is failing too, and the last set keeps serving.
    let status = gateway
        .wait_source_status(watching, "failing", 2 * WAIT, |s| s.state == "failing")
        .await;
    assert!(hung.elapsed() < Duration::from_millis(1_000 + 5_000 + 500 + 1_000 + 1_500));
    assert_eq!(status.watch_connected(), Some(false), "{status}");
    assert!(
        status.last_error.as_deref().unwrap_or_default().contains(
            "(watch) could not be fetched: the watch request got no answer within 500 ms"
        ),
        "{status}"
    );
    wait_serving_only(&gateway, &["a"], 3, WAIT).await;

    cluster.fake.hang(false);
    for source in [watching, listing] {
        gateway
            .wait_source_status(source, "healthy", 2 * WAIT, |s| s.state == "healthy")
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_cut_at_once_are_asked_again_at_most_once_a_second() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["a"]).await;
    cluster
        .fake
        .apply(slice(&pods, "web-x1", vec![pods.ready("a")]));
    // A proxy in front of the API server that ends every watch at once.
    cluster
        .fake
        .set_max_watch_timeout(Some(Duration::from_millis(1)));
    let (_, source) = web_service(&gateway, cluster.source(json!({}))).await;
    wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    let watches = cluster.fake.watches();
    let lists = cluster.fake.lists();
    // A counting window: the rate of requests is what is measured.
    let window = Instant::now();
    wait_until("a 3 s window", WAIT, || async {
        window.elapsed() > Duration::from_secs(3)
    })
    .await;
    let made = cluster.fake.watches() - watches;
    eprintln!(
        "watches cut at once: {made} watch requests in {:?}",
        window.elapsed()
    );
    assert!((2..=4).contains(&made), "{made} watch requests in 3 s");
    assert_eq!(cluster.fake.lists(), lists, "each resumes without a list");
    let status = gateway.source_status(source).await;
    assert_eq!(status.state, "healthy", "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_and_token_refusals_are_failed_refreshes_that_keep_the_last_set() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["a"]).await;
    cluster
        .fake
        .apply(slice(&pods, "web-x1", vec![pods.ready("a")]));
    let (_, source) = web_service(&gateway, cluster.source(json!({}))).await;
    wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;

    // The Role binding is removed: a full read (an operator's refresh) is forbidden.
    cluster.fake.forbid(Some(NAMESPACE));
    let (code, body) = gateway
        .api(
            "POST",
            &format!("/api/v1/discovery-sources/{source}/refresh"),
            None,
        )
        .await;
    assert_eq!(code, StatusCode::ACCEPTED, "{body}");
    let status = wait_status(&gateway, source, "failing", |s| s.state == "failing").await;
    let error = status.last_error.as_deref().unwrap_or_default();
    assert!(
        error.contains("answered HTTP 403: endpointslices.discovery.k8s.io is forbidden")
            && error.contains("cannot list resource \"endpointslices\""),
        "{status}"
    );
    wait_serving_only(&gateway, &["a"], 3, WAIT).await;
    cluster.fake.forbid(None);
    wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;

    // The token is refused.
    cluster.fake.require_token(Some("another"));
    cluster.fake.close_watches();
    let status = wait_status(&gateway, source, "failing on 401", |s| s.state == "failing").await;
    let error = status.last_error.as_deref().unwrap_or_default();
    assert!(
        error.contains(
            "answered HTTP 401: Unauthorized (the API server did not accept the bearer token)"
        ),
        "{status}"
    );
    assert!(!error.contains(TOKEN), "{status}");
    wait_serving_only(&gateway, &["a"], 3, WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_over_https_is_verified_against_ca_file() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::with(KubeFake::start_tls().await);
    let pods = Pods::start(&["a"]).await;
    cluster
        .fake
        .apply(slice(&pods, "web-x1", vec![pods.ready("a")]));
    let ca_file = cluster.token_dir.path().join("ca.crt");
    std::fs::write(
        &ca_file,
        cluster.fake.ca_pem.clone().expect("a certificate"),
    )
    .unwrap();
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    gateway.route_all_to(service).await;
    let path = format!("/api/v1/services/{service}/discovery-sources");
    let mut sources = Vec::new();
    for (name, extra) in [
        ("trusted", json!({"ca_file": ca_file.display().to_string()})),
        ("untrusted", json!({})),
        ("unverified", json!({"tls_verify": false})),
        ("no-ca", json!({"ca_file": "/nonexistent/ca.crt"})),
    ] {
        let mut body = cluster.source(extra);
        body["name"] = json!(name);
        sources.push(gateway.create(&path, body).await);
    }
    let trusted = wait_status(&gateway, sources[0], "healthy", |s| s.state == "healthy").await;
    assert_eq!(trusted.watch_connected(), Some(true), "{trusted}");
    let untrusted = wait_status(&gateway, sources[1], "failing", |s| s.state == "failing").await;
    let error = untrusted.last_error.as_deref().unwrap_or_default();
    assert!(
        error.contains(&cluster.fake.url()) && error.to_lowercase().contains("certificate"),
        "{untrusted}"
    );
    wait_status(&gateway, sources[2], "healthy", |s| s.state == "healthy").await;
    let no_ca = wait_status(&gateway, sources[3], "failing", |s| s.state == "failing").await;
    assert_eq!(
        no_ca.error(),
        "cannot use the CA file /nonexistent/ca.crt: No such file or directory (os error 2)",
        "{no_ca}"
    );
    wait_serving_only(&gateway, &["a"], 3, WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_kubernetes_configs_are_refused_by_field() {
    let gateway = TestGateway::start().await;
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    let path = format!("/api/v1/services/{service}/discovery-sources");
    for (config, field) in [
        (json!({}), "config.service"),
        (json!({"service": "Web_1"}), "config.service"),
        (
            json!({"service": "web", "namespace": "Shop"}),
            "config.namespace",
        ),
        (json!({"service": "web", "port": 70000}), "config.port"),
        (json!({"service": "web", "port": "HTTP"}), "config.port"),
        (
            json!({"service": "web", "api_server": "not a url"}),
            "config.api_server",
        ),
        (
            json!({"service": "web", "label_selector": "a=b"}),
            "config.label_selector",
        ),
    ] {
        let (code, body) = gateway
            .api(
                "POST",
                &path,
                Some(json!({"name": "k8s", "provider": "kubernetes", "config": config})),
            )
            .await;
        assert_eq!(code, StatusCode::UNPROCESSABLE_ENTITY, "{config}: {body}");
        assert_eq!(
            ApiError::read(&body).field.as_deref(),
            Some(field),
            "{config}: {body}"
        );
    }
    let (code, providers) = gateway
        .api("GET", "/api/v1/discovery/providers", None)
        .await;
    assert_eq!(code, StatusCode::OK);
    let kubernetes = providers
        .as_array()
        .or_else(|| providers["items"].as_array())
        .expect("a list")
        .iter()
        .find(|provider| provider["name"] == "kubernetes")
        .cloned()
        .expect("kubernetes is listed");
    assert_eq!(kubernetes["kind"], "watch", "{kubernetes}");
    assert_eq!(kubernetes["defaults"]["tls_verify"], true, "{kubernetes}");
    assert!(
        kubernetes["config_schema"]["required"]
            .as_array()
            .is_some_and(|required| required.contains(&json!("service"))),
        "{kubernetes}"
    );
}

// ---------------------------------------------------------------------------------------------
// Measured: slice change → data path
// ---------------------------------------------------------------------------------------------

/// Prints the median and the worst delay from a slice change to the first request served by the
/// new pod; each change comes on an idle watch, so each is read on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slice_changes_reach_the_data_path_fast() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let names = ["p0", "p1", "p2", "p3", "p4", "p5"];
    let pods = Pods::start(&names).await;
    cluster
        .fake
        .apply(slice(&pods, "web-x1", vec![pods.ready("p0")]));
    let (_, source) = web_service(&gateway, cluster.source(json!({}))).await;
    wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    let mut delays = Vec::new();
    for count in 2..=names.len() {
        wait_watch_idle(&gateway, source).await;
        let ready: Vec<Ep> = names[..count].iter().map(|name| pods.ready(name)).collect();
        let changed = Instant::now();
        cluster.fake.apply(slice(&pods, "web-x1", ready));
        wait_served(&gateway, names[count - 1], PROPAGATION).await;
        delays.push(changed.elapsed());
    }
    delays.sort();
    eprintln!(
        "kubernetes slice change to data path: median {:?}, worst {:?} over {} changes",
        delays[delays.len() / 2],
        delays[delays.len() - 1],
        delays.len()
    );
    assert!(
        delays.iter().all(|delay| *delay < PROPAGATION),
        "{delays:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubeconfig_gives_the_server_the_credentials_and_the_namespace() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["a"]).await;
    cluster
        .fake
        .apply(slice(&pods, "web-x1", vec![pods.ready("a")]));
    let kubeconfig = cluster.token_dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n\
             clusters:\n- name: fake\n  cluster:\n    server: {}\n\
             users:\n- name: gateway\n  user:\n    token: {TOKEN}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: gateway\n    namespace: {NAMESPACE}\n",
            cluster.fake.url()
        ),
    )
    .unwrap();
    let source = json!({
        "name": "k8s",
        "provider": "kubernetes",
        "config": {"service": "web", "kubeconfig": kubeconfig.display().to_string()},
    });
    let (_, source) = web_service(&gateway, source).await;
    wait_serving_only(&gateway, &["a"], 1, WAIT).await;
    let status = wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    assert_eq!(status.endpoints.active, 1, "{status}");
    assert_eq!(cluster.fake.last_token().as_deref(), Some(TOKEN));

    // A server named by hand without token_file gets no token (not even a pod's own).
    let bare = KubeFake::start().await;
    bare.apply_service(web_service_object());
    bare.apply(slice(&pods, "web-x1", vec![pods.ready("a")]));
    let by_hand = json!({
        "name": "by-hand", "provider": "kubernetes",
        "config": {"service": "web", "namespace": NAMESPACE, "api_server": bare.url()},
    });
    let service = gateway
        .create("/api/v1/services", json!({"name": "web-2"}))
        .await;
    let by_hand = gateway
        .create(
            &format!("/api/v1/services/{service}/discovery-sources"),
            by_hand,
        )
        .await;
    wait_status(&gateway, by_hand, "healthy", |s| s.state == "healthy").await;
    assert!(bare.requests() >= 1);
    assert_eq!(bare.last_authorization(), None);

    // A kubeconfig that is not there: a failed refresh naming it.
    let (code, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/discovery-sources/{source}"),
            Some(json!({"config": {"kubeconfig": "/nonexistent/kubeconfig"}})),
        )
        .await;
    assert_eq!(code, StatusCode::OK, "{body}");
    let status = wait_status(&gateway, source, "failing", |s| s.state == "failing").await;
    let error = status.last_error.as_deref().unwrap_or_default();
    assert!(
        error.starts_with("cannot use the kubeconfig /nonexistent/kubeconfig:"),
        "{status}"
    );
    wait_serving_only(&gateway, &["a"], 3, WAIT).await;
}

// ---------------------------------------------------------------------------------------------
// The Service object: ports, existence, permission
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_port_number_maps_to_the_pods_port_and_follows_service_edits() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["a"]).await;
    // Port 80 "http" → the pods' port, 81 "alt" → 9 (nothing listens there).
    let web = |http: u16, alt: u16| {
        Svc::new(NAMESPACE, "web")
            .port(Some("http"), http, Some(TargetPort::Number(pods.port)))
            .port(Some("alt"), alt, Some(TargetPort::Number(9)))
    };
    cluster.fake.apply_service(web(80, 81));
    cluster.fake.apply(
        Slice::new(NAMESPACE, "web-x1", "web")
            .port(Some("http"), pods.port)
            .port(Some("alt"), 9)
            .endpoint(pods.ready("a")),
    );
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    gateway.route_all_to(service).await;
    let path = format!("/api/v1/services/{service}/discovery-sources");
    let mut by_service_port = cluster.source(json!({"port": 80}));
    by_service_port["name"] = json!("by-service-port");
    // The re-mapped set replaces the only target: not a sudden loss to hold.
    by_service_port["removal_guard"] = Value::Null;
    let source = gateway.create(&path, by_service_port).await;
    // A config written when the number meant the endpoints' port is refused, saying what to set.
    let mut by_target_port = cluster.source(json!({"port": pods.port}));
    by_target_port["name"] = json!("by-target-port");
    let old_style = gateway.create(&path, by_target_port).await;

    wait_serving_only(&gateway, &["a"], 3, WAIT).await;
    let status = wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    assert_eq!(status.endpoints.active, 1, "{status}");
    let targets = source_targets(&gateway, service).await;
    assert!(targets.contains_key(&pods.key("a")), "{:?}", targets.keys());
    let refused = wait_status(&gateway, old_style, "failing", |s| s.state == "failing").await;
    assert_eq!(
        refused.error(),
        format!(
            "registry {}/api/v1/namespaces/shop/services/web: spec.ports: Service shop/web has \
             no port {port} (its ports: 80 \"http\" → {port}/TCP, 81 \"alt\" → 9/TCP); {port} is \
             the target port of Service port 80: \"port\" is the Service's port, set 80 or \"http\"",
            cluster.fake.url(),
            port = pods.port
        ),
        "{refused}"
    );

    // The Service is edited (the slices are not): port 80 is now "alt", so the endpoints'
    // port is 9, and pod a's target on the pods' port drains.
    wait_watch_idle(&gateway, source).await;
    cluster.fake.apply_service(web(82, 80));
    let moved = format!("{}:9", pods.ip("a"));
    let status = wait_status(&gateway, source, "re-mapped to port 9", |s| {
        s.endpoints.active == 1 && s.endpoints.draining == 1
    })
    .await;
    assert_eq!(status.state, "healthy", "{status}");
    let targets = source_targets(&gateway, service).await;
    assert_eq!(targets[&moved].state, "active", "{targets:?}");
    assert_eq!(targets[&pods.key("a")].state, "draining", "{targets:?}");

    // Edited back: served on the pods' port again.
    wait_watch_idle(&gateway, source).await;
    cluster.fake.apply_service(web(80, 81));
    wait_until("back on the pods' port", WAIT, || async {
        let targets = source_targets(&gateway, service).await;
        targets
            .get(&pods.key("a"))
            .is_some_and(|target| target.state == "active")
    })
    .await;
    wait_serving_only(&gateway, &["a"], 3, WAIT).await;
    assert!(cluster.fake.service_watches() >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_service_is_a_failed_refresh_until_it_exists() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["a"]).await;
    cluster.fake.delete_service(NAMESPACE, "web");
    // Slices without their Service (a Service deleted, its slices not yet collected).
    cluster
        .fake
        .apply(slice(&pods, "web-x1", vec![pods.ready("a")]));
    let (_, source) = web_service(&gateway, cluster.source(json!({}))).await;
    let status = wait_status(&gateway, source, "failing", |s| s.state == "failing").await;
    assert_eq!(
        status.error(),
        format!(
            "no Service shop/web: {}/api/v1/namespaces/shop/services/web answered HTTP 404",
            cluster.fake.url()
        ),
        "{status}"
    );
    assert_eq!(status.endpoints.active, 0, "{status}");
    assert_eq!(
        cluster.fake.lists(),
        0,
        "the slices are not read without the Service"
    );

    cluster.fake.apply_service(web_service_object());
    let status = gateway
        .wait_source_status(source, "healthy", 2 * WAIT, |s| s.state == "healthy")
        .await;
    assert_eq!(status.endpoints.active, 1, "{status}");
    wait_serving_only(&gateway, &["a"], 1, WAIT).await;

    // Deleted while followed: failing, and the last set keeps serving (nothing drains).
    let (_, failures) = applied(&gateway, source);
    cluster.fake.delete_service(NAMESPACE, "web");
    let status = wait_status(&gateway, source, "failing", |s| s.state == "failing").await;
    assert_eq!(
        status.error(),
        "no Service shop/web: it was deleted",
        "{status}"
    );
    assert!(applied(&gateway, source).1 > failures);
    assert_eq!(status.endpoints.active, 1, "{status}");
    assert_eq!(status.endpoints.draining, 0, "{status}");
    wait_serving_only(&gateway, &["a"], 3, WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_permission_on_services_the_error_names_it() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["a"]).await;
    cluster
        .fake
        .apply(slice(&pods, "web-x1", vec![pods.ready("a")]));
    // A Role with only the EndpointSlice rules: the get is refused.
    cluster.fake.forbid_services(Some(NAMESPACE));
    let (_, source) = web_service(&gateway, cluster.source(json!({}))).await;
    let status = wait_status(&gateway, source, "failing", |s| s.state == "failing").await;
    assert_eq!(
        status.error(),
        format!(
            "registry {}/api/v1/namespaces/shop/services/web answered HTTP 403: services \"web\" \
             is forbidden: User \"system:serviceaccount:raahi:gateway\" cannot get resource \
             \"services\" in API group \"\" in the namespace \"shop\" (the gateway's account \
             needs `get` and `watch` on `services` (API group \"\"): see the README's RBAC)",
            cluster.fake.url()
        ),
        "{status}"
    );
    cluster.fake.forbid_services(None);
    gateway
        .wait_source_status(source, "healthy", 2 * WAIT, |s| s.state == "healthy")
        .await;
    wait_serving_only(&gateway, &["a"], 1, WAIT).await;
    wait_until("both watches are open", WAIT, || async {
        cluster.fake.open_watches() == 1 && cluster.fake.open_service_watches() == 1
    })
    .await;

    // `get` granted but not `watch`: the watch of the Service is refused when it is asked again.
    cluster.fake.forbid_services(Some(NAMESPACE));
    cluster.fake.close_watches();
    let status = wait_status(&gateway, source, "failing", |s| s.state == "failing").await;
    let error = status.error();
    assert!(
        error.contains(&format!(
            "{}/api/v1/namespaces/shop/services?fieldSelector=metadata.name=web (watch) answered \
             HTTP 403: services \"web\" is forbidden",
            cluster.fake.url()
        )) && error.contains("cannot watch resource \"services\"")
            && error.contains("needs `get` and `watch` on `services`"),
        "{status}"
    );
    wait_serving_only(&gateway, &["a"], 3, WAIT).await;
}

// ---------------------------------------------------------------------------------------------
// 410 Gone however it comes
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_as_a_watch_requests_status_relists_without_a_failure() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["a", "b"]).await;
    cluster
        .fake
        .apply(slice(&pods, "web-x1", vec![pods.ready("a")]));
    let (_, source) = web_service(&gateway, cluster.source(json!({}))).await;
    wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    wait_until("a watch is open", WAIT, || async {
        cluster.fake.open_watches() == 1
    })
    .await;
    let lists = cluster.fake.lists();
    let (_, failures) = applied(&gateway, source);
    // As in an_expired_watch_relists_without_a_failure, but the resumed watch request itself
    // is answered HTTP 410.
    cluster.fake.expire_watches_with_status(true);
    cluster
        .fake
        .apply(Slice::new(NAMESPACE, "db-x1", "db").port(None, 5432));
    cluster.fake.compact();
    cluster.fake.close_watches();
    cluster.fake.apply(slice(
        &pods,
        "web-x1",
        vec![pods.ready("a"), pods.ready("b")],
    ));
    wait_served(&gateway, "b", WAIT).await;
    assert!(cluster.fake.lists() > lists, "relisted");
    let status = gateway.source_status(source).await;
    assert_eq!(status.state, "healthy", "{status}");
    assert_eq!(status.last_error, None, "{status}");
    assert_eq!(status.endpoints.draining, 0, "{status}");
    assert_eq!(applied(&gateway, source).1, failures, "no failed refresh");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_on_a_continue_token_relists_without_a_failure() {
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["a"]).await;
    // More slices than kube-rs's page of 500: the list takes two pages.
    for index in 0..500 {
        cluster
            .fake
            .apply(Slice::new(NAMESPACE, &format!("web-e{index:03}"), "web").port(Some("http"), 1));
    }
    cluster
        .fake
        .apply(slice(&pods, "web-x1", vec![pods.ready("a")]));
    let (_, source) = web_service(&gateway, cluster.source(json!({}))).await;
    wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    let lists = cluster.fake.lists();
    assert_eq!(lists, 2, "two pages");
    let (_, failures) = applied(&gateway, source);

    // An operator's refresh reads everything again; etcd compacts between the two pages.
    cluster.fake.compact_before_next_continue();
    let (code, body) = gateway
        .api(
            "POST",
            &format!("/api/v1/discovery-sources/{source}/refresh"),
            None,
        )
        .await;
    assert_eq!(code, StatusCode::ACCEPTED, "{body}");
    wait_until("the list was read again whole", WAIT, || async {
        cluster.fake.lists() >= lists + 4
    })
    .await;
    let status = wait_status(&gateway, source, "watch connected", |s| {
        s.watch_connected() == Some(true) && s.endpoints.active == 1
    })
    .await;
    assert_eq!(status.state, "healthy", "{status}");
    assert_eq!(status.last_error, None, "{status}");
    assert_eq!(status.endpoints.draining, 0, "{status}");
    assert_eq!(applied(&gateway, source).1, failures, "no failed refresh");
    wait_serving_only(&gateway, &["a"], 3, WAIT).await;
}

// ---------------------------------------------------------------------------------------------
// An exec credential plugin
// ---------------------------------------------------------------------------------------------

/// Whether process `pid` still runs (a zombie waiting to be reaped does not).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let state = stat.rsplit_once(')')?.1.trim_start().chars().next()?;
            Some(state != 'Z' && state != 'X')
        })
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exec_plugin_that_hangs_is_stopped_after_timeout_ms() {
    use std::os::unix::fs::PermissionsExt;
    let gateway = TestGateway::start().await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["a"]).await;
    cluster
        .fake
        .apply(slice(&pods, "web-x1", vec![pods.ready("a")]));
    let dir = cluster.token_dir.path();
    let plugin = dir.join("plugin.sh");
    let pid_file = dir.join("plugin.pid");
    // A plugin waiting for a login that never comes.
    std::fs::write(
        &plugin,
        format!(
            "#!/bin/sh\necho $$ > {}\nexec sleep 30\n",
            pid_file.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n\
             clusters:\n- name: fake\n  cluster:\n    server: {}\n\
             users:\n- name: gateway\n  user:\n    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: {}\n      interactiveMode: Never\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: gateway\n    namespace: {NAMESPACE}\n",
            cluster.fake.url(),
            plugin.display()
        ),
    )
    .unwrap();
    let source = json!({
        "name": "k8s",
        "provider": "kubernetes",
        "config": {
            "service": "web",
            "kubeconfig": kubeconfig.display().to_string(),
            "timeout_ms": 500,
        },
    });
    let (_, source) = web_service(&gateway, source).await;
    let status = wait_status(&gateway, source, "failing", |s| s.state == "failing").await;
    assert_eq!(
        status.error(),
        format!(
            "the exec credential plugin {} did not finish within 500 ms (timeout_ms); it was \
             stopped",
            plugin.display()
        ),
        "{status}"
    );
    let pid: u32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    wait_until("the plugin is stopped", Duration::from_secs(3), || async {
        !running(pid)
    })
    .await;

    // The plugin answers now: its token reaches the API server.
    std::fs::write(
        &plugin,
        format!(
            "#!/bin/sh\necho '{{\"apiVersion\":\"client.authentication.k8s.io/v1\",\
             \"kind\":\"ExecCredential\",\"status\":{{\"token\":\"{TOKEN}\"}}}}'\n"
        ),
    )
    .unwrap();
    let status = gateway
        .wait_source_status(source, "healthy", 2 * WAIT, |s| s.state == "healthy")
        .await;
    assert_eq!(status.endpoints.active, 1, "{status}");
    assert_eq!(cluster.fake.last_token().as_deref(), Some(TOKEN));
    wait_serving_only(&gateway, &["a"], 1, WAIT).await;
}
