//! Upstream TLS connections: TCP to one target, then TLS with the service's server name and
//! trust settings. Traffic to `https` services offers `h2` and `http/1.1` by ALPN; health checks
//! of `https` and `tls` services dial through the same connector, so they see what traffic sees.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::{Authority, Scheme};
use http::Uri;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// A TLS handshake with a target failed: the certificate was refused, the versions or ALPN did
/// not match, or the peer is not speaking TLS. Nothing of the request was sent.
#[derive(Debug, thiserror::Error)]
#[error("TLS with {target} (server name {server_name:?}) failed: {reason}")]
pub struct UpstreamTlsError {
    pub target: String,
    pub server_name: String,
    pub reason: String,
}

impl UpstreamTlsError {
    /// The TLS failure somewhere in `error`'s chain of sources (a client wraps what the
    /// connector returned).
    pub fn find_in<'e>(
        error: &'e (dyn std::error::Error + 'static),
    ) -> Option<&'e UpstreamTlsError> {
        crate::error_chain::find(error)
    }

    /// The reason and the server name, as operators read them in a 502 body or a check's
    /// `last_check`: `invalid peer certificate: UnknownIssuer (server name "api.test")`.
    pub fn detail(&self) -> String {
        format!("{} (server name {:?})", self.reason, self.server_name)
    }
}

/// What a target's last TLS connection chose by ALPN, as kept in an `AtomicU8`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum AlpnChoice {
    /// No connection made yet.
    Unknown = 0,
    Http2 = 1,
    Http1 = 2,
}

/// Which protocols the connector offers by ALPN.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AlpnOffer {
    /// `h2` and `http/1.1`: HTTP/2 when the target agrees.
    Http2AndHttp1,
    /// `http/1.1` only, for requests that upgrade the connection (WebSocket).
    Http1Only,
    /// Nothing, for a bare handshake whatever the target speaks: a server whose own protocols
    /// are not offered may refuse the handshake (`no_application_protocol`), which would say
    /// nothing about whether it serves its clients.
    Nothing,
}

/// Connects to one fixed target whatever the request URI says, so the URI's authority can carry
/// the `Host`/`:authority` chosen for the request.
#[derive(Clone)]
pub struct TlsTargetConnector {
    tcp: HttpConnector,
    dial: Uri,
    target: Authority,
    /// Bounds TCP connect and TLS handshake together.
    connect_timeout: Duration,
    /// The server name and client config, or why they could not be built (reported per connect).
    tls: Result<(ServerName<'static>, Arc<rustls::ClientConfig>), String>,
    server_name_text: String,
    /// Told what ALPN chose on each connection (an [`AlpnChoice`]).
    chose_h2: Option<Arc<AtomicU8>>,
}

impl TlsTargetConnector {
    pub fn new(
        target: Authority,
        server_name: &str,
        config: Result<Arc<rustls::ClientConfig>, String>,
        alpn: AlpnOffer,
        connect_timeout: Duration,
    ) -> TlsTargetConnector {
        let mut tcp = HttpConnector::new();
        tcp.set_nodelay(true);
        tcp.set_keepalive(Some(Duration::from_secs(60)));
        let dial = Uri::builder()
            .scheme(Scheme::HTTP)
            .authority(target.clone())
            .path_and_query("/")
            .build()
            .unwrap_or_default();
        let name = ServerName::try_from(server_name.to_string())
            .map_err(|error| format!("server name {server_name:?} is not valid for TLS: {error}"));
        let tls = match (name, config) {
            (Ok(name), Ok(config)) => {
                let config = match alpn {
                    AlpnOffer::Http2AndHttp1 => config,
                    AlpnOffer::Http1Only => with_alpn(&config, vec![b"http/1.1".to_vec()]),
                    AlpnOffer::Nothing => with_alpn(&config, Vec::new()),
                };
                Ok((name, config))
            }
            (Err(reason), _) | (_, Err(reason)) => Err(reason),
        };
        TlsTargetConnector {
            tcp,
            dial,
            target,
            connect_timeout,
            tls,
            server_name_text: server_name.to_string(),
            chose_h2: None,
        }
    }

