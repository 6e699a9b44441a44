//! `/readyz`: the health indicator of DESIGN §7. 200 only while `ready`; 503 while `starting`
//! (a discovery source is still on its first refresh) or `draining`
//! (the shutdown sequence began), so a Kubernetes readiness probe or a load balancer's health
//! check takes the instance out exactly then. The body says why, and whether the instance is
//! `degraded` (serving, but something needs an operator's look).
//!
//! [`follow`] feeds the same verdict to the Consul registrar, which keeps its check critical
//! until the gateway is first ready (DESIGN §10).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use chrono::{DateTime, Utc};
use serde::Serialize;

use super::AdminState;
use crate::clock::unix_ms;
use crate::control::{ControlError, ControlHandle};
use crate::model::{DiscoverySource, SourceProgress, SourceState};
use crate::registration::{GatewayReadiness, RegistrationState, RegistrationStatus};
use crate::store::{Store, StoreError};

/// How often the registrar's readiness is computed while the gateway starts.
const FOLLOW_EVERY: Duration = Duration::from_millis(100);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReadyState {
    Ready,
    Starting,
    Draining,
}

#[derive(Debug, Serialize)]
pub struct Readiness {
    pub status: ReadyState,
    /// Why the instance is not ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Every enabled discovery source has succeeded at least once.
    pub ever_resolved: bool,
    /// Serving, but a source is failing or stale, targets are ejected, or the registration is
    /// not kept alive; `degraded_because` says which.
    pub degraded: bool,
    pub degraded_because: Vec<String>,
    /// Discovery sources by lifecycle state (every state listed).
    pub sources: BTreeMap<&'static str, u64>,
    pub ejected_targets: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub registration: Option<RegistrationStatus>,
}

pub async fn readyz(State(state): State<AdminState>) -> (StatusCode, Json<Readiness>) {
    let registration = state
        .registration
        .as_ref()
        .map(|status| status.borrow().clone());
    let ejected_targets = ejected_targets(&state);
    let readiness = assess_stored(
        state.store.all_sources().await,
        state.started_at,
        ejected_targets,
        registration,
        state.draining.load(Ordering::SeqCst),
    );
    let code = match readiness.status {
        ReadyState::Ready => StatusCode::OK,
        ReadyState::Starting | ReadyState::Draining => StatusCode::SERVICE_UNAVAILABLE,
    };
    (code, Json(readiness))
}

/// [`assess`] of the sources as read from the store, or of the store's failure.
fn assess_stored(
    sources: Result<Vec<(DiscoverySource, SourceProgress)>, StoreError>,
    started_at: DateTime<Utc>,
    ejected_targets: u64,
    registration: Option<RegistrationStatus>,
    draining: bool,
) -> Readiness {
    match sources {
        Ok(sources) => assess(
            &sources,
            crate::clock::now(),
            started_at,
            ejected_targets,
            registration,
            draining,
        ),
        // The data path serves from its last snapshot without the store, so a shared database
        // going down must not take every instance out of rotation at once: ready, degraded.
        Err(error) => Readiness {
            status: if draining {
                ReadyState::Draining
            } else {
                ReadyState::Ready
            },
            reason: None,
            ever_resolved: false,
            degraded: true,
            degraded_because: vec![format!("the store is unreachable: {error}")],
            sources: BTreeMap::new(),
            ejected_targets,
            registration,
        },
    }
}

