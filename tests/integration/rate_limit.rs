//! Route limits through real sockets (TRAFFIC.md §6): a key over its rate gets 429
//! `rate_limited` with `Retry-After` and the IETF quota fields while other keys go on; a gRPC
//! client gets RESOURCE_EXHAUSTED; `max_in_flight` answers 503 `too_many_requests` and frees
//! its places as answers end; bad limits are refused naming their field.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use reqwest::StatusCode;
use serde_json::json;
use tokio::sync::watch;

use crate::common::grpc::{client, grpc_service, EchoRequest, GrpcOrigin};
use crate::common::{target, wait_until, TestGateway, Upstream};

const STEP: Duration = Duration::from_secs(10);

async fn limited_route(gateway: &TestGateway, upstream: &Upstream, rules: serde_json::Value) {
    let service = gateway
        .service_with_targets("web", &[target(upstream, 100, 0)])
        .await;
    let mut route = json!({"name": "limited", "service_id": service});
    route
        .as_object_mut()
        .unwrap()
        .extend(rules.as_object().unwrap().clone());
    gateway.create("/api/v1/routes", route).await;
}

async fn status_of(http: &reqwest::Client, gateway: &TestGateway) -> StatusCode {
    http.get(gateway.proxy_url("/x"))
        .send()
        .await
        .unwrap()
        .status()
}

async fn get_with_key(
    http: &reqwest::Client,
    gateway: &TestGateway,
    key: &str,
) -> reqwest::Response {
    http.get(gateway.proxy_url("/x"))
        .header("x-api-key", key)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_key_over_its_rate_gets_429_with_its_quota_while_another_goes_on() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("web").await;
    // One request a minute after a burst of three: the test cannot outrun the refill.
    limited_route(
        &gateway,
        &upstream,
        json!({"rate_limit": {"requests_per_second": 0.0166667, "burst": 3,
                              "key": {"header": "X-Api-Key"}}}),
    )
    .await;
    let http = reqwest::Client::new();
    for _ in 0..3 {
        let response = get_with_key(&http, &gateway, "alpha").await;
        assert_eq!(response.status(), StatusCode::OK);
    }
    let refused = get_with_key(&http, &gateway, "alpha").await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let headers = refused.headers().clone();
    let retry_after: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(
        (55..=60).contains(&retry_after),
        "Retry-After {retry_after}"
    );
    assert_eq!(headers["ratelimit-policy"], "\"default\";q=3;w=180");
    assert_eq!(
        headers["ratelimit"].to_str().unwrap(),
        format!("\"default\";r=0;t={retry_after}")
    );
    // A bodyless refusal keeps the connection for the next request.
    assert!(headers.get("connection").is_none());
    let body: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limited");
    assert_eq!(
        upstream.hits(),
        3,
        "the refused request never reached the target"
    );

    // Another key, and a request without the header (keyed by its address), go on.
    assert_eq!(
        get_with_key(&http, &gateway, "beta").await.status(),
        StatusCode::OK
    );
    let anonymous = http.get(gateway.proxy_url("/x")).send().await.unwrap();
    assert_eq!(anonymous.status(), StatusCode::OK);
    assert_eq!(
        get_with_key(&http, &gateway, "alpha").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        gateway
            .metric("raahi_requests_refused_total{code=\"rate_limited\"}")
            .await,
        2
    );
}

#[tokio::test]
async fn a_refused_key_is_admitted_again_once_its_interval_passed() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("web").await;
    // One request every 3 s: a loaded machine still sends the second well within the interval.
    limited_route(
        &gateway,
        &upstream,
        json!({"rate_limit": {"requests_per_second": 0.333334, "burst": 1, "key": "route"}}),
    )
    .await;
    let http = reqwest::Client::new();
    let admitted_at = tokio::time::Instant::now();
    assert_eq!(status_of(&http, &gateway).await, StatusCode::OK);
    // The route's one key: any client is refused now, and admitted again about 3 s later.
    let refused = http
        .get(gateway.proxy_url("/x"))
        .header("x-api-key", "other")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry_after: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=3).contains(&retry_after), "Retry-After {retry_after}");
    wait_until("the route admits a request again", STEP, || async {
        let status = status_of(&http, &gateway).await;
        (status == StatusCode::OK).then_some(()).ok_or(status)
    })
    .await;
    assert!(
        admitted_at.elapsed() >= Duration::from_millis(2900),
        "admitted again after {:?}, before its interval",
        admitted_at.elapsed()
    );
}

