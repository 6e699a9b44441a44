//! Checks the Kubernetes API server fake (`common::kubernetes`) against the documented API
//! behaviour, with raw HTTP for the wire format and with kube-rs itself (the client the
//! `kubernetes` provider uses), so the provider's integration tests can trust it.

use crate::common;

use std::pin::Pin;
use std::time::Duration;

use common::kubernetes::{Ep, KubeFake, Slice, INITIAL_EVENTS_END, SERVICE_ACCOUNT};
use common::wait_until;
use futures_util::{Stream, StreamExt};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher;
use kube::Api;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(5);

fn slices(namespace: &str) -> String {
    format!("/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices")
}

const ALL_SLICES: &str = "/apis/discovery.k8s.io/v1/endpointslices";

/// A slice of service `web` with one ready endpoint, on a named port.
fn web(namespace: &str, name: &str, ip: &str) -> Slice {
    Slice::new(namespace, name, "web")
        .port(Some("http"), 8080)
        .endpoint(
            Ep::new(&[ip])
                .node("node-1")
                .zone("zone-a")
                .pod(&format!("{name}-pod")),
        )
}

struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: Value,
}

async fn get_as(fake: &KubeFake, path: &str, token: Option<&str>) -> Answer {
    let mut request = reqwest::Client::new().get(format!("{}{path}", fake.url()));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.expect("the fake answers");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let text = response.text().await.unwrap();
    let body = serde_json::from_str(&text).unwrap_or_else(|_| panic!("a JSON body: {text}"));
    Answer {
        status,
        headers,
        body,
    }
}

async fn get(fake: &KubeFake, path: &str) -> Answer {
    get_as(fake, path, None).await
}

/// The names of a list's items, in order.
fn names(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|item| item["metadata"]["name"].as_str().unwrap().to_owned())
        .collect()
}

/// A `Status` body with this code and reason; returns its message.
fn status_message(answer: &Answer, code: u16, reason: &str) -> String {
    assert_eq!(answer.status, code, "{}", answer.body);
    let body = &answer.body;
    assert_eq!(body["kind"], "Status", "{body}");
    assert_eq!(body["apiVersion"], "v1", "{body}");
    assert!(body["metadata"].is_object(), "{body}");
    assert_eq!(body["status"], "Failure", "{body}");
    assert_eq!(body["code"], code, "{body}");
    assert_eq!(body["reason"], reason, "{body}");
    body["message"].as_str().unwrap().to_owned()
}

enum Next {
    Event(Value),
    /// The chunked body ended cleanly.
    End,
    /// The connection broke mid-stream.
    Broken,
}

/// A raw watch stream: newline-delimited JSON events.
struct Watch {
    response: reqwest::Response,
    buffer: Vec<u8>,
}

impl Watch {
    async fn open(fake: &KubeFake, path: &str) -> Watch {
        let response = reqwest::Client::new()
            .get(format!("{}{path}", fake.url()))
            .send()
            .await
            .expect("the fake answers");
        assert_eq!(response.status().as_u16(), 200);
        assert_eq!(
            response.headers()["content-type"],
            "application/json",
            "watch content type"
        );
        assert_eq!(
            response.headers()["transfer-encoding"],
            "chunked",
            "a watch is chunked"
        );
        Watch {
            response,
            buffer: Vec::new(),
        }
    }

    async fn next_within(&mut self, within: Duration) -> Option<Next> {
        let end = tokio::time::Instant::now() + within;
        loop {
            if let Some(at) = self.buffer.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buffer.drain(..=at).collect();
                let event = serde_json::from_slice(&line).expect("each line is one JSON event");
                return Some(Next::Event(event));
            }
            match tokio::time::timeout_at(end, self.response.chunk()).await {
                Err(_) => return None,
                Ok(Ok(Some(chunk))) => self.buffer.extend_from_slice(&chunk),
                Ok(Ok(None)) => {
                    assert!(self.buffer.is_empty(), "a partial line at the end");
                    return Some(Next::End);
                }
                Ok(Err(_)) => return Some(Next::Broken),
            }
        }
    }

    /// The next event, which must come within 5 s.
    async fn event(&mut self) -> Value {
        match self.next_within(WAIT).await {
            Some(Next::Event(event)) => event,
            Some(Next::End) => panic!("the watch ended instead of sending an event"),
            Some(Next::Broken) => panic!("the watch broke instead of sending an event"),
            None => panic!("no watch event within {WAIT:?}"),
        }
    }

    /// The stream must end cleanly within `within`.
    async fn ends(&mut self, within: Duration) {
        match self.next_within(within).await {
            Some(Next::End) => {}
            Some(Next::Event(event)) => panic!("an event instead of the end: {event}"),
            Some(Next::Broken) => panic!("the watch broke instead of ending cleanly"),
            None => panic!("the watch did not end within {within:?}"),
        }
    }
}

fn rv_of(object: &Value) -> u64 {
    object["metadata"]["resourceVersion"]
        .as_str()
        .expect("a resourceVersion string")
        .parse()
        .unwrap()
}

fn assert_event(event: &Value, kind: &str, name: &str) {
    assert_eq!(event["type"], kind, "{event}");
    assert_eq!(event["object"]["metadata"]["name"], name, "{event}");
    assert_eq!(event["object"]["kind"], "EndpointSlice", "{event}");
    assert_eq!(
        event["object"]["apiVersion"], "discovery.k8s.io/v1",
        "{event}"
    );
}

