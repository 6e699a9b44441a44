//! Route rules through real sockets (TRAFFIC.md §3): conditions on headers, query and cookies,
//! path forms, weighted backends and subsets, and the filters on the way.

use reqwest::StatusCode;
use serde_json::json;

use crate::common::{target, TestGateway, Upstream};

async fn two_services(gateway: &TestGateway) -> (Upstream, i64, Upstream, i64) {
    let stable = Upstream::start("stable").await;
    let canary = Upstream::start("canary").await;
    let stable_id = gateway
        .service_with_targets("stable", &[target(&stable, 100, 0)])
        .await;
    let canary_id = gateway
        .service_with_targets("canary", &[target(&canary, 100, 0)])
        .await;
    (stable, stable_id, canary, canary_id)
}

async fn body_of(response: reqwest::Response) -> String {
    response.text().await.expect("a body")
}

#[tokio::test]
async fn header_query_and_cookie_conditions_choose_the_route() {
    let gateway = TestGateway::start().await;
    let (_stable, stable, _canary, canary) = two_services(&gateway).await;
    gateway.route_all_to(stable).await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "by-header", "service_id": canary,
                   "headers": [{"name": "X-Canary", "value": "1"}]}),
        )
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "by-query", "service_id": canary, "path_prefix": "/q",
                   "query": [{"name": "version", "regex": "v[2-9]"}]}),
        )
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "by-cookie", "service_id": canary, "path_exact": "/c",
                   "cookies": [{"name": "beta", "present": true}]}),
        )
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "by-regex", "service_id": canary, "hosts": ["api.test"],
                   "path_regex": "/items/[0-9]+"}),
        )
        .await;
    let http = reqwest::Client::new();
    let send = |path: &str, header: Option<(&str, &str)>| {
        let mut request = http.get(gateway.proxy_url(path));
        if let Some((name, value)) = header {
            request = request.header(name, value);
        }
        request.send()
    };
    type Case<'a> = (&'a str, Option<(&'a str, &'a str)>, &'a str);
    let cases: &[Case<'_>] = &[
        ("/x", Some(("x-canary", "1")), "canary"),
        ("/x", Some(("x-canary", "2")), "stable"),
        ("/x", None, "stable"),
        ("/q?version=v3", None, "canary"),
        ("/q?version=v1", None, "stable"),
        ("/q?other=v3", None, "stable"),
        ("/c", Some(("cookie", "a=1; beta=yes")), "canary"),
        ("/c", Some(("cookie", "a=1")), "stable"),
        ("/c/more", Some(("cookie", "beta=yes")), "stable"),
        ("/items/42", Some(("host", "api.test")), "canary"),
        ("/items/42x", Some(("host", "api.test")), "stable"),
    ];
    for (path, header, expected) in cases {
        let response = send(path, *header).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{path} {header:?}");
        assert_eq!(body_of(response).await, *expected, "{path} {header:?}");
    }
}

#[tokio::test]
async fn a_ninety_ten_split_is_exact_over_a_thousand_requests() {
    let gateway = TestGateway::start().await;
    let (stable, stable_id, canary, canary_id) = two_services(&gateway).await;
    let route = gateway
        .create(
            "/api/v1/routes",
            json!({"name": "split", "backends": [
                {"service_id": stable_id, "weight": 90},
                {"service_id": canary_id, "weight": 10}]}),
        )
        .await;
    for _ in 0..1000 {
        assert_eq!(gateway.get("/").await.status(), StatusCode::OK);
    }
    assert_eq!((stable.hits(), canary.hits()), (900, 100));
    let (_, shown) = gateway
        .api("GET", &format!("/api/v1/routes/{route}"), None)
        .await;
    assert_eq!(shown["service_id"], stable_id);
    assert_eq!(shown["backends"][1]["weight"], 10);
    let metrics = gateway.metrics_text().await;
    assert!(
        metrics.contains("raahi_route_requests_total{route=\"split\",backend=\"canary\"} 100"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_backend_without_an_available_target_gives_its_share_away() {
    let gateway = TestGateway::start().await;
    let (stable, stable_id, canary, canary_id) = two_services(&gateway).await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "split", "backends": [
                {"service_id": stable_id, "weight": 50},
                {"service_id": canary_id, "weight": 50, "subset": {"version": "v9"}}]}),
        )
        .await;
    for _ in 0..20 {
        assert_eq!(gateway.get("/").await.status(), StatusCode::OK);
    }
    assert_eq!((stable.hits(), canary.hits()), (20, 0));
}

