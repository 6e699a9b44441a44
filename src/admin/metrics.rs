//! `/metrics`: Prometheus (OpenMetrics) text, read from the data path's atomics, the control
//! task's refresh counters and the store. Labels are services, routes, targets and sources —
//! configuration, never anything per request — so cardinality stays bounded.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeGaugeValue, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::AdminState;
use crate::clock::unix_ms;
use crate::model::{Health, Id, SourceState};
use crate::snapshot::{RetryCounters, RetryReason, REFUSAL_CODES};

const STATUS_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];
const SOURCE_STATES: [SourceState; 5] = [
    SourceState::Pending,
    SourceState::Healthy,
    SourceState::Failing,
    SourceState::Stale,
    SourceState::Disabled,
];

type Labels = Vec<(&'static str, String)>;

/// Everything one scrape reports, gathered before encoding (the store is async; encoding is not).
#[derive(Debug, Default)]
struct Scrape {
    /// Whether the store answered this scrape (its series are missing otherwise).
    store_up: bool,
    unrouted: u64,
    stream_unmatched: u64,
    client_connection_parks: u64,
    parked_client_connections: u64,
    client_connections: u64,
    client_connections_refused: u64,
    http2_calmed_connections: u64,
    http2_streams_refused: u64,
    /// Request bodies held before a pick: (memory bytes, spool bytes, bodies spooled).
    request_bodies: (u64, u64, u64),
    admin: AdminSample,
    dropped_log_lines: u64,
    /// The span exporter's counts, when tracing is on.
    tracing: Option<TraceSample>,
    requests_refused: Vec<(Labels, u64)>,
    streams: Vec<StreamSample>,
    certificates: Vec<(Labels, i64)>,
    routes: Vec<RouteSample>,
    services: Vec<ServiceSample>,
    targets: Vec<TargetSample>,
    target_states: Vec<(String, String, i64)>,
    sources: Vec<SourceSample>,
    /// This process's registration: (labels, registered, failed calls to the agent).
    registration: Option<(Labels, bool, u64)>,
    /// Reloads of the store by the control task: (whole, only what changed).
    reloads: (u64, u64),
    /// Cluster rate-limit exchanges through the store: (answered, failed).
    rate_share_syncs: (u64, u64),
}

/// The span exporter: what it sent, dropped and lost.
#[derive(Debug, Default)]
struct TraceSample {
    exported: u64,
    dropped: u64,
    failed: u64,
    queued: u64,
}

impl TraceSample {
    fn read(counters: &crate::telemetry::trace::TraceCounters) -> TraceSample {
        TraceSample {
            exported: counters.exported_spans.load(Ordering::Relaxed),
            dropped: counters.dropped_spans.load(Ordering::Relaxed),
            failed: counters.failed_spans.load(Ordering::Relaxed),
            queued: counters.queued_requests.load(Ordering::Relaxed),
        }
    }

    fn encode(&self, encoder: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        counter(
            encoder,
            "raahi_trace_spans_exported",
            "Spans the OTLP collector accepted.",
            [(Labels::new(), self.exported)],
        )?;
        counter(
            encoder,
            "raahi_trace_spans_dropped",
            "Spans dropped because the export queue (tracing.queue_requests) was full: the \
             exporter fell behind; requests never wait for it.",
            [(Labels::new(), self.dropped)],
        )?;
        counter(
            encoder,
            "raahi_trace_spans_failed",
            "Spans lost in export calls that failed or timed out.",
            [(Labels::new(), self.failed)],
        )?;
        gauge(
            encoder,
            "raahi_trace_queued_requests",
            "Finished requests whose spans wait for the exporter.",
            [(Labels::new(), self.queued as i64)],
        )
    }
}

/// The admin listener's connections and event streams.
#[derive(Debug, Default)]
struct AdminSample {
    connections: u64,
    connections_refused: u64,
    event_streams: u64,
    event_stream_held_bytes: u64,
    /// Streams cut off: (too far behind, past the budget).
    event_streams_cut_off: (u64, u64),
    /// `snapshot` frames: (built, shared).
    event_snapshots: (u64, u64),
}

impl AdminSample {
    fn read(state: &AdminState) -> AdminSample {
        AdminSample {
            connections: state.connections.open(),
            connections_refused: state.connections.refused(),
            event_streams: state.event_streams.open(),
            event_stream_held_bytes: state.event_streams.held_bytes(),
            event_streams_cut_off: state.event_streams.cut_off(),
            event_snapshots: state.event_streams.snapshots(),
        }
    }

    fn encode(&self, encoder: &mut DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let one = |value: u64| [(Labels::new(), value)];
        let level = |value: u64| [(Labels::new(), i64::try_from(value).unwrap_or(i64::MAX))];
        gauge(
            encoder,
            "raahi_admin_connections",
            "Connections open now on the admin listener.",
            level(self.connections),
        )?;
        counter(
            encoder,
            "raahi_admin_connections_refused",
            "Admin connections closed on arrival: admin.max_connections were open.",
            one(self.connections_refused),
        )?;
        gauge(
            encoder,
            "raahi_admin_event_streams",
            "Event streams (/api/v1/events) open now.",
            level(self.event_streams),
        )?;
        gauge(
            encoder,
            "raahi_admin_event_stream_held_bytes",
            "Bytes handed to event-stream clients and not yet written to their sockets, all \
             clients together (bounded by admin.event_stream_budget_bytes).",
            level(self.event_stream_held_bytes),
        )?;
        counter(
            encoder,
            "raahi_admin_event_streams_cut_off",
            "Event streams ended by the gateway: reason=\"behind\" fell admin.event_client_queue \
             events behind, reason=\"budget\" would have passed admin.event_stream_budget_bytes.",
            [
                (
                    vec![("reason", "behind".to_owned())],
                    self.event_streams_cut_off.0,
                ),
                (
                    vec![("reason", "budget".to_owned())],
                    self.event_streams_cut_off.1,
                ),
            ],
        )?;
        counter(
            encoder,
            "raahi_admin_event_snapshots_built",
            "Event-stream snapshot frames built (store read and serialised).",
            one(self.event_snapshots.0),
        )?;
        counter(
            encoder,
            "raahi_admin_event_snapshots_shared",
            "Event streams started with a snapshot frame built for an earlier client.",
            one(self.event_snapshots.1),
        )
    }
}

#[derive(Debug)]
struct RouteSample {
    labels: Labels,
    name: String,
    /// Requests per backend label.
    backends: Vec<(String, u64)>,
    redirects: u64,
    mirrored: u64,
    mirror_dropped: u64,
    has_mirror: bool,
    /// For routes with a `rate_limit`.
    rate_limit: Option<RateLimitSample>,
    /// For routes with `max_in_flight`: (in flight now, refused past it).
    in_flight: Option<(u64, u64)>,
    /// For canary routes: the canary backend's percent of the route's requests now.
    canary_weight: Option<u8>,
    responses: [u64; 5],
    buckets: Vec<(f64, u64)>,
    latency_sum: f64,
}

/// A route's rate limit on this gateway.
#[derive(Debug)]
struct RateLimitSample {
    /// Requests refused (429 `rate_limited`).
    limited: u64,
    keys: u64,
    /// Requests per second a key without a share of its own runs at here.
    default_rate: f64,
}

#[derive(Debug)]
struct ServiceSample {
    labels: Labels,
    panic_picks: u64,
    connect_errors: u64,
    timeouts: u64,
    queued: u64,
    overloaded: u64,
    /// HTTP/2 connections, streams and unprocessed streams, for services that speak it.
    h2: Option<[u64; 3]>,
    /// Sessions re-pinned, for services with session persistence.
    sessions_repinned: Option<u64>,
    /// Retries: requests' and, for stream services, connections' connect retries.
    retries: Option<RetrySample>,
    /// For services with a zone split: whether the zone alone takes the requests now, and the
    /// picks made among the zone's targets and among every zone's.
    locality: Option<LocalitySample>,
}

#[derive(Debug, Clone, Copy)]
struct LocalitySample {
    in_zone: bool,
    zone_picks: u64,
    all_zone_picks: u64,
}

/// A service's retries on this gateway.
#[derive(Debug, Default)]
struct RetrySample {
    /// Retries sent, by [`RetryReason`].
    sent: [u64; RetryReason::ALL.len()],
    budget_exhausted: u64,
    hedges: u64,
}

impl RetrySample {
    fn read(counters: &RetryCounters) -> RetrySample {
        RetrySample {
            sent: std::array::from_fn(|index| counters.sent[index].load(Ordering::Relaxed)),
            budget_exhausted: counters.budget_exhausted.load(Ordering::Relaxed),
            hedges: counters.hedges.load(Ordering::Relaxed),
        }
    }
}

#[derive(Debug)]
struct StreamSample {
    labels: Labels,
    connections: u64,
    active: u64,
    bytes_in: u64,
    bytes_out: u64,
    connect_failures: u64,
}

#[derive(Debug)]
struct TargetSample {
    labels: Labels,
    in_flight: u32,
    health: Health,
    ejected: bool,
}

#[derive(Debug)]
struct SourceSample {
    labels: Labels,
    state: SourceState,
    refreshes: u64,
    failures: u64,
    duration_seconds: f64,
    /// A watch provider's watch: connected or not; None for poll providers.
    watch_connected: Option<bool>,
    /// Targets the removal guard holds.
    guard_held: u64,
}

pub async fn metrics(State(state): State<AdminState>) -> Response {
    encode(gather(&state).await)
}

async fn gather(state: &AdminState) -> Scrape {
    let snapshot = state.control.snapshot();
    let now = unix_ms();
    let reloads = state.control.reload_stats();
    let rate_shares = state.control.rate_shares();
    let mut scrape = Scrape {
        rate_share_syncs: (rate_shares.syncs(), rate_shares.sync_failures()),
        reloads: (
            reloads.full.load(Ordering::Relaxed),
            reloads.partial.load(Ordering::Relaxed),
        ),
        unrouted: state.gateway_counters.unrouted.load(Ordering::Relaxed),
        stream_unmatched: state
            .gateway_counters
            .stream_unmatched
            .load(Ordering::Relaxed),
        client_connection_parks: state
            .gateway_counters
            .client_connection_parks
            .load(Ordering::Relaxed),
        parked_client_connections: state
            .gateway_counters
            .parked_client_connections
            .load(Ordering::Relaxed),
        client_connections: state
            .gateway_counters
            .client_connections
            .load(Ordering::Relaxed),
        client_connections_refused: state
            .gateway_counters
            .client_connections_refused
            .load(Ordering::Relaxed),
        http2_calmed_connections: state
            .gateway_counters
            .http2_calmed_connections
            .load(Ordering::Relaxed),
        http2_streams_refused: state
            .gateway_counters
            .http2_streams_refused
            .load(Ordering::Relaxed),
        request_bodies: (
            state
                .gateway_counters
                .request_body_memory_bytes
                .load(Ordering::Relaxed),
            state
                .gateway_counters
                .request_spool_bytes
                .load(Ordering::Relaxed),
            state
                .gateway_counters
                .requests_spooled
                .load(Ordering::Relaxed),
        ),
        admin: AdminSample::read(state),
        dropped_log_lines: crate::telemetry::dropped_log_lines(),
        tracing: state.trace_counters.as_deref().map(TraceSample::read),
        requests_refused: REFUSAL_CODES
            .iter()
            .zip(&state.gateway_counters.requests_refused)
            .map(|(code, count)| {
                (
                    vec![("code", (*code).to_owned())],
                    count.load(Ordering::Relaxed),
                )
            })
            .collect(),
        registration: state.registration.as_ref().map(|status| {
            let status = status.borrow();
            (
                vec![
                    ("registry", status.registry.to_owned()),
                    ("service_id", status.service_id.clone()),
                ],
                status.state == crate::registration::RegistrationState::Registered,
                status.failures,
            )
        }),
        ..Scrape::default()
    };
    for entry in snapshot.streams().routes() {
        let route = &entry.route;
        let stats = &entry.stats;
        scrape.streams.push(StreamSample {
            labels: vec![
                ("service", entry.service.service.name.clone()),
                ("listen", route.listen.to_string()),
                ("sni", route.sni.clone().unwrap_or_default()),
            ],
            connections: stats.connections_total(),
            active: stats.connections_active(),
            bytes_in: stats.bytes_client_to_upstream(),
            bytes_out: stats.bytes_upstream_to_client(),
            connect_failures: stats.connect_failures(),
        });
    }
    let mut service_names: HashMap<Id, String> = HashMap::new();
    for service in snapshot.services() {
        let name = service.service.name.clone();
        service_names.insert(service.service.id, name.clone());
        let counters = &service.counters;
        scrape.services.push(ServiceSample {
            labels: vec![("service", name.clone())],
            panic_picks: counters.panic_picks.load(Ordering::Relaxed),
            connect_errors: counters.connect_errors.load(Ordering::Relaxed),
            timeouts: counters.timeouts.load(Ordering::Relaxed),
            queued: counters.queued.load(Ordering::Relaxed),
            overloaded: counters.overloaded.load(Ordering::Relaxed),
            sessions_repinned: service
                .service
                .session_persistence
                .as_ref()
                .map(|_| counters.sessions_repinned.load(Ordering::Relaxed)),
            retries: Some(RetrySample::read(&counters.retries)),
            locality: service.locality.as_deref().map(|split| LocalitySample {
                in_zone: split.decision().in_force.is_some(),
                zone_picks: counters.zone_picks.load(Ordering::Relaxed),
                all_zone_picks: counters.all_zone_picks.load(Ordering::Relaxed),
            }),
            h2: matches!(
                service.service.protocol,
                crate::model::Protocol::H2c | crate::model::Protocol::Https
            )
            .then(|| {
                [
                    counters.h2_connections.load(Ordering::Relaxed),
                    counters.h2_streams.load(Ordering::Relaxed),
                    counters.h2_unprocessed.load(Ordering::Relaxed),
                ]
            }),
        });
        for target in &service.targets {
            scrape.targets.push(TargetSample {
                labels: vec![
                    ("service", name.clone()),
                    ("target", target.authority.to_string()),
                ],
                in_flight: target.load.in_flight(),
                health: target.health.health(),
                ejected: target.health.ejected_until(now).is_some(),
            });
        }
    }
    for route in snapshot.routes() {
        let (buckets, latency_sum) = route.stats.latency();
        scrape.routes.push(RouteSample {
            name: route.route.name.clone(),
            backends: route
                .backends
                .list()
                .iter()
                .map(|backend| {
                    (
                        backend.label.to_string(),
                        backend.requests.load(std::sync::atomic::Ordering::Relaxed),
                    )
                })
                .collect(),
            redirects: route
                .stats
                .redirects
                .load(std::sync::atomic::Ordering::Relaxed),
            mirrored: route
                .stats
                .mirror
                .sent
                .load(std::sync::atomic::Ordering::Relaxed),
            mirror_dropped: route
                .stats
                .mirror
                .dropped
                .load(std::sync::atomic::Ordering::Relaxed),
            has_mirror: route.mirror.is_some(),
            rate_limit: route.limiter.as_ref().map(|limiter| RateLimitSample {
                limited: route.stats.rate_limited.load(Ordering::Relaxed),
                keys: limiter.keys(),
                default_rate: limiter.default_rate(),
            }),
            canary_weight: route
                .route
                .canary_status
                .as_ref()
                .filter(|_| route.route.canary.is_some())
                .map(|status| status.weight),
            in_flight: route.route.max_in_flight.map(|_| {
                (
                    route.stats.in_flight.load(Ordering::Relaxed),
                    route.stats.in_flight_refused.load(Ordering::Relaxed),
                )
            }),
            labels: vec![
                (
                    "service",
                    route
                        .service()
                        .map(|service| service.service.name.clone())
                        .unwrap_or_default(),
                ),
                ("route", route.route.name.clone()),
            ],
            responses: route.stats.responses(),
            buckets,
            latency_sum,
        });
    }
    for file in state.control.file_certificate_expiries().iter() {
        scrape.certificates.push((
            vec![
                ("source", "file".to_owned()),
                ("cert_file", file.cert_file.clone()),
                ("sni", file.sni.clone()),
            ],
            file.not_after.timestamp(),
        ));
    }
    match gather_store(state, &service_names, &mut scrape).await {
        Ok(()) => scrape.store_up = true,
        // What the data path and the control task know is still worth reporting while the
        // store is away, and this is when operators look.
        Err(error) => tracing::warn!(%error, "metrics without the store's part"),
    }
    scrape
}

/// The series read from the store: targets by state, sources, certificates.
async fn gather_store(
    state: &AdminState,
    service_names: &HashMap<Id, String>,
    scrape: &mut Scrape,
) -> Result<(), crate::store::StoreError> {
    for certificate in state
        .store
        .list_certificates(crate::store::Page {
            limit: 10_000,
            after: None,
        })
        .await?
    {
        scrape.certificates.push((
            vec![
                ("source", "api".to_owned()),
                ("certificate_id", certificate.id.to_string()),
                ("sni", certificate.snis.first().cloned().unwrap_or_default()),
            ],
            certificate.not_after.timestamp(),
        ));
    }
    for (service_id, target_state, count) in state.store.target_state_counts().await? {
        let service = service_names
            .get(&service_id)
            .cloned()
            .unwrap_or_else(|| service_id.to_string());
        scrape.target_states.push((service, target_state, count));
    }
    let stats = state.control.source_stats();
    for (source, progress) in state.store.all_sources().await? {
        let counters = stats.get(&source.id);
        let read = |pick: fn(&crate::control::SourceStats) -> u64| {
            counters.map(|stats| pick(stats)).unwrap_or(0)
        };
        let service = service_names
            .get(&source.service_id)
            .cloned()
            .unwrap_or_else(|| source.service_id.to_string());
        scrape.sources.push(SourceSample {
            labels: vec![
                ("service", service),
                ("source", source.name.clone()),
                ("provider", source.provider.as_str().to_owned()),
            ],
            state: progress.state,
            refreshes: read(|stats| stats.refreshes.load(Ordering::Relaxed)),
            failures: read(|stats| stats.failures.load(Ordering::Relaxed)),
            duration_seconds: read(|stats| stats.duration_micros.load(Ordering::Relaxed)) as f64
                / 1_000_000.0,
            watch_connected: progress.watch.as_ref().map(|watch| watch.connected),
            guard_held: progress.guard.as_ref().map_or(0, |hold| hold.holding),
        });
    }
    Ok(())
}

fn encode(scrape: Scrape) -> Response {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(scrape));
    let mut text = String::new();
    if let Err(error) = prometheus_client::encoding::text::encode(&mut text, &registry) {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("# encoding failed: {error}\n"),
        )
            .into_response();
    }
    let mut response = text.into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    response
}

