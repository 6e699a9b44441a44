//! Configuration objects created, changed or deleted between two reloads.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Observer, SeenSource};
use crate::control::desired::Desired;
use crate::control::sources::SourceEntry;
use crate::events::{
    CanaryEvent, ConfigChangeKind, ConfigEvent, ConfigKind, ConfigObject, EventBody, ServiceView,
    SourceView,
};
use crate::model::{Certificate, Id, Route, Service};
use crate::snapshot::Snapshot;
use crate::store::ChangeSet;

impl Observer {
    /// Reports configuration changes among what `changes` names and takes the new picture of
    /// it; returns those sources as they were (to name a deleted source's targets).
    pub(super) fn report_config(
        &mut self,
        desired: &Desired,
        changes: &ChangeSet,
        snapshot: &Snapshot,
        entries: &HashMap<Id, SourceEntry>,
    ) -> HashMap<Id, SeenSource> {
        let in_scope = |service_id: Id| changes.touches_service(service_id);
        let services: HashMap<Id, Arc<Service>> = if changes.everything {
            by_id(desired.services.values(), |service| service.id)
        } else {
            changes
                .services
                .iter()
                .filter_map(|id| desired.services.get(id))
                .map(|service| (service.id, service.clone()))
                .collect()
        };
        let previous_services: HashMap<Id, Arc<Service>> = if changes.everything {
            std::mem::take(&mut self.services)
        } else {
            changes
                .services
                .iter()
                .filter_map(|id| self.services.remove(id).map(|service| (*id, service)))
                .collect()
        };
        let sources: HashMap<Id, SeenSource> = entries
            .iter()
            .filter(|(_, entry)| in_scope(entry.source.service_id))
            .map(|(id, entry)| (*id, SeenSource::of(&entry.source)))
            .collect();
        let previous_sources: HashMap<Id, SeenSource> = if changes.everything {
            std::mem::take(&mut self.sources)
        } else {
            let ids: Vec<Id> = self
                .sources
                .iter()
                .filter(|(_, source)| in_scope(source.service_id))
                .map(|(id, _)| *id)
                .collect();
            ids.into_iter()
                .filter_map(|id| self.sources.remove(&id).map(|source| (id, source)))
                .collect()
        };
        let routes = (changes.everything || changes.routes)
            .then(|| by_id(desired.routes.iter(), |route| route.id));
        let stream_routes = (changes.everything || changes.stream_routes)
            .then(|| by_id(desired.stream_routes.iter(), |route| route.id));
        let certificates = (changes.everything || changes.certificates).then(|| {
            desired
                .certificates
                .iter()
                .map(|entry| (entry.certificate.id, entry.certificate.clone()))
                .collect::<HashMap<Id, Certificate>>()
        });
        if self.primed {
            self.report_services(&previous_services, &services, snapshot);
            self.report_sources(&previous_sources, &sources, entries);
            if let Some(routes) = &routes {
                self.report_canaries(&self.routes, routes);
                // A canary's move is a `canary` event, not a change of the route's settings.
                let settings = |routes: &HashMap<Id, Arc<Route>>| -> HashMap<Id, Route> {
                    routes
                        .iter()
                        .map(|(id, route)| {
                            let mut route = Route::clone(route);
                            route.canary_status = None;
                            (*id, route)
                        })
                        .collect()
                };
                self.report_plain(
                    ConfigKind::Route,
                    &settings(&self.routes),
                    &settings(routes),
                    |route| (route.service_id, Some(route.name.clone())),
                );
            }
            if let Some(stream_routes) = &stream_routes {
                self.report_plain(
                    ConfigKind::StreamRoute,
                    &self.stream_routes,
                    stream_routes,
                    |route| (Some(route.service_id), Some(route.listen.to_string())),
                );
            }
            if let Some(certificates) = &certificates {
                self.report_plain(
                    ConfigKind::Certificate,
                    &self.certificates,
                    certificates,
                    |certificate| (None, certificate.snis.first().cloned()),
                );
            }
        }
        self.services.extend(services);
        self.sources.extend(sources);
        if let Some(routes) = routes {
            self.routes = routes;
        }
        if let Some(stream_routes) = stream_routes {
            self.stream_routes = stream_routes;
        }
        if let Some(certificates) = certificates {
            self.certificates = certificates;
        }
        previous_sources
    }

    fn report_services(
        &self,
        previous: &HashMap<Id, Arc<Service>>,
        current: &HashMap<Id, Arc<Service>>,
        snapshot: &Snapshot,
    ) {
        for (id, change) in changes(previous, current) {
            let (service, object) = match current.get(&id) {
                Some(service) => {
                    let panic_picks = snapshot
                        .service(id)
                        .map(|runtime| runtime.counters.panic_picks.load(Ordering::Relaxed))
                        .unwrap_or(0);
                    let view = ServiceView {
                        service: Service::clone(service),
                        panic_picks,
                    };
                    (service, Some(ConfigObject::Service(view)))
                }
                None => (&previous[&id], None),
            };
            self.config_event(
                ConfigKind::Service,
                id,
                Some(id),
                &service.name,
                change,
                object,
            );
        }
    }

