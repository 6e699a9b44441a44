//! Keep-alive HTTP/1.1 connections to one plain `http` target.
//!
//! A request takes the most recently used idle connection (or dials a new one), sends on it,
//! and gives it back once its response body has been read to the end; a connection whose
//! response was cut short is closed instead. The pool is one target's, so its lock is shared
//! only by that target's requests and is held for a push or a pop. Idle connections close after
//! the service's `idle_ms`.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use http::uri::Authority;
use http::{Method, Response};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::body::UpstreamRequestBody;
use super::h1client::{self, Connection, ExchangeError, RequestHead, ResponseBody};

/// Why an attempt on a pooled target got no response. The messages leave the target's address
/// out: they reach clients inside error answers (`ProxyError` carries the target for the log).
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
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

impl PoolError {
    /// Nothing of the request reached the target.
    pub fn is_connect(&self) -> bool {
        !matches!(self, PoolError::Request(_))
    }

    pub fn is_connect_timeout(&self) -> bool {
        matches!(self, PoolError::ConnectTimeout { .. })
    }
}

struct IdleConnection {
    connection: Box<Connection>,
    since: Instant,
}

pub struct TargetPool {
    target: Authority,
    connect_timeout: Duration,
    idle_timeout: Duration,
    idle: Mutex<Vec<IdleConnection>>,
    reaper_running: AtomicBool,
}

impl TargetPool {
    pub fn new(target: Authority, connect_timeout: Duration, idle_timeout: Duration) -> Self {
        TargetPool {
            target,
            connect_timeout,
            idle_timeout,
            idle: Mutex::new(Vec::new()),
            reaper_running: AtomicBool::new(false),
        }
    }

    pub fn target(&self) -> &Authority {
        &self.target
    }

    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// Sends `request` on an idle connection or a new one. An idle connection that turns out
    /// closed when the request head is written to it (the target ended it meanwhile) is
    /// dropped and the request goes on another: its body was not touched yet.
    pub async fn send(
        self: &Arc<Self>,
        head: RequestHead<'_>,
        body: UpstreamRequestBody,
    ) -> Result<Response<ResponseBody>, PoolError> {
        let method_is_head = *head.method == Method::HEAD;
        let (head, framing) = h1client::encode_head(&head, &body);
        let connection = loop {
            let (mut connection, reused) = match self.take_idle() {
                Some(connection) => (connection, true),
                None => (self.connect().await?, false),
            };
            match connection.write_head(&head).await {
                Ok(()) => break connection,
                Err(_) if reused => continue,
                // A new connection that would not take the request head: a connect failure,
                // which may go to another target.
                Err(error) => return Err(PoolError::Unsent(error)),
            }
        };
        h1client::finish_exchange(connection, method_is_head, body, framing, self.clone())
            .await
            .map_err(PoolError::Request)
    }

    fn take_idle(&self) -> Option<Box<Connection>> {
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        while let Some(candidate) = idle.pop() {
            if candidate.since.elapsed() < self.idle_timeout && candidate.connection.is_reusable() {
                return Some(candidate.connection);
            }
        }
        None
    }

    async fn connect(&self) -> Result<Box<Connection>, PoolError> {
        let connecting = TcpStream::connect(self.target.as_str());
        let stream = match tokio::time::timeout(self.connect_timeout, connecting).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(error)) => return Err(PoolError::Connect(error)),
            Err(_) => {
                return Err(PoolError::ConnectTimeout {
                    timeout_ms: self.connect_timeout.as_millis() as u64,
                })
            }
        };
        let _ = stream.set_nodelay(true);
        let keepalive = socket2::TcpKeepalive::new().with_time(Duration::from_secs(60));
        let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive);
        Ok(Connection::new(stream))
    }

    /// Takes back a connection whose exchange ended cleanly.
    pub(super) fn put_back(self: &Arc<Self>, connection: Box<Connection>) {
        {
            let mut idle = self
                .idle
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            idle.push(IdleConnection {
                connection,
                since: Instant::now(),
            });
        }
        if !self.reaper_running.swap(true, Ordering::AcqRel) {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => drop(runtime.spawn(reap(Arc::downgrade(self)))),
                // The runtime is going away, and the pool with it.
                Err(_) => self.reaper_running.store(false, Ordering::Release),
            }
        }
    }

    /// Drops idle connections past the idle timeout or closed by the target; true when none
    /// is left (the reaper then stops, and the next one put back starts it again).
    fn prune(&self) -> bool {
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let idle_timeout = self.idle_timeout;
        idle.retain(|entry| entry.since.elapsed() < idle_timeout && entry.connection.is_reusable());
        if idle.is_empty() {
            self.reaper_running.store(false, Ordering::Release);
            return true;
        }
        false
    }

    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.idle.lock().map(|idle| idle.len()).unwrap_or(0)
    }
}

