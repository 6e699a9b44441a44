//! `raahi status` as a real process against a real gateway's admin API: services, targets by
//! state and health, discovery sources with their lifecycle; JSON output; pagination; and the
//! one-line errors for a wrong token, a viewer token and an unreachable admin API.

use crate::common;
use common::*;

use std::convert::Infallible;
use std::process::Output;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::registry::Registry;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpListener;

const WAIT: Duration = Duration::from_secs(15);

/// The real binary, without any `RAAHI_*` setting inherited from the environment. Run through
/// tokio so the in-process gateway keeps answering while we wait for the child.
async fn raahi_status(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_raahi"));
    for (name, _) in std::env::vars() {
        if name.starts_with("RAAHI_") || name == "RUST_LOG" {
            command.env_remove(name);
        }
    }
    command.envs(env.iter().copied()).arg("status").args(args);
    tokio::time::timeout(WAIT, command.output())
        .await
        .expect("raahi status finishes")
        .expect("raahi status runs")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A gateway with service `web`: one operator target and one `http` discovery source whose
/// registry serves one endpoint, both health-checked. Returns once the source is healthy and
/// both targets are healthy.
struct World {
    gateway: TestGateway,
    service: i64,
    _registry: Registry,
    _upstreams: (Upstream, Upstream),
}

async fn world() -> World {
    let gateway = TestGateway::start().await;
    let operator = Upstream::start("operator").await;
    let discovered = Upstream::start("discovered").await;
    let registry = Registry::start().await;
    registry.set_json(json!([{
        "key": "web-1",
        "host": "127.0.0.1",
        "port": discovered.addr.port(),
    }]));

    let service = gateway
        .create(
            "/api/v1/services",
            json!({
                "name": "web",
                "health_check": {"path": "/", "interval_ms": 100, "timeout_ms": 500,
                                 "healthy_threshold": 1, "unhealthy_threshold": 3},
            }),
        )
        .await;
    gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            target(&operator, 1, 0),
        )
        .await;
    let source = gateway
        .create(
            &format!("/api/v1/services/{service}/discovery-sources"),
            json!({
                "name": "web-registry",
                "provider": "http",
                "config": {"url": registry.url("/v1/endpoints"), "interval_ms": 200, "timeout_ms": 500},
            }),
        )
        .await;

    gateway
        .wait_source_status(source, "healthy with one endpoint", WAIT, |status| {
            status.state == "healthy" && status.endpoints.active == 1
        })
        .await;
    wait_until("both targets are healthy", WAIT, || async {
        let (_, targets) = gateway
            .api("GET", &format!("/api/v1/services/{service}/targets"), None)
            .await;
        let items = targets["items"].as_array().cloned().unwrap_or_default();
        items.len() == 2 && items.iter().all(|t| t["health"] == "healthy")
    })
    .await;
    World {
        gateway,
        service,
        _registry: registry,
        _upstreams: (operator, discovered),
    }
}

fn admin_url(gateway: &TestGateway) -> String {
    format!("http://{}", gateway.admin)
}