#[tokio::test]
async fn a_list_has_the_real_shape_and_the_current_resource_version() {
    let fake = KubeFake::start().await;
    fake.apply(web("shop", "web-b", "10.0.0.2"));
    fake.apply(web("shop", "web-a", "10.0.0.1"));
    fake.apply(
        Slice::new("shop", "web-v6", "web")
            .address_type("IPv6")
            .port(None, 80)
            .endpoint(
                Ep::new(&["fd00::1"])
                    .ready(Some(false))
                    .serving(None)
                    .terminating(Some(true))
                    .hostname("h1"),
            ),
    );
    fake.apply(web("other", "web-c", "10.0.0.3"));

    let answer = get(&fake, &slices("shop")).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.headers["content-type"], "application/json");
    let list = &answer.body;
    assert_eq!(list["kind"], "EndpointSliceList");
    assert_eq!(list["apiVersion"], "discovery.k8s.io/v1");
    assert_eq!(
        list["metadata"],
        json!({"resourceVersion": fake.resource_version().to_string()}),
        "no continue on a complete list"
    );
    assert_eq!(names(list), ["web-a", "web-b", "web-v6"], "etcd key order");
    let item = &list["items"][0];
    assert!(
        item.get("kind").is_none() && item.get("apiVersion").is_none(),
        "list items carry no kind/apiVersion: {item}"
    );
    let metadata = &item["metadata"];
    assert_eq!(metadata["namespace"], "shop");
    assert_eq!(metadata["generation"], 1);
    assert!(metadata["uid"].as_str().unwrap().len() == 36, "{metadata}");
    assert!(metadata["creationTimestamp"]
        .as_str()
        .unwrap()
        .ends_with('Z'));
    assert_eq!(
        metadata["labels"],
        json!({
            "kubernetes.io/service-name": "web",
            "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
        })
    );
    assert_eq!(item["addressType"], "IPv4");
    assert_eq!(
        item["endpoints"],
        json!([{
            "addresses": ["10.0.0.1"],
            "conditions": {"ready": true, "serving": true, "terminating": false},
            "targetRef": {"kind": "Pod", "namespace": "shop", "name": "web-a-pod"},
            "nodeName": "node-1",
            "zone": "zone-a",
        }])
    );
    assert_eq!(
        item["ports"],
        json!([{"name": "http", "protocol": "TCP", "port": 8080}])
    );
    let v6 = &list["items"][2];
    assert_eq!(v6["addressType"], "IPv6");
    assert_eq!(
        v6["endpoints"][0]["conditions"],
        json!({"ready": false, "terminating": true})
    );
    assert_eq!(v6["endpoints"][0]["hostname"], "h1");
    assert_eq!(
        v6["ports"],
        json!([{"name": "", "protocol": "TCP", "port": 80}])
    );
    // Versions of items are those of their last write, below the list's.
    let rvs: Vec<u64> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(rv_of)
        .collect();
    assert_eq!(rvs, [3, 2, 4]);

    let all = get(&fake, ALL_SLICES).await.body;
    assert_eq!(names(&all), ["web-c", "web-a", "web-b", "web-v6"]);

    // An empty slice: endpoints and ports are null, as Go serializes nil slices.
    fake.apply(Slice::new("empty", "placeholder", "none"));
    let empty = get(&fake, &slices("empty")).await.body;
    assert_eq!(empty["items"][0]["endpoints"], Value::Null);
    assert_eq!(empty["items"][0]["ports"], Value::Null);
    assert_eq!(
        get(&fake, &slices("nothing")).await.body["items"],
        json!([])
    );

    // kube-rs parses it into k8s-openapi types.
    let parsed: kube::core::ObjectList<EndpointSlice> = serde_json::from_value(all).unwrap();
    assert_eq!(parsed.items.len(), 4);
    assert_eq!(parsed.items[1].endpoints[0].addresses, ["10.0.0.1"]);
    let parsed: kube::core::ObjectList<EndpointSlice> = serde_json::from_value(empty).unwrap();
    assert!(parsed.items[0].endpoints.is_empty());

    // A get of one object carries kind/apiVersion; a missing one is a NotFound Status.
    let one = get(&fake, &format!("{}/web-a", slices("shop"))).await;
    assert_eq!(one.status, 200);
    assert_eq!(one.body["kind"], "EndpointSlice");
    let missing = get(&fake, &format!("{}/nope", slices("shop"))).await;
    assert_eq!(
        status_message(&missing, 404, "NotFound"),
        "endpointslices.discovery.k8s.io \"nope\" not found"
    );
}

#[tokio::test]
async fn updates_keep_uid_and_bump_resource_version_and_generation_as_the_registry_does() {
    let fake = KubeFake::start().await;
    let first = fake.apply(web("shop", "web-a", "10.0.0.1"));
    let created = fake.object("shop", "web-a").unwrap();
    assert_eq!(rv_of(&created), first);

    let second = fake.apply(web("shop", "web-a", "10.0.0.9"));
    assert!(second > first);
    let updated = fake.object("shop", "web-a").unwrap();
    assert_eq!(updated["metadata"]["uid"], created["metadata"]["uid"]);
    assert_eq!(
        updated["metadata"]["creationTimestamp"],
        created["metadata"]["creationTimestamp"]
    );
    assert_eq!(updated["metadata"]["generation"], 2);

    // The same content again writes nothing.
    assert_eq!(fake.apply(web("shop", "web-a", "10.0.0.9")), second);
    assert_eq!(fake.resource_version(), second);

    // A label change is a write, but not a new generation.
    let third = fake.apply(web("shop", "web-a", "10.0.0.9").label("team", "blue"));
    assert!(third > second);
    assert_eq!(
        fake.object("shop", "web-a").unwrap()["metadata"]["generation"],
        2
    );

    assert!(fake.delete("shop", "web-a"));
    assert!(!fake.delete("shop", "web-a"), "deleting nothing");
    assert_eq!(fake.resource_version(), third + 1);
    assert!(fake.object("shop", "web-a").is_none());
}

#[tokio::test]
async fn label_and_field_selectors_filter_and_bad_ones_are_400() {
    let fake = KubeFake::start().await;
    fake.apply(web("shop", "web-a", "10.0.0.1").label("team", "blue"));
    fake.apply(web("shop", "web-b", "10.0.0.2").label("tier", "3"));
    fake.apply(Slice::new("shop", "api-a", "api").label("team", "red"));

    let cases = [
        ("kubernetes.io/service-name=web", vec!["web-a", "web-b"]),
        ("kubernetes.io/service-name==web", vec!["web-a", "web-b"]),
        ("kubernetes.io/service-name!=web", vec!["api-a"]),
        ("team", vec!["api-a", "web-a"]),
        ("!team", vec!["web-b"]),
        ("team!=blue", vec!["api-a", "web-b"]),
        ("kubernetes.io/service-name=web,team=blue", vec!["web-a"]),
        ("team in (red, blue)", vec!["api-a", "web-a"]),
        ("team notin (red)", vec!["web-a", "web-b"]),
        ("tier>2", vec!["web-b"]),
        ("", vec!["api-a", "web-a", "web-b"]),
    ];
    for (selector, expected) in cases {
        let path = format!("{}?labelSelector={}", slices("shop"), urlencode(selector));
        let answer = get(&fake, &path).await;
        assert_eq!(answer.status, 200, "{selector}: {}", answer.body);
        assert_eq!(names(&answer.body), expected, "labelSelector {selector:?}");
    }

    let bad = [
        ("a=b=c", "found '=', expected: ',' or 'end of string'"),
        (
            "=x",
            "found '=', expected: !, identifier, or 'end of string'",
        ),
        ("a,", "found '', expected: identifier after ','"),
        (
            "a in b",
            "unable to parse requirement: found 'b', expected: '('",
        ),
        (
            "a@b=c",
            "unable to parse requirement: key: Invalid value: \"a@b\"",
        ),
    ];
    for (selector, message) in bad {
        let path = format!("{}?labelSelector={}", slices("shop"), urlencode(selector));
        let answer = get(&fake, &path).await;
        let got = status_message(&answer, 400, "BadRequest");
        assert!(got.starts_with(message), "{selector:?}: {got}");
    }

    let by_name = get(
        &fake,
        &format!("{}?fieldSelector=metadata.name%3Dweb-b", slices("shop")),
    )
    .await;
    assert_eq!(names(&by_name.body), ["web-b"]);
    let not_name = get(
        &fake,
        &format!("{}?fieldSelector=metadata.name!%3Dweb-b", slices("shop")),
    )
    .await;
    assert_eq!(names(&not_name.body), ["api-a", "web-a"]);
    let unsupported = get(
        &fake,
        &format!("{}?fieldSelector=spec.x%3Dy", slices("shop")),
    )
    .await;
    assert_eq!(
        status_message(&unsupported, 400, "BadRequest"),
        "field label not supported: spec.x"
    );
}

