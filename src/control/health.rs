//! Active health checks: one loop per service that has `health_check` set, run in the control
//! plane with jitter and a bound on concurrent checks, never on the request path. Verdicts go to
//! the per-target atomics the balancer reads, and to the store for target listings.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Request, Uri};
use http_body_util::Empty;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::Semaphore;
use tokio::task::{JoinHandle, JoinSet};

use crate::balance::TargetHealth;
use crate::model::{CheckResult, Health, HealthCheck, HealthCheckKind, Id, Service};
use crate::snapshot::SnapshotHandle;
use crate::store::Store;

/// Checks running at once across all services.
const MAX_CONCURRENT_CHECKS: usize = 64;
const JITTER_FRACTION: f64 = 0.10;

type CheckClient = Client<HttpConnector, Empty<Bytes>>;

/// The running check loops, one per service with checks on.
pub(super) struct HealthCheckers {
    loops: HashMap<Id, RunningLoop>,
    permits: Arc<Semaphore>,
}

struct RunningLoop {
    /// What the loop was started with; a change restarts it.
    settings: (HealthCheck, Option<String>),
    task: JoinHandle<()>,
}

impl Drop for RunningLoop {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Default for HealthCheckers {
    fn default() -> Self {
        HealthCheckers {
            loops: HashMap::new(),
            permits: Arc::new(Semaphore::new(MAX_CONCURRENT_CHECKS)),
        }
    }
}

impl HealthCheckers {
    /// Stops the loops of services whose checks went away or changed. Done before a new
    /// snapshot resets the verdicts of unchecked targets, so no late result undoes the reset.
    pub(super) fn stop_unwanted(&mut self, services: &[Service]) {
        let wanted = wanted(services);
        self.loops
            .retain(|id, running| wanted.get(id) == Some(&running.settings));
    }

    /// Starts a loop for each service with `health_check` that has none (after publishing, so
    /// the first round sees the new targets).
    pub(super) fn start_missing(
        &mut self,
        services: &[Service],
        snapshots: &SnapshotHandle,
        store: &Store,
    ) {
        for (service_id, settings) in wanted(services) {
            if self.loops.contains_key(&service_id) {
                continue;
            }
            let checker = ServiceChecker {
                service_id,
                check: settings.0.clone(),
                upstream_authority: settings.1.clone(),
                snapshots: snapshots.clone(),
                store: store.clone(),
                permits: self.permits.clone(),
                client: Client::builder(TokioExecutor::new())
                    // A fresh connection per check: a pooled one would hide a dead listener.
                    .pool_max_idle_per_host(0)
                    .build(connector(settings.0.timeout_ms)),
            };
            let task = tokio::spawn(checker.run());
            self.loops
                .insert(service_id, RunningLoop { settings, task });
        }
    }
}

fn wanted(services: &[Service]) -> HashMap<Id, (HealthCheck, Option<String>)> {
    services
        .iter()
        .filter_map(|service| {
            let check = service.health_check.clone()?;
            Some((service.id, (check, service.upstream_authority.clone())))
        })
        .collect()
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
    check: HealthCheck,
    upstream_authority: Option<String>,
    snapshots: SnapshotHandle,
    store: Store,
    permits: Arc<Semaphore>,
    client: CheckClient,
}

struct Probe {
    target_id: Id,
    authority: String,
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
                let health = judge(&this.check, streak, &probe.health, result.passed);
                if health != probe.health.health() {
                    tracing::info!(
                        service_id = this.service_id,
                        target_id = probe.target_id,
                        health = health.as_str(),
                        detail = %result.detail,
                        "target health changed"
                    );
                    probe.health.set_health(health);
                }
                seen.insert(probe.target_id);
                records.push((probe.target_id, health, result));
            }
            streaks.retain(|id, _| seen.contains(id));
            if let Err(error) = this.store.record_health_checks(&records).await {
                tracing::warn!(service_id = this.service_id, %error, "health check results not stored");
            }
            let interval = Duration::from_millis(this.check.interval_ms);
            tokio::time::sleep(interval.mul_f64(1.0 - JITTER_FRACTION * fastrand::f64())).await;
        }
    }

    /// The targets currently in rotation for this service.
    fn probes(&self) -> Vec<Probe> {
        let snapshot = self.snapshots.load();
        let Some(service) = snapshot.service(self.service_id) else {
            return Vec::new();
        };
        service
            .targets
            .iter()
            .map(|target| Probe {
                target_id: target.id,
                authority: target.authority.to_string(),
                health: target.health.clone(),
            })
            .collect()
    }

    async fn check_one(&self, authority: &str) -> CheckResult {
        let timeout = Duration::from_millis(self.check.timeout_ms);
        let attempt = async {
            match self.check.kind {
                HealthCheckKind::Tcp => tokio::net::TcpStream::connect(authority)
                    .await
                    .map(|_| (true, "connected".to_owned()))
                    .map_err(|error| format!("connect: {error}")),
                HealthCheckKind::Http => self.http_check(authority).await,
            }
        };
        let (passed, detail) = match tokio::time::timeout(timeout, attempt).await {
            Ok(Ok(verdict)) => verdict,
            Ok(Err(detail)) => (false, detail),
            Err(_) => (
                false,
                format!("timed out after {} ms", self.check.timeout_ms),
            ),
        };
        CheckResult {
            at: chrono::Utc::now(),
            passed,
            detail,
        }
    }

    async fn http_check(&self, authority: &str) -> Result<(bool, String), String> {
        let uri: Uri = format!("http://{authority}{}", self.check.path)
            .parse()
            .map_err(|error| format!("bad check URI: {error}"))?;
        let host = self
            .check
            .host
            .as_deref()
            .or(self.upstream_authority.as_deref())
            .unwrap_or(authority);
        let mut request = Request::new(Empty::new());
        *request.uri_mut() = uri;
        if let Ok(host) = HeaderValue::from_str(host) {
            request.headers_mut().insert(header::HOST, host);
        }
        request.headers_mut().insert(
            header::USER_AGENT,
            HeaderValue::from_static("raahi-health-check"),
        );
        let response = self
            .client
            .request(request)
            .await
            .map_err(|error| error_text(&error))?;
        let status = response.status().as_u16();
        let passed = self.check.expects(status);
        let detail = if passed {
            format!("HTTP {status}")
        } else {
            format!(
                "HTTP {status}, expected {}",
                self.check.expected_statuses.join(", ")
            )
        };
        Ok((passed, detail))
    }
}

fn error_text(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
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