#[tokio::test]
async fn text_shows_service_targets_and_source_lifecycle() {
    let world = world().await;
    let url = admin_url(&world.gateway);
    let shadow = world
        .gateway
        .create("/api/v1/services", json!({"name": "shadow"}))
        .await;
    let route = world
        .gateway
        .create(
            "/api/v1/routes",
            json!({"name": "split", "path_prefix": "/api",
                   "headers": [{"name": "x-canary", "value": "1"}],
                   "backends": [{"service_id": world.service, "weight": 3},
                                {"service_id": world.service, "weight": 1, "subset": {"tag": "v2"}}],
                   "mirror": {"service_id": shadow, "percent": 5},
                   "cors": {"allow_origins": ["https://app.test"]}}),
        )
        .await;
    // A configuration file that does not exist proves `status` never loads one.
    let output = raahi_status(
        &["--admin-url", &url, "--token", ADMIN_TOKEN],
        &[("RAAHI_CONFIG", "/nonexistent/raahi.toml")],
    )
    .await;
    assert!(output.status.success(), "{output:?}");
    let text = stdout(&output);
    let service_line = format!(
        "service web (id {}): targets active 2, draining 0, stale 0; health healthy 2, unhealthy 0, unknown 0",
        world.service
    );
    assert!(text.contains(&service_line), "{text}");
    let source_line = text
        .lines()
        .find(|line| line.starts_with("  source web-registry (http): "))
        .unwrap_or_else(|| panic!("a line for the source: {text}"));
    assert!(
        source_line.starts_with(
            "  source web-registry (http): healthy, endpoints active/draining/stale 1/0/0, last success "
        ),
        "{source_line}"
    );
    assert!(source_line.contains(", next refresh "), "{source_line}");
    assert!(!source_line.contains("last error"), "{source_line}");
    let route_line = format!(
        "route split (id {route}): any host, prefix /api, header x-canary = 1 -> web 75 %, web{{tag=v2}} 25 %; cors, mirror shadow 5 %"
    );
    assert!(text.contains(&route_line), "{text}");
}

#[tokio::test]
async fn url_and_token_come_from_the_environment_and_json_parses() {
    let world = world().await;
    let url = admin_url(&world.gateway);
    let output = raahi_status(
        &["--output", "json"],
        &[
            ("RAAHI_ADMIN_URL", &url),
            ("RAAHI_ADMIN_TOKEN", ADMIN_TOKEN),
        ],
    )
    .await;
    assert!(output.status.success(), "{output:?}");
    let report: Value = serde_json::from_str(&stdout(&output)).expect("the output is JSON");
    let service = &report["services"][0];
    assert_eq!(service["name"], "web", "{report}");
    assert_eq!(service["id"], world.service, "{report}");
    assert_eq!(
        service["targets"],
        json!({"active": 2, "draining": 0, "stale": 0})
    );
    assert_eq!(
        service["health"],
        json!({"healthy": 2, "unhealthy": 0, "unknown": 0})
    );
    let source = &service["sources"][0];
    assert_eq!(source["name"], "web-registry", "{report}");
    assert_eq!(source["provider"], "http", "{report}");
    assert_eq!(source["state"], "healthy", "{report}");
    assert_eq!(
        source["endpoints"],
        json!({"active": 1, "draining": 0, "stale": 0})
    );
    assert!(source["last_success_at"].is_string(), "{report}");
    assert!(source["last_error"].is_null(), "{report}");
}

#[tokio::test]
async fn wrong_missing_or_viewer_token_exits_1_with_one_line_about_the_token() {
    let gateway = TestGateway::start().await;
    gateway
        .create("/api/v1/services", json!({ "name": "web" }))
        .await;
    let url = admin_url(&gateway);

    let wrong = raahi_status(&["--admin-url", &url, "--token", "not-the-token"], &[]).await;
    assert_eq!(wrong.status.code(), Some(1), "{wrong:?}");
    let message = stderr(&wrong);
    assert_eq!(message.lines().count(), 1, "{message}");
    assert!(message.contains("rejected the token"), "{message}");
    assert!(message.contains(&url), "{message}");
    assert!(stdout(&wrong).is_empty());

    let missing = raahi_status(&["--admin-url", &url], &[]).await;
    assert_eq!(missing.status.code(), Some(1), "{missing:?}");
    let message = stderr(&missing);
    assert!(message.contains("needs a token"), "{message}");
    assert!(message.contains("RAAHI_ADMIN_TOKEN"), "{message}");

    // A viewer reads services and targets, but discovery sources need the admin role.
    let (status, created) = gateway
        .api(
            "POST",
            "/api/v1/tokens",
            Some(json!({"name": "reader", "role": "viewer"})),
        )
        .await;
    assert_eq!(status, 201, "{created}");
    let viewer = created["token"].as_str().unwrap().to_owned();
    let forbidden = raahi_status(&["--admin-url", &url, "--token", &viewer], &[]).await;
    assert_eq!(forbidden.status.code(), Some(1), "{forbidden:?}");
    let message = stderr(&forbidden);
    assert_eq!(message.lines().count(), 1, "{message}");
    assert!(message.contains("token lacks the admin role"), "{message}");
}

