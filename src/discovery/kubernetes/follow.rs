//! One open watch: kube-rs's watcher events kept as the Service's slices, each change (with the
//! events that follow it within [`BURST_WINDOW`]) answered as one whole set, errors classified.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher;

use super::client::Connection;
use super::slices::{endpoints_of, name_of, Wanted};
use super::{watch_seconds, KubernetesConfig, SERVICE_NAME_LABEL};
use crate::discovery::{DiscoveryError, WatchAnswer};
use crate::error_chain::text as error_chain;

/// How long after a change the events that follow it are taken into the same set. The
/// EndpointSlice controller writes a rollout's changes slice by slice, milliseconds apart.
const BURST_WINDOW: Duration = Duration::from_millis(50);

type SliceEvents =
    Pin<Box<dyn Stream<Item = Result<watcher::Event<EndpointSlice>, watcher::Error>> + Send>>;

/// One open watch: kube-rs's watcher, the slices it reported, and what the config asks of them.
pub(super) struct Follower {
    url: String,
    service: String,
    wanted: Wanted,
    list_timeout: Duration,
    events: SliceEvents,
    slices: SliceSet,
    /// An error that ended the watch while a burst was being gathered: reported after the
    /// burst's set.
    pending_error: Option<DiscoveryError>,
}

impl Follower {
    pub(super) async fn open(config: &KubernetesConfig) -> Result<Follower, DiscoveryError> {
        // A kubeconfig may run an exec credential plugin, which kube-rs runs synchronously: on a
        // blocking thread, so it stalls no runtime worker, and bounded by `timeout_ms`.
        let owned = config.clone();
        let runtime = tokio::runtime::Handle::current();
        let opening =
            tokio::task::spawn_blocking(move || runtime.block_on(Connection::open(&owned)));
        let setup = |reason: String| DiscoveryError::ClientSetup { reason };
        let connection = tokio::time::timeout(Duration::from_millis(config.timeout_ms), opening)
            .await
            .map_err(|_| {
                setup(format!(
                    "finding the API server's credentials took longer than {} ms (timeout_ms)",
                    config.timeout_ms
                ))
            })?
            .map_err(|err| {
                setup(format!(
                    "finding the API server's credentials failed: {err}"
                ))
            })??;
        let api = kube::Api::<EndpointSlice>::namespaced(
            connection.client.clone(),
            &connection.namespace,
        );
        let watch_config = watcher::Config::default()
            .labels(&format!("{SERVICE_NAME_LABEL}={}", config.service))
            .timeout(watch_seconds(config));
        Ok(Follower::new(
            connection.shown_url,
            config,
            Box::pin(watcher(api, watch_config)),
        ))
    }

    fn new(url: String, config: &KubernetesConfig, events: SliceEvents) -> Follower {
        Follower {
            url,
            service: config.service.clone(),
            wanted: Wanted::of(config),
            list_timeout: Duration::from_millis(config.timeout_ms),
            events,
            slices: SliceSet::default(),
            pending_error: None,
        }
    }

    pub(super) fn answers(self) -> impl Stream<Item = Result<WatchAnswer, DiscoveryError>> + Send {
        futures_util::stream::unfold(Some(self), |follower| async move {
            let mut follower = follower?;
            match follower.next_answer().await {
                Ok(answer) => Some((Ok(answer), Some(follower))),
                // The runner opens a new watch after an error; this one is done.
                Err(error) => Some((Err(error), None)),
            }
        })
    }

    /// Waits for the next change, then takes every event arriving within [`BURST_WINDOW`] of
    /// it, so a burst (a rollout touching several slices, a scale-up written slice by slice) is
    /// one set and one reconcile.
    async fn next_answer(&mut self) -> Result<WatchAnswer, DiscoveryError> {
        if let Some(error) = self.pending_error.take() {
            return Err(error);
        }
        let mut burst_ends: Option<tokio::time::Instant> = None;
        loop {
            let event = match burst_ends {
                Some(deadline) => {
                    match tokio::time::timeout_at(deadline, self.events.next()).await {
                        Ok(event) => event,
                        Err(_) => return self.answer(),
                    }
                }
                None => self.next_event().await?,
            };
            let error = match event {
                None => DiscoveryError::WatchEnded,
                Some(Ok(event)) => {
                    if self.slices.apply(event) && burst_ends.is_none() {
                        burst_ends = Some(tokio::time::Instant::now() + BURST_WINDOW);
                    }
                    continue;
                }
                // kube-rs relists on its next poll; a compacted history is routine.
                Some(Err(watcher::Error::WatchError(status))) if status.code == 410 => {
                    tracing::debug!(url = %self.url, "watch expired (410 Gone); relisting");
                    continue;
                }
                Some(Err(err)) => watcher_failed(&self.url, err),
            };
            if burst_ends.is_some() {
                self.pending_error = Some(error);
                return self.answer();
            }
            return Err(error);
        }
    }