#[tokio::test]
async fn subsets_select_targets_by_metadata_labels_and_tags() {
    let gateway = TestGateway::start().await;
    let v1 = Upstream::start("v1").await;
    let v2 = Upstream::start("v2").await;
    let mut first = target(&v1, 100, 0);
    first["metadata"] = json!({"meta": {"version": "v1"}, "tags": ["blue"]});
    let mut second = target(&v2, 100, 0);
    second["metadata"] = json!({"labels": {"version": "v2"}, "tags": ["green"]});
    let service = gateway.service_with_targets("web", &[first, second]).await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "v2", "path_prefix": "/v2",
                   "backends": [{"service_id": service, "subset": {"version": "v2"}}]}),
        )
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "blue", "path_prefix": "/blue",
                   "backends": [{"service_id": service, "subset": {"tag": "blue"}}]}),
        )
        .await;
    for _ in 0..6 {
        assert_eq!(body_of(gateway.get("/v2/x").await).await, "v2");
        assert_eq!(body_of(gateway.get("/blue/x").await).await, "v1");
    }
}

#[tokio::test]
async fn header_filters_rewrite_and_timeouts_shape_the_exchange() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("web").await;
    let service = gateway
        .service_with_targets("web", &[target(&upstream, 100, 0)])
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "api", "path_prefix": "/api", "service_id": service,
                   "request_headers": {"set": {"x-client": "${client_ip}"},
                                       "add": {"x-via": "raahi-${scheme}"},
                                       "remove": ["x-secret"]},
                   "response_headers": {"set": {"x-served-for": "${host}"}},
                   "rewrite": {"prefix": "/v2", "hostname": "internal.test"}}),
        )
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "bounded", "path_prefix": "/slow", "service_id": service,
                   "timeouts": {"request_ms": 300}}),
        )
        .await;
    let response = reqwest::Client::new()
        .get(gateway.proxy_url("/api/items?a=1"))
        .header("x-secret", "s")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-served-for"], "127.0.0.1");
    let seen = upstream.last_seen();
    assert_eq!(seen.path, "/v2/items");
    assert_eq!(seen.query.as_deref(), Some("a=1"));
    assert_eq!(seen.header("host"), Some("internal.test"));
    assert_eq!(seen.header("x-client"), Some("127.0.0.1"));
    assert_eq!(seen.header("x-via"), Some("raahi-http"));
    assert_eq!(seen.header("x-secret"), None);

    let slow = gateway.get("/slow/2000").await;
    assert_eq!(slow.status(), StatusCode::GATEWAY_TIMEOUT);
    let body: serde_json::Value = slow.json().await.unwrap();
    assert_eq!(body["error"]["code"], "request_timeout");
}

#[tokio::test]
async fn a_redirect_is_answered_by_raahi_with_the_query_kept() {
    let gateway = TestGateway::start().await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "to-https", "hosts": ["shop.test"], "path_prefix": "/old",
                   "redirect": {"scheme": "https", "prefix": "/new", "status": 301}}),
        )
        .await;
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let response = client
        .get(gateway.proxy_url("/old/page?x=1"))
        .header("host", "shop.test:8080")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::MOVED_PERMANENTLY);
    assert_eq!(
        response.headers()["location"],
        "https://shop.test/new/page?x=1"
    );
}

