//! The registrar: this process's own entry in a registry (DESIGN §10). Once the proxy listens it
//! registers the gateway in Consul with a TTL check. While the gateway is still starting (`/readyz`
//! says `starting`: a discovery source is on its first refresh) the check is registered critical
//! and kept so, with the note `starting`, so no client chooses an instance that has not loaded
//! its targets; as soon as the gateway is ready the check passes, then every third of the TTL. A
//! check the agent no longer knows (404) is registered again; an unreachable agent is retried
//! with a jittered backoff and never stops the proxy. At shutdown the check is failed first
//! (clients stop choosing this instance while it still serves), and the registration is removed
//! once the last request finished.
//!
//! Only the *first* readiness is waited for: once the gateway was ready, the check keeps passing
//! until the drain, even if `/readyz` says `starting` again because a source was added or
//! changed. Such a change reaches every gateway sharing the store at the same moment, and
//! failing all their checks at once would leave the registry's clients with no instance, while
//! each gateway still serves everything it served before.
//!
//! Imports only `model` and `config`; `gateway.rs` drives it and feeds it the readiness, the
//! admin API reads its status.

mod consul;

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::ConsulRegistration;
use consul::{Agent, AgentError};

/// The first retry after a failed call to the agent; it doubles up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);
/// The longest a withdrawal or deregistration at shutdown may hold the shutdown up.
const FAREWELL_TIMEOUT: Duration = Duration::from_secs(2);

/// The note of the check while the gateway starts.
const STARTING_NOTE: &str = "starting: waiting for the gateway's first readiness (/readyz)";

/// Whether the gateway is ready to serve, as `/readyz` says, fed to the registrar by the gateway.
/// Draining is not one of them: the drain sequence withdraws the registration itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatewayReadiness {
    /// A discovery source is still on its first refresh: the check stays critical.
    Starting,
    /// Ready: the check passes.
    Ready,
}

/// Where the registration stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RegistrationState {
    /// Not registered yet (the first attempt is under way).
    Registering,
    /// Registered with its check critical (note `starting`) until the gateway is first ready.
    Starting,
    /// Registered, the check passed within its TTL.
    Registered,
    /// The agent did not answer or failed; retried with backoff. The proxy serves anyway.
    Unreachable,
    /// The agent refused the token (401, 403): retried with backoff until an operator fixes it.
    Refused,
    /// Draining: the check was failed so clients stop choosing this instance.
    Withdrawn,
    /// Removed from the registry at shutdown.
    Deregistered,
}

/// What `/readyz`, `/metrics` and `raahi status` show of the registration.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RegistrationStatus {
    pub registry: &'static str,
    pub service_id: String,
    pub service_name: String,
    /// The advertised `ip:port`.
    pub address: String,
    pub state: RegistrationState,
    /// When `state` last changed.
    pub since: DateTime<Utc>,
    pub last_heartbeat_at: Option<DateTime<Utc>>,
    /// Why the last call to the agent failed; null once one succeeds.
    pub last_error: Option<String>,
    /// Failed calls to the agent since start.
    pub failures: u64,
}

