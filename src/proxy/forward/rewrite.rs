//! What goes upstream: the request as the client sent it, rewritten by the route and service
//! (forwarding fields, Host, path), and the per-attempt request for `https` targets.

use std::borrow::Cow;

use http::uri::{Authority, PathAndQuery, Scheme};
use http::{header, HeaderMap, HeaderValue, Method, Request, Uri, Version};

use super::Downstream;
use crate::model::path::{self, EscapedSlashes};
use crate::proxy::body::{BufferedBody, ClientBody, UpstreamRequestBody};
use crate::proxy::error::ProxyError;
use crate::proxy::headers::{self, X_REQUEST_ID};
use crate::snapshot::{RouteEntry, ServiceRuntime, TargetRuntime, Variables};

/// The host a request is for: lower case, without port.
pub(super) fn request_host<B>(request: &Request<B>) -> Cow<'_, str> {
    host_of(request.uri(), request.headers().get(header::HOST))
}

/// The host of a request with this URI and Host header: the URI's authority first (HTTP/2's
/// `:authority`, an absolute-form target), lower case, without port.
pub(super) fn host_of<'a>(uri: &'a Uri, host_header: Option<&'a HeaderValue>) -> Cow<'a, str> {
    let raw = uri
        .authority()
        .map(|authority| authority.as_str())
        .or_else(|| host_header.and_then(|value| value.to_str().ok()))
        .unwrap_or("");
    let host = strip_port(raw);
    if host.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(host.to_ascii_lowercase())
    } else {
        Cow::Borrowed(host)
    }
}

/// The port the client named in the request's authority or Host, if any.
pub(super) fn request_port<B>(request: &Request<B>) -> Option<u16> {
    let raw = request
        .uri()
        .authority()
        .map(|authority| authority.as_str())
        .or_else(|| request.headers().get(header::HOST)?.to_str().ok())?;
    let after_host = match raw.strip_prefix('[') {
        Some(rest) => rest.split_once(']')?.1,
        None => raw,
    };
    after_host.rsplit_once(':')?.1.parse().ok()
}

fn strip_port(authority: &str) -> &str {
    if let Some(rest) = authority.strip_prefix('[') {
        // IPv6 literal: keep the brackets off, as route hosts are written without them.
        return rest.split(']').next().unwrap_or(rest);
    }
    authority.split(':').next().unwrap_or(authority)
}

/// Puts `request`'s path in its normal form (see `model::path`), the query untouched; a path
/// already normal is left as it is, without a copy.
pub(super) fn normalize_path<B>(
    request: &mut Request<B>,
    escaped_slashes: EscapedSlashes,
) -> Result<(), ProxyError> {
    let uri = request.uri();
    let normal = match path::normalize(uri.path(), escaped_slashes) {
        Ok(Cow::Borrowed(_)) => return Ok(()),
        Ok(Cow::Owned(normal)) => normal,
        Err(error) => {
            return Err(ProxyError::InvalidPath {
                reason: error.reason(),
            })
        }
    };
    let path_and_query = match uri.query() {
        Some(query) => format!("{normal}?{query}"),
        None => normal,
    };
    // Every character of the normal form was in the path the URI parser accepted, or is an
    // unreserved one or an escape, so this does not fail; if it did, the request is refused
    // rather than routed on a path its target would read differently.
    fn unrepresentable<E>(_: E) -> ProxyError {
        ProxyError::InvalidPath {
            reason: "cannot be put in its normal form",
        }
    }
    let mut parts = http::uri::Parts::default();
    parts.scheme = uri.scheme().cloned();
    parts.authority = uri.authority().cloned();
    parts.path_and_query = Some(PathAndQuery::try_from(path_and_query).map_err(unrepresentable)?);
    *request.uri_mut() = Uri::from_parts(parts).map_err(unrepresentable)?;
    Ok(())
}