    fn report_sources(
        &self,
        previous: &HashMap<Id, SeenSource>,
        current: &HashMap<Id, SeenSource>,
        entries: &HashMap<Id, SourceEntry>,
    ) {
        for (id, change) in changes(previous, current) {
            let (source, object) = match (current.get(&id), entries.get(&id)) {
                (Some(source), Some(entry)) => {
                    let status = self.status_of(entry, &entry.progress);
                    let view = SourceView::new(&entry.source, Some(status));
                    (source, Some(ConfigObject::Source(view)))
                }
                _ => (&previous[&id], None),
            };
            self.config_event(
                ConfigKind::DiscoverySource,
                id,
                Some(source.service_id),
                &source.name,
                change,
                object,
            );
        }
    }

    /// Routes, stream routes and certificates: created, changed or deleted, without the object.
    /// One `canary` event per route whose canary moved (a new round) or started.
    fn report_canaries(
        &self,
        previous: &HashMap<Id, Arc<Route>>,
        current: &HashMap<Id, Arc<Route>>,
    ) {
        for (id, route) in current {
            let Some(status) = &route.canary_status else {
                continue;
            };
            let before = previous
                .get(id)
                .and_then(|route| route.canary_status.as_ref());
            if before.is_some_and(|before| before.round == status.round) {
                continue;
            }
            let service_id = route
                .canary
                .as_ref()
                .and_then(|canary| route.backends.get(canary.backend_index()))
                .map(|backend| backend.service_id);
            self.log.record(
                service_id,
                EventBody::Canary(CanaryEvent {
                    route_id: *id,
                    name: route.name.clone(),
                    state: status.state,
                    step: status.step,
                    weight: status.weight,
                    previous_weight: before.map(|before| before.weight),
                    round: status.round,
                    reason: status.reason.clone(),
                }),
            );
        }
    }

    fn report_plain<T: PartialEq>(
        &self,
        kind: ConfigKind,
        previous: &HashMap<Id, T>,
        current: &HashMap<Id, T>,
        describe: impl Fn(&T) -> (Option<Id>, Option<String>),
    ) {
        for (id, change) in changes(previous, current) {
            let object = current.get(&id).or_else(|| previous.get(&id));
            let Some((service_id, name)) = object.map(&describe) else {
                continue;
            };
            self.log.record(
                service_id,
                EventBody::Config(ConfigEvent {
                    kind,
                    object_id: id,
                    name,
                    change,
                    object: None,
                }),
            );
        }
    }

    fn config_event(
        &self,
        kind: ConfigKind,
        object_id: Id,
        service_id: Option<Id>,
        name: &str,
        change: ConfigChangeKind,
        object: Option<ConfigObject>,
    ) {
        self.log.record(
            service_id,
            EventBody::Config(ConfigEvent {
                kind,
                object_id,
                name: Some(name.to_owned()),
                change,
                object,
            }),
        );
    }
}

/// What changed between two pictures, in id order (so events come in a repeatable order).
fn changes<T: PartialEq>(
    previous: &HashMap<Id, T>,
    current: &HashMap<Id, T>,
) -> Vec<(Id, ConfigChangeKind)> {
    let mut changes: Vec<(Id, ConfigChangeKind)> = current
        .iter()
        .filter_map(|(id, object)| match previous.get(id) {
            None => Some((*id, ConfigChangeKind::Created)),
            Some(before) if before != object => Some((*id, ConfigChangeKind::Changed)),
            Some(_) => None,
        })
        .chain(
            previous
                .keys()
                .filter(|id| !current.contains_key(id))
                .map(|id| (*id, ConfigChangeKind::Deleted)),
        )
        .collect();
    changes.sort_by_key(|(id, _)| *id);
    changes
}

fn by_id<'a, T: Clone + 'a>(
    items: impl Iterator<Item = &'a T>,
    id: impl Fn(&T) -> Id,
) -> HashMap<Id, T> {
    items.map(|item| (id(item), item.clone())).collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::control::build::{build_snapshot, tests::service};
    use crate::control::desired::Desired;
    use crate::control::observe::Observer;
    use crate::events::{EventLog, EventSettings};
    use crate::model::{Backend, Route, RoutingConfig};

    #[test]
    fn the_observer_shares_each_service_and_route_with_the_desired_state() {
        let config = RoutingConfig {
            services: vec![service(1)],
            routes: vec![Route {
                id: 7,
                name: "r7".into(),
                backends: vec![Backend::whole(1)],
                ..Route::default()
            }],
            ..RoutingConfig::default()
        };
        let snapshot = build_snapshot(&config, &mut crate::control::CarriedState::in_zone(None), 1);
        let log = Arc::new(EventLog::new(EventSettings::default()));
        let mut observer = Observer::new(log, "me".into());
        let desired = Desired::from_config(config);
        let everything = crate::store::ChangeSet::everything();
        observer.changes_loaded(&desired, &everything, &snapshot, &Default::default());
        assert!(
            Arc::ptr_eq(&observer.services[&1], &desired.services[&1]),
            "the observer holds the desired state's service, not a copy"
        );
        assert!(
            Arc::ptr_eq(&observer.routes[&7], &desired.routes[0]),
            "the observer holds the desired state's route, not a copy"
        );
    }
}