fn with(labels: &Labels, extra: (&'static str, String)) -> Labels {
    let mut labels = labels.clone();
    labels.push(extra);
    labels
}

fn counter(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (Labels, u64)>,
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, value) in samples {
        ConstCounter::new(value).encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

fn gauge<N: EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (Labels, N)>,
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, value) in samples {
        ConstGauge::new(value).encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for Scrape {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        if let Some((labels, registered, failures)) = &self.registration {
            gauge(
                &mut encoder,
                "raahi_registration_registered",
                "1 while this gateway's registration is kept alive by heartbeats; 0 while \
                 registering, starting (check critical until the gateway is first ready), \
                 unreachable or withdrawn.",
                [(labels.clone(), i64::from(*registered))],
            )?;
            counter(
                &mut encoder,
                "raahi_registration_failures",
                "Calls to the registry's agent that failed since start.",
                [(labels.clone(), *failures)],
            )?;
        }
        counter(
            &mut encoder,
            "raahi_rate_share_syncs",
            "Exchanges of cluster-scope rate-limit demand through the store: result=\"ok\" \
             answered, result=\"failed\" did not (every share kept as it was).",
            [
                (vec![("result", "ok".to_owned())], self.rate_share_syncs.0),
                (
                    vec![("result", "failed".to_owned())],
                    self.rate_share_syncs.1,
                ),
            ],
        )?;
        counter(
            &mut encoder,
            "raahi_control_reloads",
            "Reads of the configuration store by the control task: kind=\"full\" reads \
             everything (start, periodic resync, fallback), kind=\"changed\" only what the \
             store's change log named.",
            [
                (vec![("kind", "full".to_owned())], self.reloads.0),
                (vec![("kind", "changed".to_owned())], self.reloads.1),
            ],
        )?;
        counter(
            &mut encoder,
            "raahi_unrouted_requests",
            "Requests that matched no route (answered 404).",
            [(Labels::new(), self.unrouted)],
        )?;
        counter(
            &mut encoder,
            "raahi_requests_refused",
            "Requests refused for breaking a rule or limit, by the code of the answer \
             (invalid_host, uri_too_long, request_body_too_large, upstream_overloaded, ...).",
            self.requests_refused.iter().cloned(),
        )?;
        gauge(
            &mut encoder,
            "raahi_client_connections",
            "Client connections open now on the proxy listeners.",
            [(
                Labels::new(),
                i64::try_from(self.client_connections).unwrap_or(i64::MAX),
            )],
        )?;
        counter(
            &mut encoder,
            "raahi_client_connections_refused",
            "Client connections closed on arrival: their listener had proxy.max_connections open.",
            [(Labels::new(), self.client_connections_refused)],
        )?;
        counter(
            &mut encoder,
            "raahi_http2_calmed_connections",
            "HTTP/2 client connections ended with GOAWAY ENHANCE_YOUR_CALM for cancelling most \
             of the streams they opened (rapid reset).",
            [(Labels::new(), self.http2_calmed_connections)],
        )?;
        counter(
            &mut encoder,
            "raahi_http2_streams_refused",
            "HTTP/2 streams refused with RST_STREAM REFUSED_STREAM: the client opened more at once \
             than proxy.http2_max_concurrent_streams.",
            [(Labels::new(), self.http2_streams_refused)],
        )?;
        let (memory, spool, spooled) = self.request_bodies;
        gauge(
            &mut encoder,
            "raahi_request_body_memory_bytes",
            "Memory held now by request bodies read before a target is picked (counted as \
             allocated; proxy.request_buffer_budget_bytes bounds it).",
            [(Labels::new(), i64::try_from(memory).unwrap_or(i64::MAX))],
        )?;
        gauge(
            &mut encoder,
            "raahi_request_spool_bytes",
            "Bytes held now in spool files by request bodies too large for memory \
             (proxy.request_spool_budget_bytes bounds it).",
            [(Labels::new(), i64::try_from(spool).unwrap_or(i64::MAX))],
        )?;
        counter(
            &mut encoder,
            "raahi_requests_spooled",
            "Request bodies written to a spool file before a target was picked.",
            [(Labels::new(), spooled)],
        )?;
        self.admin.encode(&mut encoder)?;
        counter(
            &mut encoder,
            "raahi_log_dropped_lines",
            "Log lines (access lines and other events) dropped rather than wait: stderr fell \
             1 MiB of one thread's lines behind, or failed.",
            [(Labels::new(), self.dropped_log_lines)],
        )?;
        if let Some(tracing) = &self.tracing {
            tracing.encode(&mut encoder)?;
        }
        gauge(
            &mut encoder,
            "raahi_store_up",
            "1 when the configuration store answered this scrape; 0 leaves its series out.",
            [(Labels::new(), i64::from(self.store_up))],
        )?;
        counter(
            &mut encoder,
            "raahi_client_connection_parks",
            "Idle HTTP/1.1 client connections that gave back their HTTP buffers between requests.",
            [(Labels::new(), self.client_connection_parks)],
        )?;
        gauge(
            &mut encoder,
            "raahi_parked_client_connections",
            "HTTP/1.1 client connections open and idle now, holding no HTTP buffers.",
            [(
                Labels::new(),
                i64::try_from(self.parked_client_connections).unwrap_or(i64::MAX),
            )],
        )?;
        counter(
            &mut encoder,
            "raahi_stream_unmatched_connections",
            "Stream connections closed because no stream route matched (SNI or ClientHello).",
            [(Labels::new(), self.stream_unmatched)],
        )?;
        counter(
            &mut encoder,
            "raahi_stream_connections",
            "Connections accepted per stream route.",
            self.streams
                .iter()
                .map(|stream| (stream.labels.clone(), stream.connections)),
        )?;
        gauge(
            &mut encoder,
            "raahi_stream_active_connections",
            "Connections open now per stream route.",
            self.streams
                .iter()
                .map(|stream| (stream.labels.clone(), stream.active as i64)),
        )?;
        counter(
            &mut encoder,
            "raahi_stream_sent_bytes",
            "Bytes copied per stream route, by direction (client_to_upstream, upstream_to_client).",
            self.streams.iter().flat_map(|stream| {
                [
                    (
                        with(
                            &stream.labels,
                            ("direction", "client_to_upstream".to_owned()),
                        ),
                        stream.bytes_in,
                    ),
                    (
                        with(
                            &stream.labels,
                            ("direction", "upstream_to_client".to_owned()),
                        ),
                        stream.bytes_out,
                    ),
                ]
            }),
        )?;
        counter(
            &mut encoder,
            "raahi_stream_connect_failures",
            "Connections to targets that failed per stream route (each tried target counts).",
            self.streams
                .iter()
                .map(|stream| (stream.labels.clone(), stream.connect_failures)),
        )?;
        gauge(
            &mut encoder,
            "raahi_certificate_not_after_seconds",
            "Expiry (unix seconds) of each served certificate, by source: api (stored through \
             the admin API; certificate_id) or file (the config's files; cert_file).",
            self.certificates.iter().cloned(),
        )?;
        counter(
            &mut encoder,
            "raahi_requests",
            "Requests answered, by service, route and status class.",
            self.routes.iter().flat_map(|route| {
                STATUS_CLASSES
                    .iter()
                    .zip(route.responses)
                    .map(|(class, count)| {
                        (with(&route.labels, ("class", class.to_string())), count)
                    })
            }),
        )?;
        counter(
            &mut encoder,
            "raahi_route_requests",
            "Requests each route sent to each of its backends (service, or service{subset}).",
            self.routes.iter().flat_map(|route| {
                route.backends.iter().map(|(backend, count)| {
                    let labels: Labels =
                        vec![("route", route.name.clone()), ("backend", backend.clone())];
                    (labels, *count)
                })
            }),
        )?;
        counter(
            &mut encoder,
            "raahi_route_redirects",
            "Requests answered with a route's redirect.",
            self.routes
                .iter()
                .filter(|route| route.redirects > 0)
                .map(|route| (vec![("route", route.name.clone())], route.redirects)),
        )?;
        counter(
            &mut encoder,
            "raahi_route_mirrored",
            "Copies of a route's requests sent to its mirror.",
            self.routes
                .iter()
                .filter(|route| route.has_mirror)
                .map(|route| (vec![("route", route.name.clone())], route.mirrored)),
        )?;
        counter(
            &mut encoder,
            "raahi_route_mirror_dropped",
            "Copies for a route's mirror not made: too many out at once, or a streaming body.",
            self.routes
                .iter()
                .filter(|route| route.has_mirror)
                .map(|route| (vec![("route", route.name.clone())], route.mirror_dropped)),
        )?;
        let rate_limits = || {
            self.routes.iter().filter_map(|route| {
                let sample = route.rate_limit.as_ref()?;
                Some((vec![("route", route.name.clone())], sample))
            })
        };
        counter(
            &mut encoder,
            "raahi_rate_limited",
            "Requests a route's rate_limit refused (429 rate_limited) on this gateway.",
            rate_limits().map(|(labels, sample)| (labels, sample.limited)),
        )?;
        gauge(
            &mut encoder,
            "raahi_rate_limit_keys",
            "Keys a route's rate_limit tracks now (at most its max_keys, rounded up to a whole \
             bucket).",
            rate_limits()
                .map(|(labels, sample)| (labels, i64::try_from(sample.keys).unwrap_or(i64::MAX))),
        )?;
        gauge(
            &mut encoder,
            "raahi_rate_limit_rate",
            "Requests per second a key without a share of its own may send through this \
             gateway: the route's rate, or under scope cluster this gateway's default share.",
            rate_limits().map(|(labels, sample)| (labels, sample.default_rate)),
        )?;
        gauge(
            &mut encoder,
            "raahi_canary_weight",
            "The canary backend's percent of a canary route's requests, as this gateway applies \
             it.",
            self.routes.iter().filter_map(|route| {
                let weight = route.canary_weight?;
                Some((vec![("route", route.name.clone())], i64::from(weight)))
            }),
        )?;
        let in_flight = || {
            self.routes.iter().filter_map(|route| {
                let (now, refused) = route.in_flight?;
                Some((vec![("route", route.name.clone())], now, refused))
            })
        };
        gauge(
            &mut encoder,
            "raahi_route_in_flight",
            "Requests of a route with max_in_flight in flight now on this gateway.",
            in_flight().map(|(labels, now, _)| (labels, i64::try_from(now).unwrap_or(i64::MAX))),
        )?;
        counter(
            &mut encoder,
            "raahi_route_in_flight_refused",
            "Requests a route refused past its max_in_flight (503 too_many_requests).",
            in_flight().map(|(labels, _, refused)| (labels, refused)),
        )?;
        {
            let mut metric = encoder.encode_descriptor(
                "raahi_request_duration_seconds",
                "Time from a request's arrival to its response headers, by service and route.",
                None,
                MetricType::Histogram,
            )?;
            for route in &self.routes {
                let count = route.buckets.iter().map(|(_, count)| count).sum();
                metric
                    .encode_family(&route.labels)?
                    .encode_histogram::<Labels>(route.latency_sum, count, &route.buckets, None)?;
            }
        }
        counter(
            &mut encoder,
            "raahi_upstream_connect_errors",
            "Attempts whose connection to a target failed or timed out.",
            self.services
                .iter()
                .map(|service| (service.labels.clone(), service.connect_errors)),
        )?;
        counter(
            &mut encoder,
            "raahi_upstream_timeouts",
            "Attempts that got no response headers, or could not send the body, in time.",
            self.services
                .iter()
                .map(|service| (service.labels.clone(), service.timeouts)),
        )?;
        counter(
            &mut encoder,
            "raahi_balancer_panic_picks",
            "Picks that ignored health and ejection because no tier had an available target.",
            self.services
                .iter()
                .map(|service| (service.labels.clone(), service.panic_picks)),
        )?;
        counter(
            &mut encoder,
            "raahi_session_repinned",
            "Requests whose session cookie named a target that could not take them: picked anew, with a new cookie.",
            self.services.iter().filter_map(|service| {
                Some((service.labels.clone(), service.sessions_repinned?))
            }),
        )?;
        let localities = || {
            self.services
                .iter()
                .filter_map(|service| Some((&service.labels, service.locality?)))
        };
        gauge(
            &mut encoder,
            "raahi_locality_in_zone",
            "1 while a service with locality sends its requests only to the gateway's zone \
             (at least locality.min_available_percent of the zone's targets available), 0 while \
             it spreads them over every zone.",
            localities().map(|(labels, sample)| (labels.clone(), i64::from(sample.in_zone))),
        )?;
        counter(
            &mut encoder,
            "raahi_locality_picks",
            "Picks of a service with locality, by the targets picked among: zone (the gateway's \
             zone only) or all_zones.",
            localities().flat_map(|(labels, sample)| {
                [
                    (with(labels, ("set", "zone".to_owned())), sample.zone_picks),
                    (
                        with(labels, ("set", "all_zones".to_owned())),
                        sample.all_zone_picks,
                    ),
                ]
            }),
        )?;
        let retries = || {
            self.services
                .iter()
                .filter_map(|service| Some((&service.labels, service.retries.as_ref()?)))
        };
        counter(
            &mut encoder,
            "raahi_retries",
            "Retries sent to a service's targets on this gateway, by what the attempt before met: \
             connect_failure, refused (an HTTP/2 stream never processed), reset, per_try_timeout, \
             status (an HTTP status the retry policy names), grpc_status (a gRPC status in a \
             trailers-only answer). Hedges count in raahi_hedges.",
            retries().flat_map(|(labels, sample)| {
                RetryReason::ALL.iter().map(move |reason| {
                    (
                        with(labels, ("reason", reason.name().to_owned())),
                        sample.sent[*reason as usize],
                    )
                })
            }),
        )?;
        counter(
            &mut encoder,
            "raahi_retry_budget_exhausted",
            "Retries and hedges a service's retry budget refused on this gateway (retries and \
             hedges in the last 10 s may reach budget.percent of the requests plus \
             budget.min_per_second times 10): the failure went to the client as it was.",
            retries().map(|(labels, sample)| (labels.clone(), sample.budget_exhausted)),
        )?;
        counter(
            &mut encoder,
            "raahi_hedges",
            "Hedged attempts sent to a service's targets on this gateway: a second attempt \
             while the first had no response headers after the route's hedge_after_ms (each \
             spends the retry budget).",
            retries().map(|(labels, sample)| (labels.clone(), sample.hedges)),
        )?;
        gauge(
            &mut encoder,
            "raahi_target_in_flight_requests",
            "Requests in flight per target in rotation.",
            self.targets
                .iter()
                .map(|target| (target.labels.clone(), i64::from(target.in_flight))),
        )?;
        gauge(
            &mut encoder,
            "raahi_target_health",
            "1 for the health each target in rotation has (unknown, healthy, unhealthy).",
            self.targets.iter().flat_map(|target| {
                [Health::Unknown, Health::Healthy, Health::Unhealthy].map(|health| {
                    (
                        with(&target.labels, ("health", health.as_str().to_owned())),
                        i64::from(target.health == health),
                    )
                })
            }),
        )?;
        gauge(
            &mut encoder,
            "raahi_service_queued_requests",
            "Requests waiting now for room at a full target (limits.max_connections_per_target).",
            self.services.iter().map(|service| {
                (
                    service.labels.clone(),
                    i64::try_from(service.queued).unwrap_or(i64::MAX),
                )
            }),
        )?;
        let h2 = |index: usize| {
            self.services.iter().filter_map(move |service| {
                service
                    .h2
                    .map(|values| (service.labels.clone(), values[index]))
            })
        };
        gauge(
            &mut encoder,
            "raahi_upstream_h2_connections",
            "HTTP/2 connections open now to the targets of each h2c service (and https, by ALPN).",
            h2(0).map(|(labels, value)| (labels, i64::try_from(value).unwrap_or(i64::MAX))),
        )?;
        gauge(
            &mut encoder,
            "raahi_upstream_h2_streams",
            "HTTP/2 streams open now to the targets of each h2c service (and https, by ALPN).",
            h2(1).map(|(labels, value)| (labels, i64::try_from(value).unwrap_or(i64::MAX))),
        )?;
        counter(
            &mut encoder,
            "raahi_upstream_h2_unprocessed_streams",
            "HTTP/2 streams a target never processed (REFUSED_STREAM, or above the last stream \
             id of its GOAWAY): retried on another connection or target whatever the method.",
            h2(2),
        )?;
        counter(
            &mut encoder,
            "raahi_service_overloaded_requests",
            "Requests and connections refused with upstream_overloaded: the service's queue was \
             full or its queue_timeout_ms ran out.",
            self.services
                .iter()
                .map(|service| (service.labels.clone(), service.overloaded)),
        )?;
        gauge(
            &mut encoder,
            "raahi_target_ejected",
            "1 while a target in rotation is ejected by passive outlier detection.",
            self.targets
                .iter()
                .map(|target| (target.labels.clone(), i64::from(target.ejected))),
        )?;
        gauge(
            &mut encoder,
            "raahi_targets",
            "Targets per service and lifecycle state (active, draining, stale).",
            self.target_states.iter().map(|(service, state, count)| {
                (
                    vec![("service", service.clone()), ("state", state.clone())],
                    *count,
                )
            }),
        )?;
        gauge(
            &mut encoder,
            "raahi_discovery_source_state",
            "1 for the lifecycle state each discovery source is in.",
            self.sources.iter().flat_map(|source| {
                SOURCE_STATES.map(|state| {
                    (
                        with(&source.labels, ("state", state.as_str().to_owned())),
                        i64::from(source.state == state),
                    )
                })
            }),
        )?;
        gauge(
            &mut encoder,
            "raahi_discovery_guard_held_targets",
            "Targets the removal guard keeps serving although their source's registry no longer \
             lists them.",
            self.sources
                .iter()
                .map(|source| (source.labels.clone(), source.guard_held as i64)),
        )?;
        gauge(
            &mut encoder,
            "raahi_discovery_watch_connected",
            "1 while a watch provider's watch is connected, 0 while it backs off or reconnects.",
            self.sources.iter().filter_map(|source| {
                let connected = source.watch_connected?;
                Some((source.labels.clone(), i64::from(connected)))
            }),
        )?;
        counter(
            &mut encoder,
            "raahi_discovery_refreshes",
            "Refresh attempts per discovery source since start.",
            self.sources
                .iter()
                .map(|source| (source.labels.clone(), source.refreshes)),
        )?;
        counter(
            &mut encoder,
            "raahi_discovery_refresh_failures",
            "Failed refresh attempts per discovery source since start.",
            self.sources
                .iter()
                .map(|source| (source.labels.clone(), source.failures)),
        )?;
        let mut metric = encoder.encode_descriptor(
            "raahi_discovery_refresh_duration_seconds",
            "Time spent in refresh attempts per discovery source since start.",
            None,
            MetricType::Counter,
        )?;
        for source in &self.sources {
            ConstCounter::new(source.duration_seconds)
                .encode(metric.encode_family(&source.labels)?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(name: &str) -> RouteSample {
        RouteSample {
            labels: vec![("route", name.to_owned())],
            name: name.to_owned(),
            backends: Vec::new(),
            redirects: 0,
            mirrored: 0,
            mirror_dropped: 0,
            has_mirror: false,
            rate_limit: None,
            canary_weight: None,
            in_flight: None,
            responses: [0; 5],
            buckets: Vec::new(),
            latency_sum: 0.0,
        }
    }

    fn service(name: &str, retries: Option<RetrySample>) -> ServiceSample {
        ServiceSample {
            labels: vec![("service", name.to_owned())],
            panic_picks: 0,
            connect_errors: 0,
            timeouts: 0,
            queued: 0,
            overloaded: 0,
            h2: None,
            sessions_repinned: None,
            retries,
            locality: None,
        }
    }

    async fn text(scrape: Scrape) -> String {
        let response = encode(scrape);
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        String::from_utf8(body.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn route_limits_have_series_only_where_a_route_has_them() {
        let mut limited = route("limited");
        limited.rate_limit = Some(RateLimitSample {
            limited: 7,
            keys: 3,
            default_rate: 2.5,
        });
        let mut held = route("held");
        held.in_flight = Some((4, 9));
        let text = text(Scrape {
            routes: vec![limited, held, route("plain")],
            ..Scrape::default()
        })
        .await;
        for line in [
            "raahi_rate_limited_total{route=\"limited\"} 7",
            "raahi_rate_limit_keys{route=\"limited\"} 3",
            "raahi_rate_limit_rate{route=\"limited\"} 2.5",
            "raahi_route_in_flight{route=\"held\"} 4",
            "raahi_route_in_flight_refused_total{route=\"held\"} 9",
            "# TYPE raahi_rate_limited counter",
            "# TYPE raahi_rate_limit_rate gauge",
            "# TYPE raahi_route_in_flight gauge",
            "# TYPE raahi_route_in_flight_refused counter",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        let limit_series = [
            "raahi_rate_limited_total",
            "raahi_rate_limit_keys",
            "raahi_rate_limit_rate",
            "raahi_route_in_flight",
            "raahi_route_in_flight_refused_total",
        ];
        let shown: Vec<&str> = text
            .lines()
            .filter(|line| {
                limit_series.iter().any(|series| {
                    line.strip_prefix(series)
                        .is_some_and(|l| l.starts_with('{'))
                })
            })
            .collect();
        assert_eq!(
            shown.len(),
            5,
            "no series for routes without the limit: {shown:?}"
        );
    }

    #[tokio::test]
    async fn retries_have_every_reason_for_every_sampled_service() {
        let mut sent = [0; RetryReason::ALL.len()];
        sent[RetryReason::ConnectFailure as usize] = 5;
        sent[RetryReason::Status as usize] = 2;
        let text = text(Scrape {
            services: vec![
                service(
                    "web",
                    Some(RetrySample {
                        sent,
                        budget_exhausted: 3,
                        hedges: 4,
                    }),
                ),
                service("idle", Some(RetrySample::default())),
                service("postgres", None),
            ],
            ..Scrape::default()
        })
        .await;
        for line in [
            "# TYPE raahi_retries counter",
            "# TYPE raahi_retry_budget_exhausted counter",
            "# TYPE raahi_hedges counter",
            "raahi_retries_total{service=\"web\",reason=\"connect_failure\"} 5",
            "raahi_retries_total{service=\"web\",reason=\"refused\"} 0",
            "raahi_retries_total{service=\"web\",reason=\"reset\"} 0",
            "raahi_retries_total{service=\"web\",reason=\"per_try_timeout\"} 0",
            "raahi_retries_total{service=\"web\",reason=\"status\"} 2",
            "raahi_retries_total{service=\"web\",reason=\"grpc_status\"} 0",
            "raahi_retry_budget_exhausted_total{service=\"web\"} 3",
            "raahi_hedges_total{service=\"web\"} 4",
            "raahi_retries_total{service=\"idle\",reason=\"grpc_status\"} 0",
            "raahi_retry_budget_exhausted_total{service=\"idle\"} 0",
            "raahi_hedges_total{service=\"idle\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        let retry_lines = |service: &str| {
            text.lines()
                .filter(|line| {
                    [
                        "raahi_retries_total{",
                        "raahi_retry_budget_exhausted_total{",
                        "raahi_hedges_total{",
                    ]
                    .iter()
                    .any(|series| line.starts_with(series))
                        && line.contains(&format!("service=\"{service}\""))
                })
                .count()
        };
        // Six reasons, the budget and the hedges: cardinality bounded by the services.
        assert_eq!(retry_lines("web"), 8, "{text}");
        assert_eq!(retry_lines("idle"), 8, "{text}");
        assert_eq!(
            retry_lines("postgres"),
            0,
            "a service without a sample has no series: {text}"
        );
    }
}