#[tokio::test]
async fn cors_preflights_are_answered_and_never_forwarded() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("web").await;
    let service = gateway
        .service_with_targets("web", &[target(&upstream, 100, 0)])
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "api", "service_id": service, "methods": ["GET", "PUT"],
                   "cors": {"allow_origins": ["https://app.test"], "allow_methods": ["GET", "PUT"],
                            "allow_headers": ["x-token"], "expose_headers": ["x-request-id"],
                            "max_age_s": 600}}),
        )
        .await;
    let client = reqwest::Client::new();
    let preflight = |origin: &'static str| {
        client
            .request(reqwest::Method::OPTIONS, gateway.proxy_url("/things"))
            .header("origin", origin)
            .header("access-control-request-method", "PUT")
            .send()
    };
    let allowed = preflight("https://app.test").await.unwrap();
    assert_eq!(allowed.status(), StatusCode::NO_CONTENT);
    assert_eq!(
        allowed.headers()["access-control-allow-origin"],
        "https://app.test"
    );
    assert_eq!(
        allowed.headers()["access-control-allow-methods"],
        "GET, PUT"
    );
    assert_eq!(allowed.headers()["access-control-max-age"], "600");
    let refused = preflight("https://evil.test").await.unwrap();
    assert_eq!(refused.status(), StatusCode::NO_CONTENT);
    assert!(!refused
        .headers()
        .contains_key("access-control-allow-origin"));
    assert_eq!(upstream.hits(), 0, "a preflight never reaches the target");

    let actual = client
        .get(gateway.proxy_url("/things"))
        .header("origin", "https://app.test")
        .send()
        .await
        .unwrap();
    assert_eq!(actual.status(), StatusCode::OK);
    assert_eq!(
        actual.headers()["access-control-allow-origin"],
        "https://app.test"
    );
    assert_eq!(
        actual.headers()["access-control-expose-headers"],
        "x-request-id"
    );
}

#[tokio::test]
async fn bad_rules_are_refused_naming_the_field() {
    let gateway = TestGateway::start().await;
    let (_stable, stable, _canary, canary) = two_services(&gateway).await;
    let cases = [
        (
            json!({"name": "r", "backends": [{"service_id": stable}, {"service_id": canary, "weight": 2_000_000}]}),
            "backends[1].weight",
        ),
        (
            json!({"name": "r", "service_id": stable, "backends": [{"service_id": canary}]}),
            "service_id",
        ),
        (
            json!({"name": "r", "service_id": stable, "headers": [{"name": "x", "value": "1", "present": true}]}),
            "headers[0]",
        ),
        (
            json!({"name": "r", "service_id": stable, "path_regex": "/(unclosed"}),
            "path_regex",
        ),
        (
            json!({"name": "r", "service_id": stable, "path_prefix": "/a", "path_exact": "/b"}),
            "path_exact",
        ),
        (
            json!({"name": "r", "service_id": stable, "redirect": {"scheme": "https"}}),
            "redirect",
        ),
        (
            json!({"name": "r", "service_id": stable, "request_headers": {"set": {"x-a": "${nope}"}}}),
            "request_headers.set.x-a",
        ),
        (
            json!({"name": "r", "service_id": stable, "cors": {"allow_origins": ["*"], "allow_credentials": true}}),
            "cors.allow_origins[0]",
        ),
        (
            json!({"name": "r", "backends": [{"service_id": stable}, {"service_id": 999}]}),
            "backends[1].service_id",
        ),
        (
            json!({"name": "r", "service_id": stable, "timeouts": {"request_ms": 100, "backend_request_ms": 200}}),
            "timeouts.backend_request_ms",
        ),
    ];
    for (body, field) in cases {
        let (status, answer) = gateway
            .api("POST", "/api/v1/routes", Some(body.clone()))
            .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}: {answer}");
        assert_eq!(answer["error"]["field"], field, "{body}: {answer}");
    }
    let (_, routes) = gateway.api("GET", "/api/v1/routes", None).await;
    assert_eq!(
        routes["items"].as_array().unwrap().len(),
        0,
        "nothing was stored"
    );
}