fn urlencode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            b' ' => "+".to_owned(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test]
async fn limit_and_continue_page_through_one_snapshot() {
    let fake = KubeFake::start().await;
    for name in ["s1", "s2", "s3", "s4", "s5"] {
        fake.apply(web("shop", name, "10.0.0.1"));
    }
    let snapshot = fake.resource_version();

    let first = get(&fake, &format!("{}?limit=2", slices("shop")))
        .await
        .body;
    assert_eq!(names(&first), ["s1", "s2"]);
    assert_eq!(first["metadata"]["resourceVersion"], snapshot.to_string());
    assert_eq!(first["metadata"]["remainingItemCount"], 3);
    let token = first["metadata"]["continue"].as_str().unwrap().to_owned();

    // Writes between pages do not show: the pages are one snapshot.
    fake.apply(web("shop", "s3", "10.9.9.9"));
    fake.delete("shop", "s4");
    fake.apply(web("shop", "s0", "10.0.0.1"));

    let second = get(
        &fake,
        &format!("{}?limit=2&continue={token}", slices("shop")),
    )
    .await
    .body;
    assert_eq!(names(&second), ["s3", "s4"]);
    assert_eq!(second["metadata"]["resourceVersion"], snapshot.to_string());
    assert_eq!(
        second["items"][0]["endpoints"][0]["addresses"],
        json!(["10.0.0.1"])
    );
    let token = second["metadata"]["continue"].as_str().unwrap().to_owned();
    let last = get(
        &fake,
        &format!("{}?limit=2&continue={token}", slices("shop")),
    )
    .await
    .body;
    assert_eq!(names(&last), ["s5"]);
    assert!(last["metadata"].get("continue").is_none(), "{last}");
    assert!(last["metadata"].get("remainingItemCount").is_none());

    // With a selector there is no remainingItemCount.
    let selected = get(
        &fake,
        &format!(
            "{}?limit=1&labelSelector=kubernetes.io%2Fservice-name%3Dweb",
            slices("shop")
        ),
    )
    .await
    .body;
    assert!(selected["metadata"]["continue"].is_string());
    assert!(selected["metadata"].get("remainingItemCount").is_none());

    // resourceVersion=0 is served from the watch cache, which ignores limit.
    let any = get(
        &fake,
        &format!("{}?limit=2&resourceVersion=0", slices("shop")),
    )
    .await
    .body;
    assert_eq!(names(&any), ["s0", "s1", "s2", "s3", "s5"]);
    assert!(any["metadata"].get("continue").is_none());

    // A continue with a resourceVersion is a bad request; a garbled token too.
    let both = get(
        &fake,
        &format!(
            "{}?limit=2&continue={token}&resourceVersion=5",
            slices("shop")
        ),
    )
    .await;
    assert_eq!(
        status_message(&both, 400, "BadRequest"),
        "specifying resource version is not allowed when using continue"
    );
    let garbled = get(&fake, &format!("{}?continue=%21%21", slices("shop"))).await;
    assert!(status_message(&garbled, 400, "BadRequest").starts_with("invalid continue token"));
}

#[tokio::test]
async fn exact_lists_and_continues_expire_with_410_after_compaction() {
    let fake = KubeFake::start().await;
    let old = fake.apply(web("shop", "web-a", "10.0.0.1"));
    fake.apply(web("shop", "web-b", "10.0.0.2"));
    fake.apply(web("shop", "web-a", "10.0.0.3"));

    // Exact reads the past.
    let exact = get(
        &fake,
        &format!(
            "{}?resourceVersion={old}&resourceVersionMatch=Exact",
            slices("shop")
        ),
    )
    .await
    .body;
    assert_eq!(exact["metadata"]["resourceVersion"], old.to_string());
    assert_eq!(names(&exact), ["web-a"]);
    assert_eq!(
        exact["items"][0]["endpoints"][0]["addresses"],
        json!(["10.0.0.1"])
    );
    // So does resourceVersion=N with a limit and no match (legacy Exact).
    let legacy = get(
        &fake,
        &format!("{}?resourceVersion={old}&limit=10", slices("shop")),
    )
    .await
    .body;
    assert_eq!(legacy["metadata"]["resourceVersion"], old.to_string());
    // Without a limit it is NotOlderThan: the current state.
    let newer = get(&fake, &format!("{}?resourceVersion={old}", slices("shop")))
        .await
        .body;
    assert_eq!(
        newer["metadata"]["resourceVersion"],
        fake.resource_version().to_string()
    );
    assert_eq!(names(&newer), ["web-a", "web-b"]);

    let page = get(&fake, &format!("{}?limit=1", slices("shop")))
        .await
        .body;
    let token = page["metadata"]["continue"].as_str().unwrap().to_owned();

    fake.apply(web("shop", "web-c", "10.0.0.4"));
    fake.compact();

    let gone = get(
        &fake,
        &format!(
            "{}?resourceVersion={old}&resourceVersionMatch=Exact",
            slices("shop")
        ),
    )
    .await;
    assert_eq!(
        status_message(&gone, 410, "Expired"),
        "The resourceVersion for the provided list is too old."
    );
    let expired = get(
        &fake,
        &format!("{}?limit=1&continue={token}", slices("shop")),
    )
    .await;
    assert!(status_message(&expired, 410, "Expired")
        .starts_with("The provided continue parameter is too old"));
    assert_eq!(gone.body["metadata"], json!({}));
    // ... with a token that goes on at the latest version (inconsistently).
    let latest = expired.body["metadata"]["continue"].as_str().unwrap();
    let rest = get(
        &fake,
        &format!("{}?limit=5&continue={latest}", slices("shop")),
    )
    .await
    .body;
    assert_eq!(names(&rest), ["web-b", "web-c"]);
    assert_eq!(
        rest["metadata"]["resourceVersion"],
        fake.resource_version().to_string()
    );
    // The current version is still Exact-readable.
    let now = fake.resource_version();
    let current = get(
        &fake,
        &format!(
            "{}?resourceVersion={now}&resourceVersionMatch=Exact",
            slices("shop")
        ),
    )
    .await;
    assert_eq!(current.status, 200);

    // Invalid combinations (ValidateListOptions): 422.
    for (query, message) in [
        (
            "resourceVersionMatch=NotOlderThan",
            "resourceVersionMatch is forbidden unless resourceVersion is provided",
        ),
        (
            "resourceVersion=0&resourceVersionMatch=Exact",
            "resourceVersionMatch \"exact\" is forbidden for resourceVersion \"0\"",
        ),
        (
            "resourceVersion=1&resourceVersionMatch=Newest",
            "Unsupported value: \"Newest\"",
        ),
    ] {
        let answer = get(&fake, &format!("{}?{query}", slices("shop"))).await;
        let got = status_message(&answer, 422, "Invalid");
        assert!(
            got.starts_with("ListOptions.meta.k8s.io \"\" is invalid: ") && got.contains(message),
            "{query}: {got}"
        );
    }
}

