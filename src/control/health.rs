//! Active health checks: one loop per service that has `health_check` set, run in the control
//! plane with jitter and a bound on concurrent checks, never on the request path. Verdicts go to
//! the per-target atomics the balancer reads, and to the store for target listings.
//!
//! Checks speak the service's protocol: when its targets speak TLS (`https`, `tls`), HTTP checks
//! and `tls` handshake checks dial through the proxy's own TLS connector with the same server
//! name, verification and CA as traffic, so a check never judges a target by a protocol its
//! traffic does not use.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::{header, HeaderValue, Request, Uri};
use http_body_util::Empty;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tower::ServiceExt;

use crate::balance::TargetHealth;
use crate::model::{CheckResult, Health, HealthCheck, HealthCheckKind, Id, Service};
use crate::proxy::{AlpnOffer, TlsTargetConnector, UpstreamTlsError};
use crate::snapshot::SnapshotHandle;
use crate::store::{ChangeSet, Store};
use crate::tls;

mod grpc;

/// Checks running at once across all services.
const MAX_CONCURRENT_CHECKS: usize = 64;
const JITTER_FRACTION: f64 = 0.10;

type PlainClient = Client<HttpConnector, Empty<Bytes>>;
type TlsClient = Client<TlsTargetConnector, Empty<Bytes>>;

/// A change of a target's health the checks decided, for the event log.
#[derive(Debug)]
pub(super) struct HealthVerdict {
    pub(super) target_id: Id,
    pub(super) health: crate::model::Health,
    /// e.g. `3 failed checks: HTTP 500`.
    pub(super) reason: String,
    /// The check that decided it (the store has it only after the round).
    pub(super) check: CheckResult,
}

/// The running check loops, one per service with checks on.
pub(super) struct HealthCheckers {
    loops: HashMap<Id, RunningLoop>,
    permits: Arc<Semaphore>,
    verdicts: mpsc::Sender<HealthVerdict>,
}

struct RunningLoop {
    /// What the loop was started with; a change restarts it.
    settings: CheckSettings,
    task: JoinHandle<()>,
}

/// A service's check and the service settings that shape its connections and requests.
#[derive(Debug, Clone, PartialEq)]
struct CheckSettings {
    check: HealthCheck,
    upstream_authority: Option<String>,
    /// The targets speak TLS (`https`, `tls`): HTTP checks go over TLS, as traffic does.
    targets_speak_tls: bool,
    /// The targets speak HTTP/2 with prior knowledge (`h2c`): so do HTTP checks.
    h2c: bool,
    tls_sni: Option<String>,
    tls_verify: bool,
    tls_ca_pem: Option<String>,
}

impl CheckSettings {
    fn of(service: &Service) -> Option<CheckSettings> {
        Some(CheckSettings {
            check: service.health_check.clone()?,
            upstream_authority: service.upstream_authority.clone(),
            targets_speak_tls: service.protocol.targets_speak_tls(),
            h2c: service.protocol == crate::model::Protocol::H2c,
            tls_sni: service.tls_sni.clone(),
            tls_verify: service.tls_verify,
            tls_ca_pem: service.tls_ca_pem.clone(),
        })
    }

    /// The server name a check of `target` sends: the one its traffic sends (DESIGN §6).
    fn server_name<'a>(&'a self, target: &'a Authority) -> &'a str {
        tls::upstream_server_name(
            self.tls_sni.as_deref(),
            self.upstream_authority.as_deref(),
            target,
        )
    }

    /// `Host` of an HTTP check: the check's own, else the service's `upstream_authority`, else
    /// the target's address.
    fn host<'a>(&'a self, target: &'a Authority) -> &'a str {
        self.check
            .host
            .as_deref()
            .or(self.upstream_authority.as_deref())
            .unwrap_or(target.as_str())
    }
}