#[tokio::test]
async fn a_patch_naming_service_id_replaces_the_backends_and_services_in_use_stay() {
    let gateway = TestGateway::start().await;
    let (_stable, stable, canary_upstream, canary) = two_services(&gateway).await;
    let route = gateway
        .create(
            "/api/v1/routes",
            json!({"name": "split", "backends": [
                {"service_id": stable, "weight": 1}, {"service_id": canary, "weight": 1}]}),
        )
        .await;
    let (status, answer) = gateway
        .api("DELETE", &format!("/api/v1/services/{canary}"), None)
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{answer}");
    let (status, patched) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/routes/{route}"),
            Some(json!({"service_id": canary})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{patched}");
    assert_eq!(
        patched["backends"],
        json!([{"service_id": canary, "weight": 1, "subset": {}}])
    );
    for _ in 0..4 {
        assert_eq!(gateway.get("/").await.status(), StatusCode::OK);
    }
    assert_eq!(canary_upstream.hits(), 4);
    let (status, _) = gateway
        .api("DELETE", &format!("/api/v1/services/{stable}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "no route uses it any more");
}

#[tokio::test]
async fn a_mirror_gets_a_copy_and_one_that_hangs_never_slows_the_client() {
    let gateway = TestGateway::start().await;
    let (stable, stable_id, shadow, shadow_id) = two_services(&gateway).await;
    // A mirror target that accepts connections and never answers.
    let hanging = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hanging_addr = hanging.local_addr().unwrap();
    let held = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let holder = held.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = hanging.accept().await {
            holder.lock().unwrap().push(socket);
        }
    });
    let hung = gateway
        .service_with_targets(
            "hung",
            &[json!({"host": "127.0.0.1", "port": hanging_addr.port()})],
        )
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "copied", "path_prefix": "/copied", "service_id": stable_id,
                   "mirror": {"service_id": shadow_id}}),
        )
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "hung", "path_prefix": "/hung", "service_id": stable_id,
                   "mirror": {"service_id": hung, "percent": 100}}),
        )
        .await;
    let http = reqwest::Client::new();
    let response = http
        .post(gateway.proxy_url("/copied/x?y=1"))
        .body("payload")
        .send()
        .await
        .unwrap();
    assert_eq!(body_of(response).await, "stable");
    crate::common::wait_until(
        "the mirror to receive the copy",
        std::time::Duration::from_secs(5),
        || async { shadow.hits() == 1 },
    )
    .await;
    let copy = shadow.last_seen();
    assert_eq!(
        (copy.method.as_str(), copy.path.as_str(), copy.body_len),
        ("POST", "/copied/x", 7)
    );

    // 100 requests while every copy hangs: each answered at once; past 64 copies out, the
    // rest are dropped and counted.
    let started = std::time::Instant::now();
    for _ in 0..100 {
        let response = http.get(gateway.proxy_url("/hung/x")).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    let elapsed = started.elapsed();
    assert!(
        elapsed < std::time::Duration::from_secs(5),
        "100 requests took {elapsed:?} beside a hanging mirror"
    );
    assert_eq!(stable.hits(), 101);
    assert_eq!(
        gateway
            .metric("raahi_route_mirrored_total{route=\"hung\"}")
            .await,
        64
    );
    assert_eq!(
        gateway
            .metric("raahi_route_mirror_dropped_total{route=\"hung\"}")
            .await,
        36
    );
}

#[tokio::test]
async fn a_backend_request_timeout_bounds_each_attempt() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("web").await;
    let service = gateway
        .service_with_targets("web", &[target(&upstream, 100, 0)])
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "api", "service_id": service,
                   "timeouts": {"backend_request_ms": 200}}),
        )
        .await;
    let started = std::time::Instant::now();
    let response = gateway.get("/slow/3000").await;
    assert_eq!(response.status(), StatusCode::GATEWAY_TIMEOUT);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "upstream_timeout");
    assert!(started.elapsed() < std::time::Duration::from_secs(2));
}