#[tokio::test]
async fn a_list_not_older_than_a_future_version_waits_for_it() {
    let fake = std::sync::Arc::new(KubeFake::start().await);
    let wanted = fake.resource_version() + 1;
    let path = format!(
        "{}?resourceVersion={wanted}&resourceVersionMatch=NotOlderThan",
        slices("shop")
    );
    let waiting = {
        let fake = fake.clone();
        tokio::spawn(async move { get(&fake, &path).await })
    };
    wait_until("the list has arrived", WAIT, || async { fake.lists() == 1 }).await;
    fake.apply(web("shop", "web-a", "10.0.0.1"));
    let answer = waiting.await.unwrap();
    assert_eq!(answer.status, 200);
    assert_eq!(
        answer.body["metadata"]["resourceVersion"],
        wanted.to_string()
    );
    assert_eq!(names(&answer.body), ["web-a"]);
}

#[tokio::test]
async fn a_watch_from_a_resource_version_replays_later_events_in_order_then_live_ones() {
    let fake = KubeFake::start().await;
    let from = fake.apply(web("shop", "web-a", "10.0.0.1"));
    fake.apply(web("shop", "web-b", "10.0.0.2"));
    fake.apply(web("other", "web-x", "10.0.0.2"));
    fake.apply(web("shop", "web-a", "10.0.0.3"));
    assert!(fake.delete("shop", "web-b"));

    let mut watch = Watch::open(
        &fake,
        &format!("{}?watch=true&resourceVersion={from}", slices("shop")),
    )
    .await;
    let added = watch.event().await;
    assert_event(&added, "ADDED", "web-b");
    let modified = watch.event().await;
    assert_event(&modified, "MODIFIED", "web-a");
    assert_eq!(
        modified["object"]["endpoints"][0]["addresses"],
        json!(["10.0.0.3"])
    );
    let deleted = watch.event().await;
    assert_event(&deleted, "DELETED", "web-b");
    assert_eq!(
        rv_of(&deleted["object"]),
        fake.resource_version(),
        "a deletion carries the deletion's resourceVersion"
    );
    assert_eq!(
        deleted["object"]["endpoints"][0]["addresses"],
        json!(["10.0.0.2"]),
        "... and the object's last content"
    );
    assert!(rv_of(&added["object"]) < rv_of(&modified["object"]));
    assert_eq!(fake.open_watches(), 1);

    fake.apply(web("other", "web-y", "10.0.0.2"));
    let live = fake.apply(web("shop", "web-c", "10.0.0.4"));
    let event = watch.event().await;
    assert_event(&event, "ADDED", "web-c");
    assert_eq!(rv_of(&event["object"]), live);

    // The all-namespaces watch sees every namespace.
    let mut all = Watch::open(
        &fake,
        &format!("{ALL_SLICES}?watch=1&resourceVersion={live}"),
    )
    .await;
    fake.apply(web("other", "web-z", "10.0.0.5"));
    assert_event(&all.event().await, "ADDED", "web-z");

    drop(watch);
    drop(all);
    wait_until("the dropped watches are closed", WAIT, || async {
        fake.open_watches() == 0
    })
    .await;
}

#[tokio::test]
async fn a_watch_from_zero_or_unset_starts_with_synthetic_added_events() {
    let fake = KubeFake::start().await;
    fake.apply(web("shop", "web-a", "10.0.0.1"));
    fake.apply(web("shop", "web-b", "10.0.0.2"));
    fake.apply(Slice::new("shop", "api-a", "api"));
    let current = fake.resource_version();

    for (from, ip) in [("&resourceVersion=0", "10.0.0.7"), ("", "10.0.0.8")] {
        let mut watch = Watch::open(
            &fake,
            &format!(
                "{}?watch=true{from}&labelSelector=kubernetes.io%2Fservice-name%3Dweb",
                slices("shop")
            ),
        )
        .await;
        assert_event(&watch.event().await, "ADDED", "web-a");
        assert_event(&watch.event().await, "ADDED", "web-b");
        // No bookmark was allowed: the next event is the next change.
        fake.apply(web("shop", "web-a", ip));
        assert_event(&watch.event().await, "MODIFIED", "web-a");
    }

    // With bookmarks allowed, the initial events end with an annotated bookmark.
    let mut watch = Watch::open(
        &fake,
        &format!(
            "{}?watch=true&resourceVersion=0&allowWatchBookmarks=true",
            slices("shop")
        ),
    )
    .await;
    assert_event(&watch.event().await, "ADDED", "api-a");
    assert_event(&watch.event().await, "ADDED", "web-a");
    assert_event(&watch.event().await, "ADDED", "web-b");
    let bookmark = watch.event().await;
    assert_eq!(bookmark["type"], "BOOKMARK");
    assert_eq!(
        bookmark["object"]["metadata"]["annotations"][INITIAL_EVENTS_END],
        "true"
    );
    assert!(rv_of(&bookmark["object"]) > current);

    // sendInitialEvents=false from 0 starts at the current version without them.
    let mut bare = Watch::open(
        &fake,
        &format!(
            "{}?watch=true&resourceVersion=0&sendInitialEvents=false&resourceVersionMatch=NotOlderThan",
            slices("shop")
        ),
    )
    .await;
    fake.apply(web("shop", "web-d", "10.0.0.8"));
    assert_event(&bare.event().await, "ADDED", "web-d");

    // sendInitialEvents without resourceVersionMatch=NotOlderThan is invalid.
    let invalid = get(
        &fake,
        &format!("{}?watch=true&sendInitialEvents=true", slices("shop")),
    )
    .await;
    assert!(status_message(&invalid, 422, "Invalid")
        .contains("sendInitialEvents requires setting resourceVersionMatch to NotOlderThan"));
}

