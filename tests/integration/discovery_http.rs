//! HTTP-registry discovery through real sockets (DESIGN.md §4 and §7): the discovery-source admin
//! API, the source lifecycle (pending, healthy, failing, stale, disabled), reconcile by provider
//! key, forced and coalesced refreshes, restart from the store, readiness, several sources on
//! one service and health kept across a flap. A real HTTP registry (`common::registry`) feeds
//! endpoints that point at real upstream servers.

use crate::common;
use common::registry::Registry;
use common::*;

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use reqwest::StatusCode;
use serde_json::{json, Value};

/// Longest wait for anything the gateway does on its own with the short timers used here.
const WAIT: Duration = Duration::from_secs(10);
const MIB: u64 = 1024 * 1024;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A registry endpoint pointing at a real upstream.
fn endpoint(key: &str, upstream: &Upstream, weight: u32, priority: i32) -> Value {
    json!({
        "key": key,
        "host": "127.0.0.1",
        "port": upstream.addr.port(),
        "weight": weight,
        "priority": priority,
    })
}

/// `endpoint` with `enabled` set.
fn endpoint_enabled(key: &str, upstream: &Upstream, weight: u32, priority: i32, on: bool) -> Value {
    let mut value = endpoint(key, upstream, weight, priority);
    value["enabled"] = json!(on);
    value
}

/// A service with a catch-all route.
async fn service_with_route(gateway: &TestGateway, name: &str) -> i64 {
    let service = gateway
        .create("/api/v1/services", json!({ "name": name }))
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({ "name": format!("{name}-all"), "service_id": service }),
        )
        .await;
    service
}

/// Merges the keys of `extra` (an object) into `base` (an object).
fn merged(mut base: Value, extra: Value) -> Value {
    let target = base.as_object_mut().expect("an object");
    for (key, value) in extra.as_object().expect("an object") {
        target.insert(key.clone(), value.clone());
    }
    base
}

/// An `http` source body: the registry URL and short timers, then `config` and `fields` on top.
fn http_source(name: &str, registry: &Registry, config: Value, fields: Value) -> Value {
    let config = merged(
        json!({
            "url": registry.url("/v1/endpoints"),
            "interval_ms": 200,
            "timeout_ms": 300,
        }),
        config,
    );
    merged(
        json!({
            "name": name,
            "provider": "http",
            "config": config,
            "stale_after_ms": 600_000,
            "removal_grace_ms": 2_000,
        }),
        fields,
    )
}

async fn add_source(gateway: &TestGateway, service: i64, body: Value) -> i64 {
    gateway
        .create(
            &format!("/api/v1/services/{service}/discovery-sources"),
            body,
        )
        .await
}

/// The targets a source owns in a service, by provider key.
async fn source_targets(
    gateway: &TestGateway,
    service: i64,
    source: i64,
) -> HashMap<String, Target> {
    gateway
        .targets(service)
        .await
        .into_iter()
        .filter(|target| target.source_id == Some(source))
        .map(|target| (target.key().to_owned(), target))
        .collect()
}

async fn target_status(gateway: &TestGateway, id: i64) -> (StatusCode, Value) {
    gateway
        .api("GET", &format!("/api/v1/targets/{id}"), None)
        .await
}

fn time_of(value: &Value) -> DateTime<Utc> {
    value
        .as_str()
        .unwrap_or_else(|| panic!("not a timestamp: {value}"))
        .parse()
        .unwrap_or_else(|e| panic!("not a timestamp: {value}: {e}"))
}

/// One GET through the proxy: status and body.
async fn fetch(gateway: &TestGateway) -> (StatusCode, String) {
    let response = gateway.get("/").await;
    let status = StatusCode::from_u16(response.status().as_u16()).unwrap();
    (status, response.text().await.unwrap())
}

/// Waits until the proxy answers with `status`.
async fn wait_proxy(gateway: &TestGateway, status: StatusCode) {
    let what = format!("the proxy to answer {status}");
    wait_until(&what, WAIT, || async {
        let (got, body) = fetch(gateway).await;
        if got == status {
            Ok(())
        } else {
            Err(format!("it answers {got}: {body}"))
        }
    })
    .await
}

fn hits(counts: &HashMap<String, usize>, name: &str) -> usize {
    counts.get(name).copied().unwrap_or(0)
}

/// The proxy's JSON error answer: status and `error.code`, `error.message`.
async fn proxy_error(gateway: &TestGateway) -> (StatusCode, String, String) {
    let response = gateway.get("/").await;
    let status = StatusCode::from_u16(response.status().as_u16()).unwrap();
    let text = response.text().await.unwrap();
    let body: Value = serde_json::from_str(&text)
        .unwrap_or_else(|_| panic!("error answer {status} is not JSON: {text}"));
    let error = ProxyError::read(&body);
    (status, error.code, error.message)
}

async fn list_sources(gateway: &TestGateway, service: i64) -> Vec<Value> {
    let list = gateway
        .get_ok(&format!("/api/v1/services/{service}/discovery-sources"))
        .await;
    assert!(list["next"].is_null(), "{list}");
    list["items"].as_array().expect("items").clone()
}

