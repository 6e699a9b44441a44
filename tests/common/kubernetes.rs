//! An in-process fake of the Kubernetes API server's EndpointSlice endpoints (`discovery.k8s.io/v1`),
//! served over HTTP/1.1 (or HTTPS) on 127.0.0.1:0, for the integration tests of the `kubernetes`
//! discovery provider. It serves what a kube-rs `watcher` over `Api::<EndpointSlice>` asks for:
//!
//! - `GET /apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices` (and the all-namespaces
//!   `GET /apis/discovery.k8s.io/v1/endpointslices`): a **list**, or with `watch` a **watch**;
//! - `GET /apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices/{name}`: a **get**;
//! - core/v1 Services, which the provider reads for their ports:
//!   `GET /api/v1/namespaces/{namespace}/services/{name}` (a get) and
//!   `GET /api/v1/namespaces/{namespace}/services` (and `/api/v1/services`) as a list or, with
//!   `watch`, a watch (with `fieldSelector=metadata.name=<name>` to watch one).
//!
//! The controls are what the provider tests need: write and delete slices, compact the history,
//! restart the "API server" with a new history, end watches, send bookmarks, require a bearer
//! token, deny by RBAC, fail, hang, stop and restart on the same port, and count what was asked.
//!
//! Written from the Kubernetes documentation and source, not from what the client under test
//! happens to expect:
//! - api-concepts, "Efficient detection of changes": the list is
//!   `{"kind":"EndpointSliceList","apiVersion":"discovery.k8s.io/v1","metadata":{"resourceVersion":..},
//!   "items":[..]}`; a watch is a `200` with `Transfer-Encoding: chunked`, `Content-Type:
//!   application/json`, one JSON document `{"type":..,"object":..}` per event (the apiserver's JSON
//!   framer ends each with a newline); the events from `resourceVersion=N` are every change after N.
//! - api-concepts, "Collections": the items of a list carry no `kind`/`apiVersion` (the documented
//!   `ServiceList` example), the objects of watch events do.
//! - api-concepts, "Watch bookmarks": a `BOOKMARK` only with `allowWatchBookmarks=true`, its object
//!   of the requested kind with only `metadata.resourceVersion` set, sent at the server's
//!   discretion. As Go serializes an empty `EndpointSlice`, the object also has the fields without
//!   `omitempty` (`addressType: ""`, `endpoints: null`, `ports: null`; k8s.io/api
//!   `discovery/v1/types.go`), and no `creationTimestamp` (`omitzero` in current apimachinery).
//!   The cacher (`storage/cacher/cacher.go` `dispatchEvents`) stamps a bookmark with the last
//!   resourceVersion it processed for the whole resource, not only the watcher's objects.
//! - api-concepts, "Streaming lists" and apimachinery `internalversion/defaults.go`
//!   `SetListOptionsDefaults` (the `WatchList` gate is beta and on by default in 1.34,
//!   feature-gates/WatchList.md): a watch from `resourceVersion` unset or `0` without
//!   `sendInitialEvents`/`resourceVersionMatch` is treated as `sendInitialEvents=true&
//!   resourceVersionMatch=NotOlderThan`, so it starts with synthetic `ADDED` events for the current
//!   objects ("Semantics for watch": "Get State and Start at Most Recent/Any") and, when bookmarks
//!   are allowed, a `BOOKMARK` annotated `k8s.io/initial-events-end: "true"` after them.
//!   `internalversion/validation` `ValidateListOptions`: `sendInitialEvents` without
//!   `resourceVersionMatch=NotOlderThan`, or `resourceVersionMatch` without `sendInitialEvents` on a
//!   watch, is `422 Invalid`.
//! - api-concepts, "Resource versions" / "Semantics for get and list": one global, increasing
//!   resourceVersion (etcd's revision) in decimal strings; for a list, unset = Most Recent,
//!   `0` = Any, `N` = Not older than (or Exact with `limit`), `resourceVersionMatch=Exact` = Exact,
//!   `resourceVersionMatch` without `resourceVersion`, or `Exact` with `0`, is invalid (422), and
//!   `continue` with a `resourceVersion` other than unset/`0` is `400 Bad Request`
//!   ("specifying resource version is not allowed when using continue").
//! - api-concepts, "Retrieving large results sets in chunks": `limit` + `continue`, the
//!   collection's `resourceVersion` constant across the pages (a consistent snapshot),
//!   `remainingItemCount` only without selectors; an expired `continue` is `410 Gone`. The token is
//!   opaque; the fake encodes it like `storage.EncodeContinue` (base64url of
//!   `{"v":"meta.k8s.io/v1","rv":N,"start":"<key>\u0000"}`). KEP-4988 and the cacher's
//!   `computeListLimit` ("as of today, the limit is ignored for requests that set RV == 0"): a list
//!   at `resourceVersion=0` answers every item, without `continue`, whatever the `limit`.
//! - api-concepts, "410 Gone responses" and `storage/etcd3/errors.go`: an Exact list below the
//!   compacted revision is `410` reason `Expired` "The resourceVersion for the provided list is too
//!   old."; an expired `continue` is `410` `Expired` with the "The provided continue parameter is
//!   too old ..." message and, in the Status `metadata.continue`, a token that goes on at the latest
//!   resourceVersion (`handleCompactedErrorForPaging`, rv -1).
//! - `storage/cacher/watch_cache.go` `getAllEventsSinceLocked` and `cacher.go` `Watch` ("other
//!   errors must fail with a watch event of type ERROR"): a watch from a resourceVersion older than
//!   the kept history is answered `200` with one `ERROR` event whose object is
//!   `{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"too old
//!   resource version: N (M)","reason":"Expired","code":410}` (M = the oldest kept - 1), then the
//!   stream ends. A watch from a resourceVersion newer than the current one waits for it.
//! - `storage/cacher/cache_watcher.go` `convertToWatchEvent` and `cacher.go` `setCachingObjects`:
//!   with a selector, an object that stops matching is sent as `DELETED` (its previous content at
//!   the new resourceVersion), one that starts matching as `ADDED`; a deletion is sent with the
//!   object's last content at the deletion's resourceVersion.
//! - `storage/errors.go` `NewTooLargeResourceVersionError` and the watch cache's 3 s
//!   `blockTimeout`: a list not older than a resourceVersion the server has not reached waits up to
//!   3 s for it, then answers `504` reason `Timeout` "Timeout: Too large resource version: N,
//!   current: M" with `retryAfterSeconds: 1`.
//! - `endpoints/handlers/get.go` `ListResource`: `timeoutSeconds` ends the watch cleanly (the
//!   chunked body is terminated); without it the server picks a timeout of at least
//!   `--min-request-timeout` (1800 s), which is what the fake uses.
//! - apimachinery `labels/selector.go` (the parser, its error texts, "unable to parse requirement:"
//!   for errors inside one requirement) and `fields/selector.go`; a bad selector is `400
//!   BadRequest`. The EndpointSlice field selectors are `metadata.name` and `metadata.namespace`;
//!   any other is `400` "field label not supported: <field>". `watch`, `allowWatchBookmarks` and
//!   `sendInitialEvents` are read as apimachinery `Convert_Slice_string_To_bool` reads them: "0",
//!   "f", "false", "n", "no" (any case) are false, anything else (even empty) true.
//! - Authentication and RBAC (`Status` bodies as the apiserver writes them): no or another bearer
//!   token is `401` `{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",
//!   "message":"Unauthorized","reason":"Unauthorized","code":401}`; a denial is `403` reason
//!   `Forbidden`, message `endpointslices.discovery.k8s.io is forbidden: User
//!   "system:serviceaccount:raahi:gateway" cannot list resource "endpointslices" in API group
//!   "discovery.k8s.io" in the namespace "<ns>"` (`watch` for a watch, `at the cluster scope` for
//!   the all-namespaces path), `details: {"group":"discovery.k8s.io","kind":"endpointslices"}`.
//! - Other paths are `404` "the server could not find the requested resource" (reason `NotFound`);
//!   a method other than GET is `405` "the server does not allow this method on the requested
//!   resource" (reason `MethodNotAllowed`): the fake serves reads only.
//! - The EndpointSlice controller's output: labels `kubernetes.io/service-name` and
//!   `endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io`, ports with
//!   `protocol: TCP` and `name: ""` for an unnamed port; `endpoints`/`ports` serialize as `null`
//!   when empty (no `omitempty`; an empty list read back from etcd's protobuf is nil). An update
//!   that changes nothing is not written (no new resourceVersion, no event); `generation` goes up
//!   only when `addressType`, `endpoints` or `ports` change (the registry strategy).
//!
//! - Services (api-concepts; k8s.io/api `core/v1/types.go`; `registry/core/service`): a Service
//!   is `{"kind":"Service","apiVersion":"v1","metadata":{..},"spec":{"ports":[{"name","protocol",
//!   "port","targetPort"}],"selector","clusterIP","clusterIPs","type","sessionAffinity",
//!   "ipFamilies","ipFamilyPolicy","internalTrafficPolicy"},"status":{"loadBalancer":{}}}`; a
//!   ServicePort's `name` is `omitempty` (a single port may be unnamed), `targetPort` an int or a
//!   string; a Service has no `generation`. They share the one resourceVersion sequence (etcd's
//!   revision) with the slices. A missing one is `404` `services "<name>" not found` with
//!   `details: {"name": .., "kind": "services"}` (no group: the core group is ""). Its field
//!   selectors are `metadata.name`, `metadata.namespace`, `spec.clusterIP` and `spec.type`. An
//!   empty Service as Go serializes it, for a bookmark: `"spec":{}`, `"status":{"loadBalancer":{}}`.
//! - RBAC denials on Services: `services "<name>" is forbidden: User "<user>" cannot <verb>
//!   resource "services" in API group "" in the namespace "<ns>"`, details `{"name": ..,
//!   "kind": "services"}`. A list or watch with a `metadata.name` field selector is authorized
//!   (and denied) with that name (the request info carries it, so RBAC `resourceNames` can allow
//!   it), hence `services "web" is forbidden` for the watch of one Service too.
//!
//! Two behaviours are switched on by a control rather than always, as only some servers show
//! them: [`KubeFake::expire_watches_with_status`] answers a watch from a compacted resourceVersion
//! with HTTP `410` and the `Expired` Status (what a watch served without the watch cache, or by
//! a proxy or aggregated API server that checks the version before streaming, answers; api-concepts
//! "410 Gone responses": "clients must handle the case by recognizing the status code 410 Gone")
//! instead of the `200` stream with one `ERROR` event; [`KubeFake::compact_before_next_continue`]
//! moves the resourceVersion on and compacts the history just before the next page with a
//! `continue` token is read, as other writes and an etcd compaction between two pages do.
//!
//! Simplifications: the watch cache and etcd share one history (`compact()` expires both); a
//! `sendInitialEvents=true` watch from a resourceVersion not reached yet starts at the current one
//! instead of waiting; a malformed `resourceVersion` is answered `500` with Go's parse error text
//! (what `ErrorToAPIStatus` makes of the storage's InvalidError); label-value validation messages
//! are shortened; `forbid` names one namespace; writes (POST, PUT, PATCH, DELETE) are not served.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderValue, AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Map, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