#[tokio::test]
async fn a_request_with_a_body_refused_closes_its_connection() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("web").await;
    limited_route(
        &gateway,
        &upstream,
        json!({"rate_limit": {"requests_per_second": 0.001, "burst": 1, "key": "route"}}),
    )
    .await;
    let http = reqwest::Client::new();
    assert_eq!(status_of(&http, &gateway).await, StatusCode::OK);
    let answer = crate::common::raw_http(
        gateway.proxy,
        "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
}

#[tokio::test]
async fn a_grpc_call_over_the_rate_gets_resource_exhausted() {
    let gateway = TestGateway::start().await;
    let origin = GrpcOrigin::start("a").await;
    let service = grpc_service(&gateway, "grpc", &[&origin], json!({})).await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "grpc", "service_id": service,
                   "rate_limit": {"requests_per_second": 0.001, "burst": 1, "key": "route"}}),
        )
        .await;
    let mut grpc = client(gateway.proxy).await;
    let request = || EchoRequest {
        text: "hi".to_owned(),
        ..EchoRequest::default()
    };
    grpc.unary(request()).await.expect("the first call passes");
    let status = grpc.unary(request()).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
}

/// An origin whose answers wait until `release` turns true.
async fn held_origin(release: watch::Receiver<bool>) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let release = release.clone();
            tokio::spawn(async move {
                let service = service_fn(move |_request| {
                    let mut release = release.clone();
                    async move {
                        let _ = release.wait_for(|released| *released).await;
                        Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from("done"))))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    address
}

/// A route `held` with `max_in_flight` to an origin whose answers wait until the sender
/// returned is told `true`.
async fn held_route(gateway: &TestGateway, max_in_flight: u32) -> watch::Sender<bool> {
    let (release, released) = watch::channel(false);
    let origin = held_origin(released).await;
    let service = gateway
        .service_with_targets(
            "held",
            &[json!({"host": origin.ip().to_string(), "port": origin.port()})],
        )
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "held", "service_id": service, "max_in_flight": max_in_flight}),
        )
        .await;
    release
}

#[tokio::test]
async fn past_max_in_flight_a_request_gets_503_until_an_answer_ends() {
    let gateway = TestGateway::start().await;
    let release = held_route(&gateway, 2).await;
    // Every request times out rather than wait for ever should one be held unexpectedly.
    let http = reqwest::Client::builder().timeout(STEP).build().unwrap();
    let held: Vec<_> = (0..2)
        .map(|_| tokio::spawn(http.get(gateway.proxy_url("/x")).send()))
        .collect();
    wait_until("both requests are in flight", STEP, || async {
        let in_flight = gateway
            .metric("raahi_route_in_flight{route=\"held\"}")
            .await;
        (in_flight == 2).then_some(()).ok_or(in_flight)
    })
    .await;
    let refused = http.get(gateway.proxy_url("/x")).send().await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "too_many_requests");
    assert_eq!(
        gateway
            .metric("raahi_requests_refused_total{code=\"too_many_requests\"}")
            .await,
        1
    );
    release.send(true).unwrap();
    for request in held {
        let response = request.await.unwrap().unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.text().await.unwrap(), "done");
    }
    // Both places are free again once the answers' bodies ended.
    wait_until("no request in flight", STEP, || async {
        let in_flight = gateway
            .metric("raahi_route_in_flight{route=\"held\"}")
            .await;
        (in_flight == 0).then_some(()).ok_or(in_flight)
    })
    .await;
    for _ in 0..3 {
        let response = http.get(gateway.proxy_url("/x")).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
}

