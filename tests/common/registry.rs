//! A real HTTP/1.1 service registry on 127.0.0.1:0 for the `http` discovery provider. The test
//! decides its answer at runtime (a JSON document, a raw status and body, a delay, a document
//! larger than the provider's limit) and reads back how often it was asked and with which headers.
//! [`Registry::start_tls`] serves the same over HTTPS with a certificate nobody trusts.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::{HeaderMap, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;

type Body = BoxBody<Bytes, Infallible>;

/// What the registry answers with.
#[derive(Clone)]
enum Answer {
    /// A status, a content type and a body sent with its Content-Length.
    Raw {
        status: StatusCode,
        content_type: String,
        body: Bytes,
    },
    /// `size` bytes of JSON whitespace, with a Content-Length or chunked.
    Huge { size: u64, chunked: bool },
}

struct Shared {
    answer: Mutex<Answer>,
    delay: Mutex<Duration>,
    /// Answers wait while this is false (see [`Registry::hold`]).
    open: watch::Sender<bool>,
    requests: AtomicUsize,
    last_headers: Mutex<HeaderMap>,
}

pub struct Registry {
    pub addr: SocketAddr,
    scheme: &'static str,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
}

impl Registry {
    /// Starts a registry answering `[]` (an empty endpoint list) until told otherwise.
    pub async fn start() -> Registry {
        Self::serve(None).await
    }

    /// The same registry over HTTPS, with a self-signed certificate for `127.0.0.1` that no
    /// client trusts (for `tls_verify`).
    pub async fn start_tls() -> Registry {
        let (acceptor, _) = super::self_signed_acceptor(&["127.0.0.1", "localhost"]);
        Self::serve(Some(acceptor)).await
    }

    async fn serve(tls: Option<TlsAcceptor>) -> Registry {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            answer: Mutex::new(Answer::Raw {
                status: StatusCode::OK,
                content_type: "application/json".to_owned(),
                body: Bytes::from_static(b"[]"),
            }),
            delay: Mutex::new(Duration::ZERO),
            open: watch::Sender::new(true),
            requests: AtomicUsize::new(0),
            last_headers: Mutex::new(HeaderMap::new()),
        });
        let (stop, mut stopped) = watch::channel(false);
        let serving = shared.clone();
        let scheme = if tls.is_some() { "https" } else { "http" };
        tokio::spawn(async move {
            let mut connections = Vec::new();
            loop {
                let (stream, _) = tokio::select! {
                    accepted = listener.accept() => match accepted { Ok(a) => a, Err(_) => continue },
                    _ = stopped.wait_for(|s| *s) => break,
                };
                let shared = serving.clone();
                let service = service_fn(move |request| answer(request, shared.clone()));
                let tls = tls.clone();
                connections.push(tokio::spawn(async move {
                    let http = hyper::server::conn::http1::Builder::new();
                    match tls {
                        None => {
                            let _ = http.serve_connection(TokioIo::new(stream), service).await;
                        }
                        Some(acceptor) => {
                            // A client that refuses the certificate ends the handshake here.
                            if let Ok(stream) = acceptor.accept(stream).await {
                                let _ = http.serve_connection(TokioIo::new(stream), service).await;
                            }
                        }
                    }
                }));
            }
            for connection in connections {
                connection.abort();
            }
        });
        Registry {
            addr,
            scheme,
            shared,
            stop,
        }
    }

    /// `http://127.0.0.1:PORT{path}` (`https` for [`Registry::start_tls`]); every path gets the
    /// same answer.
    pub fn url(&self, path: &str) -> String {
        format!("{}://{}{}", self.scheme, self.addr, path)
    }

    /// Answers 200 with `value` as `application/json`.
    pub fn set_json(&self, value: Value) {
        self.set_raw(200, "application/json", value.to_string().into_bytes());
    }

    /// Answers `status` with exactly these bytes (invalid JSON, error pages...).
    pub fn set_raw(&self, status: u16, content_type: &str, body: impl Into<Bytes>) {
        *self.shared.answer.lock().unwrap() = Answer::Raw {
            status: StatusCode::from_u16(status).expect("a valid status"),
            content_type: content_type.to_owned(),
            body: body.into(),
        };
    }

    /// Answers 200 with a `size`-byte document of JSON whitespace, generated as it is sent:
    /// with a Content-Length header, or chunked (no length announced) when `chunked`.
    pub fn set_huge(&self, size: u64, chunked: bool) {
        *self.shared.answer.lock().unwrap() = Answer::Huge { size, chunked };
    }

    /// Waits this long before answering each request (zero: answer at once).
    pub fn set_delay(&self, delay: Duration) {
        *self.shared.delay.lock().unwrap() = delay;
    }

    /// Holds every answer (those under way too) until [`Registry::release`]: a registry that
    /// answers exactly when the test wants.
    pub fn hold(&self) {
        self.shared.open.send_replace(false);
    }

    /// Sends the answers held since [`Registry::hold`], and answers at once from now on.
    pub fn release(&self) {
        self.shared.open.send_replace(true);
    }

    /// Requests received so far (counted on arrival, before any delay).
    pub fn requests(&self) -> usize {
        self.shared.requests.load(Ordering::SeqCst)
    }

    /// The headers of the latest request (empty before the first).
    pub fn last_headers(&self) -> HeaderMap {
        self.shared.last_headers.lock().unwrap().clone()
    }

    /// Stops listening and drops open connections.
    pub fn stop(&self) {
        let _ = self.stop.send(true);
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn answer(
    request: Request<Incoming>,
    shared: Arc<Shared>,
) -> Result<Response<Body>, Infallible> {
    shared.requests.fetch_add(1, Ordering::SeqCst);
    *shared.last_headers.lock().unwrap() = request.headers().clone();
    let delay = *shared.delay.lock().unwrap();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let _ = shared.open.subscribe().wait_for(|open| *open).await;
    let answer = shared.answer.lock().unwrap().clone();
    let response = match answer {
        Answer::Raw {
            status,
            content_type,
            body,
        } => {
            let length = body.len();
            let mut response = Response::new(Full::new(body).boxed());
            *response.status_mut() = status;
            response
                .headers_mut()
                .insert(CONTENT_TYPE, content_type.parse().unwrap());
            response.headers_mut().insert(CONTENT_LENGTH, length.into());
            response
        }
        Answer::Huge { size, chunked } => {
            let mut response = Response::new(
                Whitespace {
                    remaining: size,
                    chunk: Bytes::from(vec![b' '; 64 * 1024]),
                    announce: !chunked,
                }
                .boxed(),
            );
            response
                .headers_mut()
                .insert(CONTENT_TYPE, "application/json".parse().unwrap());
            if !chunked {
                response.headers_mut().insert(CONTENT_LENGTH, size.into());
            }
            response
        }
    };
    Ok(response)
}

/// `remaining` spaces in 64 KiB frames; its size is announced only when `announce`, so hyper
/// frames it with a Content-Length or as chunked.
struct Whitespace {
    remaining: u64,
    chunk: Bytes,
    announce: bool,
}

impl hyper::body::Body for Whitespace {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.remaining == 0 {
            return Poll::Ready(None);
        }
        let take = self.remaining.min(self.chunk.len() as u64) as usize;
        self.remaining -= take as u64;
        Poll::Ready(Some(Ok(Frame::data(self.chunk.slice(..take)))))
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        if self.announce {
            SizeHint::with_exact(self.remaining)
        } else {
            SizeHint::default()
        }
    }
}
