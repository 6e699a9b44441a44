//! Access-log lines, written without tracing: the request path formats its line straight into
//! its thread's sink buffer (no per-field allocation, no dispatch through a subscriber) in the
//! layout the `json` and `logfmt` log formats give every other event, so one parser reads both.

use std::cell::Cell;
use std::net::IpAddr;
use std::sync::OnceLock;
use std::time::Duration;

use super::sink::SinkHandle;
use super::{escape_json, quoted};

/// The tracing target access lines are filed under, which `RUST_LOG` turns on and off
/// (`raahi::access=off`) like any other target.
pub const TARGET: &str = "raahi::access";

/// The process's access log; unset (the access log off) until `install`.
static ACCESS_LOG: OnceLock<AccessLog> = OnceLock::new();

struct AccessLog {
    sink: SinkHandle,
    layout: Layout,
}

/// How access lines are laid out: as the `json` or `logfmt` log format lays out other events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    Json,
    Logfmt,
}

/// Turns the access log on for this process. Only the first call counts.
pub fn install(sink: SinkHandle, layout: Layout) {
    let _ = ACCESS_LOG.set(AccessLog { sink, layout });
}

/// Whether access lines are written: worth gathering what they need.
pub fn enabled() -> bool {
    ACCESS_LOG.get().is_some()
}

