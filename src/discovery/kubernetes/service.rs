//! Following the one Service object whose ports `port` is read through: a `get` when the watch
//! opens (a missing Service fails it at once), then a `watch` of it alone
//! (`fieldSelector=metadata.name=<name>`). Only `get` and `watch` on `services` are needed,
//! and both may be restricted to the Service with `resourceNames`.
//!
//! Each watch request starts from the most recent state (no `resourceVersion`): the API server
//! begins it with the Service as it is now, so a Service unchanged for longer than the API
//! server keeps history (a Service's resource version is that of its last change, often days
//! old) never makes a watch answer 410 Gone, and nothing is missed between two requests.

use std::pin::Pin;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Service;
use kube::api::{WatchEvent, WatchParams};
use kube::Api;

use super::errors::{client_failed, refused};
use crate::discovery::DiscoveryError;

/// The annotation of the bookmark that ends a watch's initial events.
const INITIAL_EVENTS_END: &str = "k8s.io/initial-events-end";
/// kube-rs's margin past `timeoutSeconds` before a silent watch is taken for dead.
const IDLE_MARGIN: Duration = Duration::from_secs(5);

type Events = Pin<Box<dyn Stream<Item = Result<WatchEvent<Service>, kube::Error>> + Send>>;

/// The Service's changes, each the whole object; an error ends them.
pub(super) type ServiceChanges =
    Pin<Box<dyn Stream<Item = Result<Service, DiscoveryError>> + Send>>;

pub(super) struct ServiceFollower {
    api: Api<Service>,
    name: String,
    /// "shop/web", as errors name it.
    shown: String,
    /// The object's URL, as errors name it.
    url: String,
    params: WatchParams,
    idle: Duration,
    timeout: Duration,
    events: Option<Events>,
    /// Whether the open watch has shown the Service yet.
    seen: bool,
}

impl ServiceFollower {
    pub(super) fn new(
        api: Api<Service>,
        name: &str,
        namespace: &str,
        url: String,
        watch_seconds: u32,
        timeout: Duration,
    ) -> ServiceFollower {
        ServiceFollower {
            api,
            name: name.to_owned(),
            shown: format!("{namespace}/{name}"),
            url,
            params: WatchParams::default()
                .fields(&format!("metadata.name={name}"))
                .timeout(watch_seconds),
            idle: Duration::from_secs(u64::from(watch_seconds)) + IDLE_MARGIN,
            timeout,
            events: None,
            seen: false,
        }
    }

    /// The Service now, within `timeout_ms`; a missing one is an error naming it.
    pub(super) async fn get(&mut self) -> Result<Service, DiscoveryError> {
        match tokio::time::timeout(self.timeout, self.api.get(&self.name)).await {
            Err(_) => Err(DiscoveryError::HttpRequest {
                url: self.url.clone(),
                reason: format!(
                    "no answer within {} ms (timeout_ms)",
                    self.timeout.as_millis()
                ),
            }),
            Ok(Ok(service)) => Ok(service),
            Ok(Err(kube::Error::Api(status))) if status.code == 404 => {
                Err(self.absent(format!("{} answered HTTP 404", self.url)))
            }
            Ok(Err(err)) => Err(client_failed(&self.url, &err)),
        }
    }

    /// The changes from now on, as a stream (kept across polls, so a caller may select on it).
    pub(super) fn changes(self) -> ServiceChanges {
        Box::pin(futures_util::stream::unfold(
            Some(self),
            |follower| async move {
                let mut follower = follower?;
                match follower.next().await {
                    Ok(service) => Some((Ok(service), Some(follower))),
                    Err(error) => Some((Err(error), None)),
                }
            },
        ))
    }

    fn watch_url(&self) -> String {
        let collection = self.url.rsplit_once('/').map_or("", |(base, _)| base);
        format!(
            "{collection}?fieldSelector=metadata.name={} (watch)",
            self.name
        )
    }

    fn absent(&self, reason: String) -> DiscoveryError {
        DiscoveryError::Absent {
            what: format!("Service {}", self.shown),
            reason,
        }
    }

    /// The next state of the Service (the same object again at the start of each watch
    /// request).
    async fn next(&mut self) -> Result<Service, DiscoveryError> {
        loop {
            let Some(events) = self.events.as_mut() else {
                self.seen = false;
                match self.api.watch(&self.params, "").await {
                    Ok(events) => self.events = Some(events.boxed()),
                    // Not expected from the most recent state, but as for the slices: routine.
                    Err(kube::Error::Api(status)) if status.code == 410 => {
                        tracing::debug!(url = %self.watch_url(), "watch expired (410 Gone)");
                    }
                    Err(err) => return Err(client_failed(&self.watch_url(), &err)),
                }
                continue;
            };
            let event = match tokio::time::timeout(self.idle, events.next()).await {
                // Silent past its own timeout: taken for dead, asked again (as kube-rs does).
                Err(_) | Ok(None) => {
                    self.events = None;
                    continue;
                }
                Ok(Some(event)) => event,
            };
            match event {
                Ok(WatchEvent::Added(service) | WatchEvent::Modified(service)) => {
                    self.seen = true;
                    return Ok(service);
                }
                Ok(WatchEvent::Deleted(_)) => {
                    return Err(self.absent("it was deleted".to_owned()));
                }
                Ok(WatchEvent::Bookmark(bookmark)) => {
                    // The initial events are over and did not hold the Service: it is gone.
                    if !self.seen
                        && bookmark
                            .metadata
                            .annotations
                            .get(INITIAL_EVENTS_END)
                            .is_some_and(|value| value == "true")
                    {
                        return Err(self.absent("it was deleted".to_owned()));
                    }
                }
                Ok(WatchEvent::Error(status)) if status.code == 410 => {
                    self.events = None;
                }
                Ok(WatchEvent::Error(status)) => return Err(refused(&self.watch_url(), &status)),
                Err(err) => return Err(client_failed(&self.watch_url(), &err)),
            }
        }
    }
}
