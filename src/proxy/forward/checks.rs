//! What a request must be before it is routed: within the listener's size limits, for one valid
//! host, and framed by a transfer coding Raahi can read. hyper has already refused what it
//! cannot parse; these are the rules it leaves to the application.

use http::header::{self, HeaderMap};
use http::{Request, Uri, Version};

use crate::proxy::error::ProxyError;
use crate::proxy::RequestLimits;

pub(super) fn check_request<B>(
    request: &Request<B>,
    limits: &RequestLimits,
) -> Result<(), ProxyError> {
    check_sizes(request.version(), request.uri(), request.headers(), limits)?;
    check_host(request.version(), request.uri(), request.headers())?;
    check_transfer_coding(request.headers())
}

fn check_sizes(
    version: Version,
    uri: &Uri,
    headers: &HeaderMap,
    limits: &RequestLimits,
) -> Result<(), ProxyError> {
    let uri_length = uri.authority().map_or(0, |a| a.as_str().len())
        + uri.path_and_query().map_or(0, |p| p.as_str().len());
    if uri_length > limits.max_uri_bytes {
        return Err(ProxyError::UriTooLong {
            length: uri_length,
            limit: limits.max_uri_bytes,
        });
    }
    if headers.len() > limits.max_header_count {
        return Err(ProxyError::HeadersTooLarge {
            reason: format!(
                "{} header fields, more than the {} allowed",
                headers.len(),
                limits.max_header_count
            ),
        });
    }
    // HTTP/2 holds the fields to the listener's SETTINGS_MAX_HEADER_LIST_SIZE already.
    if version == Version::HTTP_2 {
        return Ok(());
    }
    // As written on the wire: name, ": ", value, CRLF.
    let header_bytes: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum();
    if header_bytes > limits.max_header_bytes {
        return Err(ProxyError::HeadersTooLarge {
            reason: format!(
                "{header_bytes} bytes of header fields, more than the {} allowed",
                limits.max_header_bytes
            ),
        });
    }
    Ok(())
}

/// RFC 9112 §3.2: an HTTP/1.1 request needs exactly one Host, and a valid one; HTTP/1.0 may
/// leave it out. An absolute-form or HTTP/2 authority must be valid too, and a Host beside an
/// HTTP/2 `:authority` must name the same (RFC 9113 §8.3.1). Userinfo is refused everywhere:
/// its credentials would be forwarded in `X-Forwarded-Host` and its user name routed on.
fn check_host(version: Version, uri: &Uri, headers: &HeaderMap) -> Result<(), ProxyError> {
    let mut hosts = headers.get_all(header::HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some() {
        return Err(invalid_host("more than one Host header field"));
    }
    let authority = match uri.authority() {
        Some(authority) => Some(split_authority(authority.as_str().as_bytes())?),
        None => None,
    };
    let Some(host) = host else {
        return match (version, authority) {
            (Version::HTTP_2, Some(_)) | (Version::HTTP_10 | Version::HTTP_09, _) => Ok(()),
            _ => Err(invalid_host("no Host header field")),
        };
    };
    let (host, port) = split_authority(host.as_bytes())?;
    if let (Version::HTTP_2, Some((authority_host, authority_port))) = (version, authority) {
        // The same host; a port only one of them names is the scheme's default.
        let same_port = port.is_none() || authority_port.is_none() || port == authority_port;
        if !host.eq_ignore_ascii_case(authority_host) || !same_port {
            return Err(invalid_host(
                "the Host header field differs from :authority",
            ));
        }
    }
    Ok(())
}

/// `uri-host [ ":" port ]` (RFC 9110 §7.2) split into its host and port digits, checked byte by
/// byte without copying: a reg-name or IPv4 address of unreserved, percent-encoded and
/// sub-delimiter characters, or an IPv6 literal in brackets; no user information (its
/// credentials would be forwarded in `X-Forwarded-Host` and its user name routed on).
fn split_authority(raw: &[u8]) -> Result<(&[u8], Option<&[u8]>), ProxyError> {
    let (host, rest) = if raw.first() == Some(&b'[') {
        if raw.contains(&b'@') {
            return Err(user_information());
        }
        let end = raw
            .iter()
            .position(|&b| b == b']')
            .ok_or_else(|| invalid_host("an IPv6 literal without its closing bracket"))?;
        let literal = std::str::from_utf8(&raw[1..end]).unwrap_or("");
        if literal.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(invalid_host("a bracketed host that is not an IPv6 address"));
        }
        raw.split_at(end + 1)
    } else {
        // One pass over the name, the common case: every byte is looked up once.
        let end = raw
            .iter()
            .position(|&b| !is_reg_name_byte(b))
            .unwrap_or(raw.len());
        let (host, rest) = raw.split_at(end);
        if rest.contains(&b'@') {
            return Err(user_information());
        }
        if rest.first().is_some_and(|&b| b != b':') {
            return Err(invalid_host(
                "a host that is not a valid host name or address",
            ));
        }
        (host, rest)
    };
    if host.is_empty() {
        return Err(invalid_host("an empty host"));
    }
    let port = match rest {
        [] | [b':'] => None,
        [b':', digits @ ..] => Some(digits),
        _ => return Err(invalid_host("a host followed by something not a port")),
    };
    // An empty port is allowed (RFC 3986 §3.2.3); otherwise decimal digits up to 65535.
    if let Some(digits) = port {
        if !is_port_number(digits) {
            return Err(invalid_host("a port that is not a number from 0 to 65535"));
        }
    }
    Ok((host, port))
}