impl Drop for RunningLoop {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl HealthCheckers {
    /// Changes of health are also told to `verdicts` (the control task's event log).
    pub(super) fn new(verdicts: mpsc::Sender<HealthVerdict>) -> HealthCheckers {
        HealthCheckers {
            loops: HashMap::new(),
            permits: Arc::new(Semaphore::new(MAX_CONCURRENT_CHECKS)),
            verdicts,
        }
    }

    /// Stops the loops of the services `changes` names whose checks went away or changed. Done
    /// before a new snapshot resets the verdicts of unchecked targets, so no late result undoes
    /// the reset.
    pub(super) fn stop_unwanted(
        &mut self,
        services: &BTreeMap<Id, Arc<Service>>,
        changes: &ChangeSet,
    ) {
        self.loops.retain(|id, running| {
            !changes.touches_service(*id)
                || services
                    .get(id)
                    .and_then(|service| CheckSettings::of(service))
                    .as_ref()
                    == Some(&running.settings)
        });
    }

    /// Starts a loop for each service `changes` names that has a `health_check` and no loop
    /// (after publishing, so the first round sees the new targets).
    pub(super) fn start_missing(
        &mut self,
        services: &BTreeMap<Id, Arc<Service>>,
        changes: &ChangeSet,
        snapshots: &SnapshotHandle,
        store: &Store,
    ) {
        let named: Box<dyn Iterator<Item = &Arc<Service>>> = if changes.everything {
            Box::new(services.values())
        } else {
            Box::new(changes.services.iter().filter_map(|id| services.get(id)))
        };
        for service in named {
            let service_id = service.id;
            let Some(settings) = CheckSettings::of(service) else {
                continue;
            };
            if self.loops.contains_key(&service_id) {
                continue;
            }
            let checker = ServiceChecker {
                service_id,
                plain: fresh_connections(connector(settings.check.timeout_ms)),
                tls_config: OnceLock::new(),
                settings: settings.clone(),
                snapshots: snapshots.clone(),
                store: store.clone(),
                permits: self.permits.clone(),
                verdicts: self.verdicts.clone(),
            };
            let task = tokio::spawn(checker.run());
            self.loops
                .insert(service_id, RunningLoop { settings, task });
        }
    }
}

/// A client that opens a new connection for every check: a pooled one would hide a dead
/// listener (or, over TLS, a certificate that stopped verifying).
fn fresh_connections<C>(connector: C) -> Client<C, Empty<Bytes>>
where
    C: hyper_util::client::legacy::connect::Connect + Clone,
{
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build(connector)
}

fn connector(timeout_ms: u64) -> HttpConnector {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(Duration::from_millis(timeout_ms)));
    connector.set_nodelay(true);
    connector
}

/// Consecutive results of one target.
#[derive(Debug, Default, Clone, Copy)]
struct Streak {
    passed: u32,
    failed: u32,
}

struct ServiceChecker {
    service_id: Id,
    settings: CheckSettings,
    snapshots: SnapshotHandle,
    store: Store,
    permits: Arc<Semaphore>,
    verdicts: mpsc::Sender<HealthVerdict>,
    plain: PlainClient,
    /// The TLS client config of this loop, built on the first TLS check: parsing the CA bundle
    /// once per loop, not once per check. An error fails every TLS check with its text.
    tls_config: OnceLock<Result<Arc<rustls::ClientConfig>, String>>,
}

struct Probe {
    target_id: Id,
    authority: Authority,
    health: Arc<TargetHealth>,
}