#[tokio::test]
async fn a_selector_watch_sees_an_object_leave_as_deleted_and_return_as_added() {
    let fake = KubeFake::start().await;
    let from = fake.apply(web("shop", "web-a", "10.0.0.1"));
    let mut watch = Watch::open(
        &fake,
        &format!(
            "{}?watch=true&resourceVersion={from}&labelSelector=kubernetes.io%2Fservice-name%3Dweb",
            slices("shop")
        ),
    )
    .await;
    // Re-labelled to another service: the watcher sees it go.
    let moved =
        fake.apply(web("shop", "web-a", "10.0.0.1").label("kubernetes.io/service-name", "other"));
    let gone = watch.event().await;
    assert_event(&gone, "DELETED", "web-a");
    assert_eq!(rv_of(&gone["object"]), moved);
    assert_eq!(
        gone["object"]["metadata"]["labels"]["kubernetes.io/service-name"], "web",
        "the previous content"
    );
    fake.apply(web("shop", "web-a", "10.0.0.2"));
    let back = watch.event().await;
    assert_event(&back, "ADDED", "web-a");
    assert_eq!(
        back["object"]["endpoints"][0]["addresses"],
        json!(["10.0.0.2"])
    );
}

#[tokio::test]
async fn bookmarks_go_only_to_watches_that_allowed_them() {
    let fake = KubeFake::start().await;
    let from = fake.apply(web("shop", "web-a", "10.0.0.1"));
    let mut with = Watch::open(
        &fake,
        &format!(
            "{}?watch=true&resourceVersion={from}&allowWatchBookmarks=true",
            slices("shop")
        ),
    )
    .await;
    let mut without = Watch::open(
        &fake,
        &format!("{}?watch=true&resourceVersion={from}", slices("shop")),
    )
    .await;
    // A write elsewhere moves the version the bookmark carries.
    let elsewhere = fake.apply(web("other", "web-x", "10.0.0.1"));
    fake.send_bookmarks();
    let bookmark = with.event().await;
    assert_eq!(
        bookmark,
        json!({
            "type": "BOOKMARK",
            "object": {
                "kind": "EndpointSlice",
                "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": elsewhere.to_string()},
                "addressType": "",
                "endpoints": null,
                "ports": null,
            }
        })
    );
    // kube-rs reads it as a bookmark.
    let parsed: kube::core::WatchEvent<EndpointSlice> = serde_json::from_value(bookmark).unwrap();
    assert!(
        matches!(parsed, kube::core::WatchEvent::Bookmark(b) if b.metadata.resource_version == elsewhere.to_string())
    );

    fake.apply(web("shop", "web-b", "10.0.0.2"));
    assert_event(&without.event().await, "ADDED", "web-b");
    assert_event(&with.event().await, "ADDED", "web-b");

    // Periodic bookmarks when configured.
    fake.set_bookmark_interval(Some(Duration::from_millis(20)));
    for _ in 0..2 {
        assert_eq!(with.event().await["type"], "BOOKMARK");
    }
    fake.set_bookmark_interval(None);
    fake.apply(web("shop", "web-c", "10.0.0.3"));
    assert_event(&without.event().await, "ADDED", "web-c");
}

#[tokio::test]
async fn timeout_seconds_and_the_server_cap_end_the_stream_cleanly() {
    let fake = KubeFake::start().await;
    let from = fake.resource_version();
    let started = tokio::time::Instant::now();
    let mut watch = Watch::open(
        &fake,
        &format!(
            "{}?watch=true&resourceVersion={from}&timeoutSeconds=1",
            slices("shop")
        ),
    )
    .await;
    watch.ends(WAIT).await;
    assert!(started.elapsed() >= Duration::from_millis(900));

    fake.set_max_watch_timeout(Some(Duration::from_millis(100)));
    let mut capped = Watch::open(
        &fake,
        &format!(
            "{}?watch=true&resourceVersion={from}&timeoutSeconds=290",
            slices("shop")
        ),
    )
    .await;
    capped.ends(WAIT).await;
    fake.set_max_watch_timeout(None);

    // close_watches ends them cleanly too, after what was queued.
    let mut closed = Watch::open(
        &fake,
        &format!("{}?watch=true&resourceVersion={from}", slices("shop")),
    )
    .await;
    fake.apply(web("shop", "web-a", "10.0.0.1"));
    fake.close_watches();
    assert_event(&closed.event().await, "ADDED", "web-a");
    closed.ends(WAIT).await;
    wait_until("every watch is closed", WAIT, || async {
        fake.open_watches() == 0
    })
    .await;
    assert_eq!(fake.watches(), 3);
}

#[tokio::test]
async fn a_watch_from_a_compacted_version_gets_one_410_error_event() {
    let fake = KubeFake::start().await;
    let old = fake.apply(web("shop", "web-a", "10.0.0.1"));
    fake.apply(web("shop", "web-b", "10.0.0.2"));
    fake.compact();
    let current = fake.resource_version();

    let mut watch = Watch::open(
        &fake,
        &format!("{}?watch=true&resourceVersion={old}", slices("shop")),
    )
    .await;
    let error = watch.event().await;
    assert_eq!(
        error,
        json!({
            "type": "ERROR",
            "object": {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": format!("too old resource version: {old} ({current})"),
                "reason": "Expired",
                "code": 410,
            }
        })
    );
    watch.ends(WAIT).await;
    let parsed: kube::core::WatchEvent<EndpointSlice> = serde_json::from_value(error).unwrap();
    assert!(matches!(parsed, kube::core::WatchEvent::Error(status) if status.code == 410));

    // From the compaction point on it is fine.
    let mut fresh = Watch::open(
        &fake,
        &format!("{}?watch=true&resourceVersion={current}", slices("shop")),
    )
    .await;
    fake.apply(web("shop", "web-c", "10.0.0.3"));
    assert_event(&fresh.event().await, "ADDED", "web-c");
}

#[tokio::test]
async fn restart_with_new_history_drops_watches_and_keeps_the_objects() {
    let fake = KubeFake::start().await;
    let old = fake.apply(web("shop", "web-a", "10.0.0.1"));
    let mut watch = Watch::open(
        &fake,
        &format!("{}?watch=true&resourceVersion={old}", slices("shop")),
    )
    .await;
    fake.apply(web("shop", "web-b", "10.0.0.2"));
    assert_event(&watch.event().await, "ADDED", "web-b");
    let before = fake.resource_version();

    fake.restart_with_new_history();
    assert!(matches!(watch.next_within(WAIT).await, Some(Next::Broken)));
    wait_until("the watch is gone", WAIT, || async {
        fake.open_watches() == 0
    })
    .await;
    let list = get(&fake, &slices("shop")).await.body;
    assert_eq!(names(&list), ["web-a", "web-b"]);
    assert_eq!(list["metadata"]["resourceVersion"], before.to_string());
    let mut stale = Watch::open(
        &fake,
        &format!("{}?watch=true&resourceVersion={old}", slices("shop")),
    )
    .await;
    assert_eq!(stale.event().await["object"]["code"], 410);
}

