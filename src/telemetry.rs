//! Log formats: logfmt (`key=value` pairs, one event a line), which tracing-subscriber does not
//! ship, and JSON lines in tracing-subscriber's layout, written without its serde_json detour.
//! Lines go to the batching [`sink`]; access lines skip tracing and are written by [`access`].

pub mod access;
pub mod sink;
pub mod trace;

use std::sync::OnceLock;

/// The sink this process logs through, for the dropped-lines metric; unset in tests that run
/// the gateway in process without logging.
static PROCESS_SINK: OnceLock<sink::SinkHandle> = OnceLock::new();

/// Records the sink the process logs through. Only the first call counts.
pub fn install_process_sink(handle: sink::SinkHandle) {
    let _ = PROCESS_SINK.set(handle);
}

/// Log lines the process dropped because the log writer fell behind or stderr failed.
pub fn dropped_log_lines() -> u64 {
    PROCESS_SINK
        .get()
        .map_or(0, sink::SinkHandle::dropped_lines)
}

use std::fmt::{self, Write as _};

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// `ts=… level=info target=raahi::access msg="…" key=value …`, values quoted when they hold
/// spaces, quotes, `=` or control characters.
#[derive(Debug, Default, Clone, Copy)]
pub struct Logfmt;

impl<S, N> FormatEvent<S, N> for Logfmt
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _context: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let metadata = event.metadata();
        let timestamp = crate::clock::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        write!(
            writer,
            "ts={timestamp} level={} target={}",
            metadata.level().as_str().to_ascii_lowercase(),
            quoted(metadata.target())
        )?;
        let mut pairs = Pairs {
            line: String::new(),
        };
        event.record(&mut pairs);
        writer.write_str(&pairs.line)?;
        writeln!(writer)
    }
}

struct Pairs {
    line: String,
}

impl Pairs {
    fn push(&mut self, field: &Field, value: &str) {
        let key = match field.name() {
            "message" => "msg",
            name => name,
        };
        let _ = write!(self.line, " {key}={}", quoted(value));
    }
}

impl Visit for Pairs {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.push(field, value);
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.push(field, &format!("{value:?}"));
    }
}

pub(crate) fn quoted(value: &str) -> std::borrow::Cow<'_, str> {
    let plain = !value.is_empty()
        && !value
            .chars()
            .any(|c| c == ' ' || c == '"' || c == '=' || c == '\\' || c.is_control());
    if plain {
        return value.into();
    }
    let mut text = String::with_capacity(value.len() + 2);
    text.push('"');
    for c in value.chars() {
        match c {
            '"' => text.push_str("\\\""),
            '\\' => text.push_str("\\\\"),
            '\n' => text.push_str("\\n"),
            c if c.is_control() => {
                let _ = write!(text, "\\u{{{:04x}}}", c as u32);
            }
            c => text.push(c),
        }
    }
    text.push('"');
    text.into()
}

/// The JSON lines tracing-subscriber's `.json()` writes (`{"timestamp":…,"level":"INFO",
/// "fields":{…},"target":…}`), written straight into the line buffer. tracing-subscriber's own
/// formatter runs serde_json through an `io::Write` adaptor that re-validates UTF-8 on every
/// token; with one access line per request that was a third of a proxied request's CPU.
/// Spans are not printed: raahi opens none.
#[derive(Debug, Default, Clone, Copy)]
pub struct Json;

impl<S, N> FormatEvent<S, N> for Json
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _context: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let metadata = event.metadata();
        let timestamp = crate::clock::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
        write!(
            writer,
            "{{\"timestamp\":\"{timestamp}\",\"level\":\"{}\",\"fields\":{{",
            metadata.level()
        )?;
        let mut fields = JsonFields {
            writer: &mut writer,
            first: true,
            result: Ok(()),
        };
        event.record(&mut fields);
        fields.result?;
        writer.write_str("},\"target\":")?;
        write_json_string(&mut writer, metadata.target())?;
        writer.write_str("}\n")
    }
}

struct JsonFields<'a, 'w> {
    writer: &'a mut Writer<'w>,
    first: bool,
    result: fmt::Result,
}

