//! A route's `retry` through the admin API over real HTTP (TRAFFIC.md §5): each bad field is
//! refused with 422 naming it, a good policy reads back with its defaults filled in, a merge
//! patch changes or removes it, and a resources file takes it under the same names.

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::common::TestGateway;

async fn refused_field(gateway: &TestGateway, method: &str, path: &str, body: Value) -> String {
    let (status, answer) = gateway.api(method, path, Some(body.clone())).await;
    assert_eq!(
        status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{method} {path} {body}: {answer}"
    );
    answer["error"]["field"]
        .as_str()
        .unwrap_or_else(|| panic!("no field named: {answer}"))
        .to_owned()
}

#[tokio::test]
async fn bad_retry_policies_are_refused_naming_their_field() {
    let gateway = TestGateway::start().await;
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    let cases = [
        (json!({"attempts": 0}), "retry.attempts"),
        (json!({"attempts": 11}), "retry.attempts"),
        (json!({"attempts": -1}), "retry.attempts"),
        (json!({"on": ["nope"]}), "retry.on[0]"),
        (json!({"on": ["reset", "5xx", "galaxy"]}), "retry.on[2]"),
        (json!({"on": ["reset", "5xx", "reset"]}), "retry.on[2]"),
        (json!({"on": []}), "retry.on"),
        (
            json!({"on": ["retriable_status"], "statuses": [600]}),
            "retry.statuses[0]",
        ),
        (
            json!({"on": ["retriable_status"], "statuses": [429, 429]}),
            "retry.statuses[1]",
        ),
        (json!({"on": ["retriable_status"]}), "retry.statuses"),
        (json!({"statuses": [503]}), "retry.statuses"),
        (json!({"per_try_timeout_ms": 0}), "retry.per_try_timeout_ms"),
        (json!({"hedge_after_ms": 3_600_001}), "retry.hedge_after_ms"),
        (
            json!({"per_try_timeout_ms": 200, "hedge_after_ms": 200}),
            "retry.hedge_after_ms",
        ),
        (json!({"budget": {"percent": 101}}), "retry.budget.percent"),
        (json!({"budget": {"percent": -1}}), "retry.budget.percent"),
        (
            json!({"budget": {"min_per_second": 1_000_001}}),
            "retry.budget.min_per_second",
        ),
        (
            json!({"backoff": {"base_ms": 100, "max_ms": 50}}),
            "retry.backoff.max_ms",
        ),
        (
            json!({"backoff": {"jitter": "none"}}),
            "retry.backoff.jitter",
        ),
        (json!({"tries": 3}), "retry.tries"),
    ];
    for (retry, field) in cases {
        let route = json!({"name": "r", "service_id": service, "retry": retry});
        assert_eq!(
            refused_field(&gateway, "POST", "/api/v1/routes", route).await,
            field,
            "{retry}"
        );
    }
    let redirect = json!({"name": "old", "path_prefix": "/old",
                          "redirect": {"path": "/new", "status": 308}, "retry": {}});
    assert_eq!(
        refused_field(&gateway, "POST", "/api/v1/routes", redirect).await,
        "retry"
    );
    // A merge patch is checked the same way, and leaves the route as it was.
    let id = gateway
        .create(
            "/api/v1/routes",
            json!({"name": "r", "service_id": service}),
        )
        .await;
    let path = format!("/api/v1/routes/{id}");
    assert_eq!(
        refused_field(
            &gateway,
            "PATCH",
            &path,
            json!({"retry": {"on": ["5xx", "nope"]}})
        )
        .await,
        "retry.on[1]"
    );
    let (status, route) = gateway.api("GET", &path, None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(route["retry"], Value::Null, "{route}");
}

#[tokio::test]
async fn a_retry_policy_reads_back_with_its_defaults_and_a_patch_removes_it() {
    let gateway = TestGateway::start().await;
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    let (status, created) = gateway
        .api(
            "POST",
            "/api/v1/routes",
            Some(json!({"name": "r", "service_id": service, "retry": {}})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let defaults = json!({
        "attempts": 3,
        "on": ["connect_failure", "refused", "reset", "gateway_error"],
        "statuses": [],
        "per_try_timeout_ms": null,
        "backoff": {"base_ms": 25, "max_ms": 250},
        "budget": {"percent": 20.0, "min_per_second": 10},
        "hedge_after_ms": null,
    });
    assert_eq!(created["retry"], defaults);
    let path = format!("/api/v1/routes/{}", created["id"]);
    let (status, read) = gateway.api("GET", &path, None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(read["retry"], defaults);

    // A merge patch changes the members it names and keeps the others.
    let (status, patched) = gateway
        .api(
            "PATCH",
            &path,
            Some(
                json!({"retry": {"attempts": 5, "on": ["5xx", "retriable_status"],
                                   "statuses": [429], "per_try_timeout_ms": 1000,
                                   "hedge_after_ms": 300, "budget": {"percent": 12.5}}}),
            ),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{patched}");
    assert_eq!(
        patched["retry"],
        json!({
            "attempts": 5,
            "on": ["5xx", "retriable_status"],
            "statuses": [429],
            "per_try_timeout_ms": 1000,
            "backoff": {"base_ms": 25, "max_ms": 250},
            "budget": {"percent": 12.5, "min_per_second": 10},
            "hedge_after_ms": 300,
        })
    );

    let (status, removed) = gateway
        .api("PATCH", &path, Some(json!({"retry": null})))
        .await;
    assert_eq!(status, StatusCode::OK, "{removed}");
    assert_eq!(removed["retry"], Value::Null);
    let (_, read) = gateway.api("GET", &path, None).await;
    assert_eq!(read["retry"], Value::Null, "{read}");
    assert_eq!(read["name"], "r");
}

/// A resources file's route takes `retry` with the API's names, and a bad one is named at its
/// place in the file.
#[test]
fn a_resources_file_takes_retry_under_the_same_names() {
    // The policy as a table of its own, as a file would write it.
    let file = |retry: &str| {
        format!(
            r#"
[[services]]
name = "web"

[[routes]]
name = "api"
service = "web"
  [routes.retry]
  {retry}
"#
        )
    };
    raahi::resources::parse(
        "resources.toml",
        &file(
            r#"attempts = 4
  on = ["connect_failure", "5xx", "retriable_status"]
  statuses = [429]
  per_try_timeout_ms = 1000
  hedge_after_ms = 200
  backoff = { base_ms = 10, max_ms = 100 }
  budget = { percent = 10, min_per_second = 5 }"#,
        ),
    )
    .expect("a good retry policy is accepted");
    raahi::resources::parse("resources.toml", &file("")).expect("an empty policy takes defaults");
    for (retry, location) in [
        (r#"on = ["reset", "reset"]"#, "routes[0].retry.on[1]"),
        (r#"on = ["nope"]"#, "routes[0].retry.on[0]"),
        ("attempts = 0", "routes[0].retry.attempts"),
        (
            "budget = { percent = 101 }",
            "routes[0].retry.budget.percent",
        ),
    ] {
        match raahi::resources::parse("resources.toml", &file(retry)) {
            Err(raahi::resources::ResourcesError::Invalid {
                location: named, ..
            }) => assert_eq!(named, location, "{retry}"),
            Err(other) => panic!("{retry}: {other}"),
            Ok(_) => panic!("{retry} was accepted"),
        }
    }
}
