//! The admin REST API through real sockets: validation errors naming the field, auth and roles,
//! CRUD round trips with defaults and merge patches, pagination, persistence across a restart,
//! the OpenAPI document and the health endpoints.

use crate::common;
use common::*;

use hyper::StatusCode;
use serde_json::{json, Value};

/// A 422 `validation_failed` naming `field`.
#[track_caller]
fn assert_invalid(what: &str, answer: &(StatusCode, Value), field: &str) {
    assert_error(what, answer, 422, "validation_failed", Some(field));
}

/// All items of a list (asserting the list answers 200 on a single page).
async fn items(gateway: &TestGateway, path: &str) -> Vec<Value> {
    let (status, body) = gateway.api("GET", path, None).await;
    assert_eq!(status, StatusCode::OK, "GET {path}: {body}");
    assert!(body["next"].is_null(), "GET {path} fits one page: {body}");
    body["items"]
        .as_array()
        .unwrap_or_else(|| panic!("GET {path} has items: {body}"))
        .clone()
}

// ----- 1. bad input -----

#[tokio::test]
async fn bad_service_input_is_refused_naming_the_field_and_stores_nothing() {
    let gateway = TestGateway::start().await;
    let existing = gateway
        .create("/api/v1/services", json!({"name": "existing"}))
        .await;
    let before = items(&gateway, "/api/v1/services").await;
    assert_eq!(before.len(), 1);

    let malformed = gateway
        .api_raw("POST", "/api/v1/services", r#"{"name": "#)
        .await;
    assert_error("malformed JSON", &malformed, 400, "malformed_request", None);
    let trailing = gateway
        .api_raw("POST", "/api/v1/services", r#"{"name": "a"} {"#)
        .await;
    assert_error(
        "trailing garbage",
        &trailing,
        400,
        "malformed_request",
        None,
    );
    let empty = gateway.api_raw("POST", "/api/v1/services", "").await;
    assert_error("empty body", &empty, 400, "malformed_request", None);

    let cases: Vec<(&str, Value, &str)> = vec![
        ("missing name", json!({"protocol": "http"}), "name"),
        ("empty object", json!({}), "name"),
        ("wrong type", json!({"name": 7}), "name"),
        ("bad name", json!({"name": "has space"}), "name"),
        (
            "unknown lb_policy",
            json!({"name": "a", "lb_policy": "fastest"}),
            "lb_policy",
        ),
        (
            "zero connect timeout",
            json!({"name": "a", "timeouts": {"connect_ms": 0}}),
            "timeouts.connect_ms",
        ),
        (
            "negative timeout",
            json!({"name": "a", "timeouts": {"idle_ms": -1}}),
            "timeouts.idle_ms",
        ),
        (
            "zero attempts",
            json!({"name": "a", "max_attempts": 0}),
            "max_attempts",
        ),
        (
            "authority with userinfo",
            json!({"name": "a", "upstream_authority": "user@host"}),
            "upstream_authority",
        ),
    ];
    for (what, body, field) in cases {
        let answer = gateway.api("POST", "/api/v1/services", Some(body)).await;
        assert_invalid(what, &answer, field);
        assert_eq!(
            items(&gateway, "/api/v1/services").await,
            before,
            "{what}: nothing stored"
        );
    }

    let duplicate = gateway
        .api(
            "POST",
            "/api/v1/services",
            Some(json!({"name": "existing"})),
        )
        .await;
    assert_error("duplicate name", &duplicate, 409, "conflict", Some("name"));
    assert_eq!(items(&gateway, "/api/v1/services").await, before);

    // Refused replacements and patches leave the stored service as it was.
    let other = gateway
        .create("/api/v1/services", json!({"name": "other"}))
        .await;
    let path = format!("/api/v1/services/{other}");
    let stored = gateway.get_ok(&path).await;
    let renamed = gateway
        .api("PUT", &path, Some(json!({"name": "existing"})))
        .await;
    assert_error(
        "rename onto a taken name",
        &renamed,
        409,
        "conflict",
        Some("name"),
    );
    let patched = gateway
        .api("PATCH", &path, Some(json!({"name": "existing"})))
        .await;
    assert_error(
        "patch onto a taken name",
        &patched,
        409,
        "conflict",
        Some("name"),
    );
    let put_wrong_type = gateway
        .api(
            "PUT",
            &path,
            Some(json!({"name": "other", "max_attempts": "3"})),
        )
        .await;
    assert_invalid("PUT wrong type", &put_wrong_type, "max_attempts");
    let patch_wrong_type = gateway
        .api(
            "PATCH",
            &path,
            Some(json!({"timeouts": {"connect_ms": "soon"}})),
        )
        .await;
    assert_invalid(
        "PATCH nested wrong type",
        &patch_wrong_type,
        "timeouts.connect_ms",
    );
    let patch_array = gateway.api("PATCH", &path, Some(json!([1]))).await;
    assert_invalid("PATCH with an array", &patch_array, "body");
    let patch_malformed = gateway.api_raw("PATCH", &path, "{").await;
    assert_error(
        "PATCH malformed",
        &patch_malformed,
        400,
        "malformed_request",
        None,
    );
    assert_eq!(gateway.get_ok(&path).await, stored);
    assert_eq!(
        gateway
            .get_ok(&format!("/api/v1/services/{existing}"))
            .await,
        before[0]
    );
}

#[tokio::test]
async fn bad_target_input_is_refused_naming_the_field_and_stores_nothing() {
    let gateway = TestGateway::start().await;
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    let targets = format!("/api/v1/services/{service}/targets");
    let kept = gateway
        .create(&targets, json!({"host": "127.0.0.1", "port": 8080}))
        .await;
    let before = items(&gateway, &targets).await;
    assert_eq!(before.len(), 1);

    let malformed = gateway
        .api_raw("POST", &targets, r#"{"host": "127.0.0.1", "port": "#)
        .await;
    assert_error("malformed JSON", &malformed, 400, "malformed_request", None);

    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "port as a word",
            json!({"host": "127.0.0.1", "port": "eighty"}),
            "port",
        ),
        (
            "port 70000",
            json!({"host": "127.0.0.1", "port": 70000}),
            "port",
        ),
        ("port 0", json!({"host": "127.0.0.1", "port": 0}), "port"),
        (
            "negative port",
            json!({"host": "127.0.0.1", "port": -1}),
            "port",
        ),
        (
            "weight over 65535",
            json!({"host": "127.0.0.1", "port": 80, "weight": 65536}),
            "weight",
        ),
        (
            "negative weight",
            json!({"host": "127.0.0.1", "port": 80, "weight": -1}),
            "weight",
        ),
        (
            "host name",
            json!({"host": "example.com", "port": 80}),
            "host",
        ),
        ("empty host", json!({"host": "", "port": 80}), "host"),
        ("missing port", json!({"host": "127.0.0.1"}), "port"),
        ("missing host", json!({"port": 80}), "host"),
        (
            "metadata not an object",
            json!({"host": "127.0.0.1", "port": 80, "metadata": [1]}),
            "metadata",
        ),
        (
            "enabled as a string",
            json!({"host": "127.0.0.1", "port": 80, "enabled": "yes"}),
            "enabled",
        ),
    ];
    for (what, body, field) in cases {
        let answer = gateway.api("POST", &targets, Some(body)).await;
        assert_invalid(what, &answer, field);
        assert_eq!(
            items(&gateway, &targets).await,
            before,
            "{what}: nothing stored"
        );
    }

    // A target for a service that does not exist.
    let orphan = gateway
        .api(
            "POST",
            "/api/v1/services/999999/targets",
            Some(json!({"host": "127.0.0.1", "port": 80})),
        )
        .await;
    assert_error(
        "target of a missing service",
        &orphan,
        404,
        "not_found",
        None,
    );
    assert_eq!(items(&gateway, &targets).await, before);

    // Refused changes to the stored target leave it as it was.
    let path = format!("/api/v1/targets/{kept}");
    for (what, method, body, field) in [
        ("PATCH port 0", "PATCH", json!({"port": 0}), "port"),
        ("PATCH weight", "PATCH", json!({"weight": 70000}), "weight"),
        (
            "PATCH host name",
            "PATCH",
            json!({"host": "db.internal"}),
            "host",
        ),
        (
            "PUT port 70000",
            "PUT",
            json!({"host": "127.0.0.1", "port": 70000}),
            "port",
        ),
        (
            "PUT missing port",
            "PUT",
            json!({"host": "127.0.0.1"}),
            "port",
        ),
    ] {
        let answer = gateway.api(method, &path, Some(body)).await;
        assert_invalid(what, &answer, field);
        assert_eq!(gateway.get_ok(&path).await, before[0], "{what}: unchanged");
    }
}

#[tokio::test]
async fn bad_route_input_is_refused_naming_the_field_and_stores_nothing() {
    let gateway = TestGateway::start().await;
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    let kept = gateway
        .create(
            "/api/v1/routes",
            json!({"name": "kept", "service_id": service}),
        )
        .await;
    let before = items(&gateway, "/api/v1/routes").await;
    assert_eq!(before.len(), 1);

    let malformed = gateway
        .api_raw("POST", "/api/v1/routes", "{\"name\" 1}")
        .await;
    assert_error("malformed JSON", &malformed, 400, "malformed_request", None);

    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "dangling service_id",
            json!({"name": "r", "service_id": 999999}),
            "service_id",
        ),
        ("missing service_id", json!({"name": "r"}), "service_id"),
        ("missing name", json!({"service_id": service}), "name"),
        (
            "service_id as a string",
            json!({"name": "r", "service_id": "web"}),
            "service_id",
        ),
        (
            "host with a space",
            json!({"name": "r", "service_id": service, "hosts": ["bad host"]}),
            "hosts[0]",
        ),
        (
            "second host bad",
            json!({"name": "r", "service_id": service, "hosts": ["ok.example", "bad host"]}),
            "hosts[1]",
        ),
        (
            "hosts not a list",
            json!({"name": "r", "service_id": service, "hosts": "a.example"}),
            "hosts",
        ),
        (
            "path_prefix without slash",
            json!({"name": "r", "service_id": service, "path_prefix": "api"}),
            "path_prefix",
        ),
        (
            "path_prefix with a space",
            json!({"name": "r", "service_id": service, "path_prefix": "/a b"}),
            "path_prefix",
        ),
        (
            "bad method",
            json!({"name": "r", "service_id": service, "methods": ["G3T"]}),
            "methods[0]",
        ),
    ];
    for (what, body, field) in cases {
        let answer = gateway.api("POST", "/api/v1/routes", Some(body)).await;
        assert_invalid(what, &answer, field);
        assert_eq!(
            items(&gateway, "/api/v1/routes").await,
            before,
            "{what}: nothing stored"
        );
    }

    let duplicate = gateway
        .api(
            "POST",
            "/api/v1/routes",
            Some(json!({"name": "kept", "service_id": service})),
        )
        .await;
    assert_error(
        "duplicate route name",
        &duplicate,
        409,
        "conflict",
        Some("name"),
    );
    assert_eq!(items(&gateway, "/api/v1/routes").await, before);

    let path = format!("/api/v1/routes/{kept}");
    for (what, method, body, field) in [
        (
            "PATCH dangling service",
            "PATCH",
            json!({"service_id": 999999}),
            "service_id",
        ),
        (
            "PATCH bad host",
            "PATCH",
            json!({"hosts": ["bad host"]}),
            "hosts[0]",
        ),
        (
            "PATCH bad prefix",
            "PATCH",
            json!({"path_prefix": "x"}),
            "path_prefix",
        ),
        (
            "PUT dangling service",
            "PUT",
            json!({"name": "kept", "service_id": 999999}),
            "service_id",
        ),
    ] {
        let answer = gateway.api(method, &path, Some(body)).await;
        assert_invalid(what, &answer, field);
        assert_eq!(gateway.get_ok(&path).await, before[0], "{what}: unchanged");
    }
}