impl JsonFields<'_, '_> {
    /// Writes `"name":` (with the separating comma) and then the value through `value`.
    fn entry(&mut self, field: &Field, value: impl FnOnce(&mut Writer<'_>) -> fmt::Result) {
        if self.result.is_err() {
            return;
        }
        let separator = if self.first { "" } else { "," };
        self.first = false;
        self.result = self
            .writer
            .write_str(separator)
            .and_then(|()| write_json_string(self.writer, field.name()))
            .and_then(|()| self.writer.write_str(":"))
            .and_then(|()| value(self.writer));
    }
}

impl Visit for JsonFields<'_, '_> {
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.entry(field, |writer| {
            if value.is_finite() {
                // `{:?}` prints the shortest round-trip form, as serde_json does (1.0, 0.25, 1e-7)
                write!(writer, "{value:?}")
            } else {
                writer.write_str("null")
            }
        });
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.entry(field, |writer| write!(writer, "{value}"));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.entry(field, |writer| write!(writer, "{value}"));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.entry(field, |writer| write!(writer, "{value}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.entry(field, |writer| write_json_string(writer, value));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.entry(field, |writer| {
            writer.write_str("\"")?;
            write!(JsonEscaped(writer), "{value:?}")?;
            writer.write_str("\"")
        });
    }
}

fn write_json_string(writer: &mut Writer<'_>, value: &str) -> fmt::Result {
    writer.write_str("\"")?;
    JsonEscaped(writer).write_str(value)?;
    writer.write_str("\"")
}

/// Escapes what it is given as the inside of a JSON string (RFC 8259 §7).
struct JsonEscaped<'a, 'w>(&'a mut Writer<'w>);

impl fmt::Write for JsonEscaped<'_, '_> {
    fn write_str(&mut self, text: &str) -> fmt::Result {
        escape_json(text, |piece| self.0.write_str(piece))
    }
}

/// Hands `emit` the pieces of `text` escaped as the inside of a JSON string (RFC 8259 §7).
pub(crate) fn escape_json<E>(
    text: &str,
    mut emit: impl FnMut(&str) -> Result<(), E>,
) -> Result<(), E> {
    let bytes = text.as_bytes();
    // Eight bytes at a time up to the first word holding something to escape; most values
    // (paths, hosts, ids, names) hold nothing and are written in one piece.
    let mut start = 0;
    while start + 8 <= bytes.len() {
        let mut word = [0u8; 8];
        word.copy_from_slice(&bytes[start..start + 8]);
        if word_needs_escape(u64::from_le_bytes(word)) {
            break;
        }
        start += 8;
    }
    let mut plain_from = 0;
    for (index, &byte) in bytes.iter().enumerate().skip(start) {
        if !NEEDS_ESCAPE[usize::from(byte)] {
            continue;
        }
        let mut unicode = *b"\\u0000";
        let escape = match byte {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0x08 => "\\b",
            0x0c => "\\f",
            _ => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                unicode[4] = HEX[usize::from(byte >> 4)];
                unicode[5] = HEX[usize::from(byte & 0xf)];
                // six ASCII bytes
                std::str::from_utf8(&unicode).unwrap_or("")
            }
        };
        // Escaped bytes are ASCII, so `index` is a character boundary.
        emit(&text[plain_from..index])?;
        emit(escape)?;
        plain_from = index + 1;
    }
    emit(&text[plain_from..])
}

/// Whether any of the eight bytes is a control character, `"` or `\` (the "has a byte less than
/// n" and "has a zero byte" word tricks; exact for "any", which is all that is asked).
fn word_needs_escape(word: u64) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let below_space = word.wrapping_sub(ONES * 0x20) & !word & HIGH;
    let quote = word ^ (ONES * u64::from(b'"'));
    let backslash = word ^ (ONES * u64::from(b'\\'));
    let has_quote = quote.wrapping_sub(ONES) & !quote & HIGH;
    let has_backslash = backslash.wrapping_sub(ONES) & !backslash & HIGH;
    below_space | has_quote | has_backslash != 0
}

