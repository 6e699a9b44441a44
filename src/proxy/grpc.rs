//! gRPC on the request path (TRAFFIC.md §2): which requests are gRPC, their deadline
//! (`grpc-timeout`), and answers a gRPC client can read when Raahi, or a target that does not
//! speak gRPC, fails the call: HTTP 200, trailers-only, `grpc-status` and `grpc-message`.

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Response, StatusCode};
use http_body_util::Full;

/// gRPC status codes (grpc/doc/statuscodes.md) that Raahi sends or reads.
pub const UNKNOWN: u16 = 2;
pub const DEADLINE_EXCEEDED: u16 = 4;
pub const PERMISSION_DENIED: u16 = 7;
pub const RESOURCE_EXHAUSTED: u16 = 8;
pub const UNIMPLEMENTED: u16 = 12;
pub const INTERNAL: u16 = 13;
pub const UNAVAILABLE: u16 = 14;
pub const UNAUTHENTICATED: u16 = 16;

/// Names Raahi's own answer, so an operator can tell it from a target's.
pub const RAAHI_ERROR: &str = "x-raahi-error";

/// A gRPC request: `application/grpc`, alone or with a `+codec` or parameters. gRPC-Web
/// (`application/grpc-web`) frames its trailers inside the body and is not handled as gRPC.
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|value| is_grpc_type(value.as_bytes()))
}

fn is_grpc_type(value: &[u8]) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    value.len() >= GRPC.len()
        && value[..GRPC.len()].eq_ignore_ascii_case(GRPC)
        && matches!(value.get(GRPC.len()), None | Some(b'+' | b';'))
}

/// The deadline a client set: 1 to 8 digits and a unit (`H`, `M`, `S`, `m`, `u`, `n`). A
/// malformed value is ignored, as gRPC servers do, rather than failing the call.
pub fn parse_timeout(value: &HeaderValue) -> Option<Duration> {
    let text = value.as_bytes();
    let (&unit, digits) = text.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let amount: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b'H' => Duration::from_secs(amount * 3600),
        b'M' => Duration::from_secs(amount * 60),
        b'S' => Duration::from_secs(amount),
        b'm' => Duration::from_millis(amount),
        b'u' => Duration::from_micros(amount),
        b'n' => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// What is left of a deadline, for the target: the finest unit whose amount fits in 8 digits,
/// rounded down, so the target never gets more time than the client has.
pub fn encode_timeout(left: Duration) -> HeaderValue {
    const MAX: u128 = 99_999_999;
    let nanos = left.as_nanos();
    let units: [(u128, &str); 6] = [
        (1, "n"),
        (1_000, "u"),
        (1_000_000, "m"),
        (1_000_000_000, "S"),
        (60_000_000_000, "M"),
        (3_600_000_000_000, "H"),
    ];
    let (amount, unit) = units
        .iter()
        .map(|(size, unit)| (nanos / size, *unit))
        .find(|(amount, _)| *amount <= MAX)
        .unwrap_or((MAX, "H"));
    HeaderValue::from_str(&format!("{amount}{unit}")).expect("digits and a unit")
}

/// The `grpc-status` in `headers` (trailers, or the head of a trailers-only answer).
pub fn status_in(headers: &HeaderMap) -> Option<u16> {
    let value = headers.get("grpc-status")?.as_bytes();
    if value.is_empty() || value.len() > 2 || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(value).ok()?.parse().ok()
}

/// The status for one of Raahi's own failures, from its code and HTTP status (TRAFFIC.md §2).
pub fn status_for_failure(code: &str, http: StatusCode) -> u16 {
    match code {
        "no_route" => UNIMPLEMENTED,
        "request_body_too_large" | "rate_limited" => RESOURCE_EXHAUSTED,
        _ if code.ends_with("_timeout") => DEADLINE_EXCEEDED,
        _ if http.is_server_error() => UNAVAILABLE,
        _ => INTERNAL,
    }
}

/// gRPC's mapping of an HTTP status from a peer that did not answer in gRPC
/// (grpc/doc/http-grpc-status-mapping.md).
pub fn status_for_http(http: StatusCode) -> u16 {
    match http.as_u16() {
        400 => INTERNAL,
        401 => UNAUTHENTICATED,
        403 => PERMISSION_DENIED,
        404 => UNIMPLEMENTED,
        429 | 502 | 503 | 504 => UNAVAILABLE,
        _ => UNKNOWN,
    }
}

/// A trailers-only gRPC answer: HTTP 200, no body, the status in the head.
pub fn trailers_only(status: u16, message: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::default());
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert("grpc-status", HeaderValue::from(status));
    if let Ok(message) = HeaderValue::from_str(&percent_encode(message)) {
        headers.insert("grpc-message", message);
    }
    response
}

