use crate::common;
use common::*;

#[tokio::test]
async fn a_request_reaches_the_upstream() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("a").await;
    let service = gateway
        .service_with_targets("web", &[target(&upstream, 1, 0)])
        .await;
    gateway.route_all_to(service).await;
    let response = gateway.get("/hello").await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.text().await.unwrap(), "a");
}
