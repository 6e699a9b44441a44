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
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::body::UpstreamRequestBody;

type Sender = http1::SendRequest<UpstreamRequestBody>;

/// Why an attempt on a pooled target got no response. The messages leave the target's address
/// out: they reach clients inside error answers (`ProxyError` carries the target for the log).
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("TCP connect failed")]
    Connect(#[source] io::Error),
    #[error("connecting took longer than {timeout_ms} ms")]
    ConnectTimeout { timeout_ms: u64 },
    #[error("HTTP/1.1 connection setup failed")]
    Handshake(#[source] hyper::Error),
    /// The connection failed after the request was handed to it (it may have been sent).
    #[error(transparent)]
    Request(hyper::Error),
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
    sender: Sender,
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
    /// closed before taking the request (the target ended it meanwhile) hands the request back,
    /// and it goes on a new connection: nothing was sent.
    pub async fn send(
        self: &Arc<Self>,
        mut request: Request<UpstreamRequestBody>,
    ) -> Result<(Response<Incoming>, PooledConnection), PoolError> {
        loop {
            let (mut sender, reused) = match self.take_idle() {
                Some(sender) => (sender, true),
                None => (self.connect().await?, false),
            };
            match sender.try_send_request(request).await {
                Ok(response) => {
                    let connection = PooledConnection {
                        sender: Some(sender),
                        pool: self.clone(),
                        finished: false,
                    };
                    return Ok((response, connection));
                }
                Err(mut failed) => match failed.take_message() {
                    Some(unsent) if reused => request = unsent,
                    // A new connection that would not take the request ended before anything
                    // was sent: a connect failure, which may go to another target.
                    Some(_) => return Err(PoolError::Handshake(failed.into_error())),
                    None => return Err(PoolError::Request(failed.into_error())),
                },
            }
        }
    }

    fn take_idle(&self) -> Option<Sender> {
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        while let Some(candidate) = idle.pop() {
            if candidate.sender.is_ready() && candidate.since.elapsed() < self.idle_timeout {
                return Some(candidate.sender);
            }
        }
        None
    }

    async fn connect(&self) -> Result<Sender, PoolError> {
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
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(PoolError::Handshake)?;
        let target = self.target.clone();
        tokio::spawn(async move {
            if let Err(error) = connection.with_upgrades().await {
                tracing::debug!(%target, %error, "upstream connection ended with an error");
            }
        });
        Ok(sender)
    }

    fn put_back(self: &Arc<Self>, sender: Sender) {
        {
            let mut idle = self
                .idle
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            idle.push(IdleConnection {
                sender,
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
        idle.retain(|entry| !entry.sender.is_closed() && entry.since.elapsed() < idle_timeout);
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

/// A connection lent to one exchange. It goes back to its pool when the response was read to
/// its end ([`PooledConnection::finished`]); otherwise it is dropped, which closes it.
pub struct PooledConnection {
    sender: Option<Sender>,
    pool: Arc<TargetPool>,
    finished: bool,
}

impl PooledConnection {
    /// The response body was read to its end: the connection can carry another request.
    pub fn finished(&mut self) {
        self.finished = true;
    }
}

impl Drop for PooledConnection {
    fn drop(&mut self) {
        let Some(mut sender) = self.sender.take() else {
            return;
        };
        if !self.finished || sender.is_closed() {
            return;
        }
        if sender.is_ready() {
            self.pool.put_back(sender);
            return;
        }
        // The connection task has not yet seen the end of the response it delivered (or the
        // request body is still going up after an early response): bounded by the idle timeout.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let pool = self.pool.clone();
        runtime.spawn(async move {
            let ready = tokio::time::timeout(pool.idle_timeout, sender.ready()).await;
            if matches!(ready, Ok(Ok(()))) {
                pool.put_back(sender);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;
    use hyper::service::service_fn;
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

    fn get(target: &Authority) -> Request<UpstreamRequestBody> {
        Request::builder()
            .uri("/")
            .header(http::header::HOST, target.as_str())
            .body(UpstreamRequestBody::Empty)
            .unwrap()
    }

    async fn exchange(pool: &Arc<TargetPool>) -> PooledConnection {
        use http_body_util::BodyExt;
        let (response, mut connection) = pool.send(get(pool.target())).await.unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "ok");
        connection.finished();
        connection
    }

    #[tokio::test]
    async fn a_finished_exchange_gives_its_connection_back_for_the_next() {
        let (target, accepted) = origin().await;
        let pool = pool_to(target, Duration::from_secs(60));
        for _ in 0..3 {
            drop(exchange(&pool).await);
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
        let (_response, connection) = pool.send(get(pool.target())).await.unwrap();
        drop(connection);
        assert_eq!(pool.idle_count(), 0);
        drop(exchange(&pool).await);
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn idle_connections_close_after_the_idle_timeout() {
        let (target, _) = origin().await;
        let pool = pool_to(target, Duration::from_millis(100));
        drop(exchange(&pool).await);
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
            drop(exchange(&pool).await);
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
        let error = pool.send(get(&target)).await.err().expect("refused");
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
