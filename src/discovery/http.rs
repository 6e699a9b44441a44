//! The `http` provider: GET a registry URL and read a JSON array of endpoints from it.
//!
//! Only a 2xx with a complete, valid document is a success; every other outcome is a failed
//! refresh whose error names the exact place (`endpoints[3].host`), so an operator can fix the
//! registry from the source's `last_error` alone.

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue, ACCEPT, ETAG};
use serde_json::{Map, Value};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::discovery::config::{
    self, check_url, default_interval_ms, default_timeout_ms, default_true, default_weight, error,
    inner_budget, ProviderConfig, SharedKeys,
};
use crate::discovery::registry_client::{read_limited, shared_client, ClientSettings};
use crate::discovery::resolver::address_key;
use crate::discovery::{
    revision_of, ConfigError, Discovered, DiscoveryError, Fetch, FetchStyle, PollProvider,
    RefreshFuture, Registered,
};
use crate::error_chain::text as error_chain;
use crate::model::{Endpoint, ProviderKind, MAX_WEIGHT};

pub const PROVIDER: Registered = Registered {
    provider: ProviderKind::Http,
    style: FetchStyle::Poll,
    description: "GET `url` and read a JSON array of endpoints (or the array at \
                  `endpoints_path`); each endpoint names an IP `host` and optionally port, \
                  weight, priority, enabled, key and metadata.",
    schema: config::schema_of::<HttpConfig>,
    validate: config::validate_as::<HttpConfig>,
    build,
};

/// `http`: GET a JSON registry document listing endpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// `http` or `https` URL answering a JSON array of endpoints
    /// (`{host, port?, weight?, priority?, enabled?, key?, metadata?}`, `host` an IP address).
    #[schemars(url)]
    pub url: String,
    /// Dotted path to the array inside an object document, e.g. `data.items`; unset means the
    /// document itself is the array.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints_path: Option<String>,
    /// Extra request headers, e.g. `{"Authorization": "Bearer …"}`.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Verify the registry's TLS certificate; false accepts any certificate.
    #[serde(default = "default_true")]
    pub tls_verify: bool,
    /// Port of endpoints that do not state one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<u32>,
    /// Milliseconds between refreshes (each wait subtracts up to 10 % jitter).
    #[serde(default = "default_interval_ms")]
    #[schemars(range(min = 100, max = 86_400_000))]
    pub interval_ms: u64,
    /// Milliseconds one refresh (request and body) may take.
    #[serde(default = "default_timeout_ms")]
    #[schemars(range(min = 10, max = 600_000))]
    pub timeout_ms: u64,
    /// Weight of endpoints that do not state one.
    #[serde(default = "default_weight")]
    #[schemars(range(max = 65535))]
    pub weight: u32,
    /// Priority tier of endpoints that do not state one (lower is preferred).
    #[serde(default)]
    pub priority: i32,
}

impl ProviderConfig for HttpConfig {
    fn shared(&self) -> SharedKeys {
        SharedKeys {
            interval_ms: Some(self.interval_ms),
            timeout_ms: self.timeout_ms,
            weight: self.weight,
            port: self.port,
        }
    }

    fn check(&self) -> Result<(), ConfigError> {
        check_url("url", &self.url)?;
        if let Some(path) = &self.endpoints_path {
            if path.split('.').any(str::is_empty) {
                return Err(error(
                    "endpoints_path",
                    "must be dot-separated keys without empty parts, e.g. data.items",
                ));
            }
        }
        for (name, value) in &self.headers {
            let field = format!("headers.{name}");
            if ::http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(error(field, "is not a valid HTTP header name"));
            }
            if ::http::HeaderValue::from_str(value).is_err() {
                return Err(error(
                    field,
                    "is not a valid HTTP header value (visible ASCII, no line breaks)",
                ));
            }
        }
        Ok(())
    }
}

fn build(config: &Value) -> Result<Fetch, ConfigError> {
    let config = config::parse::<HttpConfig>(config)?;
    Ok(Fetch::Poll {
        schedule: config::schedule_of(&config),
        provider: Box::new(HttpProvider::new(&config)?),
    })
}

/// Largest registry document read; a bigger one is a failed refresh, not a memory spike.
pub const MAX_DOCUMENT_BYTES: u64 = 10 * 1024 * 1024;

