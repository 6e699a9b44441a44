//! Upstreams that give every request the same answer, whatever its path: one target of a
//! service answering 503 (or 409, or stalling) while another answers 200, as the retry tests
//! need. They count the requests they received, on arrival.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::net::TcpListener;

use super::fake_server::Listening;

/// What a [`FixedUpstream`] answers to every request: `status`, its name as the body and in
/// `x-upstream`, the extra `headers`, after `delay` (a stall when long).
#[derive(Clone, Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub delay: Duration,
}

impl Answer {
    pub fn status(status: u16) -> Answer {
        Answer {
            status,
            headers: Vec::new(),
            delay: Duration::ZERO,
        }
    }

    pub fn with_header(mut self, name: &str, value: &str) -> Answer {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    /// Answers only after `delay` (counted on arrival all the same).
    pub fn after(mut self, delay: Duration) -> Answer {
        self.delay = delay;
        self
    }
}

/// An HTTP/1.1 upstream on 127.0.0.1:0 giving every request one [`Answer`].
pub struct FixedUpstream {
    pub name: String,
    pub addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    listening: Option<Listening>,
}

impl FixedUpstream {
    pub async fn start(name: &str, answer: Answer) -> FixedUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let counter = hits.clone();
        let name_owned: Arc<str> = Arc::from(name);
        let listening = Listening::serve(listener, None, move |request: Request<Incoming>| {
            let hits = counter.clone();
            let answer = answer.clone();
            let name = name_owned.clone();
            async move {
                hits.fetch_add(1, Ordering::SeqCst);
                // The whole request first, as an application would read it.
                let _ = request.into_body().collect().await;
                if !answer.delay.is_zero() {
                    tokio::time::sleep(answer.delay).await;
                }
                let mut response = Response::new(Full::new(Bytes::from(name.to_string())));
                *response.status_mut() = StatusCode::from_u16(answer.status).unwrap();
                let headers = response.headers_mut();
                headers.insert("x-upstream", name.parse().unwrap());
                for (header, value) in &answer.headers {
                    headers.insert(
                        hyper::header::HeaderName::from_bytes(header.as_bytes()).unwrap(),
                        value.parse().unwrap(),
                    );
                }
                Ok::<_, Infallible>(response)
            }
        });
        FixedUpstream {
            name: name.to_owned(),
            addr,
            hits,
            listening: Some(listening),
        }
    }

    /// Requests received so far (stalled ones included).
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    /// A target body for this upstream.
    pub fn target(&self) -> Value {
        json!({"host": self.addr.ip().to_string(), "port": self.addr.port()})
    }
}

impl Drop for FixedUpstream {
    fn drop(&mut self) {
        if let Some(listening) = self.listening.take() {
            listening.stop();
        }
    }
}

/// An h2c gRPC upstream on 127.0.0.1:0 that answers every call trailers-only (one HEADERS
/// frame ending the stream) with `grpc-status` `code`.
pub struct FailingGrpcUpstream {
    pub addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl FailingGrpcUpstream {
    pub async fn start(code: u32) -> FailingGrpcUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let counter = hits.clone();
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((stream, _)) = listener.accept().await {
                let counter = counter.clone();
                let service = service_fn(move |request: Request<Incoming>| {
                    let counter = counter.clone();
                    async move {
                        counter.fetch_add(1, Ordering::SeqCst);
                        let _ = request.into_body().collect().await;
                        let response = Response::builder()
                            .status(200)
                            .header("content-type", "application/grpc")
                            .header("grpc-status", code.to_string())
                            .header("grpc-message", "failing-origin")
                            .body(Full::new(Bytes::new()))
                            .unwrap();
                        Ok::<_, Infallible>(response)
                    }
                });
                connections.spawn(async move {
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        FailingGrpcUpstream { addr, hits, task }
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for FailingGrpcUpstream {
    fn drop(&mut self) {
        // The JoinSet of connections goes with the task.
        self.task.abort();
    }
}
