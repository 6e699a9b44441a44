//! A route's weighted backends (TRAFFIC.md §3): one schedule of smooth weighted round robin
//! compiled per snapshot, walked by one atomic cursor that outlives snapshots, so the shares
//! are exact over any window on one gateway; subsets of a service's targets chosen by labels,
//! each with a balancer of its own.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde_json::Value;

use super::ServiceRuntime;
use crate::balance::{Balancer, Member};
use crate::model::Backend;

/// Longest schedule kept: weights whose reduced sum is larger are scaled down to it, so the
/// shares are then exact to 1/4096.
const MAX_SCHEDULE: u64 = 4096;

/// One backend of a route, resolved.
pub struct BackendRuntime {
    pub service: Arc<ServiceRuntime>,
    /// None: every target of the service.
    pub subset: Option<Subset>,
    pub weight: u32,
    /// `service` or `service{label=value,...}`: the `backend` label of the metrics and the log.
    pub label: Arc<str>,
    /// Requests this backend was chosen for, carried across snapshots by route and label.
    pub requests: Arc<AtomicU64>,
}

/// The targets of a service whose labels hold a subset's pairs, with their own balancer.
pub struct Subset {
    pub(super) balancer: Balancer,
    /// Balancer member index → index into the service's targets, ascending.
    pub(super) members: Box<[u32]>,
    /// The label pairs every member holds.
    labels: BTreeMap<String, String>,
}

impl BackendRuntime {
    pub fn new(
        service: Arc<ServiceRuntime>,
        backend: &Backend,
        requests_of: impl FnOnce(&str) -> Arc<AtomicU64>,
    ) -> BackendRuntime {
        let label = backend_label(&service.service.name, &backend.subset);
        let subset = (!backend.subset.is_empty()).then(|| Subset::of(&service, &backend.subset));
        BackendRuntime {
            requests: requests_of(&label),
            label: label.into(),
            subset,
            weight: backend.weight,
            service,
        }
    }

    /// Whether a pick would find a target that is available (not unhealthy, not ejected).
    /// Does not move any round-robin cursor.
    pub fn has_available_target(&self) -> bool {
        self.service.has_available(self.subset.as_ref())
    }
}

fn backend_label(service: &str, subset: &BTreeMap<String, String>) -> String {
    if subset.is_empty() {
        return service.to_owned();
    }
    let pairs: Vec<String> = subset.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{service}{{{}}}", pairs.join(","))
}

impl Subset {
    fn of(service: &ServiceRuntime, subset: &BTreeMap<String, String>) -> Subset {
        let mut members = Vec::new();
        let mut balancer_members = Vec::new();
        for (index, target) in service.targets.iter().enumerate() {
            let holds = subset
                .iter()
                .all(|(label, value)| has_label(&target.spec.metadata, label, value));
            debug_assert!(members.last().is_none_or(|&last| (last as usize) < index));
            if holds {
                members.push(u32::try_from(index).expect("fewer than 2^32 targets"));
                balancer_members.push(Member {
                    weight: target.spec.weight,
                    priority: target.spec.priority,
                    load: target.load.clone(),
                    identity: target.identity,
                });
            }
        }
        Subset {
            balancer: Balancer::new(service.service.lb_policy, balancer_members),
            members: members.into(),
            labels: subset.clone(),
        }
    }

    /// Whether the service's target at `index` is a member.
    pub(super) fn contains(&self, index: usize) -> bool {
        self.members.binary_search(&(index as u32)).is_ok()
    }

    /// Whether a target with this metadata holds the subset's labels.
    pub(super) fn selects(&self, metadata: &Value) -> bool {
        self.labels
            .iter()
            .all(|(label, value)| has_label(metadata, label, value))
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }
}

/// A target's labels come from its metadata: every top-level string, number or boolean, every
/// entry of `meta` (Consul's `Service.Meta`) and of `labels`; the label `tag` matches any of
/// `tags`.
pub fn has_label(metadata: &Value, label: &str, value: &str) -> bool {
    let scalar_is = |found: Option<&Value>| match found {
        Some(Value::String(text)) => text == value,
        Some(Value::Number(number)) => number.to_string() == value,
        Some(Value::Bool(flag)) => value == if *flag { "true" } else { "false" },
        _ => false,
    };
    if label == "tag" {
        let tagged = metadata
            .get("tags")
            .and_then(Value::as_array)
            .is_some_and(|tags| tags.iter().any(|tag| tag.as_str() == Some(value)));
        if tagged {
            return true;
        }
    }
    scalar_is(metadata.get(label))
        || scalar_is(metadata.get("meta").and_then(|meta| meta.get(label)))
        || scalar_is(metadata.get("labels").and_then(|labels| labels.get(label)))
}

/// A route's backends with their schedule.
pub struct Backends {
    list: Box<[BackendRuntime]>,
    /// One period of smooth weighted round robin: positions in `list`.
    schedule: Box<[u8]>,
    /// Where the schedule is, carried across snapshots with the route's statistics.
    cursor: Arc<AtomicU64>,
}

impl Backends {
    pub fn new(list: Vec<BackendRuntime>, cursor: Arc<AtomicU64>) -> Backends {
        let weights: Vec<u64> = list
            .iter()
            .map(|backend| u64::from(backend.weight))
            .collect();
        Backends {
            schedule: smooth_schedule(&weights).into(),
            list: list.into(),
            cursor,
        }
    }

