//! What the registry fakes (`consul.rs`, `kubernetes.rs`) share: serving HTTP/1.1 (optionally
//! over TLS) on a listener, dropping every connection, stopping so that connects are refused at
//! once, and listening again on the same port.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

/// One listening period, between a start and [`Listening::stop`].
pub struct Listening {
    listener: Arc<TcpListener>,
    stop: watch::Sender<bool>,
    connections: Arc<Mutex<Vec<AbortHandle>>>,
}

impl Listening {
    /// Serves `answer` on every connection `listener` accepts, over TLS when `tls` is set.
    pub fn serve<F, Fut, B>(listener: TcpListener, tls: Option<TlsAcceptor>, answer: F) -> Listening
    where
        F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Result<Response<B>, Infallible>> + Send + 'static,
        B: hyper::body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let listener = Arc::new(listener);
        let (stop, mut stopped) = watch::channel(false);
        let connections: Arc<Mutex<Vec<AbortHandle>>> = Arc::new(Mutex::new(Vec::new()));
        let accepting = listener.clone();
        let tracked = connections.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    accepted = accepting.accept() => accepted,
                    _ = stopped.wait_for(|stop| *stop) => break,
                };
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    // After `stop` shut the socket down, accept fails until this task sees the
                    // flag.
                    Err(_) if *stopped.borrow() => break,
                    Err(_) => {
                        tokio::task::yield_now().await;
                        continue;
                    }
                };
                let service = service_fn(answer.clone());
                let tls = tls.clone();
                let connection = tokio::spawn(async move {
                    let http = hyper::server::conn::http1::Builder::new();
                    match tls {
                        None => {
                            let _ = http.serve_connection(TokioIo::new(stream), service).await;
                        }
                        // A client that refuses the certificate ends the handshake here.
                        Some(acceptor) => {
                            if let Ok(stream) = acceptor.accept(stream).await {
                                let _ = http.serve_connection(TokioIo::new(stream), service).await;
                            }
                        }
                    }
                });
                let mut connections = tracked.lock().unwrap();
                connections.retain(|handle| !handle.is_finished());
                connections.push(connection.abort_handle());
            }
        });
        Listening {
            listener,
            stop,
            connections,
        }
    }

    /// Drops every open connection (streams end without their final chunk); keeps listening.
    pub fn drop_connections(&self) {
        for connection in self.connections.lock().unwrap().drain(..) {
            connection.abort();
        }
    }

    pub fn stop(self) {
        let _ = self.stop.send(true);
        // Shutting the listening socket down makes the kernel refuse new connections right
        // now, not whenever the accept task next runs: a test may connect right after `stop`.
        let _ = socket2::SockRef::from(&*self.listener).shutdown(std::net::Shutdown::Read);
        self.drop_connections();
    }
}

/// Binds `addr` again after a stop (the old accept task may hold the port for a moment).
pub async fn rebind(addr: SocketAddr) -> TcpListener {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match TcpListener::bind(addr).await {
            Ok(listener) => return listener,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(error) => panic!("restart: cannot bind {addr} again: {error}"),
        }
    }
}