/// Writes one access line whose fields `fill` gives, when the access log is on.
pub fn write(fill: impl FnOnce(&mut Fields<'_>)) {
    let Some(log) = ACCESS_LOG.get() else {
        return;
    };
    log.sink
        .append(|buffer| format_line(buffer, log.layout, fill));
}

fn format_line(buffer: &mut Vec<u8>, layout: Layout, fill: impl FnOnce(&mut Fields<'_>)) {
    let timestamp = Timestamp::now();
    let mut fields = Fields {
        buffer,
        layout,
        first: true,
    };
    match layout {
        Layout::Json => {
            fields.buffer.extend_from_slice(b"{\"timestamp\":\"");
            timestamp.write(fields.buffer, 6);
            fields
                .buffer
                .extend_from_slice(b"\",\"level\":\"INFO\",\"fields\":{");
            fill(&mut fields);
            fields.buffer.extend_from_slice(b"},\"target\":\"");
            fields.buffer.extend_from_slice(TARGET.as_bytes());
            fields.buffer.extend_from_slice(b"\"}\n");
        }
        Layout::Logfmt => {
            fields.buffer.extend_from_slice(b"ts=");
            timestamp.write(fields.buffer, 3);
            fields.buffer.extend_from_slice(b" level=info target=");
            fields.buffer.extend_from_slice(TARGET.as_bytes());
            fill(&mut fields);
            fields.buffer.push(b'\n');
        }
    }
}

/// One line as `layout` lays it out, for tests of the fields their callers write.
#[cfg(test)]
pub(crate) fn format_for_test(layout: Layout, fill: impl FnOnce(&mut Fields<'_>)) -> String {
    let mut buffer = Vec::new();
    format_line(&mut buffer, layout, fill);
    String::from_utf8(buffer).expect("access lines are UTF-8")
}

/// The fields of one line, in the order they are added. Names are the caller's identifiers
/// (plain ASCII, never escaped); values are escaped or quoted as the layout needs.
pub struct Fields<'a> {
    buffer: &'a mut Vec<u8>,
    layout: Layout,
    first: bool,
}

impl Fields<'_> {
    pub fn str(&mut self, name: &str, value: &str) {
        self.name(name);
        match self.layout {
            Layout::Json => {
                self.buffer.push(b'"');
                let buffer = &mut *self.buffer;
                let _ = escape_json(value, |piece| {
                    buffer.extend_from_slice(piece.as_bytes());
                    Ok::<(), ()>(())
                });
                self.buffer.push(b'"');
            }
            Layout::Logfmt => self.buffer.extend_from_slice(quoted(value).as_bytes()),
        }
    }

    /// A field left out when there is no value, as tracing leaves out a `None`.
    pub fn opt_str(&mut self, name: &str, value: Option<&str>) {
        if let Some(value) = value {
            self.str(name, value);
        }
    }

    pub fn u64(&mut self, name: &str, value: u64) {
        self.name(name);
        self.buffer
            .extend_from_slice(itoa::Buffer::new().format(value).as_bytes());
    }

    pub fn i64(&mut self, name: &str, value: i64) {
        self.name(name);
        self.buffer
            .extend_from_slice(itoa::Buffer::new().format(value).as_bytes());
    }

    pub fn opt_u64(&mut self, name: &str, value: Option<u64>) {
        if let Some(value) = value {
            self.u64(name, value);
        }
    }

    /// `true` or `false`: a JSON boolean, a bare word in logfmt.
    pub fn bool(&mut self, name: &str, value: bool) {
        self.name(name);
        self.buffer
            .extend_from_slice(if value { b"true" } else { b"false" });
    }

    /// An address as a string; IPv4 without the formatting machinery, as most clients are.
    pub fn ip(&mut self, name: &str, ip: IpAddr) {
        match ip {
            IpAddr::V4(v4) => {
                self.name(name);
                let quote = self.layout == Layout::Json;
                if quote {
                    self.buffer.push(b'"');
                }
                let mut itoa = itoa::Buffer::new();
                for (index, octet) in v4.octets().into_iter().enumerate() {
                    if index > 0 {
                        self.buffer.push(b'.');
                    }
                    self.buffer.extend_from_slice(itoa.format(octet).as_bytes());
                }
                if quote {
                    self.buffer.push(b'"');
                }
            }
            IpAddr::V6(v6) => self.str(name, &v6.to_string()),
        }
    }

    /// Milliseconds with microsecond precision (`12.345`), as a JSON number.
    pub fn millis(&mut self, name: &str, elapsed: Duration) {
        self.name(name);
        let micros = elapsed.as_micros();
        let mut itoa = itoa::Buffer::new();
        self.buffer
            .extend_from_slice(itoa.format(micros / 1000).as_bytes());
        let fraction = (micros % 1000) as u16;
        self.buffer.extend_from_slice(&[
            b'.',
            b'0' + (fraction / 100) as u8,
            b'0' + (fraction / 10 % 10) as u8,
            b'0' + (fraction % 10) as u8,
        ]);
    }

    pub fn opt_millis(&mut self, name: &str, elapsed: Option<Duration>) {
        if let Some(elapsed) = elapsed {
            self.millis(name, elapsed);
        }
    }

    fn name(&mut self, name: &str) {
        match self.layout {
            Layout::Json => {
                if !self.first {
                    self.buffer.push(b',');
                }
                self.buffer.push(b'"');
                self.buffer.extend_from_slice(name.as_bytes());
                self.buffer.extend_from_slice(b"\":");
            }
            Layout::Logfmt => {
                self.buffer.push(b' ');
                self.buffer.extend_from_slice(name.as_bytes());
                self.buffer.push(b'=');
            }
        }
        self.first = false;
    }
}

/// `2026-12-02T12:34:56.123456Z` (RFC 3339, UTC). The date and time of day are formatted once a
/// second per thread; a line adds only its fraction.
struct Timestamp {
    micros: u64,
}

thread_local! {
    /// The second last formatted on this thread and its `YYYY-MM-DDTHH:MM:SS`.
    static FORMATTED_SECOND: Cell<(u64, [u8; 19])> = const { Cell::new((u64::MAX, [0; 19])) };
}

impl Timestamp {
    fn now() -> Timestamp {
        Timestamp {
            micros: crate::clock::unix_micros(),
        }
    }

    /// Writes the timestamp with `digits` (3 or 6) digits of fraction.
    fn write(&self, buffer: &mut Vec<u8>, digits: u32) {
        let second = self.micros / 1_000_000;
        let date_time = FORMATTED_SECOND.with(|cached| {
            let (cached_second, text) = cached.get();
            if cached_second == second {
                return text;
            }
            let text = format_second(second);
            cached.set((second, text));
            text
        });
        buffer.extend_from_slice(&date_time);
        buffer.push(b'.');
        let fraction = (self.micros % 1_000_000) / 10u64.pow(6 - digits);
        let mut itoa = itoa::Buffer::new();
        let text = itoa.format(fraction);
        for _ in text.len()..digits as usize {
            buffer.push(b'0');
        }
        buffer.extend_from_slice(text.as_bytes());
        buffer.push(b'Z');
    }
}

fn format_second(second: u64) -> [u8; 19] {
    let mut text = [b'0'; 19];
    let formatted = i64::try_from(second)
        .ok()
        .and_then(|second| chrono::DateTime::from_timestamp(second, 0))
        .unwrap_or_default()
        .format("%Y-%m-%dT%H:%M:%S")
        .to_string();
    if formatted.len() == text.len() {
        text.copy_from_slice(formatted.as_bytes());
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::format_for_test as line;

    fn every_kind(fields: &mut Fields<'_>) {
        fields.str("request_id", "id with \"quotes\"\n");
        fields.ip("client", IpAddr::V4(Ipv4Addr::new(10, 0, 200, 7)));
        fields.ip("client6", IpAddr::V6(Ipv6Addr::LOCALHOST));
        fields.str("path", "/a b=c");
        fields.opt_str("route", None);
        fields.opt_str("service", Some("shop"));
        fields.u64("status", 200);
        fields.i64("route_id", -3);
        fields.opt_u64("bytes", None);
        fields.millis("duration_ms", Duration::from_micros(12_045));
        fields.opt_millis("upstream_ms", Some(Duration::from_micros(7)));
        fields.bool("hedged", true);
        fields.bool("cached", false);
    }

    #[test]
    fn json_lines_parse_and_keep_every_value() {
        let text = line(Layout::Json, every_kind);
        assert!(
            text.ends_with("}\n") && text.matches('\n').count() == 1,
            "{text}"
        );
        let entry: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(entry["level"], "INFO");
        assert_eq!(entry["target"], "raahi::access");
        let fields = &entry["fields"];
        assert_eq!(fields["request_id"], "id with \"quotes\"\n");
        assert_eq!(fields["client"], "10.0.200.7");
        assert_eq!(fields["client6"], "::1");
        assert_eq!(fields["path"], "/a b=c");
        assert_eq!(fields["service"], "shop");
        assert_eq!(fields["status"], 200);
        assert_eq!(fields["route_id"], -3);
        assert_eq!(fields["duration_ms"], 12.045);
        assert_eq!(fields["upstream_ms"], 0.007);
        assert_eq!(fields["hedged"], true);
        assert_eq!(fields["cached"], false);
        assert!(fields.get("route").is_none() && fields.get("bytes").is_none());
        let timestamp = entry["timestamp"].as_str().unwrap();
        let parsed = chrono::DateTime::parse_from_rfc3339(timestamp).unwrap();
        let age = crate::clock::now().signed_duration_since(parsed);
        assert!(age.num_seconds().abs() < 60, "{timestamp}");
        assert_eq!(
            timestamp.len(),
            "2026-12-02T12:34:56.123456Z".len(),
            "{timestamp}"
        );
    }

    #[test]
    fn logfmt_lines_quote_what_needs_quoting() {
        let text = line(Layout::Logfmt, every_kind);
        assert!(text.starts_with("ts="), "{text}");
        assert!(
            text.ends_with('\n') && text.matches('\n').count() == 1,
            "{text}"
        );
        for pair in [
            " level=info target=raahi::access ",
            r#" request_id="id with \"quotes\"\n""#,
            " client=10.0.200.7 ",
            " client6=::1 ",
            r#" path="/a b=c" "#,
            " service=shop ",
            " status=200 ",
            " route_id=-3 ",
            " duration_ms=12.045 ",
            " upstream_ms=0.007 ",
            " hedged=true cached=false\n",
        ] {
            assert!(text.contains(pair), "{pair:?} missing in {text}");
        }
        assert!(
            !text.contains("route=") && !text.contains("bytes="),
            "{text}"
        );
        let timestamp = text.split(' ').next().unwrap().trim_start_matches("ts=");
        assert_eq!(
            timestamp.len(),
            "2026-12-02T12:34:56.123Z".len(),
            "{timestamp}"
        );
    }

    #[test]
    fn timestamps_change_with_the_second() {
        let mut early = Vec::new();
        Timestamp { micros: 5 }.write(&mut early, 6);
        assert_eq!(early, b"1970-01-01T00:00:00.000005Z");
        let mut later = Vec::new();
        Timestamp {
            micros: 1_796_214_896_123_456,
        }
        .write(&mut later, 3);
        assert_eq!(later, b"2026-12-02T12:34:56.123Z");
    }
}
