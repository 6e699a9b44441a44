//! Declarative configuration: a resources file applied at start and on SIGHUP, idempotently,
//! reporting what it did and marking what it manages.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::process::RaahiProcess;
use common::*;
use raahi::gateway::Gateway;
use serde_json::json;

fn resources(web_a: &Upstream, web_b: &Upstream, weight_b: u32, route: &str) -> String {
    format!(
        r#"
[[services]]
name = "web"
upstream_authority = "web.internal"

  [[services.targets]]
  host = "127.0.0.1"
  port = {port_a}
  weight = 1

  [[services.targets]]
  host = "127.0.0.1"
  port = {port_b}
  weight = {weight_b}

[[routes]]
name = "{route}"
service = "web"
path_prefix = "/"
"#,
        port_a = web_a.addr.port(),
        port_b = web_b.addr.port(),
    )
}

async fn start_with_file(text: &str) -> (TestGateway, std::path::PathBuf) {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let path = dir.path().join("resources.toml");
    std::fs::write(&path, text).unwrap();
    let mut config = test_config(dir.path());
    config.resources.file = Some(path.clone());
    (TestGateway::start_with(dir, config).await, path)
}

fn counts_of(gateway: &TestGateway) -> raahi::resources::ApplyCounts {
    let (_, counts) = gateway
        .gateway
        .as_ref()
        .unwrap()
        .resources
        .as_ref()
        .expect("a resources file is configured");
    *counts
}

async fn reload(gateway: &TestGateway) -> raahi::resources::ApplyReport {
    gateway
        .gateway
        .as_ref()
        .unwrap()
        .reload_resources()
        .await
        .expect("a resources file is configured")
        .expect("the file applies")
}

#[tokio::test]
async fn a_file_is_applied_at_start_and_what_it_manages_is_marked() {
    let a = Upstream::start("a").await;
    let b = Upstream::start("b").await;
    let (gateway, _) = start_with_file(&resources(&a, &b, 3, "web")).await;

    // The service, its two targets and the route (each checked through the API below).
    let counts = counts_of(&gateway);
    assert_eq!(
        counts,
        raahi::resources::ApplyCounts {
            created: 4,
            ..Default::default()
        }
    );

    let (_, services) = gateway.api("GET", "/api/v1/services", None).await;
    let web = &services["items"][0];
    assert_eq!(web["name"], "web");
    assert_eq!(web["managed_by"], "resources-file");
    assert_eq!(web["upstream_authority"], "web.internal");
    let (_, targets) = gateway
        .api(
            "GET",
            &format!("/api/v1/services/{}/targets", web["id"]),
            None,
        )
        .await;
    assert_eq!(targets["items"].as_array().unwrap().len(), 2, "{targets}");
    assert!(targets["items"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t["managed_by"] == "resources-file"));

    // Live at once, with the declared weights.
    let answers = spread(&gateway, "/", 400, 4).await;
    let to_b = answers.get("b").copied().unwrap_or(0);
    assert!((270..=330).contains(&to_b), "{answers:?}");
    assert_eq!(b.last_seen().header("host"), Some("web.internal"));

    // What the API creates is not marked.
    let manual = gateway
        .create("/api/v1/services", json!({"name": "manual"}))
        .await;
    let (_, manual) = gateway
        .api("GET", &format!("/api/v1/services/{manual}"), None)
        .await;
    assert!(manual["managed_by"].is_null());
}

#[tokio::test]
async fn reapplying_changes_only_what_changed_and_deletes_only_what_it_created() {
    let a = Upstream::start("a").await;
    let b = Upstream::start("b").await;
    let (gateway, path) = start_with_file(&resources(&a, &b, 3, "web")).await;
    let manual = gateway
        .create("/api/v1/services", json!({"name": "manual"}))
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "manual", "hosts": ["manual.test"], "service_id": manual}),
        )
        .await;
    let (_, before) = gateway.api("GET", "/api/v1/services", None).await;

    // The same file again: nothing to do, nothing written.
    let report = reload(&gateway).await;
    assert!(
        report.created.is_empty() && report.changed.is_empty() && report.deleted.is_empty(),
        "{report:?}"
    );
    assert_eq!(report.unchanged.len(), 4, "{report:?}");
    let (_, after) = gateway.api("GET", "/api/v1/services", None).await;
    assert_eq!(before, after, "an idempotent apply writes nothing");

    // A changed weight, a renamed route.
    std::fs::write(&path, resources(&a, &b, 1, "web-v2")).unwrap();
    let report = reload(&gateway).await;
    assert_eq!(
        report.changed,
        vec![format!("target web/127.0.0.1:{}", b.addr.port())]
    );
    assert_eq!(report.created, vec!["route web-v2".to_owned()]);
    assert_eq!(report.deleted, vec!["route web".to_owned()]);
    let answers = spread(&gateway, "/", 400, 4).await;
    let to_b = answers.get("b").copied().unwrap_or(0);
    assert!((160..=240).contains(&to_b), "weights now 1:1: {answers:?}");

    // Objects made through the API are left alone.
    let (_, routes) = gateway.api("GET", "/api/v1/routes", None).await;
    let names: Vec<&str> = routes["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["manual", "web-v2"]);

    // A file without the service deletes it (and its targets); the manual one stays.
    std::fs::write(&path, "").unwrap();
    let report = reload(&gateway).await;
    let mut deleted = report.deleted.clone();
    deleted.sort();
    assert!(deleted.contains(&"service web".to_owned()), "{report:?}");
    assert!(deleted.contains(&"route web-v2".to_owned()), "{report:?}");
    let (_, services) = gateway.api("GET", "/api/v1/services", None).await;
    assert_eq!(services["items"].as_array().unwrap().len(), 1);
    assert_eq!(services["items"][0]["name"], "manual");
}

