//! Health checks over HTTP/2: `grpc.health.v1.Health/Check` (type `grpc`), and the `http`
//! check of an `h2c` service, whose targets may speak nothing but HTTP/2. One connection per
//! check, as the other checks; what is read of an answer is bounded.
//!
//! The two protobuf messages are small enough to write by hand (grpc/doc/health-checking.md):
//! `HealthCheckRequest { string service = 1; }` and
//! `HealthCheckResponse { ServingStatus status = 1; }`.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::uri::{Authority, Scheme};
use http::{header, HeaderValue, Request, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite};

/// The most of an answer a check reads: a health answer is a few bytes.
const MAX_ANSWER: usize = 64 * 1024;
const CHECK_PATH: &str = "/grpc.health.v1.Health/Check";

/// `ServingStatus` values.
const SERVING: u64 = 1;

/// What a check asks over one fresh HTTP/2 connection.
pub(super) struct H2Probe<'a> {
    pub scheme: Scheme,
    /// `:authority`: the check's Host.
    pub authority: &'a str,
    pub timeout_ms: u64,
}

/// `grpc.health.v1.Health/Check` for `service` ("" is the server as a whole): healthy only on
/// HTTP 200, `grpc-status` 0 and `SERVING`.
pub(super) async fn grpc_check<T>(
    io: T,
    probe: H2Probe<'_>,
    service: &str,
) -> Result<(bool, String), String>
where
    T: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let mut request = Request::new(Full::new(frame(&encode_request(service))));
    *request.method_mut() = http::Method::POST;
    *request.uri_mut() = uri(&probe, CHECK_PATH)?;
    let headers = request.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert(header::TE, HeaderValue::from_static("trailers"));
    headers.insert(
        header::USER_AGENT,
        HeaderValue::from_static("raahi-health-check"),
    );
    if let Ok(timeout) = HeaderValue::from_str(&format!("{}m", probe.timeout_ms)) {
        headers.insert("grpc-timeout", timeout);
    }
    let response = send(io, request).await?;
    let status = response.status();
    let grpc = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|value| value.as_bytes().starts_with(b"application/grpc"));
    if status != http::StatusCode::OK || !grpc {
        return Ok((
            false,
            format!("HTTP {} (not a gRPC answer)", status.as_u16()),
        ));
    }
    let head_status = grpc_status(response.headers());
    let head_message = grpc_message(response.headers());
    let collected = Limited::new(response.into_body(), MAX_ANSWER)
        .collect()
        .await
        .map_err(|error| format!("reading the answer: {error}"))?;
    let trailers = collected.trailers().cloned().unwrap_or_default();
    let (code, message) = match grpc_status(&trailers) {
        Some(code) => (code, grpc_message(&trailers)),
        None => match head_status {
            Some(code) => (code, head_message),
            None => return Ok((false, "gRPC answer without grpc-status".to_owned())),
        },
    };
    if code != 0 {
        return Ok((
            false,
            format!(
                "grpc-status {code} ({}): {}",
                status_name(code),
                message.unwrap_or_default()
            ),
        ));
    }
    let serving = unframe(collected.to_bytes()).and_then(decode_status)?;
    Ok(match serving {
        SERVING => (true, "gRPC SERVING".to_owned()),
        3 => (false, format!("gRPC SERVICE_UNKNOWN for {service:?}")),
        other => (false, format!("gRPC {}", serving_name(other))),
    })
}

/// A GET of `path` over HTTP/2 with prior knowledge (an `h2c` service's `http` check): the
/// status as the HTTP/1.1 check reads it.
pub(super) async fn http2_status<T>(io: T, probe: H2Probe<'_>, path: &str) -> Result<u16, String>
where
    T: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let mut request = Request::new(Full::new(Bytes::new()));
    *request.uri_mut() = uri(&probe, path)?;
    request.headers_mut().insert(
        header::USER_AGENT,
        HeaderValue::from_static("raahi-health-check"),
    );
    Ok(send(io, request).await?.status().as_u16())
}