#[tokio::test]
async fn tokens_are_checked_and_rbac_denials_have_the_apiserver_message() {
    let fake = KubeFake::start().await;
    fake.require_token(Some("token-1"));
    for token in [None, Some("token-2")] {
        let answer = get_as(&fake, &slices("shop"), token).await;
        assert_eq!(
            answer.body,
            json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",
                   "message":"Unauthorized","reason":"Unauthorized","code":401})
        );
        assert_eq!(answer.status, 401);
    }
    assert_eq!(fake.last_token().as_deref(), Some("token-2"));
    assert_eq!(
        get_as(&fake, &slices("shop"), Some("token-1")).await.status,
        200
    );
    assert_eq!(fake.last_token().as_deref(), Some("token-1"));
    assert_eq!(fake.last_authorization().as_deref(), Some("Bearer token-1"));

    fake.forbid(Some("shop"));
    let list = get_as(&fake, &slices("shop"), Some("token-1")).await;
    assert_eq!(
        status_message(&list, 403, "Forbidden"),
        format!(
            "endpointslices.discovery.k8s.io is forbidden: User \"{SERVICE_ACCOUNT}\" cannot list \
             resource \"endpointslices\" in API group \"discovery.k8s.io\" in the namespace \"shop\""
        )
    );
    assert_eq!(
        list.body["details"],
        json!({"group": "discovery.k8s.io", "kind": "endpointslices"})
    );
    let watch = get_as(
        &fake,
        &format!("{}?watch=true", slices("shop")),
        Some("token-1"),
    )
    .await;
    assert!(status_message(&watch, 403, "Forbidden").contains("cannot watch resource"));
    let cluster = get_as(&fake, ALL_SLICES, Some("token-1")).await;
    assert!(status_message(&cluster, 403, "Forbidden").ends_with("at the cluster scope"));
    assert_eq!(
        get_as(&fake, &slices("other"), Some("token-1"))
            .await
            .status,
        200
    );
    fake.forbid(None);
    assert_eq!(
        get_as(&fake, &slices("shop"), Some("token-1")).await.status,
        200
    );
}

#[tokio::test]
async fn other_paths_are_404_and_other_methods_405() {
    let fake = KubeFake::start().await;
    for path in [
        "/api/v1/namespaces/shop/endpoints",
        "/apis/discovery.k8s.io/v1beta1/endpointslices",
        "/apis/discovery.k8s.io/v1/namespaces/shop/endpointslices/a/b",
    ] {
        let answer = get(&fake, path).await;
        assert_eq!(
            status_message(&answer, 404, "NotFound"),
            "the server could not find the requested resource",
            "{path}"
        );
    }
    let response = reqwest::Client::new()
        .post(format!("{}{}", fake.url(), slices("shop")))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 405);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["reason"], "MethodNotAllowed");
}

#[tokio::test]
async fn fail_with_and_hang_and_the_counters() {
    let fake = KubeFake::start().await;
    fake.fail_with(Some((500, "etcdserver: leader changed".into())));
    let failed = get(&fake, &slices("shop")).await;
    assert_eq!(
        status_message(&failed, 500, "InternalError"),
        "etcdserver: leader changed"
    );
    fake.fail_with(Some((
        429,
        "too many requests, please try again later".into(),
    )));
    let throttled = get(&fake, &slices("shop")).await;
    status_message(&throttled, 429, "TooManyRequests");
    assert_eq!(throttled.headers["retry-after"], "1");
    fake.fail_with(None);

    fake.hang(true);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let hung = client
        .get(format!("{}{}?watch=1", fake.url(), slices("shop")))
        .send()
        .await;
    assert!(hung.unwrap_err().is_timeout());
    fake.hang(false);
    assert_eq!(get(&fake, &slices("shop")).await.status, 200);

    assert_eq!(fake.lists(), 3);
    assert_eq!(fake.watches(), 1);
    assert_eq!(fake.requests(), 4);
    assert_eq!(fake.queries(), ["", "", "watch=1", ""]);
}

#[tokio::test]
async fn a_hang_stalls_open_watches_until_it_ends() {
    let fake = KubeFake::start().await;
    let from = fake.resource_version();
    let mut watch = Watch::open(
        &fake,
        &format!(
            "{}?watch=true&resourceVersion={from}&timeoutSeconds=1",
            slices("shop")
        ),
    )
    .await;
    fake.hang(true);
    fake.apply(web("shop", "web-a", "10.0.0.1"));
    // Silent, past its own timeout too.
    assert!(watch
        .next_within(Duration::from_millis(1200))
        .await
        .is_none());
    fake.hang(false);
    assert_event(&watch.event().await, "ADDED", "web-a");
    watch.ends(WAIT).await;
}

#[tokio::test]
async fn stop_refuses_connections_and_restart_serves_the_same_objects() {
    let fake = KubeFake::start().await;
    fake.apply(web("shop", "web-a", "10.0.0.1"));
    let rv = fake.resource_version();
    let from = rv;
    let mut watch = Watch::open(
        &fake,
        &format!("{}?watch=true&resourceVersion={from}", slices("shop")),
    )
    .await;
    fake.stop();
    assert!(matches!(watch.next_within(WAIT).await, Some(Next::Broken)));
    let refused = reqwest::Client::new()
        .get(format!("{}{}", fake.url(), slices("shop")))
        .send()
        .await;
    assert!(refused.unwrap_err().is_connect());
    fake.restart().await;
    let list = get(&fake, &slices("shop")).await.body;
    assert_eq!(names(&list), ["web-a"]);
    assert_eq!(list["metadata"]["resourceVersion"], rv.to_string());
}

/// A kube-rs watcher stream, with the (retryable) errors it yielded along the way.
struct Events {
    stream: Pin<Box<dyn Stream<Item = watcher::Result<watcher::Event<EndpointSlice>>> + Send>>,
    errors: Vec<watcher::Error>,
}

impl Events {
    fn new(api: Api<EndpointSlice>, config: watcher::Config) -> Events {
        Events {
            stream: watcher(api, config).boxed(),
            errors: Vec::new(),
        }
    }

    /// The next event, within 5 s; errors are kept in `errors`.
    async fn next(&mut self) -> watcher::Event<EndpointSlice> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            match tokio::time::timeout_at(deadline, self.stream.next()).await {
                Err(_) => panic!("no kube-rs watcher event within {WAIT:?}"),
                Ok(None) => panic!("the kube-rs watcher ended"),
                Ok(Some(Err(error))) => self.errors.push(error),
                Ok(Some(Ok(event))) => return event,
            }
        }
    }

    /// Init, one InitApply per name (in order), InitDone.
    async fn expect_initial(&mut self, expected: &[&str]) {
        assert!(matches!(self.next().await, watcher::Event::Init));
        for name in expected {
            match self.next().await {
                watcher::Event::InitApply(slice) => assert_eq!(name_of(&slice), *name),
                other => panic!("expected InitApply({name}), got {other:?}"),
            }
        }
        assert!(matches!(self.next().await, watcher::Event::InitDone));
    }
}