#[tokio::test]
async fn an_invalid_file_names_the_place_and_changes_nothing() {
    let a = Upstream::start("a").await;
    let b = Upstream::start("b").await;
    let (gateway, path) = start_with_file(&resources(&a, &b, 3, "web")).await;
    let (_, before) = gateway.api("GET", "/api/v1/routes", None).await;

    let broken = resources(&a, &b, 3, "web-v2").replace("weight = 1", "weight = 70000");
    std::fs::write(&path, broken).unwrap();
    let error = gateway
        .gateway
        .as_ref()
        .unwrap()
        .reload_resources()
        .await
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(error.contains("services[0].targets[0].weight"), "{error}");
    let (_, after) = gateway.api("GET", "/api/v1/routes", None).await;
    assert_eq!(before, after, "nothing applied");

    std::fs::write(&path, "[[routes]]\nname = \"r\"\nservice = \"nope\"\n").unwrap();
    let error = gateway
        .gateway
        .as_ref()
        .unwrap()
        .reload_resources()
        .await
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(error.contains("\"nope\""), "{error}");
    let (_, after) = gateway.api("GET", "/api/v1/routes", None).await;
    assert_eq!(before, after, "nothing applied");

    // At start, an invalid file stops the gateway with the same kind of message.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[[services]]\nname = \"x\"\ncolour = \"red\"\n").unwrap();
    let mut config = test_config(dir.path());
    config.resources.file = Some(bad);
    let error = Gateway::start(&config)
        .await
        .err()
        .expect("start refused")
        .to_string();
    assert!(error.contains("bad.toml: services[0].colour"), "{error}");
}