/// A running registrar. Dropping it stops the heartbeats without deregistering (as a crash
/// would: the TTL lapses and the registry reaps the entry).
pub struct Registrar {
    agent: Agent,
    status: watch::Sender<RegistrationStatus>,
    /// Tells the heartbeat loop to stop between two calls.
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl Registrar {
    /// Starts registering `service_id` at `advertised` and keeping the registration alive; the
    /// check passes once `readiness` is first [`GatewayReadiness::Ready`].
    pub fn start(
        config: &ConsulRegistration,
        service_id: String,
        advertised: std::net::SocketAddr,
        readiness: watch::Receiver<GatewayReadiness>,
    ) -> Result<Registrar, RegistrationError> {
        let agent = Agent::new(config, service_id.clone(), advertised)?;
        let (status, _) = watch::channel(RegistrationStatus {
            registry: "consul",
            service_id,
            service_name: config.service_name.clone(),
            address: advertised.to_string(),
            state: RegistrationState::Registering,
            since: crate::clock::now(),
            last_heartbeat_at: None,
            last_error: None,
            failures: 0,
        });
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(keep_registered(
            agent.clone(),
            status.clone(),
            stopped,
            readiness,
        ));
        Ok(Registrar {
            agent,
            status,
            stop,
            task: Some(task),
        })
    }

    /// The registration as it stands, updated as it changes.
    pub fn status(&self) -> watch::Receiver<RegistrationStatus> {
        self.status.subscribe()
    }

    /// Draining: stop passing the check and fail it, so the registry's clients stop choosing this
    /// instance while it still serves. Bounded; a failure is logged (the TTL lapses anyway).
    pub async fn withdraw(&mut self) {
        self.stop_heartbeats().await;
        match tokio::time::timeout(FAREWELL_TIMEOUT, self.agent.fail_check("draining")).await {
            Ok(Ok(())) => {
                tracing::info!(service_id = %self.agent.service_id(), "registration withdrawn: check failed while draining");
                set_state(&self.status, RegistrationState::Withdrawn);
            }
            // Nothing left to withdraw: the agent lost the registration.
            Ok(Err(AgentError::UnknownCheck { .. })) => {
                set_state(&self.status, RegistrationState::Withdrawn)
            }
            Ok(Err(error)) => {
                note_failure(&self.status, "cannot withdraw the registration", &error)
            }
            Err(_) => note_failure(
                &self.status,
                "cannot withdraw the registration",
                &AgentError::Timeout {
                    call: "check fail",
                    after: FAREWELL_TIMEOUT,
                },
            ),
        }
    }

    /// After the last request: remove the registration. Bounded; a failure is logged (the
    /// registry reaps the entry after `deregister_critical_after_ms`).
    pub async fn deregister(mut self) {
        self.stop_heartbeats().await;
        match tokio::time::timeout(FAREWELL_TIMEOUT, self.agent.deregister()).await {
            Ok(Ok(())) => {
                tracing::info!(service_id = %self.agent.service_id(), "deregistered");
                set_state(&self.status, RegistrationState::Deregistered);
            }
            Ok(Err(error)) => note_failure(&self.status, "cannot deregister", &error),
            Err(_) => note_failure(
                &self.status,
                "cannot deregister",
                &AgentError::Timeout {
                    call: "deregister",
                    after: FAREWELL_TIMEOUT,
                },
            ),
        }
    }
}

impl Registrar {
    /// Stops the heartbeat loop between two calls and waits for it, so a pass it had under way
    /// has been answered before the withdrawal is sent and cannot make the check passing again.
    /// A call the agent does not answer is cut off after its own timeout.
    async fn stop_heartbeats(&mut self) {
        let _ = self.stop.send(true);
        if let Some(mut task) = self.task.take() {
            if tokio::time::timeout(FAREWELL_TIMEOUT, &mut task)
                .await
                .is_err()
            {
                task.abort();
            }
        }
    }
}

impl Drop for Registrar {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Why the registrar cannot start (a config that passed validation, so only a broken TLS setup).
#[derive(Debug, thiserror::Error)]
#[error("registration.consul: {0}")]
pub struct RegistrationError(String);

/// Registers, then updates the check at once and every third of the TTL: failed with the note `starting`
/// until the gateway is first ready, passed from then on (at once when readiness arrives, not at
/// the next beat). Registers again when the agent lost the check or could not be reached (an
/// agent restarted without its data may have lost it).
async fn keep_registered(
    agent: Agent,
    status: watch::Sender<RegistrationStatus>,
    mut stop: watch::Receiver<bool>,
    mut readiness: watch::Receiver<GatewayReadiness>,
) {
    let heartbeat = agent.ttl() / 3;
    let mut failures: u32 = 0;
    let mut registered = false;
    let mut ready = *readiness.borrow_and_update() == GatewayReadiness::Ready;
    // The gateway stopped feeding readiness without ever being ready (it drains): nothing left
    // to wait for.
    let mut unfed = false;
    while !*stop.borrow() {
        let call = match (registered, ready) {
            (false, _) => agent.register(ready).await,
            (true, true) => agent.pass_check().await,
            (true, false) => agent.fail_check(STARTING_NOTE).await,
        };
        let wait = match call {
            Ok(()) => {
                failures = 0;
                let first = !registered;
                if first {
                    tracing::info!(service_id = %agent.service_id(), ready, "registered in consul");
                }
                registered = true;
                status.send_modify(|status| {
                    status.last_heartbeat_at = Some(crate::clock::now());
                    status.last_error = None;
                });
                set_state(
                    &status,
                    if ready {
                        RegistrationState::Registered
                    } else {
                        RegistrationState::Starting
                    },
                );
                // Right after (re-)registering, the update: a check of the same id keeps its
                // status through a registration (a restart within its TTL: passing while
                // starting, or critical once ready), so only the update sets it.
                if first {
                    Duration::ZERO
                } else {
                    heartbeat
                }
            }
            Err(AgentError::UnknownCheck { .. }) if registered => {
                tracing::warn!(service_id = %agent.service_id(), "the agent lost the registration; registering again");
                registered = false;
                Duration::ZERO
            }
            Err(error) => {
                failures = failures.saturating_add(1);
                registered = false;
                note_failure(&status, "consul agent call failed", &error);
                set_state(&status, state_after(&error));
                retry_delay(failures, fastrand::f64())
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.wait_for(|stop| *stop) => {}
            fed = readiness.wait_for(|now| *now == GatewayReadiness::Ready), if !ready && !unfed => {
                match fed {
                    Ok(_) => {
                        tracing::info!(service_id = %agent.service_id(), "the gateway is ready: passing the check");
                        ready = true;
                    }
                    Err(_) => unfed = true,
                }
            }
        }
    }
}

/// A refusal (a bad or missing ACL token: 401, 403) is a configuration problem an operator must
/// fix; anything else is the agent being away.
fn state_after(error: &AgentError) -> RegistrationState {
    match error {
        AgentError::Refused {
            status: 401 | 403, ..
        } => RegistrationState::Refused,
        _ => RegistrationState::Unreachable,
    }
}

/// 1 s doubling to 30 s, plus up to 20 % jitter so a fleet restarted with its agent does not
/// call it in step.
fn retry_delay(failures: u32, jitter: f64) -> Duration {
    let base = RETRY_FIRST
        .saturating_mul(1u32 << failures.saturating_sub(1).min(16))
        .min(RETRY_MAX);
    base.mul_f64(1.0 + 0.2 * jitter.clamp(0.0, 1.0))
}

fn set_state(status: &watch::Sender<RegistrationStatus>, state: RegistrationState) {
    status.send_if_modified(|status| {
        let changed = status.state != state;
        if changed {
            status.state = state;
            status.since = crate::clock::now();
        }
        changed
    });
}

fn note_failure(status: &watch::Sender<RegistrationStatus>, what: &str, error: &AgentError) {
    // Once per change of error, not on every retry of the same failure.
    let text = error.to_string();
    let repeated = status.borrow().last_error.as_deref() == Some(text.as_str());
    if repeated {
        tracing::debug!(%error, "{what}");
    } else {
        tracing::warn!(%error, "{what}");
    }
    status.send_modify(|status| {
        status.failures += 1;
        status.last_error = Some(text);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_double_from_a_second_to_half_a_minute() {
        let secs = |failures| retry_delay(failures, 0.0).as_secs();
        assert_eq!([1, 2, 3, 4, 5, 6, 7].map(secs), [1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(retry_delay(1, 0.5), Duration::from_millis(1_100));
        assert_eq!(retry_delay(u32::MAX, 0.99).as_secs(), 35);
    }
}
