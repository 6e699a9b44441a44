//! PLACEHOLDER until the real balancer lands (being written in parallel).
use crate::model::LbPolicy;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
#[derive(Debug, Default)]
pub struct TargetLoad {
    in_flight: AtomicU32,
}
impl TargetLoad {
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }
    pub fn start_request(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }
    pub fn finish_request(&self) {
        let _ = self
            .in_flight
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1));
    }
}
pub struct Member {
    pub weight: u32,
    pub priority: i32,
    pub load: Arc<TargetLoad>,
}
pub struct Balancer {
    policy: LbPolicy,
    members: Vec<Member>,
    cursor: AtomicUsize,
}
impl Balancer {
    pub fn new(policy: LbPolicy, members: Vec<Member>) -> Balancer {
        Balancer {
            policy,
            members,
            cursor: AtomicUsize::new(0),
        }
    }
    pub fn pick(&self, skip: impl Fn(usize) -> bool) -> Option<usize> {
        let mut prios: Vec<i32> = self
            .members
            .iter()
            .filter(|m| m.weight > 0)
            .map(|m| m.priority)
            .collect();
        prios.sort();
        prios.dedup();
        for p in prios {
            let idx: Vec<usize> = (0..self.members.len())
                .filter(|&i| {
                    self.members[i].priority == p && self.members[i].weight > 0 && !skip(i)
                })
                .collect();
            if !idx.is_empty() {
                return Some(idx[self.cursor.fetch_add(1, Ordering::Relaxed) % idx.len()]);
            }
        }
        None
    }
    pub fn policy(&self) -> LbPolicy {
        self.policy
    }
    pub fn len(&self) -> usize {
        self.members.len()
    }
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }
}