    /// The next event; while a list is under way, within `timeout_ms` (a page, or the
    /// trampolined steps between pages).
    async fn next_event(
        &mut self,
    ) -> Result<Option<Result<watcher::Event<EndpointSlice>, watcher::Error>>, DiscoveryError> {
        if !self.slices.awaiting_list() {
            return Ok(self.events.next().await);
        }
        tokio::time::timeout(self.list_timeout, self.events.next())
            .await
            .map_err(|_| DiscoveryError::HttpRequest {
                url: self.url.clone(),
                reason: format!(
                    "the list did not complete within {} ms (timeout_ms)",
                    self.list_timeout.as_millis()
                ),
            })
    }

    fn answer(&self) -> Result<WatchAnswer, DiscoveryError> {
        let discovered = endpoints_of(&self.slices.slices, &self.wanted).map_err(|reason| {
            DiscoveryError::BadDocument {
                url: self.url.clone(),
                location: format!("Service {}", self.service),
                reason,
            }
        })?;
        Ok(WatchAnswer {
            discovered,
            position: self.slices.position.clone(),
        })
    }
}

/// The slices of one Service as the watcher reported them.
#[derive(Default)]
struct SliceSet {
    /// As of the last complete list and the events since, by name.
    slices: BTreeMap<String, EndpointSlice>,
    /// A list in progress (kube-rs's `Init` .. `InitDone`).
    listing: Option<BTreeMap<String, EndpointSlice>>,
    /// The resource version of the newest object in `slices`.
    position: String,
    /// The same for the list in progress: it replaces `position` with the list, since a
    /// restored etcd may number from lower again.
    listing_position: String,
}

impl SliceSet {
    /// Before the first list is done, or while a relist runs.
    fn awaiting_list(&self) -> bool {
        self.listing.is_some() || self.position.is_empty()
    }

    /// True when the set may have changed.
    fn apply(&mut self, event: watcher::Event<EndpointSlice>) -> bool {
        match event {
            watcher::Event::Init => {
                self.listing = Some(BTreeMap::new());
                self.listing_position.clear();
                false
            }
            watcher::Event::InitApply(slice) => {
                newest(&mut self.listing_position, &slice);
                if let Some(listing) = &mut self.listing {
                    listing.insert(name_of(&slice), slice);
                }
                false
            }
            watcher::Event::InitDone => {
                if let Some(listing) = self.listing.take() {
                    self.slices = listing;
                }
                self.position = std::mem::take(&mut self.listing_position);
                if self.position.is_empty() {
                    // An empty list carries no object; the answer still needs a position.
                    self.position = "0".to_owned();
                }
                true
            }
            watcher::Event::Apply(slice) => {
                newest(&mut self.position, &slice);
                self.slices.insert(name_of(&slice), slice);
                true
            }
            watcher::Event::Delete(slice) => {
                newest(&mut self.position, &slice);
                self.slices.remove(&name_of(&slice));
                true
            }
        }
    }
}

/// Keeps in `position` the newer of it and the slice's resource version. Resource versions are
/// opaque; numeric ones (every real API server's) compare as numbers.
fn newest(position: &mut String, slice: &EndpointSlice) {
    let Some(version) = slice.metadata.resource_version.as_deref() else {
        return;
    };
    let newer = match (version.parse::<u64>(), position.parse::<u64>()) {
        (Ok(seen), Ok(known)) => seen > known,
        _ => true,
    };
    if newer {
        *position = version.to_owned();
    }
}

fn refused(url: &str, status: &kube::core::Status) -> DiscoveryError {
    let mut message = if status.message.is_empty() {
        status.reason.clone()
    } else {
        status.message.clone()
    };
    if status.code == 401 {
        message.push_str(" (the API server did not accept the bearer token)");
    }
    DiscoveryError::RegistryRefused {
        url: url.to_owned(),
        status: status.code,
        message,
    }
}

