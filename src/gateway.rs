//! Wires the parts into a running gateway: store, control task, proxy and admin listeners.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin::{self, auth, AdminState};
use crate::config::Config;
use crate::control::{self, ControlError, ControlHandle};
use crate::proxy::{self, ListenerSettings, ProxyState};
use crate::resources::{ApplyReport, ResourcesError, ResourcesFile};
use crate::snapshot::{GatewayCounters, Snapshot, SnapshotHandle};
use crate::store::{Store, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot open the store: {0}")]
    Store(#[from] StoreError),
    #[error("{0}")]
    Control(#[from] ControlError),
    #[error("{0}")]
    Resources(#[from] ResourcesError),
    #[error("cannot listen on {address} ({role}): {source}")]
    Bind {
        role: &'static str,
        address: SocketAddr,
        source: std::io::Error,
    },
}

/// A started gateway. Dropping it does not stop it; call [`Gateway::shutdown`].
pub struct Gateway {
    pub proxy_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// A newly generated admin token when the store had none (shown once).
    pub generated_admin_token: Option<String>,
    pub store: Store,
    pub control: ControlHandle,
    pub snapshots: SnapshotHandle,
    /// The declarative resources file, when configured, and what its first apply did.
    pub resources: Option<(ResourcesFile, ApplyReport)>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

async fn bind(role: &'static str, address: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(address)
        .await
        .map_err(|source| StartError::Bind {
            role,
            address,
            source,
        })
}

impl Gateway {
    /// Opens the store, publishes the first snapshot from it, then starts accepting.
    pub async fn start(config: &Config) -> Result<Gateway, StartError> {
        let store = Store::connect(&config.database.url).await?;
        let generated_admin_token =
            match auth::bootstrap(&store, config.admin.token.as_deref()).await? {
                auth::Bootstrap::Generated(token) => Some(token),
                auth::Bootstrap::Configured | auth::Bootstrap::Existing => None,
            };
        let snapshots = SnapshotHandle::new(Snapshot::empty());
        let (control, control_task) = control::start(store.clone(), snapshots.clone()).await?;
        // Applied before the listeners open, so the first request already sees it.
        let resources = match &config.resources.file {
            Some(path) => {
                let file = ResourcesFile::new(path.clone(), store.clone(), control.clone());
                let report = file.apply().await?;
                tracing::info!(file = %path.display(), %report, "resources file applied");
                Some((file, report))
            }
            None => None,
        };

        let proxy_listener = bind("proxy", config.proxy.listen).await?;
        let admin_listener = bind("admin", config.admin.listen).await?;
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
        let gateway_counters = Arc::new(GatewayCounters::default());
        let settings = ListenerSettings {
            client_header_timeout: std::time::Duration::from_millis(
                config.proxy.client_header_timeout_ms,
            ),
            shutdown_grace: std::time::Duration::from_millis(config.proxy.shutdown_grace_ms),
        };
        let proxy_task = proxy::serve_http(
            proxy_listener,
            ProxyState::new(snapshots.clone(), gateway_counters.clone()),
            settings,
            shutdown_signal.clone(),
        );
        let admin_app = admin::router(AdminState {
            store: store.clone(),
            control: control.clone(),
            started_at: chrono::Utc::now(),
            gateway_counters,
        });
        let mut admin_shutdown = shutdown_signal;
        let admin_task = tokio::spawn(async move {
            let serve = axum::serve(admin_listener, admin_app).with_graceful_shutdown(async move {
                let _ = admin_shutdown.wait_for(|stop| *stop).await;
            });
            if let Err(error) = serve.await {
                tracing::error!(%error, "admin listener failed");
            }
        });
        let mut tasks = vec![control_task, proxy_task, admin_task];
        if let Some((file, _)) = &resources {
            tasks.push(reload_on_sighup(file.clone()));
        }
        tracing::info!(proxy = %proxy_addr, admin = %admin_addr, "raahi is serving");
        Ok(Gateway {
            proxy_addr,
            admin_addr,
            generated_admin_token,
            store,
            control,
            snapshots,
            resources,
            shutdown,
            tasks,
        })
    }

    /// Applies the resources file again (what SIGHUP does).
    pub async fn reload_resources(&self) -> Option<Result<ApplyReport, ResourcesError>> {
        let (file, _) = self.resources.as_ref()?;
        Some(file.apply().await)
    }

    /// Stops accepting on both listeners, lets requests in flight finish (within the proxy's
    /// shutdown grace), then ends the control task.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        let mut tasks = self.tasks;
        let control_task = tasks.remove(0);
        let sighup_task = (tasks.len() > 2).then(|| tasks.remove(2));
        if let Some(task) = sighup_task {
            task.abort();
        }
        for task in tasks {
            let _ = task.await;
        }
        control_task.abort();
    }
}

/// Re-applies the resources file on every SIGHUP; a file that fails changes nothing. The
/// handler is installed before this returns: a SIGHUP that arrives as soon as the gateway says it
/// is serving must reload, not end the process (SIGHUP's default action).
fn reload_on_sighup(file: ResourcesFile) -> JoinHandle<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let hangups = signal(SignalKind::hangup());
    tokio::spawn(async move {
        let mut hangups = match hangups {
            Ok(hangups) => hangups,
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGHUP; the resources file applies only at start");
                return;
            }
        };
        while hangups.recv().await.is_some() {
            match file.apply().await {
                Ok(report) => {
                    tracing::info!(file = %file.path.display(), %report, "resources file applied")
                }
                Err(error) => {
                    tracing::error!(%error, "resources file not applied; the previous configuration stays")
                }
            }
        }
    })
}
