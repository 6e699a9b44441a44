//! Header rewriting between client and upstream (RFC 9110 §7.6).

use std::net::IpAddr;

use bytes::Bytes;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::Version;

/// Headers that describe one connection and must not be forwarded (RFC 9110 §7.6.1), beside
/// those the `Connection` header names.
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

pub static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Removes hop-by-hop headers, including every header the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none of them: one pass over the few names present is cheaper than
    // seven hashed removals, and `Connection` is among the names looked for.
    if !has_hop_by_hop(headers) {
        return;
    }
    let connection_lines = headers.get_all(header::CONNECTION).iter().count();
    if connection_lines == 1 {
        // The usual case (`Connection: keep-alive` from an HTTP/1.1 upstream): take the one
        // line out and remove what it names by string, without collecting owned names.
        if let Some(connection) = headers.remove(header::CONNECTION) {
            for token in connection.to_str().unwrap_or("").split(',') {
                let token = token.trim();
                if !token.is_empty() {
                    headers.remove(token);
                }
            }
        }
    } else if connection_lines > 1 {
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|value| value.split(','))
            .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
            .collect();
        for name in named {
            headers.remove(name);
        }
    }
    if !has_hop_by_hop(headers) {
        return;
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

/// gRPC's own trailer fields: an HTTP/2 gRPC server announces none of them in `Trailer`.
const GRPC_TRAILERS: &str = "grpc-status, grpc-message, grpc-status-details-bin";

/// The trailer fields a response announces (`Trailer`, hop-by-hop: read before stripping).
pub fn trailer_names(headers: &HeaderMap) -> Option<HeaderValue> {
    let mut names = headers.get_all(header::TRAILER).iter();
    let first = names.next()?.clone();
    // Several lines are one list (RFC 9110 §5.3).
    Some(names.fold(first, |joined, next| {
        let mut line = joined.as_bytes().to_vec();
        line.extend_from_slice(b", ");
        line.extend_from_slice(next.as_bytes());
        HeaderValue::from_bytes(&line).unwrap_or(joined)
    }))
}

/// For an HTTP/1.1 client: hyper's HTTP/1.1 writer sends only the trailer fields a chunked
/// response announces in `Trailer` (and only to a client that sent `TE: trailers`), so the
/// announcement the target made goes on, and a gRPC response announces gRPC's status fields,
/// which HTTP/2 servers never announce. A response framed by length carries no trailers.
pub fn announce_trailers(headers: &mut HeaderMap, announced: Option<HeaderValue>) {
    if headers.contains_key(header::CONTENT_LENGTH) {
        return;
    }
    let grpc = headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|value| value.as_bytes().starts_with(b"application/grpc"));
    let value = match (announced, grpc) {
        (Some(announced), true) => {
            let mut line = announced.as_bytes().to_vec();
            line.extend_from_slice(b", ");
            line.extend_from_slice(GRPC_TRAILERS.as_bytes());
            HeaderValue::from_bytes(&line).unwrap_or(announced)
        }
        (Some(announced), false) => announced,
        (None, true) => HeaderValue::from_static(GRPC_TRAILERS),
        (None, false) => return,
    };
    headers.insert(header::TRAILER, value);
}

fn has_hop_by_hop(headers: &HeaderMap) -> bool {
    // By name: comparing against `HOP_BY_HOP` builds (and drops) that array at every call.
    headers.keys().any(|name| {
        matches!(
            name.as_str(),
            "connection"
                | "keep-alive"
                | "proxy-connection"
                | "te"
                | "trailer"
                | "transfer-encoding"
                | "upgrade"
        )
    })
}

/// Whether the `Transfer-Encoding` fields, taken as one list (RFC 9110 §5.3), name `chunked`
/// and nothing else: the only framing of a target's body that Raahi can pass on, since the
/// field is hop-by-hop and any other coding would reach the client as the body itself. Empty
/// list elements are not codings (§5.6.1); a field that is not text makes the list unreadable.
pub fn is_chunked_alone(headers: &HeaderMap) -> bool {
    let mut chunked = false;
    for value in headers.get_all(header::TRANSFER_ENCODING) {
        let Ok(text) = value.to_str() else {
            return false;
        };
        for coding in text.split(',').map(str::trim) {
            if coding.is_empty() {
                continue;
            }
            if chunked || !coding.eq_ignore_ascii_case("chunked") {
                return false;
            }
            chunked = true;
        }
    }
    chunked
}

/// An HTTP/1.1 request asking to switch protocols (e.g. WebSocket).
pub fn is_upgrade_request(version: Version, headers: &HeaderMap) -> bool {
    version == Version::HTTP_11
        && headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|value| value.split(','))
            .any(|token| token.trim().eq_ignore_ascii_case("upgrade"))
}