/// Bytes a JSON string cannot hold as they are: control characters, `"` and `\`. A table lookup
/// per byte, because every access-log line runs each of its values through this loop.
static NEEDS_ESCAPE: [bool; 256] = {
    let mut table = [false; 256];
    let mut byte = 0;
    while byte < 0x20 {
        table[byte] = true;
        byte += 1;
    }
    table[b'"' as usize] = true;
    table[b'\\' as usize] = true;
    table
};

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn events_become_one_logfmt_line() {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .event_format(Logfmt)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(
                target: "raahi::access",
                status = 200,
                path = "/a b",
                host = "shop.test",
                quote = "say \"hi\"",
                "request done"
            );
        });
        let line = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        assert!(line.starts_with("ts="), "{line}");
        assert!(
            line.ends_with('\n') && line.lines().count() == 1,
            "{line:?}"
        );
        for pair in [
            "level=info",
            "target=raahi::access",
            "msg=\"request done\"",
            "status=200",
            "path=\"/a b\"",
            "host=shop.test",
            "quote=\"say \\\"hi\\\"\"",
        ] {
            assert!(line.contains(pair), "{pair} missing in {line}");
        }
    }

    /// The same event through tracing-subscriber's own `.json()` and through `Json`.
    fn both_json_lines(emit: impl Fn()) -> (serde_json::Value, serde_json::Value) {
        let ours = Captured::default();
        let writer = ours.clone();
        let subscriber = tracing_subscriber::fmt()
            .event_format(Json)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, &emit);
        let theirs = Captured::default();
        let writer = theirs.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, &emit);
        let parse = |captured: &Captured| {
            let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
            assert!(
                text.ends_with('\n') && text.lines().count() == 1,
                "{text:?}"
            );
            let mut value: serde_json::Value = serde_json::from_str(&text)
                .unwrap_or_else(|error| panic!("not JSON ({error}): {text}"));
            let timestamp = value["timestamp"].as_str().unwrap_or_default().to_owned();
            assert!(
                chrono::DateTime::parse_from_rfc3339(&timestamp).is_ok(),
                "timestamp {timestamp:?} in {text}"
            );
            value["timestamp"] = serde_json::Value::Null;
            value
        };
        (parse(&ours), parse(&theirs))
    }

    #[test]
    fn json_lines_match_tracing_subscribers_layout() {
        let (ours, theirs) = both_json_lines(|| {
            let client: std::net::IpAddr = "127.0.0.1".parse().unwrap();
            let missing: Option<&str> = None;
            tracing::info!(
                target: "raahi::access",
                request_id = "abc-1",
                client = %client,
                protocol = ?http::Version::HTTP_11,
                route = missing,
                status = 200u16,
                offset = -3i64,
                cached = false,
                duration_ms = 1.25f64,
                whole_ms = 3.0f64,
                "request done"
            );
        });
        assert_eq!(ours, theirs);
        assert_eq!(ours["fields"]["status"], 200);
        assert_eq!(ours["fields"]["duration_ms"], 1.25);
        assert_eq!(ours["level"], "INFO");
        assert_eq!(ours["target"], "raahi::access");
    }

    #[test]
    fn word_check_agrees_with_the_byte_table() {
        for special in 0..=255u8 {
            for position in 0..8 {
                let mut word = *b"abcdefgh";
                word[position] = special;
                let expected = word.iter().any(|byte| NEEDS_ESCAPE[usize::from(*byte)]);
                assert_eq!(
                    word_needs_escape(u64::from_le_bytes(word)),
                    expected,
                    "byte {special:#04x} at {position}"
                );
            }
        }
    }

    #[test]
    fn json_strings_are_escaped() {
        let (ours, theirs) = both_json_lines(|| {
            tracing::warn!(
                path = "/say \"hi\"\\back",
                control = "tab\there\nnew line\r\u{1}\u{1f}\u{8}\u{c}",
                unicode = "café ✓ 🚀",
                long = "/a/rather/long/path/with/a\"quote/and\\a/backslash/after/24/bytes\u{1}",
                debug = ?"quoted \"debug\"",
                "message with \"quotes\" and \u{7f}"
            );
        });
        assert_eq!(ours, theirs);
        assert_eq!(ours["fields"]["path"], "/say \"hi\"\\back");
        assert_eq!(
            ours["fields"]["control"],
            "tab\there\nnew line\r\u{1}\u{1f}\u{8}\u{c}"
        );
        assert_eq!(ours["fields"]["unicode"], "café ✓ 🚀");
    }
}