pub struct HttpProvider {
    url: String,
    /// The URL as errors name it: without credentials or query (where tokens travel), since
    /// `last_error` reaches viewers through the event stream.
    shown_url: String,
    /// Shared with every source of the same TLS settings.
    client: Arc<reqwest::Client>,
    headers: HeaderMap,
    endpoints_path: Option<Vec<String>>,
    defaults: Defaults,
    /// The configured `timeout_ms`, named in errors (the client gives up a little earlier so its
    /// own, more precise error wins over the refresh loop's).
    timeout_ms: u64,
}

/// What an endpoint gets for a field it leaves out.
#[derive(Debug, Clone, Copy)]
struct Defaults {
    port: Option<u16>,
    weight: u32,
    priority: i32,
}

impl HttpProvider {
    /// `config` has passed `validate`. The client (and its connection pool) is shared by every
    /// source with the same TLS settings and reused by every refresh.
    pub fn new(config: &HttpConfig) -> Result<Self, ConfigError> {
        let client = shared_client(&ClientSettings {
            tls_verify: config.tls_verify,
            ca_pem: None,
            connect_timeout_ms: None,
        })
        .map_err(|err| ConfigError {
            field: String::new(),
            message: err.to_string(),
        })?;
        Ok(HttpProvider {
            url: config.url.clone(),
            shown_url: shown_url(&config.url),
            client,
            headers: request_headers(config)?,
            endpoints_path: config
                .endpoints_path
                .as_ref()
                .map(|path| path.split('.').map(str::to_owned).collect()),
            defaults: Defaults {
                port: config.port.and_then(|port| u16::try_from(port).ok()),
                weight: config.weight,
                priority: config.priority,
            },
            timeout_ms: config.timeout_ms,
        })
    }

    async fn discover(&self) -> Result<Discovered, DiscoveryError> {
        let response = self
            .client
            .get(&self.url)
            .timeout(inner_budget(Duration::from_millis(self.timeout_ms)))
            .headers(self.headers.clone())
            .send()
            .await
            .map_err(|err| self.request_error(err))?;
        let status = response.status();
        if !status.is_success() {
            return Err(DiscoveryError::HttpStatus {
                url: self.shown_url.clone(),
                status: status.as_u16(),
            });
        }
        let etag = response
            .headers()
            .get(ETAG)
            .and_then(|value| value.to_str().ok())
            .filter(|value| !value.is_empty())
            .map(str::to_owned);
        let body = self.read_body(response).await?;
        let document: Value =
            serde_json::from_slice(&body).map_err(|err| DiscoveryError::BadJson {
                url: self.shown_url.clone(),
                reason: err.to_string(),
            })?;
        let endpoints = self.endpoints_in(&document)?;
        Ok(Discovered {
            revision: etag.unwrap_or_else(|| revision_of(&endpoints)),
            endpoints,
            ttl: None,
            refused: None,
            departures: Vec::new(),
        })
    }

    async fn read_body(&self, response: reqwest::Response) -> Result<Vec<u8>, DiscoveryError> {
        read_limited(response, &self.shown_url, MAX_DOCUMENT_BYTES, |err| {
            self.request_error(err)
        })
        .await
    }

    fn endpoints_in(&self, document: &Value) -> Result<Vec<Endpoint>, DiscoveryError> {
        let bad = |(location, reason): (String, String)| DiscoveryError::BadDocument {
            url: self.shown_url.clone(),
            location,
            reason,
        };
        let items = locate(document, self.endpoints_path.as_deref()).map_err(bad)?;
        let mut endpoints = Vec::with_capacity(items.len());
        let mut keys = HashSet::new();
        for (index, item) in items.iter().enumerate() {
            let endpoint = parse_endpoint(item, self.defaults)
                .map_err(|(field, reason)| bad((endpoint_location(index, field), reason)))?;
            // The registry's first word on a key wins; later duplicates are ignored.
            if keys.insert(endpoint.key.clone()) {
                endpoints.push(endpoint);
            }
        }
        Ok(endpoints)
    }

    fn request_error(&self, err: reqwest::Error) -> DiscoveryError {
        let reason = if err.is_timeout() {
            format!(
                "timed out after {} ms (timeout_ms) without a complete response",
                self.timeout_ms
            )
        } else {
            // The URL is already in the message; the causes say what went wrong.
            error_chain(&err.without_url())
        };
        DiscoveryError::HttpRequest {
            url: self.shown_url.clone(),
            reason,
        }
    }
}

