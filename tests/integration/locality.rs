//! Locality through real sockets (TRAFFIC.md §4): a gateway in zone `a` (`cluster.zone`) keeps a
//! `locality` service's requests on the upstreams labelled with its zone while enough of them are
//! healthy, spreads them over every zone once the zone falls below `min_available_percent`, and
//! takes them back when it recovers; Kubernetes EndpointSlice `hints.forZones` from the
//! Kubernetes fake decide the zone's set when every endpoint has them. The runtime view, the
//! metrics and the event stream say which split is in force and why.

use crate::common;
use crate::discovery_kubernetes::{slice, Cluster, Pods};
use crate::events::Stream;

use common::kubernetes::Ep;
use common::*;

use std::collections::HashMap;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(10);

/// A gateway in `zone` (through `RAAHI_CLUSTER_ZONE`, as an operator sets it), or in none.
async fn gateway_in(zone: Option<&str>) -> TestGateway {
    let dir = std::sync::Arc::new(tempfile::tempdir().expect("temp dir"));
    let overrides: Vec<(&str, &str)> = zone
        .map(|zone| ("RAAHI_CLUSTER_ZONE", zone))
        .into_iter()
        .collect();
    let config = test_config_with(dir.path(), &overrides);
    TestGateway::start_with(dir, config).await
}

/// A service `name` with `settings`, a catch-all route, and one operator target per upstream
/// with its metadata.
async fn service_of(
    gateway: &TestGateway,
    name: &str,
    settings: Value,
    targets: &[(&Upstream, Value)],
) -> i64 {
    let mut body = settings;
    body["name"] = json!(name);
    let service = gateway.create("/api/v1/services", body).await;
    for (upstream, metadata) in targets {
        let mut target = target(upstream, 100, 0);
        target["metadata"] = metadata.clone();
        gateway
            .create(&format!("/api/v1/services/{service}/targets"), target)
            .await;
    }
    gateway.route_all_to(service).await;
    service
}

async fn locality_of(gateway: &TestGateway, service: i64) -> Value {
    gateway
        .get_ok(&format!("/api/v1/services/{service}/runtime"))
        .await["locality"]
        .clone()
}

/// Waits until the runtime view shows `in_force` (and, when given, `available` of `total`).
async fn wait_split(
    gateway: &TestGateway,
    service: i64,
    in_force: &str,
    counts: Option<(u64, u64)>,
) -> Value {
    wait_until(&format!("locality {in_force} {counts:?}"), WAIT, || async {
        let view = locality_of(gateway, service).await;
        let counted = (
            view["available"].as_u64().unwrap(),
            view["total"].as_u64().unwrap(),
        );
        if view["in_force"] == in_force && counts.is_none_or(|counts| counts == counted) {
            Ok(view)
        } else {
            Err(view.to_string())
        }
    })
    .await
}

/// Answers by upstream name over `count` requests.
async fn answers(gateway: &TestGateway, count: usize) -> HashMap<String, usize> {
    spread(gateway, "/", count, 4).await
}

fn share_of(counts: &HashMap<String, usize>, prefix: &str) -> f64 {
    let total: usize = counts.values().sum();
    let of: usize = counts
        .iter()
        .filter(|(name, _)| name.starts_with(prefix))
        .map(|(_, n)| n)
        .sum();
    of as f64 / total as f64
}

/// The goal: no target of the zone above 1.25 × the mean load of the zone's targets.
fn assert_even_within_zone(counts: &HashMap<String, usize>, zone_targets: &[&str]) {
    let loads: Vec<usize> = zone_targets
        .iter()
        .map(|name| counts.get(*name).copied().unwrap_or(0))
        .collect();
    let mean = loads.iter().sum::<usize>() as f64 / loads.len() as f64;
    for (name, load) in zone_targets.iter().zip(&loads) {
        assert!(
            *load as f64 <= 1.25 * mean,
            "{name} took {load}, above 1.25 × the zone's mean {mean}: {counts:?}"
        );
    }
}