    /// Records in `flag`, on each connection made, what ALPN chose.
    pub fn telling_alpn(mut self, flag: Arc<AtomicU8>) -> Self {
        self.chose_h2 = Some(flag);
        self
    }

    fn tls_error(&self, reason: String) -> UpstreamTlsError {
        UpstreamTlsError {
            target: self.target.to_string(),
            server_name: self.server_name_text.clone(),
            reason,
        }
    }
}

fn with_alpn(
    config: &Arc<rustls::ClientConfig>,
    protocols: Vec<Vec<u8>>,
) -> Arc<rustls::ClientConfig> {
    let mut config = rustls::ClientConfig::clone(config);
    config.alpn_protocols = protocols;
    Arc::new(config)
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower::Service<Uri> for TlsTargetConnector {
    type Response = TlsConnection;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<TlsConnection, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.tcp.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, _request_uri: Uri) -> Self::Future {
        let dialling = self.dial_tls();
        Box::pin(async move {
            let stream = dialling.await?;
            Ok(TlsConnection {
                inner: TokioIo::new(stream),
            })
        })
    }
}

impl TlsTargetConnector {
    /// TCP to the target and the TLS handshake, within the connect timeout: for hyper's client
    /// (through `call`) and for the HTTP/2 pool, which reads the ALPN outcome itself.
    pub fn dial_tls(
        &mut self,
    ) -> impl Future<Output = Result<TlsStream<TcpStream>, BoxError>> + Send + 'static {
        let connector = self.clone();
        let connecting = tower::Service::call(&mut self.tcp, self.dial.clone());
        async move {
            let (server_name, config) = match &connector.tls {
                Ok(tls) => tls.clone(),
                Err(reason) => return Err(connector.tls_error(reason.clone()).into()),
            };
            let connect_and_handshake = async {
                let tcp = connecting.await?.into_inner();
                TlsConnector::from(config)
                    .connect(server_name, tcp)
                    .await
                    .map_err(|error| BoxError::from(connector.tls_error(handshake_reason(&error))))
            };
            match tokio::time::timeout(connector.connect_timeout, connect_and_handshake).await {
                Ok(Ok(stream)) => {
                    if let Some(flag) = &connector.chose_h2 {
                        let choice = match stream.get_ref().1.alpn_protocol() {
                            Some(b"h2") => AlpnChoice::Http2,
                            _ => AlpnChoice::Http1,
                        };
                        flag.store(choice as u8, Ordering::Relaxed);
                    }
                    Ok(stream)
                }
                Ok(Err(error)) => Err(error),
                // TimedOut is what the pool's classification reads as a connect timeout.
                Err(_) => Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "connecting to {} over TLS took longer than {} ms",
                        connector.target,
                        connector.connect_timeout.as_millis()
                    ),
                )
                .into()),
            }
        }
    }
}

/// The rustls reason ("invalid peer certificate: UnknownIssuer") rather than the io wrapper's.
fn handshake_reason(error: &io::Error) -> String {
    match error.get_ref() {
        Some(inner) => inner.to_string(),
        None => error.to_string(),
    }
}

/// A TLS connection to a target, telling the client whether ALPN chose HTTP/2.
pub struct TlsConnection {
    inner: TokioIo<TlsStream<TcpStream>>,
}

impl TlsConnection {
    /// Ends the session with a `close_notify`, so the target sees an orderly close rather than
    /// a truncated one.
    pub async fn close(self) -> io::Result<()> {
        use tokio::io::AsyncWriteExt;
        self.inner.into_inner().shutdown().await
    }
}

impl Connection for TlsConnection {
    fn connected(&self) -> Connected {
        let (tcp, session) = self.inner.inner().get_ref();
        let connected = tcp.connected();
        if session.alpn_protocol() == Some(b"h2") {
            connected.negotiated_h2()
        } else {
            connected
        }
    }
}

impl Read for TlsConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl Write for TlsConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
}