use super::fake_server::{rebind, Listening};

/// The API group and version served.
pub const GROUP: &str = "discovery.k8s.io";
pub const API_VERSION: &str = "discovery.k8s.io/v1";
/// The user every authenticated request is made as (RBAC denials name it).
pub const SERVICE_ACCOUNT: &str = "system:serviceaccount:raahi:gateway";
/// The labels the EndpointSlice controller sets.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
pub const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
pub const MANAGED_BY_CONTROLLER: &str = "endpointslice-controller.k8s.io";
/// The annotation of the bookmark that ends a watch's initial events.
pub const INITIAL_EVENTS_END: &str = "k8s.io/initial-events-end";
/// The watch cache's `blockTimeout`: how long a read for a future resourceVersion waits.
const BLOCK_TIMEOUT: Duration = Duration::from_secs(3);
/// The watch timeout without `timeoutSeconds`: `--min-request-timeout` (its lower bound).
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);
const EXPIRED_LIST: &str = "The resourceVersion for the provided list is too old.";
const INCONSISTENT_CONTINUE: &str = "The provided continue parameter is too old to display a \
consistent list result. You can start a new list without the continue parameter, or use the \
continue token in this response to retrieve the remainder of the results. Continuing with the \
provided token results in an inconsistent list - objects that were created, modified, or deleted \
between the time the first chunk was returned and now may show up in the list.";

/// One endpoint of a [`Slice`]: `Ep::new(&["10.0.0.1"])`, ready, serving and not terminating.
#[derive(Clone, Debug)]
pub struct Ep {
    addresses: Vec<String>,
    ready: Option<bool>,
    serving: Option<bool>,
    terminating: Option<bool>,
    node: Option<String>,
    zone: Option<String>,
    pod: Option<String>,
    hostname: Option<String>,
    for_zones: Option<Vec<String>>,
}

impl Ep {
    /// An endpoint with these addresses and conditions ready=true, serving=true,
    /// terminating=false.
    pub fn new(addresses: &[&str]) -> Ep {
        Ep {
            addresses: addresses.iter().map(|a| (*a).to_owned()).collect(),
            ready: Some(true),
            serving: Some(true),
            terminating: Some(false),
            node: None,
            zone: None,
            pod: None,
            hostname: None,
            for_zones: None,
        }
    }

    /// `conditions.ready` (None: absent, which clients must read as ready).
    pub fn ready(mut self, ready: Option<bool>) -> Ep {
        self.ready = ready;
        self
    }

    /// `conditions.serving` (None: absent).
    pub fn serving(mut self, serving: Option<bool>) -> Ep {
        self.serving = serving;
        self
    }

    /// `conditions.terminating` (None: absent).
    pub fn terminating(mut self, terminating: Option<bool>) -> Ep {
        self.terminating = terminating;
        self
    }

    /// `nodeName`
    pub fn node(mut self, node: &str) -> Ep {
        self.node = Some(node.to_owned());
        self
    }

    /// `zone`
    pub fn zone(mut self, zone: &str) -> Ep {
        self.zone = Some(zone.to_owned());
        self
    }

    /// `targetRef: {kind: Pod, namespace: <the slice's>, name: pod}`
    pub fn pod(mut self, pod: &str) -> Ep {
        self.pod = Some(pod.to_owned());
        self
    }

    /// `hints.forZones`: the zones the EndpointSlice controller allocated the endpoint to
    /// (discovery.k8s.io/v1 `EndpointHints`: a list of `{"name": zone}`, at most 8).
    pub fn for_zones(mut self, zones: &[&str]) -> Ep {
        assert!(zones.len() <= 8, "the API allows at most 8 forZones");
        self.for_zones = Some(zones.iter().map(|zone| (*zone).to_owned()).collect());
        self
    }

    /// `hostname`
    pub fn hostname(mut self, hostname: &str) -> Ep {
        self.hostname = Some(hostname.to_owned());
        self
    }

    fn to_json(&self, namespace: &str) -> Value {
        let mut endpoint = Map::new();
        endpoint.insert("addresses".into(), json!(self.addresses));
        let mut conditions = Map::new();
        for (name, value) in [
            ("ready", self.ready),
            ("serving", self.serving),
            ("terminating", self.terminating),
        ] {
            if let Some(value) = value {
                conditions.insert(name.into(), Value::Bool(value));
            }
        }
        endpoint.insert("conditions".into(), Value::Object(conditions));
        if let Some(hostname) = &self.hostname {
            endpoint.insert("hostname".into(), json!(hostname));
        }
        if let Some(pod) = &self.pod {
            endpoint.insert(
                "targetRef".into(),
                json!({"kind": "Pod", "namespace": namespace, "name": pod}),
            );
        }
        if let Some(node) = &self.node {
            endpoint.insert("nodeName".into(), json!(node));
        }
        if let Some(zone) = &self.zone {
            endpoint.insert("zone".into(), json!(zone));
        }
        if let Some(zones) = &self.for_zones {
            let for_zones: Vec<Value> = zones.iter().map(|zone| json!({"name": zone})).collect();
            endpoint.insert("hints".into(), json!({"forZones": for_zones}));
        }
        Value::Object(endpoint)
    }
}

/// An EndpointSlice as the EndpointSlice controller writes it, for [`KubeFake::apply`].
#[derive(Clone, Debug)]
pub struct Slice {
    pub namespace: String,
    pub name: String,
    pub service: String,
    address_type: String,
    ports: Vec<(Option<String>, u16)>,
    endpoints: Vec<Ep>,
    labels: BTreeMap<String, String>,
}

impl Slice {
    /// Slice `name` of `service` in `namespace`: `addressType: IPv4`, no endpoints, no ports, the
    /// labels `kubernetes.io/service-name=<service>` and
    /// `endpointslice.kubernetes.io/managed-by=endpointslice-controller.k8s.io`.
    pub fn new(namespace: &str, name: &str, service: &str) -> Slice {
        let mut labels = BTreeMap::new();
        labels.insert(SERVICE_NAME_LABEL.to_owned(), service.to_owned());
        labels.insert(
            MANAGED_BY_LABEL.to_owned(),
            MANAGED_BY_CONTROLLER.to_owned(),
        );
        Slice {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            service: service.to_owned(),
            address_type: "IPv4".to_owned(),
            ports: Vec::new(),
            endpoints: Vec::new(),
            labels,
        }
    }

    /// `addressType`: "IPv4" (default), "IPv6" or "FQDN".
    pub fn address_type(mut self, address_type: &str) -> Slice {
        self.address_type = address_type.to_owned();
        self
    }

    /// Adds a TCP port; `None` is an unnamed port (`name: ""`, as the controller writes it).
    pub fn port(mut self, name: Option<&str>, port: u16) -> Slice {
        self.ports.push((name.map(str::to_owned), port));
        self
    }

    /// Adds an endpoint.
    pub fn endpoint(mut self, endpoint: Ep) -> Slice {
        self.endpoints.push(endpoint);
        self
    }

    /// Sets a label (also to override the two the controller sets).
    pub fn label(mut self, key: &str, value: &str) -> Slice {
        self.labels.insert(key.to_owned(), value.to_owned());
        self
    }

    /// The object as a client would write it: no server-set metadata.
    pub fn to_json(&self) -> Value {
        let endpoints: Vec<Value> = self
            .endpoints
            .iter()
            .map(|endpoint| endpoint.to_json(&self.namespace))
            .collect();
        let ports: Vec<Value> = self
            .ports
            .iter()
            .map(|(name, port)| {
                json!({"name": name.clone().unwrap_or_default(), "protocol": "TCP", "port": port})
            })
            .collect();
        json!({
            "kind": "EndpointSlice",
            "apiVersion": API_VERSION,
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": self.labels,
            },
            "addressType": self.address_type,
            "endpoints": if endpoints.is_empty() { Value::Null } else { Value::Array(endpoints) },
            "ports": if ports.is_empty() { Value::Null } else { Value::Array(ports) },
        })
    }
}

/// A ServicePort's `targetPort`: a number or a container port's name.
#[derive(Clone, Debug)]
pub enum TargetPort {
    Number(u16),
    Name(String),
}

/// A core/v1 Service, for [`KubeFake::apply_service`]: `type: ClusterIP`, selector `app=<name>`.
#[derive(Clone, Debug)]
pub struct Svc {
    pub namespace: String,
    pub name: String,
    ports: Vec<(Option<String>, u16, Option<TargetPort>, String)>,
    headless: bool,
    external_name: Option<String>,
}

impl Svc {
    pub fn new(namespace: &str, name: &str) -> Svc {
        Svc {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            ports: Vec::new(),
            headless: false,
            external_name: None,
        }
    }

    /// Adds a TCP port `port` (named or not) mapped to `target` (None: the same number, as the
    /// API server defaults it).
    pub fn port(self, name: Option<&str>, port: u16, target: Option<TargetPort>) -> Svc {
        self.port_with_protocol(name, port, target, "TCP")
    }

    pub fn port_with_protocol(
        mut self,
        name: Option<&str>,
        port: u16,
        target: Option<TargetPort>,
        protocol: &str,
    ) -> Svc {
        self.ports
            .push((name.map(str::to_owned), port, target, protocol.to_owned()));
        self
    }

    /// `clusterIP: None`.
    pub fn headless(mut self) -> Svc {
        self.headless = true;
        self
    }

    /// `type: ExternalName` with this name.
    pub fn external_name(mut self, name: &str) -> Svc {
        self.external_name = Some(name.to_owned());
        self
    }

