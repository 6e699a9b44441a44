//! What a request or a connection does to its target's shared state, the same for HTTP and
//! L4: it counts as in flight while it runs (least-request balancing, the dashboard), and its
//! outcome feeds passive ejection.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::balance::{FailureCause, TargetLoad};
use crate::clock::unix_ms;
use crate::model::Id;
use crate::snapshot::{RouteStats, ServiceCounters, ServiceRuntime, TargetRuntime};

/// Counts a request or connection against its target from pick until it is finished or dropped.
pub struct InFlight {
    load: Arc<TargetLoad>,
    /// The service's own count, kept only under `hash_balance_factor` (its bounded load needs
    /// the mean): every other request pays no shared counter.
    service: Option<Arc<ServiceCounters>>,
    /// The request's place under its route's `max_in_flight`, when the route has one.
    route: Option<RouteSlot>,
}

impl InFlight {
    /// Holds `slot` for as long as the request: to the end of its answer's body or tunnel.
    pub fn holding(mut self, slot: Option<RouteSlot>) -> InFlight {
        self.route = slot;
        self
    }

    pub fn start(load: &Arc<TargetLoad>) -> InFlight {
        load.start_request();
        InFlight::started(load)
    }

    /// The guard of a request already counted at its target.
    fn started(load: &Arc<TargetLoad>) -> InFlight {
        InFlight {
            load: load.clone(),
            service: None,
            route: None,
        }
    }

    /// Starts a request or connection as [`InFlight::start_within_target`] does, counting it
    /// in the service too when its bounded load needs that.
    pub async fn start_within(
        service: &ServiceRuntime,
        target: &TargetRuntime,
    ) -> Result<InFlight, Overloaded> {
        let mut in_flight = InFlight::start_within_target(service, target).await?;
        if service.service.hash_balance_factor.is_some() {
            service.counters.in_flight.fetch_add(1, Ordering::Relaxed);
            in_flight.service = Some(service.counters.clone());
        }
        Ok(in_flight)
    }

    /// Starts a request or connection within the service's `max_connections_per_target`,
    /// waiting in the service's queue while the target is full. Refused (queue full) or timed
    /// out, it counts against no target: the target is busy, not failing.
    async fn start_within_target(
        service: &ServiceRuntime,
        target: &TargetRuntime,
    ) -> Result<InFlight, Overloaded> {
        let limits = &service.service.limits;
        let Some(connections) = limits.max_connections_per_target else {
            return Ok(InFlight::start(&target.load));
        };
        // Over HTTP/2 a connection carries many requests: the limit counts connections, and
        // requests wait only once every stream of every connection is taken.
        let max = match service.service.protocol {
            crate::model::Protocol::H2c => {
                connections.saturating_mul(limits.max_streams_per_connection)
            }
            _ => connections,
        };
        let load = &target.load;
        // Requests already waiting go first: a newcomer does not take the room they wait for.
        if !load.has_waiters() && load.try_start_request(max) {
            return Ok(InFlight::started(load));
        }
        let counters = &service.counters;
        let _queued = Queued::join(counters);
        if counters.queued.load(Ordering::Relaxed) > u64::from(limits.max_pending_requests) {
            counters.overloaded.fetch_add(1, Ordering::Relaxed);
            return Err(Overloaded::QueueFull {
                max_pending: limits.max_pending_requests,
            });
        }
        let deadline = Instant::now() + Duration::from_millis(limits.queue_timeout_ms);
        // Boxed, as only a request that queues needs its room: see `read_request_body`.
        if Box::pin(tokio::time::timeout_at(deadline, wait_for_room(load, max)))
            .await
            .is_ok()
        {
            return Ok(InFlight::started(load));
        }
        counters.overloaded.fetch_add(1, Ordering::Relaxed);
        Err(Overloaded::QueueTimeout {
            timeout_ms: limits.queue_timeout_ms,
        })
    }
}

/// Waits until fewer than `max` requests are in flight at the target, and starts one.
async fn wait_for_room(load: &TargetLoad, max: u32) {
    let waiter = load.wait_for_room();
    loop {
        // Registered before the check, so a finish between the two is not missed.
        let room = waiter.room().notified();
        tokio::pin!(room);
        room.as_mut().enable();
        if load.try_start_request(max) {
            return;
        }
        room.await;
    }
}

/// Why a request found no room at its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Overloaded {
    #[error("{max_pending} requests already wait for room (limits.max_pending_requests)")]
    QueueFull { max_pending: u32 },
    #[error("no room at the picked target within {timeout_ms} ms (limits.queue_timeout_ms)")]
    QueueTimeout { timeout_ms: u64 },
}

/// A request counted in its service's queue while it waits.
struct Queued<'a>(&'a ServiceCounters);

