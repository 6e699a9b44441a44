//! One open watch: kube-rs's watcher events kept as the Service's slices, the Service object
//! followed beside them (its ports say which slice port `port` means), each change (with the
//! events that follow it within [`BURST_WINDOW`]) answered as one whole set, errors classified.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher;

use super::client::Connection;
use super::errors::{is_gone, watcher_failed};
use super::exec::ExecPlugin;
use super::ports::slice_port;
use super::service::{ServiceChanges, ServiceFollower};
use super::slices::{endpoints_of, name_of, Wanted};
use super::{watch_seconds, KubernetesConfig, PortRef, SERVICE_NAME_LABEL};
use crate::discovery::{DiscoveryError, WatchAnswer};

/// How many 410s in a row (without a list completed between them) are routine: an expired watch
/// and then an expired continue token during its relist are; a server answering 410 to every
/// request is a failure, not a loop.
const GONE_IN_A_ROW: u32 = 2;

/// The least time between two runs of the exec plugin to renew its token.
const MIN_RENEWAL_WAIT: Duration = Duration::from_secs(10);

/// How long after a change the events that follow it are taken into the same set. The
/// EndpointSlice controller writes a rollout's changes slice by slice, milliseconds apart, and
/// its slices follow a Service's edit as quickly.
const BURST_WINDOW: Duration = Duration::from_millis(50);

type SliceItem = Result<watcher::Event<EndpointSlice>, watcher::Error>;
type SliceEvents = Pin<Box<dyn Stream<Item = SliceItem> + Send>>;

/// Starts the slices' watcher again from a list (after a 410 kube-rs would not relist on).
type Relist = Box<dyn Fn() -> SliceEvents + Send>;

/// What came next: a slice event, or the Service's new state (boxed: a Service is large, and
/// the two sizes stay close).
#[allow(clippy::large_enum_variant)] // matched at once, never kept
enum Next {
    Slice(Option<SliceItem>),
    Service(Box<Option<Result<Service, DiscoveryError>>>),
}

/// One open watch: kube-rs's watcher, the slices it reported, the Service, and what the config
/// asks of them.
pub(super) struct Follower {
    url: String,
    service_url: String,
    /// "shop/web", as errors name the Service.
    shown: String,
    port: Option<PortRef>,
    config: Arc<KubernetesConfig>,
    list_timeout: Duration,
    events: SliceEvents,
    relist: Option<Relist>,
    service: Service,
    service_changes: ServiceChanges,
    slices: SliceSet,
    /// 410s since the last complete list (see [`GONE_IN_A_ROW`]).
    gone_in_a_row: u32,
    exec: Option<Arc<ExecPlugin>>,
    /// An error that ended the watch while a burst was being gathered: reported after the
    /// burst's set.
    pending_error: Option<DiscoveryError>,
}

impl Follower {
    pub(super) async fn open(config: &Arc<KubernetesConfig>) -> Result<Follower, DiscoveryError> {
        let connection = Connection::open(config).await?;
        let services =
            kube::Api::<Service>::namespaced(connection.client.clone(), &connection.namespace);
        let mut service_follower = ServiceFollower::new(
            services,
            &config.service,
            &connection.namespace,
            connection.service_url.clone(),
            watch_seconds(config),
            Duration::from_millis(config.timeout_ms),
        );
        // A missing Service fails the watch before its slices are read.
        let service = service_follower.get().await?;
        let api = kube::Api::<EndpointSlice>::namespaced(
            connection.client.clone(),
            &connection.namespace,
        );
        let watch_config = watcher::Config::default()
            .labels(&format!("{SERVICE_NAME_LABEL}={}", config.service))
            .timeout(watch_seconds(config));
        let relist: Relist = Box::new(move || Box::pin(watcher(api.clone(), watch_config.clone())));
        let mut follower = Follower::new(
            connection.shown_url,
            config,
            relist(),
            service,
            service_follower.changes(),
        );
        follower.service_url = connection.service_url;
        follower.shown = format!("{}/{}", connection.namespace, config.service);
        follower.relist = Some(relist);
        follower.exec = connection.exec;
        Ok(follower)
    }

