//! A route's `mirror` (TRAFFIC.md §3): a copy of the request goes to another service on a task
//! of its own and its answer is dropped. It never delays or fails the request: a copy is made
//! only of a body already read whole, at most `MAX_IN_FLIGHT` copies per route are out at once,
//! and every copy not sent is counted.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;

use super::retry::send_with_retries;
use super::rewrite::Outgoing;
use super::Exchange;
use crate::proxy::retry::RetryRule;
use crate::proxy::ProxyState;
use crate::snapshot::RouteEntry;

/// Copies of one route's requests out at once; past it, copies are dropped.
const MAX_IN_FLIGHT: u64 = 64;
/// How much of a mirror's answer is read (and dropped) so its connection can be reused; a
/// longer answer ends its connection instead.
const MAX_DRAINED_BYTES: usize = 1024 * 1024;

/// Sends a copy of `request` to the route's mirror when its `percent` and bounds allow.
pub(super) fn maybe_copy(state: &Arc<ProxyState>, route: &Arc<RouteEntry>, request: &Outgoing) {
    let (Some(mirror), Some(backend)) = (&route.route.mirror, &route.mirror) else {
        return;
    };
    let stats = &route.stats.mirror;
    // One request in `percent` of each hundred, spread evenly.
    let turn = stats.seen.fetch_add(1, Ordering::Relaxed);
    if turn % 100 >= u64::from(mirror.percent) {
        return;
    }
    let Some(copy) = request.try_clone() else {
        stats.dropped.fetch_add(1, Ordering::Relaxed);
        return;
    };
    if stats.in_flight.fetch_add(1, Ordering::Relaxed) >= MAX_IN_FLIGHT {
        stats.in_flight.fetch_sub(1, Ordering::Relaxed);
        stats.dropped.fetch_add(1, Ordering::Relaxed);
        return;
    }
    stats.sent.fetch_add(1, Ordering::Relaxed);
    let state = state.clone();
    let route = route.clone();
    let timeout = Duration::from_millis(backend.service.service.timeouts.response_header_ms);
    tokio::spawn(async move {
        let Some(backend) = &route.mirror else {
            return;
        };
        let mut exchange = Exchange::default();
        // The copy's answer is dropped: it follows its service's rules, not the route's policy.
        let rule = RetryRule::of(None, backend.service.service.max_attempts);
        let sending = send_with_retries(
            &state,
            backend,
            copy,
            &mut exchange,
            false,
            None,
            Default::default(),
            rule,
        );
        if let Ok(Ok((response, in_flight, _))) = tokio::time::timeout(timeout, sending).await {
            drain(response.into_body(), timeout).await;
            drop(in_flight);
        }
        route.stats.mirror.in_flight.fetch_sub(1, Ordering::Relaxed);
    });
}

/// Reads a mirror's answer to its end (within bounds), so its connection goes back to the pool.
pub(super) async fn drain<B: http_body::Body + Unpin>(mut body: B, timeout: Duration) {
    let reading = async {
        let mut read = 0usize;
        while let Some(Ok(frame)) = body.frame().await {
            if let Some(data) = frame.data_ref() {
                read += bytes::Buf::remaining(data);
                if read > MAX_DRAINED_BYTES {
                    return;
                }
            }
        }
    };
    let _ = tokio::time::timeout(timeout, reading).await;
}
