//! Switched protocols (WebSocket and other `Upgrade`s): the upstream side of a 101 is kept
//! and bytes are copied both ways once the client's side is free.

use std::sync::Arc;

use bytes::Bytes;
use http::{Response, Version};
use http_body_util::{Either, Full};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use super::ProxyBody;
use crate::proxy::accounting::InFlight;
use crate::proxy::headers;
use crate::proxy::response_body::UpstreamBody;

/// The upstream side of an upgraded exchange, waiting for the client connection's driver to
/// get the client's socket back from hyper.
#[derive(Default)]
pub struct UpgradeHandoff {
    upstream: std::sync::Mutex<Option<(UpstreamUpgrade, InFlight)>>,
}

impl UpgradeHandoff {
    fn put(&self, upstream: UpstreamUpgrade, in_flight: InFlight) {
        if let Ok(mut slot) = self.upstream.lock() {
            *slot = Some((upstream, in_flight));
        }
    }

    pub fn take(&self) -> Option<(UpstreamUpgrade, InFlight)> {
        self.upstream.lock().ok()?.take()
    }
}

/// The upstream side of a switched protocol: hyper's upgrade still to complete (`https`
/// targets), or a plain target's connection with the bytes it already sent past the 101.
pub enum UpstreamUpgrade {
    Pending(OnUpgrade),
    Plain {
        stream: TcpStream,
        already_read: Bytes,
    },
}

/// Answers the client's upgrade with the target's 101 and leaves the upstream side where the
/// client connection's driver takes it (`handoff`), or runs the tunnel on hyper's upgrade.
pub(super) fn switch_protocols(
    mut upstream: Response<UpstreamBody>,
    in_flight: InFlight,
    client_upgrade: OnUpgrade,
    handoff: Option<&Arc<UpgradeHandoff>>,
    connection_slot: Option<Arc<dyn std::any::Any + Send + Sync>>,
) -> Response<ProxyBody> {
    let hyper_upgrade = matches!(upstream.body(), UpstreamBody::Hyper(_))
        .then(|| hyper::upgrade::on(&mut upstream));
    let (parts, body) = upstream.into_parts();
    let upstream_upgrade = match (hyper_upgrade, body) {
        (Some(pending), _) => Some(UpstreamUpgrade::Pending(pending)),
        (None, UpstreamBody::Pooled(body)) => {
            body.into_upgraded()
                .map(|(stream, already_read)| UpstreamUpgrade::Plain {
                    stream,
                    already_read,
                })
        }
        // HTTP/2 targets never switch protocols: a 101 there is malformed, and h2 refuses it.
        (None, UpstreamBody::Hyper(_) | UpstreamBody::H2(_)) => None,
    };
    match (upstream_upgrade, handoff) {
        (Some(upstream_upgrade), Some(handoff)) => handoff.put(upstream_upgrade, in_flight),
        (Some(upstream_upgrade), None) => {
            tokio::spawn(async move {
                match client_upgrade.await {
                    Ok(client) => tunnel(TokioIo::new(client), upstream_upgrade, in_flight).await,
                    Err(error) => tracing::debug!(%error, "protocol upgrade failed"),
                }
                drop(connection_slot);
            });
        }
        // The request body was still going up when the target switched protocols:
        // its connection is no longer whole.
        (None, _) => tracing::warn!("the target switched protocols while the request body was still being sent; the upgrade is abandoned"),
    }
    let mut response = Response::from_parts(parts, Either::Right(Full::new(Bytes::new())));
    headers::add_via(response.headers_mut(), Version::HTTP_11);
    response
}

/// Copies bytes both ways between the upgraded client and upstream connections.
pub async fn tunnel<C>(mut client: C, upstream: UpstreamUpgrade, in_flight: InFlight)
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    let copied = match upstream {
        UpstreamUpgrade::Pending(on_upgrade) => match on_upgrade.await {
            Ok(upgraded) => {
                tokio::io::copy_bidirectional(&mut client, &mut TokioIo::new(upgraded)).await
            }
            Err(error) => {
                tracing::debug!(%error, "protocol upgrade failed");
                return;
            }
        },
        UpstreamUpgrade::Plain {
            mut stream,
            already_read,
        } => match client.write_all(&already_read).await {
            Ok(()) => tokio::io::copy_bidirectional(&mut client, &mut stream).await,
            Err(error) => Err(error),
        },
    };
    if let Err(error) = copied {
        tracing::debug!(%error, "upgraded connection ended with an error");
    }
    drop(in_flight);
}