    pub fn list(&self) -> &[BackendRuntime] {
        &self.list
    }

    pub fn first(&self) -> Option<&BackendRuntime> {
        self.list.first()
    }

    /// The backend for the next request: the schedule's, unless it has no available target
    /// and another does; then one of those by weight. When none has one, the schedule's, whose
    /// service decides (panic mode, or `no_available_target`). None only for a route without
    /// backends (a redirect).
    pub fn choose(&self) -> Option<&BackendRuntime> {
        if self.list.len() <= 1 {
            return self.list.first();
        }
        let turn = self.cursor.fetch_add(1, Ordering::Relaxed);
        let scheduled =
            &self.list[usize::from(self.schedule[(turn % self.schedule.len() as u64) as usize])];
        if scheduled.has_available_target() {
            return Some(scheduled);
        }
        let others: Vec<&BackendRuntime> = self
            .list
            .iter()
            .filter(|backend| {
                backend.weight > 0
                    && !std::ptr::eq(*backend, scheduled)
                    && backend.has_available_target()
            })
            .collect();
        let total: u64 = others.iter().map(|backend| u64::from(backend.weight)).sum();
        if total == 0 {
            return Some(scheduled);
        }
        let mut point = turn % total;
        others
            .into_iter()
            .find(|backend| {
                let weight = u64::from(backend.weight);
                if point < weight {
                    return true;
                }
                point -= weight;
                false
            })
            .or(Some(scheduled))
    }
}

/// One period of smooth weighted round robin (as NGINX's): each turn every weight is added to
/// its backend's credit, the backend with the most credit (the first on a tie) is chosen and
/// pays the total. Over the period each backend is chosen exactly its weight's times, spread
/// evenly. Weights are reduced by their common divisor, and scaled to `MAX_SCHEDULE` beyond it.
pub fn smooth_schedule(weights: &[u64]) -> Vec<u8> {
    let divisor = weights
        .iter()
        .copied()
        .filter(|&weight| weight > 0)
        .fold(0, gcd)
        .max(1);
    let mut reduced: Vec<u64> = weights.iter().map(|weight| weight / divisor).collect();
    let total: u64 = reduced.iter().sum();
    if total > MAX_SCHEDULE {
        reduced = weights
            .iter()
            .map(|&weight| {
                let scaled = weight * MAX_SCHEDULE / (total * divisor);
                if weight > 0 {
                    scaled.max(1)
                } else {
                    0
                }
            })
            .collect();
    }
    let total: u64 = reduced.iter().sum();
    if total == 0 {
        return vec![0];
    }
    let mut credit = vec![0i64; reduced.len()];
    (0..total)
        .map(|_| {
            for (credit, &weight) in credit.iter_mut().zip(&reduced) {
                *credit += weight as i64;
            }
            let (chosen, _) = credit
                .iter()
                .enumerate()
                .rev()
                .max_by_key(|&(_, credit)| *credit)
                .expect("at least one backend");
            credit[chosen] -= total as i64;
            u8::try_from(chosen).expect("fewer than 256 backends")
        })
        .collect()
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn counts(schedule: &[u8], backends: usize) -> Vec<usize> {
        (0..backends)
            .map(|backend| {
                schedule
                    .iter()
                    .filter(|&&b| usize::from(b) == backend)
                    .count()
            })
            .collect()
    }

    #[test]
    fn a_period_gives_each_backend_its_weight_spread_out() {
        assert_eq!(smooth_schedule(&[90, 10]).len(), 10);
        assert_eq!(counts(&smooth_schedule(&[90, 10]), 2), vec![9, 1]);
        assert_eq!(smooth_schedule(&[5, 1, 1]), vec![0, 0, 1, 0, 2, 0, 0]);
        assert_eq!(counts(&smooth_schedule(&[3, 0, 2]), 3), vec![3, 0, 2]);
        // Never twice in a row for equal weights.
        assert_eq!(smooth_schedule(&[1, 1]), vec![0, 1]);
    }

    #[test]
    fn large_weights_are_scaled_to_a_bounded_period_keeping_every_backend() {
        let schedule = smooth_schedule(&[999_999, 1]);
        assert!(schedule.len() as u64 <= MAX_SCHEDULE + 1);
        assert_eq!(counts(&schedule, 2)[1], 1);
        let schedule = smooth_schedule(&[333_333, 666_667]);
        let shares = counts(&schedule, 2);
        let share = shares[0] as f64 / schedule.len() as f64;
        assert!((share - 1.0 / 3.0).abs() < 0.001, "{share}");
    }

    #[test]
    fn labels_come_from_metadata_meta_labels_and_tags() {
        let metadata = json!({
            "zone": "a", "port_name": 8080, "canary": true,
            "meta": {"version": "v2"}, "labels": {"app": "web"}, "tags": ["blue", "primary"],
        });
        assert!(has_label(&metadata, "zone", "a"));
        assert!(has_label(&metadata, "port_name", "8080"));
        assert!(has_label(&metadata, "canary", "true"));
        assert!(has_label(&metadata, "version", "v2"));
        assert!(has_label(&metadata, "app", "web"));
        assert!(has_label(&metadata, "tag", "blue"));
        assert!(!has_label(&metadata, "tag", "green"));
        assert!(!has_label(&metadata, "version", "v1"));
        assert!(!has_label(&json!({}), "zone", "a"));
    }
}
