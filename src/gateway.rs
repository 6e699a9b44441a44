//! Wires the parts into a running gateway: store, control task, proxy and admin listeners.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin::{self, auth, AdminState};
use crate::config::{self, Config, TlsConfig};
use crate::control::{
    self, ClusterSettings, ControlError, ControlHandle, EdgeOptions, FileCertificateExpiry,
    FileCertificates,
};
use crate::events::{EventLog, EventSettings};
use crate::model::path::EscapedSlashes;
use crate::proxy::stream::{StreamListeners, StreamSettings};
use crate::proxy::{
    self, BodySettings, Budget, ListenerSettings, ProxyState, RequestLimits, SpoolSettings,
};
use crate::registration::{Registrar, RegistrationError};
use crate::resources::{ApplyCounts, ApplyReport, ResourcesError, ResourcesFile};
use crate::snapshot::{GatewayCounters, Snapshot, SnapshotHandle};
use crate::store::{Store, StoreError};
use crate::tls::{self, CertResolver};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot open the store: {0}")]
    Store(#[from] StoreError),
    #[error("{0}")]
    Control(#[from] ControlError),
    #[error("{0}")]
    Resources(#[from] ResourcesError),
    #[error("{file}: {reason}")]
    Certificate { file: String, reason: String },
    #[error("read but not live: {0}")]
    NotLive(Arc<ControlError>),
    #[error("cannot listen on {address} ({role}): {source}")]
    Bind {
        role: &'static str,
        address: SocketAddr,
        source: std::io::Error,
    },
    #[error("{0}")]
    Registration(#[from] RegistrationError),
    #[error("proxy.request_spool_dir: cannot make spool files in {dir}: {source}")]
    SpoolDir { dir: String, source: std::io::Error },
    #[error("{0}")]
    Tracing(#[from] crate::telemetry::trace::TraceError),
}

/// A started gateway. Dropping it does not stop the proxy (only the registration's heartbeats);
/// call [`Gateway::drain`] or [`Gateway::shutdown`].
pub struct Gateway {
    pub proxy_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// The HTTPS listener's address, when `proxy.tls_listen` is set.
    pub tls_addr: Option<SocketAddr>,
    /// A newly generated admin token when the store had none (shown once).
    pub generated_admin_token: Option<String>,
    pub store: Store,
    pub control: ControlHandle,
    pub snapshots: SnapshotHandle,
    /// The declarative resources file, when configured, and what its first apply did (counted:
    /// the names are logged once).
    pub resources: Option<(ResourcesFile, ApplyCounts)>,
    /// This process's entry in Consul, when `registration.consul` is set.
    pub registrar: Option<Registrar>,
    /// Set when the shutdown sequence starts: `/readyz` answers 503 `draining`.
    draining: Arc<AtomicBool>,
    proxy_state: Arc<ProxyState>,
    /// The span exporter, flushed once requests have finished.
    tracer: Option<Arc<crate::telemetry::trace::Tracer>>,
    drain_delay: Duration,
    shutdown: watch::Sender<bool>,
    control_task: JoinHandle<()>,
    /// Listener tasks; each ends once its connections finished or the shutdown grace ran out.
    tasks: Vec<JoinHandle<()>>,
    sighup_task: Option<JoinHandle<()>>,
    streams: Arc<StreamListeners>,
}

/// Reads and checks the certificates named in the config; the default one is also served for
/// its own names.
pub fn load_file_certificates(config: &TlsConfig) -> Result<FileCertificates, StartError> {
    let load = |cert_file: &Path, key_file: &Path| {
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|error| StartError::Certificate {
                file: path.display().to_string(),
                reason: format!("cannot read: {error}"),
            })
        };
        let (cert_pem, key_pem) = (read(cert_file)?, read(key_file)?);
        tls::parse_certificate(&cert_pem, &key_pem).map_err(|error| StartError::Certificate {
            file: match error.field() {
                "key_pem" => key_file.display().to_string(),
                _ => cert_file.display().to_string(),
            },
            reason: error.to_string(),
        })
    };
    let expiry = |cert_file: &Path, parsed: &tls::ParsedCertificate| FileCertificateExpiry {
        cert_file: cert_file.display().to_string(),
        sni: parsed.names.first().cloned().unwrap_or_default(),
        not_after: parsed.not_after,
    };
    let mut certificates = FileCertificates::default();
    if let (Some(cert_file), Some(key_file)) = (&config.cert_file, &config.key_file) {
        let parsed = load(cert_file, key_file)?;
        certificates.expiries.push(expiry(cert_file, &parsed));
        certificates.default = Some(parsed.key.clone());
        certificates.others.push((parsed.names, parsed.key));
    }
    for files in &config.certificates {
        let parsed = load(&files.cert_file, &files.key_file)?;
        certificates
            .expiries
            .push(expiry(&files.cert_file, &parsed));
        certificates.others.push((parsed.names, parsed.key));
    }
    Ok(certificates)
}

/// How long a graceful shutdown waits to hand its discovery-source leases over.
const RELEASE_LEASES_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a stopping gateway waits for its last spans to reach the collector.
const TRACE_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

fn cluster_settings(config: &Config) -> ClusterSettings {
    ClusterSettings {
        lease: Duration::from_millis(config.cluster.lease_ms),
        resync: Duration::from_millis(config.cluster.resync_ms),
        rate_sync: Duration::from_millis(config.cluster.rate_sync_ms),
        zone: config.cluster.zone.as_deref().map(Into::into),
    }
}

/// The admin listener's accept backlog: std's and tokio's default, as before
/// `proxy.listen_backlog`, which is for the data path's listeners.
const ADMIN_LISTEN_BACKLOG: u32 = 128;

async fn bind(
    role: &'static str,
    address: SocketAddr,
    backlog: u32,
) -> Result<TcpListener, StartError> {
    proxy::bind_listener(address, backlog)
        .and_then(TcpListener::from_std)
        .map_err(|source| StartError::Bind {
            role,
            address,
            source,
        })
}

impl Gateway {
    /// Opens the store, publishes the first snapshot from it, then starts accepting.
    pub async fn start(config: &Config) -> Result<Gateway, StartError> {
        tls::install_crypto_provider();
        let instance_id = config.cluster.instance_id_or_generated();
        let store = Store::connect_as(&config.database.url, &instance_id).await?;
        let generated_admin_token =
            match auth::bootstrap(&store, config.admin.token.as_deref()).await? {
                auth::Bootstrap::Generated(token) => Some(token),
                auth::Bootstrap::Configured | auth::Bootstrap::Existing => None,
            };
        let snapshots = SnapshotHandle::new(Snapshot::empty());
        let gateway_counters = Arc::new(GatewayCounters::default());
        let settings = ListenerSettings {
            client_header_timeout: Duration::from_millis(config.proxy.client_header_timeout_ms),
            shutdown_grace: Duration::from_millis(config.proxy.shutdown_grace_ms),
            max_connections: config.proxy.max_connections as usize,
            http2_max_concurrent_streams: config.proxy.http2_max_concurrent_streams,
            http2_idle_timeout: Duration::from_millis(config.proxy.http2_idle_timeout_ms),
            requests: RequestLimits {
                max_uri_bytes: config.proxy.max_uri_bytes as usize,
                max_header_count: config.proxy.max_header_count as usize,
                max_header_bytes: config.proxy.max_header_bytes as usize,
                escaped_slashes: match config.proxy.escaped_slashes {
                    crate::config::EscapedSlashes::Keep => EscapedSlashes::Keep,
                    crate::config::EscapedSlashes::Reject => EscapedSlashes::Reject,
                },
            },
        };
        let streams = StreamListeners::new(
            snapshots.clone(),
            gateway_counters.clone(),
            StreamSettings {
                handshake_timeout: settings.client_header_timeout,
                shutdown_grace: settings.shutdown_grace,
                listen_backlog: config.proxy.listen_backlog,
            },
        );
        let certificates = config.proxy.tls_listen.is_some().then(CertResolver::new);
        let edge = EdgeOptions {
            streams: Some(streams.clone()),
            certificates: certificates.clone(),
            file_certificates: load_file_certificates(&config.tls)?,
        };
        let events = Arc::new(EventLog::new(event_settings(&config.admin)));
        let (control, control_task) = control::start(
            store.clone(),
            snapshots.clone(),
            edge,
            cluster_settings(config),
            events.clone(),
        )
        .await?;
        // Applied before the listeners open, so the first request already sees it.
        let resources = match &config.resources.file {
            Some(path) => {
                let file = ResourcesFile::new(path.clone(), store.clone(), control.clone());
                let report = file.apply().await?;
                tracing::info!(file = %path.display(), %report, "resources file applied");
                Some((file, report.counts()))
            }
            None => None,
        };

        let proxy_listener =
            bind("proxy", config.proxy.listen, config.proxy.listen_backlog).await?;
        let admin_listener = bind("admin", config.admin.listen, ADMIN_LISTEN_BACKLOG).await?;
        let proxy_addr = proxy_listener
            .local_addr()
            .map_err(|source| StartError::Bind {
                role: "proxy",
                address: config.proxy.listen,
                source,
            })?;
        let admin_addr = admin_listener
            .local_addr()
            .map_err(|source| StartError::Bind {
                role: "admin",
                address: config.admin.listen,
                source,
            })?;

        let (shutdown, shutdown_signal) = watch::channel(false);
        let tracer = start_tracer(&config.tracing, &instance_id)?;
        let proxy_state = ProxyState::new(
            snapshots.clone(),
            gateway_counters.clone(),
            settings.requests,
            body_settings(&config.proxy, &gateway_counters)?,
            match config.proxy.error_details {
                config::ErrorDetails::Brief => proxy::ErrorDetails::Brief,
                config::ErrorDetails::Full => proxy::ErrorDetails::Full,
            },
            tracer.clone(),
        );
        let mut tasks = vec![proxy::serve_http(
            proxy_listener,
            proxy_state.clone(),
            settings,
            shutdown_signal.clone(),
        )];
        let mut tls_addr = None;
        if let (Some(address), Some(resolver)) = (config.proxy.tls_listen, certificates) {
            let listener = bind("https", address, config.proxy.listen_backlog).await?;
            tls_addr = Some(listener.local_addr().map_err(|source| StartError::Bind {
                role: "https",
                address,
                source,
            })?);
            tasks.push(proxy::serve_https(
                listener,
                tls::server_config(resolver),
                proxy_state.clone(),
                settings,
                shutdown_signal.clone(),
            ));
        }
        let draining = Arc::new(AtomicBool::new(false));
        let started_at = crate::clock::now();
        // Registered once the proxy listens, so a client that finds it can reach it; its check
        // passes once `/readyz` first says ready.
        let registrar = match &config.registration.consul {
            Some(consul) => {
                let service_id = consul.service_id.clone().unwrap_or(instance_id);
                let readiness = admin::readiness::follow(
                    store.clone(),
                    control.clone(),
                    started_at,
                    draining.clone(),
                )
                .await;
                Some(Registrar::start(
                    consul,
                    service_id,
                    consul.advertised(proxy_addr),
                    readiness,
                )?)
            }
            None => None,
        };
        let admin_state = AdminState {
            store: store.clone(),
            control: control.clone(),
            started_at,
            gateway_counters,
            draining: draining.clone(),
            registration: registrar.as_ref().map(Registrar::status),
            connections: Arc::default(),
            event_streams: admin::EventStreams::new(config.admin.event_stream_budget_bytes),
            trace_counters: tracer.as_ref().map(|tracer| tracer.counters().clone()),
        };
        let admin_task = admin::serve(
            admin_listener,
            admin_state,
            admin_listener_settings(config),
            shutdown_signal,
        );
        tasks.push(admin_task);
        let certificate_files = (config.proxy.tls_listen.is_some()
            && (config.tls.cert_file.is_some() || !config.tls.certificates.is_empty()))
        .then(|| config.tls.clone());
        let reloads = Reloads {
            resources: resources.as_ref().map(|(file, _)| file.clone()),
            certificate_files,
            control: control.clone(),
        };
        let sighup_task = reloads.wanted().then(|| reload_on_sighup(reloads));
        tracing::info!(proxy = %proxy_addr, https = ?tls_addr, admin = %admin_addr, "raahi is serving");
        Ok(Gateway {
            proxy_addr,
            admin_addr,
            tls_addr,
            generated_admin_token,
            store,
            control,
            snapshots,
            resources,
            registrar,
            draining,
            proxy_state,
            tracer,
            drain_delay: config.drain_delay(),
            shutdown,
            control_task,
            tasks,
            sighup_task,
            streams,
        })
    }

    /// Reads the certificate files named in `config` again and serves them (what SIGHUP does).
    pub async fn reload_certificate_files(&self, config: &TlsConfig) -> Result<(), StartError> {
        let certificates = load_file_certificates(config)?;
        self.control
            .replace_file_certificates(certificates)
            .await
            .map_err(StartError::NotLive)?;
        Ok(())
    }

    /// Applies the resources file again (what SIGHUP does).
    pub async fn reload_resources(&self) -> Option<Result<ApplyReport, ResourcesError>> {
        let (file, _) = self.resources.as_ref()?;
        Some(file.apply().await)
    }

    /// The shutdown sequence (DESIGN §10): `/readyz` turns 503 `draining` and the registration
    /// is withdrawn; the proxy keeps accepting for `proxy.drain_delay_ms` (cut short when
    /// `hurry` completes: a second signal); then listeners close and requests in flight finish
    /// (within the shutdown grace); then the registration is removed.
    pub async fn drain(mut self, hurry: impl Future<Output = ()>) {
        self.draining.store(true, Ordering::SeqCst);
        self.proxy_state.start_draining();
        let registrar = self.withdraw().await;
        let delay = self.drain_delay;
        if !delay.is_zero() {
            tracing::info!(
                delay_ms = delay.as_millis() as u64,
                "draining: still accepting while clients stop choosing this instance"
            );
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = hurry => tracing::info!("second signal: skipping the rest of the drain delay"),
            }
        }
        self.stop_serving().await;
        if let Some(registrar) = registrar {
            registrar.deregister().await;
        }
    }

    /// [`Gateway::drain`] without the delay: withdraw, stop, finish in-flight, deregister.
    pub async fn shutdown(mut self) {
        self.drain_delay = Duration::ZERO;
        self.drain(std::future::pending()).await;
    }

    async fn withdraw(&mut self) -> Option<Registrar> {
        let mut registrar = self.registrar.take()?;
        registrar.withdraw().await;
        Some(registrar)
    }

    /// Stops accepting on every listener, lets requests and stream connections in flight finish
    /// (within the proxy's shutdown grace), then ends the control task.
    async fn stop_serving(self) {
        let _ = self.shutdown.send(true);
        // Event streams never end by themselves; the admin listener waits for its connections.
        self.control.events().close();
        if let Some(task) = self.sighup_task {
            task.abort();
        }
        let listeners = async {
            for task in self.tasks {
                let _ = task.await;
            }
        };
        // Meanwhile another instance may take the discovery sources over (bounded: with the
        // database away the leases simply expire).
        let handover = tokio::time::timeout(RELEASE_LEASES_TIMEOUT, self.control.release_leases());
        // The others take over this gateway's part of every cluster rate limit at once.
        let rate_handover =
            tokio::time::timeout(RELEASE_LEASES_TIMEOUT, self.control.stop_rate_sharing());
        let (_, _, _, _) =
            tokio::join!(listeners, self.streams.shutdown(), handover, rate_handover);
        if let Some(tracer) = &self.tracer {
            tracer.flush(TRACE_FLUSH_TIMEOUT).await;
        }
        self.control_task.abort();
    }

    /// Stops everything at once, without finishing requests or freeing leases: what a crash
    /// looks like to the other instances (for tests).
    pub fn abort(self) {
        let _ = self.shutdown.send(true);
        self.control.events().close();
        if let Some(task) = self.sighup_task {
            task.abort();
        }
        for task in self.tasks {
            task.abort();
        }
        self.control_task.abort();
    }
}

/// What a SIGHUP reads again: the resources file and the certificate files, when configured.
struct Reloads {
    resources: Option<ResourcesFile>,
    certificate_files: Option<TlsConfig>,
    control: ControlHandle,
}

impl Reloads {
    fn wanted(&self) -> bool {
        self.resources.is_some() || self.certificate_files.is_some()
    }

    /// Each part on its own: a file that fails changes nothing of what it configures.
    async fn reload(&self) {
        if let Some(file) = &self.resources {
            match file.apply().await {
                Ok(report) => {
                    tracing::info!(file = %file.path.display(), %report, "resources file applied")
                }
                Err(error) => {
                    tracing::error!(%error, "resources file not applied; the previous configuration stays")
                }
            }
        }
        if let Some(files) = &self.certificate_files {
            match load_file_certificates(files) {
                Ok(certificates) => {
                    match self.control.replace_file_certificates(certificates).await {
                        Ok(_) => tracing::info!("certificate files read again and served"),
                        Err(error) => {
                            tracing::error!(%error, "certificate files read but not served yet")
                        }
                    }
                }
                Err(error) => {
                    tracing::error!(%error, "certificate files not reloaded; the previous certificates stay")
                }
            }
        }
    }
}

/// Reads the resources file and the certificate files again on every SIGHUP. The handler is
/// installed before this returns: a SIGHUP that arrives as soon as the gateway says it is
/// serving must reload, not end the process (SIGHUP's default action).
fn reload_on_sighup(reloads: Reloads) -> JoinHandle<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let hangups = signal(SignalKind::hangup());
    tokio::spawn(async move {
        let mut hangups = match hangups {
            Ok(hangups) => hangups,
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGHUP; files are read only at start");
                return;
            }
        };
        while hangups.recv().await.is_some() {
            reloads.reload().await;
        }
    })
}

