//! gRPC requests (placeholder until the policy file lands).

use http::HeaderMap;

pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|value| value.as_bytes().starts_with(b"application/grpc"))
}

/// The `grpc-status` in `headers` (trailers, or the head of a trailers-only answer).
pub fn status_in(headers: &HeaderMap) -> Option<u16> {
    let value = headers.get("grpc-status")?.to_str().ok()?;
    (value.len() <= 2).then(|| value.parse().ok()).flatten()
}

pub const UNAVAILABLE: u16 = 14;

pub fn parse_timeout(value: &http::HeaderValue) -> Option<std::time::Duration> {
    let text = value.to_str().ok()?;
    let (digits, unit) = text.split_at(text.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    use std::time::Duration;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

pub fn encode_timeout(left: std::time::Duration) -> http::HeaderValue {
    let millis = left.as_millis();
    let text = if millis < 100_000_000 {
        format!("{millis}m")
    } else {
        format!("{}S", left.as_secs().min(99_999_999))
    };
    http::HeaderValue::from_str(&text).expect("digits and a unit")
}