/// Decimal digits (leading zeros allowed) whose value is at most 65535.
fn is_port_number(digits: &[u8]) -> bool {
    let mut value: u32 = 0;
    for &b in digits {
        if !b.is_ascii_digit() {
            return false;
        }
        value = value * 10 + u32::from(b - b'0');
        if value > u32::from(u16::MAX) {
            return false;
        }
    }
    true
}

fn user_information() -> ProxyError {
    invalid_host("a host with user information")
}

/// unreserved / pct-encoded / sub-delims (RFC 3986 §3.2.2), looked up in one step per byte.
fn is_reg_name_byte(b: u8) -> bool {
    REG_NAME_BYTES[usize::from(b)]
}

const REG_NAME_BYTES: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = (b as u8).is_ascii_alphanumeric();
        b += 1;
    }
    let others = b"-._~%!$&'()*+,;=";
    let mut i = 0;
    while i < others.len() {
        table[others[i] as usize] = true;
        i += 1;
    }
    table
};

fn invalid_host(reason: &'static str) -> ProxyError {
    ProxyError::InvalidHost { reason }
}

/// RFC 9112 §6.1: a server that gets a transfer coding it does not understand answers 501.
/// Raahi reads `chunked`, once; hyper has already refused codings that do not end in it.
fn check_transfer_coding(headers: &HeaderMap) -> Result<(), ProxyError> {
    let mut chunked = 0;
    for value in headers.get_all(header::TRANSFER_ENCODING) {
        let value = value.to_str().map_err(|_| ProxyError::InvalidFraming {
            reason: "a Transfer-Encoding that is not text",
        })?;
        for coding in value.split(',').map(str::trim).filter(|c| !c.is_empty()) {
            if !coding.eq_ignore_ascii_case("chunked") {
                return Err(ProxyError::UnsupportedTransferCoding {
                    coding: coding.chars().take(64).collect(),
                });
            }
            chunked += 1;
        }
    }
    if chunked > 1 {
        return Err(ProxyError::InvalidFraming {
            reason: "the chunked transfer coding applied more than once",
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The byte-by-byte version `split_authority` replaced; they must agree on every input.
    fn reference_split_authority(raw: &[u8]) -> Result<(&[u8], Option<&[u8]>), ProxyError> {
        if raw.contains(&b'@') {
            return Err(invalid_host("a host with user information"));
        }
        let (host, rest) = if raw.first() == Some(&b'[') {
            let end = raw
                .iter()
                .position(|&b| b == b']')
                .ok_or_else(|| invalid_host("an IPv6 literal without its closing bracket"))?;
            let literal = std::str::from_utf8(&raw[1..end]).unwrap_or("");
            if literal.parse::<std::net::Ipv6Addr>().is_err() {
                return Err(invalid_host("a bracketed host that is not an IPv6 address"));
            }
            raw.split_at(end + 1)
        } else {
            let end = raw.iter().position(|&b| b == b':').unwrap_or(raw.len());
            let (host, rest) = raw.split_at(end);
            if !host.iter().all(|&b| is_reg_name_byte(b)) {
                return Err(invalid_host(
                    "a host that is not a valid host name or address",
                ));
            }
            (host, rest)
        };
        if host.is_empty() {
            return Err(invalid_host("an empty host"));
        }
        let port = match rest {
            [] => None,
            [b':', digits @ ..] => Some(digits),
            _ => return Err(invalid_host("a host followed by something not a port")),
        };
        // An empty port is allowed (RFC 3986 §3.2.3); otherwise decimal digits up to 65535.
        if let Some(port) = port.filter(|port| !port.is_empty()) {
            let number = std::str::from_utf8(port)
                .ok()
                .filter(|digits| digits.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|digits| digits.parse::<u16>().ok());
            if number.is_none() {
                return Err(invalid_host("a port that is not a number from 0 to 65535"));
            }
        }
        Ok((host, port.filter(|port| !port.is_empty())))
    }

    fn outcome(
        result: Result<(&[u8], Option<&[u8]>), ProxyError>,
    ) -> Result<(Vec<u8>, Option<Vec<u8>>), String> {
        result
            .map(|(host, port)| (host.to_vec(), port.map(<[u8]>::to_vec)))
            .map_err(|error| error.to_string())
    }

    proptest! {
        #[test]
        fn split_authority_agrees_with_the_byte_by_byte_version(
            raw in proptest::collection::vec(
                prop_oneof![
                    Just(b'a'), Just(b'Z'), Just(b'0'), Just(b'9'), Just(b'.'), Just(b'-'),
                    Just(b':'), Just(b'@'), Just(b'['), Just(b']'), Just(b'%'), Just(b' '),
                    Just(b'/'), Just(b'_'), any::<u8>(),
                ],
                0..24,
            )
        ) {
            prop_assert_eq!(
                outcome(split_authority(&raw)),
                outcome(reference_split_authority(&raw))
            );
        }
    }

    #[test]
    fn ports_are_numbers_up_to_65535() {
        for (raw, ok) in [
            ("h:0", true),
            ("h:65535", true),
            ("h:0000080", true),
            ("h:65536", false),
            ("h:99999999999999999999", false),
            ("h:8a", false),
            ("h:", true),
            ("h:-1", false),
        ] {
            assert_eq!(split_authority(raw.as_bytes()).is_ok(), ok, "{raw}");
        }
    }

    fn limits() -> RequestLimits {
        RequestLimits {
            max_uri_bytes: 64,
            max_header_count: 4,
            max_header_bytes: 200,
            escaped_slashes: Default::default(),
        }
    }

    fn request(version: Version, uri: &str, fields: &[(&str, &str)]) -> Request<()> {
        let mut builder = Request::builder().version(version).uri(uri);
        for (name, value) in fields {
            builder = builder.header(*name, *value);
        }
        builder.body(()).unwrap()
    }

    fn code(version: Version, uri: &str, fields: &[(&str, &str)]) -> Option<&'static str> {
        check_request(&request(version, uri, fields), &limits())
            .err()
            .map(|error| error.code())
    }

    const H11: Version = Version::HTTP_11;

    #[test]
    fn hosts_must_be_one_and_valid() {
        assert_eq!(code(H11, "/", &[("host", "a.example")]), None);
        assert_eq!(code(H11, "/", &[("host", "a.example:8080")]), None);
        assert_eq!(code(H11, "/", &[("host", "[::1]:8080")]), None);
        assert_eq!(code(H11, "/", &[("host", "10.0.0.1")]), None);
        assert_eq!(
            code(H11, "/", &[("host", "a.example:")]),
            None,
            "empty port"
        );
        assert_eq!(code(H11, "/", &[("host", "xn--bcher-kva.example")]), None);
        for bad in [
            vec![],
            vec![("host", "a.example"), ("host", "a.example")],
            vec![("host", "")],
            vec![("host", "a b")],
            vec![("host", "evil.example/x")],
            vec![("host", "user@evil.example")],
            vec![("host", "a.example:99999")],
            vec![("host", "a.example:x")],
            vec![("host", "a.example:+80")],
            vec![("host", "[evil.example]")],
            vec![("host", "[::1")],
            vec![("host", "a.example:80:80")],
            vec![("host", "a\"b")],
        ] {
            assert_eq!(code(H11, "/", &bad), Some("invalid_host"), "{bad:?}");
        }
        assert_eq!(
            code(
                H11,
                "http://user:pw@evil.example/",
                &[("host", "evil.example")]
            ),
            Some("invalid_host")
        );
        // An absolute-form authority wins over the Host, but Host must still be there.
        assert_eq!(
            code(H11, "http://a.example/", &[("host", "b.example")]),
            None
        );
        assert_eq!(code(H11, "http://a.example/", &[]), Some("invalid_host"));
    }

    #[test]
    fn http10_and_http2_may_leave_host_out() {
        assert_eq!(code(Version::HTTP_10, "/", &[]), None);
        assert_eq!(code(Version::HTTP_2, "http://a.example/", &[]), None);
        assert_eq!(
            code(
                Version::HTTP_2,
                "http://a.example/",
                &[("host", "A.example")]
            ),
            None
        );
        assert_eq!(
            code(
                Version::HTTP_2,
                "http://a.example/",
                &[("host", "b.example")]
            ),
            Some("invalid_host")
        );
        assert_eq!(code(Version::HTTP_2, "/", &[]), Some("invalid_host"));
        assert_eq!(
            code(
                Version::HTTP_2,
                "https://a.example:443/",
                &[("host", "a.example")]
            ),
            None,
            "a port only one side names"
        );
        assert_eq!(
            code(
                Version::HTTP_2,
                "https://a.example:443/",
                &[("host", "a.example:8443")]
            ),
            Some("invalid_host")
        );
    }

    #[test]
    fn only_chunked_once_is_read() {
        let host = ("host", "a.example");
        assert_eq!(
            code(H11, "/", &[host, ("transfer-encoding", "Chunked")]),
            None
        );
        for coding in ["gzip, chunked", "identity, chunked", "chunked;q=1"] {
            assert_eq!(
                code(H11, "/", &[host, ("transfer-encoding", coding)]),
                Some("unsupported_transfer_coding"),
                "{coding}"
            );
        }
        assert_eq!(
            code(
                H11,
                "/",
                &[
                    host,
                    ("transfer-encoding", "gzip"),
                    ("transfer-encoding", "chunked")
                ]
            ),
            Some("unsupported_transfer_coding")
        );
        assert_eq!(
            code(H11, "/", &[host, ("transfer-encoding", "chunked, chunked")]),
            Some("invalid_framing")
        );
    }

    #[test]
    fn sizes_are_held_to_the_limits() {
        let host = ("host", "a.example");
        let long_path = format!("/{}", "a".repeat(64));
        assert_eq!(code(H11, &long_path, &[host]), Some("uri_too_long"));
        assert_eq!(code(H11, &long_path[..64], &[host]), None);
        let five = [host, ("a", "1"), ("b", "2"), ("c", "3"), ("d", "4")];
        assert_eq!(code(H11, "/", &five), Some("request_headers_too_large"));
        assert_eq!(code(H11, "/", &five[..4]), None);
        let big = "v".repeat(200);
        assert_eq!(
            code(H11, "/", &[host, ("a", &big)]),
            Some("request_headers_too_large")
        );
    }
}
