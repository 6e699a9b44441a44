//! Checks the Consul fake (`common::consul`) against Consul's documented behaviour, so the
//! provider's integration tests can trust it.

use crate::common;

use std::time::Duration;

use common::consul::{AgentService, ConsulFake, Instance};
use common::wait_until;
use serde_json::{json, Value};
use tokio::time::Instant;

struct Answer {
    status: u16,
    index: Option<u64>,
    headers: reqwest::header::HeaderMap,
    text: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text).expect("a JSON body")
    }

    /// `Service.ID` of every entry, in answer order.
    fn ids(&self) -> Vec<String> {
        self.json()
            .as_array()
            .expect("a JSON array")
            .iter()
            .map(|entry| entry["Service"]["ID"].as_str().unwrap().to_owned())
            .collect()
    }
}

async fn get_with(client: &reqwest::Client, consul: &ConsulFake, path: &str) -> Answer {
    let response = client
        .get(format!("{}{}", consul.url(), path))
        .send()
        .await
        .expect("the fake answers");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let index = headers
        .get("x-consul-index")
        .map(|value| value.to_str().unwrap().parse().unwrap());
    let text = response.text().await.unwrap();
    Answer {
        status,
        index,
        headers,
        text,
    }
}

async fn get(consul: &ConsulFake, path: &str) -> Answer {
    get_with(&reqwest::Client::new(), consul, path).await
}

/// A PUT to the fake, with an optional JSON body and `X-Consul-Token`.
async fn put_with(
    client: &reqwest::Client,
    consul: &ConsulFake,
    path: &str,
    body: Option<&Value>,
    token: Option<&str>,
) -> Answer {
    let mut request = client.put(format!("{}{}", consul.url(), path));
    if let Some(body) = body {
        request = request.body(serde_json::to_vec(body).unwrap());
    }
    if let Some(token) = token {
        request = request.header("X-Consul-Token", token);
    }
    let response = request.send().await.expect("the fake answers");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let index = headers
        .get("x-consul-index")
        .map(|value| value.to_str().unwrap().parse().unwrap());
    let text = response.text().await.unwrap();
    Answer {
        status,
        index,
        headers,
        text,
    }
}

async fn put(consul: &ConsulFake, path: &str, body: Option<&Value>) -> Answer {
    put_with(&reqwest::Client::new(), consul, path, body, None).await
}

/// A PUT whose body is raw bytes (for bodies that are not JSON).
async fn put_raw(consul: &ConsulFake, path: &str, body: &'static str) -> Answer {
    let response = reqwest::Client::new()
        .put(format!("{}{}", consul.url(), path))
        .body(body)
        .send()
        .await
        .expect("the fake answers");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    Answer {
        status,
        index: None,
        headers,
        text: response.text().await.unwrap(),
    }
}

/// The check `id` of a health entry.
fn health_check<'a>(entry: &'a Value, id: &str) -> &'a Value {
    entry["Checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|check| check["CheckID"] == id)
        .unwrap_or_else(|| panic!("check {id} in {entry}"))
}