/// What the client sent, kept so the request can be sent again to another target.
pub(super) struct Outgoing {
    pub method: Method,
    pub path_and_query: PathAndQuery,
    pub headers: HeaderMap,
    /// No Host was chosen for the whole request: each attempt sends its target's authority in
    /// place of the Host in `headers` (the client's, if it sent one).
    pub host_from_target: bool,
    /// The request switches protocols, so it must reach the upstream over HTTP/1.1.
    pub upgrade: bool,
    /// The Host is the client's (a route with `preserve_host`): unbounded values, so over TLS
    /// the request goes over HTTP/1.1 on the target's own pool rather than a pool (and an
    /// HTTP/2 connection for its `:authority`) per value a client chooses.
    pub host_from_client: bool,
    /// The client may go away (an HTTP/2 stream reset, an HTTP/1.1 connection closed) while
    /// the request is with a target: the exchange then finishes on its own, so the upstream
    /// connection goes back to its pool rather than being closed (see `detach`). Not for an
    /// upgrade, whose answer never ends.
    pub finish_if_abandoned: bool,
    /// Each attempt yields once before it sends: hyper polls an HTTP/2 stream's future before
    /// it looks for the client's reset, and a request sent in that first poll for a stream
    /// already reset would then be finished for nobody (a client resetting streams as fast as
    /// it opens them would make the target serve them all).
    pub yield_first: bool,
    /// The route's `max_request_body_bytes`, named when a streaming body goes past it.
    pub body_limit: Option<u64>,
    pub body: PendingBody,
}

impl Outgoing {
    /// A copy to send elsewhere as well, when the body is already read whole (or there is
    /// none): a streaming body cannot be copied without holding the request back.
    pub fn try_clone(&self) -> Option<Outgoing> {
        let body = match &self.body {
            PendingBody::Empty => PendingBody::Empty,
            PendingBody::Buffered(body) => PendingBody::Buffered(body.clone()),
            PendingBody::Streaming(_) | PendingBody::Consumed => return None,
        };
        Some(Outgoing {
            method: self.method.clone(),
            path_and_query: self.path_and_query.clone(),
            headers: self.headers.clone(),
            host_from_target: self.host_from_target,
            upgrade: self.upgrade,
            host_from_client: self.host_from_client,
            finish_if_abandoned: false,
            yield_first: false,
            body_limit: self.body_limit,
            body,
        })
    }

    /// The request must not ride an HTTP/2 connection keyed by its Host.
    pub fn http1_only(&self) -> bool {
        self.upgrade || self.host_from_client
    }
}

pub(super) enum PendingBody {
    Empty,
    /// Read whole before a target was picked: every attempt sends it again.
    Buffered(BufferedBody),
    Streaming(ClientBody),
    /// Sent (at least partly) to a target that then failed: the request cannot be repeated.
    Consumed,
}