// ---------------------------------------------------------------------------------------------
// 1. Admin API
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn source_crud_fills_defaults_merges_patches_and_pages() {
    let gateway = TestGateway::start().await;
    let registry = Registry::start().await;
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    let base = format!("/api/v1/services/{service}/discovery-sources");
    let url = registry.url("/v1/endpoints");

    // Create: every default is filled in and stored.
    let (status, created) = gateway
        .api(
            "POST",
            &base,
            Some(json!({"name": "registry", "provider": "http", "config": {"url": url}})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let id = id_of(&created);
    assert_eq!(created["service_id"], service);
    assert_eq!(created["name"], "registry");
    assert_eq!(created["provider"], "http");
    assert_eq!(created["enabled"], true);
    assert_eq!(created["stale_after_ms"], 300_000);
    assert_eq!(created["removal_grace_ms"], 60_000);
    assert_eq!(
        created["config"],
        json!({
            "url": url,
            "headers": {},
            "tls_verify": true,
            "interval_ms": 30_000,
            "timeout_ms": 5_000,
            "weight": 100,
            "priority": 0,
        }),
        "the stored config has every default filled in"
    );
    time_of(&created["created_at"]);
    time_of(&created["updated_at"]);
    assert_eq!(
        gateway
            .get_ok(&format!("/api/v1/discovery-sources/{id}"))
            .await,
        created
    );

    // PATCH merges: a config patch keeps the other config keys.
    let (status, patched) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/discovery-sources/{id}"),
            Some(json!({
                "config": {"interval_ms": 1_000, "headers": {"X-Team": "blue"}},
                "removal_grace_ms": 5_000,
            })),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{patched}");
    assert_eq!(patched["id"], id);
    assert_eq!(patched["name"], "registry");
    assert_eq!(patched["stale_after_ms"], 300_000);
    assert_eq!(patched["removal_grace_ms"], 5_000);
    assert_eq!(
        patched["config"],
        json!({
            "url": url,
            "headers": {"X-Team": "blue"},
            "tls_verify": true,
            "interval_ms": 1_000,
            "timeout_ms": 5_000,
            "weight": 100,
            "priority": 0,
        })
    );
    assert_eq!(patched["created_at"], created["created_at"]);
    assert_eq!(
        gateway
            .get_ok(&format!("/api/v1/discovery-sources/{id}"))
            .await,
        patched
    );

    // PUT replaces: what it leaves out returns to the defaults.
    let other_url = registry.url("/v2/endpoints");
    let (status, replaced) = gateway
        .api(
            "PUT",
            &format!("/api/v1/discovery-sources/{id}"),
            Some(json!({
                "name": "registry-v2",
                "provider": "http",
                "config": {"url": other_url, "timeout_ms": 700, "endpoints_path": "data.items"},
            })),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{replaced}");
    assert_eq!(replaced["id"], id);
    assert_eq!(replaced["name"], "registry-v2");
    assert_eq!(replaced["removal_grace_ms"], 60_000);
    assert_eq!(
        replaced["config"],
        json!({
            "url": other_url,
            "endpoints_path": "data.items",
            "headers": {},
            "tls_verify": true,
            "interval_ms": 30_000,
            "timeout_ms": 700,
            "weight": 100,
            "priority": 0,
        })
    );
    assert_eq!(
        gateway
            .get_ok(&format!("/api/v1/discovery-sources/{id}"))
            .await,
        replaced
    );

    // Pagination.
    let second = add_source(
        &gateway,
        service,
        json!({"name": "b", "provider": "http", "config": {"url": url}}),
    )
    .await;
    let third = add_source(
        &gateway,
        service,
        json!({"name": "c", "provider": "http", "config": {"url": url}}),
    )
    .await;
    let page = gateway.get_ok(&format!("{base}?limit=2")).await;
    let ids: Vec<i64> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(id_of)
        .collect();
    assert_eq!(ids, [id, second], "{page}");
    assert_eq!(page["next"], second, "{page}");
    let rest = gateway
        .get_ok(&format!("{base}?limit=2&after={second}"))
        .await;
    let ids: Vec<i64> = rest["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(id_of)
        .collect();
    assert_eq!(ids, [third], "{rest}");
    assert!(rest["next"].is_null(), "{rest}");

    // DELETE, then every resource of the source is gone.
    let (status, body) = gateway
        .api("DELETE", &format!("/api/v1/discovery-sources/{id}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    assert!(body.is_null(), "204 has no body: {body}");
    for (method, path, body) in [
        ("GET", format!("/api/v1/discovery-sources/{id}"), None),
        (
            "GET",
            format!("/api/v1/discovery-sources/{id}/status"),
            None,
        ),
        (
            "POST",
            format!("/api/v1/discovery-sources/{id}/refresh"),
            None,
        ),
        (
            "PATCH",
            format!("/api/v1/discovery-sources/{id}"),
            Some(json!({"enabled": false})),
        ),
        (
            "PUT",
            format!("/api/v1/discovery-sources/{id}"),
            Some(json!({"name": "x", "provider": "http", "config": {"url": url}})),
        ),
        ("DELETE", format!("/api/v1/discovery-sources/{id}"), None),
    ] {
        let answer = gateway.api(method, &path, body).await;
        assert_error(
            &format!("{method} {path} after delete"),
            &answer,
            StatusCode::NOT_FOUND,
            "not_found",
            None,
        );
    }
    let remaining: Vec<i64> = list_sources(&gateway, service)
        .await
        .iter()
        .map(id_of)
        .collect();
    assert_eq!(remaining, [second, third]);

    // An unknown service has no sources to list.
    let answer = gateway
        .api("GET", "/api/v1/services/999999/discovery-sources", None)
        .await;
    assert_error(
        "list of unknown service",
        &answer,
        StatusCode::NOT_FOUND,
        "not_found",
        None,
    );
}

#[tokio::test]
async fn source_resources_are_admin_only_and_providers_are_open_to_viewers() {
    let gateway = TestGateway::start().await;
    let registry = Registry::start().await;
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    let body =
        json!({"name": "registry", "provider": "http", "config": {"url": registry.url("/")}});
    let source = add_source(&gateway, service, body.clone()).await;
    let before = gateway
        .get_ok(&format!("/api/v1/discovery-sources/{source}"))
        .await;

    let (status, token) = gateway
        .api(
            "POST",
            "/api/v1/tokens",
            Some(json!({"name": "dashboard", "role": "viewer"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{token}");
    let secret = token["token"].as_str().expect("the secret").to_owned();
    let viewer = Some(secret.as_str());

    let calls: Vec<(&str, String, Option<Value>)> = vec![
        (
            "GET",
            format!("/api/v1/services/{service}/discovery-sources"),
            None,
        ),
        (
            "POST",
            format!("/api/v1/services/{service}/discovery-sources"),
            Some(
                json!({"name": "sneaky", "provider": "http", "config": {"url": registry.url("/")}}),
            ),
        ),
        ("GET", format!("/api/v1/discovery-sources/{source}"), None),
        (
            "PUT",
            format!("/api/v1/discovery-sources/{source}"),
            Some(body.clone()),
        ),
        (
            "PATCH",
            format!("/api/v1/discovery-sources/{source}"),
            Some(json!({"enabled": false})),
        ),
        (
            "DELETE",
            format!("/api/v1/discovery-sources/{source}"),
            None,
        ),
        (
            "POST",
            format!("/api/v1/discovery-sources/{source}/refresh"),
            None,
        ),
    ];
    for (method, path, body) in &calls {
        let answer = gateway.api_as(viewer, method, path, body.clone()).await;
        assert_error(
            &format!("viewer {method} {path}"),
            &answer,
            StatusCode::FORBIDDEN,
            "forbidden",
            None,
        );
        let answer = gateway.api_as(None, method, path, body.clone()).await;
        assert_eq!(
            answer.0,
            StatusCode::UNAUTHORIZED,
            "anonymous {method} {path}: {}",
            answer.1
        );
    }
    // A source's status carries no config: viewers read it (the dashboard's refresh times),
    // anonymous callers do not.
    let status_path = format!("/api/v1/discovery-sources/{source}/status");
    let answer = gateway.api_as(viewer, "GET", &status_path, None).await;
    assert_eq!(
        answer.0,
        StatusCode::OK,
        "viewer GET {status_path}: {}",
        answer.1
    );
    assert!(answer.1.get("config").is_none(), "{}", answer.1);
    let answer = gateway.api_as(None, "GET", &status_path, None).await;
    assert_eq!(
        answer.0,
        StatusCode::UNAUTHORIZED,
        "anonymous GET {status_path}: {}",
        answer.1
    );
    // Nothing changed.
    assert_eq!(
        gateway
            .get_ok(&format!("/api/v1/discovery-sources/{source}"))
            .await,
        before
    );
    assert_eq!(list_sources(&gateway, service).await.len(), 1);

    // The providers descriptor is open to viewers (and not to anonymous callers).
    let (status, providers) = gateway
        .api_as(viewer, "GET", "/api/v1/discovery/providers", None)
        .await;
    assert_eq!(status, StatusCode::OK, "{providers}");
    assert_eq!(
        gateway.get_ok("/api/v1/discovery/providers").await,
        providers,
        "viewer and admin see the same descriptor"
    );
    let (status, _) = gateway
        .api_as(None, "GET", "/api/v1/discovery/providers", None)
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let providers = providers.as_array().expect("a JSON array").clone();
    let mut names: Vec<&str> = providers
        .iter()
        .map(|p| p["name"].as_str().expect("a name"))
        .collect();
    names.sort_unstable();
    assert_eq!(names, ["consul", "dns", "dns-srv", "http", "kubernetes"]);
    let by_name = |name: &str| {
        providers
            .iter()
            .find(|p| p["name"] == name)
            .unwrap()
            .clone()
    };
    for (name, required) in [
        ("dns", &["hostname", "port"][..]),
        ("dns-srv", &["service_name"][..]),
        ("http", &["url"][..]),
    ] {
        let descriptor = by_name(name);
        assert!(
            descriptor["description"]
                .as_str()
                .is_some_and(|d| !d.is_empty()),
            "{descriptor}"
        );
        let schema = &descriptor["config_schema"];
        assert!(schema.is_object(), "{name}: {schema}");
        assert!(schema["properties"].is_object(), "{name}: {schema}");
        for key in required {
            assert!(
                schema["required"]
                    .as_array()
                    .is_some_and(|r| r.contains(&json!(key))),
                "{name} requires {key}: {schema}"
            );
        }
        let defaults = &descriptor["defaults"];
        assert!(defaults.is_object(), "{name}: {descriptor}");
        assert_eq!(defaults["interval_ms"], 30_000, "{name}: {defaults}");
        assert_eq!(defaults["timeout_ms"], 5_000, "{name}: {defaults}");
        assert_eq!(defaults["weight"], 100, "{name}: {defaults}");
        assert_eq!(defaults["priority"], 0, "{name}: {defaults}");
        assert_eq!(descriptor["kind"], "poll", "{name}: {descriptor}");
    }
    let consul = by_name("consul");
    assert_eq!(consul["kind"], "watch", "{consul}");
    assert_eq!(consul["defaults"]["wait_ms"], 55_000, "{consul}");
    assert!(
        consul["config_schema"]["required"]
            .as_array()
            .is_some_and(|r| r.contains(&json!("service"))),
        "{consul}"
    );
    let http = by_name("http");
    assert_eq!(http["defaults"]["tls_verify"], true, "{http}");
    for key in [
        "url",
        "endpoints_path",
        "headers",
        "tls_verify",
        "interval_ms",
        "timeout_ms",
        "port",
        "weight",
        "priority",
    ] {
        assert!(
            http["config_schema"]["properties"][key].is_object(),
            "http config_schema describes {key}: {http}"
        );
    }
    assert_eq!(
        by_name("dns")["defaults"]["record_types"],
        json!(["a", "aaaa"])
    );
}

#[tokio::test]
async fn invalid_sources_are_refused_naming_the_field_and_nothing_is_stored() {
    let gateway = TestGateway::start().await;
    let registry = Registry::start().await;
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    let base = format!("/api/v1/services/{service}/discovery-sources");
    let url = registry.url("/v1/endpoints");
    let http = |config: Value| json!({"name": "registry", "provider": "http", "config": config});

    let cases: Vec<(&str, Value, &str)> = vec![
        ("missing url", http(json!({})), "config.url"),
        (
            "bad url scheme",
            http(json!({"url": "ftp://127.0.0.1/x"})),
            "config.url",
        ),
        ("not a url", http(json!({"url": "registry"})), "config.url"),
        (
            "unknown config key",
            http(json!({"url": url, "intervl_ms": 1000})),
            "config.intervl_ms",
        ),
        (
            "interval 0",
            http(json!({"url": url, "interval_ms": 0})),
            "config.interval_ms",
        ),
        (
            "timeout 0",
            http(json!({"url": url, "timeout_ms": 0})),
            "config.timeout_ms",
        ),
        (
            "port 0",
            http(json!({"url": url, "port": 0})),
            "config.port",
        ),
        (
            "weight too big",
            http(json!({"url": url, "weight": 70_000})),
            "config.weight",
        ),
        (
            "tls_verify not a bool",
            http(json!({"url": url, "tls_verify": "yes"})),
            "config.tls_verify",
        ),
        (
            "empty endpoints_path part",
            http(json!({"url": url, "endpoints_path": "data..items"})),
            "config.endpoints_path",
        ),
        (
            "bad header name",
            http(json!({"url": url, "headers": {"Bad Header": "x"}})),
            "config.headers.Bad Header",
        ),
        ("config not an object", http(json!("http://x/")), "config"),
        (
            "dns without port",
            json!({"name": "dns", "provider": "dns", "config": {"hostname": "api.internal"}}),
            "config.port",
        ),
        (
            "unknown provider",
            json!({"name": "c", "provider": "consul-ish", "config": {"url": url}}),
            "provider",
        ),
        (
            "stale_after_ms 0",
            merged(http(json!({"url": url})), json!({"stale_after_ms": 0})),
            "stale_after_ms",
        ),
        (
            "empty name",
            merged(http(json!({"url": url})), json!({"name": ""})),
            "name",
        ),
        (
            "unknown field",
            merged(http(json!({"url": url})), json!({"colour": "red"})),
            "colour",
        ),
    ];
    for (what, body, field) in &cases {
        let answer = gateway.api("POST", &base, Some(body.clone())).await;
        assert_error(
            what,
            &answer,
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation_failed",
            Some(field),
        );
    }
    let answer = gateway.api_raw("POST", &base, "{\"name\": ").await;
    assert_error(
        "malformed JSON",
        &answer,
        StatusCode::BAD_REQUEST,
        "malformed_request",
        None,
    );
    assert!(
        list_sources(&gateway, service).await.is_empty(),
        "nothing stored after a refusal"
    );

    // Duplicate name in one service: 409; the same name in another service is fine.
    let source = add_source(&gateway, service, http(json!({"url": url}))).await;
    let answer = gateway
        .api(
            "POST",
            &base,
            Some(http(json!({"url": registry.url("/other")}))),
        )
        .await;
    assert_error(
        "duplicate name",
        &answer,
        StatusCode::CONFLICT,
        "conflict",
        Some("name"),
    );
    let other_service = gateway
        .create("/api/v1/services", json!({"name": "api"}))
        .await;
    add_source(&gateway, other_service, http(json!({"url": url}))).await;

    // Unknown service: 404.
    let answer = gateway
        .api(
            "POST",
            "/api/v1/services/999999/discovery-sources",
            Some(http(json!({"url": url}))),
        )
        .await;
    assert_error(
        "unknown service",
        &answer,
        StatusCode::NOT_FOUND,
        "not_found",
        None,
    );

    // Bad updates are refused the same way and change nothing.
    let second = add_source(
        &gateway,
        service,
        json!({"name": "second", "provider": "http", "config": {"url": url}}),
    )
    .await;
    let stored = gateway
        .get_ok(&format!("/api/v1/discovery-sources/{source}"))
        .await;
    let path = format!("/api/v1/discovery-sources/{source}");
    for (what, method, body, status, code, field) in [
        (
            "PATCH bad scheme",
            "PATCH",
            json!({"config": {"url": "ftp://127.0.0.1/"}}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation_failed",
            "config.url",
        ),
        (
            "PATCH interval 0",
            "PATCH",
            json!({"config": {"interval_ms": 0}}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation_failed",
            "config.interval_ms",
        ),
        (
            "PATCH unknown config key",
            "PATCH",
            json!({"config": {"hostname": "x"}}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation_failed",
            "config.hostname",
        ),
        (
            "PUT without url",
            "PUT",
            http(json!({})),
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation_failed",
            "config.url",
        ),
        (
            "PATCH to a taken name",
            "PATCH",
            json!({"name": "second"}),
            StatusCode::CONFLICT,
            "conflict",
            "name",
        ),
    ] {
        let answer = gateway.api(method, &path, Some(body)).await;
        assert_error(what, &answer, status, code, Some(field));
    }
    assert_eq!(
        gateway.get_ok(&path).await,
        stored,
        "refused updates change nothing"
    );
    let ids: Vec<i64> = list_sources(&gateway, service)
        .await
        .iter()
        .map(id_of)
        .collect();
    assert_eq!(ids, [source, second]);
}

// ---------------------------------------------------------------------------------------------
// 2. Lifecycle and traffic
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_new_source_is_pending_then_healthy_and_traffic_follows_registry_weights_and_tiers() {
    // The 503 is read for the source's state: told only with `proxy.error_details = "full"`.
    let gateway = TestGateway::start_with_full_errors().await;
    let registry = Registry::start().await;
    let (a, b, c) = (
        Upstream::start("a").await,
        Upstream::start("b").await,
        Upstream::start("c").await,
    );
    let service = service_with_route(&gateway, "web").await;
    let mut first = endpoint("a", &a, 1, 0);
    first["metadata"] = json!({"zone": "z1"});
    let document = json!([first, endpoint("b", &b, 3, 0), endpoint("c", &c, 1, 1)]);
    registry.set_json(document);
    // The first refresh takes a while, so the pending state can be seen.
    registry.set_delay(Duration::from_millis(800));
    let source = add_source(
        &gateway,
        service,
        http_source(
            "registry",
            &registry,
            json!({"timeout_ms": 2_000}),
            json!({}),
        ),
    )
    .await;

    let pending = gateway.source_status(source).await;
    assert_eq!(pending.source_id, source, "{pending}");
    assert_eq!(pending.state, "pending", "{pending}");
    assert!(pending.revision.is_none(), "{pending}");
    assert!(pending.last_success_at.is_none(), "{pending}");
    assert!(pending.last_refresh_at.is_none(), "{pending}");
    assert!(pending.last_error.is_none(), "{pending}");
    assert!(
        pending.next_refresh_at.is_some(),
        "an enabled source has a next refresh: {pending}"
    );
    assert_eq!(pending.endpoints, counts(0, 0, 0), "{pending}");
    let (status, code, message) = proxy_error(&gateway).await;
    assert_eq!(
        (status, code.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "discovery_unavailable"),
        "only a pending source feeds the service"
    );
    assert!(message.contains("(pending)"), "{message}");

    let healthy = wait_state(&gateway, source, "healthy").await;
    registry.set_delay(Duration::ZERO);
    assert!(
        healthy.revision.as_deref().is_some_and(|r| !r.is_empty()),
        "{healthy}"
    );
    assert!(healthy.last_error.is_none(), "{healthy}");
    let success = healthy.last_success_at.expect("last_success_at");
    assert!(
        healthy.last_refresh_at.expect("last_refresh_at") >= success,
        "{healthy}"
    );
    assert!(
        healthy.next_refresh_at.expect("next_refresh_at") > success,
        "{healthy}"
    );
    assert_eq!(healthy.endpoints, counts(3, 0, 0), "{healthy}");

    let targets = source_targets(&gateway, service, source).await;
    assert_eq!(targets.len(), 3, "{targets:?}");
    for (key, upstream, weight, priority) in [("a", &a, 1, 0), ("b", &b, 3, 0), ("c", &c, 1, 1)] {
        let target = &targets[key];
        assert_eq!(target.service_id, service, "{target}");
        assert_eq!(target.source_id, Some(source), "{target}");
        assert_eq!(target.host, "127.0.0.1", "{target}");
        assert_eq!(target.port, upstream.addr.port(), "{target}");
        assert_eq!(target.weight, weight, "{target}");
        assert_eq!(target.priority, priority, "{target}");
        assert!(target.enabled, "{target}");
        assert_eq!(target.state, "active", "{target}");
        assert_eq!(target.health, "unknown", "{target}");
        assert!(target.remove_at.is_none(), "{target}");
    }
    assert_eq!(targets["a"].metadata, json!({"zone": "z1"}));
    assert_eq!(targets["b"].metadata, json!({}));

    // Weights 1:3 within tier 0; tier 1 gets nothing while tier 0 is available.
    wait_proxy(&gateway, StatusCode::OK).await;
    let counts_seen = spread(&gateway, "/", 1_000, 4).await;
    let (to_a, to_b, to_c) = (
        hits(&counts_seen, "a"),
        hits(&counts_seen, "b"),
        hits(&counts_seen, "c"),
    );
    assert_eq!(to_a + to_b, 1_000, "{counts_seen:?}");
    assert_eq!(to_c, 0, "the lower tier gets nothing: {counts_seen:?}");
    assert!(
        (200..=300).contains(&to_a),
        "a gets 25 % ± 5: {counts_seen:?}"
    );
    assert!(
        (700..=800).contains(&to_b),
        "b gets 75 % ± 5: {counts_seen:?}"
    );

    // The registry disables tier 0: traffic fails over to tier 1.
    registry.set_json(json!([
        endpoint_enabled("a", &a, 1, 0, false),
        endpoint_enabled("b", &b, 3, 0, false),
        endpoint("c", &c, 1, 1),
    ]));
    let (ida, idb) = (id_of(&targets["a"]), id_of(&targets["b"]));
    wait_until("tier 0 disabled", WAIT, || async {
        let (a, b) = (gateway.target(ida).await, gateway.target(idb).await);
        if !a.enabled && !b.enabled {
            Ok(())
        } else {
            Err(format!("{a}\n{b}"))
        }
    })
    .await;
    let status = gateway.source_status(source).await;
    assert_eq!(
        status.endpoints,
        counts(3, 0, 0),
        "disabled endpoints stay active targets: {status}"
    );
    let counts_seen = spread(&gateway, "/", 100, 2).await;
    assert_eq!(hits(&counts_seen, "c"), 100, "{counts_seen:?}");

    // Tier 0 back.
    registry.set_json(json!([
        endpoint("a", &a, 1, 0),
        endpoint("b", &b, 3, 0),
        endpoint("c", &c, 1, 1),
    ]));
    wait_until("tier 0 enabled", WAIT, || async {
        let (a, b) = (gateway.target(ida).await, gateway.target(idb).await);
        if a.enabled && b.enabled {
            Ok(())
        } else {
            Err(format!("{a}\n{b}"))
        }
    })
    .await;
    let counts_seen = spread(&gateway, "/", 100, 2).await;
    assert_eq!(hits(&counts_seen, "c"), 0, "{counts_seen:?}");
    assert_eq!(hits(&counts_seen, "a") + hits(&counts_seen, "b"), 100);
}

// ---------------------------------------------------------------------------------------------
// 3. Failed refreshes
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn bad_registry_answers_make_the_source_failing_while_last_known_good_targets_serve() {
    let gateway = TestGateway::start().await;
    let registry = Registry::start().await;
    let a = Upstream::start("a").await;
    let service = service_with_route(&gateway, "web").await;
    let good = json!([endpoint("a", &a, 100, 0)]);
    registry.set_json(good.clone());
    let source = add_source(
        &gateway,
        service,
        http_source(
            "registry",
            &registry,
            json!({"timeout_ms": 1_000}),
            json!({}),
        ),
    )
    .await;
    let healthy = wait_state(&gateway, source, "healthy").await;
    let revision = healthy.revision.clone();
    let target = id_of(&source_targets(&gateway, service, source).await["a"]);
    wait_proxy(&gateway, StatusCode::OK).await;
    let url = registry.url("/v1/endpoints");

    type Setup = Box<dyn Fn(&Registry)>;
    let cases: Vec<(&str, Setup, Vec<String>)> = vec![
        (
            "invalid JSON",
            Box::new(|r| r.set_raw(200, "application/json", &b"[{\"host\": "[..])),
            vec!["invalid JSON".into()],
        ),
        (
            "HTTP 500",
            Box::new(|r| r.set_raw(500, "text/plain", &b"boom"[..])),
            vec!["500".into()],
        ),
        (
            "slower than timeout_ms",
            Box::new(|r| r.set_delay(Duration::from_millis(2_500))),
            vec!["timed out".into()],
        ),
        (
            "over 10 MiB with Content-Length",
            Box::new(|r| r.set_huge(11 * MIB, false)),
            vec!["larger than".into()],
        ),
        (
            "over 10 MiB chunked",
            Box::new(|r| r.set_huge(11 * MIB, true)),
            vec!["larger than".into()],
        ),
        (
            "endpoint without host",
            Box::new(move |r| {
                r.set_json(json!([
                    {"key": "a", "host": "127.0.0.1", "port": 1},
                    {"key": "b", "port": 2},
                ]))
            }),
            vec!["endpoints[1].host".into()],
        ),
        (
            "port out of range",
            Box::new(|r| r.set_json(json!([{"key": "a", "host": "127.0.0.1", "port": 70_000}]))),
            vec!["endpoints[0].port".into()],
        ),
        (
            "port not a number",
            Box::new(|r| r.set_json(json!([{"key": "a", "host": "127.0.0.1", "port": "80"}]))),
            vec!["endpoints[0].port".into()],
        ),
        (
            "host name instead of an IP",
            Box::new(|r| r.set_json(json!([{"key": "a", "host": "backend.internal", "port": 80}]))),
            vec!["endpoints[0].host".into()],
        ),
        (
            "an object where the array should be",
            Box::new(|r| r.set_json(json!({"items": []}))),
            vec!["expected a JSON array".into()],
        ),
    ];

    let mut problems = Vec::new();
    let mut last_good = healthy.clone();
    for (what, setup, needles) in &cases {
        setup(&registry);
        let failing = wait_state(&gateway, source, "failing").await;
        let error = failing.last_error.as_deref().unwrap_or_default().to_owned();
        for needle in needles.iter().chain([&url]) {
            if !error.contains(needle.as_str()) {
                problems.push(format!(
                    "{what}: last_error {error:?} does not contain {needle:?}"
                ));
            }
        }
        assert_eq!(failing.revision, revision, "{what}: {failing}");
        assert!(
            failing.last_success_at.expect("last_success_at")
                >= last_good.last_success_at.expect("last_success_at")
                && failing.last_success_at.expect("last_success_at")
                    < failing.last_refresh_at.expect("last_refresh_at"),
            "{what}: last_success_at is the last good refresh: {failing}"
        );
        assert_eq!(failing.endpoints, counts(1, 0, 0), "{what}: {failing}");
        // The last known good target keeps serving.
        for _ in 0..5 {
            assert_eq!(
                fetch(&gateway).await,
                (StatusCode::OK, "a".to_owned()),
                "{what}"
            );
        }
        let kept = gateway.target(target).await;
        assert_eq!(kept.state, "active", "{what}: {kept}");

        // A good answer heals it.
        registry.set_delay(Duration::ZERO);
        registry.set_json(good.clone());
        let healed = wait_state(&gateway, source, "healthy").await;
        assert!(healed.last_error.is_none(), "{what}: {healed}");
        assert_eq!(
            healed.revision, revision,
            "{what}: same document, same revision"
        );
        last_good = healed;
        assert_eq!(
            id_of(&source_targets(&gateway, service, source).await["a"]),
            target,
            "{what}"
        );
    }
    assert!(
        problems.is_empty(),
        "imprecise last_error:\n{}",
        problems.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// 4. Stale
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_source_failing_past_stale_after_turns_stale_then_recovers_with_the_same_targets() {
    // The 503 is read for the source's state: told only with `proxy.error_details = "full"`.
    let gateway = TestGateway::start_with_full_errors().await;
    let registry = Registry::start().await;
    let (a, b) = (Upstream::start("a").await, Upstream::start("b").await);
    let service = service_with_route(&gateway, "web").await;
    let document = json!([endpoint("a", &a, 100, 0), endpoint("b", &b, 100, 0)]);
    registry.set_json(document.clone());
    let source = add_source(
        &gateway,
        service,
        http_source(
            "registry",
            &registry,
            json!({}),
            json!({"stale_after_ms": 1_500}),
        ),
    )
    .await;
    wait_state(&gateway, source, "healthy").await;
    let before = source_targets(&gateway, service, source).await;
    wait_proxy(&gateway, StatusCode::OK).await;

    registry.set_raw(503, "text/plain", &b"maintenance"[..]);
    let broke_at = Instant::now();
    let failing = wait_state(&gateway, source, "failing").await;
    assert!(
        failing.failing_since.expect("failing_since")
            <= failing.last_refresh_at.expect("last_refresh_at"),
        "{failing}"
    );
    assert_eq!(failing.endpoints, counts(2, 0, 0), "{failing}");
    assert_eq!(
        fetch(&gateway).await.0,
        StatusCode::OK,
        "failing still serves"
    );

    let stale = wait_state(&gateway, source, "stale").await;
    let after = broke_at.elapsed();
    assert!(
        after >= Duration::from_millis(1_450),
        "stale only after stale_after_ms of failures, got stale after {after:?}"
    );
    assert!(
        stale
            .last_error
            .as_deref()
            .unwrap_or_default()
            .contains("503"),
        "{stale}"
    );
    let stale = wait_status(&gateway, source, "targets stale", |s| {
        s.endpoints == counts(0, 0, 2)
    })
    .await;
    assert_eq!(stale.state, "stale");
    for target in source_targets(&gateway, service, source).await.values() {
        assert_eq!(target.state, "stale", "{target}");
    }
    wait_proxy(&gateway, StatusCode::SERVICE_UNAVAILABLE).await;
    let (status, code, message) = proxy_error(&gateway).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(code, "discovery_unavailable");
    assert!(
        message.contains("web") && message.contains("(stale)"),
        "{message}"
    );

    // Still stale while the failures go on (only a success brings it back).
    holds_for("the source stale", Duration::from_millis(500), || async {
        let status = gateway.source_status(source).await;
        if status.state == "stale" {
            Ok(())
        } else {
            Err(status)
        }
    })
    .await;

    registry.set_json(document);
    let healthy = wait_state(&gateway, source, "healthy").await;
    assert!(healthy.last_error.is_none(), "{healthy}");
    let healthy = wait_status(&gateway, source, "targets active", |s| {
        s.endpoints == counts(2, 0, 0)
    })
    .await;
    assert_eq!(healthy.state, "healthy");
    let after = source_targets(&gateway, service, source).await;
    for key in ["a", "b"] {
        assert_eq!(
            id_of(&after[key]),
            id_of(&before[key]),
            "{key} keeps its id"
        );
        assert_eq!(after[key].state, "active", "{}", after[key]);
    }
    wait_proxy(&gateway, StatusCode::OK).await;
    let seen = spread(&gateway, "/", 40, 2).await;
    assert_eq!(hits(&seen, "a"), 20, "{seen:?}");
    assert_eq!(hits(&seen, "b"), 20, "{seen:?}");
}

// ---------------------------------------------------------------------------------------------
// 5. Reconcile by key
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn reconcile_by_key_keeps_ids_drains_removed_endpoints_and_tracks_the_revision() {
    let gateway = TestGateway::start().await;
    let registry = Registry::start().await;
    let (a, b, c) = (
        Upstream::start("a").await,
        Upstream::start("b").await,
        Upstream::start("c").await,
    );
    let service = service_with_route(&gateway, "web").await;
    let grace = 1_500;
    registry.set_json(json!([
        endpoint("a", &a, 100, 0),
        endpoint("b", &b, 100, 0),
        endpoint("c", &c, 100, 0),
    ]));
    let source = add_source(
        &gateway,
        service,
        http_source(
            "registry",
            &registry,
            json!({}),
            // This test empties the registry on purpose; discovery_safety.rs tests the guard.
            json!({"removal_grace_ms": grace, "removal_guard": null}),
        ),
    )
    .await;
    let first = wait_state(&gateway, source, "healthy").await;
    let r1 = first.revision.as_deref().unwrap().to_owned();
    let targets = source_targets(&gateway, service, source).await;
    let (ida, idb, idc) = (
        id_of(&targets["a"]),
        id_of(&targets["b"]),
        id_of(&targets["c"]),
    );

    // The same document again: refreshes happen, nothing changes, the revision stays.
    let asked = registry.requests();
    wait_until("three more refreshes", WAIT, || async {
        (registry.requests() >= asked + 3).then_some(())
    })
    .await;
    let again = wait_status(&gateway, source, "a later refresh recorded", |s| {
        s.last_refresh_at != first.last_refresh_at
    })
    .await;
    assert_eq!(again.state, "healthy", "{again}");
    assert_eq!(
        again.revision.as_deref(),
        Some(r1.as_str()),
        "a no-op refresh keeps the revision: {again}"
    );
    assert_eq!(
        source_targets(&gateway, service, source).await,
        targets,
        "a no-op refresh writes nothing"
    );
    // The same endpoints in another order are the same set.
    registry.set_json(json!([
        endpoint("c", &c, 100, 0),
        endpoint("b", &b, 100, 0),
        endpoint("a", &a, 100, 0),
    ]));
    let asked = registry.requests();
    wait_until("two more refreshes", WAIT, || async {
        (registry.requests() >= asked + 2).then_some(())
    })
    .await;
    holds_for("revision r1", Duration::from_millis(100), || async {
        let status = gateway.source_status(source).await;
        if status.revision.as_deref() == Some(r1.as_str()) {
            Ok(())
        } else {
            Err(status)
        }
    })
    .await;

    // A changed field: same id, new weight, new revision.
    registry.set_json(json!([
        endpoint("a", &a, 300, 0),
        endpoint("b", &b, 100, 0),
        endpoint("c", &c, 100, 0),
    ]));
    let changed = wait_target(&gateway, ida, "weight 300", |target| target.weight == 300).await;
    assert_eq!(id_of(&changed), ida);
    assert_eq!(changed.state, "active", "{changed}");
    assert_eq!(changed.created_at, targets["a"].created_at, "{changed}");
    let r2 = wait_status(&gateway, source, "a new revision", |s| {
        s.revision.as_deref() != Some(r1.as_str())
    })
    .await
    .revision
    .expect("a revision");

    // An endpoint removed: draining with a deadline, no new traffic, requests in flight finish.
    wait_proxy(&gateway, StatusCode::OK).await;
    let in_flight: Vec<_> = (0..10)
        .map(|_| {
            let client = gateway.http.clone();
            let url = gateway.proxy_url("/slow/1000");
            tokio::spawn(async move {
                let response = client.get(url).send().await.expect("proxy answers");
                (response.status().as_u16(), response.text().await.unwrap())
            })
        })
        .collect();
    wait_until("a slow request reached b", WAIT, || async {
        b.seen
            .lock()
            .unwrap()
            .iter()
            .any(|seen| seen.path == "/slow/1000")
            .then_some(())
    })
    .await;
    registry.set_json(json!([
        endpoint("a", &a, 300, 0),
        endpoint("c", &c, 100, 0)
    ]));
    let draining = wait_target(&gateway, idb, "draining", |target| {
        target.state == "draining"
    })
    .await;
    let remove_at = draining.remove_at.expect("remove_at");
    let marked = draining.updated_at;
    let left = (remove_at - marked).num_milliseconds();
    assert!(
        (grace - 700..=grace + 100).contains(&left),
        "remove_at is removal_grace_ms after the drain: {left} ms: {draining}"
    );
    // Targets are written before the progress, so wait for both.
    wait_status(&gateway, source, "one draining, a new revision", |s| {
        s.endpoints == counts(2, 1, 0) && s.revision.as_deref() != Some(r2.as_str())
    })
    .await;
    wait_until("b gets no new traffic", WAIT, || async {
        let before = b.hits();
        let seen = spread(&gateway, "/", 20, 1).await;
        (hits(&seen, "b") == 0 && b.hits() == before).then_some(())
    })
    .await;
    let mut finished_on_b = 0;
    for request in in_flight {
        let (status, body) = request.await.expect("request task");
        assert_eq!(status, 200, "an in-flight request finishes: {body}");
        finished_on_b += usize::from(body == "b");
    }
    assert!(
        finished_on_b >= 1,
        "a request in flight on b when it began draining finished"
    );

    // It comes back within the grace: same id, active again, no deadline.
    registry.set_json(json!([
        endpoint("a", &a, 300, 0),
        endpoint("b", &b, 100, 0),
        endpoint("c", &c, 100, 0),
    ]));
    // The target must stay (answer 200) within its grace: `wait_target` fails on a 404.
    let back = wait_target(&gateway, idb, "active again", |target| {
        target.state == "active"
    })
    .await;
    assert!(back.remove_at.is_none(), "{back}");
    // The same endpoint set as before has the same revision again.
    wait_status(&gateway, source, "revision r2 again", |s| {
        s.revision.as_deref() == Some(r2.as_str()) && s.endpoints == counts(3, 0, 0)
    })
    .await;
    wait_until("b gets traffic again", WAIT, || async {
        (hits(&spread(&gateway, "/", 20, 1).await, "b") > 0).then_some(())
    })
    .await;

    // An endpoint removed for longer than the grace: deleted when it ends.
    registry.set_json(json!([
        endpoint("a", &a, 300, 0),
        endpoint("b", &b, 100, 0)
    ]));
    let removed_at = Instant::now();
    wait_target(&gateway, idc, "draining", |target| {
        target.state == "draining"
    })
    .await;
    wait_until("c deleted", WAIT, || async {
        (target_status(&gateway, idc).await.0 == StatusCode::NOT_FOUND).then_some(())
    })
    .await;
    let lasted = removed_at.elapsed();
    assert!(
        lasted >= Duration::from_millis(grace as u64 - 50),
        "deleted only when removal_grace_ms ends: after {lasted:?}"
    );
    wait_status(&gateway, source, "c gone", |s| {
        s.endpoints == counts(2, 0, 0)
    })
    .await;

    // It returns after its deletion: a new target with a new id.
    registry.set_json(json!([
        endpoint("a", &a, 300, 0),
        endpoint("b", &b, 100, 0),
        endpoint("c", &c, 100, 0),
    ]));
    let returned = wait_until("c back", WAIT, || async {
        source_targets(&gateway, service, source).await.remove("c")
    })
    .await;
    assert_ne!(
        id_of(&returned),
        idc,
        "a deleted target does not come back: {returned}"
    );
    assert_eq!(returned.state, "active", "{returned}");
    assert_eq!(returned.health, "unknown", "{returned}");

    // An empty list is a successful refresh: everything drains, nothing takes new traffic.
    registry.set_json(json!([]));
    let empty = wait_status(&gateway, source, "all draining", |s| {
        s.endpoints == counts(0, 3, 0)
    })
    .await;
    assert_eq!(empty.state, "healthy", "{empty}");
    assert!(empty.last_error.is_none(), "{empty}");
    wait_proxy(&gateway, StatusCode::SERVICE_UNAVAILABLE).await;
    assert_eq!(proxy_error(&gateway).await.1, "no_available_target");
}

// ---------------------------------------------------------------------------------------------
// 6. Forced refresh
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn refresh_answers_at_once_picks_up_changes_before_the_interval_and_coalesces() {
    let gateway = TestGateway::start().await;
    let registry = Registry::start().await;
    let (a, b) = (Upstream::start("a").await, Upstream::start("b").await);
    let service = service_with_route(&gateway, "web").await;
    registry.set_json(json!([endpoint("a", &a, 100, 0)]));
    let source = add_source(
        &gateway,
        service,
        http_source(
            "registry",
            &registry,
            json!({"interval_ms": 60_000, "timeout_ms": 2_000}),
            json!({}),
        ),
    )
    .await;
    let first = wait_state(&gateway, source, "healthy").await;
    assert_eq!(registry.requests(), 1, "one refresh at start");
    let interval = first.next_refresh_at.expect("next_refresh_at")
        - first.last_refresh_at.expect("last_refresh_at");
    assert!(
        (54_000..=60_000).contains(&interval.num_milliseconds()),
        "next refresh is interval_ms less up to 10 % jitter later: {first}"
    );

    // A registry change waits for the interval...
    registry.set_json(json!([
        endpoint("a", &a, 100, 0),
        endpoint("b", &b, 100, 0)
    ]));
    holds_for(
        "no refresh before the interval",
        Duration::from_millis(700),
        || async {
            let status = gateway.source_status(source).await;
            let requests = registry.requests();
            if requests == 1 && status.endpoints == counts(1, 0, 0) {
                Ok(())
            } else {
                Err(format!("{requests} registry requests; {status}"))
            }
        },
    )
    .await;

    // ...unless a refresh is forced. It answers 202 at once, with the status as it is.
    // The registry answers slowly (timeout_ms is 2000), so a refresh that waited would show.
    registry.set_delay(Duration::from_millis(1_000));
    let refresh = format!("/api/v1/discovery-sources/{source}/refresh");
    let started = Instant::now();
    let (status, answer) = gateway.api("POST", &refresh, None).await;
    let took = started.elapsed();
    assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
    assert!(
        took < Duration::from_millis(700),
        "refresh does not wait: took {took:?}"
    );
    let answer = SourceStatus::read(answer);
    assert_eq!(answer.source_id, source, "{answer}");
    assert_eq!(answer.state, "healthy", "{answer}");
    assert_eq!(
        answer.endpoints,
        counts(1, 0, 0),
        "the current status: {answer}"
    );
    assert_eq!(answer.revision, first.revision, "{answer}");

    // More refresh calls while that one is in flight join it.
    wait_until("the forced refresh reached the registry", WAIT, || async {
        (registry.requests() == 2).then_some(())
    })
    .await;
    for _ in 0..4 {
        let (status, answer) = gateway.api("POST", &refresh, None).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
    }
    // Targets are written before the progress, so wait for both.
    wait_status(&gateway, source, "both endpoints, a new revision", |s| {
        s.endpoints == counts(2, 0, 0) && s.revision != first.revision
    })
    .await;
    holds_for(
        "refresh calls during a running refresh coalesced into it",
        Duration::from_millis(800),
        || async {
            let requests = registry.requests();
            if requests == 2 {
                Ok(())
            } else {
                Err(format!("{requests} registry requests"))
            }
        },
    )
    .await;
    wait_proxy(&gateway, StatusCode::OK).await;
    let seen = spread(&gateway, "/", 20, 1).await;
    assert_eq!((hits(&seen, "a"), hits(&seen, "b")), (10, 10), "{seen:?}");

    // A forced refresh after the last one finished runs again.
    registry.set_delay(Duration::ZERO);
    let (status, _) = gateway.api("POST", &refresh, None).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    wait_until("another refresh", WAIT, || async {
        (registry.requests() == 3).then_some(())
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// 7. Headers, endpoints_path and config defaults
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn configured_headers_reach_the_registry_and_endpoints_path_finds_the_array() {
    let gateway = TestGateway::start().await;
    let registry = Registry::start().await;
    let (a, b) = (Upstream::start("a").await, Upstream::start("b").await);
    let service = service_with_route(&gateway, "web").await;
    let good = json!({
        "data": {
            "items": [
                // No port and no weight: the source's config supplies them.
                {"key": "a", "host": "127.0.0.1", "metadata": {"zone": "z"}},
                // No key: host:port is the key.
                {"host": "127.0.0.1", "port": b.addr.port(), "weight": 42, "extra": "ignored"},
            ],
            "total": 2,
        }
    });
    registry.set_json(good.clone());
    let source = add_source(
        &gateway,
        service,
        http_source(
            "registry",
            &registry,
            json!({
                "endpoints_path": "data.items",
                "headers": {"Authorization": "Bearer s3cret", "X-Tenant": "blue"},
                "port": a.addr.port(),
                "weight": 7,
            }),
            json!({}),
        ),
    )
    .await;
    wait_state(&gateway, source, "healthy").await;
    let headers = registry.last_headers();
    assert_eq!(
        headers.get("authorization").unwrap(),
        "Bearer s3cret",
        "{headers:?}"
    );
    assert_eq!(headers.get("x-tenant").unwrap(), "blue", "{headers:?}");
    assert_eq!(
        headers.get("accept").unwrap(),
        "application/json",
        "{headers:?}"
    );

    let targets = source_targets(&gateway, service, source).await;
    let b_key = format!("127.0.0.1:{}", b.addr.port());
    let keys: BTreeSet<&str> = targets.keys().map(String::as_str).collect();
    assert_eq!(keys, BTreeSet::from(["a", b_key.as_str()]), "{targets:?}");
    let ta = &targets["a"];
    assert_eq!(ta.port, a.addr.port(), "config port: {ta}");
    assert_eq!(ta.weight, 7, "config weight: {ta}");
    assert_eq!(ta.priority, 0, "{ta}");
    assert_eq!(ta.metadata, json!({"zone": "z"}), "{ta}");
    assert_eq!(targets[&b_key].weight, 42, "{}", targets[&b_key]);
    wait_proxy(&gateway, StatusCode::OK).await;
    let seen = spread(&gateway, "/", 49, 1).await;
    assert!(
        (5..=9).contains(&hits(&seen, "a")),
        "weights 7:42: {seen:?}"
    );
    assert_eq!(hits(&seen, "a") + hits(&seen, "b"), 49, "{seen:?}");

    // endpoints_path pointing at a non-array, or at nothing: failing, last known good serves.
    for (document, needles) in [
        (
            json!({"data": {"items": {"host": "127.0.0.1", "port": 80}}}),
            ["data.items", "expected an array"],
        ),
        (json!({"data": {"nodes": []}}), ["data.items", "not found"]),
    ] {
        registry.set_json(document.clone());
        let failing = wait_state(&gateway, source, "failing").await;
        let error = failing.last_error.as_deref().unwrap_or_default();
        for needle in needles {
            assert!(
                error.contains(needle),
                "{document}: {error:?} names {needle:?}"
            );
        }
        assert_eq!(failing.endpoints, counts(2, 0, 0), "{failing}");
        assert_eq!(fetch(&gateway).await.0, StatusCode::OK);
        registry.set_json(good.clone());
        let healed = wait_state(&gateway, source, "healthy").await;
        assert!(healed.last_error.is_none(), "{healed}");
    }
}

// ---------------------------------------------------------------------------------------------
// 8. Restart
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn after_a_restart_the_last_known_good_targets_serve_at_once_and_deadlines_survive() {
    let gateway = TestGateway::start().await;
    let registry = Registry::start().await;
    let (a, b, c) = (
        Upstream::start("a").await,
        Upstream::start("b").await,
        Upstream::start("c").await,
    );
    let service = service_with_route(&gateway, "web").await;
    registry.set_json(json!([
        endpoint("a", &a, 100, 0),
        endpoint("b", &b, 100, 0),
        endpoint("c", &c, 100, 0),
    ]));
    let source = add_source(
        &gateway,
        service,
        http_source(
            "registry",
            &registry,
            json!({}),
            json!({"removal_grace_ms": 4_000}),
        ),
    )
    .await;
    wait_status(&gateway, source, "three endpoints", |s| {
        s.state == "healthy" && s.endpoints == counts(3, 0, 0)
    })
    .await;
    let idc = id_of(&source_targets(&gateway, service, source).await["c"]);
    // c leaves: draining with a deadline that must survive the restart.
    registry.set_json(json!([
        endpoint("a", &a, 100, 0),
        endpoint("b", &b, 100, 0)
    ]));
    let draining = wait_target(&gateway, idc, "draining", |target| {
        target.state == "draining"
    })
    .await;
    wait_proxy(&gateway, StatusCode::OK).await;

    // The registry goes down; wait until no refresh can succeed any more.
    registry.set_raw(500, "text/plain", &b"down"[..]);
    let before = wait_state(&gateway, source, "failing").await;
    assert!(before.revision.is_some(), "{before}");
    let targets_before = source_targets(&gateway, service, source).await;

    let gateway = gateway.restart().await;
    // The first request after the restart is served by the stored targets.
    let (status, body) = fetch(&gateway).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "first request after restart: {body}"
    );
    assert!(body == "a" || body == "b", "{body}");
    let after = gateway.source_status(source).await;
    assert_eq!(
        after.revision, before.revision,
        "persisted revision: {after}"
    );
    assert_eq!(
        after.last_success_at, before.last_success_at,
        "persisted last_success_at: {after}"
    );
    assert_ne!(after.state, "pending", "{after}");
    let failing = wait_status(&gateway, source, "a failed refresh after restart", |s| {
        s.state == "failing" && s.last_refresh_at != before.last_refresh_at
    })
    .await;
    assert_eq!(failing.revision, before.revision, "{failing}");
    assert!(
        failing
            .last_error
            .as_deref()
            .unwrap_or_default()
            .contains("500"),
        "{failing}"
    );
    let seen = spread(&gateway, "/", 20, 1).await;
    assert_eq!((hits(&seen, "a"), hits(&seen, "b")), (10, 10), "{seen:?}");

    // The targets and c's deadline came back from the store.
    let targets_after = source_targets(&gateway, service, source).await;
    for (key, target) in &targets_before {
        assert_eq!(id_of(&targets_after[key]), id_of(target), "{key}");
        assert_eq!(targets_after[key].state, target.state, "{key}");
    }
    let kept = gateway.target(idc).await;
    assert_eq!(kept.state, "draining", "{kept}");
    assert_eq!(kept.remove_at, draining.remove_at, "{kept}");
    let deadline = draining.remove_at.expect("remove_at");
    wait_until("c deleted at its deadline", WAIT, || async {
        (target_status(&gateway, idc).await.0 == StatusCode::NOT_FOUND).then_some(())
    })
    .await;
    assert!(
        Utc::now() >= deadline,
        "deleted no earlier than remove_at {deadline}"
    );
}

// ---------------------------------------------------------------------------------------------
// 9. Readiness
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn readyz_waits_for_the_first_refresh_of_an_enabled_source() {
    let gateway = TestGateway::start().await;
    let registry = Registry::start().await;
    let a = Upstream::start("a").await;
    let readyz = || async {
        let (status, body) = gateway.readyz().await;
        (StatusCode::from_u16(status).unwrap(), body.to_string())
    };
    assert_eq!(readyz().await.0, StatusCode::OK, "ready without sources");

    let service = service_with_route(&gateway, "web").await;
    registry.set_json(json!([endpoint("a", &a, 100, 0)]));
    registry.set_delay(Duration::from_millis(1_500));

    // A disabled source never refreshes and does not hold readiness.
    let idle = Registry::start().await;
    let disabled = add_source(
        &gateway,
        service,
        http_source(
            "idle",
            &idle,
            json!({"timeout_ms": 4_000}),
            json!({"enabled": false}),
        ),
    )
    .await;
    let status = gateway.source_status(disabled).await;
    assert_eq!(status.state, "disabled", "{status}");
    assert!(status.next_refresh_at.is_none(), "{status}");
    assert_eq!(
        readyz().await.0,
        StatusCode::OK,
        "a disabled source is not waited for"
    );
    let source = add_source(
        &gateway,
        service,
        http_source(
            "registry",
            &registry,
            json!({"timeout_ms": 4_000}),
            json!({}),
        ),
    )
    .await;
    let (status, body) = readyz().await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(
        body.contains("registry"),
        "names the pending source: {body}"
    );
    assert_eq!(gateway.source_status(source).await.state, "pending");

    wait_until("ready", WAIT, || async {
        (readyz().await.0 == StatusCode::OK).then_some(())
    })
    .await;
    assert_eq!(
        idle.requests(),
        0,
        "a disabled source never asks its registry"
    );
    let status = gateway.source_status(source).await;
    assert_eq!(
        status.state, "healthy",
        "ready only after the first refresh: {status}"
    );
}

// ---------------------------------------------------------------------------------------------
// Disabling, deleting, read-only discovered targets
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn disabling_drains_and_stops_refreshes_and_deleting_removes_targets_at_once() {
    let gateway = TestGateway::start().await;
    let registry = Registry::start().await;
    let (a, b) = (Upstream::start("a").await, Upstream::start("b").await);
    let service = service_with_route(&gateway, "web").await;
    registry.set_json(json!([
        endpoint("a", &a, 100, 0),
        endpoint("b", &b, 100, 0)
    ]));
    let source = add_source(
        &gateway,
        service,
        http_source(
            "registry",
            &registry,
            json!({}),
            json!({"removal_grace_ms": 1_000}),
        ),
    )
    .await;
    wait_state(&gateway, source, "healthy").await;
    let first = source_targets(&gateway, service, source).await;
    wait_proxy(&gateway, StatusCode::OK).await;

    let path = format!("/api/v1/discovery-sources/{source}");
    let (status, body) = gateway
        .api("PATCH", &path, Some(json!({"enabled": false})))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["enabled"], false);
    let disabled = gateway.source_status(source).await;
    assert_eq!(disabled.state, "disabled", "{disabled}");
    assert!(disabled.next_refresh_at.is_none(), "{disabled}");
    assert_eq!(disabled.endpoints, counts(0, 2, 0), "{disabled}");
    for target in source_targets(&gateway, service, source).await.values() {
        assert_eq!(target.state, "draining", "{target}");
        assert!(target.remove_at.is_some(), "{target}");
    }
    let (status, code, _) = proxy_error(&gateway).await;
    assert_eq!(
        (status, code.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "no_available_target")
    );
    let answer = gateway.api("POST", &format!("{path}/refresh"), None).await;
    assert_error(
        "refresh disabled",
        &answer,
        StatusCode::CONFLICT,
        "conflict",
        Some("enabled"),
    );

    tokio::time::sleep(Duration::from_millis(100)).await;
    let asked = registry.requests();
    wait_status(&gateway, source, "drained targets deleted", |s| {
        s.endpoints == counts(0, 0, 0)
    })
    .await;
    holds_for(
        "a disabled source not refreshing",
        Duration::from_millis(500),
        || async {
            let requests = registry.requests();
            if requests == asked {
                Ok(())
            } else {
                Err(format!("{requests} registry requests, {asked} before"))
            }
        },
    )
    .await;
    assert_eq!(gateway.source_status(source).await.state, "disabled");

    // Enabled again: pending until its first refresh, then new targets.
    let (status, body) = gateway
        .api("PATCH", &path, Some(json!({"enabled": true})))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let healthy = wait_status(&gateway, source, "healthy with targets", |s| {
        s.state == "healthy" && s.endpoints == counts(2, 0, 0)
    })
    .await;
    assert!(healthy.next_refresh_at.is_some(), "{healthy}");
    let second = source_targets(&gateway, service, source).await;
    for key in ["a", "b"] {
        assert_ne!(
            id_of(&second[key]),
            id_of(&first[key]),
            "deleted targets are new ones"
        );
    }
    wait_proxy(&gateway, StatusCode::OK).await;

    // Deleting the source removes its targets at once.
    let (status, _) = gateway.api("DELETE", &path, None).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert!(source_targets(&gateway, service, source).await.is_empty());
    for target in second.values() {
        assert_eq!(
            target_status(&gateway, id_of(target)).await.0,
            StatusCode::NOT_FOUND
        );
    }
    let (status, code, _) = proxy_error(&gateway).await;
    assert_eq!(
        (status, code.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "no_available_target")
    );
}

#[tokio::test]
async fn discovered_targets_are_read_only_and_share_a_service_with_operator_targets() {
    let gateway = TestGateway::start().await;
    let registry = Registry::start().await;
    let (operator, discovered) = (Upstream::start("op").await, Upstream::start("d").await);
    let service = service_with_route(&gateway, "web").await;
    let manual = gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            target(&operator, 100, 0),
        )
        .await;
    registry.set_json(json!([endpoint("d", &discovered, 100, 0)]));
    let source = add_source(
        &gateway,
        service,
        http_source("registry", &registry, json!({}), json!({})),
    )
    .await;
    let status = wait_state(&gateway, source, "healthy").await;
    assert_eq!(
        status.endpoints,
        counts(1, 0, 0),
        "only the source's own targets: {status}"
    );
    let found = source_targets(&gateway, service, source).await["d"].clone();
    let id = id_of(&found);

    wait_until("both targets serve", WAIT, || async {
        let seen = spread(&gateway, "/", 10, 1).await;
        (hits(&seen, "op") == 5 && hits(&seen, "d") == 5).then_some(())
    })
    .await;

    let path = format!("/api/v1/targets/{id}");
    for (method, body) in [
        ("PUT", Some(json!({"host": "127.0.0.1", "port": 1}))),
        ("PATCH", Some(json!({"weight": 1}))),
        ("DELETE", None),
    ] {
        let answer = gateway.api(method, &path, body).await;
        assert_error(
            &format!("{method} discovered target"),
            &answer,
            StatusCode::CONFLICT,
            "conflict",
            None,
        );
        let message = ApiError::read(&answer.1).message;
        assert!(
            message.contains(&format!("discovery source {source}")),
            "names the owning source: {message}"
        );
    }
    holds_for(
        "refused writes changing nothing (and refreshes neither)",
        Duration::from_millis(300),
        || async {
            let unchanged = gateway.target(id).await;
            if unchanged == found {
                Ok(())
            } else {
                Err(format!("{unchanged}, was {found}"))
            }
        },
    )
    .await;

    // The operator target is still the operator's, untouched by refreshes.
    let (status, patched) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/targets/{manual}"),
            Some(json!({"weight": 300})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{patched}");
    assert!(patched["source_id"].is_null(), "{patched}");
    holds_for(
        "the operator target keeping its weight",
        Duration::from_millis(500),
        || async {
            let manual_now = gateway.target(manual).await;
            if manual_now.weight == 300 {
                Ok(())
            } else {
                Err(manual_now)
            }
        },
    )
    .await;
    let seen = spread(&gateway, "/", 40, 1).await;
    assert!(
        (27..=33).contains(&hits(&seen, "op")),
        "weights 300:100: {seen:?}"
    );
    assert_eq!(hits(&seen, "op") + hits(&seen, "d"), 40, "{seen:?}");
}

#[tokio::test]
async fn tls_verify_refuses_an_untrusted_registry_certificate_unless_turned_off() {
    let gateway = TestGateway::start().await;
    let registry = Registry::start_tls().await;
    let a = Upstream::start("a").await;
    let service = service_with_route(&gateway, "web").await;
    registry.set_json(json!([endpoint("a", &a, 100, 0)]));
    let url = registry.url("/v1/endpoints");
    assert!(url.starts_with("https://"), "{url}");
    let source = add_source(
        &gateway,
        service,
        http_source("registry", &registry, json!({}), json!({})),
    )
    .await;
    assert_eq!(
        gateway
            .get_ok(&format!("/api/v1/discovery-sources/{source}"))
            .await["config"]["tls_verify"],
        true
    );
    let failing = wait_state(&gateway, source, "failing").await;
    let error = failing.last_error.as_deref().unwrap_or_default();
    assert!(error.contains(&url), "{error}");
    assert!(
        error.to_lowercase().contains("certificate"),
        "says the certificate is refused: {error}"
    );
    assert_eq!(
        registry.requests(),
        0,
        "no request without a trusted certificate"
    );
    assert_eq!(failing.endpoints, counts(0, 0, 0), "{failing}");

    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/discovery-sources/{source}"),
            Some(json!({"config": {"tls_verify": false}})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["config"]["url"], url.as_str(), "{body}");
    let healthy = wait_state(&gateway, source, "healthy").await;
    assert_eq!(healthy.endpoints, counts(1, 0, 0), "{healthy}");
    assert!(registry.requests() >= 1);
    wait_proxy(&gateway, StatusCode::OK).await;
    assert_eq!(fetch(&gateway).await, (StatusCode::OK, "a".to_owned()));
}

// ---------------------------------------------------------------------------------------------
// 10. Several sources on one service; health across a flap
// ---------------------------------------------------------------------------------------------

/// The target ids of `targets`, by provider key.
fn ids_by_key(targets: &HashMap<String, Target>) -> HashMap<String, i64> {
    targets
        .iter()
        .map(|(key, target)| (key.clone(), id_of(target)))
        .collect()
}

/// DESIGN §4: two sources feed one service at once. Each owns its own targets (even under the
/// same provider key), traffic reaches both sources' endpoints, and a change to one source's set
/// or its deletion touches only that source's targets.
#[tokio::test]
async fn two_sources_feed_one_service_and_each_changes_only_its_own_targets() {
    let gateway = TestGateway::start().await;
    let (first_registry, second_registry) = (Registry::start().await, Registry::start().await);
    let (a1, a2, b1) = (
        Upstream::start("a1").await,
        Upstream::start("a2").await,
        Upstream::start("b1").await,
    );
    let service = service_with_route(&gateway, "web").await;
    // Both registries name an endpoint "one": provider keys belong to a source.
    first_registry.set_json(json!([
        endpoint("one", &a1, 100, 0),
        endpoint("two", &a2, 100, 0),
    ]));
    second_registry.set_json(json!([endpoint("one", &b1, 100, 0)]));
    let long_grace = json!({"removal_grace_ms": 60_000});
    let first = add_source(
        &gateway,
        service,
        http_source("first", &first_registry, json!({}), long_grace.clone()),
    )
    .await;
    let second = add_source(
        &gateway,
        service,
        http_source("second", &second_registry, json!({}), long_grace),
    )
    .await;
    wait_status(&gateway, first, "first healthy with 2", |s| {
        s.state == "healthy" && s.endpoints == counts(2, 0, 0)
    })
    .await;
    wait_status(&gateway, second, "second healthy with 1", |s| {
        s.state == "healthy" && s.endpoints == counts(1, 0, 0)
    })
    .await;
    let first_targets = source_targets(&gateway, service, first).await;
    let second_targets = source_targets(&gateway, service, second).await;
    assert_eq!(
        first_targets["one"].port,
        a1.addr.port(),
        "{first_targets:?}"
    );
    assert_eq!(
        second_targets["one"].port,
        b1.addr.port(),
        "{second_targets:?}"
    );
    assert_ne!(id_of(&first_targets["one"]), id_of(&second_targets["one"]));

    // Traffic reaches every endpoint of both sources.
    wait_until("traffic on a1, a2 and b1", WAIT, || async {
        let seen = spread(&gateway, "/", 30, 3).await;
        ["a1", "a2", "b1"]
            .iter()
            .all(|name| hits(&seen, name) > 0)
            .then_some(())
    })
    .await;

    // The first source loses "two": only its target drains; the second's is left as it was.
    first_registry.set_json(json!([endpoint("one", &a1, 100, 0)]));
    wait_status(&gateway, first, "first: one active, one draining", |s| {
        s.endpoints == counts(1, 1, 0)
    })
    .await;
    let first_now = source_targets(&gateway, service, first).await;
    assert_eq!(first_now["two"].state, "draining", "{first_now:?}");
    assert_eq!(first_now["one"].state, "active", "{first_now:?}");
    assert_eq!(ids_by_key(&first_now), ids_by_key(&first_targets));
    assert_eq!(
        source_targets(&gateway, service, second).await,
        second_targets,
        "the other source's target is untouched"
    );
    assert_eq!(
        gateway.source_status(second).await.endpoints,
        counts(1, 0, 0)
    );
    wait_until("traffic on a1 and b1 only", WAIT, || async {
        let seen = spread(&gateway, "/", 30, 3).await;
        (hits(&seen, "a1") > 0 && hits(&seen, "b1") > 0 && hits(&seen, "a2") == 0).then_some(())
    })
    .await;

    // Deleting the second source removes its target at once and leaves the first's alone.
    let (status, body) = gateway
        .api(
            "DELETE",
            &format!("/api/v1/discovery-sources/{second}"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    assert_eq!(
        target_status(&gateway, id_of(&second_targets["one"]))
            .await
            .0,
        StatusCode::NOT_FOUND
    );
    let after = source_targets(&gateway, service, first).await;
    assert_eq!(ids_by_key(&after), ids_by_key(&first_targets));
    assert_eq!(after["one"].state, "active", "{after:?}");
    assert_eq!(
        after["two"].state, "draining",
        "still draining, within its grace: {after:?}"
    );
    let seen = spread(&gateway, "/", 20, 2).await;
    assert_eq!(hits(&seen, "a1"), 20, "{seen:?}");
}

/// DESIGN §4: an endpoint that leaves and returns within `removal_grace_ms` keeps its target
/// id and its health: it comes back `active` and `healthy` at once, not `unknown` until checks
/// prove it again.
#[tokio::test]
async fn an_endpoint_back_within_its_grace_keeps_its_id_and_health() {
    let gateway = TestGateway::start().await;
    let registry = Registry::start().await;
    let (a, b) = (Upstream::start("a").await, Upstream::start("b").await);
    let service = service_with_route(&gateway, "web").await;
    // Three passes 150 ms apart: health the checks had to earn again would stay `unknown` for
    // at least 300 ms after the return, far longer than one status poll takes.
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{service}"),
            Some(json!({"health_check": {
                "path": "/", "interval_ms": 150, "timeout_ms": 500, "healthy_threshold": 3
            }})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    registry.set_json(json!([
        endpoint("a", &a, 100, 0),
        endpoint("b", &b, 100, 0)
    ]));
    let source = add_source(
        &gateway,
        service,
        http_source(
            "registry",
            &registry,
            json!({}),
            json!({"removal_grace_ms": 60_000}),
        ),
    )
    .await;
    wait_state(&gateway, source, "healthy").await;
    let idb = id_of(&source_targets(&gateway, service, source).await["b"]);
    wait_target(&gateway, idb, "healthy", |target| {
        target.health == "healthy"
    })
    .await;

    registry.set_json(json!([endpoint("a", &a, 100, 0)]));
    let draining = wait_target(&gateway, idb, "draining", |target| {
        target.state == "draining"
    })
    .await;
    assert_eq!(draining.health, "healthy", "{draining}");

    registry.set_json(json!([
        endpoint("a", &a, 100, 0),
        endpoint("b", &b, 100, 0)
    ]));
    // The target must stay (answer 200) within its grace: `wait_target` fails on a 404.
    let back = wait_target(&gateway, idb, "active again", |target| {
        target.state == "active"
    })
    .await;
    assert_eq!(id_of(&back), idb);
    assert_eq!(
        back.health, "healthy",
        "health kept across the flap: {back}"
    );
    assert!(back.remove_at.is_none(), "{back}");
    let listed = source_targets(&gateway, service, source).await;
    assert_eq!(listed["b"].health, "healthy", "{listed:?}");
    wait_until("b gets traffic again", WAIT, || async {
        (hits(&spread(&gateway, "/", 20, 1).await, "b") > 0).then_some(())
    })
    .await;
}

/// A rebuild that runs between a write and its apply (here one a refresh outcome asks for)
/// reads the write first; the apply must still start the discovery loop of the source written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_a_rebuild_read_first_still_starts_on_the_apply() {
    let gateway = TestGateway::start().await;
    let first = Upstream::start("first").await;
    let moved = Upstream::start("moved").await;
    let other = Upstream::start("other").await;
    let registry = Registry::start().await;
    registry.set_json(json!([endpoint("a", &first, 1, 0)]));
    let other_registry = Registry::start().await;
    other_registry.set_json(json!([endpoint("b", &other, 1, 0)]));
    let service = service_with_route(&gateway, "web").await;
    let slow = json!({"interval_ms": 3_600_000});
    let refreshed = add_source(
        &gateway,
        service,
        http_source("refreshed", &registry, slow.clone(), json!({})),
    )
    .await;
    wait_status(&gateway, refreshed, "healthy", |s| s.state == "healthy").await;

    // Written to the store without the admin API's apply.
    let running = gateway.gateway.as_ref().expect("running");
    let spec: raahi::model::DiscoverySourceSpec =
        serde_json::from_value(http_source("written", &other_registry, slow, json!({})))
            .expect("a source spec");
    let written = running
        .store
        .create_source(service, &spec)
        .await
        .expect("stored")
        .id;
    // A refresh that changes targets: its rebuild reads the write above.
    registry.set_json(json!([endpoint("a", &moved, 1, 0)]));
    let (status, body) = gateway
        .api(
            "POST",
            &format!("/api/v1/discovery-sources/{refreshed}/refresh"),
            None,
        )
        .await;
    assert!(status.is_success(), "{body}");
    wait_until("the refresh reached the data path", WAIT, || async {
        let (status, body) = fetch(&gateway).await;
        if body == "moved" {
            Ok(())
        } else {
            Err(format!("{status} {body}"))
        }
    })
    .await;

    running.control.apply().await.expect("applied");
    let status = wait_status(&gateway, written, "healthy", |s| s.state == "healthy").await;
    assert_eq!(status.endpoints.active, 1, "{status:?}");
}