#[tokio::test]
async fn sighup_applies_the_file_again() {
    let a = Upstream::start("a").await;
    let b = Upstream::start("b").await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("resources.toml");
    std::fs::write(&path, resources(&a, &b, 3, "web")).unwrap();
    let process = RaahiProcess::serve(&[
        ("RAAHI_ADMIN_TOKEN", ADMIN_TOKEN),
        ("RAAHI_LOG_FORMAT", "text"),
        ("RAAHI_RESOURCES_FILE", path.to_str().unwrap()),
    ])
    .await;
    assert!(
        process
            .stdout_lines
            .iter()
            .any(|line| line.contains("created 4")),
        "{:?}",
        process.stdout_lines
    );

    std::fs::write(&path, resources(&a, &b, 3, "web-v2")).unwrap();
    process.signal("-HUP");
    let http = reqwest::Client::new();
    wait_until(
        "the renamed route is applied",
        Duration::from_secs(10),
        || async {
            let routes: serde_json::Value = http
                .get(format!("http://{}/api/v1/routes", process.admin))
                .bearer_auth(ADMIN_TOKEN)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            routes["items"][0]["name"] == "web-v2" && routes["items"].as_array().unwrap().len() == 1
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consul_source_in_the_file_is_validated_and_watched() {
    let fake = common::consul::ConsulFake::start().await;
    let web = Upstream::start("web").await;
    fake.register(common::consul::Instance::new("web", web.addr.port()));
    let text = format!(
        r#"
[[services]]
name = "web"

  [[services.discovery_sources]]
  name = "web-consul"
  provider = "consul"
  config = {{ address = "{address}", service = "web", wait_ms = 10000 }}

[[routes]]
name = "web"
service = "web"
path_prefix = "/"
"#,
        address = fake.url(),
    );
    let (gateway, path) = start_with_file(&text).await;
    wait_until(
        "the consul source serves",
        Duration::from_secs(10),
        || async {
            let response = gateway.get("/").await;
            response.status() == 200 && response.text().await.unwrap() == "web"
        },
    )
    .await;
    let (_, sources) = gateway
        .api("GET", "/api/v1/services/1/discovery-sources", None)
        .await;
    let source = &sources["items"][0];
    assert_eq!(source["managed_by"], "resources-file", "{source}");
    assert_eq!(
        source["config"]["passing_only"], true,
        "defaults are filled: {source}"
    );

    // A bad consul config in the file names its place and changes nothing.
    std::fs::write(&path, text.replace("wait_ms = 10000", "wait_ms = 10")).unwrap();
    let error = gateway
        .gateway
        .as_ref()
        .unwrap()
        .reload_resources()
        .await
        .expect("a resources file is configured")
        .expect_err("a wait_ms under a second is refused");
    let message = error.to_string();
    assert!(
        message.contains("discovery_sources[0]") && message.contains("wait_ms"),
        "{message}"
    );
    let (_, after) = gateway
        .api("GET", "/api/v1/services/1/discovery-sources", None)
        .await;
    assert_eq!(after["items"][0]["config"]["wait_ms"], 10_000, "{after}");
}

/// An `h2c` service with a gRPC health check, declared in the file, carries real gRPC.
#[tokio::test]
async fn a_declared_h2c_service_carries_grpc() {
    let origin = common::grpc::GrpcOrigin::start("declared").await;
    let text = format!(
        r#"
[[services]]
name = "carts"
protocol = "h2c"
timeouts = {{ keepalive_ms = 20000 }}
limits = {{ max_streams_per_connection = 50 }}
health_check = {{ type = "grpc", grpc_service = "raahi.test.Echo", interval_ms = 200 }}

  [[services.targets]]
  host = "127.0.0.1"
  port = {port}

[[routes]]
name = "grpc"
service = "carts"
"#,
        port = origin.addr.port()
    );
    let (gateway, _path) = start_with_file(&text).await;
    let (_, service) = gateway.api("GET", "/api/v1/services/1", None).await;
    assert_eq!(service["protocol"], "h2c", "{service}");
    assert_eq!(service["health_check"]["type"], "grpc", "{service}");
    assert_eq!(service["limits"]["max_streams_per_connection"], 50);
    let target = gateway.targets(1).await.remove(0);
    wait_target(&gateway, target.id, "healthy by gRPC", |t| {
        t.health == api::Health::Healthy
    })
    .await;
    let mut client = common::grpc::client(gateway.proxy).await;
    let reply = client
        .unary(common::grpc::EchoRequest {
            text: "from the file".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.origin, "declared");
}

/// Routes in the file name their backends' and mirror's services by name, with the API's
/// rule fields; applying again changes nothing, and a bad rule names its place.
#[tokio::test]
async fn declared_route_rules_name_services_and_apply_once() {
    let stable = Upstream::start("stable").await;
    let canary = Upstream::start("canary").await;
    let text = format!(
        r#"
[[services]]
name = "stable"
  [[services.targets]]
  host = "127.0.0.1"
  port = {stable}

[[services]]
name = "canary"
  [[services.targets]]
  host = "127.0.0.1"
  port = {canary}
  metadata = {{ tags = ["v2"] }}

[[routes]]
name = "split"
path_prefix = "/api"
backends = [{{ service = "stable", weight = 3 }}, {{ service = "canary", weight = 1, subset = {{ tag = "v2" }} }}]
mirror = {{ service = "canary", percent = 50 }}
request_headers = {{ set = {{ "x-client" = "${{client_ip}}" }} }}
rate_limit = {{ requests_per_second = 1000, key = {{ header = "X-Api-Key" }}, scope = "cluster" }}
max_in_flight = 50

[[routes]]
name = "old"
path_prefix = "/old"
redirect = {{ path = "/api", status = 308 }}
"#,
        stable = stable.addr.port(),
        canary = canary.addr.port()
    );
    let (gateway, path) = start_with_file(&text).await;
    let (_, routes) = gateway.api("GET", "/api/v1/routes", None).await;
    let split = &routes["items"][0];
    assert_eq!(split["backends"][0]["weight"], 3, "{split}");
    assert_eq!(split["backends"][1]["subset"]["tag"], "v2", "{split}");
    assert_eq!(split["mirror"]["percent"], 50, "{split}");
    assert_eq!(split["rate_limit"]["key"]["header"], "x-api-key", "{split}");
    assert_eq!(split["rate_limit"]["scope"], "cluster", "{split}");
    assert_eq!(split["max_in_flight"], 50, "{split}");
    assert_eq!(routes["items"][1]["redirect"]["status"], 308);
    for _ in 0..8 {
        assert_eq!(gateway.get("/api/x").await.status(), 200);
    }
    assert_eq!(stable.hits(), 6);
    assert_eq!(stable.last_seen().header("x-client"), Some("127.0.0.1"));
    let redirected = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
        .get(gateway.proxy_url("/old/x"))
        .send()
        .await
        .unwrap();
    assert_eq!(redirected.status(), 308);

    let report = gateway
        .gateway
        .as_ref()
        .unwrap()
        .reload_resources()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(report.changed.len(), 0, "{report:?}");

    let broken = text.replace("weight = 1,", "weight = 2000000,");
    std::fs::write(&path, broken).unwrap();
    let error = gateway
        .gateway
        .as_ref()
        .unwrap()
        .reload_resources()
        .await
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(error.contains("routes[0].backends[1].weight"), "{error}");
    std::fs::write(
        &path,
        text.replace(
            "service = \"canary\", percent",
            "service = \"nope\", percent",
        ),
    )
    .unwrap();
    let error = gateway
        .gateway
        .as_ref()
        .unwrap()
        .reload_resources()
        .await
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(error.contains("\"nope\""), "{error}");
}