fn name_of(slice: &EndpointSlice) -> &str {
    slice.metadata.name.as_deref().unwrap()
}

#[tokio::test]
async fn kube_rs_watcher_lists_watches_and_relists_after_a_410() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let fake = KubeFake::start().await;
    fake.apply(web("shop", "web-a", "10.0.0.1"));
    fake.apply(Slice::new("shop", "api-a", "api").endpoint(Ep::new(&["10.0.1.1"])));

    let client = kube::Client::try_from(kube::Config::new(fake.url().parse().unwrap())).unwrap();
    let api: Api<EndpointSlice> = Api::namespaced(client, "shop");
    let mut events = Events::new(
        api,
        watcher::Config::default().labels("kubernetes.io/service-name=web"),
    );

    events.expect_initial(&["web-a"]).await;
    let listed_at = fake.resource_version();
    // The watch starts when the stream is next polled, from the list's resourceVersion, so the
    // write below reaches it whenever it connects.

    let added = fake.apply(web("shop", "web-b", "10.0.0.2"));
    match events.next().await {
        watcher::Event::Apply(slice) => {
            assert_eq!(name_of(&slice), "web-b");
            assert_eq!(slice.endpoints[0].addresses, ["10.0.0.2"]);
            assert_eq!(
                slice.endpoints[0].conditions.as_ref().unwrap().ready,
                Some(true)
            );
            assert_eq!(
                slice.ports.as_ref().unwrap()[0].port,
                Some(8080),
                "ports parse"
            );
            assert_eq!(
                slice.metadata.resource_version.as_deref(),
                Some(added.to_string().as_str())
            );
        }
        other => panic!("expected Apply(web-b), got {other:?}"),
    }
    fake.delete("shop", "web-a");
    match events.next().await {
        watcher::Event::Delete(slice) => assert_eq!(name_of(&slice), "web-a"),
        other => panic!("expected Delete(web-a), got {other:?}"),
    }
    let deleted_at = fake.resource_version();

    // A write the watcher does not see, the history forgotten, and the connection dropped: the
    // watch resumes from a version that is gone, gets the 410 ERROR event and relists.
    fake.apply(Slice::new("elsewhere", "x", "x"));
    fake.compact();
    fake.restart_with_new_history();
    events.expect_initial(&["web-b"]).await;
    assert!(
        events.errors.iter().any(|error| matches!(
            error,
            watcher::Error::WatchError(status) if status.code == 410 && status.reason == "Expired"
        )),
        "the relist followed the 410 ERROR event: {:?}",
        events.errors
    );
    assert_eq!(fake.lists(), 2);

    let queries = fake.queries();
    println!("kube-rs queries: {queries:#?}");
    println!("kube-rs watcher errors: {:#?}", events.errors);
    let selector = "labelSelector=kubernetes.io%2Fservice-name%3Dweb";
    // kube-core builds its query with `form_urlencoded::Serializer::new("<path>?")`, which takes
    // the `?` for existing content: every query string starts with `&` (harmless to Go's parser).
    assert_eq!(queries[0], format!("&{selector}&limit=500"));
    assert_eq!(
        queries[1],
        format!(
            "&watch=true&timeoutSeconds=290&{selector}&allowWatchBookmarks=true&resourceVersion={listed_at}"
        )
    );
    assert!(
        queries.contains(&format!(
            "&watch=true&timeoutSeconds=290&{selector}&allowWatchBookmarks=true&resourceVersion={deleted_at}"
        )),
        "the resumed watch: {queries:?}"
    );
    assert_eq!(
        queries
            .iter()
            .filter(|q| q.starts_with(&format!("&{selector}")))
            .count(),
        2,
        "two lists"
    );
}

#[tokio::test]
async fn kube_rs_over_tls_with_a_token_file() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let fake = KubeFake::start_tls().await;
    fake.require_token(Some("token-1"));
    fake.apply(web("shop", "web-a", "10.0.0.1"));
    let pem = fake.ca_pem.clone().unwrap();
    let der = {
        use rustls_pki_types::pem::PemObject;
        rustls_pki_types::CertificateDer::from_pem_slice(pem.as_bytes())
            .unwrap()
            .to_vec()
    };
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "token-1").unwrap();

    let mut config = kube::Config::new(fake.url().parse().unwrap());
    config.root_cert = Some(vec![der.clone()]);
    config.auth_info.token_file = Some(token_file.display().to_string());
    let client = kube::Client::try_from(config).unwrap();
    let api: Api<EndpointSlice> = Api::namespaced(client, "shop");
    let list = api.list(&Default::default()).await.unwrap();
    assert_eq!(list.items.len(), 1);
    assert_eq!(fake.last_token().as_deref(), Some("token-1"));

    let mut events = Events::new(api, watcher::Config::default());
    events.expect_initial(&["web-a"]).await;

    // Without the token kube-rs gets the 401 Status, parsed.
    let mut anonymous = kube::Config::new(fake.url().parse().unwrap());
    anonymous.root_cert = Some(vec![der]);
    let api: Api<EndpointSlice> =
        Api::namespaced(kube::Client::try_from(anonymous).unwrap(), "shop");
    match api.list(&Default::default()).await {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 401);
            assert_eq!(status.reason, "Unauthorized");
        }
        other => panic!("expected a 401 Status, got {other:?}"),
    }
}

#[tokio::test]
async fn zone_hints_are_served_as_the_controller_writes_them() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let fake = KubeFake::start().await;
    fake.apply(
        Slice::new("shop", "web-h", "web")
            .port(Some("http"), 8080)
            .endpoint(Ep::new(&["10.0.0.1"]).zone("zone-a").for_zones(&["zone-a"]))
            .endpoint(
                Ep::new(&["10.0.0.2"])
                    .zone("zone-b")
                    .for_zones(&["zone-a", "zone-c"]),
            )
            .endpoint(Ep::new(&["10.0.0.3"]).zone("zone-b")),
    );
    let list = get_as(&fake, &slices("shop"), None).await;
    assert_eq!(list.status, 200);
    let endpoints = &list.body["items"][0]["endpoints"];
    assert_eq!(
        endpoints[0]["hints"],
        json!({"forZones": [{"name": "zone-a"}]})
    );
    assert_eq!(
        endpoints[1]["hints"],
        json!({"forZones": [{"name": "zone-a"}, {"name": "zone-c"}]})
    );
    assert!(endpoints[2].get("hints").is_none(), "no hints: no field");

    // The typed client reads them as discovery.k8s.io/v1 EndpointHints.
    let client = kube::Client::try_from(kube::Config::new(fake.url().parse().unwrap())).unwrap();
    let api: Api<EndpointSlice> = Api::namespaced(client, "shop");
    let slice = api.get("web-h").await.unwrap();
    let zones: Vec<Vec<String>> = slice
        .endpoints
        .iter()
        .map(|endpoint| {
            endpoint
                .hints
                .iter()
                .flat_map(|hints| hints.for_zones.iter().flatten())
                .map(|zone| zone.name.clone())
                .collect()
        })
        .collect();
    assert_eq!(
        zones,
        [vec!["zone-a"], vec!["zone-a", "zone-c"], Vec::<&str>::new()]
    );
}

