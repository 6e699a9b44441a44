//! The conformance corpus (issue 20): raw HTTP/1.1 framing and smuggling cases against one
//! gateway whose target is a raw origin that records exactly what reached it. Every later change
//! to the downstream path must keep this corpus passing (DESIGN.md §6: nothing ambiguous ever
//! reaches a target).
//!
//! Part 1 is one table: each row sends exact bytes on a fresh connection and states the answer,
//! whether the connection closes, and what the target may receive. All rows run, and every
//! failure is reported at the end.

use crate::common;
use common::*;

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// How long one step of a case (an answer, a close, a request reaching the origin) may take.
const STEP: Duration = Duration::from_secs(5);
/// After a case, how long the origin is watched for requests that should not arrive.
const QUIET: Duration = Duration::from_millis(120);
/// The Host of the table's requests (the catch-all route takes any).
const HOST: &str = "corpus.example";
/// The path of the request that checks a connection is still usable; the origin's records
/// leave it out.
const ALIVE: &str = "/__alive";

// ---------------------------------------------------------------------------------------------
// The recording origin
// ---------------------------------------------------------------------------------------------

/// One complete request as the origin read it off the wire.
#[derive(Debug, Clone)]
struct Recorded {
    method: String,
    target: String,
    headers: Vec<(String, String)>,
    /// The body's content, whatever its framing on the wire.
    body: Vec<u8>,
}

impl Recorded {
    fn values(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
            .collect()
    }
}

#[derive(Default)]
struct Record {
    /// The target of every request head read, complete or not.
    heads: Vec<String>,
    /// Requests read to the end of their body.
    requests: Vec<Recorded>,
    /// Bytes from the gateway the origin could not parse as HTTP/1.1.
    errors: Vec<String>,
}

/// Where the record stood before a case.
#[derive(Clone, Copy)]
struct Mark {
    heads: usize,
    requests: usize,
    errors: usize,
}

/// What reached the origin since a mark (the liveness probes left out).
struct Since {
    heads: Vec<String>,
    requests: Vec<Recorded>,
    errors: Vec<String>,
}

/// A raw HTTP/1.1 origin on 127.0.0.1:0: reads each request (head, then body by its own
/// framing, chunked or Content-Length), records it, and answers 200 with the request target as
/// the body (so a client can tell pipelined answers apart).
struct RecordingOrigin {
    addr: SocketAddr,
    record: Arc<Mutex<Record>>,
}

impl RecordingOrigin {
    async fn start() -> RecordingOrigin {
        let record = Arc::new(Mutex::new(Record::default()));
        let shared = record.clone();
        let (addr, _accepted) =
            counting_origin(move |stream| serve_recorded(stream, shared.clone())).await;
        RecordingOrigin { addr, record }
    }

    fn mark(&self) -> Mark {
        let record = self.record.lock().unwrap();
        Mark {
            heads: record.heads.len(),
            requests: record.requests.len(),
            errors: record.errors.len(),
        }
    }

    fn since(&self, mark: Mark) -> Since {
        let record = self.record.lock().unwrap();
        Since {
            heads: record.heads[mark.heads..]
                .iter()
                .filter(|target| target.as_str() != ALIVE)
                .cloned()
                .collect(),
            requests: record.requests[mark.requests..]
                .iter()
                .filter(|request| request.target != ALIVE)
                .cloned()
                .collect(),
            errors: record.errors[mark.errors..].to_vec(),
        }
    }