    /// The object as a client would write it, with the fields the API server defaults.
    pub fn to_json(&self) -> Value {
        let ports: Vec<Value> = self
            .ports
            .iter()
            .map(|(name, port, target, protocol)| {
                let mut value = json!({"protocol": protocol, "port": port});
                if let Some(name) = name {
                    value["name"] = json!(name);
                }
                value["targetPort"] = match target {
                    None => json!(port),
                    Some(TargetPort::Number(number)) => json!(number),
                    Some(TargetPort::Name(name)) => json!(name),
                };
                value
            })
            .collect();
        let mut spec = json!({"sessionAffinity": "None"});
        if !ports.is_empty() {
            spec["ports"] = json!(ports);
        }
        match &self.external_name {
            Some(external) => {
                spec["type"] = json!("ExternalName");
                spec["externalName"] = json!(external);
            }
            None => {
                let ip = if self.headless { "None" } else { "10.96.0.10" };
                spec["type"] = json!("ClusterIP");
                spec["clusterIP"] = json!(ip);
                spec["clusterIPs"] = json!([ip]);
                spec["selector"] = json!({"app": self.name});
                spec["ipFamilies"] = json!(["IPv4"]);
                spec["ipFamilyPolicy"] = json!("SingleStack");
                spec["internalTrafficPolicy"] = json!("Cluster");
            }
        }
        json!({
            "kind": "Service",
            "apiVersion": "v1",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": spec,
            "status": {"loadBalancer": {}},
        })
    }
}

/// The resources served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resource {
    EndpointSlices,
    Services,
}

impl Resource {
    fn kind(self) -> &'static str {
        match self {
            Resource::EndpointSlices => "EndpointSlice",
            Resource::Services => "Service",
        }
    }

    /// etcd's key prefix: objects are listed in key order.
    fn key(self, namespace: &str, name: &str) -> String {
        match self {
            Resource::EndpointSlices => format!("/registry/endpointslices/{namespace}/{name}"),
            Resource::Services => format!("/registry/services/specs/{namespace}/{name}"),
        }
    }

    fn plural(self) -> &'static str {
        match self {
            Resource::EndpointSlices => "endpointslices",
            Resource::Services => "services",
        }
    }

    fn group(self) -> &'static str {
        match self {
            Resource::EndpointSlices => GROUP,
            Resource::Services => "",
        }
    }

    /// `GroupResource.String()`: `services`, `endpointslices.discovery.k8s.io`.
    fn qualified(self) -> String {
        match self.group() {
            "" => self.plural().to_owned(),
            group => format!("{}.{group}", self.plural()),
        }
    }
}

/// One write to the store, kept as history: `object` is the new content (None for a deletion),
/// `previous` the content it replaced, with its own resourceVersion.
struct Change {
    rv: u64,
    key: String,
    object: Option<Value>,
    previous: Option<Value>,
}

/// What a list or watch selects: its resource, namespace (None: all), label and field selectors.
#[derive(Clone, Debug)]
struct Filter {
    resource: Resource,
    namespace: Option<String>,
    labels: LabelSelector,
    fields: FieldSelector,
}

impl Filter {
    fn matches(&self, object: &Value) -> bool {
        if object["kind"] != self.resource.kind() {
            return false;
        }
        let metadata = &object["metadata"];
        let namespace = metadata["namespace"].as_str().unwrap_or("");
        if self.namespace.as_deref().is_some_and(|ns| ns != namespace) {
            return false;
        }
        let empty = Map::new();
        let labels = metadata["labels"].as_object().unwrap_or(&empty);
        self.labels.matches(labels) && self.fields.matches(object)
    }

    fn has_selectors(&self) -> bool {
        !self.labels.0.is_empty() || !self.fields.0.is_empty()
    }
}

/// One open watch, fed under the state lock so its events keep the store's order.
struct Watcher {
    id: u64,
    filter: Filter,
    bookmarks: bool,
    /// Changes at or below this resourceVersion are not sent (the watch started after them).
    after: u64,
    tx: mpsc::UnboundedSender<Bytes>,
}

struct State {
    /// By etcd key order, `<namespace>/<name>`.
    objects: BTreeMap<String, Value>,
    rv: u64,
    /// The history holds every change with a resourceVersion above this one.
    compacted: u64,
    history: Vec<Change>,
    watchers: Vec<Watcher>,
    next_watcher: u64,
    token: Option<String>,
    forbidden: Option<String>,
    forbidden_services: Option<String>,
    failure: Option<(u16, String)>,
    expire_watches_with_status: bool,
    compact_before_next_continue: bool,
    queries: Vec<String>,
    last_authorization: Option<String>,
    max_watch_timeout: Option<Duration>,
}

impl State {
    /// Appends a change to the history and sends it to every watcher that sees it.
    fn record(&mut self, change: Change) {
        let mut gone = Vec::new();
        for watcher in &self.watchers {
            if change.rv <= watcher.after {
                continue;
            }
            if let Some(line) = event_line(&change, &watcher.filter) {
                if watcher.tx.send(line).is_err() {
                    gone.push(watcher.id);
                }
            }
        }
        self.watchers.retain(|watcher| !gone.contains(&watcher.id));
        self.history.push(change);
    }

    fn send_bookmarks(&mut self) {
        let rv = self.rv;
        self.watchers.retain(|watcher| {
            let line = bookmark_line(watcher.filter.resource, rv, false);
            !(watcher.bookmarks && rv >= watcher.after && watcher.tx.send(line).is_err())
        });
    }

    /// The objects as they were at `rv` (>= `compacted`): the current ones with the later changes
    /// undone.
    fn objects_at(&self, rv: u64) -> BTreeMap<String, Value> {
        let mut objects = self.objects.clone();
        for change in self.history.iter().rev() {
            if change.rv <= rv {
                break;
            }
            match &change.previous {
                Some(previous) => objects.insert(change.key.clone(), previous.clone()),
                None => objects.remove(&change.key),
            };
        }
        objects
    }

    /// Forgets the history: every resourceVersion below the current one is gone.
    fn compact(&mut self) {
        self.history.clear();
        self.compacted = self.rv;
    }
}

struct Shared {
    state: Mutex<State>,
    hang: watch::Sender<bool>,
    /// The current resourceVersion, for reads waiting to be fresh enough.
    rv: watch::Sender<u64>,
    bookmark_interval: watch::Sender<Option<Duration>>,
    requests: AtomicUsize,
    lists: AtomicUsize,
    watches: AtomicUsize,
    open_watches: AtomicUsize,
    open_service_watches: AtomicUsize,
    service_gets: AtomicUsize,
    service_watches: AtomicUsize,
}

/// The fake API server. See the module documentation for what it serves.
pub struct KubeFake {
    pub addr: SocketAddr,
    /// For [`KubeFake::start_tls`]: the PEM of the self-signed certificate it serves.
    pub ca_pem: Option<String>,
    shared: Arc<Shared>,
    run: Mutex<Option<Listening>>,
    tls: Option<TlsAcceptor>,
    bookmark_timer: AbortHandle,
}

impl KubeFake {
    /// Serves plain HTTP on 127.0.0.1:0, with no objects, at resourceVersion 1.
    pub async fn start() -> KubeFake {
        Self::start_with(None).await
    }

    /// The same over HTTPS with a self-signed certificate for `127.0.0.1` that only a client given
    /// [`KubeFake::ca_pem`] trusts.
    pub async fn start_tls() -> KubeFake {
        let (acceptor, pem) = super::self_signed_acceptor(&["127.0.0.1"]);
        let mut fake = Self::start_with(Some(acceptor)).await;
        fake.ca_pem = Some(pem);
        fake
    }

