//! Zone-aware routing (TRAFFIC.md §4), compiled per snapshot.
//!
//! For a service with `locality` on a gateway with `cluster.zone`, the control task builds the
//! zone's targets into balancers of their own, one per priority tier (as a subset has its own
//! balancer), and decides which of them is *in force* — one atomic word per service. A pick
//! loads that word: in force, it picks among the zone's targets of that tier; otherwise, or when
//! none of them is available right now, it picks as if the service had no locality. The request
//! path never counts targets.
//!
//! The decision is the control task's ([`ZoneSplit::refresh`]): at every build, every 250 ms and
//! after each health verdict, because availability moves at runtime (health checks, passive
//! ejection, an ejection running out) and an ejection's end is a time, not a write anyone makes.
//! Between two looks a zone that lost targets keeps its traffic for at most that long; a zone
//! with no available target at all spills over at once, since its pick finds nothing.
//!
//! Priority tiers come first (as Envoy orders priority before locality): the zone's targets are
//! counted in the tier the service picks from now (the lowest priority value with an available
//! target in any zone), so a zone never keeps traffic on its backup tier while another zone's
//! primary tier can take it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde_json::Value;

use super::backends::has_label;
use super::TargetRuntime;
use crate::balance::{Balancer, Member};
use crate::model::{LbPolicy, Locality, ZONE_HINTS_KEY};

/// Largest count a decision word holds (24 bits); a zone's target count is capped to it.
const COUNT_MAX: u64 = (1 << 24) - 1;

/// How the zone's targets were chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZoneBasis {
    /// Every target in rotation carries Kubernetes EndpointSlice `hints.forZones`
    /// (`metadata.zone_hints`): the zone's targets are those whose hints name it, as kube-proxy
    /// chooses them.
    Hints,
    /// The targets whose `zone` label (metadata `zone`, `meta.zone` or `labels.zone`) is the
    /// gateway's zone.
    Labels,
}

impl ZoneBasis {
    pub fn as_str(self) -> &'static str {
        match self {
            ZoneBasis::Hints => "hints",
            ZoneBasis::Labels => "labels",
        }
    }
}

/// The zone's targets of one priority tier, with their balancer.
struct ZoneTier {
    priority: i32,
    balancer: Balancer,
    /// Balancer member index → index into the service's targets, ascending.
    members: Box<[u32]>,
}

/// One service's zone split: the zone's targets by tier and the decision in force.
pub struct ZoneSplit {
    zone: Arc<str>,
    min_available_percent: u32,
    basis: ZoneBasis,
    /// Ascending priority value (most preferred first).
    tiers: Box<[ZoneTier]>,
    /// The last decision, packed (see [`ZoneDecision::pack`]): written by the control task, loaded
    /// once by each pick.
    decision: AtomicU64,
}

/// What the control task decided at its last look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZoneDecision {
    /// The zone's tier requests go to (its priority value); None: every zone.
    pub in_force: Option<i32>,
    /// The zone's targets counted (those of the tier the service picks from), and how many of
    /// them were available.
    pub available: u32,
    pub total: u32,
    /// Position of the tier in force in the split's tiers (meaningful only while in force).
    slot: u16,
}

impl ZoneDecision {
    /// 16 bits: 0 for every zone, else the tier's position + 1; 24 bits each: available, total.
    fn pack(self) -> u64 {
        let slot = if self.in_force.is_some() {
            u64::from(self.slot) + 1
        } else {
            0
        };
        (slot << 48)
            | (u64::from(self.available).min(COUNT_MAX) << 24)
            | u64::from(self.total).min(COUNT_MAX)
    }
}

impl ZoneSplit {
    /// The split of a service whose targets in rotation are `targets`, decided once from their
    /// health now (`now_ms`).
    pub fn build(
        zone: Arc<str>,
        locality: Locality,
        policy: LbPolicy,
        targets: &[TargetRuntime],
        now_ms: u64,
    ) -> ZoneSplit {
        let basis = if hints_decide(targets, &zone) {
            ZoneBasis::Hints
        } else {
            ZoneBasis::Labels
        };
        let mut by_priority: std::collections::BTreeMap<i32, (Vec<Member>, Vec<u32>)> =
            Default::default();
        for (index, target) in targets.iter().enumerate() {
            if target.spec.weight == 0 || !in_zone(&target.spec.metadata, &zone, basis) {
                continue;
            }
            let (members, indices) = by_priority.entry(target.spec.priority).or_default();
            members.push(Member {
                weight: target.spec.weight,
                priority: target.spec.priority,
                load: target.load.clone(),
                identity: target.identity,
            });
            indices.push(u32::try_from(index).expect("fewer than 2^32 targets"));
        }
        let tiers = by_priority
            .into_iter()
            .map(|(priority, (members, indices))| ZoneTier {
                priority,
                balancer: Balancer::new(policy, members),
                members: indices.into(),
            })
            .collect();
        let split = ZoneSplit {
            zone,
            min_available_percent: locality.min_available_percent,
            basis,
            tiers,
            decision: AtomicU64::new(0),
        };
        split.refresh(targets, now_ms);
        split
    }

    pub fn zone(&self) -> &str {
        &self.zone
    }

    pub fn basis(&self) -> ZoneBasis {
        self.basis
    }

    pub fn min_available_percent(&self) -> u32 {
        self.min_available_percent
    }

    /// The zone's targets of every tier (weight > 0).
    pub fn zone_targets(&self) -> usize {
        self.tiers.iter().map(|tier| tier.members.len()).sum()
    }

    /// Whether the service's target at `index` is one of the zone's.
    pub fn contains(&self, index: usize) -> bool {
        let index = index as u32;
        self.tiers
            .iter()
            .any(|tier| tier.members.binary_search(&index).is_ok())
    }