const CHECKS: &str = r#"{"path": "/health", "interval_ms": 100, "timeout_ms": 200,
    "healthy_threshold": 1, "unhealthy_threshold": 1}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_stay_in_zone_spill_over_below_the_threshold_and_come_back() {
    let gateway = gateway_in(Some("a")).await;
    let mut events = Stream::open(&gateway, "", None).await;
    let a1 = Upstream::start("a1").await;
    let a2 = Upstream::start("a2").await;
    let a3 = Upstream::start("a3").await;
    let b1 = Upstream::start("b1").await;
    let b2 = Upstream::start("b2").await;
    let b3 = Upstream::start("b3").await;
    let checks: Value = serde_json::from_str(CHECKS).unwrap();
    // The zone label as each registry carries it: top-level metadata (Kubernetes, the HTTP
    // registry), Consul's Service.Meta (`meta`), or `labels`.
    let service = service_of(
        &gateway,
        "zoned",
        json!({"locality": {"min_available_percent": 70}, "health_check": checks}),
        &[
            (&a1, json!({"zone": "a"})),
            (&a2, json!({"meta": {"zone": "a"}})),
            (&a3, json!({"labels": {"zone": "a"}})),
            (&b1, json!({"zone": "b"})),
            (&b2, json!({"zone": "b"})),
            (&b3, json!({})),
        ],
    )
    .await;

    let view = wait_split(&gateway, service, "zone_only", Some((3, 3))).await;
    assert_eq!(view["zone"], "a", "{view}");
    assert_eq!(view["basis"], "labels", "{view}");
    assert_eq!(view["min_available_percent"], 70, "{view}");
    assert_eq!(
        view["reason"],
        "3 of 3 targets in zone a available (100 % ≥ 70 %)"
    );
    let counts = answers(&gateway, 600).await;
    let in_zone = share_of(&counts, "a");
    assert!(in_zone >= 0.95, "in-zone share {in_zone}: {counts:?}");
    assert_even_within_zone(&counts, &["a1", "a2", "a3"]);
    let runtime = gateway
        .get_ok(&format!("/api/v1/services/{service}/runtime"))
        .await;
    let in_zone_flags: Vec<&Value> = runtime["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|target| &target["in_zone"])
        .collect();
    assert_eq!(
        in_zone_flags,
        [true, true, true, false, false, false]
            .map(Value::from)
            .iter()
            .collect::<Vec<_>>()
    );
    assert_eq!(
        gateway
            .metric(r#"raahi_locality_in_zone{service="zoned"}"#)
            .await,
        1
    );
    assert!(
        gateway
            .metric(r#"raahi_locality_picks_total{service="zoned",set="zone"}"#)
            .await
            >= 600
    );

    // One of three down: 66 % < 70 %, every zone takes requests.
    a1.stop_and_wait().await;
    let view = wait_split(&gateway, service, "all_zones", Some((2, 3))).await;
    assert_eq!(
        view["reason"],
        "2 of 3 targets in zone a available (66 % < 70 %)"
    );
    let event = events
        .until("the split moving to every zone", |event| {
            event.event == "locality"
                && event.data["from"] == "zone_only"
                && event.data["to"] == "all_zones"
        })
        .await;
    assert_eq!(event.data["service_id"], service, "{:?}", event.data);
    assert_eq!(event.data["from"], "zone_only");
    assert_eq!(event.data["zone"], "a");
    assert_eq!(event.data["available"], 2);
    assert_eq!(
        event.data["reason"],
        "2 of 3 targets in zone a available (66 % < 70 %)"
    );
    let counts = answers(&gateway, 500).await;
    assert_eq!(counts.get("a1"), None, "a1 is down: {counts:?}");
    let out_of_zone = share_of(&counts, "b");
    // Five available targets, three of them outside the zone: about 60 %.
    assert!(
        out_of_zone >= 0.45,
        "out-of-zone share {out_of_zone}: {counts:?}"
    );
    assert_eq!(
        gateway
            .metric(r#"raahi_locality_in_zone{service="zoned"}"#)
            .await,
        0
    );

    // Back: the zone takes every request again.
    let _a1 = Upstream::start_on("a1", a1.addr).await;
    wait_split(&gateway, service, "zone_only", Some((3, 3))).await;
    events
        .until("the split back to the zone", |event| {
            event.event == "locality"
                && event.data["from"] == "all_zones"
                && event.data["to"] == "zone_only"
        })
        .await;
    let counts = answers(&gateway, 300).await;
    assert_eq!(share_of(&counts, "a"), 1.0, "{counts:?}");
    assert!(counts.contains_key("a1"), "{counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zone_with_every_target_down_spills_over_at_once() {
    let gateway = gateway_in(Some("a")).await;
    let a1 = Upstream::start("a1").await;
    let b1 = Upstream::start("b1").await;
    let b2 = Upstream::start("b2").await;
    // No health checks: only passive ejection and connect retries see a1 go.
    let service = service_of(
        &gateway,
        "passive",
        json!({"locality": {"min_available_percent": 100}}),
        &[
            (&a1, json!({"zone": "a"})),
            (&b1, json!({"zone": "b"})),
            (&b2, json!({"zone": "b"})),
        ],
    )
    .await;
    wait_split(&gateway, service, "zone_only", Some((1, 1))).await;
    assert_eq!(answers(&gateway, 50).await.get("a1"), Some(&50));
    a1.stop_and_wait().await;
    // Every request is answered: a connect failure retries on another zone's target, and the
    // ejection it causes takes the zone below its threshold.
    let counts = answers(&gateway, 200).await;
    assert_eq!(counts.get("a1"), None, "{counts:?}");
    wait_split(&gateway, service, "all_zones", Some((0, 1))).await;
}

#[tokio::test]
async fn without_a_zone_or_without_locality_every_zone_is_alike() {
    let gateway = gateway_in(None).await;
    let a1 = Upstream::start("a1").await;
    let b1 = Upstream::start("b1").await;
    let service = service_of(
        &gateway,
        "zoneless",
        json!({"locality": {}}),
        &[(&a1, json!({"zone": "a"})), (&b1, json!({"zone": "b"}))],
    )
    .await;
    let view = locality_of(&gateway, service).await;
    assert_eq!(view["in_force"], "no_zone_configured", "{view}");
    assert_eq!(view["zone"], Value::Null);
    assert_eq!(view["min_available_percent"], 70, "the default");
    let counts = answers(&gateway, 100).await;
    assert_eq!((counts.get("a1"), counts.get("b1")), (Some(&50), Some(&50)));

    let zoned = gateway_in(Some("a")).await;
    let plain = service_of(
        &zoned,
        "plain",
        json!({}),
        &[(&a1, json!({"zone": "a"})), (&b1, json!({"zone": "b"}))],
    )
    .await;
    let view = locality_of(&zoned, plain).await;
    assert_eq!(view["in_force"], "no_locality", "{view}");
    assert_eq!(view["zone"], "a");
    let counts = answers(&zoned, 100).await;
    assert_eq!((counts.get("a1"), counts.get("b1")), (Some(&50), Some(&50)));
    assert!(!zoned
        .metrics_text()
        .await
        .contains(r#"raahi_locality_in_zone{service="plain"}"#));
}

#[tokio::test]
async fn locality_is_validated_stored_and_patched() {
    let gateway = gateway_in(Some("a")).await;
    for bad in [json!(101), json!(-1), json!("70"), json!(1.5)] {
        let (status, body) = gateway
            .api(
                "POST",
                "/api/v1/services",
                Some(json!({"name": "v", "locality": {"min_available_percent": bad}})),
            )
            .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{bad}: {body}");
        assert_eq!(
            body["error"]["field"], "locality.min_available_percent",
            "{bad}: {body}"
        );
    }
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/services",
            Some(json!({"name": "v", "locality": {"min_available": 70}})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    let service = gateway
        .create(
            "/api/v1/services",
            json!({"name": "v", "locality": {"min_available_percent": 0}}),
        )
        .await;
    let path = format!("/api/v1/services/{service}");
    assert_eq!(
        gateway.get_ok(&path).await["locality"],
        json!({"min_available_percent": 0})
    );
    let (status, body) = gateway
        .api(
            "PATCH",
            &path,
            Some(json!({"locality": {"min_available_percent": 90}})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["locality"], json!({"min_available_percent": 90}));
    let (_, body) = gateway
        .api("PATCH", &path, Some(json!({"locality": null})))
        .await;
    assert_eq!(body["locality"], Value::Null);
    assert_eq!(
        locality_of(&gateway, service).await["in_force"],
        "no_locality"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_slice_hints_decide_the_zone_when_every_endpoint_has_them() {
    let gateway = gateway_in(Some("zone-a")).await;
    let cluster = Cluster::start().await;
    let pods = Pods::start(&["a1", "a2", "b1", "b2"]).await;
    let pod = |name: &str, zone: &str| Ep::new(&[&pods.ip(name)]).pod(name).zone(zone);
    // The EndpointSlice controller lent zone-b's b1 to zone-a.
    let hinted = vec![
        pod("a1", "zone-a").for_zones(&["zone-a"]),
        pod("a2", "zone-a").for_zones(&["zone-a"]),
        pod("b1", "zone-b").for_zones(&["zone-a"]),
        pod("b2", "zone-b").for_zones(&["zone-b"]),
    ];
    cluster.fake.apply(slice(&pods, "web-1", hinted));
    let service = gateway
        .create(
            "/api/v1/services",
            json!({"name": "web", "locality": {"min_available_percent": 50}}),
        )
        .await;
    gateway.route_all_to(service).await;
    gateway
        .create(
            &format!("/api/v1/services/{service}/discovery-sources"),
            cluster.source(json!({})),
        )
        .await;

    let view = wait_split(&gateway, service, "zone_only", Some((3, 3))).await;
    assert_eq!(view["basis"], "hints", "{view}");
    let counts = answers(&gateway, 300).await;
    assert_eq!(
        counts.get("b2"),
        None,
        "b2 is hinted for zone-b: {counts:?}"
    );
    assert_even_within_zone(&counts, &["a1", "a2", "b1"]);
    assert!(
        counts.contains_key("b1"),
        "b1 is hinted for zone-a: {counts:?}"
    );

    // One endpoint without hints: kube-proxy ignores them all, the endpoints' zones decide.
    let partly = vec![
        pod("a1", "zone-a").for_zones(&["zone-a"]),
        pod("a2", "zone-a").for_zones(&["zone-a"]),
        pod("b1", "zone-b").for_zones(&["zone-a"]),
        pod("b2", "zone-b"),
    ];
    cluster.fake.apply(slice(&pods, "web-1", partly));
    let view = wait_until("the labels to decide", WAIT, || async {
        let view = locality_of(&gateway, service).await;
        if view["basis"] == "labels" && view["total"] == 2 {
            Ok(view)
        } else {
            Err(view.to_string())
        }
    })
    .await;
    assert_eq!(view["in_force"], "zone_only", "{view}");
    let counts = answers(&gateway, 200).await;
    assert_eq!(share_of(&counts, "a"), 1.0, "{counts:?}");
    assert_even_within_zone(&counts, &["a1", "a2"]);
}