    async fn start_with(tls: Option<TlsAcceptor>) -> KubeFake {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                objects: BTreeMap::new(),
                rv: 1,
                compacted: 1,
                history: Vec::new(),
                watchers: Vec::new(),
                next_watcher: 0,
                token: None,
                forbidden: None,
                forbidden_services: None,
                failure: None,
                expire_watches_with_status: false,
                compact_before_next_continue: false,
                queries: Vec::new(),
                last_authorization: None,
                max_watch_timeout: None,
            }),
            hang: watch::channel(false).0,
            rv: watch::channel(1).0,
            bookmark_interval: watch::channel(None).0,
            requests: AtomicUsize::new(0),
            lists: AtomicUsize::new(0),
            watches: AtomicUsize::new(0),
            open_watches: AtomicUsize::new(0),
            open_service_watches: AtomicUsize::new(0),
            service_gets: AtomicUsize::new(0),
            service_watches: AtomicUsize::new(0),
        });
        let run = serve(shared.clone(), listener, tls.clone());
        let interval = shared.bookmark_interval.subscribe();
        let bookmark_timer =
            tokio::spawn(run_bookmarks(Arc::downgrade(&shared), interval)).abort_handle();
        KubeFake {
            addr,
            ca_pem: None,
            shared,
            run: Mutex::new(Some(run)),
            tls,
            bookmark_timer,
        }
    }

    /// `http://127.0.0.1:PORT` (`https` for [`KubeFake::start_tls`]).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// Creates or updates the slice (by namespace and name) and returns its resourceVersion.
    /// Watchers see `ADDED` or `MODIFIED` (or `ADDED`/`DELETED` when their selector starts or
    /// stops matching). An update that changes nothing writes nothing (same resourceVersion, no
    /// event). `uid` and `creationTimestamp` stay across updates; `generation` goes up when
    /// `addressType`, `endpoints` or `ports` change.
    pub fn apply(&self, slice: Slice) -> u64 {
        let key = Resource::EndpointSlices.key(&slice.namespace, &slice.name);
        self.write(key, slice.to_json())
    }

    /// Creates or updates the Service (by namespace and name) and returns its resourceVersion,
    /// as [`KubeFake::apply`] does for slices (a Service has no `generation`).
    pub fn apply_service(&self, service: Svc) -> u64 {
        let key = Resource::Services.key(&service.namespace, &service.name);
        self.write(key, service.to_json())
    }

    /// Deletes the Service; false when there was none.
    pub fn delete_service(&self, namespace: &str, name: &str) -> bool {
        self.remove(Resource::Services.key(namespace, name))
    }

    fn write(&self, key: String, desired: Value) -> u64 {
        let rv = {
            let mut state = self.shared.state.lock().unwrap();
            let previous = state.objects.get(&key).cloned();
            if let Some(previous) = &previous {
                if same_content(previous, &desired) {
                    return resource_version_of(previous);
                }
            }
            state.rv += 1;
            let rv = state.rv;
            let object = stamp(desired, previous.as_ref(), rv);
            state.objects.insert(key.clone(), object.clone());
            state.record(Change {
                rv,
                key,
                object: Some(object),
                previous,
            });
            rv
        };
        self.shared.rv.send_replace(rv);
        rv
    }

    /// Deletes the slice; watchers see `DELETED` with its last content at a new resourceVersion.
    /// Returns false (and writes nothing) when there was no such slice.
    pub fn delete(&self, namespace: &str, name: &str) -> bool {
        self.remove(Resource::EndpointSlices.key(namespace, name))
    }

    fn remove(&self, key: String) -> bool {
        let rv = {
            let mut state = self.shared.state.lock().unwrap();
            let Some(previous) = state.objects.remove(&key) else {
                return false;
            };
            state.rv += 1;
            let rv = state.rv;
            state.record(Change {
                rv,
                key,
                object: None,
                previous: Some(previous),
            });
            rv
        };
        self.shared.rv.send_replace(rv);
        true
    }

    /// The stored object (as a watch event carries it), if any.
    pub fn object(&self, namespace: &str, name: &str) -> Option<Value> {
        let state = self.shared.state.lock().unwrap();
        state
            .objects
            .get(&Resource::EndpointSlices.key(namespace, name))
            .cloned()
    }

    /// The current resourceVersion (etcd's revision): that of the last write.
    pub fn resource_version(&self) -> u64 {
        self.shared.state.lock().unwrap().rv
    }

    /// Forgets the history (etcd compaction and the watch cache's window at once): a watch from a
    /// resourceVersion below the current one gets the `410 Expired` ERROR event, an Exact list or a
    /// `continue` below it `410 Gone`. Open watches go on.
    pub fn compact(&self) {
        self.shared.state.lock().unwrap().compact();
    }

    /// An API server restart (or an etcd restore): every open connection is dropped (watch streams
    /// end without their final chunk), the history is forgotten as by [`KubeFake::compact`], the
    /// objects and the resourceVersion are kept, and the port keeps listening.
    pub fn restart_with_new_history(&self) {
        {
            let mut state = self.shared.state.lock().unwrap();
            state.compact();
            state.watchers.clear();
        }
        if let Some(run) = self.run.lock().unwrap().as_ref() {
            run.drop_connections();
        }
    }

    /// Ends every open watch cleanly after the events already queued for it (as `timeoutSeconds`
    /// does): a client resumes from its last resourceVersion.
    pub fn close_watches(&self) {
        self.shared.state.lock().unwrap().watchers.clear();
    }

    /// Sends a `BOOKMARK` at the current resourceVersion to every open watch that allowed them.
    pub fn send_bookmarks(&self) {
        self.shared.state.lock().unwrap().send_bookmarks();
    }

    /// From now on send bookmarks every `interval` to the watches that allowed them (None, the
    /// default: only through [`KubeFake::send_bookmarks`] and at the end of initial events).
    pub fn set_bookmark_interval(&self, interval: Option<Duration>) {
        self.shared.bookmark_interval.send_replace(interval);
    }

    /// A test control, not an API server setting: watches started from now on end after at most
    /// `cap`, whatever their `timeoutSeconds` (the real server honours `timeoutSeconds` as given).
    /// None (default): `timeoutSeconds`, or 1800 s without it.
    pub fn set_max_watch_timeout(&self, cap: Option<Duration>) {
        self.shared.state.lock().unwrap().max_watch_timeout = cap;
    }

    /// Requires `Authorization: Bearer <token>` on every request (None: no authentication). Without
    /// it, or with another token, requests get `401 Unauthorized`.
    pub fn require_token(&self, token: Option<&str>) {
        self.shared.state.lock().unwrap().token = token.map(str::to_owned);
    }

    /// The bearer token of the last request that had an `Authorization` header.
    pub fn last_token(&self) -> Option<String> {
        let header = self.last_authorization()?;
        let (scheme, token) = header.split_once(' ')?;
        scheme
            .eq_ignore_ascii_case("bearer")
            .then(|| token.trim().to_owned())
    }

    /// The last `Authorization` header seen, as sent.
    pub fn last_authorization(&self) -> Option<String> {
        self.shared.state.lock().unwrap().last_authorization.clone()
    }

    /// RBAC: [`SERVICE_ACCOUNT`] may not read EndpointSlices in `namespace` (so not at the cluster
    /// scope either): `403 Forbidden` for lists, watches and gets there. None lifts it.
    pub fn forbid(&self, namespace: Option<&str>) {
        self.shared.state.lock().unwrap().forbidden = namespace.map(str::to_owned);
    }

    /// RBAC: [`SERVICE_ACCOUNT`] may not read Services in `namespace` (get, list, watch). None
    /// lifts it.
    pub fn forbid_services(&self, namespace: Option<&str>) {
        self.shared.state.lock().unwrap().forbidden_services = namespace.map(str::to_owned);
    }

    /// From now on (true) a watch from a compacted resourceVersion is answered HTTP `410` with the
    /// `Expired` Status, not a `200` stream with one `ERROR` event (see the module documentation).
    pub fn expire_watches_with_status(&self, on: bool) {
        self.shared.state.lock().unwrap().expire_watches_with_status = on;
    }

    /// Just before the next list page with a `continue` token is read, other resources are
    /// written (the resourceVersion moves on) and the history is compacted, as etcd does between
    /// two pages of a slow list: that page is `410 Expired`.
    pub fn compact_before_next_continue(&self) {
        self.shared
            .state
            .lock()
            .unwrap()
            .compact_before_next_continue = true;
    }

    /// GETs of one Service so far, whatever their answer.
    pub fn service_gets(&self) -> usize {
        self.shared.service_gets.load(Ordering::SeqCst)
    }

    /// Watch requests on Services so far, whatever their answer.
    pub fn service_watches(&self) -> usize {
        self.shared.service_watches.load(Ordering::SeqCst)
    }

    /// From now on every request is answered `status` with a `Status` body carrying `message` (and
    /// the reason the apiserver uses for that code). Open watches go on. None goes back to normal.
    pub fn fail_with(&self, failure: Option<(u16, String)>) {
        if let Some((status, _)) = &failure {
            StatusCode::from_u16(*status).expect("fail_with: a valid HTTP status");
        }
        self.shared.state.lock().unwrap().failure = failure;
    }

    /// While on, requests are accepted and their headers read but never answered (they stay silent
    /// until their client gives up or [`KubeFake::stop`], even after `hang(false)`), and open
    /// watches go silent: no events, bookmarks or end of stream, not even at their timeout. When it
    /// is turned off they resume with what was queued meanwhile.
    pub fn hang(&self, on: bool) {
        self.shared.hang.send_replace(on);
    }

    /// Requests so far (every one, whatever its path and answer).
    pub fn requests(&self) -> usize {
        self.shared.requests.load(Ordering::SeqCst)
    }

    /// GETs of an EndpointSlice collection without `watch` so far, whatever their answer.
    pub fn lists(&self) -> usize {
        self.shared.lists.load(Ordering::SeqCst)
    }

    /// GETs of an EndpointSlice collection with `watch` so far, whatever their answer.
    pub fn watches(&self) -> usize {
        self.shared.watches.load(Ordering::SeqCst)
    }

    /// EndpointSlice watch streams open right now.
    pub fn open_watches(&self) -> usize {
        self.shared.open_watches.load(Ordering::SeqCst)
    }

    /// Service watch streams open right now.
    pub fn open_service_watches(&self) -> usize {
        self.shared.open_service_watches.load(Ordering::SeqCst)
    }

    /// The raw query strings of every request so far, in order ("" for none).
    pub fn queries(&self) -> Vec<String> {
        self.shared.state.lock().unwrap().queries.clone()
    }

    /// Stops listening and drops every connection: connects are refused until
    /// [`KubeFake::restart`]. Objects and history are kept.
    pub fn stop(&self) {
        self.shared.state.lock().unwrap().watchers.clear();
        if let Some(run) = self.run.lock().unwrap().take() {
            run.stop();
        }
    }

    /// Listens again on the same port, objects and history kept. Does nothing while listening.
    pub async fn restart(&self) {
        if self.run.lock().unwrap().is_some() {
            return;
        }
        let listener = rebind(self.addr).await;
        let run = serve(self.shared.clone(), listener, self.tls.clone());
        *self.run.lock().unwrap() = Some(run);
    }
}

impl Drop for KubeFake {
    fn drop(&mut self) {
        self.stop();
        self.bookmark_timer.abort();
    }
}

async fn run_bookmarks(shared: Weak<Shared>, mut interval: watch::Receiver<Option<Duration>>) {
    loop {
        let every = *interval.borrow_and_update();
        match every {
            None => {
                if interval.changed().await.is_err() {
                    return;
                }
            }
            Some(every) => {
                tokio::select! {
                    _ = tokio::time::sleep(every) => {
                        let Some(shared) = shared.upgrade() else { return };
                        shared.state.lock().unwrap().send_bookmarks();
                    }
                    changed = interval.changed() => if changed.is_err() { return },
                }
            }
        }
    }
}

fn serve(shared: Arc<Shared>, listener: TcpListener, tls: Option<TlsAcceptor>) -> Listening {
    Listening::serve(listener, tls, move |request| {
        answer(request, shared.clone())
    })
}

type Body = UnsyncBoxBody<Bytes, Infallible>;
type Answer = Response<Body>;

/// What a request is for.
enum Target {
    /// A collection, in one namespace or all.
    Collection(Resource, Option<String>),
    Object(Resource, String, String),
    Other,
}

impl Target {
    fn parse(path: &str) -> Target {
        let (resource, rest) = if let Some(rest) = path.strip_prefix("/apis/discovery.k8s.io/v1/") {
            (Resource::EndpointSlices, rest)
        } else if let Some(rest) = path.strip_prefix("/api/v1/") {
            (Resource::Services, rest)
        } else {
            return Target::Other;
        };
        let plural = resource.plural();
        let parts: Vec<&str> = rest.split('/').collect();
        match parts.as_slice() {
            [all] if *all == plural => Target::Collection(resource, None),
            ["namespaces", namespace, collection]
                if *collection == plural && !namespace.is_empty() =>
            {
                Target::Collection(resource, Some((*namespace).to_owned()))
            }
            ["namespaces", namespace, collection, name]
                if *collection == plural && !namespace.is_empty() && !name.is_empty() =>
            {
                Target::Object(resource, (*namespace).to_owned(), (*name).to_owned())
            }
            _ => Target::Other,
        }
    }
}