fn client_failed(url: &str, err: &kube::Error) -> DiscoveryError {
    match err {
        kube::Error::Api(status) => refused(url, status),
        // Our own request policy's refusals read better without kube's "ServiceError: ".
        kube::Error::Service(err) => DiscoveryError::HttpRequest {
            url: url.to_owned(),
            reason: error_chain(err.as_ref()),
        },
        kube::Error::SerdeError(err) => DiscoveryError::BadJson {
            url: url.to_owned(),
            reason: err.to_string(),
        },
        other => DiscoveryError::HttpRequest {
            url: url.to_owned(),
            reason: error_chain(other),
        },
    }
}

fn watcher_failed(url: &str, err: watcher::Error) -> DiscoveryError {
    match &err {
        watcher::Error::InitialListFailed(err) => client_failed(url, err),
        watcher::Error::WatchStartFailed(err) | watcher::Error::WatchFailed(err) => {
            client_failed(&format!("{url} (watch)"), err)
        }
        watcher::Error::WatchError(status) => refused(&format!("{url} (watch)"), status),
        watcher::Error::NoResourceVersion => DiscoveryError::BadDocument {
            url: url.to_owned(),
            location: "metadata.resourceVersion".to_owned(),
            reason: err.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::config;
    use crate::discovery::kubernetes::slices::tests::{endpoint, http_port, keys, slice};
    use serde_json::{json, Value};

    // -- Following a watch: kube-rs's events, scripted, in paused time ------------------------

    fn event_slice(name: &str, version: &str, addresses: &[&str]) -> EndpointSlice {
        let mut slice = slice(
            name,
            "IPv4",
            http_port(),
            Value::Array(
                addresses
                    .iter()
                    .map(|address| endpoint(address, true, true, false))
                    .collect(),
            ),
        );
        slice.metadata.resource_version = Some(version.to_owned());
        slice
    }

    type Item = Result<watcher::Event<EndpointSlice>, watcher::Error>;

    /// A follower over a channel of kube-rs events: the test sends events when it likes.
    fn scripted(timeout_ms: u64) -> (Follower, tokio::sync::mpsc::UnboundedSender<Item>) {
        let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
        let events = futures_util::stream::unfold(receiver, |mut receiver| async move {
            let item = receiver.recv().await?;
            Some((item, receiver))
        });
        let config = config::parse::<KubernetesConfig>(&json!({
            "service": "web", "timeout_ms": timeout_ms,
        }))
        .unwrap();
        let follower = Follower::new("https://api/list".to_owned(), &config, Box::pin(events));
        (follower, sender)
    }

    fn expired() -> watcher::Error {
        watcher::Error::WatchError(
            kube::core::Status::failure("too old", "Expired")
                .with_code(410)
                .boxed(),
        )
    }

    fn forbidden() -> watcher::Error {
        watcher::Error::WatchError(
            kube::core::Status::failure("endpointslices is forbidden", "Forbidden")
                .with_code(403)
                .boxed(),
        )
    }

    fn listed(sender: &tokio::sync::mpsc::UnboundedSender<Item>, slices: Vec<EndpointSlice>) {
        sender.send(Ok(watcher::Event::Init)).unwrap();
        for slice in slices {
            sender.send(Ok(watcher::Event::InitApply(slice))).unwrap();
        }
        sender.send(Ok(watcher::Event::InitDone)).unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_list_is_one_answer_with_the_newest_resource_version() {
        let (mut follower, sender) = scripted(5_000);
        listed(
            &sender,
            vec![
                event_slice("web-a", "12", &["10.0.0.1"]),
                event_slice("web-b", "9", &["10.0.0.2"]),
            ],
        );
        let answer = follower.next_answer().await.unwrap();
        assert_eq!(keys(&answer.discovered), ["10.0.0.1:8080", "10.0.0.2:8080"]);
        assert_eq!(answer.position, "12");
    }

    #[tokio::test(start_paused = true)]
    async fn changes_within_the_burst_window_are_one_set_later_ones_the_next() {
        let (mut follower, sender) = scripted(5_000);
        listed(&sender, vec![event_slice("web-a", "3", &["10.0.0.1"])]);
        follower.next_answer().await.unwrap();
        let started = tokio::time::Instant::now();
        sender
            .send(Ok(watcher::Event::Apply(event_slice(
                "web-a",
                "4",
                &["10.0.0.1", "10.0.0.2"],
            ))))
            .unwrap();
        let later = sender.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            later
                .send(Ok(watcher::Event::Apply(event_slice(
                    "web-b",
                    "5",
                    &["10.0.0.3"],
                ))))
                .unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
            later
                .send(Ok(watcher::Event::Delete(event_slice("web-b", "6", &[]))))
                .unwrap();
        });
        let burst = follower.next_answer().await.unwrap();
        assert_eq!(
            keys(&burst.discovered),
            ["10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080"]
        );
        assert_eq!(burst.position, "5");
        assert_eq!(started.elapsed(), BURST_WINDOW);
        let next = follower.next_answer().await.unwrap();
        assert_eq!(keys(&next.discovered), ["10.0.0.1:8080", "10.0.0.2:8080"]);
        assert_eq!(next.position, "6");
    }

    #[tokio::test(start_paused = true)]
    async fn a_410_relists_without_an_error_and_the_new_list_replaces_the_old() {
        let (mut follower, sender) = scripted(5_000);
        listed(
            &sender,
            vec![
                event_slice("web-a", "7", &["10.0.0.1"]),
                event_slice("web-b", "7", &["10.0.0.2"]),
            ],
        );
        follower.next_answer().await.unwrap();
        sender.send(Err(expired())).unwrap();
        // The relist (after an etcd restore: lower numbers) no longer has web-b.
        listed(&sender, vec![event_slice("web-a", "2", &["10.0.0.1"])]);
        let answer = follower.next_answer().await.unwrap();
        assert_eq!(keys(&answer.discovered), ["10.0.0.1:8080"]);
        assert_eq!(answer.position, "2");
    }

    #[tokio::test(start_paused = true)]
    async fn an_error_inside_a_burst_comes_after_the_burst_set() {
        let (mut follower, sender) = scripted(5_000);
        listed(&sender, vec![event_slice("web-a", "3", &["10.0.0.1"])]);
        follower.next_answer().await.unwrap();
        sender
            .send(Ok(watcher::Event::Apply(event_slice(
                "web-a",
                "4",
                &["10.0.0.1", "10.0.0.2"],
            ))))
            .unwrap();
        sender.send(Err(forbidden())).unwrap();
        let burst = follower.next_answer().await.unwrap();
        assert_eq!(keys(&burst.discovered), ["10.0.0.1:8080", "10.0.0.2:8080"]);
        let error = follower.next_answer().await.unwrap_err();
        assert_eq!(
            error.to_string(),
            "registry https://api/list (watch) answered HTTP 403: endpointslices is forbidden"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_relist_begun_inside_a_burst_leaves_the_answer_as_it_was() {
        let (mut follower, sender) = scripted(5_000);
        listed(&sender, vec![event_slice("web-a", "7", &["10.0.0.1"])]);
        follower.next_answer().await.unwrap();
        sender
            .send(Ok(watcher::Event::Apply(event_slice(
                "web-a",
                "8",
                &["10.0.0.1", "10.0.0.2"],
            ))))
            .unwrap();
        sender.send(Err(expired())).unwrap();
        sender.send(Ok(watcher::Event::Init)).unwrap();
        sender
            .send(Ok(watcher::Event::InitApply(event_slice(
                "web-a",
                "2",
                &["10.0.0.9"],
            ))))
            .unwrap();
        // The list is not done when the burst window ends: the set and position are the last
        // complete ones.
        let answer = follower.next_answer().await.unwrap();
        assert_eq!(keys(&answer.discovered), ["10.0.0.1:8080", "10.0.0.2:8080"]);
        assert_eq!(answer.position, "8");
        sender.send(Ok(watcher::Event::InitDone)).unwrap();
        let relisted = follower.next_answer().await.unwrap();
        assert_eq!(keys(&relisted.discovered), ["10.0.0.9:8080"]);
        assert_eq!(relisted.position, "2");
    }

    #[tokio::test(start_paused = true)]
    async fn a_list_that_stalls_fails_in_timeout_ms_but_an_idle_watch_never_does() {
        let (mut follower, sender) = scripted(700);
        sender.send(Ok(watcher::Event::Init)).unwrap();
        let started = tokio::time::Instant::now();
        let error = follower.next_answer().await.unwrap_err();
        assert_eq!(started.elapsed(), Duration::from_millis(700));
        assert_eq!(
            error.to_string(),
            "registry https://api/list could not be fetched: the list did not complete within \
             700 ms (timeout_ms)"
        );

        let (mut follower, sender) = scripted(700);
        listed(&sender, vec![event_slice("web-a", "3", &["10.0.0.1"])]);
        follower.next_answer().await.unwrap();
        let idle = tokio::time::timeout(Duration::from_secs(3_600), follower.next_answer()).await;
        assert!(idle.is_err(), "an idle watch waits: {idle:?}");
    }
}