/// The registrar's readiness: `/readyz`'s status (same store read, same rules), computed at
/// once, then every 100 ms while it says `starting`. The registrar waits only for the first
/// readiness, so the feed ends once the status is anything else: `ready` is sent, while
/// `draining` is left to the drain sequence, which withdraws the registration itself.
///
/// The store says a source is healthy before this gateway routes to its targets (the control
/// task stores them first and publishes the snapshot after; on a shared database another
/// gateway may have refreshed it), so `ready` is sent only once `control` has published a
/// snapshot built after the store said so.
pub async fn follow(
    store: Store,
    control: ControlHandle,
    started_at: DateTime<Utc>,
    draining: Arc<AtomicBool>,
) -> tokio::sync::watch::Receiver<GatewayReadiness> {
    let mut feed = Follower {
        store,
        control,
        draining,
        judge: FollowJudge::new(started_at),
    };
    let first = feed.status().await;
    let readiness = match first {
        ReadyState::Ready => GatewayReadiness::Ready,
        ReadyState::Starting | ReadyState::Draining => GatewayReadiness::Starting,
    };
    let (sender, receiver) = tokio::sync::watch::channel(readiness);
    if first == ReadyState::Starting {
        tokio::spawn(async move {
            let mut now = first;
            while now == ReadyState::Starting {
                tokio::time::sleep(FOLLOW_EVERY).await;
                now = feed.status().await;
            }
            if now == ReadyState::Ready {
                let _ = sender.send(GatewayReadiness::Ready);
            }
        });
    }
    receiver
}

/// What [`follow`] reads from.
struct Follower {
    store: Store,
    control: ControlHandle,
    draining: Arc<AtomicBool>,
    judge: FollowJudge,
}

impl Follower {
    async fn status(&mut self) -> ReadyState {
        let read = self.store.all_sources().await;
        let draining = self.draining.load(Ordering::SeqCst);
        match self.judge.judge(read, crate::clock::now(), draining) {
            ReadyState::Ready => routed(&self.control).await,
            other => other,
        }
    }
}

/// `Ready` once the live routing holds what the store holds now; `Starting` (asked again at the
/// next tick) when the control task could not read the store; `Draining` (the feed ends) when
/// the control task is gone.
async fn routed(control: &ControlHandle) -> ReadyState {
    match control.apply().await {
        Ok(_) => ReadyState::Ready,
        Err(error) if matches!(*error, ControlError::Stopped) => ReadyState::Draining,
        Err(error) => {
            tracing::debug!(%error, "not ready for the registrar yet: the routing is not reloaded");
            ReadyState::Starting
        }
    }
}

/// The registrar's verdict from successive store reads. Unlike `/readyz`, which answers each
/// probe on its own, the feed's `ready` is final, so a failed read tells it nothing new: the
/// last sources read are judged again at the current time (each pending one is still waited
/// for at most its `timeout_ms`), and before any read succeeded the gateway is still starting.
struct FollowJudge {
    started_at: DateTime<Utc>,
    last_read: Option<Vec<(DiscoverySource, SourceProgress)>>,
}

impl FollowJudge {
    fn new(started_at: DateTime<Utc>) -> FollowJudge {
        FollowJudge {
            started_at,
            last_read: None,
        }
    }

    fn judge(
        &mut self,
        read: Result<Vec<(DiscoverySource, SourceProgress)>, StoreError>,
        now: DateTime<Utc>,
        draining: bool,
    ) -> ReadyState {
        match read {
            Ok(sources) => self.last_read = Some(sources),
            Err(error) => {
                tracing::debug!(%error, "readiness for the registrar: the store read failed; judging the last sources read")
            }
        }
        match &self.last_read {
            Some(sources) => assess(sources, now, self.started_at, 0, None, draining).status,
            None if draining => ReadyState::Draining,
            None => ReadyState::Starting,
        }
    }
}

fn ejected_targets(state: &AdminState) -> u64 {
    let now = unix_ms();
    let snapshot = state.control.snapshot();
    snapshot
        .services()
        .flat_map(|service| service.targets.iter())
        .filter(|target| target.health.ejected_until(now).is_some())
        .count() as u64
}

