//! One stream connection from accept to end: its route (by listen address, and by SNI read
//! from the ClientHello without terminating TLS), a target connected with retries, the relay,
//! and its access log line.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::uri::Authority;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::relay::{self, Ended, Progress};
use super::{OpenConnection, Shared};
use crate::balance::ip_hash;
use crate::model::{HashOn, Id, RetryBudget, MAX_ATTEMPTS};
use crate::proxy::accounting::{record_outcome, InFlight, Overloaded};
use crate::proxy::failure::{Blame, NoTarget, Retry, UpstreamFailure};
use crate::proxy::sni::{Hello, HelloError, HelloReader, MAX_CLIENT_HELLO_BUFFER};
use crate::snapshot::{Preference, RetryReason, ServiceRuntime, StreamRouteEntry};
use crate::telemetry::access;

/// Read size while waiting for a ClientHello, which is usually well under this.
const HELLO_READ_CHUNK: usize = 4 * 1024;

/// Why a connection could not be proxied.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("the client sent no complete ClientHello within {timeout_ms} ms")]
    HelloTimeout { timeout_ms: u64 },
    #[error("the client closed the connection before its ClientHello was complete")]
    HelloTruncated,
    #[error("unreadable ClientHello: {0}")]
    BadHello(#[from] HelloError),
    #[error("reading the ClientHello failed: {0}")]
    ClientRead(io::Error),
    #[error("no stream route on {listen} matches server name {sni:?}")]
    NoRoute {
        listen: SocketAddr,
        sni: Option<String>,
    },
    #[error(transparent)]
    NoTarget(#[from] NoTarget),
    #[error(transparent)]
    Upstream(#[from] UpstreamFailure),
    #[error("service {service}'s targets are full: {reason}")]
    Overloaded { service: String, reason: Overloaded },
}

impl StreamError {
    pub fn blame(&self) -> Blame {
        match self {
            StreamError::HelloTimeout { .. }
            | StreamError::HelloTruncated
            | StreamError::BadHello(_)
            | StreamError::ClientRead(_)
            | StreamError::NoRoute { .. } => Blame::Client,
            StreamError::NoTarget(no_target) => no_target.blame(),
            StreamError::Upstream(_) => Blame::Upstream,
            StreamError::Overloaded { .. } => Blame::Gateway,
        }
    }

    /// The access log's `outcome` of a connection that ended with this error.
    pub fn code(&self) -> &'static str {
        match self {
            StreamError::HelloTimeout { .. } => "client_hello_timeout",
            StreamError::HelloTruncated | StreamError::ClientRead(_) => "client_closed",
            StreamError::BadHello(_) => "bad_client_hello",
            StreamError::NoRoute { .. } => "no_route",
            StreamError::NoTarget(no_target) => no_target.code(),
            StreamError::Upstream(failure) => failure.code(),
            StreamError::Overloaded { .. } => "upstream_overloaded",
        }
    }

    /// Connections that no route took: they count as `stream_unmatched`.
    fn is_unmatched(&self) -> bool {
        matches!(
            self,
            StreamError::HelloTimeout { .. }
                | StreamError::HelloTruncated
                | StreamError::BadHello(_)
                | StreamError::ClientRead(_)
                | StreamError::NoRoute { .. }
        )
    }
}

/// What one connection did, for the access log and the route's statistics.
struct ConnectionRecord {
    listen: SocketAddr,
    sni: Option<String>,
    route: Option<Arc<StreamRouteEntry>>,
    /// The target of the last connect attempt.
    target: Option<Authority>,
    progress: Progress,
}

pub(super) async fn serve(
    shared: Arc<Shared>,
    client_stream: TcpStream,
    client: SocketAddr,
    listen: SocketAddr,
    open: OpenConnection,
) {
    let mut drop_open = shared.drop_open.subscribe();
    let mut record = ConnectionRecord {
        listen,
        sni: None,
        route: None,
        target: None,
        progress: Progress::new(),
    };
    let result = tokio::select! {
        result = proxy_connection(&shared, client_stream, &mut record) => result,
        // An error (the sender gone) cannot happen while this task holds `shared`.
        _ = drop_open.wait_for(|drop| *drop) => Ok(Ended::Shutdown),
    };
    let client_to_upstream = record.progress.client_to_upstream.load(Ordering::Relaxed);
    let upstream_to_client = record.progress.upstream_to_client.load(Ordering::Relaxed);
    if let Some(route) = &record.route {
        route.stats.closed();
    }
    let outcome = match &result {
        Ok(ended) => {
            if let Ended::ClientFailed(error) | Ended::UpstreamFailed(error) = ended {
                tracing::debug!(%client, %listen, %error, "stream connection ended with an error");
            }
            ended.code()
        }
        Err(error) => {
            if error.is_unmatched() {
                shared
                    .counters
                    .stream_unmatched
                    .fetch_add(1, Ordering::Relaxed);
            }
            match error.blame() {
                Blame::Client => {
                    tracing::debug!(%client, %listen, code = error.code(), %error, "stream connection refused")
                }
                Blame::Upstream | Blame::Gateway | Blame::Discovery => {
                    tracing::warn!(%client, %listen, code = error.code(), %error, "stream connection failed")
                }
            }
            error.code()
        }
    };
    let route = record.route.as_deref();
    access::write(|fields| {
        fields.str("kind", "stream");
        fields.str("client", &client.to_string());
        fields.str("listen", &listen.to_string());
        fields.opt_str("sni", record.sni.as_deref());
        if let Some(route) = route {
            fields.i64("route", route.route.id);
        }
        fields.opt_str(
            "service",
            route.map(|route| route.service.service.name.as_str()),
        );
        fields.opt_str("target", record.target.as_ref().map(Authority::as_str));
        fields.u64("bytes_client_to_upstream", client_to_upstream);
        fields.u64("bytes_upstream_to_client", upstream_to_client);
        fields.millis("duration_ms", record.progress.started.elapsed());
        fields.str("outcome", outcome);
    });
    drop(open);
}

async fn proxy_connection(
    shared: &Shared,
    mut client: TcpStream,
    record: &mut ConnectionRecord,
) -> Result<Ended, StreamError> {
    let _ = client.set_nodelay(true);
    let listen = record.listen;
    let passthrough = {
        let snapshot = shared.snapshots.load();
        let routes = snapshot.streams().listener(listen);
        match routes {
            Some(routes) => routes.is_passthrough(),
            // The route went away between the accept and now.
            None => return Err(StreamError::NoRoute { listen, sni: None }),
        }
    };
    let hello = if passthrough {
        let (hello, sni) =
            read_client_hello(&mut client, shared.settings.handshake_timeout).await?;
        record.sni = sni;
        hello
    } else {
        Vec::new()
    };
    let route = {
        let snapshot = shared.snapshots.load();
        snapshot
            .streams()
            .listener(listen)
            .and_then(|routes| routes.route_for(record.sni.as_deref()))
            .cloned()
    };
    let route = route.ok_or_else(|| StreamError::NoRoute {
        listen,
        sni: record.sni.clone(),
    })?;
    route.stats.opened();
    record.progress.route_stats = Some(route.stats.clone());
    record.route = Some(route.clone());
    let service = &route.service;
    let preference = Preference {
        pinned: None,
        hash: client_ip_hash(service, &client),
    };
    let (upstream, in_flight) =
        connect_upstream(service, &route, preference, &mut record.target).await?;
    let _ = upstream.set_nodelay(true);
    let idle = Duration::from_millis(service.service.timeouts.idle_ms);
    let ended = relay::relay(client, upstream, &hello, idle, &record.progress).await;
    drop(in_flight);
    Ok(ended)
}

/// Reads until the buffered bytes hold a complete ClientHello; returns them (they must go
/// upstream first) with the server name.
async fn read_client_hello(
    client: &mut TcpStream,
    timeout: Duration,
) -> Result<(Vec<u8>, Option<String>), StreamError> {
    let deadline = Instant::now() + timeout;
    let mut buffered = Vec::new();
    // It looks at each new byte once, so feeding it after every read costs nothing more when
    // a client trickles its bytes, and its answer does not depend on how they were read.
    let mut reader = HelloReader::default();
    loop {
        if let Hello::Complete { sni } = reader.read(&buffered)? {
            return Ok((buffered, sni));
        }
        let room = MAX_CLIENT_HELLO_BUFFER.saturating_sub(buffered.len());
        if room == 0 {
            return Err(HelloError::TooLarge.into());
        }
        let filled = buffered.len();
        buffered.resize(filled + room.min(HELLO_READ_CHUNK), 0);
        let read = tokio::time::timeout_at(deadline, client.read(&mut buffered[filled..]))
            .await
            .map_err(|_| StreamError::HelloTimeout {
                timeout_ms: timeout.as_millis() as u64,
            })?
            .map_err(StreamError::ClientRead)?;
        buffered.truncate(filled + read);
        if read == 0 {
            return Err(StreamError::HelloTruncated);
        }
    }
}

/// Under a hashing policy keyed on the client's address, that address's hash (the only key a
/// byte stream has).
fn client_ip_hash(service: &ServiceRuntime, client: &TcpStream) -> Option<u64> {
    let config = &service.service;
    if !config.lb_policy.is_hashing() || config.hash_on != Some(HashOn::ClientIp) {
        return None;
    }
    Some(ip_hash(client.peer_addr().ok()?.ip()))
}

/// Connects to a picked target, trying other targets after connect failures. The target's
/// in-flight count covers the connection from its connect to its end (for least_request).
async fn connect_upstream(
    service: &ServiceRuntime,
    route: &StreamRouteEntry,
    preference: Preference,
    last_target: &mut Option<Authority>,
) -> Result<(TcpStream, InFlight), StreamError> {
    let attempts = (service.service.max_attempts as usize).clamp(1, MAX_ATTEMPTS as usize);
    let connect_timeout = Duration::from_millis(service.service.timeouts.connect_ms);
    let mut tried: Vec<Id> = Vec::with_capacity(attempts);
    let mut last_failure = None;
    // Connections share the service's retry budget with its requests: a service that is down
    // costs its targets at most the budget's extra connects, whoever asks.
    let retries = &service.counters.retries;
    retries.request(Instant::now());
    for attempt in 1..=attempts {
        // Like HTTP: only the first pick may fall back to unhealthy or ejected targets.
        let first_attempt = attempt == 1;
        // Held past the recorded outcome, like HTTP: a connect is a half-open trial's verdict.
        let Some(pick) = service.pick_preferring(
            None,
            preference,
            |candidate| tried.contains(&candidate.id),
            first_attempt,
        ) else {
            break;
        };
        // A retry has a target to go to: now it may spend the budget.
        if !first_attempt {
            if !retries.try_spend(Instant::now(), &RetryBudget::default()) {
                break;
            }
            retries.sent(RetryReason::ConnectFailure);
        }
        let target = pick.target;
        tried.push(target.id);
        *last_target = Some(target.authority.clone());
        let in_flight = InFlight::start_within(service, target)
            .await
            .map_err(|reason| StreamError::Overloaded {
                service: service.service.name.clone(),
                reason,
            })?;
        let failure = match tokio::time::timeout(
            connect_timeout,
            TcpStream::connect(target.authority.as_str()),
        )
        .await
        {
            Ok(Ok(stream)) => {
                record_outcome(service, target, None);
                return Ok((stream, in_flight));
            }
            Ok(Err(error)) => UpstreamFailure::connect_failed(service, target, error.to_string()),
            Err(_) => UpstreamFailure::connect_timeout(service, target),
        };
        drop(in_flight);
        route.stats.connect_failed();
        service
            .counters
            .connect_errors
            .fetch_add(1, Ordering::Relaxed);
        record_outcome(service, target, failure.ejection_cause());
        tracing::debug!(target = %target.authority, attempt, error = %failure, "stream connect attempt failed");
        // Nothing of a connection reaches a target before its connect succeeds, so every
        // connect failure may go elsewhere; a rule that says otherwise ends the attempts.
        let retry_allowed = failure.retry() == Retry::Any;
        last_failure = Some(failure);
        if !retry_allowed {
            break;
        }
    }
    Err(match last_failure {
        Some(failure) => StreamError::Upstream(failure),
        None => StreamError::NoTarget(NoTarget::of(service)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::failure::UpstreamFailureKind;
    use crate::proxy::stream::tests::socket_pair;
    use tokio::io::AsyncWriteExt;

    #[test]
    fn client_mistakes_are_unmatched_and_upstream_failures_name_their_code() {
        let unmatched = StreamError::NoRoute {
            listen: "127.0.0.1:443".parse().unwrap(),
            sni: Some("x.test".into()),
        };
        assert!(unmatched.is_unmatched());
        assert_eq!(unmatched.blame(), Blame::Client);
        let failed = StreamError::Upstream(UpstreamFailure::new(
            "db".into(),
            "127.0.0.1:1".into(),
            UpstreamFailureKind::ConnectFailed {
                reason: "refused".into(),
            },
        ));
        assert!(!failed.is_unmatched());
        assert_eq!(failed.blame(), Blame::Upstream);
        assert_eq!(failed.code(), "upstream_connect_failed");
        let no_target = StreamError::NoTarget(NoTarget::Discovery {
            service: "db".into(),
            sources: "db-dns (pending)".into(),
        });
        assert_eq!(no_target.blame(), Blame::Discovery);
        assert_eq!(no_target.code(), "discovery_unavailable");
    }

    #[tokio::test]
    async fn client_hello_is_read_across_writes_and_kept_whole() {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        let name = rustls_pki_types::ServerName::try_from("db.example.org").unwrap();
        let mut tls = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
        let mut hello = Vec::new();
        tls.write_tls(&mut hello).unwrap();

        let (mut client, mut gateway_side) = socket_pair().await;
        let sent = hello.clone();
        let writer = tokio::spawn(async move {
            for piece in sent.chunks(50) {
                client.write_all(piece).await.unwrap();
                client.flush().await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            client
        });
        let (buffered, sni) = read_client_hello(&mut gateway_side, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(sni.as_deref(), Some("db.example.org"));
        assert_eq!(buffered, hello);
        drop(writer.await.unwrap());
    }

    #[tokio::test]
    async fn a_silent_or_non_tls_client_is_refused() {
        let (_client, mut gateway_side) = socket_pair().await;
        let silent = read_client_hello(&mut gateway_side, Duration::from_millis(50)).await;
        assert!(matches!(silent, Err(StreamError::HelloTimeout { .. })));

        let (mut client, mut gateway_side) = socket_pair().await;
        client.write_all(b"SSH-2.0-OpenSSH\r\n").await.unwrap();
        let garbage = read_client_hello(&mut gateway_side, Duration::from_secs(5)).await;
        assert!(matches!(
            garbage,
            Err(StreamError::BadHello(HelloError::NotTls))
        ));

        let (mut client, mut gateway_side) = socket_pair().await;
        client.write_all(&[22, 3, 1, 0, 200, 1]).await.unwrap();
        client.shutdown().await.unwrap();
        let truncated = read_client_hello(&mut gateway_side, Duration::from_secs(5)).await;
        assert!(matches!(truncated, Err(StreamError::HelloTruncated)));
    }
}