fn uri(probe: &H2Probe<'_>, path: &str) -> Result<Uri, String> {
    let authority = Authority::try_from(probe.authority)
        .map_err(|error| format!("bad check authority {:?}: {error}", probe.authority))?;
    Uri::builder()
        .scheme(probe.scheme.clone())
        .authority(authority)
        .path_and_query(path)
        .build()
        .map_err(|error| format!("bad check URI: {error}"))
}

async fn send<T>(
    io: T,
    request: Request<Full<Bytes>>,
) -> Result<http::Response<hyper::body::Incoming>, String>
where
    T: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .max_header_list_size(MAX_ANSWER as u32)
        .handshake(TokioIo::new(io))
        .await
        .map_err(|error| format!("HTTP/2 handshake: {error}"))?;
    // The connection ends when the check does (its future is dropped with the sender).
    tokio::spawn(connection);
    sender
        .send_request(request)
        .await
        .map_err(|error| format!("HTTP/2: {}", chain(&error)))
}

fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    crate::error_chain::text(error)
}

fn grpc_status(headers: &http::HeaderMap) -> Option<u64> {
    headers.get("grpc-status")?.to_str().ok()?.parse().ok()
}

fn grpc_message(headers: &http::HeaderMap) -> Option<String> {
    let raw = headers.get("grpc-message")?.as_bytes();
    Some(percent_decode(raw))
}