/// `url` without user, password or query (`?…` marks a query left out).
fn shown_url(url: &str) -> String {
    let Ok(mut parsed) = reqwest::Url::parse(url) else {
        return url.to_owned();
    };
    // Both only fail for URLs that cannot have credentials, which `check_url` refused.
    let _ = parsed.set_username("");
    let _ = parsed.set_password(None);
    let had_query = parsed.query().is_some();
    parsed.set_query(None);
    parsed.set_fragment(None);
    let mut shown = parsed.to_string();
    if had_query {
        shown.push_str("?…");
    }
    shown
}

impl PollProvider for HttpProvider {
    fn refresh(&self) -> RefreshFuture<'_> {
        Box::pin(self.discover())
    }
}

/// `Accept: application/json` unless the config says otherwise, plus the configured headers.
fn request_headers(config: &HttpConfig) -> Result<HeaderMap, ConfigError> {
    let mut headers = HeaderMap::new();
    headers.insert(ACCEPT, HeaderValue::from_static("application/json"));
    for (name, value) in &config.headers {
        let invalid = || ConfigError {
            field: format!("headers.{name}"),
            message: "is not a valid HTTP header".to_owned(),
        };
        let name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| invalid())?;
        let value = HeaderValue::from_str(value).map_err(|_| invalid())?;
        headers.insert(name, value);
    }
    Ok(headers)
}

/// The endpoint array: the document itself, or the value at the dotted path (numeric parts
/// index arrays). Errors are (location, reason).
fn locate<'a>(
    document: &'a Value,
    path: Option<&[String]>,
) -> Result<&'a [Value], (String, String)> {
    let Some(path) = path else {
        return match document {
            Value::Array(items) => Ok(items),
            other => Err((
                "document".to_owned(),
                format!(
                    "expected a JSON array of endpoints, got {}; set endpoints_path if the array \
                     is inside an object",
                    kind_of(other)
                ),
            )),
        };
    };
    let mut current = document;
    for (depth, part) in path.iter().enumerate() {
        let location = path[..=depth].join(".");
        let next = match current {
            Value::Object(map) => map.get(part),
            Value::Array(items) => part
                .parse::<usize>()
                .ok()
                .and_then(|index| items.get(index)),
            _ => None,
        };
        current = next.ok_or_else(|| {
            (
                location,
                format!(
                    "not found in the document (the parent is {})",
                    kind_of(current)
                ),
            )
        })?;
    }
    match current {
        Value::Array(items) => Ok(items),
        other => Err((
            path.join("."),
            format!("expected an array of endpoints, got {}", kind_of(other)),
        )),
    }
}

/// `endpoints[3]` or `endpoints[3].host`.
fn endpoint_location(index: usize, field: Option<&str>) -> String {
    match field {
        Some(field) => format!("endpoints[{index}].{field}"),
        None => format!("endpoints[{index}]"),
    }
}

/// One endpoint object; errors are (field, reason). Unknown fields are ignored so registries
/// can carry more than Raahi reads.
fn parse_endpoint(
    item: &Value,
    defaults: Defaults,
) -> Result<Endpoint, (Option<&'static str>, String)> {
    let Value::Object(fields) = item else {
        return Err((None, format!("expected an object, got {}", kind_of(item))));
    };
    let host = parse_host(fields).map_err(|reason| (Some("host"), reason))?;
    let port = parse_port(fields, defaults.port).map_err(|reason| (Some("port"), reason))?;
    let weight = match present(fields, "weight") {
        None => defaults.weight,
        Some(value) => value
            .as_u64()
            .filter(|weight| *weight <= u64::from(MAX_WEIGHT))
            .and_then(|weight| u32::try_from(weight).ok())
            .ok_or((
                Some("weight"),
                format!("must be an integer from 0 to {MAX_WEIGHT}, got {value}"),
            ))?,
    };
    let priority = match present(fields, "priority") {
        None => defaults.priority,
        Some(value) => value
            .as_i64()
            .and_then(|priority| i32::try_from(priority).ok())
            .ok_or((
                Some("priority"),
                format!("must be a 32-bit integer, got {value}"),
            ))?,
    };
    let enabled = match present(fields, "enabled") {
        None => true,
        Some(value) => value.as_bool().ok_or((
            Some("enabled"),
            format!("must be true or false, got {value}"),
        ))?,
    };
    let key = match present(fields, "key") {
        None => address_key(host, port),
        Some(Value::String(key)) if !key.is_empty() => key.clone(),
        Some(value) => {
            return Err((
                Some("key"),
                format!("must be a non-empty string, got {value}"),
            ))
        }
    };
    let metadata = match present(fields, "metadata") {
        None => Value::Object(Map::new()),
        Some(value @ Value::Object(_)) => value.clone(),
        Some(value) => {
            return Err((
                Some("metadata"),
                format!("must be an object, got {}", kind_of(value)),
            ))
        }
    };
    Ok(Endpoint {
        key,
        host: host.to_string(),
        port,
        weight,
        priority,
        enabled,
        metadata,
    })
}