impl ServiceChecker {
    async fn run(self) {
        let this = Arc::new(self);
        let mut streaks: HashMap<Id, Streak> = HashMap::new();
        loop {
            let probes = this.probes();
            let mut checks = JoinSet::new();
            for probe in probes {
                let this = this.clone();
                checks.spawn(async move {
                    let _permit = this.permits.clone().acquire_owned().await;
                    let result = this.check_one(&probe.authority).await;
                    (probe, result)
                });
            }
            let mut records = Vec::new();
            let mut seen = std::collections::HashSet::new();
            while let Some(joined) = checks.join_next().await {
                let Ok((probe, result)) = joined else {
                    continue;
                };
                let streak = streaks.entry(probe.target_id).or_default();
                let health = judge(&this.settings.check, streak, &probe.health, result.passed);
                if health != probe.health.health() {
                    tracing::info!(
                        service_id = this.service_id,
                        target_id = probe.target_id,
                        health = health.as_str(),
                        detail = %result.detail,
                        "target health changed"
                    );
                    let (count, verdict) = match health {
                        Health::Unhealthy => (streak.failed, "failed"),
                        _ => (streak.passed, "passed"),
                    };
                    let plural = if count == 1 { "" } else { "s" };
                    let reason = format!("{count} {verdict} check{plural}: {}", result.detail);
                    // Full only when the control task is far behind: the event then lacks
                    // this detail, never the change itself (the task also reads the atomics).
                    // Told before it is set, so the control task's next look finds the reason.
                    let _ = this.verdicts.try_send(HealthVerdict {
                        target_id: probe.target_id,
                        health,
                        reason,
                        check: result.clone(),
                    });
                    probe.health.set_health(health);
                }
                seen.insert(probe.target_id);
                records.push((probe.target_id, health, result));
            }
            streaks.retain(|id, _| seen.contains(id));
            if let Err(error) = this.store.record_health_checks(&records).await {
                tracing::warn!(service_id = this.service_id, %error, "health check results not stored");
            }
            let interval = Duration::from_millis(this.settings.check.interval_ms);
            tokio::time::sleep(interval.mul_f64(1.0 - JITTER_FRACTION * fastrand::f64())).await;
        }
    }

    /// The targets currently in rotation for this service, and the draining ones that still
    /// serve their sessions (a session goes to its target only while it is available).
    fn probes(&self) -> Vec<Probe> {
        let snapshot = self.snapshots.load();
        let Some(service) = snapshot.service(self.service_id) else {
            return Vec::new();
        };
        let keeping_sessions = service
            .sessions
            .iter()
            .flat_map(|sessions| sessions.draining.iter());
        service
            .targets
            .iter()
            .chain(keeping_sessions)
            .map(|target| Probe {
                target_id: target.id,
                authority: target.authority.clone(),
                health: target.health.clone(),
            })
            .collect()
    }

    async fn check_one(&self, target: &Authority) -> CheckResult {
        let check = &self.settings.check;
        let attempt = async {
            match check.kind {
                HealthCheckKind::Tcp => tcp_check(target).await,
                HealthCheckKind::Http if self.settings.targets_speak_tls => {
                    self.https_check(target).await
                }
                HealthCheckKind::Http if self.settings.h2c => self.h2c_http_check(target).await,
                HealthCheckKind::Http => self.http_check(target).await,
                HealthCheckKind::Tls => self.tls_check(target).await,
                HealthCheckKind::Grpc => self.grpc_check(target).await,
            }
        };
        let timeout = Duration::from_millis(check.timeout_ms);
        let (passed, detail) = match tokio::time::timeout(timeout, attempt).await {
            Ok(Ok(verdict)) => verdict,
            Ok(Err(detail)) => (false, detail),
            Err(_) => (false, format!("timed out after {} ms", check.timeout_ms)),
        };
        CheckResult {
            at: crate::clock::now(),
            passed,
            detail,
        }
    }

    async fn http_check(&self, target: &Authority) -> Result<(bool, String), String> {
        let uri: Uri = format!("http://{target}{}", self.settings.check.path)
            .parse()
            .map_err(|error| format!("bad check URI: {error}"))?;
        let request = check_request(uri, self.settings.host(target));
        let response = self
            .plain
            .request(request)
            .await
            .map_err(|error| failure_text(&error))?;
        Ok(status_verdict(
            &self.settings.check,
            response.status().as_u16(),
        ))
    }