async fn answer(request: Request<Incoming>, shared: Arc<Shared>) -> Result<Answer, Infallible> {
    shared.requests.fetch_add(1, Ordering::SeqCst);
    let raw_query = request.uri().query().unwrap_or("").to_owned();
    let query = Query::parse(&raw_query);
    let target = Target::parse(request.uri().path());
    let authorization = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    let is_watch = query.get("watch").is_some_and(go_bool);
    if request.method() == Method::GET {
        let counter = match (&target, is_watch) {
            (Target::Collection(Resource::EndpointSlices, _), true) => Some(&shared.watches),
            (Target::Collection(Resource::EndpointSlices, _), false) => Some(&shared.lists),
            (Target::Collection(Resource::Services, _), true)
            | (Target::Object(Resource::Services, _, _), true) => Some(&shared.service_watches),
            (Target::Object(Resource::Services, _, _), false) => Some(&shared.service_gets),
            _ => None,
        };
        if let Some(counter) = counter {
            counter.fetch_add(1, Ordering::SeqCst);
        }
    }
    let (failure, token, forbidden, forbidden_services) = {
        let mut state = shared.state.lock().unwrap();
        state.queries.push(raw_query);
        if authorization.is_some() {
            state.last_authorization = authorization.clone();
        }
        (
            state.failure.clone(),
            state.token.clone(),
            state.forbidden.clone(),
            state.forbidden_services.clone(),
        )
    };
    let hanging = *shared.hang.borrow();
    if hanging {
        std::future::pending::<()>().await;
    }
    if let Some((code, message)) = failure {
        return Ok(status_answer(code, reason_for(code), &message, None));
    }
    if let Some(token) = token {
        let presented = authorization.as_deref().and_then(|header| {
            let mut parts = header.split_whitespace();
            let scheme = parts.next()?;
            let token = parts.next()?;
            (scheme.eq_ignore_ascii_case("bearer") && parts.next().is_none()).then_some(token)
        });
        if presented != Some(token.as_str()) {
            return Ok(status_answer(401, "Unauthorized", "Unauthorized", None));
        }
    }
    if request.method() != Method::GET {
        return Ok(status_answer(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
            Some(json!({})),
        ));
    }
    let (resource, namespace, name) = match &target {
        Target::Other => {
            return Ok(status_answer(
                404,
                "NotFound",
                "the server could not find the requested resource",
                Some(json!({})),
            ))
        }
        Target::Collection(resource, namespace) => (*resource, namespace.clone(), None),
        Target::Object(resource, namespace, name) => {
            (*resource, Some(namespace.clone()), Some(name.clone()))
        }
    };
    let denied = match resource {
        Resource::EndpointSlices => forbidden,
        Resource::Services => forbidden_services,
    };
    if let Some(denied) = &denied {
        if namespace
            .as_ref()
            .is_none_or(|namespace| namespace == denied)
        {
            let verb = match (&name, is_watch) {
                (_, true) => "watch",
                (Some(_), false) => "get",
                (None, false) => "list",
            };
            // A list or watch by metadata.name is authorized with that name.
            let named = name.clone().or_else(|| field_selector_name(&query));
            return Ok(forbidden_answer(
                resource,
                verb,
                namespace.as_deref(),
                named.as_deref(),
            ));
        }
    }
    Ok(match (name, is_watch) {
        (Some(name), false) => get_answer(&shared, resource, &namespace.unwrap(), &name),
        (Some(name), true) => {
            // A watch of one object: a collection watch with a metadata.name field selector.
            let mut query = query;
            query.pairs.retain(|(key, _)| key != "fieldSelector");
            query
                .pairs
                .push(("fieldSelector".into(), format!("metadata.name={name}")));
            watch_answer(&shared, resource, namespace, &query)
        }
        (None, false) => list_answer(&shared, resource, namespace, &query).await,
        (None, true) => watch_answer(&shared, resource, namespace, &query),
    })
}

/// The name a `metadata.name=<name>` field selector asks for, if that is all it asks.
fn field_selector_name(query: &Query) -> Option<String> {
    let selector = query.get("fieldSelector")?;
    let name = selector
        .strip_prefix("metadata.name==")
        .or_else(|| selector.strip_prefix("metadata.name="))?;
    (!name.contains(',')).then(|| name.to_owned())
}

fn get_answer(shared: &Shared, resource: Resource, namespace: &str, name: &str) -> Answer {
    let state = shared.state.lock().unwrap();
    match state.objects.get(&resource.key(namespace, name)) {
        Some(object) => json_answer(200, object),
        None => status_answer(
            404,
            "NotFound",
            &format!("{} \"{name}\" not found", resource.qualified()),
            Some(details(resource, Some(name))),
        ),
    }
}

/// A Status's `details`: `group` is `omitempty`, so the core group's is left out.
fn details(resource: Resource, name: Option<&str>) -> Value {
    let mut details = json!({"kind": resource.plural()});
    if !resource.group().is_empty() {
        details["group"] = json!(resource.group());
    }
    if let Some(name) = name {
        details["name"] = json!(name);
    }
    details
}

/// How a list picks its objects.
enum Plan {
    /// The current objects; `limit` 0 means all.
    Current { limit: usize },
    /// Not older than `rv`: waits for it, then the current objects.
    AtLeast { rv: u64, limit: usize },
    /// Exactly at `rv`, from `start` (a continue token's key) on; `rv` None: the latest.
    Exact {
        rv: Option<u64>,
        limit: usize,
        start: Option<String>,
        continued: bool,
    },
}

async fn list_answer(
    shared: &Shared,
    resource: Resource,
    namespace: Option<String>,
    query: &Query,
) -> Answer {
    let filter = match filter_from(resource, namespace, query) {
        Ok(filter) => filter,
        Err(answer) => return answer,
    };
    let limit = match query.get("limit").map(str::parse::<i64>) {
        None => 0,
        Some(Ok(limit)) => limit.max(0) as usize,
        Some(Err(error)) => return bad_request(&format!("limit: {error}")),
    };
    let rv_param = query.get("resourceVersion").unwrap_or("");
    let rv_match = query.get("resourceVersionMatch").unwrap_or("");
    let continue_token = query.get("continue").unwrap_or("");
    // ValidateListOptions (internalversion/validation/validation.go).
    let mut errors = Vec::new();
    if !rv_match.is_empty() {
        if rv_param.is_empty() {
            errors.push(
                "resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden unless \
                 resourceVersion is provided"
                    .to_owned(),
            );
        }
        if !continue_token.is_empty() {
            errors.push(
                "resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden when continue \
                 is provided"
                    .to_owned(),
            );
        }
        if rv_match != "Exact" && rv_match != "NotOlderThan" {
            errors.push(format!(
                "resourceVersionMatch: Unsupported value: \"{rv_match}\": supported values: \
                 \"Exact\", \"NotOlderThan\", \"\""
            ));
        }
        if rv_match == "Exact" && rv_param == "0" {
            errors.push(
                "resourceVersionMatch: Forbidden: resourceVersionMatch \"exact\" is forbidden for \
                 resourceVersion \"0\""
                    .to_owned(),
            );
        }
    }
    if query.has("sendInitialEvents") {
        errors.push(
            "sendInitialEvents: Forbidden: sendInitialEvents is forbidden for list".to_owned(),
        );
    }
    if !errors.is_empty() {
        return invalid_list_options(&errors);
    }
    if !continue_token.is_empty() && !rv_param.is_empty() && rv_param != "0" {
        return bad_request("specifying resource version is not allowed when using continue");
    }
    let requested = match parse_resource_version(rv_param) {
        Ok(rv) => rv,
        Err(answer) => return answer,
    };
    let plan = if !continue_token.is_empty() {
        match decode_continue(continue_token) {
            Ok((rv, start)) => Plan::Exact {
                rv,
                limit,
                start: Some(start),
                continued: true,
            },
            Err(error) => return bad_request(&format!("invalid continue token: {error}")),
        }
    } else if rv_param.is_empty() {
        Plan::Current { limit }
    } else if rv_param == "0" {
        Plan::Current { limit: 0 }
    } else if rv_match == "Exact" || (rv_match.is_empty() && limit > 0) {
        Plan::Exact {
            rv: Some(requested),
            limit,
            start: None,
            continued: false,
        }
    } else {
        Plan::AtLeast {
            rv: requested,
            limit,
        }
    };
    let wait_for = match &plan {
        Plan::AtLeast { rv, .. } => Some(*rv),
        Plan::Exact {
            rv: Some(rv),
            continued: false,
            ..
        } => Some(*rv),
        _ => None,
    };
    if let Some(wanted) = wait_for {
        let mut current = shared.rv.subscribe();
        let fresh = tokio::time::timeout(BLOCK_TIMEOUT, current.wait_for(|rv| *rv >= wanted)).await;
        if !matches!(fresh, Ok(Ok(_))) {
            let now = *shared.rv.borrow();
            return status_answer(
                504,
                "Timeout",
                &format!("Timeout: Too large resource version: {wanted}, current: {now}"),
                Some(json!({
                    "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                    "retryAfterSeconds": 1,
                })),
            );
        }
    }

    let mut state = shared.state.lock().unwrap();
    if matches!(
        plan,
        Plan::Exact {
            continued: true,
            ..
        }
    ) && state.compact_before_next_continue
    {
        // Other resources were written meanwhile (the revision is cluster-wide), then etcd
        // compacted: the page's revision is gone.
        state.compact_before_next_continue = false;
        state.rv += 1;
        shared.rv.send_replace(state.rv);
        state.compact();
    }
    let (objects, list_rv, limit, start) = match plan {
        Plan::Current { limit } | Plan::AtLeast { limit, .. } => {
            (state.objects.clone(), state.rv, limit, None)
        }
        Plan::Exact {
            rv,
            limit,
            start,
            continued,
        } => {
            let at = rv.unwrap_or(state.rv);
            if at < state.compacted {
                if continued {
                    let token = encode_continue(-1, start.as_deref().unwrap_or(""));
                    let mut status = status_value(410, "Expired", INCONSISTENT_CONTINUE, None);
                    status["metadata"] = json!({"continue": token});
                    return json_answer(410, &status);
                }
                return status_answer(410, "Expired", EXPIRED_LIST, None);
            }
            (state.objects_at(at), at, limit, start)
        }
    };
    drop(state);

    let mut matching = objects
        .iter()
        .filter(|(key, _)| {
            start
                .as_ref()
                .is_none_or(|start| key.as_str() >= start.as_str())
        })
        .filter(|(_, object)| filter.matches(object));
    let mut items = Vec::new();
    let mut last_key = None;
    for (key, object) in matching.by_ref() {
        items.push(list_item(object));
        last_key = Some(key.clone());
        if limit > 0 && items.len() == limit {
            break;
        }
    }
    let remaining = matching.count();
    let mut metadata = json!({"resourceVersion": list_rv.to_string()});
    if remaining > 0 {
        let start = format!("{}\u{0}", last_key.unwrap_or_default());
        metadata["continue"] = json!(encode_continue(list_rv as i64, &start));
        if !filter.has_selectors() {
            metadata["remainingItemCount"] = json!(remaining);
        }
    }
    json_answer(
        200,
        &json!({
            "kind": format!("{}List", resource.kind()),
            "apiVersion": api_version(resource),
            "metadata": metadata,
            "items": items,
        }),
    )
}