impl<'a> Queued<'a> {
    fn join(counters: &'a ServiceCounters) -> Queued<'a> {
        counters.queued.fetch_add(1, Ordering::Relaxed);
        Queued(counters)
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What an exchange counts against, to count it the same way once its client went away and it
/// finishes on its own (see `detach`): its target, its service under a bounded load, its route
/// under `max_in_flight`. A client resetting its streams must not take them out of any count.
/// It borrows the request's own count, so an exchange that finishes with its caller pays
/// nothing for it.
#[derive(Clone, Copy)]
pub struct Abandoned<'a> {
    in_flight: &'a InFlight,
    route: Option<&'a Arc<RouteStats>>,
}

impl Abandoned<'_> {
    /// Counts the abandoned exchange: never refused, it is already under way.
    pub fn start(&self) -> InFlight {
        let mut in_flight = InFlight::start(&self.in_flight.load);
        if let Some(service) = &self.in_flight.service {
            service.in_flight.fetch_add(1, Ordering::Relaxed);
            in_flight.service = Some(service.clone());
        }
        in_flight.route = self.route.map(|stats| {
            stats.in_flight.fetch_add(1, Ordering::Relaxed);
            RouteSlot(stats.clone())
        });
        in_flight
    }
}

impl InFlight {
    /// How to count this exchange should its client abandon it; `route`: the statistics of
    /// a route with `max_in_flight`.
    pub fn if_abandoned<'a>(&'a self, route: Option<&'a Arc<RouteStats>>) -> Abandoned<'a> {
        Abandoned {
            in_flight: self,
            route,
        }
    }
}

/// One request counted under its route's `max_in_flight`, until dropped.
pub struct RouteSlot(Arc<RouteStats>);

impl RouteSlot {
    /// A place among the route's `limit` requests in flight; None when they are all taken
    /// (counted as refused).
    pub fn take(stats: &Arc<RouteStats>, limit: u32) -> Option<RouteSlot> {
        let before = stats.in_flight.fetch_add(1, Ordering::Relaxed);
        if before >= u64::from(limit) {
            stats.in_flight.fetch_sub(1, Ordering::Relaxed);
            stats.in_flight_refused.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(RouteSlot(stats.clone()))
    }
}

impl Drop for RouteSlot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.load.finish_request();
        if let Some(service) = &self.service {
            service.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// The target whose answer is being passed on, once its head was accepted (and counted a
/// success): a body that then breaks off is logged and counts against the target as a broken
/// exchange. Holds the service its request was routed to, so it costs no lookup until then.
pub struct Answering {
    service: Arc<ServiceRuntime>,
    target: Id,
}

impl Answering {
    pub fn new(service: Arc<ServiceRuntime>, target: Id) -> Answering {
        Answering { service, target }
    }

    /// The answer ended with `grpc-status` 14: gRPC's 503, counted like one.
    pub fn grpc_unavailable(&self) {
        let service = &self.service;
        if let Some(target) = service
            .targets
            .iter()
            .find(|target| target.id == self.target)
        {
            record_outcome(service, target, Some(FailureCause::GrpcUnavailable));
        }
    }

    pub fn failed(&self, error: &(dyn std::error::Error + 'static)) {
        let service = &self.service;
        let Some(target) = service
            .targets
            .iter()
            .find(|target| target.id == self.target)
        else {
            return;
        };
        let reason = crate::error_chain::text(error);
        tracing::warn!(
            service = %service.service.name,
            target = %target.authority,
            error = %reason,
            "the target's response broke off after its head was passed on"
        );
        record_outcome(service, target, Some(FailureCause::ConnectionError));
    }
}

/// Feeds passive ejection: a failure (connect error, timeout, a failure status) may take the
/// target out; a success clears its record and ends a half-open trial by restoring the target.
pub fn record_outcome(
    service: &ServiceRuntime,
    target: &TargetRuntime,
    failure: Option<FailureCause>,
) {
    let policy = &service.service.ejection;
    // With ejection turned off after a target was ejected, nothing would judge its trials and it
    // would stay half-open (one request at a time) for good: any outcome restores it instead,
    // once the ejection has run out.
    let Some(cause) = failure.filter(|_| policy.enabled) else {
        target.health.record_success(unix_ms);
        return;
    };
    let now = unix_ms();
    if !target.health.record_failure(now, policy) || !ejection_allowed(service, now) {
        return;
    }
    if let Some(until) = target.health.eject(now, policy, cause) {
        tracing::warn!(
            service = %service.service.name,
            target = %target.authority,
            ejected_for_ms = until.saturating_sub(now),
            "target ejected after failures"
        );
    }
}

/// `max_ejection_percent` of the service's targets may be out at once, and always at least one.
fn ejection_allowed(service: &ServiceRuntime, now: u64) -> bool {
    let percent = service.service.ejection.max_ejection_percent as usize;
    if percent == 0 {
        return false;
    }
    let allowed = (service.targets.len() * percent / 100).max(1);
    let ejected = service
        .targets
        .iter()
        .filter(|target| target.health.ejected_until(now).is_some())
        .count();
    ejected < allowed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_waiting_request_starts_when_another_finishes_and_leaves_no_trace_if_it_gives_up() {
        let load = Arc::new(TargetLoad::default());
        assert!(load.try_start_request(1));
        let finisher = load.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            finisher.finish_request();
        });
        let start = Instant::now();
        wait_for_room(&load, 1).await;
        assert_eq!(start.elapsed(), Duration::from_millis(300));
        assert_eq!(load.in_flight(), 1, "it took the room it waited for");
        assert!(!load.has_waiters());
        // Nobody finishes now: the wait is given up (as at a queue timeout).
        let waited = tokio::time::timeout(Duration::from_millis(100), wait_for_room(&load, 1));
        assert!(waited.await.is_err());
        assert_eq!(load.in_flight(), 1);
        assert!(
            !load.has_waiters(),
            "a wait given up leaves no waiter behind"
        );
    }
}