    /// A target body for this origin.
    fn target(&self) -> Value {
        json!({"host": "127.0.0.1", "port": self.addr.port(), "weight": 1})
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

/// Reads more bytes into `pending`; false at the end of the connection (or an error).
async fn fill(stream: &mut TcpStream, pending: &mut Vec<u8>) -> bool {
    let mut chunk = vec![0u8; 64 * 1024];
    match stream.read(&mut chunk).await {
        Ok(0) | Err(_) => false,
        Ok(n) => {
            pending.extend_from_slice(&chunk[..n]);
            true
        }
    }
}

async fn origin_line(stream: &mut TcpStream, pending: &mut Vec<u8>) -> Option<Vec<u8>> {
    loop {
        if let Some(end) = find(pending, b"\r\n") {
            let line = pending[..end].to_vec();
            pending.drain(..end + 2);
            return Some(line);
        }
        if !fill(stream, pending).await {
            return None;
        }
    }
}

/// Why the origin stopped reading a connection.
enum Stop {
    /// The connection ended (mid-request or between requests).
    Ended,
    /// The gateway sent something that is not HTTP/1.1.
    Malformed(String),
}

/// Reads one body by the head's framing.
async fn origin_body(
    stream: &mut TcpStream,
    pending: &mut Vec<u8>,
    headers: &[(String, String)],
) -> Result<Vec<u8>, Stop> {
    let values = |name: &str| -> Vec<String> {
        headers
            .iter()
            .filter(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.clone())
            .collect()
    };
    let codings = values("transfer-encoding");
    let lengths = values("content-length");
    if !codings.is_empty() && !lengths.is_empty() {
        return Err(Stop::Malformed(format!(
            "both Transfer-Encoding {codings:?} and Content-Length {lengths:?}"
        )));
    }
    if lengths.len() > 1 {
        return Err(Stop::Malformed(format!("Content-Length {lengths:?}")));
    }
    if !codings.is_empty() {
        if codings.len() != 1 || !codings[0].trim().eq_ignore_ascii_case("chunked") {
            return Err(Stop::Malformed(format!("Transfer-Encoding {codings:?}")));
        }
        let mut body = Vec::new();
        loop {
            let line = origin_line(stream, pending).await.ok_or(Stop::Ended)?;
            let text = String::from_utf8_lossy(&line).into_owned();
            let digits = text.split(';').next().unwrap_or("");
            let size = usize::from_str_radix(digits, 16)
                .map_err(|_| Stop::Malformed(format!("chunk-size line {text:?}")))?;
            if size == 0 {
                // Trailer fields up to the empty line.
                loop {
                    let line = origin_line(stream, pending).await.ok_or(Stop::Ended)?;
                    if line.is_empty() {
                        return Ok(body);
                    }
                }
            }
            while pending.len() < size + 2 {
                if !fill(stream, pending).await {
                    return Err(Stop::Ended);
                }
            }
            if &pending[size..size + 2] != b"\r\n" {
                return Err(Stop::Malformed("chunk data without CRLF".into()));
            }
            body.extend_from_slice(&pending[..size]);
            pending.drain(..size + 2);
        }
    }
    let Some(length) = lengths.first() else {
        return Ok(Vec::new());
    };
    let length: usize = length
        .parse()
        .map_err(|_| Stop::Malformed(format!("Content-Length {length:?}")))?;
    while pending.len() < length {
        if !fill(stream, pending).await {
            return Err(Stop::Ended);
        }
    }
    Ok(pending.drain(..length).collect())
}

async fn serve_recorded(mut stream: TcpStream, record: Arc<Mutex<Record>>) {
    let _ = stream.set_nodelay(true);
    let mut pending = Vec::new();
    loop {
        let end = loop {
            if let Some(end) = find(&pending, b"\r\n\r\n") {
                break end;
            }
            if !fill(&mut stream, &mut pending).await {
                return;
            }
        };
        let head = String::from_utf8_lossy(&pending[..end]).into_owned();
        pending.drain(..end + 4);
        let mut lines = head.split("\r\n");
        let request_line: Vec<&str> = lines.next().unwrap_or("").split(' ').collect();
        let malformed = |record: &Arc<Mutex<Record>>, what: String| {
            record.lock().unwrap().errors.push(what);
        };
        if request_line.len() != 3 || request_line[2] != "HTTP/1.1" {
            malformed(
                &record,
                format!("request line {:?}", request_line.join(" ")),
            );
            return;
        }
        let mut headers = Vec::new();
        for line in lines {
            match line.split_once(':') {
                Some((name, value)) if !name.is_empty() && !name.contains([' ', '\t']) => {
                    headers.push((name.to_owned(), value.trim().to_owned()))
                }
                _ => {
                    malformed(&record, format!("field line {line:?}"));
                    return;
                }
            }
        }
        let target = request_line[1].to_owned();
        record.lock().unwrap().heads.push(target.clone());
        let body = match origin_body(&mut stream, &mut pending, &headers).await {
            Ok(body) => body,
            Err(Stop::Ended) => return,
            Err(Stop::Malformed(what)) => {
                malformed(&record, format!("{target}: {what}"));
                return;
            }
        };
        record.lock().unwrap().requests.push(Recorded {
            method: request_line[0].to_owned(),
            target: target.clone(),
            headers,
            body,
        });
        let mut answer: String = target.chars().take(100).collect();
        if answer.len() < target.len() {
            answer = "long".into();
        }
        let reply = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{answer}",
            answer.len()
        );
        if stream.write_all(reply.as_bytes()).await.is_err() {
            return;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The client side of a case
// ---------------------------------------------------------------------------------------------

/// One answer as the client read it.
struct Answer {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Answer {
    /// `error.code` of a named JSON error answer.
    fn error_code(&self) -> Option<String> {
        let value: Value = serde_json::from_slice(&self.body).ok()?;
        value["error"]["code"].as_str().map(str::to_owned)
    }

    fn describe(&self) -> String {
        format!(
            "{:?} {}",
            self.head.split("\r\n").next().unwrap_or(""),
            short(&self.body)
        )
    }
}

struct Client {
    stream: TcpStream,
    pending: Vec<u8>,
    /// The gateway reset the connection (rather than closing it).
    reset: bool,
}

impl Client {
    async fn connect(addr: SocketAddr) -> Client {
        let stream = TcpStream::connect(addr).await.expect("the proxy accepts");
        let _ = stream.set_nodelay(true);
        Client {
            stream,
            pending: Vec::new(),
            reset: false,
        }
    }

    /// Reads more; `Ok(false)` at the end of the connection.
    async fn fill(&mut self, until: Instant) -> Result<bool, String> {
        let mut chunk = vec![0u8; 64 * 1024];
        match tokio::time::timeout_at(until, self.stream.read(&mut chunk)).await {
            Err(_) => Err("timed out waiting for the gateway".into()),
            Ok(Ok(0)) => Ok(false),
            Ok(Ok(n)) => {
                self.pending.extend_from_slice(&chunk[..n]);
                Ok(true)
            }
            Ok(Err(_)) => {
                self.reset = true;
                Ok(false)
            }
        }
    }

    async fn line(&mut self, until: Instant) -> Result<Vec<u8>, String> {
        loop {
            if let Some(end) = find(&self.pending, b"\r\n") {
                let line = self.pending[..end].to_vec();
                self.pending.drain(..end + 2);
                return Ok(line);
            }
            if !self.fill(until).await? {
                return Err("connection closed inside a chunked answer".into());
            }
        }
    }

    async fn exactly(&mut self, n: usize, until: Instant) -> Result<Vec<u8>, String> {
        while self.pending.len() < n {
            if !self.fill(until).await? {
                return Err(format!(
                    "connection closed after {} of {n} body bytes",
                    self.pending.len()
                ));
            }
        }
        Ok(self.pending.drain(..n).collect())
    }

    /// The next answer; `Ok(None)` when the gateway closed the connection first.
    async fn answer(&mut self, until: Instant) -> Result<Option<Answer>, String> {
        let end = loop {
            if let Some(end) = find(&self.pending, b"\r\n\r\n") {
                break end;
            }
            if !self.fill(until).await? {
                if self.pending.is_empty() {
                    return Ok(None);
                }
                return Err(format!(
                    "connection closed inside an answer head: {}",
                    escape(&self.pending)
                ));
            }
        };
        let head = String::from_utf8_lossy(&self.pending[..end]).into_owned();
        self.pending.drain(..end + 4);
        let status: u16 = head
            .split(' ')
            .nth(1)
            .and_then(|code| code.parse().ok())
            .ok_or_else(|| format!("not an HTTP answer: {head:?}"))?;
        let length = head_values(&head, "content-length").first().cloned();
        let chunked = head_values(&head, "transfer-encoding")
            .iter()
            .any(|value| value.eq_ignore_ascii_case("chunked"));
        let body = if (100..200).contains(&status) || status == 204 || status == 304 {
            Vec::new()
        } else if let Some(length) = length {
            let length: usize = length
                .parse()
                .map_err(|_| format!("answer Content-Length {length:?}"))?;
            self.exactly(length, until).await?
        } else if chunked {
            let mut body = Vec::new();
            loop {
                let line = self.line(until).await?;
                let text = String::from_utf8_lossy(&line).into_owned();
                let size = usize::from_str_radix(text.split(';').next().unwrap_or(""), 16)
                    .map_err(|_| format!("answer chunk-size {text:?}"))?;
                if size == 0 {
                    while !self.line(until).await?.is_empty() {}
                    break body;
                }
                body.extend(self.exactly(size + 2, until).await?.drain(..size));
            }
        } else {
            while self.fill(until).await? {}
            std::mem::take(&mut self.pending)
        };
        Ok(Some(Answer { status, head, body }))
    }
}

/// At most 80 bytes of `bytes`, escaped, and how many there were in all when more.
fn short(bytes: &[u8]) -> String {
    if bytes.len() <= 80 {
        escape(bytes)
    } else {
        format!("{}… ({} bytes)", escape(&bytes[..80]), bytes.len())
    }
}

/// Bytes as readable text: printable ASCII as is, the rest escaped.
fn escape(bytes: &[u8]) -> String {
    let mut text = String::new();
    for &byte in bytes {
        match byte {
            b'\r' => text.push_str("\\r"),
            b'\n' => text.push_str("\\n"),
            b'\t' => text.push_str("\\t"),
            b'\\' => text.push_str("\\\\"),
            0x20..=0x7e => text.push(byte as char),
            _ => {
                let _ = write!(text, "\\x{byte:02x}");
            }
        }
    }
    text
}

// ---------------------------------------------------------------------------------------------
// Rows
// ---------------------------------------------------------------------------------------------

enum Step {
    Write(Vec<u8>),
    /// Read a `100 Continue` before going on.
    AwaitContinue,
    /// End the client's writes (the gateway sees the end of the connection).
    HalfClose,
}

/// An answer the client must read.
struct Expected {
    status: u16,
    /// `error.code` of the JSON error body, where Raahi names one.
    code: Option<&'static str>,
    /// The exact body (the origin answers with the request target).
    body: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Close {
    /// The gateway must close the connection after its answers.
    Must,
    /// The connection must stay usable: a further request on it is answered.
    MustNot,
    /// Either is acceptable.
    Either,
}

/// What a request must look like at the target.
struct Req {
    method: &'static str,
    target: String,
    body: Vec<u8>,
}

fn req(method: &'static str, target: &str, body: &[u8]) -> Req {
    Req {
        method,
        target: target.to_owned(),
        body: body.to_vec(),
    }
}

enum Reaches {
    /// Not even a request head.
    Nothing,
    /// Perhaps a head, but no request is ever complete.
    NoCompleteRequest,
    /// Exactly these, in order, and nothing else.
    Exactly(Vec<Req>),
}

type Check = fn(&[Recorded]) -> Result<(), String>;

struct Row {
    name: &'static str,
    steps: Vec<Step>,
    answers: Vec<Expected>,
    close: Close,
    reaches: Reaches,
    check: Option<Check>,
    /// Behaviour being implemented on main by another engineer.
    pending: bool,
}

impl Row {
    /// A request the gateway must forward: one 200 per request, the connection stays usable.
    fn forwards(name: &'static str, bytes: impl AsRef<[u8]>, reqs: Vec<Req>) -> Row {
        Row {
            name,
            steps: vec![Step::Write(bytes.as_ref().to_vec())],
            answers: reqs
                .iter()
                .map(|r| Expected {
                    status: 200,
                    code: None,
                    body: Some(r.target.clone()),
                })
                .collect(),
            close: Close::MustNot,
            reaches: Reaches::Exactly(reqs),
            check: None,
            pending: false,
        }
    }

    /// A request the gateway must refuse with `status` (and `code`), closing the connection;
    /// nothing reaches the target.
    fn refuses(
        name: &'static str,
        bytes: impl AsRef<[u8]>,
        status: u16,
        code: Option<&'static str>,
    ) -> Row {
        Row {
            name,
            steps: vec![Step::Write(bytes.as_ref().to_vec())],
            answers: vec![Expected {
                status,
                code,
                body: None,
            }],
            close: Close::Must,
            reaches: Reaches::Nothing,
            check: None,
            pending: false,
        }
    }

    fn close(mut self, close: Close) -> Row {
        self.close = close;
        self
    }

    fn reaches(mut self, reaches: Reaches) -> Row {
        self.reaches = reaches;
        self
    }

    fn check(mut self, check: Check) -> Row {
        self.check = Some(check);
        self
    }

    fn steps(mut self, steps: Vec<Step>) -> Row {
        self.steps = steps;
        self
    }

    fn pending(mut self) -> Row {
        self.pending = true;
        self
    }
}

/// `POST path` with a Host and the given extra field lines, then `body` as is.
fn post(path: &str, fields: &str, body: &str) -> String {
    format!("POST {path} HTTP/1.1\r\nHost: {HOST}\r\n{fields}\r\n{body}")
}

fn get(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: {HOST}\r\n\r\n")
}

fn chunked(path: &str, coding_line: &str) -> String {
    post(
        path,
        &format!("{coding_line}\r\n"),
        "5\r\nhello\r\n0\r\n\r\n",
    )
}

const SMUGGLED: &str = "GET /smuggled HTTP/1.1\r\nHost: corpus.example\r\n\r\n";

fn rows() -> Vec<Row> {
    use Close::*;
    let hello = |path: &str| vec![req("POST", path, b"hello")];
    vec![
        // Baselines.
        Row::forwards("get", get("/get"), vec![req("GET", "/get", b"")]),
        Row::forwards(
            "post_content_length",
            post("/cl", "Content-Length: 5\r\n", "hello"),
            hello("/cl"),
        ),
        Row::forwards(
            "post_chunked",
            post(
                "/chunked",
                "Transfer-Encoding: chunked\r\n",
                "5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
            ),
            vec![req("POST", "/chunked", b"hello world")],
        ),
        Row::forwards(
            "post_content_length_zero",
            post("/cl0", "Content-Length: 0\r\n", ""),
            vec![req("POST", "/cl0", b"")],
        ),
        // Content-Length and Transfer-Encoding together (RFC 9112 §6.3: DESIGN.md §6 refuses).
        Row::refuses(
            "cl_then_te",
            post(
                "/clte",
                "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
                "0\r\n\r\n",
            ),
            400,
            None,
        ),
        Row::refuses(
            "te_then_cl",
            post(
                "/tecl",
                "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
                "0\r\n\r\n",
            ),
            400,
            None,
        ),
        Row::refuses(
            "cl_te_smuggle",
            post(
                "/clte-smuggle",
                &format!(
                    "Content-Length: {}\r\nTransfer-Encoding: chunked\r\n",
                    5 + SMUGGLED.len()
                ),
                &format!("0\r\n\r\n{SMUGGLED}"),
            ),
            400,
            None,
        ),
        Row::refuses(
            "te_cl_smuggle",
            post(
                "/tecl-smuggle",
                "Transfer-Encoding: chunked\r\nContent-Length: 4\r\n",
                &format!("{:x}\r\n{SMUGGLED}\r\n0\r\n\r\n", SMUGGLED.len()),
            ),
            400,
            None,
        ),
        // Obfuscated Transfer-Encoding.
        Row::refuses(
            "te_xchunked",
            chunked("/xchunked", "Transfer-Encoding: xchunked"),
            400,
            None,
        ),
        Row::forwards(
            "te_value_leading_space",
            chunked("/te-lead", "Transfer-Encoding:  chunked"),
            hello("/te-lead"),
        ),
        Row::forwards(
            "te_value_trailing_space",
            chunked("/te-trail", "Transfer-Encoding: chunked "),
            hello("/te-trail"),
        ),
        Row::forwards(
            "te_value_tab",
            chunked("/te-tab", "Transfer-Encoding:\tchunked"),
            hello("/te-tab"),
        ),
        Row::forwards(
            "te_upper_case",
            chunked("/te-upper", "Transfer-Encoding: CHUNKED"),
            hello("/te-upper"),
        ),
        Row::refuses(
            "te_space_before_colon",
            chunked("/te-colon", "Transfer-Encoding : chunked"),
            400,
            None,
        ),
        Row::refuses(
            "te_vertical_tab",
            chunked("/te-vt", "Transfer-Encoding:\x0bchunked"),
            400,
            None,
        ),
        Row::refuses(
            "te_line_leading_space",
            format!(
                "POST /te-line HTTP/1.1\r\n Transfer-Encoding: chunked\r\nHost: {HOST}\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
            ),
            400,
            None,
        ),
        Row::refuses(
            "te_chunked_not_last",
            chunked("/te-notlast", "Transfer-Encoding: chunked, gzip"),
            400,
            None,
        ),
        Row::refuses(
            "te_on_http_1_0",
            format!(
                "POST /te10 HTTP/1.0\r\nHost: {HOST}\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
            ),
            400,
            None,
        ),
        // Chunk sizes and chunk framing.
        Row::forwards(
            "chunk_extension",
            post(
                "/ext",
                "Transfer-Encoding: chunked\r\n",
                "5;ext=1\r\nhello\r\n0\r\n\r\n",
            ),
            hello("/ext"),
        ),
        Row::forwards(
            "chunked_with_trailers",
            post(
                "/trailers",
                "Transfer-Encoding: chunked\r\n",
                "5\r\nhello\r\n0\r\nX-Checksum: 1\r\n\r\n",
            ),
            hello("/trailers"),
        ),
        body_error(
            "chunk_size_negative",
            post(
                "/neg",
                "Transfer-Encoding: chunked\r\n",
                "-5\r\nhello\r\n0\r\n\r\n",
            ),
        ),
        body_error(
            "chunk_size_overflow",
            post(
                "/overflow",
                "Transfer-Encoding: chunked\r\n",
                "ffffffffffffffffff\r\nhello\r\n0\r\n\r\n",
            ),
        ),
        body_error(
            "chunk_size_0x_prefix",
            post(
                "/0x",
                "Transfer-Encoding: chunked\r\n",
                "0x5\r\nhello\r\n0\r\n\r\n",
            ),
        ),
        body_error(
            "chunk_data_without_crlf",
            post(
                "/nocrlf",
                "Transfer-Encoding: chunked\r\n",
                "5\r\nhelloXX0\r\n\r\n",
            ),
        ),
        body_error(
            "chunk_data_shorter_than_size",
            post(
                "/short",
                "Transfer-Encoding: chunked\r\n",
                "5\r\nhel\r\n0\r\n\r\n",
            ),
        ),
        body_error(
            "chunk_lines_lf_only",
            post(
                "/lfchunks",
                "Transfer-Encoding: chunked\r\n",
                "5\nhello\n0\n\n",
            ),
        ),
        // Content-Length.
        Row::forwards(
            "cl_duplicate_equal",
            post("/cl-dup", "Content-Length: 5\r\nContent-Length: 5\r\n", "hello"),
            hello("/cl-dup"),
        ),
        Row::refuses(
            "cl_duplicate_differing",
            post("/cl-diff", "Content-Length: 5\r\nContent-Length: 6\r\n", "hello!"),
            400,
            None,
        ),
        Row::refuses(
            "cl_plus_sign",
            post("/cl-plus", "Content-Length: +5\r\n", "hello"),
            400,
            None,
        ),
        Row::refuses(
            "cl_list",
            post("/cl-list", "Content-Length: 5, 5\r\n", "hello"),
            400,
            None,
        ),
        Row::refuses(
            "cl_hex",
            post("/cl-hex", "Content-Length: 0x5\r\n", "hello"),
            400,
            None,
        ),
        Row::refuses(
            "cl_non_numeric",
            post("/cl-abc", "Content-Length: five\r\n", "hello"),
            400,
            None,
        ),
        Row::refuses(
            "cl_negative",
            post("/cl-neg", "Content-Length: -5\r\n", "hello"),
            400,
            None,
        ),
        Row::refuses(
            "cl_overflow",
            post(
                "/cl-big",
                "Content-Length: 99999999999999999999999\r\n",
                "hello",
            ),
            400,
            None,
        ),
        Row::refuses(
            "cl_empty",
            post("/cl-empty", "Content-Length: \r\n", "hello"),
            400,
            None,
        ),
        // Field and line syntax.
        Row::refuses(
            "obs_fold_space",
            post("/fold", "X-A: a\r\n b\r\nContent-Length: 5\r\n", "hello"),
            400,
            None,
        ),
        Row::refuses(
            "obs_fold_tab",
            post("/fold-tab", "X-A: a\r\n\tb\r\nContent-Length: 5\r\n", "hello"),
            400,
            None,
        ),
        Row::refuses(
            "obs_fold_content_length",
            post("/fold-cl", "Content-Length:\r\n 5\r\n", "hello"),
            400,
            None,
        ),
        Row::forwards(
            "bare_lf_line_endings",
            format!("GET /lf HTTP/1.1\nHost: {HOST}\n\n"),
            vec![req("GET", "/lf", b"")],
        ),
        Row::refuses(
            "bare_cr_in_field_value",
            post("/cr", "X-A: a\rb\r\nContent-Length: 5\r\n", "hello"),
            400,
            None,
        ),
        Row::refuses(
            "bare_cr_line_endings",
            format!("GET /cr-lines HTTP/1.1\rHost: {HOST}\r\r"),
            400,
            None,
        ),
        Row::refuses(
            "nul_in_field_value",
            post("/nul", "X-A: a\0b\r\nContent-Length: 5\r\n", "hello"),
            400,
            None,
        ),
        Row::refuses(
            "field_name_with_space",
            post("/name-space", "X Foo: bar\r\nContent-Length: 5\r\n", "hello"),
            400,
            None,
        ),
        Row::refuses(
            "field_line_without_colon",
            post("/no-colon", "X-Foo\r\nContent-Length: 5\r\n", "hello"),
            400,
            None,
        ),
        Row::refuses(
            "field_name_empty",
            post("/empty-name", ": value\r\nContent-Length: 5\r\n", "hello"),
            400,
            None,
        ),
        Row::refuses(
            "request_line_extra_spaces",
            format!("GET  /spaces  HTTP/1.1\r\nHost: {HOST}\r\n\r\n"),
            400,
            None,
        ),
        Row::refuses(
            "request_line_trailing_space",
            format!("GET /trailing HTTP/1.1 \r\nHost: {HOST}\r\n\r\n"),
            400,
            None,
        ),
        Row::refuses(
            "method_with_invalid_character",
            format!("G(T /method HTTP/1.1\r\nHost: {HOST}\r\n\r\n"),
            400,
            None,
        ),
        Row::refuses(
            "version_lower_case",
            format!("GET /version http/1.1\r\nHost: {HOST}\r\n\r\n"),
            400,
            None,
        ),
        Row::refuses("http_0_9", "GET /\r\n\r\n", 400, None),
        Row::forwards(
            "leading_empty_line",
            format!("\r\nGET /leading HTTP/1.1\r\nHost: {HOST}\r\n\r\n"),
            vec![req("GET", "/leading", b"")],
        ),
        // HTTP/1.0.
        Row::forwards(
            "http_1_0_without_keep_alive",
            format!("GET /ten HTTP/1.0\r\nHost: {HOST}\r\n\r\n"),
            vec![req("GET", "/ten", b"")],
        )
        .close(Must),
        Row::forwards(
            "http_1_0_keep_alive",
            format!("GET /ten-ka HTTP/1.0\r\nHost: {HOST}\r\nConnection: keep-alive\r\n\r\n"),
            vec![req("GET", "/ten-ka", b"")],
        ),
        // Request targets.
        Row::forwards(
            "absolute_form_authority_wins",
            format!("GET http://a.example/p HTTP/1.1\r\nHost: {HOST}\r\n\r\n"),
            vec![req("GET", "/p", b"")],
        )
        .check(|seen| {
            let forwarded = seen[0].values("x-forwarded-host");
            if forwarded == ["a.example"] {
                Ok(())
            } else {
                Err(format!("x-forwarded-host {forwarded:?}, not the authority a.example"))
            }
        }),
        // Pipelining and bodies that look like requests.
        Row::forwards(
            "pipeline_two",
            format!("{}{}", get("/p1"), get("/p2")),
            vec![req("GET", "/p1", b""), req("GET", "/p2", b"")],
        ),
        Row::forwards(
            "pipeline_three",
            format!(
                "{}{}{}",
                get("/q1"),
                post("/q2", "Content-Length: 5\r\n", "hello"),
                post("/q3", "Transfer-Encoding: chunked\r\n", "3\r\nabc\r\n0\r\n\r\n"),
            ),
            vec![
                req("GET", "/q1", b""),
                req("POST", "/q2", b"hello"),
                req("POST", "/q3", b"abc"),
            ],
        ),
        Row::forwards(
            "request_inside_body",
            post(
                "/outer",
                &format!("Content-Length: {}\r\n", SMUGGLED.len()),
                SMUGGLED,
            ),
            vec![req("POST", "/outer", SMUGGLED.as_bytes())],
        ),
        Row::forwards(
            "request_inside_chunked_body",
            post(
                "/outer-chunked",
                "Transfer-Encoding: chunked\r\n",
                &format!("{:x}\r\n{SMUGGLED}\r\n0\r\n\r\n", SMUGGLED.len()),
            ),
            vec![req("POST", "/outer-chunked", SMUGGLED.as_bytes())],
        ),
        Row::forwards(
            "expect_100_continue",
            "",
            vec![req("POST", "/expect", b"hello")],
        )
        .steps(vec![
            Step::Write(
                post(
                    "/expect",
                    "Content-Length: 5\r\nExpect: 100-continue\r\n",
                    "",
                )
                .into_bytes(),
            ),
            Step::AwaitContinue,
            Step::Write(b"hello".to_vec()),
        ]),
        // The client goes away inside the body.
        Row {
            name: "closed_mid_body_content_length",
            steps: vec![
                Step::Write(post("/mid", "Content-Length: 100\r\n", "only part").into_bytes()),
                Step::HalfClose,
            ],
            answers: vec![Expected {
                status: 400,
                code: Some("client_body_failed"),
                body: None,
            }],
            close: Must,
            reaches: Reaches::NoCompleteRequest,
            check: None,
            pending: false,
        },
        Row {
            name: "closed_mid_body_chunked",
            steps: vec![
                Step::Write(
                    post(
                        "/mid-chunked",
                        "Transfer-Encoding: chunked\r\n",
                        "5\r\nhello\r\n",
                    )
                    .into_bytes(),
                ),
                Step::HalfClose,
            ],
            answers: vec![Expected {
                status: 400,
                code: Some("client_body_failed"),
                body: None,
            }],
            close: Must,
            reaches: Reaches::NoCompleteRequest,
            check: None,
            pending: false,
        },
        // The field-count limit (on the list being implemented on main; hyper enforces it
        // already).
        Row::refuses(
            "more_than_100_fields",
            format!(
                "GET /many HTTP/1.1\r\nHost: {HOST}\r\n{}\r\n",
                (0..101).map(|i| format!("X-F{i}: v\r\n")).collect::<String>()
            ),
            431,
            None,
        )
        .close(Either)
        .pending(),
        // Host (being implemented on main).
        Row::refuses(
            "host_missing",
            "GET /no-host HTTP/1.1\r\n\r\n",
            400,
            Some("invalid_host"),
        )
        .pending(),
        Row::forwards(
            "host_missing_http_1_0",
            "GET /no-host-10 HTTP/1.0\r\n\r\n",
            vec![req("GET", "/no-host-10", b"")],
        )
        .close(Must)
        .pending(),
        Row::refuses(
            "host_twice",
            "GET /two-hosts HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\n\r\n",
            400,
            Some("invalid_host"),
        )
        .pending(),
        Row::refuses(
            "host_empty",
            "GET /empty-host HTTP/1.1\r\nHost:\r\n\r\n",
            400,
            Some("invalid_host"),
        )
        .pending(),
        Row::refuses(
            "host_with_space",
            "GET /host-space HTTP/1.1\r\nHost: a b\r\n\r\n",
            400,
            None,
        )
        .close(Either)
        .pending(),
        Row::refuses(
            "host_with_path",
            "GET /host-path HTTP/1.1\r\nHost: evil.example/x\r\n\r\n",
            400,
            None,
        )
        .close(Either)
        .pending(),
        Row::refuses(
            "host_with_userinfo",
            "GET /host-user HTTP/1.1\r\nHost: user@evil.example\r\n\r\n",
            400,
            None,
        )
        .close(Either)
        .pending(),
        Row::refuses(
            "absolute_form_with_userinfo",
            format!("GET http://user:pw@evil.example/ HTTP/1.1\r\nHost: {HOST}\r\n\r\n"),
            400,
            Some("invalid_host"),
        )
        .close(Either)
        .pending(),
        // Transfer codings other than chunked (being implemented on main).
        Row::refuses(
            "te_gzip_chunked",
            chunked("/gzip", "Transfer-Encoding: gzip, chunked"),
            501,
            Some("unsupported_transfer_coding"),
        )
        .pending(),
        Row::refuses(
            "te_identity_chunked",
            chunked("/identity", "Transfer-Encoding: identity, chunked"),
            501,
            Some("unsupported_transfer_coding"),
        )
        .pending(),
        Row::refuses(
            "te_two_lines_gzip_then_chunked",
            chunked(
                "/gzip-lines",
                "Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked",
            ),
            501,
            Some("unsupported_transfer_coding"),
        )
        .pending(),
        Row::forwards(
            "get_with_chunked_body",
            format!(
                "GET /search HTTP/1.1\r\nHost: {HOST}\r\nTransfer-Encoding: chunked\r\n\r\n7\r\n{{\"q\":1}}\r\n0\r\n\r\n"
            ),
            vec![req("GET", "/search", b"{\"q\":1}")],
        )
        .pending(),
        Row::forwards(
            "upgrade_h2c_is_not_switched",
            format!(
                "GET /h2c HTTP/1.1\r\nHost: {HOST}\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"
            ),
            vec![req("GET", "/h2c", b"")],
        )
        .check(|seen| {
            let request = &seen[0];
            for name in ["upgrade", "http2-settings"] {
                if !request.values(name).is_empty() {
                    return Err(format!("the target got {name}: {:?}", request.values(name)));
                }
            }
            Ok(())
        })
        .pending(),
        // Size limits (being implemented on main).
        Row::refuses(
            "request_target_over_8192",
            format!("GET /{} HTTP/1.1\r\nHost: {HOST}\r\n\r\n", "a".repeat(8200)),
            414,
            Some("uri_too_long"),
        )
        .close(Either)
        .pending(),
        Row::refuses(
            "fields_over_64_kib",
            format!(
                "GET /big-fields HTTP/1.1\r\nHost: {HOST}\r\n{}\r\n",
                (0..20)
                    .map(|i| format!("X-Big{i}: {}\r\n", "v".repeat(4000)))
                    .collect::<String>()
            ),
            431,
            None,
        )
        .close(Either)
        .pending(),
        Row::forwards(
            "limited_route_small_body",
            "POST /small HTTP/1.1\r\nHost: limited.example\r\nContent-Length: 5\r\n\r\nhello",
            hello("/small"),
        ),
        Row::refuses(
            "limited_route_content_length_over",
            format!(
                "POST /limited HTTP/1.1\r\nHost: limited.example\r\nContent-Length: 5000\r\n\r\n{}",
                "x".repeat(5000)
            ),
            413,
            Some("request_body_too_large"),
        )
        .close(Either)
        .pending(),
        Row::refuses(
            "limited_route_chunked_over",
            format!(
                "POST /limited-chunked HTTP/1.1\r\nHost: limited.example\r\nTransfer-Encoding: chunked\r\n\r\n{}0\r\n\r\n",
                format!("3e8\r\n{}\r\n", "x".repeat(1000)).repeat(5)
            ),
            413,
            Some("request_body_too_large"),
        )
        .close(Either)
        .reaches(Reaches::NoCompleteRequest)
        .pending(),
    ]
}

/// A request whose head is fine but whose chunked body is broken: the gateway answers 400
/// (the body could not be read), closes, and no complete request reaches the target.
fn body_error(name: &'static str, bytes: String) -> Row {
    Row::refuses(name, bytes, 400, Some("client_body_failed")).reaches(Reaches::NoCompleteRequest)
}

/// Runs one row; every problem seen, or nothing when it passed.
async fn run_row(proxy: SocketAddr, origin: &RecordingOrigin, row: &Row) -> Vec<String> {
    let mut problems = Vec::new();
    let mark = origin.mark();
    let mut client = Client::connect(proxy).await;
    let until = Instant::now() + STEP;
    let mut sending = true;
    for step in &row.steps {
        if !sending {
            break;
        }
        match step {
            Step::Write(bytes) => {
                if let Err(error) = client.stream.write_all(bytes).await {
                    problems.push(format!("(note) write failed: {error}"));
                    sending = false;
                }
            }
            Step::AwaitContinue => match client.answer(until).await {
                Ok(Some(answer)) if answer.status == 100 => {}
                Ok(Some(answer)) => {
                    problems.push(format!("expected 100 Continue, got {}", answer.describe()));
                    sending = false;
                }
                Ok(None) => {
                    problems.push("expected 100 Continue, the connection closed".into());
                    sending = false;
                }
                Err(error) => {
                    problems.push(format!("expected 100 Continue: {error}"));
                    sending = false;
                }
            },
            Step::HalfClose => {
                let _ = client.stream.shutdown().await;
            }
        }
    }
    // The answers, in order.
    let mut broken = false;
    for (i, expected) in row.answers.iter().enumerate() {
        match client.answer(until).await {
            Ok(Some(answer)) => {
                let mut wrong = Vec::new();
                if answer.status != expected.status {
                    wrong.push(format!(
                        "status {} (expected {})",
                        answer.status, expected.status
                    ));
                }
                if let Some(code) = expected.code {
                    let got = answer.error_code();
                    if got.as_deref() != Some(code) {
                        wrong.push(format!("error.code {got:?} (expected {code:?})"));
                    }
                }
                if let Some(body) = &expected.body {
                    if answer.body != body.as_bytes() {
                        wrong.push(format!(
                            "body {:?} (expected {body:?})",
                            escape(&answer.body)
                        ));
                    }
                }
                if !wrong.is_empty() {
                    problems.push(format!(
                        "answer {}: {} — got {}",
                        i + 1,
                        wrong.join(", "),
                        answer.describe()
                    ));
                }
            }
            Ok(None) => {
                problems.push(format!(
                    "answer {}: none, the connection closed{} (expected {})",
                    i + 1,
                    if client.reset { " (reset)" } else { "" },
                    expected.status
                ));
                broken = true;
                break;
            }
            Err(error) => {
                problems.push(format!("answer {}: {error}", i + 1));
                broken = true;
                break;
            }
        }
    }
    // Then the connection: closed, or still usable (and holding no extra answer).
    if !broken {
        match row.close {
            Close::Must => match client.answer(until).await {
                Ok(None) => {}
                Ok(Some(extra)) => {
                    problems.push(format!("an extra answer: {}", extra.describe()));
                }
                Err(error) => problems.push(format!("connection not closed: {error}")),
            },
            Close::MustNot => {
                let alive = get(ALIVE);
                if let Err(error) = client.stream.write_all(alive.as_bytes()).await {
                    problems.push(format!("connection not usable: write failed: {error}"));
                } else {
                    match client.answer(until).await {
                        Ok(Some(answer))
                            if answer.status == 200 && answer.body == ALIVE.as_bytes() => {}
                        Ok(Some(answer)) => problems.push(format!(
                            "connection not usable: the next answer was {} (an extra answer?)",
                            answer.describe()
                        )),
                        Ok(None) => {
                            problems.push("the connection closed (expected it to stay open)".into())
                        }
                        Err(error) => problems.push(format!("connection not usable: {error}")),
                    }
                }
            }
            Close::Either => {}
        }
    }
    drop(client);
    // What reached the origin: wait for what must arrive, then watch for anything more.
    if let Reaches::Exactly(reqs) = &row.reaches {
        let end = Instant::now() + STEP;
        while origin.since(mark).requests.len() < reqs.len() && Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let quiet_end = Instant::now() + QUIET;
    let seen = loop {
        let seen = origin.since(mark);
        let too_much = match &row.reaches {
            Reaches::Nothing => !seen.heads.is_empty(),
            Reaches::NoCompleteRequest => !seen.requests.is_empty(),
            Reaches::Exactly(reqs) => seen.heads.len() > reqs.len(),
        };
        if too_much || Instant::now() >= quiet_end {
            break seen;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let describe = |seen: &Since| {
        let heads: Vec<String> = seen.heads.iter().map(|t| short(t.as_bytes())).collect();
        let requests: Vec<String> = seen
            .requests
            .iter()
            .map(|r| {
                format!(
                    "{} {} body {}",
                    r.method,
                    short(r.target.as_bytes()),
                    short(&r.body)
                )
            })
            .collect();
        format!("heads {heads:?}, complete requests {requests:?}")
    };
    match &row.reaches {
        Reaches::Nothing => {
            if !seen.heads.is_empty() {
                problems.push(format!(
                    "the target must get nothing, got {}",
                    describe(&seen)
                ));
            }
        }
        Reaches::NoCompleteRequest => {
            if !seen.requests.is_empty() {
                problems.push(format!(
                    "the target must get no complete request, got {}",
                    describe(&seen)
                ));
            }
        }
        Reaches::Exactly(reqs) => {
            let matches = seen.heads.len() == reqs.len()
                && seen.requests.len() == reqs.len()
                && reqs.iter().zip(&seen.requests).all(|(want, got)| {
                    want.method == got.method && want.target == got.target && want.body == got.body
                });
            if !matches {
                let wanted: Vec<String> = reqs
                    .iter()
                    .map(|r| format!("{} {} body {:?}", r.method, r.target, escape(&r.body)))
                    .collect();
                problems.push(format!(
                    "the target must get exactly {wanted:?}, got {}",
                    describe(&seen)
                ));
            } else if let Some(check) = row.check {
                if let Err(error) = check(&seen.requests) {
                    problems.push(error);
                }
            }
        }
    }
    if !seen.errors.is_empty() {
        problems.push(format!("the origin got malformed bytes: {:?}", seen.errors));
    }
    // A failed write is only a note when nothing else went wrong.
    if problems.iter().all(|p| p.starts_with("(note)")) {
        problems.clear();
    }
    problems
}

/// A gateway whose catch-all route sends everything to a recording origin, and whose route
/// for `limited.example` (same service) caps request bodies at 1000 bytes. The second value
/// says why that route could not be created, if it could not.
async fn corpus_gateway() -> (TestGateway, RecordingOrigin, Option<String>) {
    let gateway = TestGateway::start().await;
    let origin = RecordingOrigin::start().await;
    let service = gateway
        .create(
            "/api/v1/services",
            json!({"name": "corpus", "protocol": "http"}),
        )
        .await;
    gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            origin.target(),
        )
        .await;
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/routes",
            Some(json!({
                "name": "limited",
                "hosts": ["limited.example"],
                "service_id": service,
                "max_request_body_bytes": 1000,
            })),
        )
        .await;
    let limited = (status != 201).then(|| format!("POST /api/v1/routes: {status} {body}"));
    gateway.route_all_to(service).await;
    // The catch-all is live once a request through it reaches the origin (the limited route,
    // created before it, is then live too).
    wait_until("the catch-all route serves", WAIT_FOR_GATEWAY, || async {
        gateway.fetch_status(ALIVE).await.0 == 200
    })
    .await;
    (gateway, origin, limited)
}

#[tokio::test]
async fn http1_framing_and_smuggling_table() {
    let (gateway, origin, limited) = corpus_gateway().await;
    let rows = rows();
    assert!(rows.len() >= 60, "the corpus has {} rows", rows.len());
    let mut failures = Vec::new();
    for row in &rows {
        let problems = run_row(gateway.proxy, &origin, row).await;
        if !problems.is_empty() {
            let tag = if row.pending {
                " [being implemented on main]"
            } else {
                ""
            };
            let sent: Vec<u8> = row
                .steps
                .iter()
                .filter_map(|step| match step {
                    Step::Write(bytes) => Some(bytes.as_slice()),
                    _ => None,
                })
                .flatten()
                .copied()
                .collect();
            failures.push(format!(
                "{}{tag}:\n    {}\n    sent: {}",
                row.name,
                problems.join("\n    "),
                short(&sent)
            ));
        }
    }
    if let Some(why) = limited {
        failures.push(format!(
            "(the limited.example route could not be created: {why})"
        ));
    }
    assert!(
        failures.is_empty(),
        "{} of {} rows failed:\n{}",
        failures.len(),
        rows.len(),
        failures.join("\n")
    );
}
