//! A plain `http` target: dials it, sends requests over HTTP/1.1 and keeps its idle
//! connections. The one place that joins the codec (`h1client`) and the pool (`pool`), as a
//! connector does: the codec hands a finished connection to its [`ConnectionHome`], which is
//! this target, and the pool keeps it without knowing what it speaks.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use http::uri::Authority;
use http::{header, Method, Response};
use tokio::net::TcpStream;

use super::accounting::Abandoned;
use super::body::UpstreamRequestBody;
use super::connect_timing::ConnectTiming;
use super::detach::FinishOnDrop;
use super::h1client::{self, Connection, ConnectionHome, ExchangeError, RequestHead, ResponseBody};
use super::pool::{Pooled, TargetPool};

/// Why an attempt on a pooled target got no response. The messages leave the target's address
/// out: they reach clients inside error answers (`ProxyError` carries the target for the log).
#[derive(Debug, thiserror::Error)]
pub enum PlainTargetError {
    #[error("TCP connect failed")]
    Connect(#[source] io::Error),
    #[error("connecting took longer than {timeout_ms} ms")]
    ConnectTimeout { timeout_ms: u64 },
    #[error("the new connection failed before the request was sent")]
    Unsent(#[source] io::Error),
    /// The exchange failed after the request head was written (it may have been acted on).
    #[error(transparent)]
    Request(ExchangeError),
}

impl PlainTargetError {
    /// Nothing of the request reached the target.
    pub fn is_connect(&self) -> bool {
        !matches!(self, PlainTargetError::Request(_))
    }

    pub fn is_connect_timeout(&self) -> bool {
        matches!(self, PlainTargetError::ConnectTimeout { .. })
    }

    /// Why the target's response was refused, when it sent one Raahi will not pass on.
    pub fn refused_response(&self) -> Option<String> {
        match self {
            PlainTargetError::Request(error) => error.refused_response(),
            _ => None,
        }
    }
}

impl Pooled for Box<Connection> {
    fn is_reusable(&self) -> bool {
        Connection::is_reusable(self)
    }

    fn rest(&mut self) {
        Connection::rest(self)
    }
}

pub struct PlainTarget {
    target: Authority,
    connect_timeout: Duration,
    pool: Arc<TargetPool<Box<Connection>>>,
}

impl ConnectionHome for PlainTarget {
    fn take_back(&self, connection: Box<Connection>) {
        self.pool.put_back(connection);
    }
}

impl PlainTarget {
    pub fn new(target: Authority, connect_timeout: Duration, idle_timeout: Duration) -> Self {
        PlainTarget {
            target,
            connect_timeout,
            pool: Arc::new(TargetPool::new(idle_timeout)),
        }
    }

    pub fn target(&self) -> &Authority {
        &self.target
    }

    pub fn idle_timeout(&self) -> Duration {
        self.pool.idle_timeout()
    }

    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// Sends `request` on an idle connection or a new one. An idle connection that turns out
    /// closed when the request head is written to it (the target ended it meanwhile) is
    /// dropped and the request goes on another: its body was not touched yet.
    ///
    /// With `finish_if_abandoned` (what the exchange counts against), a client that goes away
    /// once the request head is written leaves the exchange to finish on its own (see
    /// `detach`), so the connection goes back to the pool rather than closed. Before that
    /// (still dialling), nothing was sent and the attempt is simply dropped.
    pub async fn send(
        self: &Arc<Self>,
        head: RequestHead<'_>,
        body: UpstreamRequestBody,
        finish_if_abandoned: Option<Abandoned<'_>>,
    ) -> Result<Response<ResponseBody>, PlainTargetError> {
        let method_is_head = *head.method == Method::HEAD;
        let upgrade_asked = head.headers.contains_key(header::UPGRADE);
        let (head, framing) = h1client::encode_head(&head, &body);
        let (connection, opened) = self.connection_with_head(&head).await?;
        let home: Arc<dyn ConnectionHome> = self.clone();
        let exchange = h1client::finish_exchange(
            connection,
            method_is_head,
            upgrade_asked,
            body,
            framing,
            home,
        );
        let mut response = match finish_if_abandoned {
            None => exchange.await,
            // The head is written: the request went.
            Some(counts) => FinishOnDrop::new(exchange, || true, counts).await,
        }
        .map_err(PlainTargetError::Request)?;
        // Only a new connection's answer carries it: a reused one's costs no allocation.
        if let Some(connect) = opened {
            response.extensions_mut().insert(ConnectTiming { connect });
        }
        Ok(response)
    }

    /// An idle or new connection with the request head written to it, and how long it took
    /// to open when it is new.
    async fn connection_with_head(
        &self,
        head: &[u8],
    ) -> Result<(Box<Connection>, Option<Duration>), PlainTargetError> {
        loop {
            // `opened`: None for a reused connection.
            let (mut connection, opened) = match self.pool.take_idle() {
                Some(connection) => (connection, None),
                None => {
                    let started = tokio::time::Instant::now();
                    let connection = self.connect().await?;
                    (connection, Some(started.elapsed()))
                }
            };
            match connection.write_head(head).await {
                Ok(()) => return Ok((connection, opened)),
                Err(_) if opened.is_none() => continue,
                // A new connection that would not take the request head: a connect failure,
                // which may go to another target.
                Err(error) => return Err(PlainTargetError::Unsent(error)),
            }
        }
    }

    async fn connect(&self) -> Result<Box<Connection>, PlainTargetError> {
        let connecting = TcpStream::connect(self.target.as_str());
        let stream = match tokio::time::timeout(self.connect_timeout, connecting).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(error)) => return Err(PlainTargetError::Connect(error)),
            Err(_) => {
                return Err(PlainTargetError::ConnectTimeout {
                    timeout_ms: self.connect_timeout.as_millis() as u64,
                })
            }
        };
        let _ = stream.set_nodelay(true);
        let keepalive = socket2::TcpKeepalive::new().with_time(Duration::from_secs(60));
        let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive);
        Ok(Connection::new(stream))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::detach::ClientBound;
    use http_body_util::Full;
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::time::Instant;

