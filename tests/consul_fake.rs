//! Checks the Consul fake (`common::consul`) against Consul's documented behaviour, so the
//! provider's integration tests can trust it.

mod common;

use std::time::Duration;

use common::consul::{ConsulFake, Instance};
use common::wait_until;
use serde_json::Value;
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
