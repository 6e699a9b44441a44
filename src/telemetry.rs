//! Log formats beyond what tracing-subscriber ships: logfmt (`key=value` pairs, one event a line).

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
        let timestamp = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
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

fn quoted(value: &str) -> std::borrow::Cow<'_, str> {
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
}
