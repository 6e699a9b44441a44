//! L4 stream routes in the snapshot: which service takes a connection on a listen address.
//!
//! A listen address carries either one plain TCP route, or TLS passthrough routes chosen by the
//! server name (SNI) of the ClientHello, plus at most one route without SNI taking the rest. The
//! admin API refuses other combinations; the table still builds deterministically from whatever
//! it is given (lowest route id wins a clash) so the data path never depends on that check.

use foldhash::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::ServiceRuntime;
use crate::model::{Id, StreamRoute};

/// Connections of one stream route, carried across snapshots by route id (atomics: recording
/// takes no lock).
#[derive(Default, Debug)]
pub struct StreamStats {
    connections_total: AtomicU64,
    connections_active: AtomicU64,
    bytes_client_to_upstream: AtomicU64,
    bytes_upstream_to_client: AtomicU64,
    connect_failures: AtomicU64,
}

impl StreamStats {
    /// Connections routed to this route since the gateway started.
    pub fn connections_total(&self) -> u64 {
        self.connections_total.load(Ordering::Relaxed)
    }

    /// Connections of this route open now.
    pub fn connections_active(&self) -> u64 {
        self.connections_active.load(Ordering::Relaxed)
    }

    /// Bytes from clients to upstream targets, counted as they move.
    pub fn bytes_client_to_upstream(&self) -> u64 {
        self.bytes_client_to_upstream.load(Ordering::Relaxed)
    }

    /// Bytes from upstream targets to clients, counted as they move.
    pub fn bytes_upstream_to_client(&self) -> u64 {
        self.bytes_upstream_to_client.load(Ordering::Relaxed)
    }

    /// Upstream connect attempts that failed or timed out.
    pub fn connect_failures(&self) -> u64 {
        self.connect_failures.load(Ordering::Relaxed)
    }

    /// A connection was routed here; it counts as active until [`StreamStats::closed`].
    pub fn opened(&self) {
        self.connections_total.fetch_add(1, Ordering::Relaxed);
        self.connections_active.fetch_add(1, Ordering::Relaxed);
    }

    /// A connection counted by [`StreamStats::opened`] ended.
    pub fn closed(&self) {
        // Saturating: a stats object shared by a recreated route must never wrap to 2^64.
        let _ = self
            .connections_active
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }

    /// Counted per chunk, so a long-lived connection shows its traffic while it lasts.
    pub fn moved_client_to_upstream(&self, bytes: u64) {
        self.bytes_client_to_upstream
            .fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn moved_upstream_to_client(&self, bytes: u64) {
        self.bytes_upstream_to_client
            .fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn connect_failed(&self) {
        self.connect_failures.fetch_add(1, Ordering::Relaxed);
    }
}

/// A stream route with its service resolved.
pub struct StreamRouteEntry {
    pub route: StreamRoute,
    pub service: Arc<ServiceRuntime>,
    pub stats: Arc<StreamStats>,
}

/// The routes of one listen address.
#[derive(Default)]
pub struct StreamListenerRoutes {
    /// By lower-case server name.
    exact: HashMap<String, Arc<StreamRouteEntry>>,
    /// `*.example.com` is keyed by `.example.com`.
    wildcard: HashMap<String, Arc<StreamRouteEntry>>,
    /// The route without SNI: every connection of a plain TCP listener, or the ClientHellos no
    /// SNI route matches on a passthrough listener.
    fallback: Option<Arc<StreamRouteEntry>>,
}

impl StreamListenerRoutes {
    /// True when some route on this address names an SNI: connections must show a ClientHello
    /// before they can be routed. A lone route without SNI (even to a `tls` service) is plain
    /// byte forwarding and reads nothing first.
    pub fn is_passthrough(&self) -> bool {
        !self.exact.is_empty() || !self.wildcard.is_empty()
    }

    /// The route for a connection whose ClientHello named `sni` (None: no SNI, or not read):
    /// the exact name, then the longest matching `*.suffix`, then the route without SNI.
    /// Case-insensitive; a trailing dot is ignored.
    pub fn route_for(&self, sni: Option<&str>) -> Option<&Arc<StreamRouteEntry>> {
        if let Some(name) = sni {
            let name = name.strip_suffix('.').unwrap_or(name);
            let lowered;
            let name = if name.bytes().any(|b| b.is_ascii_uppercase()) {
                lowered = name.to_ascii_lowercase();
                lowered.as_str()
            } else {
                name
            };
            if let Some(found) = self.exact.get(name) {
                return Some(found);
            }
            if !self.wildcard.is_empty() {
                // `a.b.example.com` tries `.b.example.com`, then `.example.com`, then `.com`.
                let found = name
                    .char_indices()
                    .filter(|&(at, c)| c == '.' && at > 0)
                    .find_map(|(at, _)| self.wildcard.get(&name[at..]));
                if found.is_some() {
                    return found;
                }
            }
        }
        self.fallback.as_ref()
    }

    /// Every route of this address once.
    pub fn routes(&self) -> impl Iterator<Item = &Arc<StreamRouteEntry>> + '_ {
        self.exact
            .values()
            .chain(self.wildcard.values())
            .chain(self.fallback.iter())
    }

    fn insert(&mut self, entry: Arc<StreamRouteEntry>) {
        let slot = match entry.route.sni.as_deref() {
            None => {
                if let Some(kept) = &self.fallback {
                    warn_clash(kept, &entry);
                    return;
                }
                self.fallback = Some(entry);
                return;
            }
            Some(sni) => {
                let sni = sni.trim_end_matches('.').to_ascii_lowercase();
                match sni.strip_prefix('*') {
                    Some(suffix) => self.wildcard.entry(suffix.to_owned()),
                    None => self.exact.entry(sni),
                }
            }
        };
        match slot {
            std::collections::hash_map::Entry::Occupied(kept) => warn_clash(kept.get(), &entry),
            std::collections::hash_map::Entry::Vacant(vacant) => {
                vacant.insert(entry);
            }
        }
    }
}

fn warn_clash(kept: &StreamRouteEntry, dropped: &StreamRouteEntry) {
    tracing::warn!(
        listen = %dropped.route.listen,
        sni = dropped.route.sni.as_deref(),
        kept_route = kept.route.id,
        dropped_route = dropped.route.id,
        "two stream routes claim the same connections; the older one is kept"
    );
}

/// Every stream route of a snapshot, by listen address.
#[derive(Default)]
pub struct StreamTable {
    listeners: HashMap<SocketAddr, StreamListenerRoutes>,
}

impl StreamTable {
    /// Resolves each route's service and takes its statistics from `stats_of(route id)`, so they
    /// outlive the snapshot. A route whose service is missing is left out with a warning.
    pub fn build(
        routes: &[StreamRoute],
        services: &HashMap<Id, Arc<ServiceRuntime>>,
        mut stats_of: impl FnMut(Id) -> Arc<StreamStats>,
    ) -> StreamTable {
        let mut ordered: Vec<&StreamRoute> = routes.iter().collect();
        ordered.sort_by_key(|route| route.id);
        let mut table = StreamTable::default();
        for route in ordered {
            let Some(service) = services.get(&route.service_id) else {
                tracing::warn!(
                    route = route.id,
                    service = route.service_id,
                    listen = %route.listen,
                    "stream route left out: its service is missing"
                );
                continue;
            };
            let entry = Arc::new(StreamRouteEntry {
                route: route.clone(),
                service: service.clone(),
                stats: stats_of(route.id),
            });
            table
                .listeners
                .entry(route.listen)
                .or_default()
                .insert(entry);
        }
        table
    }

    pub fn listener(&self, listen: SocketAddr) -> Option<&StreamListenerRoutes> {
        self.listeners.get(&listen)
    }