/// A field's value, with JSON null meaning "not given" as many registries write it.
fn present<'a>(fields: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    fields.get(name).filter(|value| !value.is_null())
}

fn parse_host(fields: &Map<String, Value>) -> Result<IpAddr, String> {
    let text = match present(fields, "host") {
        None => return Err("is required".to_owned()),
        Some(Value::String(text)) => text,
        Some(other) => return Err(format!("must be a string, got {}", kind_of(other))),
    };
    // "[fd00::1]" is how IPv6 hosts are often written next to a port.
    let bare = text
        .strip_prefix('[')
        .and_then(|inner| inner.strip_suffix(']'))
        .unwrap_or(text);
    bare.parse::<IpAddr>().map_err(|_| {
        format!("must be an IP address (the request path never resolves names), got {text:?}")
    })
}

fn parse_port(fields: &Map<String, Value>, default: Option<u16>) -> Result<u16, String> {
    match present(fields, "port") {
        None => {
            default.ok_or_else(|| "is required (the source config sets no default port)".to_owned())
        }
        Some(value) => value
            .as_u64()
            .and_then(|port| u16::try_from(port).ok())
            .filter(|port| *port != 0)
            .ok_or_else(|| format!("must be an integer from 1 to 65535, got {value}")),
    }
}

fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn errors_name_the_url_without_credentials_or_query() {
        assert_eq!(
            super::shown_url("https://user:secret@registry.example:8443/v1/endpoints?token=abc#x"),
            "https://registry.example:8443/v1/endpoints?…"
        );
        assert_eq!(
            super::shown_url("http://127.0.0.1:8500/v1/endpoints"),
            "http://127.0.0.1:8500/v1/endpoints"
        );
    }

    use std::convert::Infallible;
    use std::net::SocketAddr;
    use std::sync::Arc;

    use bytes::Bytes;
    use http_body_util::combinators::BoxBody;
    use http_body_util::{BodyExt, Full, StreamBody};
    use hyper::body::{Frame, Incoming};
    use hyper::{Request, Response};
    use hyper_util::rt::TokioIo;
    use serde_json::json;
    use tokio::net::TcpListener;
    use tokio::task::JoinHandle;

    use super::*;
    use crate::model::ProviderKind;

    type Body = BoxBody<Bytes, Infallible>;
    type Handler = Arc<dyn Fn(&Request<Incoming>) -> Response<Body> + Send + Sync>;

    /// An in-process HTTP/1.1 registry answering every request with `handler`.
    struct Registry {
        addr: SocketAddr,
        scheme: &'static str,
        task: JoinHandle<()>,
    }

    impl Drop for Registry {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    impl Registry {
        async fn start(
            handler: impl Fn(&Request<Incoming>) -> Response<Body> + Send + Sync + 'static,
        ) -> Registry {
            Registry::serve(handler, None).await
        }

        /// Serves `handler` over TLS with a fresh self-signed certificate no client trusts.
        async fn start_tls(
            handler: impl Fn(&Request<Incoming>) -> Response<Body> + Send + Sync + 'static,
        ) -> Registry {
            use tokio_rustls::rustls;
            let certified =
                rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
            let key =
                rustls::pki_types::PrivatePkcs8KeyDer::from(certified.signing_key.serialize_der());
            let config = rustls::ServerConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![certified.cert.der().clone()], key.into())
            .unwrap();
            Registry::serve(
                handler,
                Some(tokio_rustls::TlsAcceptor::from(Arc::new(config))),
            )
            .await
        }

        async fn serve(
            handler: impl Fn(&Request<Incoming>) -> Response<Body> + Send + Sync + 'static,
            tls: Option<tokio_rustls::TlsAcceptor>,
        ) -> Registry {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let handler: Handler = Arc::new(handler);
            let scheme = if tls.is_some() { "https" } else { "http" };
            let task = tokio::spawn(async move {
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    let handler = handler.clone();
                    let tls = tls.clone();
                    tokio::spawn(async move {
                        let service =
                            hyper::service::service_fn(move |request: Request<Incoming>| {
                                let response = handler(&request);
                                async move { Ok::<_, Infallible>(response) }
                            });
                        let http = hyper::server::conn::http1::Builder::new();
                        let _ = match tls {
                            None => http.serve_connection(TokioIo::new(stream), service).await,
                            Some(acceptor) => {
                                let Ok(stream) = acceptor.accept(stream).await else {
                                    return;
                                };
                                http.serve_connection(TokioIo::new(stream), service).await
                            }
                        };
                    });
                }
            });
            Registry { addr, scheme, task }
        }

        /// A registry answering `document` with status 200.
        async fn json(document: Value) -> Registry {
            Registry::start(move |_| json_response(200, &document)).await
        }

        fn url(&self) -> String {
            format!("{}://{}/v1/endpoints", self.scheme, self.addr)
        }
    }

    fn full(bytes: impl Into<Bytes>) -> Body {
        Full::new(bytes.into()).boxed()
    }

    fn json_response(status: u16, document: &Value) -> Response<Body> {
        Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .body(full(document.to_string()))
            .unwrap()
    }

    fn provider(registry: &Registry, extra: Value) -> HttpProvider {
        let mut config = json!({ "url": registry.url(), "timeout_ms": 2000 });
        config
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let config = crate::discovery::validate(ProviderKind::Http, &config).unwrap();
        HttpProvider::new(&serde_json::from_value(config).unwrap()).unwrap()
    }

    fn bad_document(err: DiscoveryError) -> (String, String) {
        match err {
            DiscoveryError::BadDocument {
                location, reason, ..
            } => (location, reason),
            other => panic!("expected BadDocument, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn array_document_becomes_endpoints() {
        let registry = Registry::json(json!([
            {"host": "10.0.0.1", "port": 8080, "weight": 5, "priority": 1, "enabled": false,
             "key": "node-a", "metadata": {"zone": "a"}, "extra": "ignored"},
            {"host": "fd00::2", "port": 8081},
            {"host": "[fd00::3]", "port": 8082},
        ]))
        .await;
        let discovered = provider(&registry, json!({})).discover().await.unwrap();
        assert_eq!(
            discovered.endpoints[0],
            Endpoint {
                key: "node-a".into(),
                host: "10.0.0.1".into(),
                port: 8080,
                weight: 5,
                priority: 1,
                enabled: false,
                metadata: json!({"zone": "a"}),
            }
        );
        assert_eq!(discovered.endpoints[1].key, "[fd00::2]:8081");
        assert_eq!(discovered.endpoints[2].host, "fd00::3");
        assert_eq!(discovered.revision, revision_of(&discovered.endpoints));
        assert_eq!(discovered.ttl, None);
    }

    #[tokio::test]
    async fn defaults_come_from_the_config() {
        let registry =
            Registry::json(json!([{"host": "10.0.0.1"}, {"host": "10.0.0.2", "port": null}])).await;
        let discovered = provider(
            &registry,
            json!({"port": 9000, "weight": 42, "priority": 3}),
        )
        .discover()
        .await
        .unwrap();
        let endpoint = &discovered.endpoints[0];
        assert_eq!(endpoint.key, "10.0.0.1:9000");
        assert_eq!(
            (
                endpoint.port,
                endpoint.weight,
                endpoint.priority,
                endpoint.enabled
            ),
            (9000, 42, 3, true)
        );
        assert_eq!(endpoint.metadata, json!({}));
        assert_eq!(discovered.endpoints[1].port, 9000);
    }

    #[tokio::test]
    async fn endpoints_path_finds_the_array() {
        let registry =
            Registry::json(json!({"data": {"items": [{"host": "10.0.0.1", "port": 80}]}})).await;
        let discovered = provider(&registry, json!({"endpoints_path": "data.items"}))
            .discover()
            .await
            .unwrap();
        assert_eq!(discovered.endpoints.len(), 1);

        let err = provider(&registry, json!({"endpoints_path": "data.nodes"}))
            .discover()
            .await
            .unwrap_err();
        assert_eq!(bad_document(err).0, "data.nodes");
        let err = provider(&registry, json!({"endpoints_path": "data"}))
            .discover()
            .await
            .unwrap_err();
        let (location, reason) = bad_document(err);
        assert_eq!(location, "data");
        assert!(reason.contains("expected an array"), "{reason}");
        let err = provider(&registry, json!({})).discover().await.unwrap_err();
        assert_eq!(bad_document(err).0, "document");
    }

    #[tokio::test]
    async fn configured_headers_are_sent() {
        let registry = Registry::start(|request| {
            let headers = request.headers();
            let authorized = headers
                .get("authorization")
                .is_some_and(|v| v == "Bearer s3cret")
                && headers.get("x-tenant").is_some_and(|v| v == "blue")
                && headers
                    .get("accept")
                    .is_some_and(|v| v == "application/json");
            if authorized {
                json_response(200, &json!([{"host": "10.0.0.1", "port": 80}]))
            } else {
                json_response(401, &json!({"error": "unauthorized"}))
            }
        })
        .await;
        let err = provider(&registry, json!({})).discover().await.unwrap_err();
        assert_eq!(
            err,
            DiscoveryError::HttpStatus {
                url: registry.url(),
                status: 401
            }
        );
        let discovered = provider(
            &registry,
            json!({"headers": {"Authorization": "Bearer s3cret", "X-Tenant": "blue"}}),
        )
        .discover()
        .await
        .unwrap();
        assert_eq!(discovered.endpoints.len(), 1);
    }

    #[tokio::test]
    async fn server_error_is_http_status() {
        let registry = Registry::start(|_| json_response(500, &json!({"error": "boom"}))).await;
        let err = provider(&registry, json!({})).discover().await.unwrap_err();
        assert_eq!(
            err,
            DiscoveryError::HttpStatus {
                url: registry.url(),
                status: 500
            }
        );
    }

    #[tokio::test]
    async fn invalid_json_is_bad_json() {
        let registry = Registry::start(|_| Response::new(full("[{\"host\": "))).await;
        let err = provider(&registry, json!({})).discover().await.unwrap_err();
        assert!(matches!(err, DiscoveryError::BadJson { .. }), "{err:?}");
    }

    #[tokio::test]
    async fn oversized_document_with_content_length_is_refused() {
        let big = Bytes::from(vec![b' '; MAX_DOCUMENT_BYTES as usize + 1]);
        let registry = Registry::start(move |_| Response::new(full(big.clone()))).await;
        let err = provider(&registry, json!({})).discover().await.unwrap_err();
        assert_eq!(
            err,
            DiscoveryError::TooLarge {
                url: registry.url(),
                limit: MAX_DOCUMENT_BYTES
            }
        );
    }

    #[tokio::test]
    async fn oversized_chunked_document_is_refused() {
        const CHUNK: usize = 64 * 1024;
        let registry = Registry::start(|_| {
            // 12 MiB without a Content-Length: only counting while reading can catch it.
            let chunks =
                (0..192).map(|_| Ok::<_, Infallible>(Frame::data(Bytes::from(vec![b' '; CHUNK]))));
            Response::new(StreamBody::new(futures_util::stream::iter(chunks)).boxed())
        })
        .await;
        let err = provider(&registry, json!({})).discover().await.unwrap_err();
        assert_eq!(
            err,
            DiscoveryError::TooLarge {
                url: registry.url(),
                limit: MAX_DOCUMENT_BYTES
            }
        );
    }

    #[tokio::test]
    async fn endpoint_without_host_names_its_index() {
        let registry =
            Registry::json(json!([{"host": "10.0.0.1", "port": 80}, {"port": 81}])).await;
        let err = provider(&registry, json!({})).discover().await.unwrap_err();
        let (location, reason) = bad_document(err.clone());
        assert_eq!(location, "endpoints[1].host");
        assert_eq!(reason, "is required");
        assert_eq!(
            err.to_string(),
            format!(
                "registry {}: endpoints[1].host: is required",
                registry.url()
            )
        );
    }

    #[tokio::test]
    async fn hostname_host_is_refused() {
        let registry = Registry::json(json!([{"host": "backend.internal", "port": 80}])).await;
        let (location, reason) =
            bad_document(provider(&registry, json!({})).discover().await.unwrap_err());
        assert_eq!(location, "endpoints[0].host");
        assert!(reason.contains("must be an IP address"), "{reason}");
    }

    #[tokio::test]
    async fn bad_ports_are_refused() {
        for (document, config) in [
            (json!([{"host": "10.0.0.1", "port": 0}]), json!({})),
            (json!([{"host": "10.0.0.1", "port": 65536}]), json!({})),
            (json!([{"host": "10.0.0.1", "port": "80"}]), json!({})),
            (json!([{"host": "10.0.0.1"}]), json!({})),
        ] {
            let registry = Registry::json(document.clone()).await;
            let err = provider(&registry, config).discover().await.unwrap_err();
            assert_eq!(bad_document(err).0, "endpoints[0].port", "{document}");
        }
        let registry =
            Registry::json(json!([{"host": "10.0.0.1", "port": 80, "weight": 70000}])).await;
        let err = provider(&registry, json!({})).discover().await.unwrap_err();
        assert_eq!(bad_document(err).0, "endpoints[0].weight");
    }

    #[tokio::test]
    async fn duplicate_keys_keep_the_first() {
        let registry = Registry::json(json!([
            {"host": "10.0.0.1", "port": 80, "weight": 1},
            {"host": "10.0.0.1", "port": 80, "weight": 2},
        ]))
        .await;
        let discovered = provider(&registry, json!({})).discover().await.unwrap();
        assert_eq!(discovered.endpoints.len(), 1);
        assert_eq!(discovered.endpoints[0].weight, 1);
    }

    #[tokio::test]
    async fn etag_is_the_revision() {
        let registry = Registry::start(|_| {
            Response::builder()
                .header("etag", "\"v42\"")
                .body(full(json!([{"host": "10.0.0.1", "port": 80}]).to_string()))
                .unwrap()
        })
        .await;
        let discovered = provider(&registry, json!({})).discover().await.unwrap();
        assert_eq!(discovered.revision, "\"v42\"");
    }

    #[tokio::test]
    async fn refused_connection_is_a_request_error() {
        let closed = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap();
        let config = crate::discovery::validate(
            ProviderKind::Http,
            &json!({"url": format!("http://{closed}/")}),
        )
        .unwrap();
        let provider = HttpProvider::new(&serde_json::from_value(config).unwrap()).unwrap();
        match provider.discover().await.unwrap_err() {
            DiscoveryError::HttpRequest { reason, .. } => assert!(!reason.is_empty()),
            other => panic!("expected HttpRequest, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn slow_registry_times_out_within_the_budget() {
        // Headers arrive, the body never does: the per-attempt timeout must still end it.
        let registry = Registry::start(|_| {
            let pending = futures_util::stream::pending::<Result<Frame<Bytes>, Infallible>>();
            Response::new(StreamBody::new(pending).boxed())
        })
        .await;
        let started = tokio::time::Instant::now();
        let err = provider(&registry, json!({"timeout_ms": 1000}))
            .discover()
            .await
            .unwrap_err();
        assert!(
            started.elapsed() < Duration::from_millis(1000),
            "{:?}",
            started.elapsed()
        );
        match err {
            DiscoveryError::HttpRequest { reason, .. } => {
                assert!(reason.contains("timed out after 1000 ms"), "{reason}")
            }
            other => panic!("expected HttpRequest, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn tls_verify_false_accepts_any_certificate() {
        let document = json!([{"host": "10.0.0.1", "port": 443}]);
        let registry = Registry::start_tls(move |_| json_response(200, &document)).await;
        let discovered = provider(&registry, json!({"tls_verify": false}))
            .discover()
            .await
            .unwrap();
        assert_eq!(discovered.endpoints.len(), 1);
        let err = provider(&registry, json!({})).discover().await.unwrap_err();
        assert!(
            matches!(err, DiscoveryError::HttpRequest { .. }),
            "an untrusted certificate must fail: {err:?}"
        );
    }
}