#[tokio::test]
async fn bad_limits_are_refused_naming_their_field_and_good_ones_read_back() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("web").await;
    let service = gateway
        .service_with_targets("web", &[target(&upstream, 100, 0)])
        .await;
    let cases = [
        (
            json!({"requests_per_second": 0}),
            "rate_limit.requests_per_second",
        ),
        (
            json!({"requests_per_second": 5, "burst": 0}),
            "rate_limit.burst",
        ),
        (
            json!({"requests_per_second": 5, "key": {"header": "bad header"}}),
            "rate_limit.key.header",
        ),
        (
            json!({"requests_per_second": 5, "max_keys": 0}),
            "rate_limit.max_keys",
        ),
        (
            json!({"requests_per_second": 5, "scope": "galaxy"}),
            "rate_limit.scope",
        ),
        (
            json!({"requests_per_second": 5, "key": "cookie"}),
            "rate_limit.key",
        ),
        (json!({"burst": 5}), "rate_limit.requests_per_second"),
    ];
    for (rate_limit, field) in cases {
        let (status, body) = gateway
            .api(
                "POST",
                "/api/v1/routes",
                Some(json!({"name": "r", "service_id": service, "rate_limit": rate_limit})),
            )
            .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert_eq!(body["error"]["field"], field, "{body}");
    }
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/routes",
            Some(json!({"name": "r", "service_id": service, "max_in_flight": 0})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(body["error"]["field"], "max_in_flight");
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/routes",
            Some(
                json!({"name": "r", "service_id": service, "max_in_flight": 10,
                        "rate_limit": {"requests_per_second": 2.5, "scope": "cluster",
                                       "key": {"header": "X-Api-Key"}}}),
            ),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(
        body["rate_limit"],
        json!({"requests_per_second": 2.5, "burst": null, "key": {"header": "x-api-key"},
               "scope": "cluster", "max_keys": 100000})
    );
    assert_eq!(body["max_in_flight"], 10);
    // A merge patch removes the limit.
    let id = body["id"].as_i64().unwrap();
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/routes/{id}"),
            Some(json!({"rate_limit": null})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["rate_limit"], serde_json::Value::Null);
    assert_eq!(body["max_in_flight"], 10);
}

#[tokio::test]
async fn a_request_its_client_abandons_keeps_its_place_until_it_ends() {
    let gateway = TestGateway::start().await;
    let release = held_route(&gateway, 1).await;
    let in_flight = || async {
        gateway
            .metric("raahi_route_in_flight{route=\"held\"}")
            .await
    };
    // An HTTP/2 client whose stream is reset once its request reached the target: the exchange
    // finishes on its own (its connection goes home), and holds the route's place meanwhile.
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .timeout(STEP)
        .build()
        .unwrap();
    let abandoned = tokio::spawn(h2.get(gateway.proxy_url("/x")).send());
    wait_until("the request is in flight", STEP, || async {
        let now = in_flight().await;
        (now == 1).then_some(()).ok_or(now)
    })
    .await;
    abandoned.abort();
    assert!(abandoned.await.unwrap_err().is_cancelled());
    crate::common::holds_for(
        "the abandoned exchange keeps its place",
        Duration::from_millis(500),
        || async {
            let now = in_flight().await;
            (now == 1).then_some(()).ok_or(now)
        },
    )
    .await;
    let http = reqwest::Client::builder().timeout(STEP).build().unwrap();
    let refused = http.get(gateway.proxy_url("/x")).send().await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    release.send(true).unwrap();
    wait_until("the abandoned exchange ended", STEP, || async {
        let now = in_flight().await;
        (now == 0).then_some(()).ok_or(now)
    })
    .await;
    let response = http.get(gateway.proxy_url("/x")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
}
