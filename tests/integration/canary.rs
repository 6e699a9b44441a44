//! Canaries through real sockets (TRAFFIC.md §4): a healthy canary promoted step by step with
//! the traffic share following each step.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use crate::common::{target, wait_until, TestGateway, Upstream};

#[tokio::test]
async fn a_healthy_canary_is_promoted_through_its_steps() {
    let gateway = TestGateway::start().await;
    let stable = Upstream::start("stable").await;
    let canary = Upstream::start("canary").await;
    let stable_id = gateway
        .service_with_targets("stable", &[target(&stable, 100, 0)])
        .await;
    let canary_id = gateway
        .service_with_targets("canary", &[target(&canary, 100, 0)])
        .await;
    let route = gateway
        .create(
            "/api/v1/routes",
            json!({"name": "shop", "backends": [
                {"service_id": stable_id}, {"service_id": canary_id}],
                "canary": {"backend": 1, "steps": [10, 50, 100], "step_interval_ms": 1000,
                    "min_requests": 5}}),
        )
        .await;
    let (status, view) = gateway
        .api("GET", &format!("/api/v1/routes/{route}/canary"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{view}");
    assert_eq!(view["state"], "progressing");
    assert_eq!(view["weight"], 10);
    for _ in 0..100 {
        assert_eq!(gateway.get("/").await.status(), StatusCode::OK);
    }
    assert_eq!(canary.hits(), 10);
    let view = wait_until("the canary promoted", Duration::from_secs(20), || async {
        for _ in 0..20 {
            gateway.get("/").await;
        }
        let (_, view) = gateway
            .api("GET", &format!("/api/v1/routes/{route}/canary"), None)
            .await;
        (view["state"] == "promoted").then_some(view)
    })
    .await;
    assert_eq!(view["weight"], 100);
    let history = view["history"].as_array().unwrap();
    assert!(history.len() >= 4, "{view}");
}