#[tokio::test]
async fn unreachable_admin_api_exits_1_naming_the_url() {
    // A port that was free a moment ago: nothing listens there now.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let output = raahi_status(&["--admin-url", &url, "--token", ADMIN_TOKEN], &[]).await;
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let message = stderr(&output);
    assert_eq!(message.lines().count(), 1, "{message}");
    assert!(
        message.contains(&format!("cannot reach the admin API at {url}")),
        "{message}"
    );
}

/// A stand-in admin API that serves every list one item per page, to prove `status` follows
/// `next` cursors; it records the paths asked for.
async fn paging_admin() -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let asked = Arc::new(Mutex::new(Vec::new()));
    let log = asked.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let log = log.clone();
            let service = service_fn(move |request: Request<hyper::body::Incoming>| {
                let log = log.clone();
                async move {
                    let uri = request.uri().clone();
                    log.lock().unwrap().push(uri.to_string());
                    let after = uri
                        .query()
                        .unwrap_or("")
                        .split('&')
                        .find_map(|pair| pair.strip_prefix("after="))
                        .map(|n| n.parse::<i64>().unwrap());
                    let body = match (uri.path(), after) {
                        ("/api/v1/services", None) => {
                            json!({"items": [{"id": 1, "name": "a"}], "next": 1})
                        }
                        ("/api/v1/services", Some(1)) => {
                            json!({"items": [{"id": 2, "name": "b"}], "next": null})
                        }
                        (path, after) if path.ends_with("/targets") => {
                            let id = after.unwrap_or(0) + 1;
                            let (state, health) = match id {
                                1 => ("active", "healthy"),
                                2 => ("draining", "unknown"),
                                _ => ("stale", "unhealthy"),
                            };
                            let next = if id < 3 { json!(id) } else { json!(null) };
                            json!({"items": [{"id": id, "state": state, "health": health}], "next": next})
                        }
                        (path, _) if path.ends_with("/discovery-sources") => {
                            json!({"items": [], "next": null})
                        }
                        ("/api/v1/routes", None) => {
                            json!({"items": [{"id": 7, "name": "r7", "service_id": 1}], "next": 7})
                        }
                        ("/api/v1/routes", Some(7)) => {
                            json!({"items": [{"id": 8, "name": "r8", "service_id": 2}], "next": null})
                        }
                        _ => json!({"error": {"code": "not_found", "message": "no such page"}}),
                    };
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(body.to_string()))))
                }
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (format!("http://{addr}"), asked)
}

#[tokio::test]
async fn every_page_of_services_and_targets_is_read() {
    let (url, asked) = paging_admin().await;
    let output = raahi_status(&["--admin-url", &url, "--token", "t"], &[]).await;
    assert!(output.status.success(), "{output:?}");
    let text = stdout(&output);
    for name in ["a (id 1)", "b (id 2)"] {
        assert!(
            text.contains(&format!(
                "service {name}: targets active 1, draining 1, stale 1; health healthy 1, unhealthy 1, unknown 1"
            )),
            "{text}"
        );
    }
    let asked = asked.lock().unwrap().clone();
    assert!(
        asked
            .iter()
            .any(|p| p.starts_with("/api/v1/services?") && p.contains("after=1")),
        "{asked:?}"
    );
    assert!(
        asked
            .iter()
            .any(|p| p.starts_with("/api/v1/services/2/targets?") && p.contains("after=2")),
        "{asked:?}"
    );
    for line in [
        "route r7 (id 7): any host, prefix / -> a",
        "route r8 (id 8): any host, prefix / -> b",
    ] {
        assert!(text.contains(line), "{text}");
    }
}