/// The indicator from what the store and the runtime say. A source still pending is waited for
/// at most one attempt's time (its `timeout_ms`) after it was created, changed or this process
/// started, so a registry down at start does not keep the instance out of rotation forever.
pub fn assess(
    sources: &[(DiscoverySource, SourceProgress)],
    now: DateTime<Utc>,
    started_at: DateTime<Utc>,
    ejected_targets: u64,
    registration: Option<RegistrationStatus>,
    draining: bool,
) -> Readiness {
    let mut by_state: BTreeMap<&'static str, u64> = [
        SourceState::Pending,
        SourceState::Healthy,
        SourceState::Failing,
        SourceState::Stale,
        SourceState::Disabled,
    ]
    .into_iter()
    .map(|state| (state.as_str(), 0))
    .collect();
    let mut waiting = Vec::new();
    let mut degraded_because = Vec::new();
    let mut ever_resolved = true;
    for (source, progress) in sources {
        *by_state.entry(progress.state.as_str()).or_default() += 1;
        if !source.enabled {
            continue;
        }
        ever_resolved &= progress.last_success_at.is_some();
        match progress.state {
            SourceState::Pending if still_first_attempt(source, now, started_at) => {
                waiting.push(source.name.clone());
            }
            SourceState::Failing | SourceState::Stale => degraded_because.push(format!(
                "discovery source {} is {}",
                source.name,
                progress.state.as_str()
            )),
            _ => {}
        }
        if let Some(hold) = &progress.guard {
            degraded_because.push(format!(
                "the removal guard of discovery source {} holds {} targets",
                source.name, hold.holding
            ));
        }
    }
    if ejected_targets > 0 {
        degraded_because.push(format!("{ejected_targets} targets ejected"));
    }
    if let Some(registration) = &registration {
        if matches!(
            registration.state,
            RegistrationState::Unreachable | RegistrationState::Refused
        ) {
            degraded_because.push("the consul registration is not kept alive".to_owned());
        }
    }
    let (status, reason) = if draining {
        (
            ReadyState::Draining,
            Some(
                "shutting down: still serving while clients stop choosing this instance".to_owned(),
            ),
        )
    } else if !waiting.is_empty() {
        (
            ReadyState::Starting,
            Some(format!(
                "discovery sources still on their first refresh: {}",
                waiting.join(", ")
            )),
        )
    } else {
        (ReadyState::Ready, None)
    };
    Readiness {
        status,
        reason,
        ever_resolved,
        degraded: !degraded_because.is_empty(),
        degraded_because,
        sources: by_state,
        ejected_targets,
        registration,
    }
}