/// Starts a health query on `service` blocked at the current index; it answers (index, body).
fn blocked_query(consul: &ConsulFake, service: &str) -> tokio::task::JoinHandle<(u64, Value)> {
    let url = format!(
        "{}/v1/health/service/{service}?index={}&wait=30s",
        consul.url(),
        consul.index()
    );
    tokio::spawn(async move {
        let response = reqwest::get(url).await.unwrap();
        let index = response.headers()["x-consul-index"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        (index, response.json().await.unwrap())
    })
}

fn tagged(service: &str, port: u16, tags: &[&str]) -> Instance {
    let mut instance = Instance::new(service, port);
    instance.tags = tags.iter().map(|tag| (*tag).to_owned()).collect();
    instance
}

#[tokio::test]
async fn answers_entries_with_consul_headers_and_a_rising_index() {
    let consul = ConsulFake::start().await;
    assert_eq!(consul.index(), 1);
    let empty = get(&consul, "/v1/health/service/web").await;
    assert_eq!(empty.status, 200);
    assert_eq!(empty.text, "[]");
    assert_eq!(empty.index, Some(1));

    let mut instance = tagged("web", 8080, &["blue"]);
    instance.meta.insert("version".into(), "2".into());
    instance.weights = (10, 3);
    instance.address = String::new();
    consul.register(instance);
    let first = get(&consul, "/v1/health/service/web").await;
    assert_eq!(first.status, 200);
    let header = |name: &str| first.headers[name].to_str().unwrap().to_owned();
    assert_eq!(header("content-type"), "application/json");
    assert_eq!(header("x-consul-knownleader"), "true");
    assert_eq!(header("x-consul-lastcontact"), "0");
    assert_eq!(header("x-consul-effective-consistency"), "leader");
    let first_index = first.index.expect("X-Consul-Index");
    assert!(first_index > 1, "a write raised the index: {first_index}");

    let entries = first.json();
    let entry = &entries[0];
    assert_eq!(entry["Node"]["Node"], "node-8080");
    assert_eq!(entry["Node"]["Address"], "127.0.0.1");
    assert_eq!(entry["Node"]["Datacenter"], "dc1");
    assert_eq!(entry["Node"]["ID"].as_str().unwrap().len(), 36);
    assert_eq!(entry["Service"]["ID"], "web-8080");
    assert_eq!(entry["Service"]["Service"], "web");
    assert_eq!(entry["Service"]["Address"], "");
    assert_eq!(entry["Service"]["Port"], 8080);
    assert_eq!(entry["Service"]["Tags"], serde_json::json!(["blue"]));
    assert_eq!(entry["Service"]["Meta"]["version"], "2");
    assert_eq!(entry["Service"]["Weights"]["Passing"], 10);
    assert_eq!(entry["Service"]["Weights"]["Warning"], 3);
    let checks = entry["Checks"].as_array().unwrap();
    assert_eq!(checks.len(), 2);
    assert!(checks
        .iter()
        .any(|check| check["CheckID"] == "serfHealth" && check["Status"] == "passing"));
    assert!(checks
        .iter()
        .any(|check| check["CheckID"] == "service:web-8080"
            && check["Status"] == "passing"
            && check["ServiceID"] == "web-8080"));

    consul.register(Instance::new("web", 8081));
    consul.register(Instance::new("api", 9000));
    let second = get(&consul, "/v1/health/service/web").await;
    assert!(second.index.unwrap() > first_index);
    assert_eq!(second.ids(), ["web-8080", "web-8081"]);

    consul.deregister("node-8080", "web-8080");
    let third = get(&consul, "/v1/health/service/web").await;
    assert!(third.index.unwrap() > second.index.unwrap());
    assert_eq!(third.ids(), ["web-8081"]);
    let before = consul.index();
    consul.deregister("node-8080", "web-8080");
    assert_eq!(consul.index(), before, "deregistering nothing is no write");

    let stale = get(&consul, "/v1/health/service/web?stale").await;
    assert_eq!(stale.headers["x-consul-effective-consistency"], "stale");
    let both = get(&consul, "/v1/health/service/web?stale&consistent").await;
    assert_eq!(both.status, 400);
}

#[tokio::test]
async fn a_blocking_query_waits_for_wait_plus_jitter_then_repeats_the_index() {
    let consul = ConsulFake::start().await;
    consul.register(Instance::new("web", 8080));
    let index = consul.index();
    let start = Instant::now();
    let answer = get(
        &consul,
        &format!("/v1/health/service/web?index={index}&wait=2s"),
    )
    .await;
    let elapsed = start.elapsed();
    assert_eq!(answer.status, 200);
    assert_eq!(answer.index, Some(index));
    assert_eq!(answer.ids(), ["web-8080"]);
    // 2 s plus at most 2 s / 16 of jitter, plus scheduling slack.
    assert!(
        elapsed >= Duration::from_secs(2),
        "returned early: {elapsed:?}"
    );
    assert!(
        elapsed < Duration::from_secs(4),
        "returned late: {elapsed:?}"
    );
    assert_eq!(consul.blocking_requests(), 1);
}

#[tokio::test]
async fn wait_is_a_go_duration() {
    let consul = ConsulFake::start().await;
    let index = consul.index();
    let start = Instant::now();
    let answer = get(
        &consul,
        &format!("/v1/health/service/web?index={index}&wait=300ms"),
    )
    .await;
    assert_eq!(answer.status, 200);
    assert!(start.elapsed() >= Duration::from_millis(300));
    let invalid = get(
        &consul,
        &format!("/v1/health/service/web?index={index}&wait=5"),
    )
    .await;
    assert_eq!(
        (invalid.status, invalid.text.as_str()),
        (400, "Invalid wait time")
    );
    let invalid = get(&consul, "/v1/health/service/web?index=-3").await;
    assert_eq!(
        (invalid.status, invalid.text.as_str()),
        (400, "Invalid index")
    );
    // A valid compound duration blocks (woken here by a write).
    let waiting = {
        let url = format!(
            "{}/v1/health/service/web?index={index}&wait=1m30s",
            consul.url()
        );
        tokio::spawn(async move { reqwest::get(url).await.unwrap().status().as_u16() })
    };
    wait_until("the query is blocked", Duration::from_secs(5), || async {
        consul.in_flight() == 1
    })
    .await;
    consul.touch();
    assert_eq!(waiting.await.unwrap(), 200);
}

#[tokio::test]
async fn a_write_wakes_a_blocked_query_at_once() {
    let consul = ConsulFake::start().await;
    let index = consul.index();
    let url = format!(
        "{}/v1/health/service/web?index={index}&wait=30s",
        consul.url()
    );
    let blocked = tokio::spawn(async move {
        let response = reqwest::get(url).await.unwrap();
        let index: u64 = response.headers()["x-consul-index"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        (index, response.text().await.unwrap(), Instant::now())
    });
    wait_until("the query is blocked", Duration::from_secs(5), || async {
        consul.in_flight() == 1
    })
    .await;
    let written = Instant::now();
    consul.register(Instance::new("web", 8080));
    let (new_index, body, answered) = tokio::time::timeout(Duration::from_secs(5), blocked)
        .await
        .expect("answered")
        .unwrap();
    assert!(
        answered.duration_since(written) < Duration::from_secs(1),
        "woken {:?} after the write",
        answered.duration_since(written)
    );
    assert!(new_index > index);
    assert!(body.contains("web-8080"));

    // An unrelated write wakes it too, with the same body.
    let index = consul.index();
    let url = format!(
        "{}/v1/health/service/web?index={index}&wait=30s",
        consul.url()
    );
    let blocked = tokio::spawn(async move { reqwest::get(url).await.unwrap().text().await });
    wait_until("the query is blocked", Duration::from_secs(5), || async {
        consul.in_flight() == 1
    })
    .await;
    consul.touch();
    let same = tokio::time::timeout(Duration::from_secs(5), blocked)
        .await
        .expect("answered")
        .unwrap()
        .unwrap();
    assert_eq!(same, body);
    assert_eq!(consul.index(), index + 1);
}

#[tokio::test]
async fn tags_must_all_match_case_insensitively() {
    let consul = ConsulFake::start().await;
    consul.register(tagged("web", 1, &["a", "b"]));
    consul.register(tagged("web", 2, &["a"]));
    consul.register(tagged("web", 3, &["b", "c"]));
    consul.register(tagged("web", 4, &["B", "A"]));
    let answer = get(&consul, "/v1/health/service/web?tag=a&tag=b").await;
    assert_eq!(answer.ids(), ["web-1", "web-4"]);
    let answer = get(&consul, "/v1/health/service/web?tag=c").await;
    assert_eq!(answer.ids(), ["web-3"]);
    assert_eq!(
        consul.queries(),
        ["tag=a&tag=b", "tag=c"],
        "raw query strings, in order"
    );
}

#[tokio::test]
async fn passing_excludes_warning_critical_and_maintenance() {
    let consul = ConsulFake::start().await;
    consul.register(Instance::new("web", 1));
    let mut warning = Instance::new("web", 2);
    warning.check_status = "warning".into();
    consul.register(warning);
    consul.register(Instance::new("web", 3));
    consul.set_check("node-3", "web-3", "critical");
    consul.register(Instance::new("web", 4));
    consul.set_check("node-4", "web-4", "maintenance");

    let all = get(&consul, "/v1/health/service/web").await;
    assert_eq!(all.ids(), ["web-1", "web-2", "web-3", "web-4"]);
    for query in ["passing", "passing=true", "passing=1"] {
        let passing = get(&consul, &format!("/v1/health/service/web?{query}")).await;
        assert_eq!(passing.ids(), ["web-1"], "?{query}");
    }
    let not_filtered = get(&consul, "/v1/health/service/web?passing=false").await;
    assert_eq!(not_filtered.ids().len(), 4);
    let invalid = get(&consul, "/v1/health/service/web?passing=maybe").await;
    assert_eq!(
        (invalid.status, invalid.text.as_str()),
        (400, "Invalid value for ?passing")
    );
}

#[tokio::test]
async fn maintenance_is_an_extra_critical_check() {
    let consul = ConsulFake::start().await;
    consul.register(Instance::new("web", 8080));
    consul.set_check("node-8080", "web-8080", "warning");
    consul.set_check("node-8080", "web-8080", "maintenance");
    let answer = get(&consul, "/v1/health/service/web").await;
    let entries = answer.json();
    let checks = entries[0]["Checks"].as_array().unwrap();
    assert_eq!(checks.len(), 3);
    let check = |id: &str| {
        checks
            .iter()
            .find(|check| check["CheckID"] == id)
            .unwrap_or_else(|| panic!("check {id} in {checks:?}"))
    };
    assert_eq!(check("_service_maintenance:web-8080")["Status"], "critical");
    assert_eq!(
        check("_service_maintenance:web-8080")["Name"],
        "Service Maintenance Mode"
    );
    assert_eq!(
        check("_service_maintenance:web-8080")["ServiceID"],
        "web-8080"
    );
    assert_eq!(
        check("service:web-8080")["Status"],
        "warning",
        "left as it was"
    );
    assert_eq!(check("serfHealth")["Status"], "passing");

    consul.set_check("node-8080", "web-8080", "passing");
    let answer = get(&consul, "/v1/health/service/web").await;
    assert_eq!(answer.json()[0]["Checks"].as_array().unwrap().len(), 2);
    let passing = get(&consul, "/v1/health/service/web?passing").await;
    assert_eq!(passing.ids(), ["web-8080"]);
}

#[tokio::test]
async fn reset_index_answers_blocked_queries_with_the_lower_index() {
    let consul = ConsulFake::start().await;
    for port in 1..=5 {
        consul.register(Instance::new("web", port));
    }
    let high = consul.index();
    assert!(high > 3);
    let url = format!(
        "{}/v1/health/service/web?index={high}&wait=30s",
        consul.url()
    );
    let blocked = tokio::spawn(async move {
        let response = reqwest::get(url).await.unwrap();
        response.headers()["x-consul-index"]
            .to_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    });
    wait_until("the query is blocked", Duration::from_secs(5), || async {
        consul.in_flight() == 1
    })
    .await;
    consul.reset_index(2);
    let answered = tokio::time::timeout(Duration::from_secs(1), blocked)
        .await
        .expect("answered at once")
        .unwrap();
    assert_eq!(answered, 2);
    assert_eq!(consul.index(), 2);

    // The entries survived; a plain read sees the lower index.
    let plain = get(&consul, "/v1/health/service/web").await;
    assert_eq!(plain.index, Some(2));
    assert_eq!(plain.ids().len(), 5);
    // A client still holding the old, higher index blocks (Consul waits for index > it).
    let start = Instant::now();
    let stale = get(
        &consul,
        &format!("/v1/health/service/web?index={high}&wait=300ms"),
    )
    .await;
    assert!(start.elapsed() >= Duration::from_millis(300));
    assert_eq!(stale.index, Some(2));
}

#[tokio::test]
async fn fail_with_answers_the_failure_until_cleared() {
    let consul = ConsulFake::start().await;
    consul.register(Instance::new("web", 8080));
    let index = consul.index();
    let url = format!(
        "{}/v1/health/service/web?index={index}&wait=30s",
        consul.url()
    );
    let blocked = tokio::spawn(async move {
        let response = reqwest::get(url).await.unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    });
    wait_until("the query is blocked", Duration::from_secs(5), || async {
        consul.in_flight() == 1
    })
    .await;
    consul.fail_with(Some((500, "No cluster leader".into())));
    let woken = tokio::time::timeout(Duration::from_secs(1), blocked)
        .await
        .expect("a blocked query answers the failure at once")
        .unwrap();
    assert_eq!(woken, (500, "No cluster leader".to_owned()));
    let failed = get(&consul, "/v1/health/service/web").await;
    assert_eq!(
        (failed.status, failed.text.as_str()),
        (500, "No cluster leader")
    );
    assert_eq!(failed.index, None);
    consul.fail_with(Some((403, "Permission denied".into())));
    assert_eq!(get(&consul, "/v1/health/service/web").await.status, 403);
    consul.fail_with(None);
    let healthy = get(&consul, "/v1/health/service/web").await;
    assert_eq!(healthy.status, 200);
    assert_eq!(healthy.ids(), ["web-8080"]);
}

#[tokio::test]
async fn require_token_wants_the_x_consul_token_header() {
    let consul = ConsulFake::start().await;
    consul.register(Instance::new("web", 8080));
    consul.require_token(Some("s3cr3t"));
    let client = reqwest::Client::new();
    let url = format!("{}/v1/health/service/web", consul.url());

    let missing = get(&consul, "/v1/health/service/web").await;
    assert_eq!(
        (missing.status, missing.text.as_str()),
        (403, "ACL not found")
    );
    let wrong = client
        .get(&url)
        .header("X-Consul-Token", "guess")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 403);
    let right = client
        .get(&url)
        .header("X-Consul-Token", "s3cr3t")
        .send()
        .await
        .unwrap();
    assert_eq!(right.status(), 200);
    assert_eq!(consul.last_headers()["x-consul-token"], "s3cr3t");
    assert!(consul
        .queries()
        .iter()
        .all(|query| !query.contains("token")));

    consul.require_token(None);
    assert_eq!(get(&consul, "/v1/health/service/web").await.status, 200);
}

#[tokio::test]
async fn hang_keeps_requests_silent_and_counts_them_in_flight() {
    let consul = ConsulFake::start().await;
    consul.register(Instance::new("web", 8080));
    consul.hang(true);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let url = format!("{}/v1/health/service/web", consul.url());
    let hanging = {
        let client = client.clone();
        let url = url.clone();
        tokio::spawn(async move { client.get(url).send().await })
    };
    wait_until("the request hangs", Duration::from_secs(5), || async {
        consul.in_flight() == 1
    })
    .await;
    assert_eq!(consul.requests(), 1, "its headers were read");
    let error = hanging.await.unwrap().expect_err("never answered");
    assert!(error.is_timeout(), "{error}");
    wait_until(
        "the abandoned request leaves in_flight",
        Duration::from_secs(5),
        || async { consul.in_flight() == 0 },
    )
    .await;

    consul.hang(false);
    let answer = client.get(&url).send().await.expect("answered again");
    assert_eq!(answer.status(), 200);
    assert_eq!(consul.max_in_flight(), 1);
}

#[tokio::test]
async fn answer_at_once_stops_blocking() {
    let consul = ConsulFake::start().await;
    consul.register(Instance::new("web", 8080));
    consul.answer_at_once(true);
    let index = consul.index();
    let start = Instant::now();
    let answer = get(
        &consul,
        &format!("/v1/health/service/web?index={index}&wait=5m"),
    )
    .await;
    assert!(start.elapsed() < Duration::from_secs(1));
    assert_eq!(answer.index, Some(index));
    assert_eq!(consul.blocking_requests(), 1);
}

#[tokio::test]
async fn stop_refuses_connections_and_restart_serves_the_same_catalog() {
    let consul = ConsulFake::start().await;
    consul.register(Instance::new("web", 8080));
    let index = consul.index();
    let url = format!(
        "{}/v1/health/service/web?index={index}&wait=30s",
        consul.url()
    );
    let blocked = tokio::spawn(async move { reqwest::get(url).await.map(|_| ()) });
    wait_until("the query is blocked", Duration::from_secs(5), || async {
        consul.in_flight() == 1
    })
    .await;

    consul.stop();
    let dropped = tokio::time::timeout(Duration::from_secs(5), blocked)
        .await
        .expect("the open connection is dropped")
        .unwrap();
    assert!(dropped.is_err(), "the blocked query fails");
    assert!(
        tokio::net::TcpStream::connect(consul.addr).await.is_err(),
        "connect refused after stop"
    );
    wait_until("in_flight drains", Duration::from_secs(5), || async {
        consul.in_flight() == 0
    })
    .await;

    consul.restart().await;
    let answer = get(&consul, "/v1/health/service/web").await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.index, Some(index));
    assert_eq!(answer.ids(), ["web-8080"]);
}