    /// An HTTP/1.1 server counting the connections it accepted.
    async fn origin() -> (Authority, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = accepted.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let service = service_fn(|_request| async {
                        Ok::<_, Infallible>(Response::new(Full::new(bytes::Bytes::from("ok"))))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        (address.to_string().parse().unwrap(), accepted)
    }

    /// A plain target with a 1 s connect timeout.
    fn target_at(target: Authority, idle_timeout: Duration) -> Arc<PlainTarget> {
        Arc::new(PlainTarget::new(
            target,
            Duration::from_secs(1),
            idle_timeout,
        ))
    }

    /// `GET /` with the target as Host.
    async fn get(target: &Arc<PlainTarget>) -> Result<Response<ResponseBody>, PlainTargetError> {
        let host = http::HeaderValue::from_str(target.target().as_str()).unwrap();
        let head = RequestHead {
            method: &Method::GET,
            path_and_query: "/",
            headers: &http::HeaderMap::new(),
            host: Some(&host),
        };
        target.send(head, UpstreamRequestBody::Empty, None).await
    }

    async fn exchange(target: &Arc<PlainTarget>) {
        use http_body_util::BodyExt;
        let response = get(target).await.unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "ok");
    }

    #[tokio::test]
    async fn a_finished_exchange_gives_its_connection_back_for_the_next() {
        let (target, accepted) = origin().await;
        let target = target_at(target, Duration::from_secs(60));
        for _ in 0..3 {
            exchange(&target).await;
            tokio::task::yield_now().await;
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "one connection served all"
        );
        assert_eq!(target.pool.idle_count(), 1);
    }

    /// The request that opened a connection tells how long that took (its trace span shows
    /// it); one on a reused connection carries nothing.
    #[tokio::test]
    async fn only_the_request_that_opened_its_connection_carries_the_connect_time() {
        use http_body_util::BodyExt;
        let (target, _) = origin().await;
        let target = target_at(target, Duration::from_secs(60));
        let first = get(&target).await.unwrap();
        let timing = *first
            .extensions()
            .get::<ConnectTiming>()
            .expect("a new connection's answer carries its connect time");
        assert!(timing.connect < Duration::from_secs(1));
        first.into_body().collect().await.unwrap();
        tokio::task::yield_now().await;
        assert_eq!(target.pool.idle_count(), 1);
        let second = get(&target).await.unwrap();
        assert!(second.extensions().get::<ConnectTiming>().is_none());
    }

    #[tokio::test]
    async fn a_response_cut_short_closes_its_connection() {
        let (target, accepted) = origin().await;
        let target = target_at(target, Duration::from_secs(60));
        let response = get(&target).await.unwrap();
        drop(response);
        assert_eq!(target.pool.idle_count(), 0);
        exchange(&target).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn idle_connections_close_after_the_idle_timeout() {
        let (target, _) = origin().await;
        let target = target_at(target, Duration::from_millis(100));
        exchange(&target).await;
        tokio::task::yield_now().await;
        assert_eq!(target.pool.idle_count(), 1);
        let deadline = Instant::now() + Duration::from_secs(5);
        while target.pool.idle_count() > 0 {
            assert!(
                Instant::now() < deadline,
                "the idle connection was not closed"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A target that closes each connection right after answering on it, without saying so in
    /// the response: the closed connection never goes back to the target, and every request
    /// succeeds on a new one.
    #[tokio::test]
    async fn a_connection_the_target_closed_costs_no_request() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target: Authority = listener.local_addr().unwrap().to_string().parse().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut chunk = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
                    let _ = stream.write_all(answer).await;
                });
            }
        });
        let target = target_at(target, Duration::from_secs(60));
        for _ in 0..20 {
            exchange(&target).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 20);
        assert_eq!(
            target.pool.idle_count(),
            0,
            "no closed connection waits in the pool"
        );
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let target: Authority = listener.local_addr().unwrap().to_string().parse().unwrap();
        drop(listener);
        let target = target_at(target.clone(), Duration::from_secs(60));
        let error = get(&target).await.err().expect("refused");
        assert!(error.is_connect(), "{error}");
        assert!(!error.is_connect_timeout());
    }

    /// A client that cancels its request while the target works on it (an HTTP/2 stream
    /// reset) must not cost the target its connection: the exchange finishes on its own and
    /// the next request reuses the connection.
    #[tokio::test]
    async fn an_abandoned_exchange_finishes_and_keeps_its_connection() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target: Authority = listener.local_addr().unwrap().to_string().parse().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let (received_tx, mut received) = tokio::sync::mpsc::unbounded_channel();
        let counter = accepted.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                let received_tx = received_tx.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |_request| {
                        let received_tx = received_tx.clone();
                        async move {
                            let _ = received_tx.send(());
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            Ok::<_, Infallible>(Response::new(Full::new(bytes::Bytes::from("ok"))))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        let target = target_at(target, Duration::from_secs(60));
        let host = http::HeaderValue::from_static("origin");
        let headers = http::HeaderMap::new();
        let head = RequestHead {
            method: &Method::GET,
            path_and_query: "/",
            headers: &headers,
            host: Some(&host),
        };
        let in_flight = crate::proxy::accounting::InFlight::start(&Arc::default());
        let counts = in_flight.if_abandoned(None);
        // As hyper holds a request: dropped unfinished, its client left.
        let mut request = ClientBound::new(Box::pin(async {
            target
                .send(head, UpstreamRequestBody::Empty, Some(counts))
                .await
        }));
        tokio::select! {
            _ = &mut request => panic!("answered before the origin got the request"),
            _ = received.recv() => {}
        }
        drop(request);
        // The caller is gone; the exchange finishes and the connection goes home.
        let deadline = Instant::now() + Duration::from_secs(5);
        while target.pool.idle_count() == 0 {
            assert!(Instant::now() < deadline, "the connection never went home");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        exchange(&target).await;
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "one connection served both"
        );
    }

    /// An exchange Raahi gives up itself (here its caller's timeout, as the response-header
    /// timeout does) is cut at once: the target sees its connection closed, and nothing of it
    /// goes back to the pool.
    #[tokio::test]
    async fn an_exchange_given_up_by_a_timeout_closes_its_connection() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target: Authority = listener.local_addr().unwrap().to_string().parse().unwrap();
        let (closed_tx, mut closed) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let closed_tx = closed_tx.clone();
                tokio::spawn(async move {
                    let service = service_fn(|_request| async {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        Ok::<_, Infallible>(Response::new(Full::new(bytes::Bytes::from("ok"))))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                    let _ = closed_tx.send(());
                });
            }
        });
        let target = target_at(target, Duration::from_secs(60));
        let host = http::HeaderValue::from_static("origin");
        let headers = http::HeaderMap::new();
        let head = RequestHead {
            method: &Method::GET,
            path_and_query: "/",
            headers: &headers,
            host: Some(&host),
        };
        let in_flight = crate::proxy::accounting::InFlight::start(&Arc::default());
        let counts = in_flight.if_abandoned(None);
        let sending = target.send(head, UpstreamRequestBody::Empty, Some(counts));
        let timed_out = tokio::time::timeout(Duration::from_millis(50), sending).await;
        assert!(timed_out.is_err(), "the origin answers after 200 ms");
        tokio::time::timeout(Duration::from_secs(2), closed.recv())
            .await
            .expect("the origin saw its connection closed at once");
        assert_eq!(target.pool.idle_count(), 0);
    }
}