/// An object as a list item: without `kind` and `apiVersion`.
fn list_item(object: &Value) -> Value {
    let mut item = object.clone();
    if let Some(item) = item.as_object_mut() {
        item.remove("kind");
        item.remove("apiVersion");
    }
    item
}

/// Removes the watcher and counts the stream closed when the response body is dropped: at its
/// end, or when the connection goes.
struct OpenWatch {
    shared: Arc<Shared>,
    id: u64,
    resource: Resource,
}

impl OpenWatch {
    fn counter(shared: &Shared, resource: Resource) -> &AtomicUsize {
        match resource {
            Resource::EndpointSlices => &shared.open_watches,
            Resource::Services => &shared.open_service_watches,
        }
    }
}

impl Drop for OpenWatch {
    fn drop(&mut self) {
        OpenWatch::counter(&self.shared, self.resource).fetch_sub(1, Ordering::SeqCst);
        let mut state = self.shared.state.lock().unwrap();
        state.watchers.retain(|watcher| watcher.id != self.id);
    }
}

struct WatchStream {
    rx: mpsc::UnboundedReceiver<Bytes>,
    deadline: Instant,
    hang: watch::Receiver<bool>,
    _open: OpenWatch,
}

fn api_version(resource: Resource) -> &'static str {
    match resource {
        Resource::EndpointSlices => API_VERSION,
        Resource::Services => "v1",
    }
}

fn watch_answer(
    shared: &Arc<Shared>,
    resource: Resource,
    namespace: Option<String>,
    query: &Query,
) -> Answer {
    let filter = match filter_from(resource, namespace, query) {
        Ok(filter) => filter,
        Err(answer) => return answer,
    };
    let timeout = match query.get("timeoutSeconds").map(str::parse::<i64>) {
        None => None,
        Some(Ok(seconds)) => (seconds > 0).then(|| Duration::from_secs(seconds as u64)),
        Some(Err(error)) => return bad_request(&format!("timeoutSeconds: {error}")),
    };
    let bookmarks = query.get("allowWatchBookmarks").is_some_and(go_bool);
    let rv_param = query.get("resourceVersion").unwrap_or("");
    let mut rv_match = query.get("resourceVersionMatch").unwrap_or("").to_owned();
    let mut send_initial = query.get("sendInitialEvents").map(go_bool);
    // SetListOptionsDefaults (WatchList on): a legacy watch gets the initial events.
    if send_initial.is_none() && rv_match.is_empty() && (rv_param.is_empty() || rv_param == "0") {
        send_initial = Some(true);
        rv_match = "NotOlderThan".to_owned();
    }
    let mut errors = Vec::new();
    if send_initial.is_some() && rv_match != "NotOlderThan" {
        errors.push(
            "resourceVersionMatch: Forbidden: sendInitialEvents requires setting \
             resourceVersionMatch to NotOlderThan"
                .to_owned(),
        );
    }
    if !rv_match.is_empty() {
        if send_initial.is_none() {
            errors.push(
                "resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden for watch \
                 unless sendInitialEvents is provided"
                    .to_owned(),
            );
        }
        if rv_match != "NotOlderThan" {
            errors.push(format!(
                "resourceVersionMatch: Unsupported value: \"{rv_match}\": supported values: \
                 \"NotOlderThan\""
            ));
        }
    }
    if !errors.is_empty() {
        return invalid_list_options(&errors);
    }
    let requested = match parse_resource_version(rv_param) {
        Ok(rv) => rv,
        Err(answer) => return answer,
    };

    let (tx, rx) = mpsc::unbounded_channel();
    let mut state = shared.state.lock().unwrap();
    let after = match send_initial {
        Some(true) => {
            for object in state.objects.values().filter(|o| filter.matches(o)) {
                let _ = tx.send(event_bytes("ADDED", object));
            }
            if bookmarks {
                let _ = tx.send(bookmark_line(resource, state.rv, true));
            }
            state.rv
        }
        Some(false) if requested == 0 => state.rv,
        _ => {
            if requested < state.compacted && state.expire_watches_with_status {
                let message = format!(
                    "too old resource version: {requested} ({})",
                    state.compacted
                );
                return status_answer(410, "Expired", &message, None);
            }
            if requested < state.compacted {
                let status = status_value(
                    410,
                    "Expired",
                    &format!(
                        "too old resource version: {requested} ({})",
                        state.compacted
                    ),
                    None,
                );
                drop(state);
                let frames = futures_util::stream::iter([Ok::<_, Infallible>(Frame::data(
                    event_bytes("ERROR", &status),
                ))]);
                return watch_response(StreamBody::new(frames).boxed_unsync());
            }
            for change in state.history.iter().filter(|c| c.rv > requested) {
                if let Some(line) = event_line(change, &filter) {
                    let _ = tx.send(line);
                }
            }
            requested
        }
    };
    let id = state.next_watcher;
    state.next_watcher += 1;
    state.watchers.push(Watcher {
        id,
        filter,
        bookmarks,
        after,
        tx,
    });
    let cap = state.max_watch_timeout;
    drop(state);
    OpenWatch::counter(shared, resource).fetch_add(1, Ordering::SeqCst);

    let mut lasts = timeout.unwrap_or(DEFAULT_WATCH_TIMEOUT);
    if let Some(cap) = cap {
        lasts = lasts.min(cap);
    }
    let stream = WatchStream {
        rx,
        deadline: Instant::now() + lasts,
        hang: shared.hang.subscribe(),
        _open: OpenWatch {
            shared: shared.clone(),
            id,
            resource,
        },
    };
    let frames = futures_util::stream::unfold(stream, |mut stream| async move {
        loop {
            let hanging = *stream.hang.borrow_and_update();
            if hanging {
                // Silent: neither events nor the end of the stream go out.
                if stream.hang.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
                continue;
            }
            tokio::select! {
                biased;
                changed = stream.hang.changed() => {
                    if changed.is_err() {
                        std::future::pending::<()>().await;
                    }
                }
                line = stream.rx.recv() => {
                    let line = line?;
                    return Some((Ok::<_, Infallible>(Frame::data(line)), stream));
                }
                _ = tokio::time::sleep_until(stream.deadline) => return None,
            }
        }
    });
    watch_response(StreamBody::new(frames).boxed_unsync())
}

fn watch_response(body: Body) -> Answer {
    let mut response = Response::new(body);
    set_json_headers(&mut response);
    response
}

/// The watch event a change is for a watcher with this filter, if any (cache_watcher.go
/// `convertToWatchEvent`).
fn event_line(change: &Change, filter: &Filter) -> Option<Bytes> {
    let current = change.object.as_ref().filter(|o| filter.matches(o));
    let previous = change.previous.as_ref().filter(|p| filter.matches(p));
    match (current, previous) {
        (Some(object), None) => Some(event_bytes("ADDED", object)),
        (Some(object), Some(_)) => Some(event_bytes("MODIFIED", object)),
        (None, Some(previous)) => {
            let mut gone = previous.clone();
            gone["metadata"]["resourceVersion"] = json!(change.rv.to_string());
            Some(event_bytes("DELETED", &gone))
        }
        (None, None) => None,
    }
}

/// One watch event as the apiserver's JSON framer writes it: `{"type":..,"object":..}` and a
/// newline.
fn event_bytes(kind: &str, object: &Value) -> Bytes {
    Bytes::from(format!(
        "{{\"type\":\"{kind}\",\"object\":{}}}\n",
        serde_json::to_string(object).unwrap()
    ))
}

/// A `BOOKMARK` event: an empty EndpointSlice as Go serializes it, with only its
/// resourceVersion (and the initial-events-end annotation) set.
fn bookmark_line(resource: Resource, rv: u64, initial_events_end: bool) -> Bytes {
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if initial_events_end {
        metadata["annotations"] = json!({INITIAL_EVENTS_END: "true"});
    }
    let object = match resource {
        Resource::EndpointSlices => json!({
            "kind": "EndpointSlice",
            "apiVersion": API_VERSION,
            "metadata": metadata,
            "addressType": "",
            "endpoints": null,
            "ports": null,
        }),
        Resource::Services => json!({
            "kind": "Service",
            "apiVersion": "v1",
            "metadata": metadata,
            "spec": {},
            "status": {"loadBalancer": {}},
        }),
    };
    event_bytes("BOOKMARK", &object)
}

/// The stored object for `desired`: server-set metadata from `previous` (or new), at `rv`.
fn stamp(desired: Value, previous: Option<&Value>, rv: u64) -> Value {
    let mut object = desired;
    let (uid, created, generation) = match previous {
        Some(previous) => {
            let metadata = &previous["metadata"];
            let generation = metadata["generation"].as_u64().unwrap_or(1);
            // A Service changes in `spec`; a slice in its three top-level fields.
            let spec_changed = ["addressType", "endpoints", "ports"]
                .iter()
                .any(|field| previous[field] != object[field]);
            (
                metadata["uid"].clone(),
                metadata["creationTimestamp"].clone(),
                generation + u64::from(spec_changed),
            )
        }
        None => (
            json!(uuid::Uuid::new_v4().to_string()),
            json!(chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string()),
            1,
        ),
    };
    let is_slice = object["kind"] == "EndpointSlice";
    let metadata = &mut object["metadata"];
    metadata["uid"] = uid;
    metadata["resourceVersion"] = json!(rv.to_string());
    if is_slice {
        metadata["generation"] = json!(generation);
    }
    metadata["creationTimestamp"] = created;
    object
}