#[tokio::test]
async fn services_are_got_watched_by_name_refused_and_missing_as_the_api_server_does() {
    use common::kubernetes::{Svc, TargetPort};
    let fake = KubeFake::start().await;
    let services = "/api/v1/namespaces/shop/services";
    let created = fake.apply_service(
        Svc::new("shop", "web")
            .port(Some("http"), 80, Some(TargetPort::Name("http".into())))
            .port(Some("admin"), 9000, None),
    );
    fake.apply_service(Svc::new("shop", "db").headless().port(None, 5432, None));

    let one = get(&fake, &format!("{services}/web")).await;
    assert_eq!(one.status, 200);
    let object = &one.body;
    assert_eq!(object["kind"], "Service");
    assert_eq!(object["apiVersion"], "v1");
    assert_eq!(rv_of(object), created);
    assert!(object["metadata"].get("generation").is_none(), "{object}");
    assert_eq!(
        object["spec"]["ports"],
        json!([
            {"name": "http", "protocol": "TCP", "port": 80, "targetPort": "http"},
            {"name": "admin", "protocol": "TCP", "port": 9000, "targetPort": 9000},
        ])
    );
    assert_eq!(object["status"], json!({"loadBalancer": {}}));
    let db = get(&fake, &format!("{services}/db")).await.body;
    assert_eq!(db["spec"]["clusterIP"], "None");
    assert!(db["spec"]["ports"][0].get("name").is_none(), "omitempty");
    // kube-rs reads it as a core/v1 Service.
    let parsed: k8s_openapi::api::core::v1::Service =
        serde_json::from_value(object.clone()).unwrap();
    assert_eq!(parsed.spec.unwrap().ports.unwrap()[0].port, 80);

    let missing = get(&fake, &format!("{services}/nope")).await;
    assert_eq!(
        status_message(&missing, 404, "NotFound"),
        "services \"nope\" not found"
    );
    assert_eq!(
        missing.body["details"],
        json!({"name": "nope", "kind": "services"})
    );
    let list = get(&fake, services).await.body;
    assert_eq!(list["kind"], "ServiceList");
    assert_eq!(names(&list), ["db", "web"]);
    // Slices are not services.
    fake.apply(web("shop", "web-a", "10.0.0.1"));
    assert_eq!(names(&get(&fake, services).await.body), ["db", "web"]);
    assert_eq!(names(&get(&fake, &slices("shop")).await.body), ["web-a"]);

    // A watch of one Service from the most recent state: its current state first, then its
    // changes only (not db's, not the slices').
    let mut watch = Watch::open(
        &fake,
        &format!(
            "{services}?watch=true&fieldSelector=metadata.name%3Dweb&allowWatchBookmarks=true"
        ),
    )
    .await;
    let first = watch.event().await;
    assert_eq!(first["type"], "ADDED");
    assert_eq!(first["object"]["metadata"]["name"], "web");
    let end = watch.event().await;
    assert_eq!(end["type"], "BOOKMARK");
    assert_eq!(end["object"]["kind"], "Service");
    assert_eq!(
        end["object"]["metadata"]["annotations"][INITIAL_EVENTS_END],
        "true"
    );
    fake.apply_service(Svc::new("shop", "db").headless().port(None, 5433, None));
    fake.apply(web("shop", "web-a", "10.0.0.2"));
    fake.apply_service(Svc::new("shop", "web").port(Some("http"), 81, None));
    let modified = watch.event().await;
    assert_eq!(modified["type"], "MODIFIED");
    assert_eq!(modified["object"]["spec"]["ports"][0]["port"], 81);
    assert!(fake.delete_service("shop", "web"));
    let deleted = watch.event().await;
    assert_eq!(deleted["type"], "DELETED");
    assert_eq!(fake.service_watches(), 1);
    assert_eq!(fake.service_gets(), 3);

    // RBAC: the get and the watch by name are refused with the name.
    fake.forbid_services(Some("shop"));
    let denied = get(&fake, &format!("{services}/db")).await;
    assert_eq!(
        status_message(&denied, 403, "Forbidden"),
        format!(
            "services \"db\" is forbidden: User \"{SERVICE_ACCOUNT}\" cannot get resource \
             \"services\" in API group \"\" in the namespace \"shop\""
        )
    );
    assert_eq!(
        denied.body["details"],
        json!({"name": "db", "kind": "services"})
    );
    let watch = get(
        &fake,
        &format!("{services}?watch=1&fieldSelector=metadata.name%3Ddb"),
    )
    .await;
    assert!(
        status_message(&watch, 403, "Forbidden").starts_with("services \"db\" is forbidden: User")
    );
    assert_eq!(
        get(&fake, &slices("shop")).await.status,
        200,
        "slices still allowed"
    );
}

#[tokio::test]
async fn watch_expiry_as_a_status_and_compaction_between_pages() {
    let fake = KubeFake::start().await;
    let old = fake.apply(web("shop", "web-a", "10.0.0.1"));
    fake.apply(web("shop", "web-b", "10.0.0.2"));
    fake.compact();
    fake.expire_watches_with_status(true);
    let expired = get(
        &fake,
        &format!("{}?watch=true&resourceVersion={old}", slices("shop")),
    )
    .await;
    assert!(status_message(&expired, 410, "Expired").starts_with("too old resource version"));
    fake.expire_watches_with_status(false);

    let first = get(&fake, &format!("{}?limit=1", slices("shop")))
        .await
        .body;
    let token = first["metadata"]["continue"].as_str().unwrap().to_owned();
    fake.compact_before_next_continue();
    fake.apply(web("shop", "web-c", "10.0.0.3"));
    let gone = get(
        &fake,
        &format!("{}?limit=1&continue={token}", slices("shop")),
    )
    .await;
    assert!(status_message(&gone, 410, "Expired")
        .starts_with("The provided continue parameter is too old"));
    // Only the next one.
    let page = get(&fake, &format!("{}?limit=1", slices("shop")))
        .await
        .body;
    let token = page["metadata"]["continue"].as_str().unwrap().to_owned();
    let next = get(
        &fake,
        &format!("{}?limit=1&continue={token}", slices("shop")),
    )
    .await;
    assert_eq!(next.status, 200);
}
