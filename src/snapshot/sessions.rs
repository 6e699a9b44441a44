//! The targets a session cookie may name (TRAFFIC.md §5, session persistence): every target of
//! the service in rotation and, unlike a new pick, its draining ones, which keep their sessions
//! until they are removed (HAProxy's `drain`).

use std::collections::HashMap;

use super::TargetRuntime;
use crate::model::Id;

/// Built only for services with `session_persistence`.
#[derive(Debug, Default)]
pub struct SessionTargets {
    /// Draining, enabled targets of weight > 0: never picked anew, still reached by a cookie.
    pub draining: Vec<TargetRuntime>,
    /// Target id → where it is.
    by_id: HashMap<Id, Place, foldhash::fast::FixedState>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// Index into the service's `targets`.
    InRotation(u32),
    /// Index into `draining`.
    Draining(u32),
}

impl SessionTargets {
    pub fn new(in_rotation: &[TargetRuntime], draining: Vec<TargetRuntime>) -> SessionTargets {
        let mut by_id = HashMap::with_capacity_and_hasher(
            in_rotation.len() + draining.len(),
            foldhash::fast::FixedState::default(),
        );
        for (index, target) in in_rotation.iter().enumerate() {
            by_id.insert(target.id, Place::InRotation(index as u32));
        }
        for (index, target) in draining.iter().enumerate() {
            by_id.insert(target.id, Place::Draining(index as u32));
        }
        SessionTargets { draining, by_id }
    }

    pub fn place(&self, id: Id) -> Option<Place> {
        self.by_id.get(&id).copied()
    }
}