    fn new(
        url: String,
        config: &Arc<KubernetesConfig>,
        events: SliceEvents,
        service: Service,
        service_changes: ServiceChanges,
    ) -> Follower {
        Follower {
            service_url: url.clone(),
            url,
            shown: config.service.clone(),
            port: config.port.clone(),
            config: Arc::clone(config),
            list_timeout: Duration::from_millis(config.timeout_ms),
            events,
            relist: None,
            service,
            service_changes,
            slices: SliceSet::default(),
            gone_in_a_row: 0,
            exec: None,
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
    /// it, so a burst (a rollout touching several slices, a scale-up written slice by slice, a
    /// Service edit and the slices that follow it) is one set and one reconcile.
    async fn next_answer(&mut self) -> Result<WatchAnswer, DiscoveryError> {
        if let Some(error) = self.pending_error.take() {
            return Err(error);
        }
        let mut burst_ends: Option<tokio::time::Instant> = None;
        loop {
            let next = match burst_ends {
                Some(deadline) => match tokio::time::timeout_at(deadline, self.next()).await {
                    Ok(next) => next?,
                    Err(_) => return self.answer(),
                },
                None => self.next_within_list_timeout().await?,
            };
            let changed = match next {
                Next::Service(service) => match *service {
                    Some(Ok(service)) => Ok(self.service_changed(service)),
                    Some(Err(error)) => Err(error),
                    None => Err(DiscoveryError::WatchEnded),
                },
                Next::Slice(Some(Ok(event))) => {
                    if matches!(event, watcher::Event::InitDone) {
                        self.gone_in_a_row = 0;
                    }
                    Ok(self.slices.apply(event))
                }
                Next::Slice(Some(Err(err))) => self.gone_or_failed(err).map(|()| false),
                Next::Slice(None) => Err(DiscoveryError::WatchEnded),
            };
            match changed {
                Ok(true) if burst_ends.is_none() => {
                    burst_ends = Some(tokio::time::Instant::now() + BURST_WINDOW);
                }
                Ok(_) => {}
                Err(error) if burst_ends.is_some() => {
                    self.pending_error = Some(error);
                    return self.answer();
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// A 410 Gone, however it came, starts a relist (kube-rs relists by itself after an ERROR
    /// event or a failed list page, not after a watch request answered 410); anything else
    /// ends the watch.
    fn gone_or_failed(&mut self, err: watcher::Error) -> Result<(), DiscoveryError> {
        if !is_gone(&err) || self.gone_in_a_row >= GONE_IN_A_ROW {
            return Err(watcher_failed(&self.url, err));
        }
        tracing::debug!(url = %self.url, error = %err, "history compacted (410 Gone); relisting");
        self.gone_in_a_row += 1;
        if matches!(err, watcher::Error::WatchStartFailed(_)) {
            if let Some(relist) = &self.relist {
                self.events = relist();
            }
        }
        Ok(())
    }

    /// True when the Service's new state may change the set.
    fn service_changed(&mut self, service: Service) -> bool {
        if service.metadata.resource_version == self.service.metadata.resource_version {
            return false;
        }
        self.service = service;
        true
    }

    /// The next event; while a list is under way, within `timeout_ms` (a page, or the
    /// trampolined steps between pages).
    async fn next_within_list_timeout(&mut self) -> Result<Next, DiscoveryError> {
        if !self.slices.awaiting_list() {
            return self.next().await;
        }
        let list_timeout = self.list_timeout;
        match tokio::time::timeout(list_timeout, self.next()).await {
            Ok(next) => next,
            Err(_) => Err(DiscoveryError::HttpRequest {
                url: self.url.clone(),
                reason: format!(
                    "the list did not complete within {} ms (timeout_ms)",
                    list_timeout.as_millis()
                ),
            }),
        }
    }

    /// The next slice event or Service state; meanwhile the exec plugin's token is renewed
    /// when it is due.
    async fn next(&mut self) -> Result<Next, DiscoveryError> {
        loop {
            let renew_at = self
                .exec
                .as_ref()
                .and_then(|plugin| plugin.renew_at())
                .map(|at| {
                    // A token that expires within the margin is not renewed in a loop.
                    let wait = (at - crate::clock::now())
                        .to_std()
                        .unwrap_or_default()
                        .max(MIN_RENEWAL_WAIT);
                    tokio::time::Instant::now() + wait
                });
            let renewal = async {
                match renew_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                event = self.events.next() => return Ok(Next::Slice(event)),
                service = self.service_changes.next() => return Ok(Next::Service(Box::new(service))),
                () = renewal => {
                    if let Some(plugin) = &self.exec {
                        plugin.renew().await?;
                    }
                }
            }
        }
    }

    fn answer(&self) -> Result<WatchAnswer, DiscoveryError> {
        let port =
            slice_port(&self.service, self.port.as_ref(), &self.shown).map_err(|reason| {
                DiscoveryError::BadDocument {
                    url: self.service_url.clone(),
                    location: "spec.ports".to_owned(),
                    reason,
                }
            })?;
        let wanted = Wanted::of(&self.config, port);
        let discovered = endpoints_of(&self.slices.slices, &wanted).map_err(|reason| {
            DiscoveryError::BadDocument {
                url: self.url.clone(),
                location: format!("Service {}", self.shown),
                reason,
            }
        })?;
        let mut position = self.slices.position.clone();
        if let Some(version) = self.service.metadata.resource_version.as_deref() {
            keep_newest(&mut position, version);
        }
        Ok(WatchAnswer {
            discovered,
            position,
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

/// Keeps in `position` the newer of it and the slice's resource version.
fn newest(position: &mut String, slice: &EndpointSlice) {
    if let Some(version) = slice.metadata.resource_version.as_deref() {
        keep_newest(position, version);
    }
}

/// Keeps in `position` the newer of it and `version`. Resource versions are opaque; numeric
/// ones (every real API server's) compare as numbers.
fn keep_newest(position: &mut String, version: &str) {
    let newer = match (version.parse::<u64>(), position.parse::<u64>()) {
        (Ok(seen), Ok(known)) => seen > known,
        _ => true,
    };
    if newer {
        *position = version.to_owned();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::config;
    use crate::discovery::kubernetes::ports::tests::service;
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
    type ServiceItem = Result<Service, DiscoveryError>;

    fn channel<T: Send + 'static>() -> (
        tokio::sync::mpsc::UnboundedSender<T>,
        Pin<Box<dyn Stream<Item = T> + Send>>,
    ) {
        let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
        let stream = futures_util::stream::unfold(receiver, |mut receiver| async move {
            let item = receiver.recv().await?;
            Some((item, receiver))
        });
        (sender, Box::pin(stream))
    }

    /// Service web: port 80 "http" → 8080 and 81 "alt" → 8081, at resource version `version`.
    fn web_service(version: &str, http: i32, alt: i32) -> Service {
        let mut service = service(json!([
            {"name": "http", "port": http, "targetPort": 8080, "protocol": "TCP"},
            {"name": "alt", "port": alt, "targetPort": 8081, "protocol": "TCP"},
        ]));
        service.metadata.resource_version = Some(version.to_owned());
        service
    }

    /// A follower over channels of kube-rs events and Service states: the test sends them when
    /// it likes. `port` 80 is the Service port "http".
    fn scripted_with_service(
        timeout_ms: u64,
    ) -> (
        Follower,
        tokio::sync::mpsc::UnboundedSender<Item>,
        tokio::sync::mpsc::UnboundedSender<ServiceItem>,
    ) {
        let (sender, events) = channel::<Item>();
        let (services, changes) = channel::<ServiceItem>();
        let config = Arc::new(
            config::parse::<KubernetesConfig>(&json!({
                "service": "web", "timeout_ms": timeout_ms, "port": 80,
            }))
            .unwrap(),
        );
        let follower = Follower::new(
            "https://api/list".to_owned(),
            &config,
            events,
            web_service("1", 80, 81),
            changes,
        );
        (follower, sender, services)
    }

    fn scripted(timeout_ms: u64) -> (Follower, tokio::sync::mpsc::UnboundedSender<Item>) {
        let (mut follower, sender, _) = scripted_with_service(timeout_ms);
        // The Service never changes (and its watch never ends).
        follower.service_changes = Box::pin(futures_util::stream::pending());
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

    fn two_ports(name: &str, version: &str, address: &str) -> EndpointSlice {
        let mut slice = slice(
            name,
            "IPv4",
            json!([
                {"name": "http", "port": 8080, "protocol": "TCP"},
                {"name": "alt", "port": 8081, "protocol": "TCP"},
            ]),
            json!([endpoint(address, true, true, false)]),
        );
        slice.metadata.resource_version = Some(version.to_owned());
        slice
    }

    #[tokio::test(start_paused = true)]
    async fn a_service_edit_alone_maps_the_port_anew() {
        let (mut follower, sender, services) = scripted_with_service(5_000);
        listed(&sender, vec![two_ports("web-a", "3", "10.0.0.1")]);
        let first = follower.next_answer().await.unwrap();
        assert_eq!(keys(&first.discovered), ["10.0.0.1:8080"]);
        assert_eq!(first.position, "3");
        // Port 80 now is "alt": the same slices, another endpoint port.
        services.send(Ok(web_service("9", 82, 80))).unwrap();
        let remapped = follower.next_answer().await.unwrap();
        assert_eq!(keys(&remapped.discovered), ["10.0.0.1:8081"]);
        assert_eq!(remapped.position, "9");
        // The Service without port 80: a failed refresh naming it.
        services.send(Ok(web_service("10", 82, 83))).unwrap();
        let error = follower.next_answer().await.unwrap_err();
        assert!(
            error
                .to_string()
                .contains("spec.ports: Service web has no port 80"),
            "{error}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_same_service_again_is_no_change() {
        let (mut follower, sender, services) = scripted_with_service(5_000);
        listed(&sender, vec![two_ports("web-a", "3", "10.0.0.1")]);
        follower.next_answer().await.unwrap();
        services.send(Ok(web_service("1", 80, 81))).unwrap();
        let idle = tokio::time::timeout(Duration::from_secs(3_600), follower.next_answer()).await;
        assert!(
            idle.is_err(),
            "no answer for an unchanged Service: {idle:?}"
        );
    }

    fn list_gone() -> watcher::Error {
        watcher::Error::InitialListFailed(kube::Error::Api(
            kube::core::Status::failure("The provided continue parameter is too old", "Expired")
                .with_code(410)
                .boxed(),
        ))
    }

    #[tokio::test(start_paused = true)]
    async fn a_410_on_a_list_page_relists_and_a_third_in_a_row_fails() {
        let (mut follower, sender) = scripted(5_000);
        listed(&sender, vec![event_slice("web-a", "7", &["10.0.0.1"])]);
        follower.next_answer().await.unwrap();
        // A relist whose second page finds its continue token expired: kube-rs lists again.
        sender.send(Err(expired())).unwrap();
        sender.send(Ok(watcher::Event::Init)).unwrap();
        sender.send(Err(list_gone())).unwrap();
        listed(
            &sender,
            vec![event_slice("web-a", "9", &["10.0.0.1", "10.0.0.2"])],
        );
        let answer = follower.next_answer().await.unwrap();
        assert_eq!(keys(&answer.discovered), ["10.0.0.1:8080", "10.0.0.2:8080"]);
        // Once the relist completed, 410s are routine again; three before a list completes are
        // not.
        for _ in 0..3 {
            sender.send(Ok(watcher::Event::Init)).unwrap();
            sender.send(Err(list_gone())).unwrap();
        }
        let error = follower.next_answer().await.unwrap_err();
        assert!(error.to_string().contains("answered HTTP 410"), "{error}");
    }
}