fn same_content(stored: &Value, desired: &Value) -> bool {
    stored["metadata"]["labels"] == desired["metadata"]["labels"]
        && ["addressType", "endpoints", "ports", "spec"]
            .iter()
            .all(|field| stored[field] == desired[field])
}

fn resource_version_of(object: &Value) -> u64 {
    object["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|rv| rv.parse().ok())
        .unwrap_or(0)
}

/// `APIObjectVersioner.ParseResourceVersion`: "" and "0" are 0.
#[allow(clippy::result_large_err)]
fn parse_resource_version(text: &str) -> Result<u64, Answer> {
    if text.is_empty() || text == "0" {
        return Ok(0);
    }
    text.parse::<u64>().map_err(|_| {
        status_answer(
            500,
            "",
            &format!(
                "resourceVersion: Invalid value: \"{text}\": strconv.ParseUint: parsing \
                 \"{text}\": invalid syntax"
            ),
            None,
        )
    })
}

#[allow(clippy::result_large_err)]
fn filter_from(
    resource: Resource,
    namespace: Option<String>,
    query: &Query,
) -> Result<Filter, Answer> {
    let labels = parse_label_selector(query.get("labelSelector").unwrap_or(""))
        .map_err(|error| bad_request(&error))?;
    let fields = parse_field_selector(resource, query.get("fieldSelector").unwrap_or(""))
        .map_err(|error| bad_request(&error))?;
    Ok(Filter {
        resource,
        namespace,
        labels,
        fields,
    })
}

/// apimachinery's `Convert_Slice_string_To_bool`.
fn go_bool(value: &str) -> bool {
    !(value == "0"
        || ["f", "false", "n", "no"]
            .iter()
            .any(|no| value.eq_ignore_ascii_case(no)))
}

fn reason_for(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        406 => "NotAcceptable",
        409 => "Conflict",
        410 => "Expired",
        415 => "UnsupportedMediaType",
        422 => "Invalid",
        429 => "TooManyRequests",
        500 => "InternalError",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "",
    }
}

/// A `Status` object as the apiserver writes it.
fn status_value(code: u16, reason: &str, message: &str, details: Option<Value>) -> Value {
    let mut status = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "code": code,
    });
    if !reason.is_empty() {
        status["reason"] = json!(reason);
    }
    if let Some(details) = details {
        status["details"] = details;
    }
    status
}

fn status_answer(code: u16, reason: &str, message: &str, details: Option<Value>) -> Answer {
    let mut response = json_answer(code, &status_value(code, reason, message, details));
    if code == 429 {
        response
            .headers_mut()
            .insert("retry-after", HeaderValue::from_static("1"));
    }
    response
}

fn bad_request(message: &str) -> Answer {
    status_answer(400, "BadRequest", message, None)
}

/// `errors.NewInvalid(meta.k8s.io ListOptions, "", errs)`.
fn invalid_list_options(errors: &[String]) -> Answer {
    let aggregate = if errors.len() == 1 {
        errors[0].clone()
    } else {
        format!("[{}]", errors.join(", "))
    };
    let causes: Vec<Value> = errors
        .iter()
        .map(|error| {
            let (field, message) = error.split_once(": ").unwrap_or(("", error));
            let reason = if message.starts_with("Forbidden") {
                "FieldValueForbidden"
            } else {
                "FieldValueNotSupported"
            };
            json!({"reason": reason, "message": message, "field": field})
        })
        .collect();
    status_answer(
        422,
        "Invalid",
        &format!("ListOptions.meta.k8s.io \"\" is invalid: {aggregate}"),
        Some(json!({"group": "meta.k8s.io", "kind": "ListOptions", "causes": causes})),
    )
}

fn forbidden_answer(
    resource: Resource,
    verb: &str,
    namespace: Option<&str>,
    name: Option<&str>,
) -> Answer {
    let scope = match namespace {
        Some(namespace) => format!("in the namespace \"{namespace}\""),
        None => "at the cluster scope".to_owned(),
    };
    let named = name.map(|name| format!("\"{name}\" ")).unwrap_or_default();
    let message = format!(
        "{} {named}is forbidden: User \"{SERVICE_ACCOUNT}\" cannot {verb} resource \"{}\" in API \
         group \"{}\" {scope}",
        resource.qualified(),
        resource.plural(),
        resource.group(),
    );
    status_answer(403, "Forbidden", &message, Some(details(resource, name)))
}

fn json_answer(code: u16, value: &Value) -> Answer {
    let body = Full::new(Bytes::from(serde_json::to_vec(value).unwrap())).boxed_unsync();
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::from_u16(code).unwrap();
    set_json_headers(&mut response);
    response
}

fn set_json_headers(response: &mut Answer) {
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache, private"));
    headers.insert(
        "audit-id",
        HeaderValue::from_str(&uuid::Uuid::new_v4().to_string()).unwrap(),
    );
}

// ---- continue tokens ----

/// `storage.EncodeContinue`: base64url (no padding) of the token JSON.
fn encode_continue(rv: i64, start: &str) -> String {
    let token = json!({"v": "meta.k8s.io/v1", "rv": rv, "start": start});
    base64url_encode(&serde_json::to_vec(&token).unwrap())
}

/// The resourceVersion (None: the latest) and start key of a continue token.
fn decode_continue(token: &str) -> Result<(Option<u64>, String), String> {
    let bytes = base64url_decode(token)
        .ok_or_else(|| "continue key is not valid: illegal base64 data".to_owned())?;
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|error| format!("continue key is not valid: {error}"))?;
    if value["v"] != "meta.k8s.io/v1" {
        return Err(
            "continue key is not valid: server does not recognize this encoded version".into(),
        );
    }
    let start = value["start"].as_str().unwrap_or("");
    if start.is_empty() {
        return Err("continue key is not valid: encoded start key cannot be empty".into());
    }
    match value["rv"].as_i64() {
        Some(-1) => Ok((None, start.to_owned())),
        Some(rv) if rv > 0 => Ok((Some(rv as u64), start.to_owned())),
        _ => Err(
            "continue key is not valid: incorrect encoded start resourceVersion (version \
             meta.k8s.io/v1)"
                .into(),
        ),
    }
}

const BASE64URL: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