    /// An HTTP check over TLS, offering `h2` and `http/1.1` as traffic does.
    async fn https_check(&self, target: &Authority) -> Result<(bool, String), String> {
        let host = self.settings.host(target);
        // The URI's authority is what HTTP/2 sends as `:authority` (it must agree with Host);
        // the connector dials the target whatever the URI names.
        let authority = Authority::try_from(host).unwrap_or_else(|_| target.clone());
        let uri = Uri::builder()
            .scheme(Scheme::HTTPS)
            .authority(authority)
            .path_and_query(self.settings.check.path.as_str())
            .build()
            .map_err(|error| format!("bad check URI: {error}"))?;
        let client: TlsClient =
            fresh_connections(self.tls_connector(target, AlpnOffer::Http2AndHttp1));
        let response = client
            .request(check_request(uri, host))
            .await
            .map_err(|error| failure_text(&error))?;
        Ok(status_verdict(
            &self.settings.check,
            response.status().as_u16(),
        ))
    }

    /// An `http` check of an `h2c` service: HTTP/2 with prior knowledge, as its traffic.
    async fn h2c_http_check(&self, target: &Authority) -> Result<(bool, String), String> {
        let stream = tokio::net::TcpStream::connect(target.as_str())
            .await
            .map_err(|error| format!("connect: {error}"))?;
        let probe = grpc::H2Probe {
            scheme: Scheme::HTTP,
            authority: self.settings.host(target),
            timeout_ms: self.settings.check.timeout_ms,
        };
        let status = grpc::http2_status(stream, probe, &self.settings.check.path).await?;
        Ok(status_verdict(&self.settings.check, status))
    }

    /// `grpc.health.v1.Health/Check`: over HTTP/2 with prior knowledge for `h2c` services,
    /// over TLS (ALPN `h2`, the traffic's server name and trust) for `https` ones.
    async fn grpc_check(&self, target: &Authority) -> Result<(bool, String), String> {
        let service = self.settings.check.grpc_service.as_deref().unwrap_or("");
        let authority = self.settings.host(target);
        let timeout_ms = self.settings.check.timeout_ms;
        if !self.settings.targets_speak_tls {
            let stream = tokio::net::TcpStream::connect(target.as_str())
                .await
                .map_err(|error| format!("connect: {error}"))?;
            let probe = grpc::H2Probe {
                scheme: Scheme::HTTP,
                authority,
                timeout_ms,
            };
            return grpc::grpc_check(stream, probe, service).await;
        }
        let stream = self
            .tls_connector(target, AlpnOffer::Http2AndHttp1)
            .dial_tls()
            .await
            .map_err(|error| match UpstreamTlsError::find_in(&*error) {
                Some(tls) => handshake_detail(tls),
                None => format!("connect: {}", error_text(&*error)),
            })?;
        if stream.get_ref().1.alpn_protocol() != Some(b"h2") {
            return Err("the target did not choose h2 by ALPN: gRPC needs HTTP/2".to_owned());
        }
        let probe = grpc::H2Probe {
            scheme: Scheme::HTTPS,
            authority,
            timeout_ms,
        };
        grpc::grpc_check(stream, probe, service).await
    }

    /// A TCP connect and a full TLS handshake, then an orderly close.
    async fn tls_check(&self, target: &Authority) -> Result<(bool, String), String> {
        let connector = self.tls_connector(target, AlpnOffer::Nothing);
        match connector.oneshot(Uri::default()).await {
            Ok(connection) => {
                // The verdict is the handshake's; a close that fails changes nothing.
                let _ = connection.close().await;
                Ok((true, "TLS handshake completed".to_owned()))
            }
            Err(error) => Err(match UpstreamTlsError::find_in(&*error) {
                Some(tls) => handshake_detail(tls),
                None => format!("connect: {}", error_text(&*error)),
            }),
        }
    }