/// The admin listener's limits: the proxy's client timeouts, `admin.max_connections`.
fn admin_listener_settings(config: &Config) -> admin::ListenerSettings {
    admin::ListenerSettings {
        header_timeout: Duration::from_millis(config.proxy.client_header_timeout_ms),
        http2_idle_timeout: Duration::from_millis(config.proxy.http2_idle_timeout_ms),
        max_connections: config.admin.max_connections as usize,
        shutdown_grace: Duration::from_millis(config.proxy.shutdown_grace_ms),
    }
}

/// The event log's bounds as configured (`config` names no module of the gateway).
/// What request bodies may hold: memory, and a spool directory checked to be usable now.
fn body_settings(
    proxy: &crate::config::ProxyConfig,
    counters: &Arc<GatewayCounters>,
) -> Result<BodySettings, StartError> {
    let memory = Budget::new(
        proxy.request_buffer_budget_bytes,
        counters.clone(),
        |counters| &counters.request_body_memory_bytes,
    );
    let spool = if proxy.request_spool_bytes == 0 {
        None
    } else {
        let dir = proxy.spool_dir();
        proxy::probe_spool_dir(&dir).map_err(|source| StartError::SpoolDir {
            dir: dir.display().to_string(),
            source,
        })?;
        Some(SpoolSettings {
            dir,
            max_request_bytes: proxy.request_spool_bytes,
            disk: Budget::new(
                proxy.request_spool_budget_bytes,
                counters.clone(),
                |counters| &counters.request_spool_bytes,
            ),
            memory: memory.clone(),
            counters: counters.clone(),
        })
    };
    Ok(BodySettings {
        client_body_timeout: Duration::from_millis(proxy.client_body_timeout_ms),
        budget: memory,
        spool,
    })
}

fn event_settings(admin: &crate::config::AdminConfig) -> EventSettings {
    EventSettings {
        ring: admin.event_ring,
        client_queue: admin.event_client_queue,
    }
}

/// The span exporter, when `tracing.otlp_endpoint` is set.
fn start_tracer(
    config: &config::TracingConfig,
    instance_id: &str,
) -> Result<Option<Arc<crate::telemetry::trace::Tracer>>, StartError> {
    let Some(endpoint) = &config.otlp_endpoint else {
        return Ok(None);
    };
    let settings = crate::telemetry::trace::TraceSettings {
        otlp_endpoint: endpoint.clone(),
        sample_percent: config.sample_percent,
        service_name: config.service_name.clone(),
        instance_id: Some(instance_id.to_owned()),
        queue_requests: config.queue_requests,
        batch_requests: config.batch_requests,
        batch_delay: Duration::from_millis(config.batch_delay_ms),
        export_timeout: Duration::from_millis(config.export_timeout_ms),
    };
    Ok(Some(crate::telemetry::trace::Tracer::start(&settings)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configured_event_bounds_default_to_the_logs_own() {
        assert_eq!(
            event_settings(&crate::config::AdminConfig::default()),
            EventSettings::default()
        );
    }
}