/// Whether a route that passes the protocols `allowed` (lower case) passes this `Upgrade`
/// field: every protocol it offers (`name` or `name/version`) must be allowed, and `h2c`
/// never is (RFC 9113 §3.1), as HTTP/2 through a tunnel would bypass every route rule.
pub fn upgrade_allowed(offered: &HeaderValue, allowed: &[String]) -> bool {
    let Ok(offered) = offered.to_str() else {
        return false;
    };
    let mut protocols = offered
        .split(',')
        .map(|protocol| protocol.split('/').next().unwrap_or("").trim())
        .filter(|name| !name.is_empty())
        .peekable();
    protocols.peek().is_some()
        && protocols.all(|name| {
            !name.eq_ignore_ascii_case("h2c")
                && allowed
                    .iter()
                    .any(|allowed| allowed.eq_ignore_ascii_case(name))
        })
}

pub static HTTP2_SETTINGS: HeaderName = HeaderName::from_static("http2-settings");

// Statics, so the bytes are checked once by the compiler: `from_static` called at run time
// validates them on every request.
static VIA_HTTP_10: HeaderValue = HeaderValue::from_static("1.0 raahi");
static VIA_HTTP_11: HeaderValue = HeaderValue::from_static("1.1 raahi");
static VIA_HTTP_2: HeaderValue = HeaderValue::from_static("2 raahi");
static PROTO_HTTP: HeaderValue = HeaderValue::from_static("http");
static PROTO_HTTPS: HeaderValue = HeaderValue::from_static("https");

fn via_value(version: Version) -> &'static HeaderValue {
    match version {
        Version::HTTP_10 => &VIA_HTTP_10,
        Version::HTTP_2 => &VIA_HTTP_2,
        _ => &VIA_HTTP_11,
    }
}

/// Appends to a list header, keeping every field line the client sent (RFC 9110 §5.3: several
/// lines are one comma-separated list).
fn append_to_list(headers: &mut HeaderMap, name: &HeaderName, value: &HeaderValue) {
    let mut existing = match headers.entry(name) {
        // The usual case, nobody before us set it: nothing to join, nothing to allocate.
        header::Entry::Vacant(entry) => {
            entry.insert(value.clone());
            return;
        }
        header::Entry::Occupied(entry) => entry,
    };
    let Ok(value) = value.to_str() else {
        return;
    };
    let mut combined = String::new();
    for existing in existing.iter() {
        if let Ok(existing) = existing.to_str() {
            if !existing.trim().is_empty() {
                combined.push_str(existing);
                combined.push_str(", ");
            }
        }
    }
    combined.push_str(value);
    if let Ok(combined) = HeaderValue::from_str(&combined) {
        existing.insert(combined);
    }
}

/// The client's address as an `X-Forwarded-For` entry; made once per client connection.
pub fn forwarded_for(client_ip: IpAddr) -> HeaderValue {
    let IpAddr::V4(v4) = client_ip else {
        return HeaderValue::from_str(&client_ip.to_string())
            .expect("an IP address is a valid header value");
    };
    // Dotted quads by hand: `Ipv4Addr`'s `Display` goes through the formatting machinery, a
    // tenth of the CPU a connection-per-request client costs.
    let mut text = Vec::with_capacity(15);
    let mut digits = itoa::Buffer::new();
    for (index, octet) in v4.octets().into_iter().enumerate() {
        if index > 0 {
            text.push(b'.');
        }
        text.extend_from_slice(digits.format(octet).as_bytes());
    }
    HeaderValue::from_maybe_shared(Bytes::from(text))
        .expect("a dotted quad is a valid header value")
}

/// Adds what the upstream needs to know about the original request; `over_tls`: it came to the
/// HTTPS listener.
///
/// `forwarded_for`: the client's address from [`forwarded_for`].
pub fn add_forwarding_headers(
    headers: &mut HeaderMap,
    forwarded_for: &HeaderValue,
    over_tls: bool,
    original_host: Option<&HeaderValue>,
    version: Version,
) {
    append_to_list(headers, &X_FORWARDED_FOR, forwarded_for);
    let proto = if over_tls { &PROTO_HTTPS } else { &PROTO_HTTP };
    headers.insert(X_FORWARDED_PROTO.clone(), proto.clone());
    match original_host {
        Some(host) => {
            headers.insert(X_FORWARDED_HOST.clone(), host.clone());
        }
        None => {
            headers.remove(&X_FORWARDED_HOST);
        }
    }
    add_via(headers, version);
}

pub fn add_via(headers: &mut HeaderMap, version: Version) {
    append_to_list(headers, &header::VIA, via_value(version));
}