/// `grpc-message` is percent-encoded UTF-8; a malformed escape stays as it is.
fn percent_decode(raw: &[u8]) -> String {
    let mut bytes = Vec::with_capacity(raw.len());
    let mut index = 0;
    while index < raw.len() {
        let hex = raw
            .get(index + 1..index + 3)
            .and_then(|pair| std::str::from_utf8(pair).ok())
            .and_then(|pair| u8::from_str_radix(pair, 16).ok());
        match (raw[index], hex) {
            (b'%', Some(byte)) => {
                bytes.push(byte);
                index += 3;
            }
            (byte, _) => {
                bytes.push(byte);
                index += 1;
            }
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

fn status_name(code: u64) -> &'static str {
    match code {
        1 => "CANCELLED",
        2 => "UNKNOWN",
        3 => "INVALID_ARGUMENT",
        4 => "DEADLINE_EXCEEDED",
        5 => "NOT_FOUND",
        7 => "PERMISSION_DENIED",
        8 => "RESOURCE_EXHAUSTED",
        12 => "UNIMPLEMENTED",
        13 => "INTERNAL",
        14 => "UNAVAILABLE",
        16 => "UNAUTHENTICATED",
        _ => "other",
    }
}

fn serving_name(status: u64) -> String {
    match status {
        0 => "UNKNOWN".to_owned(),
        2 => "NOT_SERVING".to_owned(),
        other => format!("serving status {other}"),
    }
}

/// `HealthCheckRequest { service }`; an empty name is the empty message (proto3 leaves
/// defaults out).
fn encode_request(service: &str) -> Bytes {
    let mut message = BytesMut::new();
    if !service.is_empty() {
        message.put_u8(0x0a);
        put_varint(&mut message, service.len() as u64);
        message.put_slice(service.as_bytes());
    }
    message.freeze()
}

/// A gRPC message on the wire: not compressed, its length, itself.
fn frame(message: &[u8]) -> Bytes {
    let mut framed = BytesMut::with_capacity(5 + message.len());
    framed.put_u8(0);
    framed.put_u32(message.len() as u32);
    framed.put_slice(message);
    framed.freeze()
}

/// The one message of an answer.
fn unframe(mut body: Bytes) -> Result<Bytes, String> {
    if body.len() < 5 {
        return Err(format!(
            "a gRPC answer of {} bytes has no message",
            body.len()
        ));
    }
    if body.get_u8() != 0 {
        return Err("the answer is compressed, which the check did not ask for".to_owned());
    }
    let length = body.get_u32() as usize;
    if length > body.len() {
        return Err(format!(
            "the answer's message claims {length} bytes and has {}",
            body.len()
        ));
    }
    Ok(body.split_to(length))
}

/// `HealthCheckResponse.status`; unknown fields are skipped, a missing status is UNKNOWN (0).
fn decode_status(mut message: Bytes) -> Result<u64, String> {
    let mut status = 0;
    while message.has_remaining() {
        let tag = varint(&mut message)?;
        match (tag >> 3, tag & 7) {
            (1, 0) => status = varint(&mut message)?,
            (_, 0) => {
                varint(&mut message)?;
            }
            (_, 1) => skip(&mut message, 8)?,
            (_, 2) => {
                let length = varint(&mut message)?;
                skip(&mut message, usize::try_from(length).unwrap_or(usize::MAX))?;
            }
            (_, 5) => skip(&mut message, 4)?,
            (field, wire) => {
                return Err(format!(
                    "malformed health answer: field {field} of wire type {wire}"
                ))
            }
        }
    }
    Ok(status)
}

fn varint(message: &mut Bytes) -> Result<u64, String> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        if !message.has_remaining() {
            return Err("malformed health answer: a number is cut short".to_owned());
        }
        let byte = message.get_u8();
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err("malformed health answer: a number longer than 10 bytes".to_owned())
}

fn skip(message: &mut Bytes, length: usize) -> Result<(), String> {
    if length > message.len() {
        return Err("malformed health answer: a field runs past the message".to_owned());
    }
    message.advance(length);
    Ok(())
}

fn put_varint(buffer: &mut BytesMut, mut value: u64) {
    while value >= 0x80 {
        buffer.put_u8((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    buffer.put_u8(value as u8);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_names_the_service_or_is_empty() {
        assert!(encode_request("").is_empty());
        assert_eq!(
            &encode_request("shop.Cart")[..],
            b"\x0a\x09shop.Cart".as_slice()
        );
        let framed = frame(&encode_request("a"));
        assert_eq!(&framed[..], b"\x00\x00\x00\x00\x03\x0a\x01a".as_slice());
    }

    #[test]
    fn answers_decode_with_unknown_fields_skipped() {
        let serving = frame(b"\x08\x01");
        assert_eq!(unframe(serving).and_then(decode_status), Ok(1));
        let with_extras = frame(b"\x10\x96\x01\x1a\x02hi\x08\x02\x25\x00\x00\x00\x00");
        assert_eq!(unframe(with_extras).and_then(decode_status), Ok(2));
        assert_eq!(unframe(frame(b"")).and_then(decode_status), Ok(0));
    }

    #[test]
    fn malformed_answers_are_errors_not_panics() {
        let cases: [&[u8]; 7] = [
            b"",
            b"\x00\x00\x00",
            b"\x01\x00\x00\x00\x02\x08\x01",
            b"\x00\x00\x00\x00\x09\x08\x01",
            b"\x00\x00\x00\x00\x02\x08\xff",
            b"\x00\x00\x00\x00\x03\x1a\x05h",
            b"\x00\x00\x00\x00\x01\x0b",
        ];
        for case in cases {
            let decoded = unframe(Bytes::from_static(case)).and_then(decode_status);
            assert!(decoded.is_err(), "{case:?}: {decoded:?}");
        }
        let endless = frame(&[0xff; 11]);
        assert!(unframe(endless).and_then(decode_status).is_err());
    }

    /// How the little health server below answers.
    #[derive(Clone, Copy)]
    enum Answer {
        Status(u8),
        TrailersOnly(u8),
        NotGrpc(u16),
        Truncated,
    }

    /// A gRPC health server written with hyper's HTTP/2 server, on loopback; it checks the
    /// request it gets (path, content type, TE, the service asked about) before answering.
    async fn health_server(answer: Answer, expected_service: &'static str) -> std::net::SocketAddr {
        use http_body_util::StreamBody;
        use hyper::body::Frame;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (socket, _) = listener.accept().await.unwrap();
                let service = hyper::service::service_fn(
                    move |request: Request<hyper::body::Incoming>| async move {
                        assert_eq!(request.uri().path(), CHECK_PATH);
                        assert_eq!(request.headers()["content-type"], "application/grpc");
                        assert_eq!(request.headers()["te"], "trailers");
                        let body = request.into_body().collect().await.unwrap().to_bytes();
                        assert_eq!(unframe(body).unwrap(), encode_request(expected_service));
                        let mut trailers = http::HeaderMap::new();
                        let (status, frames): (
                            u16,
                            Vec<Result<Frame<Bytes>, std::convert::Infallible>>,
                        ) = match answer {
                            Answer::Status(serving) => {
                                trailers.insert("grpc-status", HeaderValue::from_static("0"));
                                (
                                    200,
                                    vec![
                                        Ok(Frame::data(frame(&[0x08, serving]))),
                                        Ok(Frame::trailers(trailers)),
                                    ],
                                )
                            }
                            Answer::TrailersOnly(code) => {
                                let response = http::Response::builder()
                                    .header("content-type", "application/grpc")
                                    .header("grpc-status", code.to_string())
                                    .header("grpc-message", "unknown%20service")
                                    .body(StreamBody::new(futures_util::stream::iter(Vec::new())))
                                    .unwrap();
                                return Ok::<_, std::convert::Infallible>(response);
                            }
                            Answer::NotGrpc(status) => {
                                (status, vec![Ok(Frame::data(Bytes::from_static(b"<html>")))])
                            }
                            Answer::Truncated => {
                                trailers.insert("grpc-status", HeaderValue::from_static("0"));
                                (
                                    200,
                                    vec![
                                        Ok(Frame::data(Bytes::from_static(
                                            b"\x00\x00\x00\x00\x09\x08",
                                        ))),
                                        Ok(Frame::trailers(trailers)),
                                    ],
                                )
                            }
                        };
                        let content_type = if matches!(answer, Answer::NotGrpc(_)) {
                            "text/html"
                        } else {
                            "application/grpc"
                        };
                        Ok(http::Response::builder()
                            .status(status)
                            .header("content-type", content_type)
                            .body(StreamBody::new(futures_util::stream::iter(frames)))
                            .unwrap())
                    },
                );
                tokio::spawn(
                    hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(socket), service),
                );
            }
        });
        addr
    }

    async fn check_against(
        answer: Answer,
        service: &'static str,
    ) -> Result<(bool, String), String> {
        let addr = health_server(answer, service).await;
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let authority = addr.to_string();
        let probe = H2Probe {
            scheme: Scheme::HTTP,
            authority: &authority,
            timeout_ms: 1000,
        };
        grpc_check(stream, probe, service).await
    }

    #[tokio::test]
    async fn serving_is_healthy_and_every_other_answer_is_not_with_its_reason() {
        assert_eq!(
            check_against(Answer::Status(1), "").await,
            Ok((true, "gRPC SERVING".to_owned()))
        );
        assert_eq!(
            check_against(Answer::Status(2), "shop.Cart").await,
            Ok((false, "gRPC NOT_SERVING".to_owned()))
        );
        assert_eq!(
            check_against(Answer::Status(3), "shop.Cart").await,
            Ok((false, "gRPC SERVICE_UNKNOWN for \"shop.Cart\"".to_owned()))
        );
        assert_eq!(
            check_against(Answer::TrailersOnly(12), "").await,
            Ok((
                false,
                "grpc-status 12 (UNIMPLEMENTED): unknown service".to_owned()
            ))
        );
        assert_eq!(
            check_against(Answer::NotGrpc(503), "").await,
            Ok((false, "HTTP 503 (not a gRPC answer)".to_owned()))
        );
        let truncated = check_against(Answer::Truncated, "").await;
        assert!(
            truncated
                .as_ref()
                .is_err_and(|error| error.contains("claims 9 bytes")),
            "{truncated:?}"
        );
    }

    #[tokio::test]
    async fn an_http2_status_check_reads_the_status() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (socket, _) = listener.accept().await.unwrap();
            let service =
                hyper::service::service_fn(|request: Request<hyper::body::Incoming>| async move {
                    let status = if request.uri().path() == "/ready" {
                        204
                    } else {
                        404
                    };
                    Ok::<_, std::convert::Infallible>(
                        http::Response::builder()
                            .status(status)
                            .body(Full::new(Bytes::new()))
                            .unwrap(),
                    )
                });
            let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(socket), service)
                .await;
        });
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let authority = addr.to_string();
        let probe = H2Probe {
            scheme: Scheme::HTTP,
            authority: &authority,
            timeout_ms: 1000,
        };
        assert_eq!(http2_status(stream, probe, "/ready").await, Ok(204));
    }

    #[test]
    fn messages_are_percent_decoded() {
        assert_eq!(percent_decode(b"caf%C3%A9 100%25 %zz"), "café 100% %zz");
    }
}
