//! Several gateway instances on one PostgreSQL store: change notifications and source leases.
//!
//! - Notifications: triggers in the database log every change that affects routing in the change
//!   log and raise `NOTIFY raahi_config` naming it (the writer's instance id, the scope and the
//!   service). A listener task here turns another instance's notification into a reload of what
//!   changed since this instance last read the log; after a lost connection it reconnects with
//!   backoff and asks for a full resync, since notifications sent meanwhile are gone and the
//!   database may not be the one it read before (a failover, a restore). A periodic read of the
//!   change log backs notifications up (`ControlTask::periodic_resync`).
//! - Leases: see `sources.rs` (`lease_round`): only the instance holding a source's lease runs
//!   its refresh loop and timers and writes its results.
//!
//! On SQLite there is one instance: no listener and no periodic resync; leases still apply (the
//! one instance always wins), so status names the refreshing instance there too.

use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::model::Id;

/// The channel the triggers of `migrations/postgres/0008_change_log.sql` notify.
pub const CONFIG_CHANNEL: &str = "raahi_config";
/// Asks the holder of a source's lease to refresh it now (payload: the source id).
pub const REFRESH_CHANNEL: &str = "raahi_refresh";
/// Payload: a source id whose held removals an admin accepted through another instance.
pub const ACCEPT_CHANNEL: &str = "raahi_accept_removals";

const RECONNECT_BACKOFF_START: Duration = Duration::from_millis(100);
const RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Settings for sharing a store with other instances.
#[derive(Debug, Clone)]
pub struct ClusterSettings {
    /// How long a source lease lasts without renewal; renewed every third of it.
    pub lease: Duration,
    /// Period of the change-log read that backs up notifications (shared stores only).
    pub resync: Duration,
    /// Period of the demand exchange of cluster-scope rate limits.
    pub rate_sync: Duration,
    /// This gateway's zone (`cluster.zone`), for services with `locality`.
    pub zone: Option<std::sync::Arc<str>>,
}

impl Default for ClusterSettings {
    fn default() -> Self {
        ClusterSettings {
            lease: Duration::from_secs(15),
            resync: Duration::from_secs(15),
            rate_sync: Duration::from_millis(250),
            zone: None,
        }
    }
}

/// What the listener tells the control task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ClusterEvent {
    /// Another instance changed the configuration, or the listener connected for the first
    /// time (what changed since the start's read is in the change log).
    Changed,
    /// The listener reconnected: notifications were missed, maybe on another database.
    Resync,
    /// Someone asked (through another instance) for this source to be refreshed now.
    RefreshRequested(Id),
    /// An admin accepted (through another instance) the removals this source's guard holds.
    AcceptRequested(Id),
}

/// Aborts the task when dropped, so the listener ends with the control task.
pub(super) struct ListenerTask(JoinHandle<()>);

impl Drop for ListenerTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Listens for other instances' changes until dropped.
pub(super) fn spawn_listener(
    pool: PgPool,
    instance_id: String,
    events: mpsc::Sender<ClusterEvent>,
) -> ListenerTask {
    ListenerTask(tokio::spawn(listen(pool, instance_id, events)))
}

async fn listen(pool: PgPool, instance_id: String, events: mpsc::Sender<ClusterEvent>) {
    let mut backoff = RECONNECT_BACKOFF_START;
    let mut was_lost = false;
    let mut listened = false;
    loop {
        let mut listener = match connect(&pool).await {
            Ok(listener) => listener,
            Err(error) => {
                if !was_lost {
                    tracing::warn!(%error, "cannot listen for configuration changes; retrying");
                }
                was_lost = true;
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(RECONNECT_BACKOFF_MAX);
                continue;
            }
        };
        if was_lost {
            tracing::info!("listening for configuration changes again; resyncing");
        }
        backoff = RECONNECT_BACKOFF_START;
        // Whatever changed while nobody listened is read now: at a first listen that came at
        // once, from the change log since the start's read of the same database; after a lost
        // connection or first attempts that failed (the database may have been replaced
        // meanwhile, as in a failover), everything.
        let catch_up = if listened || was_lost {
            ClusterEvent::Resync
        } else {
            ClusterEvent::Changed
        };
        listened = true;
        if events.send(catch_up).await.is_err() {
            return;
        }
        loop {
            let event = match listener.try_recv().await {
                Ok(Some(notification)) => match notification.channel() {
                    CONFIG_CHANNEL => config_change(notification.payload(), &instance_id),
                    REFRESH_CHANNEL => notification
                        .payload()
                        .parse::<Id>()
                        .ok()
                        .map(ClusterEvent::RefreshRequested),
                    ACCEPT_CHANNEL => notification
                        .payload()
                        .parse::<Id>()
                        .ok()
                        .map(ClusterEvent::AcceptRequested),
                    _ => None,
                },
                Ok(None) => {
                    tracing::warn!("lost the connection that listens for configuration changes");
                    was_lost = true;
                    break;
                }
                Err(error) => {
                    tracing::warn!(%error, "listening for configuration changes failed");
                    was_lost = true;
                    break;
                }
            };
            if let Some(event) = event {
                // A full queue already holds a reload; the control task coalesces them.
                if let Err(mpsc::error::TrySendError::Closed(_)) = events.try_send(event) {
                    return;
                }
            }
        }
    }
}

/// What a `raahi_config` notification names (see `migrations/postgres/0008_change_log.sql`).
#[derive(Debug, serde::Deserialize)]
struct ConfigNotification {
    instance: String,
    scope: String,
    service_id: Option<Id>,
}

/// Another instance's change is news; this instance's own is already applied. The control task
/// reads what changed from the change log, which also covers notifications that were lost.
fn config_change(payload: &str, own_instance: &str) -> Option<ClusterEvent> {
    match serde_json::from_str::<ConfigNotification>(payload) {
        Ok(change) if change.instance == own_instance => None,
        Ok(change) => {
            tracing::trace!(
                from = %change.instance,
                scope = %change.scope,
                service_id = ?change.service_id,
                "configuration changed on another instance"
            );
            Some(ClusterEvent::Changed)
        }
        // Not this version's payload: whatever it says, something changed.
        Err(_) => (payload != own_instance).then_some(ClusterEvent::Changed),
    }
}

async fn connect(pool: &PgPool) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener
        .listen_all([CONFIG_CHANNEL, REFRESH_CHANNEL, ACCEPT_CHANNEL])
        .await?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_instances_change_is_news_and_its_own_is_not() {
        let theirs = r#"{"instance":"b","scope":"service","service_id":7}"#;
        assert_eq!(config_change(theirs, "a"), Some(ClusterEvent::Changed));
        assert_eq!(config_change(theirs, "b"), None);
        let routes = r#"{"instance":"b","scope":"routes","service_id":null}"#;
        assert_eq!(config_change(routes, "a"), Some(ClusterEvent::Changed));
    }

    #[test]
    fn a_payload_of_another_version_still_means_a_change() {
        assert_eq!(config_change("b", "a"), Some(ClusterEvent::Changed));
        assert_eq!(config_change("a", "a"), None);
    }
}
