//! The removal guard (DESIGN §4): a registry that suddenly answers with far fewer endpoints is
//! more often broken than right (a zone pushed half-empty, `[]` after a bad deploy, NXDOMAIN
//! during a transfer), so such removals are held until the smaller set is confirmed.
//!
//! Pure: the caller passes the source's targets, the refresh's result, the hold so far, which
//! targets health checks or ejection took out, and the time. The guard answers with the set for
//! reconcile (the registry's endpoints plus the held targets, unchanged) and the hold to keep.
//!
//! - Only unexplained removals count: keys of `active` targets that the answer neither lists nor
//!   names as departing. Explicit departures (Consul: failing checks; Kubernetes: terminating or
//!   not ready) are never held.
//! - The guard holds when those removals are more than `max_percent` of the active targets and
//!   more than `min_endpoints`: all of them, except targets health checks or ejection took out
//!   (those are down anyway and drain).
//! - While a hold lasts, the share is measured against the active targets it started with, so
//!   endpoints the suspicious answer itself adds cannot dilute it.
//! - The hold ends when the answer no longer removes that much (the registry recovered, or the
//!   set shrank one endpoint at a time), or when the same removals (no key missing anew; weight
//!   or metadata changes do not count) have been answered for `confirm_ms` across at least
//!   [`CONFIRMATIONS`] refreshes, or when the guard is turned off, or when an admin accepts the
//!   removals (the held keys drain).

use std::collections::HashSet;

use chrono::{DateTime, Utc};

use super::Discovered;
use crate::model::{Endpoint, GuardHold, RemovalGuard, Target, TargetState};

/// Refreshes that must answer the smaller set (the first included) before it is trusted.
pub const CONFIRMATIONS: u32 = 3;

/// What the guard made of one successful refresh.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// The set to reconcile: the registry's endpoints, then the held targets as they are.
    pub endpoints: Vec<Endpoint>,
    /// The hold after this refresh; None when nothing is held.
    pub hold: Option<GuardHold>,
    /// What changed, for the log.
    pub change: Change,
}

/// How the hold changed with this refresh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Nothing held before or after.
    None,
    /// A hold started, or restarted because another key went missing.
    Started,
    /// The same removals were answered again; still short of confirmation.
    StillHolding,
    /// The smaller set was confirmed: the held removals apply now.
    Confirmed,
    /// The answer no longer removes too much (or the guard is off): the hold ended without
    /// confirmation.
    Ended,
    /// Health checks or ejection took every held target out: nothing left to hold.
    Released,
}

/// Applies the guard to one successful refresh of a source whose targets are `current`.
/// `taken_out` tells whether health checks or ejection took a target out.
pub fn judge(
    settings: Option<&RemovalGuard>,
    current: &[Target],
    discovered: &Discovered,
    hold: Option<&GuardHold>,
    taken_out: impl Fn(&Target) -> bool,
    now: DateTime<Utc>,
) -> Verdict {
    let held_before = hold.is_some();
    let pass = |change| Verdict {
        endpoints: discovered.endpoints.clone(),
        hold: None,
        change,
    };
    let ended = if held_before {
        Change::Ended
    } else {
        Change::None
    };
    let Some(settings) = settings else {
        return pass(ended);
    };
    let missing = unexplained_removals(current, discovered);
    let removed = missing.len();
    let base = hold.map_or_else(
        || current.iter().filter(|target| is_active(target)).count(),
        |hold| hold.base as usize,
    );
    if !too_many(removed, base, settings) {
        return pass(ended);
    }
    // The same removals (or fewer: some came back or were taken out) confirm the hold; a key
    // that goes missing anew has not been confirmed, so the hold starts over.
    let same_removals = hold.is_some_and(|hold| {
        missing.iter().all(|target| {
            target
                .provider_key
                .as_ref()
                .is_some_and(|key| hold.held.contains(key))
        })
    });
    let (since, confirmations) = match hold {
        Some(hold) if same_removals => (hold.since, hold.confirmations.saturating_add(1)),
        _ => (now, 1),
    };
    let confirm_for = chrono::Duration::milliseconds(settings.confirm_ms as i64);
    if confirmations >= CONFIRMATIONS && now - since >= confirm_for {
        return pass(Change::Confirmed);
    }
    let held: Vec<&Target> = missing
        .into_iter()
        .filter(|target| !taken_out(target))
        .collect();
    if held.is_empty() {
        return pass(if held_before {
            Change::Released
        } else {
            Change::None
        });
    }
    let change = if same_removals {
        Change::StillHolding
    } else {
        Change::Started
    };
    let reason = format!(
        "the registry's answer would remove {removed} of {base} active endpoints \
         (more than {}% and more than {}); held until the same removals are seen for {} ms \
         across {CONFIRMATIONS} refreshes or an admin accepts them",
        settings.max_percent, settings.min_endpoints, settings.confirm_ms
    );
    let mut endpoints = discovered.endpoints.clone();
    // As last discovered, so reconcile changes nothing about them.
    endpoints.extend(
        held.iter()
            .filter_map(|target| target.discovered_endpoint()),
    );
    Verdict {
        endpoints,
        hold: Some(GuardHold {
            holding: held.len() as u64,
            held: held.iter().filter_map(|t| t.provider_key.clone()).collect(),
            since,
            confirmations,
            base: base as u64,
            reason,
        }),
        change,
    }
}

/// Whether an admin's acceptance releases `hold`, the hold now: `accepted` is the hold the
/// request covered (the one stored when it was made). Only that same hold is released: it keeps
/// its `since` (and holds no key it did not hold) while the same removals are answered again and
/// across a takeover. A hold that began after the request (or restarted because a key went
/// missing anew) is not, nor anything when the request saw none. `since` is compared for
/// equality only: two holds' times may come from two gateways' clocks, so their order means
/// nothing.
pub fn acceptance_releases(accepted: Option<&GuardHold>, hold: Option<&GuardHold>) -> bool {
    match (accepted, hold) {
        (Some(accepted), Some(hold)) => {
            hold.since == accepted.since && hold.held.iter().all(|key| accepted.held.contains(key))
        }
        _ => false,
    }
}

/// More than `max_percent` of `active` and more than `min_endpoints`.
fn too_many(removed: usize, active: usize, settings: &RemovalGuard) -> bool {
    removed > settings.min_endpoints as usize
        && (removed as u128) * 100 > u128::from(settings.max_percent) * active as u128
}

/// Active targets whose key the answer neither lists nor names as departing.
fn unexplained_removals<'a>(current: &'a [Target], discovered: &Discovered) -> Vec<&'a Target> {
    let explained: HashSet<&str> = discovered
        .endpoints
        .iter()
        .map(|endpoint| endpoint.key.as_str())
        .chain(discovered.departures.iter().map(String::as_str))
        .collect();
    current
        .iter()
        .filter(|target| is_active(target))
        .filter(|target| {
            target
                .provider_key
                .as_deref()
                .is_some_and(|key| !explained.contains(key))
        })
        .collect()
}

/// Serving now and owned by discovery: the targets a wrong answer would take away.
fn is_active(target: &Target) -> bool {
    target.state == TargetState::Active && target.provider_key.is_some()
}

#[cfg(test)]
mod tests;