    fn tls_connector(&self, target: &Authority, alpn: AlpnOffer) -> TlsTargetConnector {
        let config = self.tls_config.get_or_init(|| {
            tls::client_config(
                self.settings.tls_verify,
                self.settings.tls_ca_pem.as_deref(),
            )
            .map_err(|error| error.to_string())
        });
        TlsTargetConnector::new(
            target.clone(),
            self.settings.server_name(target),
            config.clone(),
            alpn,
            Duration::from_millis(self.settings.check.timeout_ms),
        )
    }
}

async fn tcp_check(target: &Authority) -> Result<(bool, String), String> {
    tokio::net::TcpStream::connect(target.as_str())
        .await
        .map(|_| (true, "connected".to_owned()))
        .map_err(|error| format!("connect: {error}"))
}

fn check_request(uri: Uri, host: &str) -> Request<Empty<Bytes>> {
    let mut request = Request::new(Empty::new());
    *request.uri_mut() = uri;
    if let Ok(host) = HeaderValue::from_str(host) {
        request.headers_mut().insert(header::HOST, host);
    }
    request.headers_mut().insert(
        header::USER_AGENT,
        HeaderValue::from_static("raahi-health-check"),
    );
    request
}

fn status_verdict(check: &HealthCheck, status: u16) -> (bool, String) {
    if check.expects(status) {
        return (true, format!("HTTP {status}"));
    }
    (
        false,
        format!(
            "HTTP {status}, expected {}",
            check.expected_statuses.join(", ")
        ),
    )
}

