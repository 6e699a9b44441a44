//! W3C Trace Context (`traceparent`), read from a request and written for the next hop.
//! Parsed by hand: it runs on every request that carries one, and the rules are few
//! (<https://www.w3.org/TR/trace-context/#traceparent-header>).

use http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::trace::{SpanId, TraceFlags, TraceId};

pub static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub static TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// `00-` + 32 hex + `-` + 16 hex + `-` + 2 hex.
const VERSION_00_LEN: usize = 55;

/// The trace a request arrived in: its id, the caller's span and whether the caller records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: TraceId,
    pub parent_id: SpanId,
    pub flags: TraceFlags,
}

impl TraceParent {
    /// The context of `headers`, when it holds exactly one valid `traceparent`. Anything else
    /// (absent, repeated, malformed, an all-zero id) is no context: the request starts afresh.
    pub fn of(headers: &HeaderMap) -> Option<TraceParent> {
        let mut values = headers.get_all(&TRACEPARENT).iter();
        let value = values.next()?;
        if values.next().is_some() {
            return None;
        }
        Self::parse(value.as_bytes())
    }

    pub fn parse(value: &[u8]) -> Option<TraceParent> {
        let value = trim(value);
        if value.len() < VERSION_00_LEN {
            return None;
        }
        let version = hex_u8(&value[0..2])?;
        // A later version may append fields after a dash; version 00 has exactly four.
        let well_sized = match version {
            0xff => false,
            0x00 => value.len() == VERSION_00_LEN,
            _ => value.len() == VERSION_00_LEN || value[VERSION_00_LEN] == b'-',
        };
        if !well_sized || value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
            return None;
        }
        let trace_id = hex_u128(&value[3..35])?;
        let parent_id = hex_u64(&value[36..52])?;
        let flags = hex_u8(&value[53..55])?;
        if trace_id == 0 || parent_id == 0 {
            return None;
        }
        Some(TraceParent {
            trace_id: TraceId::from(trace_id),
            parent_id: SpanId::from(parent_id),
            // Only the sampled bit has a meaning Raahi acts on; other bits are passed on as
            // they came when Raahi does not record (the header is then left untouched).
            flags: TraceFlags::new(flags),
        })
    }

    pub fn sampled(&self) -> bool {
        self.flags.is_sampled()
    }
}

/// The `traceparent` value naming `span_id` as the parent of the next hop.
pub fn traceparent(trace_id: TraceId, span_id: SpanId, flags: TraceFlags) -> HeaderValue {
    let mut text = [0u8; VERSION_00_LEN];
    text[0..3].copy_from_slice(b"00-");
    write_hex(&mut text[3..35], &trace_id.to_bytes());
    text[35] = b'-';
    write_hex(&mut text[36..52], &span_id.to_bytes());
    text[52] = b'-';
    write_hex(
        &mut text[53..55],
        &[flags.to_u8() & TraceFlags::SAMPLED.to_u8()],
    );
    HeaderValue::from_bytes(&text).expect("hex digits and dashes are a valid header value")
}

/// A trace id as the 32 lower-case hex digits `traceparent` carries, without allocating.
pub fn trace_id_hex(trace_id: TraceId, out: &mut [u8; 32]) -> &str {
    write_hex(out, &trace_id.to_bytes());
    std::str::from_utf8(out).expect("hex digits are ASCII")
}

/// Optional whitespace around a header value is not part of it (RFC 9110 §5.5).
fn trim(value: &[u8]) -> &[u8] {
    let start = value
        .iter()
        .position(|b| !matches!(b, b' ' | b'\t'))
        .unwrap_or(value.len());
    let end = value
        .iter()
        .rposition(|b| !matches!(b, b' ' | b'\t'))
        .map_or(start, |last| last + 1);
    &value[start..end]
}

/// Lower-case hex only: the specification refuses upper case.
fn hex_digit(byte: u8) -> Option<u8> {
    match byte {
        b'0'..=b'9' => Some(byte - b'0'),
        b'a'..=b'f' => Some(byte - b'a' + 10),
        _ => None,
    }
}

fn hex_u128(digits: &[u8]) -> Option<u128> {
    digits.iter().try_fold(0u128, |value, &byte| {
        Some((value << 4) | u128::from(hex_digit(byte)?))
    })
}

fn hex_u64(digits: &[u8]) -> Option<u64> {
    digits.iter().try_fold(0u64, |value, &byte| {
        Some((value << 4) | u64::from(hex_digit(byte)?))
    })
}

fn hex_u8(digits: &[u8]) -> Option<u8> {
    Some((hex_digit(digits[0])? << 4) | hex_digit(digits[1])?)
}

fn write_hex(out: &mut [u8], bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (pair, byte) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = DIGITS[usize::from(byte >> 4)];
        pair[1] = DIGITS[usize::from(byte & 0x0f)];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn the_specification_example_is_read_and_written_back_the_same() {
        let parent = TraceParent::parse(EXAMPLE.as_bytes()).unwrap();
        assert_eq!(
            parent.trace_id,
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
        );
        assert_eq!(
            parent.parent_id,
            SpanId::from_hex("00f067aa0ba902b7").unwrap()
        );
        assert!(parent.sampled());
        assert_eq!(
            traceparent(parent.trace_id, parent.parent_id, parent.flags),
            EXAMPLE
        );
    }

    #[test]
    fn malformed_values_are_no_context() {
        for value in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            // Upper-case hex, an all-zero trace or parent id, version ff, a wrong separator.
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
            // Version 00 has no room for more fields.
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert_eq!(TraceParent::parse(value.as_bytes()), None, "{value:?}");
        }
    }

    #[test]
    fn a_later_version_is_read_by_its_first_four_fields() {
        let later = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes";
        assert!(TraceParent::parse(later.as_bytes()).is_some());
        let glued = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x";
        assert_eq!(TraceParent::parse(glued.as_bytes()), None);
    }

    #[test]
    fn surrounding_whitespace_is_ignored_and_two_headers_are_none() {
        let spaced = format!("  {EXAMPLE}\t");
        assert!(TraceParent::parse(spaced.as_bytes()).is_some());
        let mut headers = HeaderMap::new();
        headers.append(&TRACEPARENT, HeaderValue::from_static(EXAMPLE));
        assert!(TraceParent::of(&headers).is_some());
        headers.append(&TRACEPARENT, HeaderValue::from_static(EXAMPLE));
        assert_eq!(TraceParent::of(&headers), None);
    }

    #[test]
    fn only_the_sampled_flag_is_written() {
        let parent =
            TraceParent::parse(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-ff").unwrap();
        let written = traceparent(parent.trace_id, parent.parent_id, parent.flags);
        assert!(written.to_str().unwrap().ends_with("-01"));
    }
}