fn base64url_encode(bytes: &[u8]) -> String {
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, byte)| n | (u32::from(*byte) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(BASE64URL[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

fn base64url_decode(text: &str) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let mut bits = 0u32;
    let mut count = 0;
    for c in text.bytes() {
        let value = BASE64URL.iter().position(|&b| b == c)? as u32;
        bits = (bits << 6) | value;
        count += 6;
        if count >= 8 {
            count -= 8;
            out.push((bits >> count) as u8);
            bits &= (1 << count) - 1;
        }
    }
    Some(out)
}

// ---- query strings ----

struct Query {
    pairs: Vec<(String, String)>,
}

impl Query {
    /// Go's `url.ParseQuery`: `&`-separated, `+` is a space, `%XX` escapes.
    fn parse(raw: &str) -> Query {
        let pairs = raw
            .split('&')
            .filter(|pair| !pair.is_empty())
            .map(|pair| {
                let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                (percent_decode(key), percent_decode(value))
            })
            .collect();
        Query { pairs }
    }

    fn has(&self, key: &str) -> bool {
        self.pairs.iter().any(|(have, _)| have == key)
    }

    /// The first value, as the apiserver's parameter decoding takes it.
    fn get(&self, key: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(have, _)| have == key)
            .map(|(_, value)| value.as_str())
    }
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b'%' => {
                let escaped = bytes
                    .get(i + 1..i + 3)
                    .and_then(|hex| std::str::from_utf8(hex).ok())
                    .and_then(|hex| u8::from_str_radix(hex, 16).ok());
                match escaped {
                    Some(byte) => {
                        out.push(byte);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            byte => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

// ---- label selectors (apimachinery labels/selector.go) ----

#[derive(Clone, Debug, Default)]
struct LabelSelector(Vec<Requirement>);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Operator {
    Exists,
    DoesNotExist,
    Equals,
    NotEquals,
    In,
    NotIn,
    GreaterThan,
    LessThan,
}

#[derive(Clone, Debug)]
struct Requirement {
    key: String,
    operator: Operator,
    values: Vec<String>,
}

impl LabelSelector {
    fn matches(&self, labels: &Map<String, Value>) -> bool {
        self.0.iter().all(|requirement| requirement.matches(labels))
    }
}

impl Requirement {
    fn matches(&self, labels: &Map<String, Value>) -> bool {
        let value = labels.get(&self.key).and_then(Value::as_str);
        let listed = |value: &str| self.values.iter().any(|v| v == value);
        let number = |text: &str| text.parse::<i64>().ok();
        match self.operator {
            Operator::Exists => value.is_some(),
            Operator::DoesNotExist => value.is_none(),
            Operator::Equals | Operator::In => value.is_some_and(listed),
            Operator::NotEquals | Operator::NotIn => !value.is_some_and(listed),
            Operator::GreaterThan | Operator::LessThan => {
                let (Some(have), Some(bound)) = (value.and_then(number), number(&self.values[0]))
                else {
                    return false;
                };
                if self.operator == Operator::GreaterThan {
                    have > bound
                } else {
                    have < bound
                }
            }
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
enum Token {
    Identifier,
    DoesNotExist,
    Equals,
    DoubleEquals,
    NotEquals,
    GreaterThan,
    LessThan,
    In,
    NotIn,
    OpenParen,
    CloseParen,
    Comma,
    End,
    Error,
}

fn is_special(c: char) -> bool {
    matches!(c, '=' | '!' | '(' | ')' | ',' | '>' | '<')
}

/// The lexer of labels/selector.go: identifiers run to whitespace or a special symbol, and the
/// longest operator among `! != ( ) , = == > <` is taken.
fn lex(input: &str) -> Vec<(Token, String)> {
    let chars: Vec<char> = input.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if is_special(c) {
            let two: String = chars[i..(i + 2).min(chars.len())].iter().collect();
            let (token, literal) = match two.as_str() {
                "!=" => (Token::NotEquals, two.clone()),
                "==" => (Token::DoubleEquals, two.clone()),
                _ => {
                    let token = match c {
                        '!' => Token::DoesNotExist,
                        '=' => Token::Equals,
                        '(' => Token::OpenParen,
                        ')' => Token::CloseParen,
                        ',' => Token::Comma,
                        '>' => Token::GreaterThan,
                        '<' => Token::LessThan,
                        _ => Token::Error,
                    };
                    (token, c.to_string())
                }
            };
            i += literal.chars().count();
            tokens.push((token, literal));
        } else {
            let begin = i;
            while i < chars.len() && !chars[i].is_whitespace() && !is_special(chars[i]) {
                i += 1;
            }
            let literal: String = chars[begin..i].iter().collect();
            let token = match literal.as_str() {
                "in" => Token::In,
                "notin" => Token::NotIn,
                _ => Token::Identifier,
            };
            tokens.push((token, literal));
        }
    }
    tokens.push((Token::End, String::new()));
    tokens
}

struct Parser {
    tokens: Vec<(Token, String)>,
    position: usize,
}

impl Parser {
    /// In the "values" context `in` and `notin` are plain identifiers.
    fn lookahead(&self, values: bool) -> (Token, String) {
        let (token, literal) = self.tokens[self.position.min(self.tokens.len() - 1)].clone();
        if values && matches!(token, Token::In | Token::NotIn) {
            return (Token::Identifier, literal);
        }
        (token, literal)
    }

    fn consume(&mut self, values: bool) -> (Token, String) {
        let item = self.lookahead(values);
        self.position += 1;
        item
    }

    fn requirement(&mut self) -> Result<Requirement, String> {
        let (mut token, mut literal) = self.consume(true);
        let mut operator = None;
        if token == Token::DoesNotExist {
            operator = Some(Operator::DoesNotExist);
            (token, literal) = self.consume(true);
        }
        if token != Token::Identifier {
            return Err(format!("found '{literal}', expected: identifier"));
        }
        if let Err(error) = validate_label_key(&literal) {
            return Err(format!("key: Invalid value: \"{literal}\": {error}"));
        }
        let key = literal;
        let (next, _) = self.lookahead(true);
        if next == Token::End || next == Token::Comma {
            operator.get_or_insert(Operator::Exists);
        }
        if let Some(operator) = operator {
            return Ok(Requirement {
                key,
                operator,
                values: Vec::new(),
            });
        }
        let (token, literal) = self.consume(false);
        let operator = match token {
            Token::In => Operator::In,
            Token::NotIn => Operator::NotIn,
            Token::Equals | Token::DoubleEquals => Operator::Equals,
            Token::NotEquals => Operator::NotEquals,
            Token::GreaterThan => Operator::GreaterThan,
            Token::LessThan => Operator::LessThan,
            _ => {
                return Err(format!(
                    "found '{literal}', expected: in, notin, =, ==, !=, gt, lt"
                ))
            }
        };
        let values = if matches!(operator, Operator::In | Operator::NotIn) {
            self.value_set()?
        } else {
            vec![self.exact_value()?]
        };
        match operator {
            Operator::GreaterThan | Operator::LessThan => {
                if values[0].parse::<i64>().is_err() {
                    return Err(format!(
                        "values[0]: Invalid value: \"{}\": for 'Gt', 'Lt' operators, the value \
                         must be an integer",
                        values[0]
                    ));
                }
            }
            _ => {
                for (i, value) in values.iter().enumerate() {
                    if let Err(error) = validate_label_value(value) {
                        return Err(format!(
                            "values[{i}][{key}]: Invalid value: \"{value}\": {error}"
                        ));
                    }
                }
            }
        }
        Ok(Requirement {
            key,
            operator,
            values,
        })
    }

    fn exact_value(&mut self) -> Result<String, String> {
        let (token, _) = self.lookahead(true);
        if token == Token::End || token == Token::Comma {
            return Ok(String::new());
        }
        match self.consume(true) {
            (Token::Identifier, literal) => Ok(literal),
            (_, literal) => Err(format!("found '{literal}', expected: identifier")),
        }
    }

    fn value_set(&mut self) -> Result<Vec<String>, String> {
        let (token, literal) = self.consume(true);
        if token != Token::OpenParen {
            return Err(format!("found '{literal}', expected: '('"));
        }
        let (token, literal) = self.lookahead(true);
        match token {
            Token::CloseParen => {
                self.consume(true);
                Ok(vec![String::new()])
            }
            Token::Identifier | Token::Comma => {
                let mut values: Vec<String> = Vec::new();
                let add = |values: &mut Vec<String>, value: String| {
                    if !values.contains(&value) {
                        values.push(value);
                    }
                };
                loop {
                    let (token, literal) = self.consume(true);
                    match token {
                        Token::Identifier => {
                            add(&mut values, literal);
                            let (next, next_literal) = self.lookahead(true);
                            match next {
                                Token::Comma => continue,
                                Token::CloseParen => break,
                                _ => {
                                    return Err(format!(
                                        "found '{next_literal}', expected: ',' or ')'"
                                    ))
                                }
                            }
                        }
                        Token::Comma => {
                            if values.is_empty() {
                                add(&mut values, String::new());
                            }
                            let (next, _) = self.lookahead(true);
                            if next == Token::CloseParen {
                                add(&mut values, String::new());
                                break;
                            }
                            if next == Token::Comma {
                                self.consume(true);
                                add(&mut values, String::new());
                            }
                        }
                        _ => {
                            return Err(format!("found '{literal}', expected: ',', or identifier"))
                        }
                    }
                }
                let (token, literal) = self.consume(true);
                if token != Token::CloseParen {
                    return Err(format!("found '{literal}', expected: ')'"));
                }
                Ok(values)
            }
            _ => Err(format!(
                "found '{literal}', expected: ',', ')' or identifier"
            )),
        }
    }
}

/// `labels.Parse` for the selector grammar: `k=v`, `k==v`, `k!=v`, `k in (..)`, `k notin (..)`,
/// `k`, `!k`, `k>n`, `k<n`, comma-separated (all must hold).
fn parse_label_selector(input: &str) -> Result<LabelSelector, String> {
    let mut parser = Parser {
        tokens: lex(input),
        position: 0,
    };
    let mut requirements = Vec::new();
    loop {
        let (token, literal) = parser.lookahead(true);
        match token {
            Token::Identifier | Token::DoesNotExist => {
                let requirement = parser
                    .requirement()
                    .map_err(|error| format!("unable to parse requirement: {error}"))?;
                requirements.push(requirement);
                let (token, literal) = parser.consume(true);
                match token {
                    Token::End => break,
                    Token::Comma => {
                        let (next, next_literal) = parser.lookahead(true);
                        if next != Token::Identifier && next != Token::DoesNotExist {
                            return Err(format!(
                                "found '{next_literal}', expected: identifier after ','"
                            ));
                        }
                    }
                    _ => {
                        return Err(format!(
                            "found '{literal}', expected: ',' or 'end of string'"
                        ))
                    }
                }
            }
            Token::End => break,
            _ => {
                return Err(format!(
                    "found '{literal}', expected: !, identifier, or 'end of string'"
                ))
            }
        }
    }
    Ok(LabelSelector(requirements))
}

fn is_name_part(text: &str, max: usize) -> bool {
    let bytes = text.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= max
        && bytes[0].is_ascii_alphanumeric()
        && bytes[bytes.len() - 1].is_ascii_alphanumeric()
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

fn is_dns_subdomain(text: &str) -> bool {
    text.len() <= 253
        && text.split('.').all(|label| {
            let bytes = label.as_bytes();
            !bytes.is_empty()
                && bytes[0].is_ascii_alphanumeric()
                && bytes[bytes.len() - 1].is_ascii_alphanumeric()
                && bytes
                    .iter()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        })
}

/// `validation.IsQualifiedName`: an optional DNS-subdomain prefix and `/`, then a name part.
fn validate_label_key(key: &str) -> Result<(), &'static str> {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if prefix.is_some_and(|prefix| !is_dns_subdomain(prefix)) {
        return Err("prefix part must be a lowercase RFC 1123 subdomain");
    }
    if name.contains('/') || !is_name_part(name, 63) {
        return Err(
            "name part must consist of alphanumeric characters, '-', '_' or '.', and \
                    must start and end with an alphanumeric character",
        );
    }
    Ok(())
}

/// `validation.IsValidLabelValue`.
fn validate_label_value(value: &str) -> Result<(), &'static str> {
    if value.is_empty() || is_name_part(value, 63) {
        Ok(())
    } else {
        Err(
            "a valid label must be an empty string or consist of alphanumeric characters, '-', \
             '_' or '.', and must start and end with an alphanumeric character",
        )
    }
}

// ---- field selectors (apimachinery fields/selector.go) ----

#[derive(Clone, Debug, Default)]
struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    fn matches(&self, object: &Value) -> bool {
        self.0.iter().all(|(field, equal, value)| {
            let have = match field.as_str() {
                "metadata.name" => &object["metadata"]["name"],
                "metadata.namespace" => &object["metadata"]["namespace"],
                "spec.clusterIP" => &object["spec"]["clusterIP"],
                "spec.type" => &object["spec"]["type"],
                _ => &Value::Null,
            };
            (have.as_str().unwrap_or("") == value) == *equal
        })
    }
}

/// `fields.ParseSelector` plus the EndpointSlice field label conversion: `metadata.name` and
/// `metadata.namespace` with `=`, `==` or `!=`.
fn parse_field_selector(resource: Resource, input: &str) -> Result<FieldSelector, String> {
    let mut terms = Vec::new();
    if input.is_empty() {
        return Ok(FieldSelector(terms));
    }
    for term in input.split(',') {
        if term.is_empty() {
            continue;
        }
        let (field, equal, value) = if let Some((field, value)) = term.split_once("!=") {
            (field, false, value)
        } else if let Some((field, value)) = term.split_once("==") {
            (field, true, value)
        } else if let Some((field, value)) = term.split_once('=') {
            (field, true, value)
        } else {
            return Err(format!(
                "invalid selector: '{input}'; can't understand '{term}'"
            ));
        };
        let supported = match resource {
            Resource::EndpointSlices => &["metadata.name", "metadata.namespace"][..],
            Resource::Services => &[
                "metadata.name",
                "metadata.namespace",
                "spec.clusterIP",
                "spec.type",
            ][..],
        };
        if !supported.contains(&field) {
            return Err(format!("field label not supported: {field}"));
        }
        terms.push((field.to_owned(), equal, value.to_owned()));
    }
    Ok(FieldSelector(terms))
}
