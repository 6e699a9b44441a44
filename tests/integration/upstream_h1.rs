//! The HTTP/1.1 client for plain `http` targets (`src/proxy/h1client.rs`, `src/proxy/pool.rs`)
//! through real sockets. Every origin here is a raw TCP server writing exact bytes, so each test
//! controls the wire: framing, fragmentation, informational answers, early answers, upgrades and
//! broken responses, and whether the upstream connection is reused afterwards.

use crate::common;
use common::*;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Notify;

/// How long any single step may take before the test fails.
const STEP: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// Origins
// ---------------------------------------------------------------------------------------------

/// One request as an origin read it off the wire.
#[derive(Debug, Clone, Default)]
struct WireRequest {
    /// Request line and fields, without the empty line.
    head: String,
    /// The body as framed on the wire (chunk-size lines and the last chunk included).
    wire_body: Vec<u8>,
    /// The body's content.
    body: Vec<u8>,
}

impl WireRequest {
    fn request_line(&self) -> &str {
        self.head.split("\r\n").next().unwrap_or("")
    }

    fn method(&self) -> &str {
        self.request_line().split(' ').next().unwrap_or("")
    }

    fn path(&self) -> &str {
        self.request_line().split(' ').nth(1).unwrap_or("")
    }

    fn header(&self, name: &str) -> Vec<String> {
        head_values(&self.head, name)
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

/// Reads more bytes into `pending`; false at the end of the connection.
async fn fill<R: AsyncRead + Unpin>(stream: &mut R, pending: &mut Vec<u8>) -> bool {
    let mut chunk = vec![0u8; 64 * 1024];
    match stream.read(&mut chunk).await {
        Ok(0) | Err(_) => false,
        Ok(n) => {
            pending.extend_from_slice(&chunk[..n]);
            true
        }
    }
}

/// Reads one request head; `None` when the connection ends first.
async fn read_request_head<R: AsyncRead + Unpin>(
    stream: &mut R,
    pending: &mut Vec<u8>,
) -> Option<WireRequest> {
    loop {
        if let Some(end) = find(pending, b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&pending[..end]).into_owned();
            pending.drain(..end + 4);
            return Some(WireRequest {
                head,
                ..WireRequest::default()
            });
        }
        if !fill(stream, pending).await {
            return None;
        }
    }
}

/// One line, CRLF included.
async fn take_line<R: AsyncRead + Unpin>(stream: &mut R, pending: &mut Vec<u8>) -> Option<Vec<u8>> {
    loop {
        if let Some(end) = find(pending, b"\r\n") {
            return Some(pending.drain(..end + 2).collect());
        }
        if !fill(stream, pending).await {
            return None;
        }
    }
}

/// Reads the body of `request` by its framing: chunked, Content-Length, or none.
async fn read_request_body<R: AsyncRead + Unpin>(
    stream: &mut R,
    pending: &mut Vec<u8>,
    request: &mut WireRequest,
) -> Option<()> {
    let chunked = request
        .header("transfer-encoding")
        .iter()
        .any(|value| value.eq_ignore_ascii_case("chunked"));
    if chunked {
        loop {
            let line = take_line(stream, pending).await?;
            request.wire_body.extend_from_slice(&line);
            let text = String::from_utf8_lossy(&line[..line.len() - 2]).into_owned();
            let digits = text.split(';').next().unwrap_or("").trim();
            let size = usize::from_str_radix(digits, 16)
                .unwrap_or_else(|_| panic!("bad chunk-size line from the gateway: {text:?}"));
            if size == 0 {
                loop {
                    let line = take_line(stream, pending).await?;
                    request.wire_body.extend_from_slice(&line);
                    if line == b"\r\n" {
                        return Some(());
                    }
                }
            }
            while pending.len() < size + 2 {
                if !fill(stream, pending).await {
                    return None;
                }
            }
            assert_eq!(&pending[size..size + 2], b"\r\n", "chunk data without CRLF");
            request.body.extend_from_slice(&pending[..size]);
            request.wire_body.extend(pending.drain(..size + 2));
        }
    }
    if let Some(length) = request.header("content-length").first() {
        let length: usize = length.parse().expect("numeric content-length");
        while pending.len() < length {
            if !fill(stream, pending).await {
                return None;
            }
        }
        request.body = pending.drain(..length).collect();
        request.wire_body = request.body.clone();
    }
    Some(())
}

/// What a scripted origin writes for one request.
struct Answer {
    bytes: Vec<u8>,
    /// Written 1, 2 and 3 bytes at a time in turn, yielding to the gateway between writes.
    trickle: bool,
    /// Close the connection once written.
    close: bool,
    /// When closing: first wait for this (the test's go-ahead).
    close_when: Option<Arc<Notify>>,
}

/// Written in one go; the connection stays open for the next request.
fn answer(bytes: impl AsRef<[u8]>) -> Answer {
    Answer {
        bytes: bytes.as_ref().to_vec(),
        trickle: false,
        close: false,
        close_when: None,
    }
}

/// Written in one go, then the origin closes the connection.
fn answer_and_close(bytes: impl AsRef<[u8]>) -> Answer {
    Answer {
        close: true,
        ..answer(bytes)
    }
}

/// Written in one go, then the origin closes the connection once `go` is notified.
fn answer_then_close_on(bytes: impl AsRef<[u8]>, go: &Arc<Notify>) -> Answer {
    Answer {
        close_when: Some(go.clone()),
        ..answer_and_close(bytes)
    }
}

/// Written in tiny pieces; the connection stays open.
fn trickled(bytes: impl AsRef<[u8]>) -> Answer {
    Answer {
        trickle: true,
        ..answer(bytes)
    }
}

async fn write_answer(stream: &mut TcpStream, reply: &Answer) -> std::io::Result<()> {
    if !reply.trickle {
        return stream.write_all(&reply.bytes).await;
    }
    let mut rest = &reply.bytes[..];
    for size in [1usize, 2, 3].into_iter().cycle() {
        if rest.is_empty() {
            break;
        }
        let (piece, tail) = rest.split_at(size.min(rest.len()));
        stream.write_all(piece).await?;
        // Lets the gateway's task read what has arrived so far (on the test's single-threaded
        // runtime it runs before this task resumes), so it parses the answer in pieces.
        tokio::task::yield_now().await;
        rest = tail;
    }
    Ok(())
}

/// A raw origin that reads each request (head, then body by its framing) and answers what
/// `script` says.
struct Origin {
    addr: SocketAddr,
    accepted: Arc<AtomicU64>,
    /// Connections the gateway ended while the origin waited for their next request.
    ended_by_gateway: Arc<AtomicU64>,
    requests: Arc<Mutex<Vec<WireRequest>>>,
}

impl Origin {
    async fn start<F>(script: F) -> Origin
    where
        F: Fn(&WireRequest) -> Answer + Send + Sync + 'static,
    {
        let script = Arc::new(script);
        let requests = Arc::new(Mutex::new(Vec::new()));
        let ended_by_gateway = Arc::new(AtomicU64::new(0));
        let (seen, ended) = (requests.clone(), ended_by_gateway.clone());
        let (addr, accepted) = counting_origin(move |mut stream| {
            let (script, seen, ended) = (script.clone(), seen.clone(), ended.clone());
            async move {
                let _ = stream.set_nodelay(true);
                let mut pending = Vec::new();
                loop {
                    let Some(mut request) = read_request_head(&mut stream, &mut pending).await
                    else {
                        if pending.is_empty() {
                            ended.fetch_add(1, Ordering::SeqCst);
                        }
                        return;
                    };
                    if read_request_body(&mut stream, &mut pending, &mut request)
                        .await
                        .is_none()
                    {
                        return;
                    }
                    let reply = script(&request);
                    seen.lock().unwrap().push(request);
                    if write_answer(&mut stream, &reply).await.is_err() {
                        return;
                    }
                    if reply.close {
                        if let Some(go) = &reply.close_when {
                            go.notified().await;
                        }
                        return;
                    }
                }
            }
        })
        .await;
        Origin {
            addr,
            accepted,
            ended_by_gateway,
            requests,
        }
    }

    fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }

    fn requests(&self) -> Vec<WireRequest> {
        self.requests.lock().unwrap().clone()
    }

    fn last_request(&self) -> WireRequest {
        self.requests()
            .last()
            .cloned()
            .expect("the origin saw a request")
    }
}

/// `HTTP/1.1 200 OK` with a Content-Length body.
fn ok(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

// ---------------------------------------------------------------------------------------------
// Gateway and client side
// ---------------------------------------------------------------------------------------------

/// A gateway whose route `all` sends every request to the one plain target at `address`.
/// Passive ejection is off, so a test's deliberate failures do not change later picks.
async fn gateway_to_address(name: &str, address: SocketAddr) -> TestGateway {
    gateway_to_target(json!({"name": name, "ejection": false}), address).await
}

/// A gateway whose route `all` sends every request to a service created from `service` (its
/// JSON) with the one target at `address`.
async fn gateway_to_target(service: serde_json::Value, address: SocketAddr) -> TestGateway {
    let gateway = TestGateway::start().await;
    let service = gateway.create("/api/v1/services", service).await;
    gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            json!({"host": address.ip().to_string(), "port": address.port(), "weight": 1}),
        )
        .await;
    // Bodies stream, so the codec's upload (framing, early answers, stalls) is what is tested.
    gateway.route_all_streaming_to(service).await;
    gateway
}

/// Sends a request through the gateway; returns status, headers and the whole body.
async fn call(request: reqwest::RequestBuilder) -> (u16, reqwest::header::HeaderMap, Bytes) {
    let response = tokio::time::timeout(STEP, request.send())
        .await
        .expect("response head within the step")
        .expect("the gateway answers");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = tokio::time::timeout(STEP, response.bytes())
        .await
        .expect("response body within the step")
        .expect("a whole response body");
    (status, headers, body)
}

/// A GET through the gateway; returns status, headers and the body as text.
async fn get(gateway: &TestGateway, path: &str) -> (u16, reqwest::header::HeaderMap, String) {
    let (status, headers, body) = call(gateway.http.get(gateway.proxy_url(path))).await;
    (status, headers, String::from_utf8_lossy(&body).into_owned())
}

/// A GET that must answer `200` with `expected` as its body.
async fn get_ok(gateway: &TestGateway, path: &str, expected: &str) {
    let (status, _, body) = get(gateway, path).await;
    assert_eq!(status, 200, "GET {path}: {body}");
    assert_eq!(body, expected, "GET {path}");
}

/// A JSON error answer from the gateway: `(status, error.code, whole body)`.
async fn error_answer(gateway: &TestGateway, path: &str) -> (u16, String, String) {
    let (status, headers, body) = get(gateway, path).await;
    let content_type = headers
        .get("content-type")
        .and_then(|value| value.to_str().ok())
        .unwrap_or("");
    let code = json_error(status, content_type, &body).code;
    (status, code, body)
}

/// Reads until the peer closes (or resets) the connection; panics if it stays open.
async fn read_until_closed<R: AsyncRead + Unpin>(stream: &mut R, mut already: Vec<u8>) -> Vec<u8> {
    tokio::time::timeout(STEP, async { while fill(stream, &mut already).await {} })
        .await
        .expect("the gateway closes the connection");
    already
}

// ---------------------------------------------------------------------------------------------
// Response framing and connection reuse
// ---------------------------------------------------------------------------------------------

/// A chunked answer with chunk extensions, bad-looking but legal whitespace and a trailer
/// section, written 1 to 3 bytes at a time (head included), arrives whole; its connection then
/// carries the next request.
#[tokio::test]
async fn a_trickled_chunked_response_with_extensions_arrives_whole_and_reuses_its_connection() {
    let big: String = (0..300)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    let chunked = format!(
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Origin: tiny\r\n\r\n\
         5;name=value\r\nhello\r\n\
         1;a=1;b=\"x y\"\r\n \r\n\
         1A ; ext\r\nabcdefghijklmnopqrstuvwxyz\r\n\
         12c\r\n{big}\r\n\
         0;last=yes\r\nX-Sum: 42\r\n\r\n"
    );
    let origin = Origin::start(move |request| match request.path() {
        "/chunked" => trickled(&chunked),
        _ => answer(ok("second")),
    })
    .await;
    let gateway = gateway_to_address("tiny", origin.addr).await;

    let (status, headers, body) = get(&gateway, "/chunked").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(headers["x-origin"], "tiny");
    assert_eq!(body, format!("hello abcdefghijklmnopqrstuvwxyz{big}"));

    get_ok(&gateway, "/second", "second").await;
    assert_eq!(origin.requests().len(), 2);
    assert_eq!(
        origin.accepted(),
        1,
        "the connection of a whole chunked answer is reused"
    );
}

/// A body without Content-Length or Transfer-Encoding runs to the end of the connection: it
/// arrives whole, and the next request needs a new connection.
#[tokio::test]
async fn a_close_delimited_response_arrives_whole_and_its_connection_is_not_reused() {
    let long: String = (0..100_000)
        .map(|i| char::from(b'0' + (i % 10) as u8))
        .collect();
    let expected = long.clone();
    let origin = Origin::start(move |request| match request.path() {
        "/until-close" => {
            answer_and_close(format!("HTTP/1.1 200 OK\r\nX-Framing: none\r\n\r\n{long}"))
        }
        _ => answer(ok("next")),
    })
    .await;
    let gateway = gateway_to_address("close-delimited", origin.addr).await;

    let (status, headers, body) = get(&gateway, "/until-close").await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-framing"], "none");
    assert_eq!(body.len(), expected.len());
    assert!(
        body == expected,
        "the close-delimited body changed on the way"
    );

    get_ok(&gateway, "/next", "next").await;
    assert_eq!(
        origin.accepted(),
        2,
        "a close-delimited answer uses up its connection"
    );
}

/// `Connection: close` in an answer with a Content-Length ends its connection even though the
/// origin leaves it open: the next request goes on a new one, and the gateway closes the old.
#[tokio::test]
async fn connection_close_in_a_response_is_honoured() {
    let origin = Origin::start(|request| {
        let body = format!("answer to {}", request.path());
        answer(format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ))
    })
    .await;
    let gateway = gateway_to_address("conn-close", origin.addr).await;

    get_ok(&gateway, "/one", "answer to /one").await;
    get_ok(&gateway, "/two", "answer to /two").await;
    assert_eq!(
        origin.accepted(),
        2,
        "each answer said Connection: close; the origin kept both open"
    );
    wait_until(
        "the gateway closes the connections it will not reuse",
        STEP,
        || async { origin.ended_by_gateway.load(Ordering::SeqCst) == 2 },
    )
    .await;
}