    /// Decides again from the targets' health at `now_ms` (the control task, never a request);
    /// returns the decision now in force. `targets` must be the ones the split was built from.
    pub fn refresh(&self, targets: &[TargetRuntime], now_ms: u64) -> ZoneDecision {
        let decision = self.decide(targets, now_ms);
        self.decision.store(decision.pack(), Ordering::Relaxed);
        decision
    }

    fn decide(&self, targets: &[TargetRuntime], now_ms: u64) -> ZoneDecision {
        let counts = |target: &TargetRuntime| {
            target.spec.weight > 0
                && target.health.health() != crate::model::Health::Unhealthy
                && target.health.ejected_until(now_ms).is_none()
        };
        // The tier the service picks from now, whatever the zone.
        let active = targets
            .iter()
            .filter(|target| counts(target))
            .map(|target| target.spec.priority)
            .min();
        let tier = active
            .and_then(|priority| self.tiers.iter().position(|tier| tier.priority == priority));
        let Some(slot) = tier else {
            // No tier available anywhere (then every zone panics alike), or the zone has no
            // target in the tier the service picks from.
            let total = if active.is_none() {
                self.zone_targets()
            } else {
                0
            };
            return ZoneDecision {
                in_force: None,
                available: 0,
                total: total as u32,
                slot: 0,
            };
        };
        let members = &self.tiers[slot].members;
        let available = members
            .iter()
            .filter(|&&index| counts(&targets[index as usize]))
            .count() as u64;
        let total = members.len() as u64;
        let enough =
            available > 0 && available * 100 >= u64::from(self.min_available_percent) * total;
        ZoneDecision {
            in_force: enough.then_some(self.tiers[slot].priority),
            available: available.min(COUNT_MAX) as u32,
            total: total.min(COUNT_MAX) as u32,
            slot: slot as u16,
        }
    }

    /// The decision in force, as the last look left it.
    pub fn decision(&self) -> ZoneDecision {
        let word = self.decision.load(Ordering::Relaxed);
        let slot = (word >> 48) as u16;
        ZoneDecision {
            in_force: slot
                .checked_sub(1)
                .and_then(|slot| self.tiers.get(usize::from(slot)))
                .map(|tier| tier.priority),
            available: ((word >> 24) & COUNT_MAX) as u32,
            total: (word & COUNT_MAX) as u32,
            slot: slot.saturating_sub(1),
        }
    }

    /// The zone's tier to pick from now, as its balancer and members; None: every zone. One
    /// atomic load.
    pub(super) fn in_force(&self) -> Option<(&Balancer, &[u32])> {
        let slot = (self.decision.load(Ordering::Relaxed) >> 48) as usize;
        let tier = self.tiers.get(slot.checked_sub(1)?)?;
        Some((&tier.balancer, &tier.members))
    }

    /// Why the decision is what it is, in a sentence.
    pub fn reason(&self, decision: ZoneDecision) -> String {
        let zone = &self.zone;
        let threshold = self.min_available_percent;
        let percent =
            |available: u32, total: u32| u64::from(available) * 100 / u64::from(total.max(1));
        let ZoneDecision {
            available, total, ..
        } = decision;
        match decision.in_force {
            Some(priority) => format!(
                "{available} of {total} targets in zone {zone} available ({} % ≥ {threshold} %){}",
                percent(available, total),
                tier_note(&self.tiers, priority)
            ),
            None if self.zone_targets() == 0 => match self.basis {
                ZoneBasis::Hints => format!("EndpointSlice hints name no target for zone {zone}"),
                ZoneBasis::Labels => format!("no target is labelled with zone {zone}"),
            },
            None if total == 0 => {
                format!("zone {zone} has no target in the priority tier the service picks from")
            }
            None if available == 0 => {
                format!("none of the {total} targets in zone {zone} is available")
            }
            None => format!(
                "{available} of {total} targets in zone {zone} available ({} % < {threshold} %)",
                percent(available, total)
            ),
        }
    }
}

/// ", priority tier P" when the zone's targets span several tiers.
fn tier_note(tiers: &[ZoneTier], priority: i32) -> String {
    if tiers.len() > 1 {
        format!(", priority tier {priority}")
    } else {
        String::new()
    }
}

/// kube-proxy's rule: hints decide when every ready endpoint (target in rotation, not a
/// serving-terminating fallback) has zone hints and some of them name the zone; otherwise it
/// uses every endpoint. Here "otherwise" means the labels decide, which for a Kubernetes source
/// is the endpoint's own `zone`.
fn hints_decide(targets: &[TargetRuntime], zone: &str) -> bool {
    let mut names_zone = false;
    for target in targets {
        let metadata = &target.spec.metadata;
        if metadata.get("terminating").and_then(Value::as_bool) == Some(true) {
            continue;
        }
        let Some(hints) = zone_hints(metadata) else {
            return false;
        };
        if hints.is_empty() {
            return false;
        }
        names_zone |= hints.iter().any(|hint| hint.as_str() == Some(zone));
    }
    names_zone
}

fn zone_hints(metadata: &Value) -> Option<&Vec<Value>> {
    metadata.get(ZONE_HINTS_KEY).and_then(Value::as_array)
}

fn in_zone(metadata: &Value, zone: &str, basis: ZoneBasis) -> bool {
    match basis {
        ZoneBasis::Hints => {
            metadata.get("terminating").and_then(Value::as_bool) != Some(true)
                && zone_hints(metadata)
                    .is_some_and(|hints| hints.iter().any(|hint| hint.as_str() == Some(zone)))
        }
        ZoneBasis::Labels => has_label(metadata, "zone", zone),
    }
}

#[cfg(test)]
mod tests;