    /// The addresses the gateway must listen on for this table.
    pub fn listen_addresses(&self) -> impl Iterator<Item = SocketAddr> + '_ {
        self.listeners.keys().copied()
    }

    /// Every route once.
    pub fn routes(&self) -> impl Iterator<Item = &Arc<StreamRouteEntry>> + '_ {
        self.listeners
            .values()
            .flat_map(StreamListenerRoutes::routes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balance::Balancer;
    use crate::model::{LbPolicy, Protocol, Service, Timeouts};

    fn service(id: Id, protocol: Protocol) -> Arc<ServiceRuntime> {
        Arc::new(ServiceRuntime {
            service: Arc::new(Service {
                limits: crate::model::UpstreamLimits::default(),
                id,
                name: format!("s{id}"),
                protocol,
                upstream_authority: None,
                tls_sni: None,
                tls_verify: true,
                tls_ca_pem: None,
                lb_policy: LbPolicy::RoundRobin,
                hash_on: None,
                hash_balance_factor: None,
                session_persistence: None,
                locality: None,
                timeouts: Timeouts::default(),
                max_attempts: 3,
                health_check: None,
                ejection: Default::default(),
                managed_by: None,
                created_at: crate::clock::now(),
                updated_at: crate::clock::now(),
            }),
            upstream_host: None,
            targets: Vec::new(),
            balancer: Balancer::new(LbPolicy::RoundRobin, Vec::new()),
            counters: Default::default(),
            discovery_gap: None,
            sessions: None,
            locality: None,
        })
    }

    fn route(id: Id, listen: &str, sni: Option<&str>, service_id: Id) -> StreamRoute {
        StreamRoute {
            id,
            listen: listen.parse().unwrap(),
            sni: sni.map(str::to_owned),
            service_id,
            created_at: crate::clock::now(),
            updated_at: crate::clock::now(),
        }
    }

    fn services() -> HashMap<Id, Arc<ServiceRuntime>> {
        [
            (1, service(1, Protocol::Tcp)),
            (2, service(2, Protocol::Tls)),
        ]
        .into_iter()
        .collect()
    }

    fn build(routes: &[StreamRoute]) -> StreamTable {
        StreamTable::build(routes, &services(), |_| Arc::default())
    }

    fn routed(table: &StreamTable, listen: &str, sni: Option<&str>) -> Option<Id> {
        table
            .listener(listen.parse().unwrap())?
            .route_for(sni)
            .map(|entry| entry.route.id)
    }

    #[test]
    fn plain_tcp_listener_takes_every_connection() {
        let table = build(&[route(1, "127.0.0.1:5432", None, 1)]);
        let listener = table.listener("127.0.0.1:5432".parse().unwrap()).unwrap();
        assert!(!listener.is_passthrough());
        assert_eq!(routed(&table, "127.0.0.1:5432", None), Some(1));
        assert_eq!(routed(&table, "127.0.0.1:5432", Some("x.test")), Some(1));
        assert_eq!(routed(&table, "127.0.0.1:5433", None), None);
    }

    #[test]
    fn exact_then_longest_wildcard_then_fallback() {
        let listen = "127.0.0.1:443";
        let table = build(&[
            route(1, listen, Some("*.example.com"), 2),
            route(2, listen, Some("api.example.com"), 2),
            route(3, listen, Some("*.eu.example.com"), 2),
            route(4, listen, None, 2),
        ]);
        assert!(table
            .listener(listen.parse().unwrap())
            .unwrap()
            .is_passthrough());
        assert_eq!(routed(&table, listen, Some("api.example.com")), Some(2));
        assert_eq!(routed(&table, listen, Some("www.example.com")), Some(1));
        assert_eq!(routed(&table, listen, Some("a.eu.example.com")), Some(3));
        assert_eq!(routed(&table, listen, Some("a.b.eu.example.com")), Some(3));
        // The wildcard needs a label before its suffix.
        assert_eq!(routed(&table, listen, Some("example.com")), Some(4));
        assert_eq!(routed(&table, listen, Some("other.org")), Some(4));
        assert_eq!(routed(&table, listen, None), Some(4));
    }

    #[test]
    fn matching_ignores_case_and_a_trailing_dot() {
        let listen = "127.0.0.1:443";
        let table = build(&[
            route(1, listen, Some("API.Example.com"), 2),
            route(2, listen, Some("*.Wild.Test"), 2),
        ]);
        assert_eq!(routed(&table, listen, Some("api.example.com")), Some(1));
        assert_eq!(routed(&table, listen, Some("API.EXAMPLE.COM.")), Some(1));
        assert_eq!(routed(&table, listen, Some("X.WILD.test")), Some(2));
    }

    #[test]
    fn passthrough_without_fallback_matches_nothing_else() {
        let listen = "127.0.0.1:443";
        let table = build(&[route(1, listen, Some("a.test"), 2)]);
        assert_eq!(routed(&table, listen, Some("b.test")), None);
        assert_eq!(routed(&table, listen, None), None);
    }

    #[test]
    fn route_to_missing_service_is_left_out() {
        let table = build(&[
            route(1, "127.0.0.1:1000", None, 99),
            route(2, "127.0.0.1:2000", None, 1),
        ]);
        assert!(table.listener("127.0.0.1:1000".parse().unwrap()).is_none());
        let addresses: Vec<SocketAddr> = table.listen_addresses().collect();
        assert_eq!(addresses, vec!["127.0.0.1:2000".parse().unwrap()]);
    }

    #[test]
    fn clashing_routes_keep_the_lowest_id() {
        let listen = "127.0.0.1:443";
        let table = build(&[
            route(7, listen, Some("a.test"), 2),
            route(3, listen, Some("A.test"), 2),
            route(9, listen, None, 2),
            route(5, listen, None, 2),
        ]);
        assert_eq!(routed(&table, listen, Some("a.test")), Some(3));
        assert_eq!(routed(&table, listen, None), Some(5));
        assert_eq!(table.routes().count(), 2);
    }

    #[test]
    fn routes_lists_each_route_once_with_its_stats() {
        let shared = Arc::new(StreamStats::default());
        let table = StreamTable::build(
            &[
                route(1, "127.0.0.1:1000", None, 1),
                route(2, "127.0.0.1:2000", Some("a.test"), 2),
                route(3, "127.0.0.1:2000", Some("*.b.test"), 2),
            ],
            &services(),
            |id| {
                if id == 2 {
                    shared.clone()
                } else {
                    Arc::default()
                }
            },
        );
        let mut ids: Vec<Id> = table.routes().map(|entry| entry.route.id).collect();
        ids.sort();
        assert_eq!(ids, vec![1, 2, 3]);
        let entry = table
            .listener("127.0.0.1:2000".parse().unwrap())
            .unwrap()
            .route_for(Some("a.test"))
            .unwrap();
        assert!(Arc::ptr_eq(&entry.stats, &shared));
    }

    #[test]
    fn stats_count_connections_and_bytes() {
        let stats = StreamStats::default();
        stats.opened();
        stats.opened();
        stats.moved_client_to_upstream(4);
        stats.moved_client_to_upstream(6);
        stats.moved_upstream_to_client(20);
        stats.closed();
        stats.connect_failed();
        assert_eq!(stats.connections_total(), 2);
        assert_eq!(stats.connections_active(), 1);
        assert_eq!(stats.bytes_client_to_upstream(), 10);
        assert_eq!(stats.bytes_upstream_to_client(), 20);
        assert_eq!(stats.connect_failures(), 1);
        stats.closed();
        stats.closed();
        assert_eq!(stats.connections_active(), 0);
    }
}