/// A JSON document that is not an object (an array, a string, a number) is refused with a 422
/// on `body`: serde would otherwise read an array positionally into the spec's fields.
/// A route's `path_prefix` is stored, and answered, in the normal form request paths are
/// routed in (issue 31); one with no normal form is refused by name.
#[tokio::test]
async fn route_prefixes_are_stored_normalised() {
    let gateway = TestGateway::start().await;
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    let (status, created) = gateway
        .api(
            "POST",
            "/api/v1/routes",
            Some(json!({"name": "v1", "service_id": service, "path_prefix": "/%61pi/./v1"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(created["path_prefix"], "/api/v1");
    let path = format!("/api/v1/routes/{}", id_of(&created));
    assert_eq!(gateway.get_ok(&path).await["path_prefix"], "/api/v1");

    let (status, replaced) = gateway
        .api(
            "PUT",
            &path,
            Some(json!({"name": "v1", "service_id": service, "path_prefix": "//api/x/../v2/"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{replaced}");
    assert_eq!(replaced["path_prefix"], "/api/v2/");
    let (status, patched) = gateway
        .api("PATCH", &path, Some(json!({"path_prefix": "/%7Eu/a%2fb"})))
        .await;
    assert_eq!(status, StatusCode::OK, "{patched}");
    assert_eq!(patched["path_prefix"], "/~u/a%2Fb");

    for (what, prefix) in [
        ("above the root", "/../x"),
        ("above the root, escaped", "/a/%2e%2e/%2E%2E"),
        ("a malformed escape", "/a%zz"),
    ] {
        let answer = gateway
            .api(
                "POST",
                "/api/v1/routes",
                Some(json!({"name": "bad", "service_id": service, "path_prefix": prefix})),
            )
            .await;
        assert_invalid(what, &answer, "path_prefix");
        let answer = gateway
            .api("PATCH", &path, Some(json!({"path_prefix": prefix})))
            .await;
        assert_invalid(what, &answer, "path_prefix");
        assert_eq!(gateway.get_ok(&path).await, patched, "{what}: unchanged");
    }
    assert_eq!(items(&gateway, "/api/v1/routes").await.len(), 1);
}

#[tokio::test]
async fn a_body_that_is_not_an_object_is_refused() {
    let gateway = TestGateway::start().await;
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    let route = gateway.route_all_to(service).await;
    let before = (
        items(&gateway, "/api/v1/services").await,
        items(&gateway, "/api/v1/routes").await,
        items(&gateway, "/api/v1/tokens").await,
    );
    let targets = format!("/api/v1/services/{service}/targets");
    let service_path = format!("/api/v1/services/{service}");
    let route_path = format!("/api/v1/routes/{route}");
    let cases: Vec<(&str, &str, Value)> = vec![
        ("POST", "/api/v1/services", json!(["positional"])),
        ("POST", "/api/v1/services", json!("web")),
        ("PUT", &service_path, json!(["renamed"])),
        ("PATCH", &service_path, json!(["renamed"])),
        ("POST", &targets, json!(["127.0.0.1", 8080])),
        ("POST", "/api/v1/routes", json!(["r", [], "/", [], service])),
        ("PUT", &route_path, json!(["renamed", [], "/", [], service])),
        ("POST", "/api/v1/tokens", json!(["sneaky", "admin"])),
        ("POST", "/api/v1/tokens", json!(42)),
    ];
    for (method, path, body) in cases {
        let what = format!("{method} {path} {body}");
        let answer = gateway.api(method, path, Some(body)).await;
        assert_invalid(&what, &answer, "body");
    }
    assert!(
        items(&gateway, &targets).await.is_empty(),
        "no target stored"
    );
    let after = (
        items(&gateway, "/api/v1/services").await,
        items(&gateway, "/api/v1/routes").await,
        items(&gateway, "/api/v1/tokens").await,
    );
    assert_eq!(after, before, "nothing changed");
}

/// An unknown field (a typo, or a read-only field written) is a 422 whose `field` is the
/// field's own path, at the top level and nested, on create, replace and patch.
#[tokio::test]
async fn unknown_fields_are_refused_naming_the_field_itself() {
    let gateway = TestGateway::start().await;
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    let target = gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            json!({"host": "127.0.0.1", "port": 8080}),
        )
        .await;
    let route = gateway.route_all_to(service).await;
    let before = (
        items(&gateway, "/api/v1/services").await,
        items(&gateway, &format!("/api/v1/services/{service}/targets")).await,
        items(&gateway, "/api/v1/routes").await,
    );

    let service_path = format!("/api/v1/services/{service}");
    let targets_path = format!("/api/v1/services/{service}/targets");
    let target_path = format!("/api/v1/targets/{target}");
    let route_path = format!("/api/v1/routes/{route}");
    let cases: Vec<(&str, &str, Value, &str)> = vec![
        (
            "POST",
            "/api/v1/services",
            json!({"name": "a", "colour": "red"}),
            "colour",
        ),
        (
            "POST",
            "/api/v1/services",
            json!({"name": "a", "timeouts": {"bogus_ms": 1}}),
            "timeouts.bogus_ms",
        ),
        (
            "PUT",
            &service_path,
            json!({"name": "web", "colour": "red"}),
            "colour",
        ),
        ("PATCH", &service_path, json!({"colour": "red"}), "colour"),
        (
            "PATCH",
            &service_path,
            json!({"timeouts": {"bogus_ms": 1}}),
            "timeouts.bogus_ms",
        ),
        (
            "POST",
            &targets_path,
            json!({"host": "127.0.0.1", "port": 80, "zone": "a"}),
            "zone",
        ),
        (
            "POST",
            &targets_path,
            json!({"host": "127.0.0.1", "port": 80, "state": "draining"}),
            "state",
        ),
        (
            "PATCH",
            &target_path,
            json!({"health": "healthy"}),
            "health",
        ),
        ("PATCH", &target_path, json!({"source_id": 1}), "source_id"),
        (
            "POST",
            "/api/v1/routes",
            json!({"name": "r", "service_id": service, "timeout": 5}),
            "timeout",
        ),
        ("PATCH", &route_path, json!({"timeout": 5}), "timeout"),
        (
            "POST",
            "/api/v1/tokens",
            json!({"name": "t", "role": "viewer", "token": "chosen"}),
            "token",
        ),
    ];
    for (method, path, body, field) in cases {
        let what = format!("{method} {path} {body}");
        let answer = gateway.api(method, path, Some(body)).await;
        assert_invalid(&what, &answer, field);
    }
    let after = (
        items(&gateway, "/api/v1/services").await,
        items(&gateway, &format!("/api/v1/services/{service}/targets")).await,
        items(&gateway, "/api/v1/routes").await,
    );
    assert_eq!(after, before, "nothing changed");
    let tokens = items(&gateway, "/api/v1/tokens").await;
    assert!(tokens.iter().all(|t| t["name"] != "t"), "{tokens:?}");
}

#[tokio::test]
async fn bad_queries_ids_and_paths_are_4xx_json() {
    let gateway = TestGateway::start().await;
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;

    for list in [
        "/api/v1/services".to_owned(),
        "/api/v1/routes".to_owned(),
        "/api/v1/tokens".to_owned(),
        format!("/api/v1/services/{service}/targets"),
    ] {
        for query in ["limit=0", "limit=abc", "limit=-1", "limit=1001", "limit="] {
            let answer = gateway.api("GET", &format!("{list}?{query}"), None).await;
            assert_invalid(&format!("{list}?{query}"), &answer, "limit");
        }
        let answer = gateway.api("GET", &format!("{list}?after=xyz"), None).await;
        assert_invalid(&format!("{list}?after=xyz"), &answer, "after");
    }

    for (method, path) in [
        ("GET", "/api/v1/services/abc"),
        ("PUT", "/api/v1/services/abc"),
        ("PATCH", "/api/v1/services/abc"),
        ("DELETE", "/api/v1/services/abc"),
        ("GET", "/api/v1/services/0"),
        ("GET", "/api/v1/services/-1"),
        ("GET", "/api/v1/services/1.5"),
        ("GET", "/api/v1/services/99999999999999999999999"),
        ("GET", "/api/v1/services/999999"),
        ("DELETE", "/api/v1/services/999999"),
        ("GET", "/api/v1/services/abc/targets"),
        ("GET", "/api/v1/services/999999/targets"),
        ("GET", "/api/v1/targets/abc"),
        ("GET", "/api/v1/targets/999999"),
        ("DELETE", "/api/v1/targets/999999"),
        ("GET", "/api/v1/routes/abc"),
        ("GET", "/api/v1/routes/999999"),
        ("DELETE", "/api/v1/routes/999999"),
        ("DELETE", "/api/v1/tokens/abc"),
        ("DELETE", "/api/v1/tokens/999999"),
        ("GET", "/api/v1/nothing-here"),
        ("GET", "/api/v1"),
        ("GET", "/nothing-here"),
        ("POST", "/api/v2/services"),
    ] {
        let body = matches!(method, "PUT" | "PATCH").then(|| json!({"name": "web"}));
        let answer = gateway.api(method, path, body).await;
        assert_error(&format!("{method} {path}"), &answer, 404, "not_found", None);
    }

    // PUT and PATCH on a missing id are 404s too, with a valid body.
    let put = gateway
        .api("PUT", "/api/v1/services/999999", Some(json!({"name": "x"})))
        .await;
    assert_error("PUT missing service", &put, 404, "not_found", None);
    let patch = gateway
        .api("PATCH", "/api/v1/routes/999999", Some(json!({"name": "x"})))
        .await;
    assert_error("PATCH missing route", &patch, 404, "not_found", None);

    // A method a resource does not have.
    let answer = gateway.api("DELETE", "/api/v1/services", None).await;
    assert_error(
        "DELETE on a collection",
        &answer,
        405,
        "method_not_allowed",
        None,
    );

    assert_eq!(items(&gateway, "/api/v1/services").await.len(), 1);
}

#[tokio::test]
async fn an_oversized_body_is_a_413_and_stores_nothing() {
    let gateway = TestGateway::start().await;
    let before = items(&gateway, "/api/v1/services").await;
    let padding = "a".repeat(1024 * 1024 + 1);
    let body = format!(r#"{{"name": "big", "upstream_authority": "{padding}"}}"#);
    let response = gateway
        .http
        .post(gateway.admin_url("/api/v1/services"))
        .bearer_auth(ADMIN_TOKEN)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("the admin API answers an oversized body");
    let status = StatusCode::from_u16(response.status().as_u16()).unwrap();
    let value: Value = response.json().await.unwrap_or(Value::Null);
    assert_error(
        "oversized body",
        &(status, value),
        413,
        "payload_too_large",
        None,
    );
    assert_eq!(items(&gateway, "/api/v1/services").await, before);
    // The listener still serves afterwards.
    gateway
        .create("/api/v1/services", json!({"name": "small"}))
        .await;
}

// ----- 2. auth -----

async fn raw_status(
    gateway: &TestGateway,
    authorization: Option<&str>,
    path: &str,
) -> (u16, Option<String>, Value) {
    let mut request = gateway.http.get(gateway.admin_url(path));
    if let Some(authorization) = authorization {
        request = request.header("authorization", authorization);
    }
    let response = request.send().await.expect("admin API answers");
    let status = response.status().as_u16();
    let challenge = response
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = response.json().await.unwrap_or(Value::Null);
    (status, challenge, body)
}

#[tokio::test]
async fn calls_without_a_valid_token_are_401_with_a_bearer_challenge() {
    let gateway = TestGateway::start().await;
    let wrong = format!("Bearer {ADMIN_TOKEN}x");
    for authorization in [
        None,
        Some(wrong.as_str()),
        Some("Bearer "),
        Some("Basic YWRtaW46YWRtaW4="),
        Some(ADMIN_TOKEN),
    ] {
        for path in ["/api/v1/services", "/api/v1/routes", "/api/v1/tokens"] {
            let (status, challenge, body) = raw_status(&gateway, authorization, path).await;
            let what = format!("GET {path} with {authorization:?}");
            assert_error(
                &what,
                &(StatusCode::from_u16(status).unwrap(), body),
                401,
                "unauthorized",
                None,
            );
            assert_eq!(challenge.as_deref(), Some("Bearer"), "{what}");
        }
    }
    // Writes without a token are refused and store nothing.
    let answer = gateway
        .api_as(
            None,
            "POST",
            "/api/v1/services",
            Some(json!({"name": "web"})),
        )
        .await;
    assert_error("POST without a token", &answer, 401, "unauthorized", None);
    let answer = gateway
        .api_as(
            Some("not-a-token"),
            "POST",
            "/api/v1/tokens",
            Some(json!({"name": "sneaky", "role": "admin"})),
        )
        .await;
    assert_error(
        "token POST with a wrong token",
        &answer,
        401,
        "unauthorized",
        None,
    );
    assert!(items(&gateway, "/api/v1/services").await.is_empty());
    let tokens = items(&gateway, "/api/v1/tokens").await;
    assert!(tokens.iter().all(|t| t["name"] != "sneaky"), "{tokens:?}");
}

#[tokio::test]
async fn a_viewer_reads_but_cannot_write_and_a_deleted_token_is_revoked() {
    let gateway = TestGateway::start().await;
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    let target = gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            json!({"host": "127.0.0.1", "port": 8080}),
        )
        .await;
    let route = gateway.route_all_to(service).await;

    let (status, created) = gateway
        .api(
            "POST",
            "/api/v1/tokens",
            Some(json!({"name": "dashboard", "role": "viewer"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(created["name"], "dashboard");
    assert_eq!(created["role"], "viewer");
    let token_id = id_of(&created);
    let secret = created["token"]
        .as_str()
        .expect("the create answer shows the secret")
        .to_owned();
    assert!(secret.len() >= 32, "a long random secret: {secret}");
    let viewer = Some(secret.as_str());

    // Reads.
    let reads = [
        "/api/v1/services".to_owned(),
        format!("/api/v1/services/{service}"),
        format!("/api/v1/services/{service}/targets"),
        format!("/api/v1/targets/{target}"),
        "/api/v1/routes".to_owned(),
        format!("/api/v1/routes/{route}"),
    ];
    for path in &reads {
        let (status, body) = gateway.api_as(viewer, "GET", path, None).await;
        assert_eq!(status, StatusCode::OK, "viewer GET {path}: {body}");
        assert_eq!(
            body,
            gateway.get_ok(path).await,
            "viewer sees what admin sees"
        );
    }

    // Writes and the token resource are admin only.
    let before_services = items(&gateway, "/api/v1/services").await;
    let before_targets = items(&gateway, &format!("/api/v1/services/{service}/targets")).await;
    let before_routes = items(&gateway, "/api/v1/routes").await;
    let refused: Vec<(&str, String, Option<Value>)> = vec![
        (
            "POST",
            "/api/v1/services".into(),
            Some(json!({"name": "new"})),
        ),
        (
            "PUT",
            format!("/api/v1/services/{service}"),
            Some(json!({"name": "web", "max_attempts": 1})),
        ),
        (
            "PATCH",
            format!("/api/v1/services/{service}"),
            Some(json!({"max_attempts": 1})),
        ),
        ("DELETE", format!("/api/v1/services/{service}"), None),
        (
            "POST",
            format!("/api/v1/services/{service}/targets"),
            Some(json!({"host": "127.0.0.1", "port": 9})),
        ),
        (
            "PUT",
            format!("/api/v1/targets/{target}"),
            Some(json!({"host": "127.0.0.1", "port": 9})),
        ),
        (
            "PATCH",
            format!("/api/v1/targets/{target}"),
            Some(json!({"weight": 1})),
        ),
        ("DELETE", format!("/api/v1/targets/{target}"), None),
        (
            "POST",
            "/api/v1/routes".into(),
            Some(json!({"name": "new", "service_id": service})),
        ),
        (
            "PUT",
            format!("/api/v1/routes/{route}"),
            Some(json!({"name": "all", "service_id": service, "path_prefix": "/x"})),
        ),
        (
            "PATCH",
            format!("/api/v1/routes/{route}"),
            Some(json!({"path_prefix": "/x"})),
        ),
        ("DELETE", format!("/api/v1/routes/{route}"), None),
        ("GET", "/api/v1/tokens".into(), None),
        (
            "POST",
            "/api/v1/tokens".into(),
            Some(json!({"name": "escalate", "role": "admin"})),
        ),
        ("DELETE", format!("/api/v1/tokens/{token_id}"), None),
    ];
    for (method, path, body) in refused {
        let answer = gateway.api_as(viewer, method, &path, body).await;
        assert_error(
            &format!("viewer {method} {path}"),
            &answer,
            403,
            "forbidden",
            None,
        );
    }
    assert_eq!(items(&gateway, "/api/v1/services").await, before_services);
    assert_eq!(
        items(&gateway, &format!("/api/v1/services/{service}/targets")).await,
        before_targets
    );
    assert_eq!(items(&gateway, "/api/v1/routes").await, before_routes);

    // The token list shows the record, never the secret or its hash.
    let (status, list) = gateway.api("GET", "/api/v1/tokens", None).await;
    assert_eq!(status, StatusCode::OK, "{list}");
    let listed: Vec<&Value> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["id"] == token_id)
        .collect();
    assert_eq!(listed.len(), 1, "{list}");
    assert_eq!(listed[0]["name"], "dashboard");
    assert_eq!(listed[0]["role"], "viewer");
    let text = list.to_string();
    let hash = raahi::admin::auth::hash_token(&secret);
    assert!(!text.contains(&secret), "the list leaks the secret: {text}");
    assert!(!text.contains(&hash), "the list leaks the hash: {text}");
    assert!(
        !text.contains(&raahi::admin::auth::hash_token(ADMIN_TOKEN)),
        "the list leaks the admin hash: {text}"
    );
    assert!(
        !text.contains(ADMIN_TOKEN),
        "the list leaks the admin secret"
    );
    for token in list["items"].as_array().unwrap() {
        for key in ["token", "hash", "token_hash", "secret"] {
            assert!(
                token.get(key).is_none(),
                "token record has `{key}`: {token}"
            );
        }
    }

    // A bad role is refused naming the field.
    let answer = gateway
        .api(
            "POST",
            "/api/v1/tokens",
            Some(json!({"name": "x", "role": "root"})),
        )
        .await;
    assert_invalid("unknown role", &answer, "role");
    let answer = gateway
        .api("POST", "/api/v1/tokens", Some(json!({"name": "x"})))
        .await;
    assert_invalid("missing role", &answer, "role");

    // Deleting the token revokes it at once.
    let (status, body) = gateway
        .api("DELETE", &format!("/api/v1/tokens/{token_id}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    let answer = gateway
        .api_as(viewer, "GET", "/api/v1/services", None)
        .await;
    assert_error("revoked token", &answer, 401, "unauthorized", None);
    let answer = gateway
        .api("DELETE", &format!("/api/v1/tokens/{token_id}"), None)
        .await;
    assert_error("deleting twice", &answer, 404, "not_found", None);
    let remaining = items(&gateway, "/api/v1/tokens").await;
    assert!(
        remaining.iter().all(|t| t["id"] != token_id),
        "{remaining:?}"
    );
}

#[tokio::test]
async fn an_admin_token_created_through_the_api_can_write() {
    let gateway = TestGateway::start().await;
    let (status, created) = gateway
        .api(
            "POST",
            "/api/v1/tokens",
            Some(json!({"name": "ci", "role": "admin"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let secret = created["token"].as_str().unwrap().to_owned();
    let (status, body) = gateway
        .api_as(
            Some(&secret),
            "POST",
            "/api/v1/services",
            Some(json!({"name": "by-ci"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, body) = gateway
        .api_as(Some(&secret), "GET", "/api/v1/tokens", None)
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // Two tokens with one name are a conflict on `name`.
    let duplicate = gateway
        .api(
            "POST",
            "/api/v1/tokens",
            Some(json!({"name": "ci", "role": "viewer"})),
        )
        .await;
    assert_error(
        "duplicate token name",
        &duplicate,
        409,
        "conflict",
        Some("name"),
    );
}

// ----- 3. CRUD -----

#[tokio::test]
async fn services_round_trip_with_defaults_put_and_merge_patch() {
    let gateway = TestGateway::start().await;
    let (status, created) = gateway
        .api("POST", "/api/v1/services", Some(json!({"name": "web"})))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let id = id_of(&created);
    assert_eq!(created["name"], "web");
    assert_eq!(created["protocol"], "http");
    assert_eq!(created["lb_policy"], "round_robin");
    assert_eq!(
        created["timeouts"],
        json!({"connect_ms": 5000, "response_header_ms": 30000, "idle_ms": 60000, "keepalive_ms": null})
    );
    assert_eq!(created["max_attempts"], 3);
    assert_eq!(created["tls_verify"], true);
    assert!(created["upstream_authority"].is_null(), "{created}");
    assert!(created["tls_sni"].is_null(), "{created}");
    assert!(created["created_at"].is_string(), "{created}");
    assert!(created["updated_at"].is_string(), "{created}");

    let path = format!("/api/v1/services/{id}");
    assert_eq!(gateway.get_ok(&path).await, created);
    assert_eq!(
        items(&gateway, "/api/v1/services").await,
        vec![created.clone()]
    );

    // PATCH: only the given fields change; a nested timeouts patch keeps the other timeouts.
    let (status, patched) = gateway
        .api(
            "PATCH",
            &path,
            Some(json!({
                "lb_policy": "random",
                "timeouts": {"connect_ms": 1000},
                "upstream_authority": "Shop.Example:8443",
            })),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{patched}");
    assert_eq!(id_of(&patched), id);
    assert_eq!(patched["name"], "web");
    assert_eq!(patched["lb_policy"], "random");
    assert_eq!(
        patched["timeouts"],
        json!({"connect_ms": 1000, "response_header_ms": 30000, "idle_ms": 60000, "keepalive_ms": null})
    );
    assert_eq!(patched["upstream_authority"], "shop.example:8443");
    assert_eq!(patched["max_attempts"], 3);
    assert_eq!(patched["created_at"], created["created_at"]);
    assert_eq!(gateway.get_ok(&path).await, patched);

    // PATCH null resets a field to its default.
    let (status, reset) = gateway
        .api(
            "PATCH",
            &path,
            Some(json!({"upstream_authority": null, "timeouts": {"connect_ms": null}, "lb_policy": null})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{reset}");
    assert!(reset["upstream_authority"].is_null(), "{reset}");
    assert_eq!(reset["lb_policy"], "round_robin");
    assert_eq!(
        reset["timeouts"],
        json!({"connect_ms": 5000, "response_header_ms": 30000, "idle_ms": 60000, "keepalive_ms": null})
    );
    assert_eq!(gateway.get_ok(&path).await, reset);

    // An empty patch changes nothing.
    let (status, same) = gateway.api("PATCH", &path, Some(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{same}");
    for key in [
        "name",
        "protocol",
        "lb_policy",
        "timeouts",
        "max_attempts",
        "tls_verify",
    ] {
        assert_eq!(same[key], reset[key], "{key}");
    }

    // PUT replaces the whole object: what it leaves out goes back to the default.
    gateway
        .api(
            "PATCH",
            &path,
            Some(json!({"lb_policy": "least_request", "tls_verify": false, "timeouts": {"idle_ms": 5}})),
        )
        .await;
    let (status, replaced) = gateway
        .api(
            "PUT",
            &path,
            Some(json!({"name": "web2", "max_attempts": 2})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{replaced}");
    assert_eq!(id_of(&replaced), id);
    assert_eq!(replaced["name"], "web2");
    assert_eq!(replaced["max_attempts"], 2);
    assert_eq!(replaced["lb_policy"], "round_robin");
    assert_eq!(replaced["tls_verify"], true);
    assert_eq!(
        replaced["timeouts"],
        json!({"connect_ms": 5000, "response_header_ms": 30000, "idle_ms": 60000, "keepalive_ms": null})
    );
    assert_eq!(replaced["created_at"], created["created_at"]);
    assert_eq!(gateway.get_ok(&path).await, replaced);

    // The old name is free again after the rename.
    gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;

    // DELETE answers 204 with no body, then the service is gone.
    let (status, body) = gateway.api("DELETE", &path, None).await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    assert!(body.is_null(), "204 has no body: {body}");
    let answer = gateway.api("GET", &path, None).await;
    assert_error("GET deleted service", &answer, 404, "not_found", None);
    let answer = gateway.api("DELETE", &path, None).await;
    assert_error("DELETE deleted service", &answer, 404, "not_found", None);
    let remaining = items(&gateway, "/api/v1/services").await;
    assert_eq!(remaining.len(), 1);
    assert_eq!(remaining[0]["name"], "web");
}

/// RFC 7396: a nested `null` removes the member even where the current value is null (a service
/// without a health check), so the member takes its default instead of being refused.
#[tokio::test]
async fn a_nested_null_patched_onto_a_missing_object_removes_the_member() {
    let gateway = TestGateway::start().await;
    let id = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    let path = format!("/api/v1/services/{id}");
    assert!(gateway.get_ok(&path).await["health_check"].is_null());

    let (status, patched) = gateway
        .api(
            "PATCH",
            &path,
            Some(json!({"health_check": {"type": "http", "path": null}})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{patched}");
    assert_eq!(patched["health_check"]["type"], "http", "{patched}");
    assert_eq!(patched["health_check"]["path"], "/", "{patched}");
    assert_eq!(gateway.get_ok(&path).await, patched);

    // On an existing check a nested null resets just that member.
    gateway
        .api(
            "PATCH",
            &path,
            Some(json!({"health_check": {"path": "/ping", "interval_ms": 500}})),
        )
        .await;
    let (status, reset) = gateway
        .api(
            "PATCH",
            &path,
            Some(json!({"health_check": {"path": null}})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{reset}");
    assert_eq!(reset["health_check"]["path"], "/", "{reset}");
    assert_eq!(reset["health_check"]["interval_ms"], 500, "{reset}");
}

#[tokio::test]
async fn targets_round_trip_with_defaults_put_and_merge_patch() {
    let gateway = TestGateway::start().await;
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    let targets = format!("/api/v1/services/{service}/targets");
    let (status, created) = gateway
        .api(
            "POST",
            &targets,
            Some(json!({"host": "127.0.0.1", "port": 8080})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let id = id_of(&created);
    assert_eq!(created["service_id"], service);
    assert_eq!(created["host"], "127.0.0.1");
    assert_eq!(created["port"], 8080);
    assert_eq!(created["weight"], 100);
    assert_eq!(created["priority"], 0);
    assert_eq!(created["enabled"], true);
    assert_eq!(created["state"], "active");
    assert_eq!(created["health"], "unknown");
    assert!(created["source_id"].is_null(), "{created}");
    assert!(
        created.get("source_id").is_some(),
        "source_id is present: {created}"
    );
    assert!(created["ejected_until"].is_null(), "{created}");
    assert_eq!(created["metadata"], json!({}));

    let path = format!("/api/v1/targets/{id}");
    assert_eq!(gateway.get_ok(&path).await, created);
    assert_eq!(items(&gateway, &targets).await, vec![created.clone()]);

    let (status, patched) = gateway
        .api(
            "PATCH",
            &path,
            Some(json!({"weight": 5, "metadata": {"zone": "a"}, "enabled": false})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{patched}");
    assert_eq!(patched["weight"], 5);
    assert_eq!(patched["metadata"], json!({"zone": "a"}));
    assert_eq!(patched["enabled"], false);
    assert_eq!(patched["host"], "127.0.0.1");
    assert_eq!(patched["port"], 8080);
    assert_eq!(patched["priority"], 0);
    assert_eq!(patched["service_id"], service);
    assert_eq!(gateway.get_ok(&path).await, patched);

    let (status, reset) = gateway
        .api(
            "PATCH",
            &path,
            Some(json!({"weight": null, "enabled": null})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{reset}");
    assert_eq!(reset["weight"], 100);
    assert_eq!(reset["enabled"], true);
    assert_eq!(reset["metadata"], json!({"zone": "a"}));

    let (status, replaced) = gateway
        .api(
            "PUT",
            &path,
            Some(json!({"host": "::1", "port": 9090, "priority": 2})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{replaced}");
    assert_eq!(id_of(&replaced), id);
    assert_eq!(replaced["host"], "::1");
    assert_eq!(replaced["port"], 9090);
    assert_eq!(replaced["priority"], 2);
    assert_eq!(replaced["weight"], 100);
    assert_eq!(replaced["enabled"], true);
    assert_eq!(replaced["metadata"], json!({}));
    assert!(replaced["source_id"].is_null(), "{replaced}");
    assert_eq!(gateway.get_ok(&path).await, replaced);

    let (status, body) = gateway.api("DELETE", &path, None).await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    let answer = gateway.api("GET", &path, None).await;
    assert_error("GET deleted target", &answer, 404, "not_found", None);
    assert!(items(&gateway, &targets).await.is_empty());
}

#[tokio::test]
async fn deleting_a_service_removes_its_targets_but_not_others() {
    let gateway = TestGateway::start().await;
    let doomed = gateway
        .create("/api/v1/services", json!({"name": "doomed"}))
        .await;
    let kept = gateway
        .create("/api/v1/services", json!({"name": "kept"}))
        .await;
    let mut doomed_targets = Vec::new();
    for port in [8081, 8082] {
        doomed_targets.push(
            gateway
                .create(
                    &format!("/api/v1/services/{doomed}/targets"),
                    json!({"host": "127.0.0.1", "port": port}),
                )
                .await,
        );
    }
    let kept_target = gateway
        .create(
            &format!("/api/v1/services/{kept}/targets"),
            json!({"host": "127.0.0.1", "port": 8083}),
        )
        .await;

    let (status, body) = gateway
        .api("DELETE", &format!("/api/v1/services/{doomed}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    for target in doomed_targets {
        let answer = gateway
            .api("GET", &format!("/api/v1/targets/{target}"), None)
            .await;
        assert_error(
            "target of a deleted service",
            &answer,
            404,
            "not_found",
            None,
        );
    }
    let answer = gateway
        .api("GET", &format!("/api/v1/services/{doomed}/targets"), None)
        .await;
    assert_error(
        "targets of a deleted service",
        &answer,
        404,
        "not_found",
        None,
    );
    gateway
        .get_ok(&format!("/api/v1/targets/{kept_target}"))
        .await;
    assert_eq!(
        items(&gateway, &format!("/api/v1/services/{kept}/targets"))
            .await
            .len(),
        1
    );
}

#[tokio::test]
async fn routes_round_trip_and_block_deleting_their_service() {
    let gateway = TestGateway::start().await;
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    let other = gateway
        .create("/api/v1/services", json!({"name": "other"}))
        .await;

    let (status, created) = gateway
        .api(
            "POST",
            "/api/v1/routes",
            Some(json!({"name": "catch-all", "service_id": service})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let id = id_of(&created);
    assert_eq!(created["name"], "catch-all");
    assert_eq!(created["service_id"], service);
    assert_eq!(created["hosts"], json!([]));
    assert_eq!(created["path_prefix"], "/");
    assert_eq!(created["methods"], json!([]));
    assert_eq!(created["preserve_host"], false);
    assert_eq!(created["strip_prefix"], false);
    assert_eq!(created["priority"], 0);
    assert!(created["created_at"].is_string(), "{created}");

    let path = format!("/api/v1/routes/{id}");
    assert_eq!(gateway.get_ok(&path).await, created);
    assert_eq!(
        items(&gateway, "/api/v1/routes").await,
        vec![created.clone()]
    );

    // Hosts are lower-cased, methods upper-cased.
    let (status, normalised) = gateway
        .api(
            "POST",
            "/api/v1/routes",
            Some(json!({
                "name": "api",
                "service_id": service,
                "hosts": ["API.Example.com", "*.example.org"],
                "methods": ["get"],
                "path_prefix": "/api",
            })),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{normalised}");
    let mut hosts: Vec<String> = normalised["hosts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap().to_owned())
        .collect();
    hosts.sort();
    assert_eq!(hosts, vec!["*.example.org", "api.example.com"]);
    assert_eq!(normalised["methods"], json!(["GET"]));
    assert_eq!(normalised["path_prefix"], "/api");

    // PATCH changes only the given fields; null resets.
    let (status, patched) = gateway
        .api(
            "PATCH",
            &path,
            Some(json!({"strip_prefix": true, "path_prefix": "/shop", "hosts": ["shop.example"]})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{patched}");
    assert_eq!(patched["strip_prefix"], true);
    assert_eq!(patched["path_prefix"], "/shop");
    assert_eq!(patched["hosts"], json!(["shop.example"]));
    assert_eq!(patched["name"], "catch-all");
    assert_eq!(patched["service_id"], service);
    assert_eq!(patched["preserve_host"], false);
    assert_eq!(gateway.get_ok(&path).await, patched);
    let (status, reset) = gateway
        .api(
            "PATCH",
            &path,
            Some(json!({"hosts": null, "path_prefix": null})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{reset}");
    assert_eq!(reset["hosts"], json!([]));
    assert_eq!(reset["path_prefix"], "/");
    assert_eq!(reset["strip_prefix"], true);

    // PUT: a full replace, defaults re-applied.
    let (status, replaced) = gateway
        .api(
            "PUT",
            &path,
            Some(json!({"name": "moved", "service_id": other, "preserve_host": true})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{replaced}");
    assert_eq!(id_of(&replaced), id);
    assert_eq!(replaced["name"], "moved");
    assert_eq!(replaced["service_id"], other);
    assert_eq!(replaced["preserve_host"], true);
    assert_eq!(replaced["strip_prefix"], false);
    assert_eq!(replaced["path_prefix"], "/");
    assert_eq!(replaced["hosts"], json!([]));
    assert_eq!(replaced["created_at"], created["created_at"]);
    assert_eq!(gateway.get_ok(&path).await, replaced);

    // A service a route uses cannot be deleted; the refusal names the route.
    for (service_id, route_name) in [(service, "api"), (other, "moved")] {
        let service_path = format!("/api/v1/services/{service_id}");
        let before = gateway.get_ok(&service_path).await;
        let answer = gateway.api("DELETE", &service_path, None).await;
        assert_error("delete a routed service", &answer, 409, "conflict", None);
        let message = answer.1["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(route_name),
            "names route {route_name}: {message}"
        );
        assert_eq!(gateway.get_ok(&service_path).await, before);
    }

    // DELETE the routes, then the services can go.
    let (status, body) = gateway.api("DELETE", &path, None).await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    let answer = gateway.api("GET", &path, None).await;
    assert_error("GET deleted route", &answer, 404, "not_found", None);
    let (status, body) = gateway
        .api("DELETE", &format!("/api/v1/services/{other}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    let (status, body) = gateway
        .api(
            "DELETE",
            &format!("/api/v1/routes/{}", id_of(&normalised)),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    let (status, body) = gateway
        .api("DELETE", &format!("/api/v1/services/{service}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    assert!(items(&gateway, "/api/v1/routes").await.is_empty());
    assert!(items(&gateway, "/api/v1/services").await.is_empty());
}

// ----- 4. pagination -----

async fn collect_pages(gateway: &TestGateway, path: &str, limit: u32) -> Vec<i64> {
    let mut ids = Vec::new();
    let mut after: Option<i64> = None;
    for _ in 0..20 {
        let url = match after {
            Some(after) => format!("{path}?limit={limit}&after={after}"),
            None => format!("{path}?limit={limit}"),
        };
        let (status, page) = gateway.api("GET", &url, None).await;
        assert_eq!(status, StatusCode::OK, "GET {url}: {page}");
        let page_items = page["items"].as_array().expect("items");
        assert!(
            page_items.len() <= limit as usize,
            "GET {url}: more than {limit} items: {page}"
        );
        ids.extend(page_items.iter().map(id_of));
        match &page["next"] {
            Value::Null => return ids,
            next => {
                let next = next
                    .as_i64()
                    .unwrap_or_else(|| panic!("next is an id: {page}"));
                assert_eq!(
                    Some(next),
                    page_items.last().map(id_of),
                    "next is the last id of the page: {page}"
                );
                after = Some(next);
            }
        }
    }
    panic!("pagination of {path} did not end after 20 pages: {ids:?}");
}

#[tokio::test]
async fn lists_page_with_limit_and_after_until_next_is_null() {
    let gateway = TestGateway::start().await;
    let mut created = Vec::new();
    for n in 0..5 {
        created.push(
            gateway
                .create("/api/v1/services", json!({"name": format!("svc-{n}")}))
                .await,
        );
    }
    let mut sorted = created.clone();
    sorted.sort();
    assert_eq!(created, sorted, "ids grow with creation");

    assert_eq!(
        collect_pages(&gateway, "/api/v1/services", 2).await,
        created
    );
    assert_eq!(
        collect_pages(&gateway, "/api/v1/services", 1).await,
        created
    );
    assert_eq!(
        collect_pages(&gateway, "/api/v1/services", 5).await,
        created
    );
    assert_eq!(
        collect_pages(&gateway, "/api/v1/services", 1000).await,
        created
    );

    // The first page of two has a cursor; the last page has none.
    let (_, first) = gateway.api("GET", "/api/v1/services?limit=2", None).await;
    assert_eq!(first["items"].as_array().unwrap().len(), 2);
    assert_eq!(first["next"], created[1]);
    let (_, last) = gateway
        .api(
            "GET",
            &format!("/api/v1/services?limit=2&after={}", created[3]),
            None,
        )
        .await;
    assert_eq!(last["items"].as_array().unwrap().len(), 1);
    assert_eq!(last["items"][0]["id"], created[4]);
    assert!(last["next"].is_null(), "{last}");

    // Targets and routes page the same way.
    let service = created[0];
    let targets = format!("/api/v1/services/{service}/targets");
    let mut target_ids = Vec::new();
    for port in 1..=5 {
        target_ids.push(
            gateway
                .create(&targets, json!({"host": "127.0.0.1", "port": port}))
                .await,
        );
    }
    assert_eq!(collect_pages(&gateway, &targets, 2).await, target_ids);
    let mut route_ids = Vec::new();
    for n in 0..3 {
        route_ids.push(
            gateway
                .create(
                    "/api/v1/routes",
                    json!({"name": format!("r{n}"), "service_id": service, "path_prefix": format!("/r{n}")}),
                )
                .await,
        );
    }
    assert_eq!(
        collect_pages(&gateway, "/api/v1/routes", 2).await,
        route_ids
    );
}

// ----- 5. restart -----

#[tokio::test]
async fn configuration_survives_a_restart_and_still_routes() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("kept-upstream").await;
    let service = gateway
        .service_with_targets("web", &[target(&upstream, 7, 0)])
        .await;
    let standby = gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            json!({"host": "127.0.0.1", "port": 9, "priority": 5, "enabled": false, "metadata": {"zone": "b"}}),
        )
        .await;
    gateway.route_all_to(service).await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "api", "service_id": service, "path_prefix": "/api", "strip_prefix": true, "methods": ["GET"]}),
        )
        .await;
    gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{service}"),
            Some(json!({"timeouts": {"idle_ms": 1234}, "max_attempts": 2})),
        )
        .await;
    let (status, viewer) = gateway
        .api(
            "POST",
            "/api/v1/tokens",
            Some(json!({"name": "viewer", "role": "viewer"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{viewer}");
    let viewer = viewer["token"].as_str().unwrap().to_owned();

    let response = gateway.get("/hello").await;
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(response.text().await.unwrap(), "kept-upstream");

    let services = items(&gateway, "/api/v1/services").await;
    let targets = items(&gateway, &format!("/api/v1/services/{service}/targets")).await;
    let routes = items(&gateway, "/api/v1/routes").await;
    assert_eq!(targets.len(), 2);
    assert_eq!(routes.len(), 2);
    let gateway = gateway.restart().await;

    assert_eq!(items(&gateway, "/api/v1/services").await, services);
    assert_eq!(
        items(&gateway, &format!("/api/v1/services/{service}/targets")).await,
        targets
    );
    assert_eq!(items(&gateway, "/api/v1/routes").await, routes);
    let standby_target = gateway.get_ok(&format!("/api/v1/targets/{standby}")).await;
    assert_eq!(standby_target["metadata"], json!({"zone": "b"}));
    assert_eq!(standby_target["enabled"], false);
    let stored = gateway.get_ok(&format!("/api/v1/services/{service}")).await;
    assert_eq!(stored["timeouts"]["idle_ms"], 1234);
    assert_eq!(stored["max_attempts"], 2);

    // Tokens survive too.
    let (status, body) = gateway
        .api_as(Some(&viewer), "GET", "/api/v1/services", None)
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");

    // The restarted gateway serves the stored routes from its first request.
    let hits_before = upstream.hits();
    let response = gateway.get("/hello").await;
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(response.text().await.unwrap(), "kept-upstream");
    let response = gateway.get("/api/items").await;
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(upstream.hits(), hits_before + 2);
    assert_eq!(upstream.last_seen().path, "/items", "strip_prefix survives");

    // And new writes after the restart get fresh ids.
    let new_service = gateway
        .create("/api/v1/services", json!({"name": "after-restart"}))
        .await;
    assert!(services.iter().all(|s| id_of(s) < new_service));
}

// ----- 6. OpenAPI -----

#[tokio::test]
async fn the_openapi_document_lists_every_resource() {
    let gateway = TestGateway::start().await;
    let (status, document) = gateway.api("GET", "/api/v1/openapi.json", None).await;
    assert_eq!(status, StatusCode::OK, "{document}");
    assert!(
        document["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.")),
        "an OpenAPI 3 document: {}",
        document["openapi"]
    );
    let paths = document["paths"]
        .as_object()
        .unwrap_or_else(|| panic!("the document has paths: {document}"));
    for (path, methods) in [
        ("/services", &["get", "post"][..]),
        ("/services/{id}", &["get", "put", "patch", "delete"][..]),
        ("/services/{id}/targets", &["get", "post"][..]),
        ("/targets/{id}", &["get", "put", "patch", "delete"][..]),
        ("/routes", &["get", "post"][..]),
        ("/routes/{id}", &["get", "put", "patch", "delete"][..]),
        ("/tokens", &["get", "post"][..]),
    ] {
        let item = paths
            .get(path)
            .unwrap_or_else(|| panic!("paths has {path}: {:?}", paths.keys().collect::<Vec<_>>()));
        for method in methods {
            assert!(
                item.get(*method).is_some(),
                "{path} documents {method}: {item}"
            );
        }
    }
    // Route rules are described down to their parts.
    let schemas = &document["components"]["schemas"];
    let spec = &schemas["RouteSpec"]["properties"];
    for field in [
        "path_exact",
        "path_regex",
        "headers",
        "query",
        "cookies",
        "backends",
        "request_headers",
        "response_headers",
        "redirect",
        "rewrite",
        "mirror",
        "cors",
        "timeouts",
    ] {
        assert!(
            spec.get(field).is_some(),
            "RouteSpec documents {field}: {spec}"
        );
    }
    for schema in [
        "Backend",
        "Condition",
        "Cors",
        "HeaderFilter",
        "Mirror",
        "Redirect",
        "Rewrite",
        "RouteTimeouts",
    ] {
        assert!(schemas.get(schema).is_some(), "components has {schema}");
    }
}

// ----- 7. health -----

#[tokio::test]
async fn health_endpoints_answer_without_a_token() {
    let gateway = TestGateway::start().await;
    for path in ["/healthz", "/readyz"] {
        let (status, body) = gateway.api_as(None, "GET", path, None).await;
        assert_eq!(status, StatusCode::OK, "GET {path}: {body}");
        assert!(body.is_object(), "GET {path} answers JSON: {body}");
    }
}

// ----- 8. configured admin token -----

/// A changed `admin.token` replaces the previously configured one (which stops working)
/// instead of adding a second configured token; tokens created through the API stay.
#[tokio::test]
async fn a_changed_configured_admin_token_replaces_the_old_one() {
    const NEW_TOKEN: &str = "a-different-admin-token-fedcba9876543210";
    let mut gateway = TestGateway::start().await;
    let (status, viewer) = gateway
        .api(
            "POST",
            "/api/v1/tokens",
            Some(json!({"name": "viewer", "role": "viewer"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{viewer}");
    let viewer = viewer["token"].as_str().unwrap().to_owned();

    // Restart on the same store with another configured token.
    if let Some(first) = gateway.gateway.take() {
        first.shutdown().await;
    }
    let dir = gateway.dir.clone();
    let mut config = test_config(dir.path());
    assert_eq!(config.admin.token.as_deref(), Some(ADMIN_TOKEN));
    config.admin.token = Some(NEW_TOKEN.to_owned());
    let gateway = TestGateway::start_with(dir, config).await;

    let (status, body) = gateway
        .api_as(Some(NEW_TOKEN), "GET", "/api/v1/services", None)
        .await;
    assert_eq!(status, StatusCode::OK, "the new configured token: {body}");
    let answer = gateway
        .api_as(Some(ADMIN_TOKEN), "GET", "/api/v1/services", None)
        .await;
    assert_error(
        "the replaced configured token",
        &answer,
        401,
        "unauthorized",
        None,
    );
    let (status, body) = gateway
        .api_as(Some(&viewer), "GET", "/api/v1/services", None)
        .await;
    assert_eq!(
        status,
        StatusCode::OK,
        "a token made through the API stays: {body}"
    );

    let (status, list) = gateway
        .api_as(Some(NEW_TOKEN), "GET", "/api/v1/tokens", None)
        .await;
    assert_eq!(status, StatusCode::OK, "{list}");
    let tokens = list["items"].as_array().expect("token items").clone();
    let configured: Vec<&Value> = tokens
        .iter()
        .filter(|token| {
            token["name"]
                .as_str()
                .is_some_and(|name| name.starts_with("configured-admin"))
        })
        .collect();
    assert_eq!(
        configured.len(),
        1,
        "exactly one configured admin token: {tokens:?}"
    );
    assert_eq!(configured[0]["name"], "configured-admin", "{tokens:?}");
    assert_eq!(configured[0]["role"], "admin", "{tokens:?}");
    assert_eq!(
        tokens.len(),
        2,
        "the configured token and the viewer: {tokens:?}"
    );
    assert!(
        tokens.iter().any(|token| token["name"] == "viewer"),
        "{tokens:?}"
    );
}

/// A viewer reads a source's status (what the dashboard shows as refresh times) but never the
/// source itself, whose `config` may hold registry credentials; the status carries none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_viewer_reads_a_sources_status_but_never_its_config() {
    let gateway = TestGateway::start().await;
    let registry = common::registry::Registry::start().await;
    registry.set_raw(503, "text/plain", "down for maintenance");
    let service = gateway
        .create("/api/v1/services", json!({"name": "disc"}))
        .await;
    let secret = "s3cret-registry-token";
    let source = gateway
        .create(
            &format!("/api/v1/services/{service}/discovery-sources"),
            json!({
                "name": "registry",
                "provider": "http",
                "config": {
                    "url": registry.url(&format!("/v1/endpoints?token={secret}")),
                    "headers": {"Authorization": format!("Bearer {secret}")},
                    "interval_ms": 200,
                },
            }),
        )
        .await;
    let (code, created) = gateway
        .api(
            "POST",
            "/api/v1/tokens",
            Some(json!({"name": "status-reader", "role": "viewer"})),
        )
        .await;
    assert_eq!(code, StatusCode::CREATED, "{created}");
    let viewer = created["token"].as_str().expect("a token").to_owned();
    let status_path = format!("/api/v1/discovery-sources/{source}/status");
    let status = wait_until(
        "the first refresh failed",
        std::time::Duration::from_secs(10),
        || async {
            let (code, body) = gateway
                .api_as(Some(&viewer), "GET", &status_path, None)
                .await;
            assert_eq!(code, StatusCode::OK, "viewer GET {status_path}: {body}");
            if body["last_error"].is_string() && body["last_refresh_at"].is_string() {
                Ok(body)
            } else {
                Err(body)
            }
        },
    )
    .await;
    assert!(status.get("config").is_none(), "{status}");
    assert!(status["next_refresh_at"].is_string(), "{status}");
    assert!(!status.to_string().contains(secret), "{status}");

    let refused = [
        ("GET", format!("/api/v1/discovery-sources/{source}")),
        (
            "GET",
            format!("/api/v1/services/{service}/discovery-sources"),
        ),
        (
            "POST",
            format!("/api/v1/discovery-sources/{source}/refresh"),
        ),
        (
            "POST",
            format!("/api/v1/discovery-sources/{source}/accept-removals"),
        ),
    ];
    for (method, path) in refused {
        let answer = gateway.api_as(Some(&viewer), method, &path, None).await;
        assert_error(
            &format!("viewer {method} {path}"),
            &answer,
            403,
            "forbidden",
            None,
        );
    }
    let missing = gateway
        .api_as(
            Some(&viewer),
            "GET",
            "/api/v1/discovery-sources/9999/status",
            None,
        )
        .await;
    assert_eq!(missing.0, StatusCode::NOT_FOUND, "{}", missing.1);
}