/// `grpc-message` is percent-encoded UTF-8: bytes outside printable ASCII, and `%`, as `%XX`.
fn percent_encode(message: &str) -> String {
    let mut encoded = String::with_capacity(message.len());
    for byte in message.bytes() {
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            encoded.push(byte as char);
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn content_type(value: &'static str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(value));
        headers
    }

    #[test]
    fn grpc_is_told_by_its_content_type() {
        for grpc in [
            "application/grpc",
            "application/grpc+proto",
            "Application/GRPC+json",
            "application/grpc;charset=utf-8",
        ] {
            assert!(is_grpc(&content_type(grpc)), "{grpc}");
        }
        for other in [
            "application/grpc-web",
            "application/grpc-web+proto",
            "application/grpcx",
            "application/json",
        ] {
            assert!(!is_grpc(&content_type(other)), "{other}");
        }
        assert!(!is_grpc(&HeaderMap::new()));
    }

    #[test]
    fn timeouts_parse_in_every_unit_and_malformed_ones_are_ignored() {
        let parse = |text: &'static str| parse_timeout(&HeaderValue::from_static(text));
        assert_eq!(parse("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse("3S"), Some(Duration::from_secs(3)));
        assert_eq!(parse("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parse("99999999n"), Some(Duration::from_nanos(99_999_999)));
        assert_eq!(parse("0S"), Some(Duration::ZERO));
        for bad in [
            "",
            "S",
            "100",
            "123456789S",
            "1s",
            "1.5S",
            "-1S",
            " 1S",
            "1 S",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn what_is_left_goes_up_in_the_finest_unit_that_fits() {
        let encode = |left: Duration| encode_timeout(left).to_str().unwrap().to_owned();
        assert_eq!(encode(Duration::from_nanos(500)), "500n");
        assert_eq!(encode(Duration::from_millis(150)), "150000u");
        assert_eq!(encode(Duration::from_secs(30)), "30000000u");
        assert_eq!(encode(Duration::from_secs(3600)), "3600000m");
        assert_eq!(encode(Duration::from_secs(10 * 86_400 * 365)), "5256000M");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]
        /// Sent on, a deadline is never longer than what was left, and loses less than a unit.
        #[test]
        fn an_encoded_deadline_is_never_longer_and_close(nanos in 0u64..(400 * 3_600_000_000_000)) {
            let left = Duration::from_nanos(nanos);
            let sent = parse_timeout(&encode_timeout(left)).unwrap();
            prop_assert!(sent <= left);
            prop_assert!(left - sent < left / 100_000 + Duration::from_nanos(1));
        }
    }

    #[test]
    fn raahis_failures_map_to_the_table_of_traffic_md() {
        let cases = [
            ("no_route", StatusCode::NOT_FOUND, UNIMPLEMENTED),
            (
                "upstream_timeout",
                StatusCode::GATEWAY_TIMEOUT,
                DEADLINE_EXCEEDED,
            ),
            (
                "upstream_connect_timeout",
                StatusCode::GATEWAY_TIMEOUT,
                DEADLINE_EXCEEDED,
            ),
            (
                "upstream_send_timeout",
                StatusCode::GATEWAY_TIMEOUT,
                DEADLINE_EXCEEDED,
            ),
            (
                "client_body_timeout",
                StatusCode::REQUEST_TIMEOUT,
                DEADLINE_EXCEEDED,
            ),
            (
                "grpc_timeout",
                StatusCode::GATEWAY_TIMEOUT,
                DEADLINE_EXCEEDED,
            ),
            (
                "request_body_too_large",
                StatusCode::PAYLOAD_TOO_LARGE,
                RESOURCE_EXHAUSTED,
            ),
            (
                "rate_limited",
                StatusCode::TOO_MANY_REQUESTS,
                RESOURCE_EXHAUSTED,
            ),
            (
                "no_available_target",
                StatusCode::SERVICE_UNAVAILABLE,
                UNAVAILABLE,
            ),
            (
                "discovery_unavailable",
                StatusCode::SERVICE_UNAVAILABLE,
                UNAVAILABLE,
            ),
            (
                "upstream_connect_failed",
                StatusCode::BAD_GATEWAY,
                UNAVAILABLE,
            ),
            (
                "upstream_refused",
                StatusCode::SERVICE_UNAVAILABLE,
                UNAVAILABLE,
            ),
            (
                "upgrade_not_supported",
                StatusCode::NOT_IMPLEMENTED,
                UNAVAILABLE,
            ),
            ("invalid_host", StatusCode::BAD_REQUEST, INTERNAL),
            ("invalid_path", StatusCode::BAD_REQUEST, INTERNAL),
        ];
        for (code, http, grpc) in cases {
            assert_eq!(status_for_failure(code, http), grpc, "{code}");
        }
    }

    #[test]
    fn a_non_grpc_answer_maps_as_grpc_clients_map_it() {
        let cases = [
            (400, INTERNAL),
            (401, UNAUTHENTICATED),
            (403, PERMISSION_DENIED),
            (404, UNIMPLEMENTED),
            (429, UNAVAILABLE),
            (502, UNAVAILABLE),
            (503, UNAVAILABLE),
            (504, UNAVAILABLE),
            (500, UNKNOWN),
            (302, UNKNOWN),
        ];
        for (http, grpc) in cases {
            assert_eq!(
                status_for_http(StatusCode::from_u16(http).unwrap()),
                grpc,
                "{http}"
            );
        }
    }

    #[test]
    fn a_trailers_only_answer_carries_the_status_and_an_encoded_message() {
        let response = trailers_only(UNAVAILABLE, "no target for service café: 100% down\n");
        assert_eq!(response.status(), StatusCode::OK);
        let headers = response.headers();
        assert_eq!(headers["content-type"], "application/grpc");
        assert_eq!(headers["grpc-status"], "14");
        assert_eq!(
            headers["grpc-message"],
            "no target for service caf%C3%A9: 100%25 down%0A"
        );
        assert_eq!(status_in(headers), Some(UNAVAILABLE));
    }

    #[test]
    fn a_status_is_one_or_two_digits() {
        let status = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert("grpc-status", HeaderValue::from_static(value));
            status_in(&headers)
        };
        assert_eq!(status("0"), Some(0));
        assert_eq!(status("14"), Some(UNAVAILABLE));
        for bad in ["", "140", "-1", "1a", " 1"] {
            assert_eq!(status(bad), None, "{bad:?}");
        }
    }
}