/// An HTTP/1.0 answer (keep-alive is not the default there) is not reused either.
#[tokio::test]
async fn an_http10_response_is_not_reused() {
    let origin =
        Origin::start(|_| answer(b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nold")).await;
    let gateway = gateway_to_address("http10", origin.addr).await;

    get_ok(&gateway, "/a", "old").await;
    get_ok(&gateway, "/b", "old").await;
    assert_eq!(origin.accepted(), 2);
}

/// Informational answers (`100 Continue`, `103 Early Hints` with fields) before the real one
/// are skipped: the client gets the final answer, without the 1xx fields, and the connection
/// is reused.
#[tokio::test]
async fn informational_responses_before_the_final_one_are_skipped() {
    let origin = Origin::start(|request| match request.path() {
        "/continue" => trickled(
            b"HTTP/1.1 100 Continue\r\n\r\n\
              HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n\
              HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Final: yes\r\n\r\nfinal",
        ),
        _ => answer(ok("after")),
    })
    .await;
    let gateway = gateway_to_address("continue", origin.addr).await;

    let (status, headers, body) = get(&gateway, "/continue").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, "final");
    assert_eq!(headers["x-final"], "yes");
    assert!(
        headers.get("link").is_none(),
        "a 1xx answer's fields leaked into the final answer: {headers:?}"
    );
    get_ok(&gateway, "/after", "after").await;
    assert_eq!(origin.accepted(), 1);
}

/// An answer to HEAD has no body whatever its Content-Length says: the next request's answer
/// on the same connection is not taken for it.
#[tokio::test]
async fn a_head_response_has_no_body_and_keeps_the_connection() {
    let origin = Origin::start(|request| match request.method() {
        "HEAD" => answer(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\nX-Head: yes\r\n\r\n"),
        _ => answer(ok("get")),
    })
    .await;
    let gateway = gateway_to_address("head", origin.addr).await;

    for _ in 0..2 {
        let (status, headers, body) = call(gateway.http.head(gateway.proxy_url("/h"))).await;
        assert_eq!(status, 200);
        assert_eq!(headers["x-head"], "yes");
        assert_eq!(
            headers["content-length"], "1000",
            "a HEAD answer keeps the length the GET would have"
        );
        assert!(body.is_empty());
        get_ok(&gateway, "/g", "get").await;
    }
    let methods: Vec<String> = origin
        .requests()
        .iter()
        .map(|request| request.method().to_owned())
        .collect();
    assert_eq!(methods, ["HEAD", "GET", "HEAD", "GET"]);
    assert_eq!(origin.accepted(), 1);
}

/// 204 and 304 answers have no body (a 304's Content-Length describes the representation) and
/// leave the connection reusable.
#[tokio::test]
async fn no_content_and_not_modified_keep_the_connection() {
    let origin = Origin::start(|request| match request.path() {
        "/204" => answer(b"HTTP/1.1 204 No Content\r\nX-Kind: empty\r\n\r\n"),
        "/304" => {
            answer(b"HTTP/1.1 304 Not Modified\r\nETag: \"v1\"\r\nContent-Length: 50\r\n\r\n")
        }
        _ => answer(ok("full")),
    })
    .await;
    let gateway = gateway_to_address("bodiless", origin.addr).await;

    for _ in 0..2 {
        let (status, headers, body) = get(&gateway, "/204").await;
        assert_eq!(status, 204);
        assert_eq!(headers["x-kind"], "empty");
        assert!(body.is_empty());
        let (status, headers, body) = get(&gateway, "/304").await;
        assert_eq!(status, 304);
        assert_eq!(headers["etag"], "\"v1\"");
        assert!(body.is_empty());
        get_ok(&gateway, "/200", "full").await;
    }
    assert_eq!(origin.requests().len(), 6);
    assert_eq!(origin.accepted(), 1);
}

/// Bytes beyond the end of an answer (here one stray byte after the body) make its connection
/// unfit for another exchange: the next request goes on a new connection and is not answered
/// with the stray byte.
#[tokio::test]
async fn bytes_beyond_a_response_keep_its_connection_out_of_the_pool() {
    let origin = Origin::start(|request| match request.path() {
        "/stray" => answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokX"),
        _ => answer(ok("clean")),
    })
    .await;
    let gateway = gateway_to_address("stray", origin.addr).await;

    get_ok(&gateway, "/stray", "ok").await;
    get_ok(&gateway, "/next", "clean").await;
    assert_eq!(origin.accepted(), 2);
}

/// An origin that closes a connection after answering on it, without saying so: the closed
/// connection never carries another request, so even POSTs (never retried) all succeed.
#[tokio::test]
async fn an_origin_closing_after_each_answer_costs_no_request() {
    let origin =
        Origin::start(|request| answer_and_close(ok(&format!("posted {}", request.body.len()))))
            .await;
    let gateway = gateway_to_address("closer", origin.addr).await;

    for round in 0..10 {
        let (status, _, body) = call(
            gateway
                .http
                .post(gateway.proxy_url(&format!("/post/{round}")))
                .body("x".repeat(round)),
        )
        .await;
        assert_eq!(
            status,
            200,
            "round {round}: {}",
            String::from_utf8_lossy(&body)
        );
        assert_eq!(body, format!("posted {round}"));
    }
    assert_eq!(origin.accepted(), 10);
}

/// An idle pooled connection that the origin closes later (its keep-alive timeout) is noticed
/// before the next request is written to it: a POST, never retried, still succeeds.
#[tokio::test]
async fn an_idle_connection_closed_by_the_origin_is_not_used() {
    let close_first = Arc::new(Notify::new());
    let first_closed = Arc::new(AtomicU64::new(0));
    let (go, closed) = (close_first.clone(), first_closed.clone());
    let (address, accepted) = counting_origin(move |mut stream| {
        let (go, closed) = (go.clone(), closed.clone());
        async move {
            let mut pending = Vec::new();
            let Some(mut request) = read_request_head(&mut stream, &mut pending).await else {
                return;
            };
            if read_request_body(&mut stream, &mut pending, &mut request)
                .await
                .is_none()
            {
                return;
            }
            let _ = stream.write_all(&ok(request.path())).await;
            if request.path() == "/first" {
                go.notified().await;
                drop(stream);
                closed.fetch_add(1, Ordering::SeqCst);
                return;
            }
            while fill(&mut stream, &mut pending).await {}
        }
    })
    .await;
    let gateway = gateway_to_address("idle-close", address).await;

    get_ok(&gateway, "/first", "/first").await;
    close_first.notify_one();
    wait_until("the origin closed the idle connection", STEP, || async {
        first_closed.load(Ordering::SeqCst) == 1
    })
    .await;
    let (status, _, body) =
        call(gateway.http.post(gateway.proxy_url("/second")).body("data")).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(body, "/second");
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
}

// ---------------------------------------------------------------------------------------------
// Broken responses
// ---------------------------------------------------------------------------------------------

/// What the gateway must never tell a client about a target.
fn assert_no_address(body: &str, origin: SocketAddr) {
    assert!(
        !body.contains(&origin.to_string()) && !body.contains("127.0.0.1"),
        "the error answer names the target's address: {body}"
    );
}

/// An unparseable answer is a named 502 (`upstream_invalid_response`: a response Raahi will not
/// pass on), and the client is not told the target's address.
#[tokio::test]
async fn an_invalid_response_is_a_502_without_the_target_address() {
    let origin = Origin::start(|request| match request.path() {
        "/bad-status" => answer(b"HTTP/1.1 abc OK\r\nContent-Length: 0\r\n\r\n"),
        "/garbage" => answer(b"hello, this is not HTTP\r\n\r\n"),
        "/bad-field" => answer(b"HTTP/1.1 200 OK\r\nBad Field: x\r\nContent-Length: 0\r\n\r\n"),
        _ => answer(ok("fine")),
    })
    .await;
    let gateway = gateway_to_address("invalid", origin.addr).await;

    for path in ["/bad-status", "/garbage", "/bad-field"] {
        let (status, code, body) = error_answer(&gateway, path).await;
        assert_eq!(status, 502, "{path}: {body}");
        assert_eq!(code, "upstream_invalid_response", "{path}: {body}");
        assert!(body.contains("invalid response"), "{path}: {body}");
        assert_no_address(&body, origin.addr);
    }
    get_ok(&gateway, "/fine", "fine").await;
    assert_eq!(
        origin.accepted(),
        4,
        "a connection that sent garbage is not reused"
    );
}

/// Two different Content-Length values (in two fields or one list) make the answer's length
/// unknowable: a 502, never a guess.
#[tokio::test]
async fn conflicting_content_lengths_are_a_502() {
    let origin = Origin::start(|request| match request.path() {
        "/two-fields" => {
            answer(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd")
        }
        "/one-list" => answer(b"HTTP/1.1 200 OK\r\nContent-Length: 3, 4\r\n\r\nabcd"),
        _ => answer(ok("fine")),
    })
    .await;
    let gateway = gateway_to_address("lengths", origin.addr).await;

    for path in ["/two-fields", "/one-list"] {
        let (status, code, body) = error_answer(&gateway, path).await;
        assert_eq!(status, 502, "{path}: {body}");
        assert_eq!(code, "upstream_invalid_response", "{path}: {body}");
        // The reason ("conflicting Content-Length") is the log's with brief error details:
        // the codec's unit tests pin it.
        assert_no_address(&body, origin.addr);
    }
    get_ok(&gateway, "/fine", "fine").await;
}

/// RFC 9112 §6.3: with both Transfer-Encoding: chunked and Content-Length, the chunked framing
/// decides, and an intermediary must drop the Content-Length before forwarding. The client must
/// get the whole chunked body, not one cut at the stale length.
#[tokio::test]
async fn a_content_length_beside_chunked_is_not_forwarded() {
    let origin = Origin::start(|_| {
        answer(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n\
              b\r\nhello world\r\n0\r\n\r\n",
        )
    })
    .await;
    let gateway = gateway_to_address("both-framings", origin.addr).await;

    let (status, headers, body) = get(&gateway, "/both").await;
    assert_eq!(status, 200);
    assert_eq!(
        body, "hello world",
        "the client got the body cut at the stale Content-Length (headers {headers:?})"
    );
    assert!(
        headers
            .get("content-length")
            .is_none_or(|value| value == "11"),
        "a Content-Length that contradicts the body reached the client: {headers:?}"
    );
}

/// An origin that dies in the middle of a body: the client's answer is cut (the gateway closes
/// the client connection rather than end the body cleanly), and the next request works on a
/// new upstream connection.
#[tokio::test]
async fn an_upstream_closing_mid_body_cuts_the_client_response() {
    let go_length = Arc::new(Notify::new());
    let go_chunked = Arc::new(Notify::new());
    let (length_close, chunked_close) = (go_length.clone(), go_chunked.clone());
    let origin = Origin::start(move |request| match request.path() {
        "/cut-length" => answer_then_close_on(
            b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789",
            &length_close,
        ),
        "/cut-chunked" => answer_then_close_on(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\na\r\n0123456789\r\n14\r\nonly half",
            &chunked_close,
        ),
        "/cut-at-once" => {
            answer_and_close(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
        }
        _ => answer(ok("fine")),
    })
    .await;
    let gateway = gateway_to_address("cut", origin.addr).await;

    // Content-Length: the client is promised 100 bytes; once it has the first 10, the origin
    // closes. The client gets those 10 and then the end of the connection.
    let mut client = TcpStream::connect(gateway.proxy).await.unwrap();
    client
        .write_all(b"GET /cut-length HTTP/1.1\r\nHost: cut.test\r\n\r\n")
        .await
        .unwrap();
    let (head, mut body) = read_head(&mut client).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(head_values(&head, "content-length"), ["100"], "{head}");
    while body.len() < 10 {
        let more = tokio::time::timeout(STEP, fill(&mut client, &mut body))
            .await
            .expect("the first body bytes within the step");
        assert!(more, "closed before the bytes the origin sent");
    }
    go_length.notify_one();
    let body = read_until_closed(&mut client, body).await;
    assert_eq!(
        body,
        b"0123456789",
        "a cut body must arrive cut: {:?}",
        String::from_utf8_lossy(&body)
    );

    // Chunked: the client gets the data that came, then the end of the connection, never the
    // last chunk.
    let mut client = TcpStream::connect(gateway.proxy).await.unwrap();
    client
        .write_all(b"GET /cut-chunked HTTP/1.1\r\nHost: cut.test\r\n\r\n")
        .await
        .unwrap();
    let (head, mut body) = read_head(&mut client).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(
        head_values(&head, "transfer-encoding"),
        ["chunked"],
        "{head}"
    );
    while find(&body, b"only half").is_none() {
        let more = tokio::time::timeout(STEP, fill(&mut client, &mut body))
            .await
            .expect("the first chunks within the step");
        assert!(more, "closed before the bytes the origin sent");
    }
    go_chunked.notify_one();
    let body = read_until_closed(&mut client, body).await;
    assert!(
        !body.ends_with(b"0\r\n\r\n") && find(&body, b"0123456789").is_some(),
        "a cut chunked body was ended cleanly: {:?}",
        String::from_utf8_lossy(&body)
    );

    // Head, part of the body and the end all at once: the client sees a failure (the head may
    // not even have been sent), never a clean answer.
    let outcome = tokio::time::timeout(STEP, async {
        let response = gateway
            .http
            .get(gateway.proxy_url("/cut-at-once"))
            .send()
            .await?;
        response.bytes().await
    })
    .await
    .expect("an outcome within the step");
    assert!(outcome.is_err(), "a cut body read as whole: {outcome:?}");

    get_ok(&gateway, "/fine", "fine").await;
    assert_eq!(
        origin.accepted(),
        4,
        "one connection per cut answer, one more"
    );
}

// ---------------------------------------------------------------------------------------------
// Request bodies
// ---------------------------------------------------------------------------------------------

/// The request head goes up in wire form as the client meant it: request line with its
/// query, one `Host`, the client's own fields, and nothing of the client connection's framing.
#[tokio::test]
async fn the_request_head_goes_up_intact_with_one_host() {
    let origin = Origin::start(|_| answer(ok("seen"))).await;
    let gateway = gateway_to_address("head-up", origin.addr).await;

    let (status, _, body) = call(
        gateway
            .http
            .get(gateway.proxy_url("/a/b?x=1&y=%2F&z"))
            .header("x-custom", "one")
            .header("x-custom", "two"),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let seen = origin.last_request();
    assert_eq!(seen.request_line(), "GET /a/b?x=1&y=%2F&z HTTP/1.1");
    assert_eq!(seen.header("host").len(), 1, "{}", seen.head);
    assert_eq!(seen.header("x-custom"), ["one", "two"], "{}", seen.head);
    assert!(seen.header("transfer-encoding").is_empty(), "{}", seen.head);
    assert!(seen.header("content-length").is_empty(), "{}", seen.head);
    assert!(seen.body.is_empty());
}

/// A request body of unknown length (the client sent it chunked) goes up chunked, byte for
/// byte; a body with a Content-Length goes up with that length. Both exchanges end with the
/// body sent before the answer, so they share one connection.
#[tokio::test]
async fn request_bodies_go_up_chunked_or_with_their_length() {
    use futures_util::stream;
    use http_body_util::StreamBody;
    use hyper::body::Frame;

    let origin = Origin::start(|request| answer(ok(&format!("got {}", request.body.len())))).await;
    let gateway = gateway_to_address("uploads", origin.addr).await;

    // Pieces of varied sizes, over 300 KiB in all, each with its own content.
    let pieces: Vec<Bytes> = (0..40u32)
        .map(|i| {
            let size = [1usize, 7, 100, 4096, 16_384][i as usize % 5] * (1 + i as usize % 3);
            Bytes::from(
                (0..size)
                    .map(|j| (i as usize * 31 + j) as u8)
                    .collect::<Vec<u8>>(),
            )
        })
        .collect();
    let whole: Vec<u8> = pieces
        .iter()
        .flat_map(|piece| piece.iter().copied())
        .collect();
    let frames = stream::iter(
        pieces
            .clone()
            .into_iter()
            .map(|piece| Ok::<_, Infallible>(Frame::data(piece))),
    );
    let (status, _, body) = call(
        gateway
            .http
            .post(gateway.proxy_url("/chunked-up"))
            .body(reqwest::Body::wrap(StreamBody::new(frames))),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(body, format!("got {}", whole.len()));
    let seen = origin.last_request();
    assert_eq!(seen.method(), "POST");
    assert_eq!(
        seen.header("transfer-encoding"),
        ["chunked"],
        "{}",
        seen.head
    );
    assert!(seen.header("content-length").is_empty(), "{}", seen.head);
    assert!(seen.body == whole, "the chunked body changed on the way");
    assert!(
        seen.wire_body.ends_with(b"\r\n0\r\n\r\n"),
        "the chunked body is not properly terminated"
    );

    let (status, _, body) = call(
        gateway
            .http
            .post(gateway.proxy_url("/sized-up"))
            .body(whole.clone()),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(body, format!("got {}", whole.len()));
    let seen = origin.last_request();
    assert_eq!(
        seen.header("content-length"),
        [whole.len().to_string()],
        "{}",
        seen.head
    );
    assert!(seen.header("transfer-encoding").is_empty(), "{}", seen.head);
    assert!(seen.body == whole, "the sized body changed on the way");

    assert_eq!(origin.accepted(), 1);
}

/// A POST over a raw connection declaring a 4 MiB body, of which a task sends all but the last
/// byte and then holds the connection: the upload cannot be complete when an answer comes.
/// Returns the connection's read half and the task (abort it at the end).
async fn unfinished_upload(
    gateway: &TestGateway,
    path: &str,
) -> (tokio::net::tcp::OwnedReadHalf, tokio::task::JoinHandle<()>) {
    const DECLARED: usize = 4 * 1024 * 1024;
    let client = TcpStream::connect(gateway.proxy).await.unwrap();
    let (reader, mut writer) = client.into_split();
    writer
        .write_all(
            format!(
                "POST {path} HTTP/1.1\r\nHost: upload.test\r\nContent-Length: {DECLARED}\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let uploader = tokio::spawn(async move {
        let chunk = vec![b'u'; 64 * 1024];
        let mut sent = 0;
        while sent < DECLARED - 1 {
            let n = chunk.len().min(DECLARED - 1 - sent);
            if writer.write_all(&chunk[..n]).await.is_err() {
                break;
            }
            sent += n;
        }
        std::future::pending::<()>().await;
        drop(writer);
    });
    (reader, uploader)
}

/// Reads one answer with a Content-Length body; returns its head and body.
async fn read_sized_response<R: AsyncRead + Unpin>(stream: &mut R) -> (String, Vec<u8>) {
    let (head, mut body) = read_head(stream).await;
    let length: usize = head_values(&head, "content-length")
        .first()
        .unwrap_or_else(|| panic!("a Content-Length answer: {head}"))
        .parse()
        .unwrap();
    while body.len() < length {
        let more = tokio::time::timeout(STEP, fill(stream, &mut body))
            .await
            .expect("body bytes within the step");
        assert!(more, "closed after {} of {length} body bytes", body.len());
    }
    (head, body)
}

/// The request body goes up while the answer is awaited: an origin that answers `413` after
/// the head, never reading the body, gets its answer to the client although the upload can
/// never finish. The connection, with a body half sent, is not reused.
#[tokio::test]
async fn an_early_response_reaches_the_client_while_the_upload_is_unfinished() {
    let (address, accepted) = counting_origin(|mut stream| async move {
        let mut pending = Vec::new();
        let Some(request) = read_request_head(&mut stream, &mut pending).await else {
            return;
        };
        if request.method() == "POST" {
            let _ = stream
                .write_all(b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 9\r\n\r\ntoo large")
                .await;
            // Reads nothing more, and holds the connection open for the rest of the test.
            std::future::pending::<()>().await;
        }
        let _ = stream.write_all(&ok("after")).await;
        while fill(&mut stream, &mut pending).await {}
    })
    .await;
    let gateway = gateway_to_address("early", address).await;

    let (mut reader, uploader) = unfinished_upload(&gateway, "/upload").await;

    let (head, body) = read_sized_response(&mut reader).await;
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    assert_eq!(body, b"too large");

    get_ok(&gateway, "/after", "after").await;
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        2,
        "a connection whose request body was cut short is not reused"
    );
    uploader.abort();
}

/// After an early answer the rest of the request body goes up on a task of its own. That task
/// ends with the answer: once the client has the whole response, the gateway lets go of the
/// upstream connection (the origin sees it closed) even while the client's upload stays
/// stalled, half sent. Without that, one stalled client pins one upstream socket for as long
/// as it likes.
#[tokio::test]
async fn an_early_answer_ends_the_upload_and_frees_the_upstream_connection() {
    let closed = Arc::new(Notify::new());
    let seen_closed = closed.clone();
    let (address, _) = counting_origin(move |mut stream| {
        let closed = seen_closed.clone();
        async move {
            let mut pending = Vec::new();
            if read_request_head(&mut stream, &mut pending).await.is_none() {
                return;
            }
            let _ = stream.write_all(&ok("early")).await;
            // Drains whatever body bytes come, until the gateway closes its side.
            while fill(&mut stream, &mut pending).await {
                pending.clear();
            }
            closed.notify_one();
        }
    })
    .await;
    let gateway = gateway_to_address("early-end", address).await;

    let client = TcpStream::connect(gateway.proxy).await.unwrap();
    let (mut reader, mut writer) = client.into_split();
    writer
        .write_all(
            b"POST /stalled HTTP/1.1\r\nHost: upload.test\r\nContent-Length: 1000000\r\n\r\nfirst bytes",
        )
        .await
        .unwrap();
    let (head, body) = read_sized_response(&mut reader).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(body, b"early");
    // The client keeps its connection and its unfinished upload open.
    tokio::time::timeout(STEP, closed.notified())
        .await
        .expect("the gateway closed its upstream connection once the answer was over");
    drop(writer);
}

/// An origin that answers early and then closes at once with request body bytes unread (its
/// kernel then resets the connection, as simple servers do). The answer reached the gateway's
/// socket before the reset and stays readable there; the failure of the body still going up
/// must not throw it away.
#[tokio::test]
async fn an_early_response_followed_by_a_reset_still_reaches_the_client() {
    let (address, accepted) = counting_origin(|mut stream| async move {
        let mut pending = Vec::new();
        let Some(request) = read_request_head(&mut stream, &mut pending).await else {
            return;
        };
        if request.method() == "POST" {
            // Waits for body bytes to sit unread in the socket, so closing sends a reset.
            let _ = stream.peek(&mut [0u8; 1]).await;
            let _ = stream
                .write_all(b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 9\r\nConnection: close\r\n\r\ntoo large")
                .await;
            return;
        }
        let _ = stream.write_all(&ok("after")).await;
        while fill(&mut stream, &mut pending).await {}
    })
    .await;
    let gateway = gateway_to_address("early-reset", address).await;

    let (mut reader, uploader) = unfinished_upload(&gateway, "/upload").await;
    let (head, body) = read_sized_response(&mut reader).await;
    assert!(
        head.starts_with("HTTP/1.1 413"),
        "the origin's answer was lost: {head}{}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(body, b"too large");

    get_ok(&gateway, "/after", "after").await;
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    uploader.abort();
}

// ---------------------------------------------------------------------------------------------
// Upgrades
// ---------------------------------------------------------------------------------------------

/// An origin that switches protocols and, in the same write as its 101 head, sends the first
/// bytes of the new protocol: the client gets them right after the 101 head, then bytes go both
/// ways, and a half-close travels through.
#[tokio::test]
async fn an_upgrade_keeps_the_bytes_sent_with_the_101_head() {
    const GREETING: &[u8] = b"greeting from the origin\n";
    let upgrade_head = Arc::new(Mutex::new(None::<String>));
    let seen = upgrade_head.clone();
    let (address, accepted) = counting_origin(move |mut stream| {
        let seen = seen.clone();
        async move {
            let mut pending = Vec::new();
            let Some(request) = read_request_head(&mut stream, &mut pending).await else {
                return;
            };
            *seen.lock().unwrap() = Some(request.head.clone());
            let mut switch =
                b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
                    .to_vec();
            switch.extend_from_slice(GREETING);
            if stream.write_all(&switch).await.is_err() {
                return;
            }
            // Echo: anything read beyond the head first, then the rest until end of stream.
            if stream.write_all(&pending).await.is_err() {
                return;
            }
            let (mut read, mut write) = stream.split();
            let _ = tokio::io::copy(&mut read, &mut write).await;
        }
    })
    .await;
    let gateway = gateway_to_address("upgrade", address).await;

    let mut client = TcpStream::connect(gateway.proxy).await.unwrap();
    client
        .write_all(
            b"GET /ws HTTP/1.1\r\nHost: ws.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
        )
        .await
        .unwrap();
    let (head, mut early) = read_head(&mut client).await;
    assert!(head.starts_with("HTTP/1.1 101"), "upgrade answer: {head}");
    assert_eq!(head_values(&head, "upgrade"), ["websocket"], "{head}");
    while early.len() < GREETING.len() {
        let more = tokio::time::timeout(STEP, fill(&mut client, &mut early))
            .await
            .expect("the greeting within the step");
        assert!(more, "closed before the greeting: {early:?}");
    }
    assert_eq!(
        early,
        GREETING,
        "the bytes after the 101 head: {:?}",
        String::from_utf8_lossy(&early)
    );
    let origin_saw = upgrade_head
        .lock()
        .unwrap()
        .clone()
        .expect("origin saw the request");
    assert!(
        head_values(&origin_saw, "upgrade") == ["websocket"]
            && head_values(&origin_saw, "connection")
                .iter()
                .any(|value| value.eq_ignore_ascii_case("upgrade")),
        "the upgrade request lost its fields: {origin_saw}"
    );

    for message in [&b"ping-123"[..], &b"a second, longer message"[..]] {
        client.write_all(message).await.unwrap();
        let mut echoed = vec![0u8; message.len()];
        tokio::time::timeout(STEP, client.read_exact(&mut echoed))
            .await
            .expect("echo within the step")
            .expect("echo read");
        assert_eq!(echoed, message);
    }

    client.shutdown().await.unwrap();
    let rest = read_until_closed(&mut client, Vec::new()).await;
    assert!(rest.is_empty(), "unexpected bytes after close: {rest:?}");
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

/// The sum of a metric's series (every label set) as `/metrics` shows it now.
async fn metric_sum(gateway: &TestGateway, name: &str) -> u64 {
    let text = gateway.metrics_text().await;
    text.lines()
        .filter(|line| line.starts_with(name) && line[name.len()..].starts_with(['{', ' ']))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// `clients` HTTP/1.1 client connections, each with one request to the gateway in flight.
async fn requests_in_flight(gateway: &TestGateway, clients: usize) -> Vec<TcpStream> {
    let mut streams = Vec::new();
    for _ in 0..clients {
        let mut stream = TcpStream::connect(gateway.proxy).await.unwrap();
        stream
            .write_all(b"GET /wave HTTP/1.1\r\nHost: waves.test\r\n\r\n")
            .await
            .unwrap();
        streams.push(stream);
    }
    streams
}

#[tokio::test]
async fn clients_that_leave_mid_request_cost_the_target_no_connections() {
    const CLIENTS: usize = 4;
    // The origin holds its answers while the gate is shut, so each wave's requests are in
    // flight together and need a connection each.
    let (gate, gate_seen) = tokio::sync::watch::channel(false);
    let heads = Arc::new(AtomicU64::new(0));
    let counted = heads.clone();
    let (address, accepted) = counting_origin(move |mut stream| {
        let (mut gate, heads) = (gate_seen.clone(), counted.clone());
        async move {
            let mut pending = Vec::new();
            while read_request_head(&mut stream, &mut pending).await.is_some() {
                heads.fetch_add(1, Ordering::SeqCst);
                if gate.wait_for(|open| *open).await.is_err()
                    || stream.write_all(&ok("ok")).await.is_err()
                {
                    return;
                }
            }
        }
    })
    .await;
    let gateway = gateway_to_address("waves", address).await;
    let heads_reach = |count: u64| {
        let heads = heads.clone();
        async move {
            wait_until(&format!("{count} requests at the origin"), STEP, || {
                let heads = heads.clone();
                async move { heads.load(Ordering::SeqCst) >= count }
            })
            .await
        }
    };
    let all_answered = || async {
        wait_until("no request in flight at the target", STEP, || async {
            metric_sum(&gateway, "raahi_target_in_flight_requests").await == 0
        })
        .await
    };

    // First wave: answered, its connections go to the pool.
    let mut clients = requests_in_flight(&gateway, CLIENTS).await;
    heads_reach(CLIENTS as u64).await;
    gate.send_replace(true);
    for client in &mut clients {
        let (head, _) = read_head(client).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    }
    all_answered().await;
    assert_eq!(accepted.load(Ordering::SeqCst), CLIENTS as u64);
    drop(clients);

    // Second wave: the clients close their connections while their requests are upstream, as
    // a load generator stopping does.
    gate.send_replace(false);
    let clients = requests_in_flight(&gateway, CLIENTS).await;
    heads_reach(2 * CLIENTS as u64).await;
    drop(clients);
    wait_until("the gateway saw its clients leave", STEP, || async {
        gateway.metric("raahi_client_connections").await == 0
    })
    .await;
    gate.send_replace(true);
    all_answered().await;

    // Third wave: the first wave's connections serve it; none is opened.
    gate.send_replace(false);
    let mut clients = requests_in_flight(&gateway, CLIENTS).await;
    heads_reach(3 * CLIENTS as u64).await;
    gate.send_replace(true);
    for client in &mut clients {
        let (head, _) = read_head(client).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        CLIENTS as u64,
        "the connections of the requests whose clients left were closed, not pooled"
    );
}

// ---------------------------------------------------------------------------------------------
// Exchanges Raahi gives up itself are cut; only a departed client's finish on their own
// ---------------------------------------------------------------------------------------------

/// Well under the 10 s an exchange left to finish on its own may take: an exchange Raahi gave
/// up must be gone (connection closed, counts released) within this.
const CUT: Duration = Duration::from_secs(4);

/// An origin that reads what it is sent and never answers, counting request heads and the
/// connections the gateway closed.
struct MuteOrigin {
    address: SocketAddr,
    heads: Arc<AtomicU64>,
    closed: Arc<AtomicU64>,
}

impl MuteOrigin {
    async fn start() -> MuteOrigin {
        let heads = Arc::new(AtomicU64::new(0));
        let closed = Arc::new(AtomicU64::new(0));
        let (seen, ended) = (heads.clone(), closed.clone());
        let (address, _) = counting_origin(move |mut stream| {
            let (seen, ended) = (seen.clone(), ended.clone());
            async move {
                let mut pending = Vec::new();
                if read_request_head(&mut stream, &mut pending).await.is_some() {
                    seen.fetch_add(1, Ordering::SeqCst);
                }
                while fill(&mut stream, &mut pending).await {
                    pending.clear();
                }
                ended.fetch_add(1, Ordering::SeqCst);
            }
        })
        .await;
        MuteOrigin {
            address,
            heads,
            closed,
        }
    }

    async fn wait_for_heads(&self, count: u64) {
        let heads = self.heads.clone();
        wait_until(
            &format!("{count} request heads at the origin"),
            STEP,
            || {
                let heads = heads.clone();
                async move { heads.load(Ordering::SeqCst) >= count }
            },
        )
        .await
    }

    /// The gateway closes the origin's connection within [`CUT`].
    async fn sees_its_connection_closed(&self) {
        let closed = self.closed.clone();
        wait_until("the origin saw its connection closed at once", CUT, || {
            let closed = closed.clone();
            async move { closed.load(Ordering::SeqCst) == 1 }
        })
        .await
    }
}

/// A gateway like [`gateway_to_address`] whose service has one attempt per request and these
/// timeouts.
async fn gateway_with_timeouts(address: SocketAddr, timeouts: serde_json::Value) -> TestGateway {
    let gateway = TestGateway::start().await;
    let service = gateway
        .create(
            "/api/v1/services",
            json!({"name": "cut", "ejection": false, "max_attempts": 1, "timeouts": timeouts}),
        )
        .await;
    gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            json!({"host": address.ip().to_string(), "port": address.port(), "weight": 1}),
        )
        .await;
    gateway.route_all_streaming_to(service).await;
    gateway
}

/// hyper's client, over HTTP/1.1 or HTTP/2 with prior knowledge.
fn hyper_client<B>(
    http2: bool,
) -> hyper_util::client::legacy::Client<hyper_util::client::legacy::connect::HttpConnector, B>
where
    B: http_body::Body + Send + 'static + Unpin,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(http2)
        .build_http()
}

#[tokio::test]
async fn an_answer_too_late_closes_its_upstream_connection_and_frees_the_target_at_once() {
    for http2 in [false, true] {
        let origin = MuteOrigin::start().await;
        let gateway =
            gateway_with_timeouts(origin.address, json!({"response_header_ms": 300})).await;
        let client = hyper_client::<http_body_util::Empty<Bytes>>(http2);
        let request = hyper::Request::get(gateway.proxy_url("/late"))
            .body(http_body_util::Empty::new())
            .unwrap();
        let response = tokio::time::timeout(STEP, client.request(request))
            .await
            .expect("answered within the step")
            .expect("a response");
        assert_eq!(response.status(), 504, "http2: {http2}");
        // Left to finish on its own, the exchange would still count at its target.
        assert_eq!(
            metric_sum(&gateway, "raahi_target_in_flight_requests").await,
            0,
            "http2: {http2}"
        );
        origin.sees_its_connection_closed().await;
    }
}

/// A body of `first` bytes that then stops moving without ending.
fn stalling_body(
    first: &'static [u8],
) -> http_body_util::StreamBody<
    impl tokio_stream::Stream<Item = Result<hyper::body::Frame<Bytes>, Infallible>> + Unpin,
> {
    use tokio_stream::StreamExt;
    let frames = tokio_stream::once(Ok(hyper::body::Frame::data(Bytes::from_static(first))))
        .chain(tokio_stream::pending());
    http_body_util::StreamBody::new(frames)
}

#[tokio::test]
async fn an_upload_that_stalls_closes_its_upstream_connection_and_frees_the_target_at_once() {
    for http2 in [false, true] {
        let origin = MuteOrigin::start().await;
        let gateway =
            gateway_with_timeouts(origin.address, json!({"response_header_ms": 300})).await;
        let client = hyper_client(http2);
        let request = hyper::Request::post(gateway.proxy_url("/upload"))
            .body(stalling_body(b"0123456789"))
            .unwrap();
        // The client keeps its request open: only Raahi's stall rule ends the exchange.
        let response = tokio::time::timeout(STEP, client.request(request))
            .await
            .expect("answered within the step")
            .expect("a response");
        assert_eq!(response.status(), 408, "http2: {http2}");
        origin.wait_for_heads(1).await;
        assert_eq!(
            metric_sum(&gateway, "raahi_target_in_flight_requests").await,
            0,
            "http2: {http2}"
        );
        origin.sees_its_connection_closed().await;
        drop(response);
    }
}

/// A TLS acceptor speaking HTTP/1.1 only (ALPN `http/1.1`), with a self-signed certificate.
fn http1_tls_acceptor() -> tokio_rustls::TlsAcceptor {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
    let certified = rcgen::generate_simple_self_signed(vec!["tls-target.test".to_owned()])
        .expect("a self-signed certificate");
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(
        certified.signing_key.serialize_der(),
    ));
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("TLS versions")
    .with_no_client_auth()
    .with_single_cert(vec![certified.cert.der().clone()], key)
    .expect("a server certificate");
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

/// A gateway sending every request to the origin at `address` as an `https` target (its
/// certificate unverified), one attempt each, without ejection.
async fn https_gateway_to(address: SocketAddr) -> TestGateway {
    let service = json!({"name": "tls", "protocol": "https", "tls_verify": false,
                         "ejection": false, "max_attempts": 1});
    gateway_to_target(service, address).await
}

/// The TLS side of a connection an origin accepted. While `stall` is set the handshake waits
/// for `handshakes` to open, and the connection is counted in `stalled`. None when the test
/// ended first or the handshake failed.
async fn tls_accept_unless_stalled(
    acceptor: &tokio_rustls::TlsAcceptor,
    stream: TcpStream,
    stall: &std::sync::atomic::AtomicBool,
    stalled: &AtomicU64,
    handshakes: &mut tokio::sync::watch::Receiver<bool>,
) -> Option<tokio_rustls::server::TlsStream<TcpStream>> {
    if stall.load(Ordering::SeqCst) {
        stalled.fetch_add(1, Ordering::SeqCst);
        handshakes.wait_for(|open| *open).await.ok()?;
    }
    acceptor.accept(stream).await.ok()
}

#[tokio::test]
async fn an_https_request_whose_client_left_before_it_was_written_is_never_sent() {
    // Connections accepted while `stall` is set wait for `handshakes` before their TLS
    // handshake; `/hold` is answered once `held` opens. Request heads are noted by path.
    let stall = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stalled = Arc::new(AtomicU64::new(0));
    let (handshakes, handshakes_seen) = tokio::sync::watch::channel(false);
    let (held, held_seen) = tokio::sync::watch::channel(false);
    let paths = Arc::new(Mutex::new(Vec::<String>::new()));
    let acceptor = http1_tls_acceptor();
    let (address, _) = {
        let (stall, stalled, paths) = (stall.clone(), stalled.clone(), paths.clone());
        counting_origin(move |stream| {
            let (acceptor, stall, stalled, paths) = (
                acceptor.clone(),
                stall.clone(),
                stalled.clone(),
                paths.clone(),
            );
            let (mut handshakes, mut held) = (handshakes_seen.clone(), held_seen.clone());
            async move {
                let Some(mut stream) =
                    tls_accept_unless_stalled(&acceptor, stream, &stall, &stalled, &mut handshakes)
                        .await
                else {
                    return;
                };
                let mut pending = Vec::new();
                while let Some(request) = read_request_head(&mut stream, &mut pending).await {
                    let path = request.path().to_owned();
                    paths.lock().unwrap().push(path.clone());
                    if path == "/hold" && held.wait_for(|open| *open).await.is_err() {
                        return;
                    }
                    if stream.write_all(&ok("ok")).await.is_err() {
                        return;
                    }
                }
            }
        })
        .await
    };
    let gateway = https_gateway_to(address).await;
    let seen = |path: &'static str| {
        let paths = paths.clone();
        move || {
            paths
                .lock()
                .unwrap()
                .iter()
                .filter(|seen| *seen == path)
                .count()
        }
    };

    // The target is learnt to speak HTTP/1.1: its requests go on hyper's client from now on.
    get_ok(&gateway, "/first", "ok").await;
    // `/hold` keeps the one pooled connection busy, so the next request needs a new one.
    let holding = {
        let url = gateway.proxy_url("/hold");
        tokio::spawn(async move { reqwest::get(url).await.map(|response| response.status()) })
    };
    let held_count = seen("/hold");
    wait_until("/hold at the origin", STEP, || async { held_count() == 1 }).await;
    let connected = gateway.metric("raahi_client_connections").await;

    // `/gone`'s connection hangs in its TLS handshake; its client leaves meanwhile.
    stall.store(true, Ordering::SeqCst);
    let mut client = TcpStream::connect(gateway.proxy).await.unwrap();
    client
        .write_all(b"GET /gone HTTP/1.1\r\nHost: tls.test\r\n\r\n")
        .await
        .unwrap();
    wait_until("the gateway dials for /gone", STEP, || async {
        stalled.load(Ordering::SeqCst) == 1
    })
    .await;
    drop(client);
    wait_until("the gateway saw /gone's client leave", STEP, || async {
        gateway.metric("raahi_client_connections").await == connected
    })
    .await;

    // The handshake may go on now: the request it was dialled for must not follow.
    handshakes.send_replace(true);
    let gone_count = seen("/gone");
    holds_for("no /gone at the origin", Duration::from_secs(1), || async {
        gone_count() == 0
    })
    .await;

    held.send_replace(true);
    let status = tokio::time::timeout(STEP, holding).await.unwrap().unwrap();
    assert_eq!(status.unwrap(), 200);
}

/// An `https` origin speaking HTTP/1.1 that hands the connection which answered `/first` to
/// the test, to be closed while the gateway keeps it idle in its pool. Connections accepted
/// while `stall` is set wait for `handshakes` before their TLS handshake. Requests are noted,
/// also those that reach the handed connection after the test closed its side.
struct ClosingTlsOrigin {
    address: SocketAddr,
    stall: Arc<std::sync::atomic::AtomicBool>,
    stalled: Arc<AtomicU64>,
    handshakes: tokio::sync::watch::Sender<bool>,
    answered_first:
        tokio::sync::mpsc::UnboundedReceiver<tokio_rustls::server::TlsStream<TcpStream>>,
    requests: Arc<Mutex<Vec<WireRequest>>>,
}

impl ClosingTlsOrigin {
    async fn start() -> ClosingTlsOrigin {
        let stall = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stalled = Arc::new(AtomicU64::new(0));
        let (handshakes, handshakes_seen) = tokio::sync::watch::channel(false);
        let (handover, answered_first) = tokio::sync::mpsc::unbounded_channel();
        let requests = Arc::new(Mutex::new(Vec::<WireRequest>::new()));
        let acceptor = http1_tls_acceptor();
        let (address, _) = {
            let (stall, stalled, requests) = (stall.clone(), stalled.clone(), requests.clone());
            counting_origin(move |stream| {
                let (acceptor, stall, stalled, requests, handover) = (
                    acceptor.clone(),
                    stall.clone(),
                    stalled.clone(),
                    requests.clone(),
                    handover.clone(),
                );
                let mut handshakes = handshakes_seen.clone();
                async move {
                    let Some(mut stream) = tls_accept_unless_stalled(
                        &acceptor,
                        stream,
                        &stall,
                        &stalled,
                        &mut handshakes,
                    )
                    .await
                    else {
                        return;
                    };
                    let mut pending = Vec::new();
                    while let Some(mut request) = read_request_head(&mut stream, &mut pending).await
                    {
                        if read_request_body(&mut stream, &mut pending, &mut request)
                            .await
                            .is_none()
                        {
                            return;
                        }
                        let path = request.path().to_owned();
                        requests.lock().unwrap().push(request);
                        if stream.write_all(&ok(&path)).await.is_err()
                            || stream.flush().await.is_err()
                        {
                            return;
                        }
                        if path == "/first" {
                            let _ = handover.send(stream);
                            return;
                        }
                    }
                }
            })
            .await
        };
        ClosingTlsOrigin {
            address,
            stall,
            stalled,
            handshakes,
            answered_first,
            requests,
        }
    }

    fn seen(&self, path: &str) -> usize {
        let requests = self.requests.lock().unwrap();
        requests.iter().filter(|seen| seen.path() == path).count()
    }

    /// A gateway sending every request to this origin as an `https` target, one attempt each.
    async fn gateway(&self) -> TestGateway {
        https_gateway_to(self.address).await
    }

    /// A keep-alive client whose `/first` was answered, and the origin's side of the
    /// connection that answered it, idle now in the gateway's pool.
    async fn first_answered(&mut self, gateway: &TestGateway) -> (TcpStream, PooledOriginSide) {
        let mut client = TcpStream::connect(gateway.proxy).await.unwrap();
        client
            .write_all(b"GET /first HTTP/1.1\r\nHost: tls.test\r\n\r\n")
            .await
            .unwrap();
        let (head, body) = read_sized_response(&mut client).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert_eq!(body, b"/first");
        let stream = tokio::time::timeout(STEP, self.answered_first.recv())
            .await
            .expect("the origin answered /first")
            .expect("the origin runs");
        let side = PooledOriginSide {
            stream,
            requests: self.requests.clone(),
        };
        (client, side)
    }
}

/// The origin's side of a connection the gateway keeps idle.
struct PooledOriginSide {
    stream: tokio_rustls::server::TlsStream<TcpStream>,
    requests: Arc<Mutex<Vec<WireRequest>>>,
}

impl PooledOriginSide {
    /// Sends `request` from `client` and, before the gateway's tasks run again, ends the
    /// pooled connection (TLS close_notify, then FIN). Both arrive in the same turn of the
    /// gateway's runtime (the test's own, one thread), the request first: the gateway hands
    /// the request to the connection it still thinks idle, whose task then reads the end and
    /// gives the request back unwritten. The origin keeps reading its side: a request written
    /// to the connection after all is noted.
    async fn close_as(self, client: &mut TcpStream, request: &[u8]) {
        let PooledOriginSide {
            mut stream,
            requests,
        } = self;
        client.write_all(request).await.unwrap();
        stream.shutdown().await.unwrap();
        tokio::spawn(async move {
            let mut pending = Vec::new();
            while let Some(request) = read_request_head(&mut stream, &mut pending).await {
                requests.lock().unwrap().push(request);
            }
        });
    }
}

/// An idle pooled connection to an `https` target that the origin closes right as a request
/// comes gives that request back unwritten: it goes again on a new connection and is answered,
/// whatever its method (a POST here, with its body), as hyper-util's own resend did before
/// Raahi took it over.
#[tokio::test]
async fn an_https_request_its_pooled_connection_gave_back_unwritten_goes_again() {
    let mut origin = ClosingTlsOrigin::start().await;
    let gateway = origin.gateway().await;
    let (mut client, pooled) = origin.first_answered(&gateway).await;

    pooled
        .close_as(
            &mut client,
            b"POST /again HTTP/1.1\r\nHost: tls.test\r\nContent-Length: 4\r\n\r\ndata",
        )
        .await;
    let (head, body) = read_sized_response(&mut client).await;
    assert!(
        head.starts_with("HTTP/1.1 200"),
        "{head}\n{}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(body, b"/again");
    let requests = origin.requests.lock().unwrap().clone();
    let again: Vec<_> = requests.iter().filter(|r| r.path() == "/again").collect();
    assert_eq!(again.len(), 1, "sent once: {requests:?}");
    assert_eq!(again[0].body, b"data");
}

/// The same request given back unwritten, while its client leaves as the gateway dials anew
/// for it: the request never reaches the origin. hyper-util, resending on its own under the
/// same "sent" probe, had the exchange finish for nobody: dialled and sent after the client
/// was gone.
#[tokio::test]
async fn an_https_request_given_back_unwritten_is_not_sent_after_its_client_left() {
    let mut origin = ClosingTlsOrigin::start().await;
    let gateway = origin.gateway().await;
    let connected = gateway.metric("raahi_client_connections").await;
    let (mut client, pooled) = origin.first_answered(&gateway).await;

    // The next connection hangs in its TLS handshake.
    origin.stall.store(true, Ordering::SeqCst);
    pooled
        .close_as(&mut client, b"GET /gone HTTP/1.1\r\nHost: tls.test\r\n\r\n")
        .await;
    wait_until("the gateway dials again for /gone", STEP, || async {
        origin.stalled.load(Ordering::SeqCst) == 1
    })
    .await;
    drop(client);
    wait_until("the gateway saw /gone's client leave", STEP, || async {
        gateway.metric("raahi_client_connections").await == connected
    })
    .await;

    // The handshake may go on now: the request it was dialled for must not follow.
    origin.handshakes.send_replace(true);
    holds_for("no /gone at the origin", Duration::from_secs(1), || async {
        origin.seen("/gone") == 0
    })
    .await;
}