fn still_first_attempt(
    source: &DiscoverySource,
    now: DateTime<Utc>,
    started_at: DateTime<Utc>,
) -> bool {
    let timeout_ms = source
        .config
        .get("timeout_ms")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(crate::discovery::config::DEFAULT_TIMEOUT_MS);
    let first_attempt = chrono::Duration::milliseconds(timeout_ms as i64);
    now - source.updated_at.max(started_at) < first_attempt
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ProviderKind;

    fn at(ms: i64) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(1_700_000_000_000 + ms).unwrap()
    }

    fn source(
        name: &str,
        state: SourceState,
        succeeded: bool,
    ) -> (DiscoverySource, SourceProgress) {
        let source = DiscoverySource {
            id: 1,
            service_id: 1,
            name: name.to_owned(),
            provider: ProviderKind::Http,
            config: serde_json::json!({"timeout_ms": 1000}),
            enabled: state != SourceState::Disabled,
            stale_after_ms: 300_000,
            removal_grace_ms: 60_000,
            removal_guard: None,
            managed_by: None,
            created_at: at(0),
            updated_at: at(0),
        };
        let progress = SourceProgress {
            state,
            last_success_at: succeeded.then(|| at(0)),
            ..SourceProgress::default()
        };
        (source, progress)
    }

    fn registration(state: RegistrationState) -> RegistrationStatus {
        RegistrationStatus {
            registry: "consul",
            service_id: "gw-1".to_owned(),
            service_name: "raahi".to_owned(),
            address: "10.0.0.7:8080".to_owned(),
            state,
            since: at(0),
            last_heartbeat_at: None,
            last_error: None,
            failures: 0,
        }
    }

    #[test]
    fn ready_without_sources_and_not_degraded() {
        let readiness = assess(&[], at(10), at(0), 0, None, false);
        assert_eq!(readiness.status, ReadyState::Ready);
        assert!(readiness.ever_resolved && !readiness.degraded);
        assert_eq!(readiness.sources["healthy"], 0);
        let json = serde_json::to_value(&readiness).unwrap();
        assert!(json.get("registration").is_none() && json.get("reason").is_none());
    }

    #[test]
    fn a_source_on_its_first_refresh_holds_readiness_for_one_attempt() {
        let sources = [source("registry", SourceState::Pending, false)];
        let starting = assess(&sources, at(500), at(0), 0, None, false);
        assert_eq!(starting.status, ReadyState::Starting);
        assert!(starting.reason.unwrap().contains("registry"));
        assert!(!starting.ever_resolved);
        let later = assess(&sources, at(1_500), at(0), 0, None, false);
        assert_eq!(later.status, ReadyState::Ready, "no longer waited for");
        assert!(!later.ever_resolved, "but it never resolved");
    }

    #[test]
    fn failing_sources_ejections_and_a_lost_registration_degrade() {
        let sources = [
            source("a", SourceState::Healthy, true),
            source("b", SourceState::Failing, true),
            source("c", SourceState::Stale, true),
            source("d", SourceState::Disabled, false),
        ];
        let readiness = assess(
            &sources,
            at(10_000),
            at(0),
            2,
            Some(registration(RegistrationState::Unreachable)),
            false,
        );
        assert_eq!(readiness.status, ReadyState::Ready);
        assert!(readiness.ever_resolved, "a disabled source is not counted");
        assert!(readiness.degraded);
        assert_eq!(
            readiness.degraded_because,
            [
                "discovery source b is failing",
                "discovery source c is stale",
                "2 targets ejected",
                "the consul registration is not kept alive"
            ]
        );
        assert_eq!(
            (readiness.sources["failing"], readiness.sources["disabled"]),
            (1, 1)
        );
    }

    fn unreachable() -> Result<Vec<(DiscoverySource, SourceProgress)>, StoreError> {
        Err(StoreError::Database(sqlx::Error::PoolTimedOut))
    }

    #[test]
    fn a_failed_read_tells_the_registrar_feed_nothing_new() {
        let mut judge = FollowJudge::new(at(0));
        assert_eq!(
            judge.judge(unreachable(), at(100), false),
            ReadyState::Starting,
            "nothing read yet: still starting, not ready"
        );
        let pending = vec![source("registry", SourceState::Pending, false)];
        assert_eq!(
            judge.judge(Ok(pending), at(200), false),
            ReadyState::Starting
        );
        assert_eq!(
            judge.judge(unreachable(), at(500), false),
            ReadyState::Starting,
            "the last sources read, still on their first refresh"
        );
        assert_eq!(
            judge.judge(unreachable(), at(1_500), false),
            ReadyState::Ready,
            "the last sources read, waited for at most their timeout_ms"
        );
        assert_eq!(
            judge.judge(unreachable(), at(1_600), true),
            ReadyState::Draining
        );
    }

    #[test]
    fn the_registrar_feed_follows_what_it_reads() {
        let mut judge = FollowJudge::new(at(0));
        let pending = vec![source("registry", SourceState::Pending, false)];
        assert_eq!(
            judge.judge(Ok(pending), at(100), false),
            ReadyState::Starting
        );
        let healthy = vec![source("registry", SourceState::Healthy, true)];
        assert_eq!(judge.judge(Ok(healthy), at(200), false), ReadyState::Ready);
        assert_eq!(
            FollowJudge::new(at(0)).judge(unreachable(), at(1), true),
            ReadyState::Draining
        );
    }

    #[test]
    fn draining_wins_over_everything() {
        let readiness = assess(
            &[source("a", SourceState::Pending, false)],
            at(1),
            at(0),
            0,
            Some(registration(RegistrationState::Withdrawn)),
            true,
        );
        assert_eq!(readiness.status, ReadyState::Draining);
        assert!(
            !readiness.degraded,
            "a withdrawn registration is the plan, not a fault"
        );
    }
}