/// What goes upstream for `parts`: hop-by-hop fields out, forwarding fields in, the Host the
/// route and service choose, the path after `strip_prefix`.
pub(super) fn prepare(
    route: &RouteEntry,
    service: &ServiceRuntime,
    parts: http::request::Parts,
    body: PendingBody,
    downstream: &Downstream,
    request_id: &HeaderValue,
    upgrade_protocol: Option<HeaderValue>,
) -> Outgoing {
    let mut headers = parts.headers;
    // Only a filter with variables needs the host the client asked for.
    let request_host = route
        .request_headers()
        .map(|_| host_of(&parts.uri, headers.get(header::HOST)).into_owned());
    // hyper sized the map for the client's fields: make room once for the ones added below
    // (X-Forwarded-*, Via, X-Request-Id, Host), rather than growing it field by field.
    headers.reserve(6);
    // The authority of an absolute-form or HTTP/2 request wins over a Host header (RFC 9112
    // §3.2.2), as it did for routing.
    let original_host = parts
        .uri
        .authority()
        .and_then(|authority| HeaderValue::from_str(authority.as_str()).ok())
        .or_else(|| headers.get(header::HOST).cloned());
    if parts.version == Version::HTTP_2 {
        join_cookies(&mut headers);
    }
    headers::strip_hop_by_hop(&mut headers);
    headers::add_forwarding_headers(
        &mut headers,
        &downstream.forwarded_for,
        downstream.over_tls,
        original_host.as_ref(),
        parts.version,
    );
    headers.insert(X_REQUEST_ID.clone(), request_id.clone());
    let upgrade = upgrade_protocol.is_some();
    if let Some(protocol) = upgrade_protocol {
        headers.insert(header::UPGRADE, protocol);
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    let rewritten_host = route
        .route
        .rewrite
        .as_ref()
        .and_then(|rewrite| rewrite.hostname.as_deref())
        .and_then(|hostname| HeaderValue::from_str(hostname).ok());
    let (chosen_host, host_from_client) =
        match (rewritten_host, route.route.preserve_host, &original_host) {
            (Some(rewritten), _, _) => (Some(rewritten), false),
            (None, true, Some(host)) => (Some(host.clone()), true),
            _ => (service.upstream_host.clone(), false),
        };
    if let Some(filter) = route.request_headers() {
        filter.apply(
            &mut headers,
            &Variables {
                client_ip: downstream.client.ip(),
                request_id,
                host: request_host.as_deref().unwrap_or(""),
                scheme: if downstream.over_tls { "https" } else { "http" },
            },
        );
    }
    let host_from_target = chosen_host.is_none();
    // Without a chosen Host the client's stays in the map: each attempt replaces it with its
    // target's authority, so removing it here would only cost a hashed removal per request.
    if let Some(host) = chosen_host {
        headers.insert(header::HOST, host);
    }
    Outgoing {
        method: parts.method,
        path_and_query: upstream_path_and_query(route, &parts.uri),
        headers,
        host_from_target,
        upgrade,
        host_from_client,
        // A load generator stopping, or clients timing out, close HTTP/1.1 connections with
        // requests in flight: closing the upstream connection of each cost a reconnect per
        // request so cut (issue 38: 25-100 a 5 s benchmark run, where NGINX opened 0-5).
        finish_if_abandoned: !upgrade,
        yield_first: !upgrade && parts.version == Version::HTTP_2,
        body_limit: route.route.max_request_body_bytes,
        body,
    }
}

/// HTTP/2 clients split `cookie` into several fields; an HTTP/1.1 upstream expects one, joined
/// with "; " (RFC 9113 §8.2.3).
fn join_cookies(headers: &mut HeaderMap) {
    if headers.get_all(header::COOKIE).iter().nth(1).is_none() {
        return;
    }
    let joined = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .collect::<Vec<_>>()
        .join("; ");
    if let Ok(joined) = HeaderValue::from_str(&joined) {
        headers.insert(header::COOKIE, joined);
    }
}

fn upstream_path_and_query(route: &RouteEntry, uri: &Uri) -> PathAndQuery {
    let original = uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    let rewrite = route.route.rewrite.as_ref();
    let path = match (
        rewrite.and_then(|rewrite| rewrite.path.as_deref()),
        rewrite.and_then(|rewrite| rewrite.prefix.as_deref()),
        route.route.path_prefix.as_deref(),
    ) {
        (Some(whole), _, _) => Cow::Borrowed(whole),
        (None, Some(replacement), Some(matched)) => Cow::Owned(
            crate::proxy::redirect::replace_prefix(original.path(), matched, replacement),
        ),
        _ if route.route.strip_prefix => route.upstream_path(original.path()),
        _ => return original,
    };
    let rewritten = match original.query() {
        Some(query) => format!("{path}?{query}"),
        None => path.into_owned(),
    };
    PathAndQuery::try_from(rewritten).unwrap_or(original)
}

/// One attempt's request to an `https` target, for hyper-util's client. Headers are copied,
/// as for the HTTP/2 pool's `https` requests: a request its connection gives back unwritten
/// goes again (see `retry`), and hyper-util drops what it was given. The URI says `https`;
/// the connector dials the target whatever the URI names. The URI's authority keys the pool:
/// when HTTP/2 may be used it is the request's Host (sent as `:authority`; one of the
/// service's few values), otherwise the target's, and the upstream reads the Host header.
pub(super) fn tls_request(
    outgoing: &mut Outgoing,
    body: UpstreamRequestBody,
    target: &TargetRuntime,
) -> Request<UpstreamRequestBody> {
    let headers = outgoing.headers.clone();
    // hyper's HTTP/1.1 client sends a GET or HEAD body of unknown length as no body at all
    // unless asked for chunked; over HTTP/2 it drops the field and sends DATA frames.
    let unframed_body = matches!(outgoing.method, Method::GET | Method::HEAD)
        && !http_body::Body::is_end_stream(&body)
        && http_body::Body::size_hint(&body).exact().is_none()
        && !headers.contains_key(header::CONTENT_LENGTH);
    let mut request = Request::new(body);
    *request.method_mut() = outgoing.method.clone();
    *request.version_mut() = Version::HTTP_11;
    *request.headers_mut() = headers;
    if unframed_body {
        request.headers_mut().insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
    }
    if outgoing.host_from_target {
        request
            .headers_mut()
            .insert(header::HOST, target.host_header.clone());
    }
    let host_authority = (!outgoing.http1_only())
        .then(|| request.headers().get(header::HOST))
        .flatten()
        .and_then(|host| Authority::try_from(host.as_bytes()).ok());
    let mut uri = http::uri::Parts::default();
    uri.scheme = Some(Scheme::HTTPS);
    uri.authority = Some(host_authority.unwrap_or_else(|| target.authority.clone()));
    uri.path_and_query = Some(outgoing.path_and_query.clone());
    *request.uri_mut() = Uri::from_parts(uri).expect("scheme, authority and path make a URI");
    request
}

/// The per-attempt request head for an HTTP/2 target (`h2c`, or `https` by ALPN): the chosen Host travels as
/// `:authority` (h2 sends no Host field), and a gRPC request says it takes trailers, as gRPC
/// servers expect (`TE` is hop-by-hop, so the client's was removed).
pub(super) fn h2_request(
    outgoing: &mut Outgoing,
    target: &TargetRuntime,
    may_retry_later: bool,
    scheme: Scheme,
) -> Request<()> {
    let mut headers = if may_retry_later {
        outgoing.headers.clone()
    } else {
        std::mem::take(&mut outgoing.headers)
    };
    let authority = match headers.remove(header::HOST) {
        Some(host) if !outgoing.host_from_target => {
            Authority::try_from(host.as_bytes()).unwrap_or_else(|_| target.authority.clone())
        }
        _ => target.authority.clone(),
    };
    if crate::proxy::grpc::is_grpc(&headers) {
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
    let mut uri = http::uri::Parts::default();
    uri.scheme = Some(scheme);
    uri.authority = Some(authority);
    uri.path_and_query = Some(outgoing.path_and_query.clone());
    let mut request = Request::new(());
    *request.method_mut() = outgoing.method.clone();
    *request.version_mut() = Version::HTTP_2;
    *request.uri_mut() = Uri::from_parts(uri).expect("scheme, authority and path make a URI");
    *request.headers_mut() = headers;
    request
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::balance::Balancer;
    use crate::model::{LbPolicy, Protocol, Route, Service, Timeouts};
    use crate::snapshot::Snapshot;

    struct RouteRule {
        preserve_host: bool,
        strip_prefix: bool,
        upstream_host: Option<&'static str>,
    }

    const PLAIN: RouteRule = RouteRule {
        preserve_host: false,
        strip_prefix: false,
        upstream_host: None,
    };

    /// The route `/api` of service `web` as the data path sees it.
    fn route_entry(rule: RouteRule) -> Arc<RouteEntry> {
        let service = ServiceRuntime {
            service: Arc::new(Service {
                limits: crate::model::UpstreamLimits::default(),
                id: 1,
                name: "web".into(),
                protocol: Protocol::Http,
                upstream_authority: rule.upstream_host.map(String::from),
                tls_sni: None,
                tls_verify: true,
                tls_ca_pem: None,
                lb_policy: LbPolicy::RoundRobin,
                hash_on: None,
                hash_balance_factor: None,
                session_persistence: None,
                locality: None,
                timeouts: Timeouts::default(),
                max_attempts: 3,
                health_check: None,
                ejection: Default::default(),
                managed_by: None,
                created_at: crate::clock::now(),
                updated_at: crate::clock::now(),
            }),
            upstream_host: rule.upstream_host.map(HeaderValue::from_static),
            targets: Vec::new(),
            balancer: Balancer::new(LbPolicy::RoundRobin, Vec::new()),
            counters: Default::default(),
            discovery_gap: None,
            sessions: None,
            locality: None,
        };
        let route = Route {
            id: 7,
            name: "api".into(),
            hosts: Vec::new(),
            path_prefix: Some("/api".into()),
            service_id: Some(1),
            backends: vec![crate::model::Backend::whole(1)],
            preserve_host: rule.preserve_host,
            strip_prefix: rule.strip_prefix,
            request_buffer_bytes: crate::model::DEFAULT_REQUEST_BUFFER_BYTES,
            upgrades: crate::model::default_upgrades(),
            created_at: crate::clock::now(),
            updated_at: crate::clock::now(),
            ..Route::default()
        };
        let snapshot = Snapshot::new(1, vec![service], vec![route]);
        let headers = http::HeaderMap::new();
        snapshot
            .find_route(
                "shop.example",
                "/api",
                &crate::snapshot::RequestView {
                    method: &Method::GET,
                    headers: &headers,
                    query: None,
                },
            )
            .cloned()
            .expect("the route matches")
    }

    fn rewrite(rule: RouteRule, request: Request<()>) -> Outgoing {
        let route = route_entry(rule);
        let downstream = Downstream::new("192.0.2.9:50000".parse().unwrap(), false);
        let (parts, ()) = request.into_parts();
        prepare(
            &route,
            route.service().unwrap(),
            parts,
            PendingBody::Empty,
            &downstream,
            &HeaderValue::from_static("req-1"),
            None,
        )
    }

    fn get(uri: &str) -> http::request::Builder {
        Request::builder().method(Method::GET).uri(uri)
    }

    #[test]
    fn hop_by_hop_fields_go_and_forwarding_fields_come() {
        let request = get("/api/items?page=2")
            .header("host", "Shop.Example")
            .header("connection", "keep-alive, x-private")
            .header("x-private", "secret")
            .header("keep-alive", "timeout=5")
            .header("te", "trailers")
            .header("x-forwarded-for", "198.51.100.1")
            .header("x-kept", "1")
            .body(())
            .unwrap();
        let outgoing = rewrite(PLAIN, request);
        let headers = &outgoing.headers;
        for gone in ["connection", "x-private", "keep-alive", "te"] {
            assert!(!headers.contains_key(gone), "{gone} must not go upstream");
        }
        assert_eq!(headers["x-kept"], "1");
        assert_eq!(headers["x-forwarded-for"], "198.51.100.1, 192.0.2.9");
        assert_eq!(headers["x-forwarded-proto"], "http");
        assert_eq!(headers["x-forwarded-host"], "Shop.Example");
        assert_eq!(headers["x-request-id"], "req-1");
        assert!(headers.contains_key("via"));
        assert_eq!(outgoing.path_and_query.as_str(), "/api/items?page=2");
        assert!(outgoing.host_from_target, "each attempt sends its target's");
        assert!(!outgoing.http1_only());
    }

    #[test]
    fn the_host_is_the_services_the_clients_or_the_targets() {
        let with_host = || get("/api").header("host", "shop.example").body(()).unwrap();
        let service_host = rewrite(
            RouteRule {
                upstream_host: Some("internal.web"),
                ..PLAIN
            },
            with_host(),
        );
        assert_eq!(service_host.headers["host"], "internal.web");
        assert!(!service_host.host_from_target);
        let preserved = rewrite(
            RouteRule {
                preserve_host: true,
                upstream_host: Some("internal.web"),
                ..PLAIN
            },
            with_host(),
        );
        assert_eq!(preserved.headers["host"], "shop.example");
        assert!(preserved.host_from_client);
        assert!(
            preserved.http1_only(),
            "a client's Host must not key an HTTP/2 pool"
        );
        let targets = rewrite(PLAIN, with_host());
        assert!(targets.host_from_target);
    }

    #[test]
    fn an_absolute_form_authority_wins_over_the_host_field() {
        let request = get("http://shop.example/api/x")
            .header("host", "other.example")
            .body(())
            .unwrap();
        let outgoing = rewrite(
            RouteRule {
                preserve_host: true,
                ..PLAIN
            },
            request,
        );
        assert_eq!(outgoing.headers["host"], "shop.example");
        assert_eq!(outgoing.headers["x-forwarded-host"], "shop.example");
        assert_eq!(outgoing.path_and_query.as_str(), "/api/x");
    }

    #[test]
    fn strip_prefix_removes_the_routes_prefix_and_keeps_the_query() {
        let strip = || RouteRule {
            strip_prefix: true,
            ..PLAIN
        };
        let cases = [
            ("/api/users?id=3", "/users?id=3"),
            ("/api", "/"),
            ("/api/", "/"),
            ("/api?x=1", "/?x=1"),
        ];
        for (sent, upstream) in cases {
            let outgoing = rewrite(strip(), get(sent).body(()).unwrap());
            assert_eq!(outgoing.path_and_query.as_str(), upstream, "{sent}");
        }
    }

    fn normalized(uri: &str, escaped_slashes: EscapedSlashes) -> Result<String, &'static str> {
        let mut request = get(uri).body(()).unwrap();
        match normalize_path(&mut request, escaped_slashes) {
            Ok(()) => Ok(request.uri().to_string()),
            Err(ProxyError::InvalidPath { reason }) => Err(reason),
            Err(other) => panic!("{uri}: {other}"),
        }
    }

    #[test]
    fn the_path_is_normalised_and_the_query_left_alone() {
        let keep = EscapedSlashes::Keep;
        let cases = [
            ("/api/x?a=1", "/api/x?a=1"),
            ("/api/%2e%2e/admin?q=/../%2e%2e", "/admin?q=/../%2e%2e"),
            ("//api/x", "/api/x"),
            ("/%61pi/x?%61", "/api/x?%61"),
            ("/api/a%2fb", "/api/a%2Fb"),
            (
                "http://shop.example//api/./x?b",
                "http://shop.example/api/x?b",
            ),
            ("*", "*"),
        ];
        for (sent, normal) in cases {
            assert_eq!(normalized(sent, keep).as_deref(), Ok(normal), "{sent}");
        }
        assert_eq!(
            normalized("/a/../../b?x", keep),
            Err("climbs above the root with '..'")
        );
        assert!(normalized("/a%zz", keep).is_err());
        assert!(normalized("/api/a%2fb", EscapedSlashes::Reject).is_err());
        assert!(normalized("/api/a%20b", EscapedSlashes::Reject).is_ok());
    }

    #[test]
    fn strip_prefix_works_on_the_normal_path() {
        let mut request = get("/%61pi/./users?id=3").body(()).unwrap();
        normalize_path(&mut request, EscapedSlashes::Keep).unwrap();
        let outgoing = rewrite(
            RouteRule {
                strip_prefix: true,
                ..PLAIN
            },
            request,
        );
        assert_eq!(outgoing.path_and_query.as_str(), "/users?id=3");
    }

    #[test]
    fn http2_cookies_are_joined_for_http1_upstreams() {
        let request = get("/api")
            .version(Version::HTTP_2)
            .header("cookie", "a=1")
            .header("cookie", "b=2")
            .body(())
            .unwrap();
        let outgoing = rewrite(PLAIN, request);
        let cookies: Vec<_> = outgoing.headers.get_all("cookie").iter().collect();
        assert_eq!(cookies, ["a=1; b=2"]);
    }

    #[test]
    fn an_upgrade_keeps_its_protocol_and_goes_over_http1() {
        let route = route_entry(PLAIN);
        let downstream = Downstream::new("192.0.2.9:50000".parse().unwrap(), true);
        let (parts, ()) = get("/api/ws")
            .header("connection", "upgrade")
            .header("upgrade", "websocket")
            .body(())
            .unwrap()
            .into_parts();
        let outgoing = prepare(
            &route,
            route.service().unwrap(),
            parts,
            PendingBody::Empty,
            &downstream,
            &HeaderValue::from_static("req-2"),
            Some(HeaderValue::from_static("websocket")),
        );
        assert_eq!(outgoing.headers["upgrade"], "websocket");
        assert_eq!(outgoing.headers["connection"], "upgrade");
        assert_eq!(outgoing.headers["x-forwarded-proto"], "https");
        assert!(outgoing.upgrade && outgoing.http1_only());
    }
}