#[tokio::test]
async fn datacenters_filters_and_routing() {
    let consul = ConsulFake::start().await;
    let mut v1 = Instance::new("web", 1);
    v1.meta.insert("version".into(), "1".into());
    let mut v2 = tagged("web", 2, &["canary"]);
    v2.meta.insert("version".into(), "2".into());
    let mut far = Instance::new("web", 3);
    far.datacenter = "dc2".into();
    consul.register(v1);
    consul.register(v2);
    consul.register(far);

    assert_eq!(
        get(&consul, "/v1/health/service/web").await.ids(),
        ["web-1", "web-2"]
    );
    assert_eq!(
        get(&consul, "/v1/health/service/web?dc=dc2").await.ids(),
        ["web-3"]
    );
    let unknown = get(&consul, "/v1/health/service/web?dc=mars").await;
    assert_eq!(
        (unknown.status, unknown.text.as_str()),
        (500, "No path to datacenter")
    );

    let filtered = get(
        &consul,
        "/v1/health/service/web?filter=Service.Meta.version%20%3D%3D%20%222%22",
    )
    .await;
    assert_eq!(filtered.ids(), ["web-2"]);
    let filtered = get(
        &consul,
        "/v1/health/service/web?filter=%22canary%22%20not%20in%20Service.Tags",
    )
    .await;
    assert_eq!(filtered.ids(), ["web-1"]);
    assert_eq!(
        consul.queries().last().unwrap(),
        "filter=%22canary%22%20not%20in%20Service.Tags"
    );

    assert_eq!(
        get(&consul, "/v1/health/service/web?ns=default")
            .await
            .ids()
            .len(),
        2
    );
    assert_eq!(
        get(&consul, "/v1/health/service/web?ns=team-a").await.text,
        "[]"
    );
    assert_eq!(
        get(&consul, "/v1/health/service/web?unknown=1")
            .await
            .ids()
            .len(),
        2
    );

    assert_eq!(get(&consul, "/v1/catalog/service/web").await.status, 404);
    let put = reqwest::Client::new()
        .put(format!("{}/v1/health/service/web", consul.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 405);
}

#[tokio::test]
async fn concurrent_blocked_queries_are_counted() {
    let consul = ConsulFake::start().await;
    let index = consul.index();
    let mut waiting = Vec::new();
    for _ in 0..3 {
        let url = format!(
            "{}/v1/health/service/web?index={index}&wait=30s",
            consul.url()
        );
        waiting.push(tokio::spawn(async move {
            reqwest::get(url).await.unwrap().status()
        }));
    }
    wait_until(
        "three queries are blocked",
        Duration::from_secs(5),
        || async { consul.in_flight() == 3 },
    )
    .await;
    consul.touch();
    for request in waiting {
        assert_eq!(request.await.unwrap(), 200);
    }
    assert_eq!(consul.max_in_flight(), 3);
    assert_eq!(consul.requests(), 3);
    assert_eq!(consul.blocking_requests(), 3);
    wait_until("in_flight drains", Duration::from_secs(5), || async {
        consul.in_flight() == 0
    })
    .await;
}

#[tokio::test]
async fn an_agent_registration_shows_in_agent_lists_and_health_answers() {
    let consul = ConsulFake::start().await;
    consul.register(Instance::new("raahi", 7000));
    let before = consul.index();
    let body = json!({
        "ID": "raahi-1",
        "Name": "raahi",
        "Address": "10.0.0.7",
        "Port": 8080,
        "Tags": ["edge"],
        "Meta": {"version": "1.2.0"},
        "Check": {"TTL": "15s", "DeregisterCriticalServiceAfter": "1m"},
    });
    let registered = put(&consul, "/v1/agent/service/register", Some(&body)).await;
    assert_eq!((registered.status, registered.text.as_str()), (200, ""));
    assert_eq!(consul.index(), before + 1, "a registration is one write");
    assert_eq!(consul.agent_registrations(), 1);
    assert_eq!(consul.last_registration_body(), Some(body));
    assert_eq!(
        consul.agent_service("raahi-1"),
        Some(AgentService {
            id: "raahi-1".into(),
            name: "raahi".into(),
            address: "10.0.0.7".into(),
            port: 8080,
            tags: vec!["edge".into()],
            meta: [("version".to_owned(), "1.2.0".to_owned())].into(),
            check_id: Some("service:raahi-1".into()),
            ttl: Some(Duration::from_secs(15)),
            deregister_critical_after: Some(Duration::from_secs(60)),
        })
    );
    assert_eq!(
        consul.agent_check_status("raahi-1").as_deref(),
        Some("critical")
    );
    assert_eq!(consul.agent_check_output("raahi-1").as_deref(), Some(""));

    let services = get(&consul, "/v1/agent/services").await;
    assert_eq!(services.status, 200);
    let service = &services.json()["raahi-1"];
    assert_eq!(service["Service"], "raahi");
    assert_eq!(service["Address"], "10.0.0.7");
    assert_eq!(service["Port"], 8080);
    assert_eq!(service["Tags"], json!(["edge"]));
    assert_eq!(service["Meta"]["version"], "1.2.0");
    assert_eq!(service["Weights"], json!({"Passing": 1, "Warning": 1}));
    assert_eq!(service["Datacenter"], "dc1");
    assert_eq!(
        service["TaggedAddresses"]["lan_ipv4"],
        json!({"Address": "10.0.0.7", "Port": 8080})
    );
    let checks = get(&consul, "/v1/agent/checks").await.json();
    let check = &checks["service:raahi-1"];
    assert_eq!(
        check["Status"], "critical",
        "a new TTL check starts critical"
    );
    assert_eq!(check["Name"], "Service 'raahi' check");
    assert_eq!(check["Type"], "ttl");
    assert_eq!(check["ServiceID"], "raahi-1");
    assert_eq!(check["Node"], "agent-node");

    let health = get(&consul, "/v1/health/service/raahi").await;
    assert_eq!(health.index, Some(before + 1));
    assert_eq!(
        health.ids(),
        ["raahi-1", "raahi-7000"],
        "agent-node sorts before node-7000"
    );
    let entry = &health.json()[0];
    assert_eq!(entry["Node"]["Node"], "agent-node");
    assert_eq!(entry["Node"]["Address"], "127.0.0.1");
    assert_eq!(entry["Node"]["Datacenter"], "dc1");
    assert_eq!(entry["Service"]["Address"], "10.0.0.7");
    assert_eq!(entry["Service"]["Port"], 8080);
    assert_eq!(health_check(entry, "serfHealth")["Status"], "passing");
    assert_eq!(health_check(entry, "service:raahi-1")["Status"], "critical");
    let passing = get(&consul, "/v1/health/service/raahi?passing").await;
    assert_eq!(passing.ids(), ["raahi-7000"]);

    // No ID: the name is the ID; no Address: Consul reports "".
    let body =
        json!({"Name": "api", "Port": 9000, "Check": {"TTL": "1500ms", "Status": "passing"}});
    assert_eq!(
        put(&consul, "/v1/agent/service/register", Some(&body))
            .await
            .status,
        200
    );
    assert_eq!(consul.agent_check_status("api").as_deref(), Some("passing"));
    let api = consul.agent_service("api").unwrap();
    assert_eq!(api.ttl, Some(Duration::from_millis(1500)));
    assert_eq!(api.deregister_critical_after, None);
    let health = get(&consul, "/v1/health/service/api?passing").await;
    assert_eq!(health.ids(), ["api"]);
    let entry = &health.json()[0];
    assert_eq!(entry["Service"]["Address"], "");
    assert_eq!(health_check(entry, "service:api")["Status"], "passing");
    assert_eq!(consul.agent_services().len(), 2);
}

#[tokio::test]
async fn check_ids_and_re_registration_follow_consul() {
    let consul = ConsulFake::start().await;
    // Several checks without ids get `service:<ID>:<n>`, 1-based.
    let body = json!({"Name": "multi", "Checks": [
        {"TTL": "10s"}, {"TTL": "10s", "CheckID": "custom"}, {"TTL": "10s"},
    ]});
    assert_eq!(
        put(&consul, "/v1/agent/service/register", Some(&body))
            .await
            .status,
        200
    );
    let checks = get(&consul, "/v1/agent/checks").await.json();
    let mut ids: Vec<&String> = checks.as_object().unwrap().keys().collect();
    ids.sort();
    assert_eq!(ids, ["custom", "service:multi:1", "service:multi:3"]);
    assert_eq!(
        consul.agent_service("multi").unwrap().check_id.as_deref(),
        Some("service:multi:1")
    );

    // Snake case and any letter case are accepted.
    let body = json!({"name": "snake", "id": "snake-1", "check": {
        "ttl": "10s", "check_id": "snake-ttl", "deregister_critical_service_after": "90s",
    }});
    assert_eq!(
        put(&consul, "/v1/agent/service/register", Some(&body))
            .await
            .status,
        200
    );
    let snake = consul.agent_service("snake-1").unwrap();
    assert_eq!(snake.check_id.as_deref(), Some("snake-ttl"));
    assert_eq!(
        snake.deregister_critical_after,
        Some(Duration::from_secs(90))
    );

    // Re-registering keeps the check's status and output, even against a Status in the body.
    let body = json!({"ID": "gw", "Name": "raahi", "Port": 1, "Check": {"TTL": "30s"}});
    put(&consul, "/v1/agent/service/register", Some(&body)).await;
    put(&consul, "/v1/agent/check/pass/service:gw?note=up", None).await;
    let first = get(&consul, "/v1/health/service/raahi").await.json();
    let before = consul.index();
    let body = json!({"ID": "gw", "Name": "raahi", "Port": 2,
        "Check": {"TTL": "30s", "Status": "critical"}});
    put(&consul, "/v1/agent/service/register", Some(&body)).await;
    assert_eq!(consul.index(), before + 1);
    assert_eq!(consul.agent_service("gw").unwrap().port, 2);
    assert_eq!(consul.agent_check_status("gw").as_deref(), Some("passing"));
    assert_eq!(consul.agent_check_output("gw").as_deref(), Some("up"));
    let second = get(&consul, "/v1/health/service/raahi").await.json();
    assert_eq!(second[0]["Service"]["Port"], 2);
    assert_eq!(
        second[0]["Service"]["CreateIndex"],
        first[0]["Service"]["CreateIndex"]
    );
    assert!(
        second[0]["Service"]["ModifyIndex"].as_u64() > first[0]["Service"]["ModifyIndex"].as_u64()
    );

    // Checks left out of a re-registration stay, unless `replace-existing-checks`.
    let other = json!({"ID": "gw", "Name": "raahi", "Port": 2, "Check": {"TTL": "30s", "CheckID": "other"}});
    put(&consul, "/v1/agent/service/register", Some(&other)).await;
    let checks = get(&consul, "/v1/agent/checks").await.json();
    assert!(checks.get("service:gw").is_some() && checks.get("other").is_some());
    put(
        &consul,
        "/v1/agent/service/register?replace-existing-checks",
        Some(&other),
    )
    .await;
    let checks = get(&consul, "/v1/agent/checks").await.json();
    assert!(checks.get("service:gw").is_none() && checks.get("other").is_some());
    assert_eq!(
        consul.agent_service("gw").unwrap().check_id.as_deref(),
        Some("other")
    );
}

#[tokio::test]
async fn pass_warn_fail_and_update_set_status_and_output_and_write_once_per_change() {
    let consul = ConsulFake::start().await;
    let body = json!({"ID": "gw", "Name": "raahi", "Check": {"TTL": "30s"}});
    put(&consul, "/v1/agent/service/register", Some(&body)).await;
    let health_output = || async {
        let health = get(&consul, "/v1/health/service/raahi").await.json();
        let check = health_check(&health[0], "service:gw").clone();
        (
            check["Status"].as_str().unwrap().to_owned(),
            check["Output"].as_str().unwrap().to_owned(),
        )
    };
    let start = consul.index();

    let passed = put(
        &consul,
        "/v1/agent/check/pass/service:gw?note=all+good",
        None,
    )
    .await;
    assert_eq!((passed.status, passed.text.as_str()), (200, ""));
    assert_eq!(consul.index(), start + 1);
    assert_eq!(
        health_output().await,
        ("passing".to_owned(), "all good".to_owned())
    );
    put(
        &consul,
        "/v1/agent/check/pass/service:gw?note=all+good",
        None,
    )
    .await;
    assert_eq!(consul.index(), start + 1, "nothing changed: no write");
    // Only the output changes: the agent keeps it, the catalog gets it later (no write now).
    put(
        &consul,
        "/v1/agent/check/pass/service:gw?note=still+good",
        None,
    )
    .await;
    assert_eq!(consul.index(), start + 1);
    assert_eq!(
        consul.agent_check_output("gw").as_deref(),
        Some("still good")
    );
    let agent_checks = get(&consul, "/v1/agent/checks").await.json();
    assert_eq!(agent_checks["service:gw"]["Output"], "still good");
    assert_eq!(
        health_output().await,
        ("passing".to_owned(), "all good".to_owned())
    );

    put(&consul, "/v1/agent/check/warn/service:gw?note=slow", None).await;
    assert_eq!(consul.index(), start + 2);
    assert_eq!(
        health_output().await,
        ("warning".to_owned(), "slow".to_owned())
    );
    put(&consul, "/v1/agent/check/fail/service:gw", None).await;
    assert_eq!(consul.index(), start + 3);
    assert_eq!(consul.agent_check_status("gw").as_deref(), Some("critical"));
    assert_eq!(consul.agent_check_output("gw").as_deref(), Some(""));
    let update = json!({"Status": "passing", "Output": "back"});
    let updated = put(&consul, "/v1/agent/check/update/service:gw", Some(&update)).await;
    assert_eq!(updated.status, 200);
    assert_eq!(consul.index(), start + 4);
    assert_eq!(
        health_output().await,
        ("passing".to_owned(), "back".to_owned())
    );

    let bogus = json!({"Status": "maintenance"});
    let invalid = put(&consul, "/v1/agent/check/update/service:gw", Some(&bogus)).await;
    assert_eq!(
        (invalid.status, invalid.text.as_str()),
        (400, "Invalid check status: 'maintenance'")
    );
    let empty = put(&consul, "/v1/agent/check/update/service:gw", None).await;
    assert_eq!(
        (empty.status, empty.text.as_str()),
        (400, "Request decode failed: EOF")
    );
    let get_pass = get(&consul, "/v1/agent/check/pass/service:gw").await;
    assert_eq!(get_pass.status, 405);
    assert_eq!(get_pass.headers["allow"], "PUT");
    assert_eq!(consul.index(), start + 4);
    assert_eq!(consul.agent_check_updates(), 9, "every request counts");
    assert_eq!(
        consul.requests(),
        4,
        "requests() counts health queries only"
    );
}

#[tokio::test]
async fn unknown_checks_and_services_answer_404() {
    let consul = ConsulFake::start().await;
    let unknown = put(&consul, "/v1/agent/check/pass/service:nope", None).await;
    assert_eq!(
        (unknown.status, unknown.text.as_str()),
        (
            404,
            "Unknown check ID \"service:nope\". Ensure that the check ID is passed, not the check name."
        )
    );
    let update = json!({"Status": "passing"});
    let unknown = put(&consul, "/v1/agent/check/update/nope", Some(&update)).await;
    assert_eq!(unknown.status, 404);
    let unknown = put(&consul, "/v1/agent/service/deregister/nope", None).await;
    assert_eq!(
        (unknown.status, unknown.text.as_str()),
        (
            404,
            "Unknown service ID \"nope\". Ensure that the service ID is passed, not the service name."
        )
    );
    // A known check that is not a TTL check cannot be passed.
    let body = json!({"Name": "web", "Check": {"HTTP": "http://127.0.0.1:1/", "Interval": "10s"}});
    assert_eq!(
        put(&consul, "/v1/agent/service/register", Some(&body))
            .await
            .status,
        200
    );
    let not_ttl = put(&consul, "/v1/agent/check/pass/service:web", None).await;
    assert_eq!(
        (not_ttl.status, not_ttl.text.as_str()),
        (500, "CheckID \"service:web\" does not have associated TTL")
    );
    let checks = get(&consul, "/v1/agent/checks").await.json();
    assert_eq!(checks["service:web"]["Type"], "http");
    assert_eq!(checks["service:web"]["Interval"], "10s");
    assert_eq!(consul.agent_check_status("web"), None, "no TTL check");
}

#[tokio::test]
async fn a_ttl_check_expires_on_time_and_wakes_a_blocked_query() {
    let consul = ConsulFake::start().await;
    let ttl = Duration::from_millis(300);
    let body = json!({"ID": "gw", "Name": "raahi", "Check": {"TTL": "300ms", "Status": "passing"}});
    let sent = Instant::now();
    put(&consul, "/v1/agent/service/register", Some(&body)).await;
    let acknowledged = Instant::now();
    let index = consul.index();
    let (woken_index, health) =
        tokio::time::timeout(Duration::from_secs(5), blocked_query(&consul, "raahi"))
            .await
            .expect("woken by the expiry")
            .unwrap();
    let expired = Instant::now();
    assert!(expired - sent >= ttl, "expired early: {:?}", expired - sent);
    assert!(
        expired - acknowledged <= ttl + Duration::from_millis(100),
        "expired late: {:?}",
        expired - acknowledged
    );
    assert_eq!(woken_index, index + 1);
    let check = health_check(&health[0], "service:gw");
    assert_eq!(
        (check["Status"].as_str(), check["Output"].as_str()),
        (Some("critical"), Some("TTL expired"))
    );
    assert_eq!(
        consul.agent_check_output("gw").as_deref(),
        Some("TTL expired")
    );

    // A pass re-arms the timer from its own time; the expiry then quotes its note.
    let sent = Instant::now();
    put(&consul, "/v1/agent/check/pass/service:gw?note=fine", None).await;
    let acknowledged = Instant::now();
    assert_eq!(consul.agent_check_status("gw").as_deref(), Some("passing"));
    let (_, health) = tokio::time::timeout(Duration::from_secs(5), blocked_query(&consul, "raahi"))
        .await
        .expect("woken by the expiry")
        .unwrap();
    let expired = Instant::now();
    assert!(expired - sent >= ttl, "expired early: {:?}", expired - sent);
    assert!(expired - acknowledged <= ttl + Duration::from_millis(100));
    assert_eq!(
        health_check(&health[0], "service:gw")["Output"],
        "TTL expired (last output before timeout follows): fine"
    );
}

#[tokio::test]
async fn a_service_critical_for_longer_than_deregister_critical_service_after_is_reaped() {
    let consul = ConsulFake::start().await;
    // Passing at first: critical at the TTL expiry (100 ms), reaped 200 ms after that.
    let passing = json!({"ID": "gw", "Name": "raahi", "Check": {
        "TTL": "100ms", "Status": "passing", "DeregisterCriticalServiceAfter": "200ms",
    }});
    // Registered critical: the reaper's clock starts only at its first TTL expiry too.
    let critical = json!({"ID": "late", "Name": "raahi", "Check": {
        "TTL": "100ms", "DeregisterCriticalServiceAfter": "100ms",
    }});
    let sent = Instant::now();
    put(&consul, "/v1/agent/service/register", Some(&passing)).await;
    put(&consul, "/v1/agent/service/register", Some(&critical)).await;
    let acknowledged = Instant::now();
    wait_until("late is reaped", Duration::from_secs(3), || async {
        consul.agent_service("late").is_none()
    })
    .await;
    assert!(
        sent.elapsed() >= Duration::from_millis(200),
        "reaped early: {:?}",
        sent.elapsed()
    );
    wait_until("gw is reaped", Duration::from_secs(3), || async {
        consul.agent_service("gw").is_none()
    })
    .await;
    assert!(
        sent.elapsed() >= Duration::from_millis(300),
        "reaped early: {:?}",
        sent.elapsed()
    );
    assert!(
        acknowledged.elapsed() < Duration::from_millis(700),
        "reaped late: {:?}",
        acknowledged.elapsed()
    );
    assert_eq!(consul.agent_check_status("gw"), None);
    assert_eq!(get(&consul, "/v1/agent/checks").await.text, "{}");
    assert_eq!(get(&consul, "/v1/health/service/raahi").await.text, "[]");
    assert_eq!(
        consul.agent_deregistrations(),
        0,
        "the agent reaped them itself"
    );
}

#[tokio::test]
async fn deregister_removes_the_service_and_its_checks() {
    let consul = ConsulFake::start().await;
    let body = json!({"ID": "gw", "Name": "raahi", "Check": {"TTL": "30s"}});
    put(&consul, "/v1/agent/service/register", Some(&body)).await;
    let blocked = blocked_query(&consul, "raahi");
    wait_until("the query is blocked", Duration::from_secs(5), || async {
        consul.in_flight() == 1
    })
    .await;
    let index = consul.index();
    let gone = put(&consul, "/v1/agent/service/deregister/gw", None).await;
    assert_eq!((gone.status, gone.text.as_str()), (200, ""));
    let (woken_index, health) = tokio::time::timeout(Duration::from_secs(5), blocked)
        .await
        .expect("woken by the deregistration")
        .unwrap();
    assert_eq!((woken_index, health), (index + 1, json!([])));
    assert!(consul.agent_services().is_empty());
    assert_eq!(get(&consul, "/v1/agent/services").await.text, "{}");
    assert_eq!(get(&consul, "/v1/agent/checks").await.text, "{}");
    let again = put(&consul, "/v1/agent/service/deregister/gw", None).await;
    assert_eq!(again.status, 404);
    assert_eq!(consul.index(), index + 1);
    assert_eq!(consul.agent_deregistrations(), 2);
}

#[tokio::test]
async fn agent_forget_all_makes_the_next_pass_404() {
    let consul = ConsulFake::start().await;
    let body = json!({"ID": "gw", "Name": "raahi", "Check": {"TTL": "30s"}});
    put(&consul, "/v1/agent/service/register", Some(&body)).await;
    assert_eq!(
        put(&consul, "/v1/agent/check/pass/service:gw", None)
            .await
            .status,
        200
    );
    let index = consul.index();
    consul.agent_forget_all();
    assert_eq!(consul.index(), index + 1, "the catalog loses it too");
    assert_eq!(
        put(&consul, "/v1/agent/check/pass/service:gw", None)
            .await
            .status,
        404
    );
    assert_eq!(get(&consul, "/v1/health/service/raahi").await.text, "[]");
    consul.agent_forget_all();
    assert_eq!(consul.index(), index + 1, "forgetting nothing is no write");
    put(&consul, "/v1/agent/service/register", Some(&body)).await;
    assert_eq!(
        put(&consul, "/v1/agent/check/pass/service:gw", None)
            .await
            .status,
        200
    );
}

#[tokio::test]
async fn agent_endpoints_want_the_token() {
    let consul = ConsulFake::start().await;
    consul.require_token(Some("s3cr3t"));
    let client = reqwest::Client::new();
    let body = json!({"ID": "gw", "Name": "raahi", "Check": {"TTL": "30s"}});
    let register = |token| {
        put_with(
            &client,
            &consul,
            "/v1/agent/service/register",
            Some(&body),
            token,
        )
    };
    let anonymous = register(None).await;
    assert_eq!(
        (anonymous.status, anonymous.text.as_str()),
        (
            403,
            "Permission denied: anonymous token lacks permission 'service:write' on \"raahi\". \
             The anonymous token is used implicitly when a request does not specify a token."
        )
    );
    let wrong = register(Some("guess")).await;
    assert_eq!((wrong.status, wrong.text.as_str()), (403, "ACL not found"));
    assert!(consul.agent_services().is_empty());
    assert_eq!(register(Some("s3cr3t")).await.status, 200);
    assert_eq!(consul.last_headers()["x-consul-token"], "s3cr3t");

    let pass = |token| {
        put_with(
            &client,
            &consul,
            "/v1/agent/check/pass/service:gw",
            None,
            token,
        )
    };
    assert!(pass(None).await.text.starts_with("Permission denied"));
    assert_eq!(pass(Some("guess")).await.text, "ACL not found");
    assert_eq!(pass(Some("s3cr3t")).await.status, 200);
    let deregister = |token| {
        put_with(
            &client,
            &consul,
            "/v1/agent/service/deregister/gw",
            None,
            token,
        )
    };
    assert_eq!(deregister(None).await.status, 403);
    assert_eq!(deregister(Some("guess")).await.status, 403);

    // Lists: another token is refused, no token sees nothing (filtered by ACLs).
    assert_eq!(get(&consul, "/v1/agent/services").await.text, "{}");
    let wrong = client
        .get(format!("{}/v1/agent/services", consul.url()))
        .header("X-Consul-Token", "guess")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 403);
    let listed: Value = client
        .get(format!("{}/v1/agent/services?token=s3cr3t", consul.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listed["gw"]["Service"], "raahi");
    assert_eq!(deregister(Some("s3cr3t")).await.status, 200);
}

#[tokio::test]
async fn a_register_body_is_validated_as_consul_does() {
    let consul = ConsulFake::start().await;
    let index = consul.index();
    let cases = [
        (json!({"Port": 80}), "Missing service name"),
        (
            json!({"Name": "raahi", "Address": "0.0.0.0"}),
            "Invalid service address",
        ),
        (
            json!({"Name": "raahi", "Address": "::"}),
            "Invalid service address",
        ),
        (
            json!({"Name": "raahi", "Check": {"Notes": "no kind"}}),
            "Invalid check: TTL must be > 0 for TTL checks",
        ),
        (
            json!({"Name": "raahi", "Check": {"TTL": "10s", "Interval": "10s"}}),
            "Invalid check: Interval and TTL cannot both be specified",
        ),
        (
            json!({"Name": "raahi", "Check": {"TTL": "10s", "Status": "up"}}),
            "Status for checks must 'passing', 'warning', 'critical'",
        ),
        (
            json!({"Name": "raahi", "Check": {"TTL": "15"}}),
            "Request decode failed: time: invalid duration \"15\"",
        ),
        (
            json!({"Name": "raahi", "Tags": "edge"}),
            "Request decode failed: json: cannot unmarshal string into Go struct field \
             ServiceDefinition.Tags of type []string",
        ),
    ];
    for (body, message) in &cases {
        let answer = put(&consul, "/v1/agent/service/register", Some(body)).await;
        assert_eq!(
            (answer.status, answer.text.as_str()),
            (400, *message),
            "{body}"
        );
    }
    assert_eq!(
        consul.last_registration_body(),
        Some(cases.last().unwrap().0.clone())
    );
    let not_json = put_raw(&consul, "/v1/agent/service/register", "{\"Name\": ").await;
    assert_eq!(not_json.status, 400);
    assert!(
        not_json.text.starts_with("Request decode failed: "),
        "{}",
        not_json.text
    );
    assert_eq!(consul.last_registration_body(), None);
    let empty = put_raw(&consul, "/v1/agent/service/register", "").await;
    assert_eq!(
        (empty.status, empty.text.as_str()),
        (400, "Request decode failed: EOF")
    );
    let get_register = get(&consul, "/v1/agent/service/register").await;
    assert_eq!(
        (get_register.status, get_register.text.as_str()),
        (405, "method GET not allowed")
    );
    let put_services = put(&consul, "/v1/agent/services", None).await;
    assert_eq!(put_services.status, 405);
    assert_eq!(put_services.headers["allow"], "GET");
    assert!(consul.agent_services().is_empty());
    assert_eq!(consul.index(), index, "nothing was written");
    assert_eq!(consul.agent_registrations(), cases.len() + 3);
}

#[tokio::test]
async fn a_failing_hung_or_stopped_agent_and_one_that_comes_back() {
    let consul = ConsulFake::start().await;
    let body = json!({"ID": "gw", "Name": "raahi", "Check": {"TTL": "30s", "Status": "passing"}});
    consul.fail_with(Some((500, "No cluster leader".into())));
    let failed = put(&consul, "/v1/agent/service/register", Some(&body)).await;
    assert_eq!(
        (failed.status, failed.text.as_str()),
        (500, "No cluster leader")
    );
    consul.fail_with(None);
    assert_eq!(
        consul.last_registration_body(),
        None,
        "a failed request is not looked at"
    );

    consul.hang(true);
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let error = impatient
        .put(format!("{}/v1/agent/service/register", consul.url()))
        .json(&body)
        .send()
        .await
        .expect_err("never answered");
    assert!(error.is_timeout(), "{error}");
    consul.hang(false);
    assert_eq!(consul.agent_registrations(), 2);
    assert!(consul.agent_services().is_empty());

    assert_eq!(
        put(&consul, "/v1/agent/service/register", Some(&body))
            .await
            .status,
        200
    );
    consul.stop();
    assert!(tokio::net::TcpStream::connect(consul.addr).await.is_err());
    consul.restart().await;
    assert_eq!(consul.agent_check_status("gw").as_deref(), Some("passing"));
    assert_eq!(
        put(&consul, "/v1/agent/check/pass/service:gw", None)
            .await
            .status,
        200
    );
    assert_eq!(get(&consul, "/v1/health/service/raahi").await.ids(), ["gw"]);
}