/// Targets found by Consul (tags, `Service.Meta`) and by an HTTP registry (labels) are chosen by
/// subsets as they come and go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subsets_select_consul_tagged_and_registry_labelled_targets() {
    use crate::common::consul::{ConsulFake, Instance};
    use crate::common::registry::Registry;
    use crate::common::{wait_status, wait_until};
    use std::time::Duration;

    let gateway = TestGateway::start().await;
    let blue = Upstream::start("blue").await;
    let green = Upstream::start("green").await;
    let fake = ConsulFake::start().await;
    let mut tagged = Instance::new("web", blue.addr.port());
    tagged.tags = vec!["blue".into()];
    fake.register(tagged);
    let mut other = Instance::new("web", green.addr.port());
    other.tags = vec!["green".into()];
    other.meta.insert("version".into(), "v2".into());
    fake.register(other);
    let consul = gateway
        .create("/api/v1/services", json!({"name": "consul-web"}))
        .await;
    let consul_source = gateway
        .create(
            &format!("/api/v1/services/{consul}/discovery-sources"),
            json!({"name": "consul", "provider": "consul",
                   "config": {"address": fake.url(), "service": "web", "wait_ms": 10_000,
                              "timeout_ms": 500}}),
        )
        .await;
    wait_status(&gateway, consul_source, "two instances", |status| {
        status.endpoints.active == 2
    })
    .await;

    let registry = Registry::start().await;
    registry.set_json(json!([
        {"key": "b", "host": "127.0.0.1", "port": blue.addr.port(),
         "metadata": {"labels": {"track": "stable"}}},
        {"key": "g", "host": "127.0.0.1", "port": green.addr.port(),
         "metadata": {"labels": {"track": "canary"}}},
    ]));
    let registered = gateway
        .create("/api/v1/services", json!({"name": "registry-web"}))
        .await;
    let registry_source = gateway
        .create(
            &format!("/api/v1/services/{registered}/discovery-sources"),
            json!({"name": "registry", "provider": "http",
                   "config": {"url": registry.url("/v1/endpoints"), "interval_ms": 200,
                              "timeout_ms": 500}}),
        )
        .await;
    wait_status(&gateway, registry_source, "two endpoints", |status| {
        status.endpoints.active == 2
    })
    .await;

    for (name, prefix, backend) in [
        (
            "tag-blue",
            "/blue",
            json!({"service_id": consul, "subset": {"tag": "blue"}}),
        ),
        (
            "meta-v2",
            "/v2",
            json!({"service_id": consul, "subset": {"version": "v2"}}),
        ),
        (
            "canary",
            "/canary",
            json!({"service_id": registered, "subset": {"track": "canary"}}),
        ),
    ] {
        gateway
            .create(
                "/api/v1/routes",
                json!({"name": name, "path_prefix": prefix, "backends": [backend]}),
            )
            .await;
    }
    for _ in 0..6 {
        assert_eq!(body_of(gateway.get("/blue/x").await).await, "blue");
        assert_eq!(body_of(gateway.get("/v2/x").await).await, "green");
        assert_eq!(body_of(gateway.get("/canary/x").await).await, "green");
    }

    // The registry moves the canary label to the other target: the subset follows.
    registry.set_json(json!([
        {"key": "b", "host": "127.0.0.1", "port": blue.addr.port(),
         "metadata": {"labels": {"track": "canary"}}},
        {"key": "g", "host": "127.0.0.1", "port": green.addr.port(),
         "metadata": {"labels": {"track": "stable"}}},
    ]));
    wait_until(
        "the canary subset to follow the labels",
        Duration::from_secs(10),
        || async { body_of(gateway.get("/canary/x").await).await == "blue" },
    )
    .await;
}

/// Patterns that backtrack exponentially in a backtracking engine (PCRE) run in linear time.
#[tokio::test]
async fn a_regex_that_would_backtrack_exponentially_stays_linear() {
    let gateway = TestGateway::start().await;
    let (_stable, stable, _canary, canary) = two_services(&gateway).await;
    gateway.route_all_to(stable).await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "evil", "service_id": canary, "path_prefix": "/x",
                   "headers": [{"name": "x-token", "regex": "(a+)+b"}]}),
        )
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "evil-path", "service_id": canary, "hosts": ["evil.test"],
                   "path_regex": "/(a|aa)+c"}),
        )
        .await;
    let attack = "a".repeat(4000);
    let http = reqwest::Client::new();
    let started = std::time::Instant::now();
    for _ in 0..20 {
        let by_header = http
            .get(gateway.proxy_url("/x"))
            .header("x-token", format!("{attack}!"))
            .send()
            .await
            .unwrap();
        assert_eq!(body_of(by_header).await, "stable");
        let by_path = http
            .get(gateway.proxy_url(&format!("/{attack}")))
            .header("host", "evil.test")
            .send()
            .await
            .unwrap();
        assert_eq!(body_of(by_path).await, "stable");
    }
    // A backtracking engine needs about 2^4000 steps for one of these; this is a deadline for
    // a hang, not a speed goal.
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
}

#[tokio::test]
async fn backends_that_all_lack_a_target_answer_no_available_target() {
    let gateway = TestGateway::start().await;
    let (stable, stable_id, canary, canary_id) = two_services(&gateway).await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "empty", "backends": [
                {"service_id": stable_id, "subset": {"version": "v8"}},
                {"service_id": canary_id, "subset": {"version": "v9"}}]}),
        )
        .await;
    let response = gateway.get("/").await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "no_available_target", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("{version=v"), "{message}");
    assert_eq!(stable.hits() + canary.hits(), 0);
}