/// What went wrong, for `last_check`: the handshake's own reason when TLS failed (not the
/// client's wrapping of it), the whole error chain otherwise.
fn failure_text(error: &(dyn std::error::Error + 'static)) -> String {
    match UpstreamTlsError::find_in(error) {
        Some(tls) => handshake_detail(tls),
        None => error_text(error),
    }
}

fn handshake_detail(error: &UpstreamTlsError) -> String {
    format!("TLS handshake: {}", error.detail())
}

fn error_text(error: &(dyn std::error::Error + 'static)) -> String {
    crate::error_chain::text(error)
}

/// The health after one more result: thresholds of consecutive results move it.
fn judge(check: &HealthCheck, streak: &mut Streak, current: &TargetHealth, passed: bool) -> Health {
    if passed {
        streak.passed = streak.passed.saturating_add(1);
        streak.failed = 0;
        if streak.passed >= check.healthy_threshold {
            return Health::Healthy;
        }
    } else {
        streak.failed = streak.failed.saturating_add(1);
        streak.passed = 0;
        if streak.failed >= check.unhealthy_threshold {
            return Health::Unhealthy;
        }
    }
    current.health()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{LbPolicy, Protocol, Timeouts};

    fn check() -> HealthCheck {
        serde_json::from_value(serde_json::json!({
            "healthy_threshold": 2,
            "unhealthy_threshold": 3
        }))
        .unwrap()
    }

    #[test]
    fn thresholds_of_consecutive_results_move_health() {
        let check = check();
        let health = TargetHealth::default();
        let mut streak = Streak::default();
        assert_eq!(judge(&check, &mut streak, &health, false), Health::Unknown);
        assert_eq!(judge(&check, &mut streak, &health, false), Health::Unknown);
        assert_eq!(
            judge(&check, &mut streak, &health, true),
            Health::Unknown,
            "a pass resets the failures"
        );
        assert_eq!(judge(&check, &mut streak, &health, true), Health::Healthy);
        health.set_health(Health::Healthy);
        assert_eq!(judge(&check, &mut streak, &health, false), Health::Healthy);
        assert_eq!(judge(&check, &mut streak, &health, false), Health::Healthy);
        assert_eq!(
            judge(&check, &mut streak, &health, false),
            Health::Unhealthy
        );
        health.set_health(Health::Unhealthy);
        assert_eq!(judge(&check, &mut streak, &health, true), Health::Unhealthy);
        assert_eq!(judge(&check, &mut streak, &health, true), Health::Healthy);
    }

    fn service(protocol: Protocol) -> Service {
        Service {
            limits: crate::model::UpstreamLimits::default(),
            id: 1,
            name: "s".into(),
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
            health_check: Some(check()),
            ejection: Default::default(),
            managed_by: None,
            created_at: crate::clock::now(),
            updated_at: crate::clock::now(),
        }
    }

    #[test]
    fn checks_go_over_tls_when_the_targets_speak_it() {
        for (protocol, over_tls) in [
            (Protocol::Http, false),
            (Protocol::Tcp, false),
            (Protocol::Https, true),
            (Protocol::Tls, true),
        ] {
            let settings = CheckSettings::of(&service(protocol)).expect("checks on");
            assert_eq!(settings.targets_speak_tls, over_tls, "{protocol:?}");
        }
        let mut off = service(Protocol::Https);
        off.health_check = None;
        assert!(CheckSettings::of(&off).is_none());
    }

    #[test]
    fn server_name_and_host_follow_the_traffic_rules() {
        let target = Authority::from_static("127.0.0.1:8443");
        let mut service = service(Protocol::Https);
        let settings = CheckSettings::of(&service).unwrap();
        assert_eq!(settings.server_name(&target), "127.0.0.1");
        assert_eq!(settings.host(&target), "127.0.0.1:8443");

        service.upstream_authority = Some("api.test:443".into());
        let settings = CheckSettings::of(&service).unwrap();
        assert_eq!(settings.server_name(&target), "api.test");
        assert_eq!(settings.host(&target), "api.test:443");

        service.tls_sni = Some("sni.test".into());
        if let Some(check) = service.health_check.as_mut() {
            check.host = Some("check.test".into());
        }
        let settings = CheckSettings::of(&service).unwrap();
        assert_eq!(settings.server_name(&target), "sni.test");
        assert_eq!(
            settings.host(&target),
            "check.test",
            "the check's Host is not its server name"
        );
    }

    #[test]
    fn a_changed_trust_setting_restarts_the_loop() {
        let before = [service(Protocol::Https)];
        let changes: [fn(&mut Service); 4] = [
            |service| service.tls_ca_pem = Some("-----BEGIN CERTIFICATE-----".into()),
            |service| service.tls_verify = false,
            |service| service.tls_sni = Some("other.test".into()),
            |service| service.protocol = Protocol::Http,
        ];
        for change in changes {
            let mut after = before.clone();
            change(&mut after[0]);
            assert_ne!(
                CheckSettings::of(&before[0]),
                CheckSettings::of(&after[0]),
                "{:?}",
                after[0]
            );
        }
    }

    /// An error wrapping the connector's as hyper-util's client error does: by `source()`.
    #[derive(Debug, thiserror::Error)]
    #[error("client error (Connect)")]
    struct Wrapped(#[source] Box<dyn std::error::Error + Send + Sync>);

    #[test]
    fn a_failed_handshake_reads_as_its_reason_and_server_name() {
        let failure = UpstreamTlsError {
            target: "127.0.0.1:8443".into(),
            server_name: "api.test".into(),
            reason: "invalid peer certificate: UnknownIssuer".into(),
        };
        let wrapped = Wrapped(Box::new(failure));
        assert_eq!(
            failure_text(&wrapped),
            "TLS handshake: invalid peer certificate: UnknownIssuer (server name \"api.test\")"
        );
        let refused = Wrapped(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "refused",
        )));
        assert_eq!(failure_text(&refused), "client error (Connect): refused");
    }

    #[test]
    fn status_verdict_names_what_was_expected() {
        let check = check();
        assert_eq!(status_verdict(&check, 204), (true, "HTTP 204".to_owned()));
        assert_eq!(
            status_verdict(&check, 500),
            (false, "HTTP 500, expected 200-399".to_owned())
        );
    }

    #[test]
    fn expected_statuses_are_ranges_or_codes() {
        let mut check = check();
        check.expected_statuses = vec!["200-299".into(), "301".into()];
        assert!(check.expects(204));
        assert!(check.expects(301));
        assert!(!check.expects(302));
        assert!(!check.expects(500));
    }
}