thread_local! {
    /// Request ids have a generator of their own, seeded from the operating system: ids are
    /// shown to clients, and must tell nothing about fastrand's shared stream, which also draws
    /// DNS transaction ids and balancer picks.
    static REQUEST_ID_RNG: std::cell::RefCell<fastrand::Rng> =
        std::cell::RefCell::new(fastrand::Rng::with_seed(rand::random()));
}

/// The client's `X-Request-Id` when it is a sane token, else a new one.
pub fn request_id(headers: &HeaderMap) -> HeaderValue {
    headers
        .get(&X_REQUEST_ID)
        .filter(|value| {
            let bytes = value.as_bytes();
            !bytes.is_empty() && bytes.len() <= 128 && bytes.iter().all(|b| b.is_ascii_graphic())
        })
        .cloned()
        .unwrap_or_else(|| {
            // A version 4 UUID from a fast generator: the id correlates log lines and needs no
            // cryptographic randomness, which cost more than the rest of this function.
            let random = REQUEST_ID_RNG.with(|rng| {
                let mut rng = rng.borrow_mut();
                rng.u128(..)
            });
            let id = uuid::Builder::from_random_bytes(random.to_ne_bytes()).into_uuid();
            let mut buffer = uuid::Uuid::encode_buffer();
            let text = id.hyphenated().encode_lower(&mut buffer);
            HeaderValue::from_str(text).expect("a uuid is a valid header value")
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_hop_by_hop_name_is_recognised() {
        for name in &HOP_BY_HOP {
            let mut headers = HeaderMap::new();
            headers.insert("x-kept", HeaderValue::from_static("1"));
            assert!(!has_hop_by_hop(&headers));
            headers.insert(name.clone(), HeaderValue::from_static("1"));
            assert!(has_hop_by_hop(&headers), "{name}");
        }
    }

    #[test]
    fn strips_fixed_and_connection_named_headers() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, X-Secret"),
        );
        headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        headers.insert("x-secret", HeaderValue::from_static("1"));
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
        headers.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers.len(), 1);
        assert!(headers.contains_key("x-kept"));
    }

    #[test]
    fn every_connection_line_is_honoured() {
        let mut headers = HeaderMap::new();
        headers.append(
            header::CONNECTION,
            HeaderValue::from_static("x-one, bad name"),
        );
        headers.append(header::CONNECTION, HeaderValue::from_static("X-Two"));
        headers.insert("x-one", HeaderValue::from_static("1"));
        headers.insert("x-two", HeaderValue::from_static("2"));
        headers.insert("x-kept", HeaderValue::from_static("3"));
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers.len(), 1);
        assert!(headers.contains_key("x-kept"));

        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static(" , bad name,X-One "),
        );
        headers.insert("x-one", HeaderValue::from_static("1"));
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        headers.insert("x-kept", HeaderValue::from_static("3"));
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers.len(), 1);
        assert!(headers.contains_key("x-kept"));
    }

    #[test]
    fn messages_without_hop_by_hop_headers_are_left_alone() {
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, HeaderValue::from_static("shop.test"));
        headers.append("x-kept", HeaderValue::from_static("1"));
        headers.append("x-kept", HeaderValue::from_static("2"));
        let before = headers.clone();
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers, before);
        // One hop-by-hop header among them still takes the full path.
        headers.insert("proxy-connection", HeaderValue::from_static("keep-alive"));
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers, before);
    }

    #[test]
    fn via_is_added_or_appended() {
        let mut headers = HeaderMap::new();
        add_via(&mut headers, Version::HTTP_2);
        assert_eq!(headers[header::VIA], "2 raahi");
        add_via(&mut headers, Version::HTTP_11);
        assert_eq!(headers[header::VIA], "2 raahi, 1.1 raahi");
        assert_eq!(headers.get_all(header::VIA).iter().count(), 1);
    }

    #[test]
    fn forwarded_for_writes_addresses_as_display_does() {
        for address in [
            "0.0.0.0",
            "1.2.3.4",
            "10.0.100.9",
            "127.0.0.1",
            "192.168.255.1",
            "255.255.255.255",
            "::1",
            "2001:db8::8a2e:370:7334",
            "::ffff:10.1.2.3",
        ] {
            let ip: IpAddr = address.parse().unwrap();
            assert_eq!(forwarded_for(ip), ip.to_string().as_str(), "{address}");
        }
    }

    #[test]
    fn forwarded_for_appends() {
        let mut headers = HeaderMap::new();
        headers.insert(&X_FORWARDED_FOR, HeaderValue::from_static("1.2.3.4"));
        let host = HeaderValue::from_static("shop.test");
        add_forwarding_headers(
            &mut headers,
            &forwarded_for("127.0.0.1".parse().unwrap()),
            false,
            Some(&host),
            Version::HTTP_11,
        );
        assert_eq!(headers[&X_FORWARDED_FOR], "1.2.3.4, 127.0.0.1");
        assert_eq!(headers[&X_FORWARDED_HOST], "shop.test");
        assert_eq!(headers[&X_FORWARDED_PROTO], "http");
        assert_eq!(headers[header::VIA], "1.1 raahi");
        // The client's own claim is replaced by what the gateway saw.
        add_forwarding_headers(
            &mut headers,
            &forwarded_for("127.0.0.1".parse().unwrap()),
            true,
            Some(&host),
            Version::HTTP_11,
        );
        assert_eq!(headers[&X_FORWARDED_PROTO], "https");
    }

    #[test]
    fn every_forwarded_for_line_is_kept() {
        let mut headers = HeaderMap::new();
        headers.append(&X_FORWARDED_FOR, HeaderValue::from_static("198.51.100.1"));
        headers.append(&X_FORWARDED_FOR, HeaderValue::from_static("198.51.100.2"));
        add_forwarding_headers(
            &mut headers,
            &forwarded_for("127.0.0.1".parse().unwrap()),
            false,
            None,
            Version::HTTP_11,
        );
        assert_eq!(
            headers[&X_FORWARDED_FOR],
            "198.51.100.1, 198.51.100.2, 127.0.0.1"
        );
        assert_eq!(headers.get_all(&X_FORWARDED_FOR).iter().count(), 1);
    }

    #[test]
    fn request_id_kept_or_generated() {
        let mut headers = HeaderMap::new();
        let generated = request_id(&headers);
        assert_eq!(generated.len(), 36);
        let parsed = uuid::Uuid::parse_str(generated.to_str().unwrap()).unwrap();
        assert_eq!(parsed.get_version(), Some(uuid::Version::Random));
        assert_eq!(parsed.get_variant(), uuid::Variant::RFC4122);
        assert_ne!(
            request_id(&headers),
            generated,
            "each request gets its own id"
        );
        headers.insert(&X_REQUEST_ID, HeaderValue::from_static("abc-123"));
        assert_eq!(request_id(&headers), "abc-123");
        headers.insert(&X_REQUEST_ID, HeaderValue::from_static("has space"));
        assert_ne!(request_id(&headers), "has space");
    }

    #[test]
    fn only_chunked_alone_frames_a_body_raahi_passes_on() {
        let coded = |lines: &[&'static str]| {
            let mut headers = HeaderMap::new();
            for line in lines {
                headers.append(header::TRANSFER_ENCODING, HeaderValue::from_static(line));
            }
            is_chunked_alone(&headers)
        };
        assert!(coded(&["chunked"]));
        assert!(coded(&["Chunked"]));
        assert!(coded(&["chunked,"]));
        assert!(coded(&[" , chunked"]));
        assert!(coded(&["chunked", ""]));
        assert!(!coded(&[]));
        assert!(!coded(&["gzip"]));
        assert!(!coded(&["gzip, chunked"]));
        assert!(!coded(&["gzip", "chunked"]));
        assert!(!coded(&["chunked, gzip"]));
        assert!(!coded(&["chunked, chunked"]));
        assert!(!coded(&["chunked", "chunked"]));
        assert!(!coded(&["identity"]));
        assert!(!coded(&["chunked;q=1"]));
        let mut not_text = HeaderMap::new();
        not_text.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_bytes(b"chunked\xe9").unwrap(),
        );
        assert!(!is_chunked_alone(&not_text));
    }

    #[test]
    fn upgrade_needs_connection_token() {
        let mut headers = HeaderMap::new();
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert!(!is_upgrade_request(Version::HTTP_11, &headers));
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, Upgrade"),
        );
        assert!(is_upgrade_request(Version::HTTP_11, &headers));
        assert!(!is_upgrade_request(Version::HTTP_2, &headers));
    }

    #[test]
    fn only_upgrades_the_route_passes_go_through_and_never_h2c() {
        let allowed = vec!["websocket".to_owned()];
        let passes = |offered: &'static str, allowed: &[String]| {
            upgrade_allowed(&HeaderValue::from_static(offered), allowed)
        };
        assert!(passes("websocket", &allowed));
        assert!(passes("WebSocket", &allowed));
        assert!(!passes("h2c", &allowed));
        assert!(!passes("h2c", &["h2c".to_owned()]));
        assert!(!passes("websocket, h2c", &allowed));
        assert!(!passes("spdy/3", &allowed));
        assert!(!passes("websocket", &[]));
        assert!(!passes(" , ", &allowed));
        assert!(passes("x-tunnel/2", &["x-tunnel".to_owned()]));
    }
}
