//! The routing configuration as last read from the store, kept by service so that a change
//! reloads, rebuilds and reports only the part it touched (the change log, `store/changes.rs`).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::model::{
    CertificateWithKey, Id, Route, RoutingConfig, Service, SourceStanding, StreamRoute, Target,
};
use crate::store::{ChangeSet, ConfigDelta};

#[derive(Default)]
pub(super) struct Desired {
    /// In id order, so a full build and its events come in a repeatable order; shared with the
    /// observer's picture, as routes and targets are.
    pub(super) services: BTreeMap<Id, Arc<Service>>,
    /// By service id, each list in id order; shared with the observer's picture.
    pub(super) targets: HashMap<Id, Vec<Arc<Target>>>,
    /// By service id.
    pub(super) sources: HashMap<Id, Vec<SourceStanding>>,
    pub(super) routes: Vec<Arc<Route>>,
    pub(super) stream_routes: Vec<StreamRoute>,
    pub(super) certificates: Vec<CertificateWithKey>,
}

/// Targets or routes as kept: `Arc`s in a vector of their own size. Collecting the `Arc`s
/// straight from the vector read would reuse its buffer in place (a `Target` is 30 times the
/// size of an `Arc`, a `Route` 144 times), and keep room for hundreds of them; the store's
/// vector itself may have grown by doubling.
fn shared<T>(items: Vec<T>) -> Vec<Arc<T>> {
    let mut shared = Vec::with_capacity(items.len());
    shared.extend(items.into_iter().map(Arc::new));
    shared
}

impl Desired {
    pub(super) fn from_config(config: RoutingConfig) -> Desired {
        let mut desired = Desired {
            services: config
                .services
                .into_iter()
                .map(|service| (service.id, Arc::new(service)))
                .collect(),
            routes: shared(config.routes),
            stream_routes: config.stream_routes,
            certificates: config.certificates,
            ..Desired::default()
        };
        for target in config.targets {
            desired
                .targets
                .entry(target.service_id)
                .or_default()
                .push(Arc::new(target));
        }
        // Pushed one at a time: without this, doubling leaves up to half of each list unused.
        for targets in desired.targets.values_mut() {
            targets.shrink_to_fit();
        }
        for source in config.sources {
            desired
                .sources
                .entry(source.service_id)
                .or_default()
                .push(source);
        }
        desired
    }

    /// Takes in what changed; returns what to rebuild.
    pub(super) fn apply(&mut self, delta: ConfigDelta) -> ChangeSet {
        for parts in delta.services {
            match parts.service {
                Some(service) => {
                    self.services.insert(parts.id, Arc::new(service));
                    self.targets.insert(parts.id, shared(parts.targets));
                    self.sources.insert(parts.id, parts.sources);
                }
                None => {
                    self.services.remove(&parts.id);
                    self.targets.remove(&parts.id);
                    self.sources.remove(&parts.id);
                }
            }
        }
        if let Some(routes) = delta.routes {
            self.routes = shared(routes);
        }
        if let Some(stream_routes) = delta.stream_routes {
            self.stream_routes = stream_routes;
        }
        if let Some(certificates) = delta.certificates {
            self.certificates = certificates;
        }
        delta.changes
    }

    pub(super) fn targets_of(&self, service_id: Id) -> &[Arc<Target>] {
        self.targets.get(&service_id).map_or(&[], Vec::as_slice)
    }

    pub(super) fn sources_of(&self, service_id: Id) -> &[SourceStanding] {
        self.sources.get(&service_id).map_or(&[], Vec::as_slice)
    }

    pub(super) fn all_targets(&self) -> impl Iterator<Item = &Target> {
        self.services
            .keys()
            .flat_map(|service_id| self.targets_of(*service_id))
            .map(|target| &**target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_kept_in_a_vector_of_their_own_size() {
        let targets: Vec<Target> = (1..=20)
            .map(|id| Target {
                id,
                ..Target::default()
            })
            .collect();
        let kept = shared(targets);
        assert_eq!(kept.len(), 20);
        assert_eq!(
            kept.capacity(),
            20,
            "not the buffer of the Vec<Target> read"
        );
    }
}