/// Closes a pool's idle connections as they pass the idle timeout, until none is left or the
/// pool is gone.
async fn reap(pool: Weak<TargetPool>) {
    loop {
        let Some(period) = pool.upgrade().map(|pool| reap_period(pool.idle_timeout)) else {
            return;
        };
        tokio::time::sleep(period).await;
        match pool.upgrade() {
            Some(pool) if !pool.prune() => {}
            _ => return,
        }
    }
}

/// A connection may outlive its idle timeout by at most a quarter of it (and one second).
fn reap_period(idle_timeout: Duration) -> Duration {
    (idle_timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;
    use std::convert::Infallible;
    use std::sync::atomic::AtomicUsize;

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

    /// A pool with a 1 s connect timeout.
    fn pool_to(target: Authority, idle_timeout: Duration) -> Arc<TargetPool> {
        Arc::new(TargetPool::new(
            target,
            Duration::from_secs(1),
            idle_timeout,
        ))
    }

    /// `GET /` with the target as Host.
    async fn get(pool: &Arc<TargetPool>) -> Result<Response<ResponseBody>, PoolError> {
        let host = http::HeaderValue::from_str(pool.target().as_str()).unwrap();
        let head = RequestHead {
            method: &Method::GET,
            path_and_query: "/",
            headers: &http::HeaderMap::new(),
            host: Some(&host),
        };
        pool.send(head, UpstreamRequestBody::Empty).await
    }

    async fn exchange(pool: &Arc<TargetPool>) {
        use http_body_util::BodyExt;
        let response = get(pool).await.unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "ok");
    }

    #[tokio::test]
    async fn a_finished_exchange_gives_its_connection_back_for_the_next() {
        let (target, accepted) = origin().await;
        let pool = pool_to(target, Duration::from_secs(60));
        for _ in 0..3 {
            exchange(&pool).await;
            tokio::task::yield_now().await;
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "one connection served all"
        );
        assert_eq!(pool.idle_count(), 1);
    }

    #[tokio::test]
    async fn a_response_cut_short_closes_its_connection() {
        let (target, accepted) = origin().await;
        let pool = pool_to(target, Duration::from_secs(60));
        let response = get(&pool).await.unwrap();
        drop(response);
        assert_eq!(pool.idle_count(), 0);
        exchange(&pool).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn idle_connections_close_after_the_idle_timeout() {
        let (target, _) = origin().await;
        let pool = pool_to(target, Duration::from_millis(100));
        exchange(&pool).await;
        tokio::task::yield_now().await;
        assert_eq!(pool.idle_count(), 1);
        let deadline = Instant::now() + Duration::from_secs(5);
        while pool.idle_count() > 0 {
            assert!(
                Instant::now() < deadline,
                "the idle connection was not closed"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            !pool.reaper_running.load(Ordering::Acquire),
            "the reaper stops"
        );
    }

    /// A target that closes each connection right after answering on it, without saying so in
    /// the response: the closed connection never goes back to the pool, and every request
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
        let pool = pool_to(target, Duration::from_secs(60));
        for _ in 0..20 {
            exchange(&pool).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 20);
        assert_eq!(
            pool.idle_count(),
            0,
            "no closed connection waits in the pool"
        );
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let target: Authority = listener.local_addr().unwrap().to_string().parse().unwrap();
        drop(listener);
        let pool = pool_to(target.clone(), Duration::from_secs(60));
        let error = get(&pool).await.err().expect("refused");
        assert!(error.is_connect(), "{error}");
        assert!(!error.is_connect_timeout());
    }

    #[test]
    fn reap_period_is_a_quarter_of_the_idle_timeout_within_bounds() {
        assert_eq!(reap_period(Duration::from_secs(60)), Duration::from_secs(1));
        assert_eq!(
            reap_period(Duration::from_millis(400)),
            Duration::from_millis(100)
        );
        assert_eq!(
            reap_period(Duration::from_millis(1)),
            Duration::from_millis(10)
        );
    }
}
