//! Admin API checks for the TLS and L4 objects: what a certificate, a stream route or a protocol
//! change is refused for, and that nothing is stored or bound when it is.

use crate::common;

use common::{ApiError, TestGateway};
use reqwest::StatusCode;
use serde_json::{json, Value};

fn self_signed(names: &[&str]) -> (String, String) {
    let names: Vec<String> = names.iter().map(|name| name.to_string()).collect();
    let generated = rcgen::generate_simple_self_signed(names).expect("rcgen");
    (generated.cert.pem(), generated.signing_key.serialize_pem())
}

async fn service(gateway: &TestGateway, name: &str, protocol: &str) -> i64 {
    gateway
        .create(
            "/api/v1/services",
            json!({"name": name, "protocol": protocol}),
        )
        .await
}

fn error_field(body: &Value) -> String {
    ApiError::read(body).field.unwrap_or_default()
}

#[tokio::test]
async fn certificate_is_checked_and_its_key_never_returned() {
    let gateway = TestGateway::start().await;
    let (cert_pem, key_pem) = self_signed(&["shop.test", "*.shop.test"]);
    let (_, other_key) = self_signed(&["shop.test"]);

    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/certificates",
            Some(json!({"cert_pem": "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n", "key_pem": key_pem})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(error_field(&body), "cert_pem", "{body}");

    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/certificates",
            Some(json!({"cert_pem": cert_pem, "key_pem": other_key})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(error_field(&body), "key_pem", "{body}");

    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/certificates",
            Some(json!({"cert_pem": cert_pem, "key_pem": key_pem, "snis": ["other.test"]})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(error_field(&body), "snis", "{body}");

    let (status, listed) = gateway.api("GET", "/api/v1/certificates", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        listed["items"],
        json!([]),
        "refused certificates are not stored"
    );

    let (status, created) = gateway
        .api(
            "POST",
            "/api/v1/certificates",
            Some(json!({"cert_pem": cert_pem, "key_pem": key_pem})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(created["snis"], json!(["*.shop.test", "shop.test"]));
    assert!(created["not_after"].is_string(), "{created}");
    assert!(created.get("key_pem").is_none(), "{created}");
    let id = created["id"].as_i64().unwrap();
    let (_, fetched) = gateway
        .api("GET", &format!("/api/v1/certificates/{id}"), None)
        .await;
    assert!(fetched.get("key_pem").is_none(), "{fetched}");
    assert!(!fetched.to_string().contains("PRIVATE KEY"), "{fetched}");

    // A second certificate for a name already served is a conflict on `snis`.
    let (cert2, key2) = self_signed(&["shop.test"]);
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/certificates",
            Some(json!({"cert_pem": cert2, "key_pem": key2})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(error_field(&body), "snis", "{body}");

    // Certificates hold private keys: viewers may not read them.
    let (status, token) = gateway
        .api(
            "POST",
            "/api/v1/tokens",
            Some(json!({"name": "reader", "role": "viewer"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED);
    let viewer = token["token"].as_str().expect("secret returned once");
    let (status, _) = gateway
        .api_as(Some(viewer), "GET", "/api/v1/certificates", None)
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
}

#[tokio::test]
async fn service_ca_bundle_must_be_pem_certificates() {
    let gateway = TestGateway::start().await;
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/services",
            Some(json!({"name": "secure", "protocol": "https", "tls_ca_pem": "garbage"})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(error_field(&body), "tls_ca_pem", "{body}");

    let (ca_pem, _) = self_signed(&["ca.test"]);
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/services",
            Some(json!({"name": "secure", "protocol": "https", "tls_ca_pem": ca_pem, "tls_sni": "api.test"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["tls_ca_pem"], json!(ca_pem));
    assert_eq!(body["tls_verify"], json!(true));
}

#[tokio::test]
async fn stream_route_fits_its_service_and_listen_address() {
    let gateway = TestGateway::start().await;
    let web = service(&gateway, "web", "http").await;
    let tcp = service(&gateway, "db", "tcp").await;
    let tls_a = service(&gateway, "tls-a", "tls").await;
    let tls_b = service(&gateway, "tls-b", "tls").await;
    let listen = common::free_addr();

    let refused = [
        (
            json!({"listen": "127.0.0.1:0", "service_id": tcp}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "listen",
        ),
        (
            json!({"listen": listen, "service_id": web}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "service_id",
        ),
        (
            json!({"listen": listen, "service_id": 9999}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "service_id",
        ),
        (
            json!({"listen": listen, "sni": "a.test", "service_id": tcp}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "sni",
        ),
        (
            json!({"listen": listen, "sni": "not a name", "service_id": tls_a}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "sni",
        ),
        (
            json!({"listen": "localhost:80", "service_id": tcp}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "listen",
        ),
    ];
    for (body, expected, field) in refused {
        let (status, answer) = gateway
            .api("POST", "/api/v1/stream-routes", Some(body.clone()))
            .await;
        assert_eq!(status, expected, "{body} -> {answer}");
        assert_eq!(error_field(&answer), field, "{body} -> {answer}");
    }
    let (_, listed) = gateway.api("GET", "/api/v1/stream-routes", None).await;
    assert_eq!(listed["items"], json!([]), "nothing refused was stored");

    // Passthrough routes share a listener; a tcp route cannot join them.
    let a = gateway
        .create(
            "/api/v1/stream-routes",
            json!({"listen": listen, "sni": "A.test", "service_id": tls_a}),
        )
        .await;
    let (_, route_a) = gateway
        .api("GET", &format!("/api/v1/stream-routes/{a}"), None)
        .await;
    assert_eq!(route_a["sni"], "a.test", "SNI is lower-cased");
    gateway
        .create(
            "/api/v1/stream-routes",
            json!({"listen": listen, "sni": "b.test", "service_id": tls_b}),
        )
        .await;
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/stream-routes",
            Some(json!({"listen": listen, "sni": "a.test", "service_id": tls_b})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(error_field(&body), "sni", "{body}");
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/stream-routes",
            Some(json!({"listen": listen, "service_id": tcp})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(error_field(&body), "listen", "{body}");
    // A catch-all passthrough route (no SNI, tls service) may join.
    gateway
        .create(
            "/api/v1/stream-routes",
            json!({"listen": listen, "service_id": tls_b}),
        )
        .await;

    // The services' protocols are now pinned by their routes.
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{tls_a}"),
            Some(json!({"protocol": "tcp"})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(error_field(&body), "protocol", "{body}");
    let (status, body) = gateway
        .api("DELETE", &format!("/api/v1/services/{tls_a}"), None)
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");

    // The catch-all's tls service cannot turn tcp: its address is shared with SNI routes.
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{tls_b}"),
            Some(json!({"protocol": "tcp"})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(error_field(&body), "protocol", "{body}");

    // An HTTP route cannot send to a tcp service, and an http service with routes stays http.
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/routes",
            Some(json!({"name": "wrong", "service_id": tcp})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(error_field(&body), "service_id", "{body}");
    gateway
        .create("/api/v1/routes", json!({"name": "site", "service_id": web}))
        .await;
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{web}"),
            Some(json!({"protocol": "tcp"})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{web}"),
            Some(json!({"protocol": "https"})),
        )
        .await;
    assert_eq!(
        status,
        StatusCode::OK,
        "http to https keeps the route valid: {body}"
    );
}

#[tokio::test]
async fn taken_listen_address_is_a_conflict_naming_it_and_nothing_is_stored() {
    let gateway = TestGateway::start().await;
    let tcp = service(&gateway, "db", "tcp").await;
    let holder = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let taken = holder.local_addr().unwrap();
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/stream-routes",
            Some(json!({"listen": taken, "service_id": tcp})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(error_field(&body), "listen", "{body}");
    assert!(
        ApiError::read(&body).message.contains(&taken.to_string()),
        "the message names the address: {body}"
    );
    let (_, listed) = gateway.api("GET", "/api/v1/stream-routes", None).await;
    assert_eq!(listed["items"], json!([]));

    // The gateway's own proxy port is taken too.
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/stream-routes",
            Some(json!({"listen": gateway.proxy, "service_id": tcp})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    drop(holder);
}
