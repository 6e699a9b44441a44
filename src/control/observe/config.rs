//! Configuration objects created, changed or deleted between two reloads.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use super::Observer;
use crate::control::sources::SourceEntry;
use crate::events::{
    ConfigChangeKind, ConfigEvent, ConfigKind, ConfigObject, EventBody, ServiceView, SourceView,
};
use crate::model::{Certificate, DiscoverySource, Id, RoutingConfig, Service};
use crate::snapshot::Snapshot;

impl Observer {
    /// Reports configuration changes and takes the new picture; returns the sources as they
    /// were (to name a deleted source's targets).
    pub(super) fn report_config(
        &mut self,
        config: &RoutingConfig,
        snapshot: &Snapshot,
        entries: &HashMap<Id, SourceEntry>,
    ) -> HashMap<Id, DiscoverySource> {
        let services = by_id(&config.services, |service| service.id);
        let routes = by_id(&config.routes, |route| route.id);
        let stream_routes = by_id(&config.stream_routes, |route| route.id);
        let certificates: HashMap<Id, Certificate> = config
            .certificates
            .iter()
            .map(|entry| (entry.certificate.id, entry.certificate.clone()))
            .collect();
        let sources: HashMap<Id, DiscoverySource> = entries
            .iter()
            .map(|(id, entry)| (*id, entry.source.clone()))
            .collect();
        if self.primed {
            self.report_services(&services, snapshot);
            self.report_sources(&sources, entries);
            self.report_plain(ConfigKind::Route, &self.routes, &routes, |route| {
                (Some(route.service_id), Some(route.name.clone()))
            });
            self.report_plain(
                ConfigKind::StreamRoute,
                &self.stream_routes,
                &stream_routes,
                |route| (Some(route.service_id), Some(route.listen.to_string())),
            );
            self.report_plain(
                ConfigKind::Certificate,
                &self.certificates,
                &certificates,
                |certificate| (None, certificate.snis.first().cloned()),
            );
        }
        self.services = services;
        self.routes = routes;
        self.stream_routes = stream_routes;
        self.certificates = certificates;
        std::mem::replace(&mut self.sources, sources)
    }

    fn report_services(&self, current: &HashMap<Id, Service>, snapshot: &Snapshot) {
        for (id, change) in changes(&self.services, current) {
            let (service, object) = match current.get(&id) {
                Some(service) => {
                    let panic_picks = snapshot
                        .service(id)
                        .map(|runtime| runtime.counters.panic_picks.load(Ordering::Relaxed))
                        .unwrap_or(0);
                    let view = ServiceView {
                        service: service.clone(),
                        panic_picks,
                    };
                    (service, Some(ConfigObject::Service(view)))
                }
                None => (&self.services[&id], None),
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
        current: &HashMap<Id, DiscoverySource>,
        entries: &HashMap<Id, SourceEntry>,
    ) {
        for (id, change) in changes(&self.sources, current) {
            let (source, object) = match (current.get(&id), entries.get(&id)) {
                (Some(source), Some(entry)) => {
                    let status = self.status_of(entry, &entry.progress);
                    (
                        source,
                        Some(ConfigObject::Source(SourceView::new(source, Some(status)))),
                    )
                }
                _ => (&self.sources[&id], None),
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

fn by_id<T: Clone>(items: &[T], id: impl Fn(&T) -> Id) -> HashMap<Id, T> {
    items.iter().map(|item| (id(item), item.clone())).collect()
}
