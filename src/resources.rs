//! Declarative configuration: a TOML file that declares services (with their operator targets
//! and discovery sources) and routes, applied idempotently at start and on SIGHUP.
//!
//! Objects are matched by name (targets by `host:port` within their service). What the file
//! declares is created or brought in line; what it no longer declares is deleted only if the
//! file created it (`managed_by = "resources-file"`). Objects made through the admin API are
//! left alone.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use crate::control::ControlHandle;
use crate::model::{
    DiscoverySource, DiscoverySourceSpec, Id, Route, RouteSpec, Service, ServiceSpec, Target,
    TargetSpec,
};
use crate::store::{ManagedKind, Store, StoreError};
use crate::validate::{self, ValidationError};

/// The mark on objects this module manages.
pub const MANAGER: &str = "resources-file";

#[derive(Debug, thiserror::Error)]
pub enum ResourcesError {
    #[error("{file}: cannot read: {reason}")]
    Unreadable { file: String, reason: String },
    #[error("{file}: {location}: {reason}")]
    Invalid {
        file: String,
        location: String,
        reason: String,
    },
    #[error("{file}: applying failed: {0}", file = .1)]
    Store(StoreError, String),
    #[error("{file}: applied, but the new routing is not live yet: {reason}")]
    NotLive { file: String, reason: String },
}

/// What one apply did, by object (`service web`, `route api`, `target web/10.0.0.1:80`...).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ApplyReport {
    pub created: Vec<String>,
    pub changed: Vec<String>,
    pub unchanged: Vec<String>,
    pub deleted: Vec<String>,
}

/// Objects named in a report's text per list; the rest are counted ("and 109,950 more"), so a
/// file of 100,000 targets logs a line, not megabytes.
const NAMED_IN_TEXT: usize = 50;

impl ApplyReport {
    pub fn counts(&self) -> ApplyCounts {
        ApplyCounts {
            created: self.created.len(),
            changed: self.changed.len(),
            unchanged: self.unchanged.len(),
            deleted: self.deleted.len(),
        }
    }
}

impl std::fmt::Display for ApplyReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.counts())?;
        for (what, names) in [
            ("created", &self.created),
            ("changed", &self.changed),
            ("deleted", &self.deleted),
        ] {
            if names.is_empty() {
                continue;
            }
            write!(f, "; {what}: ")?;
            for (index, name) in names.iter().take(NAMED_IN_TEXT).enumerate() {
                if index > 0 {
                    f.write_str(", ")?;
                }
                f.write_str(name)?;
            }
            if names.len() > NAMED_IN_TEXT {
                write!(f, " and {} more", names.len() - NAMED_IN_TEXT)?;
            }
        }
        Ok(())
    }
}

/// How many objects one apply created, changed, left alone and deleted: what the gateway keeps
/// of its start's apply (the report's names take megabytes for a large file).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ApplyCounts {
    pub created: usize,
    pub changed: usize,
    pub unchanged: usize,
    pub deleted: usize,
}

impl std::fmt::Display for ApplyCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "created {}, changed {}, unchanged {}, deleted {}",
            self.created, self.changed, self.unchanged, self.deleted
        )
    }
}

struct DeclaredService {
    spec: ServiceSpec,
    targets: Vec<TargetSpec>,
    sources: Vec<DiscoverySourceSpec>,
}

struct DeclaredRoute {
    /// The service of each backend, by name, in order.
    backend_services: Vec<String>,
    mirror_service: Option<String>,
    /// Service ids are filled in once services exist.
    spec: RouteSpec,
}

impl DeclaredRoute {
    fn service_names(&self) -> impl Iterator<Item = &String> {
        self.backend_services.iter().chain(&self.mirror_service)
    }
}

/// Takes the `service` name out of a table that names a service (a backend, a mirror), leaving
/// a placeholder `service_id` for validation.
fn take_service_name(
    file: &str,
    location: &str,
    table: &mut toml::Table,
) -> Result<String, ResourcesError> {
    match table.remove("service") {
        Some(toml::Value::String(name)) => {
            table.insert("service_id".to_owned(), toml::Value::Integer(0));
            Ok(name)
        }
        _ => Err(invalid(
            file,
            format!("{location}service"),
            "the name of a service (a string) is required",
        )),
    }
}

/// A parsed and validated resources file.
pub struct Resources {
    services: Vec<DeclaredService>,
    routes: Vec<DeclaredRoute>,
}

/// Loads and applies resource files for one gateway.
#[derive(Clone)]
pub struct ResourcesFile {
    pub path: PathBuf,
    store: Store,
    control: ControlHandle,
}

impl ResourcesFile {
    pub fn new(path: PathBuf, store: Store, control: ControlHandle) -> ResourcesFile {
        ResourcesFile {
            path,
            store,
            control,
        }
    }

    /// Reads, validates and applies the file, then makes the result live. Nothing is written
    /// when the file is invalid.
    pub async fn apply(&self) -> Result<ApplyReport, ResourcesError> {
        let file = self.path.display().to_string();
        let resources = check_file(&self.path)?;
        let report = apply(&self.store, &resources)
            .await
            .map_err(|error| ResourcesError::Store(error, file.clone()))?;
        self.control
            .apply()
            .await
            .map_err(|error| ResourcesError::NotLive {
                file,
                reason: error.to_string(),
            })?;
        Ok(report)
    }
}

fn invalid(file: &str, location: impl Into<String>, reason: impl Into<String>) -> ResourcesError {
    ResourcesError::Invalid {
        file: file.to_owned(),
        location: location.into(),
        reason: reason.into(),
    }
}

/// Takes a list of tables out of `table` under `key` (absent: empty).
fn take_list(
    file: &str,
    location: &str,
    table: &mut toml::Table,
    key: &str,
) -> Result<Vec<toml::Table>, ResourcesError> {
    match table.remove(key) {
        None => Ok(Vec::new()),
        Some(toml::Value::Array(items)) => items
            .into_iter()
            .enumerate()
            .map(|(index, item)| match item {
                toml::Value::Table(table) => Ok(table),
                _ => Err(invalid(
                    file,
                    format!("{location}{key}[{index}]"),
                    "expected a table",
                )),
            })
            .collect(),
        Some(_) => Err(invalid(
            file,
            format!("{location}{key}"),
            "expected a list of tables",
        )),
    }
}

/// A table read as `T` through JSON, so errors name the key like the admin API's do.
fn read<T: serde::de::DeserializeOwned>(
    file: &str,
    location: &str,
    table: toml::Table,
) -> Result<T, ResourcesError> {
    let json = serde_json::to_value(toml::Value::Table(table))
        .map_err(|error| invalid(file, location, error.to_string()))?;
    validate::from_value(json).map_err(|error| field_invalid(file, location, error))
}

/// Reads, parses and validates the file at `path` without touching the store (what
/// `raahi check-config` and every apply do first).
pub fn check_file(path: &std::path::Path) -> Result<Resources, ResourcesError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|error| ResourcesError::Unreadable {
        file: file.clone(),
        reason: error.to_string(),
    })?;
    parse(&file, &text)
}

/// Parses and validates a resources file without touching the store.
pub fn parse(file: &str, text: &str) -> Result<Resources, ResourcesError> {
    let mut root: toml::Table = text
        .parse()
        .map_err(|error: toml::de::Error| invalid(file, "TOML", error.message().to_owned()))?;
    let service_tables = take_list(file, "", &mut root, "services")?;
    let route_tables = take_list(file, "", &mut root, "routes")?;
    if let Some(key) = root.keys().next() {
        return Err(invalid(
            file,
            key.clone(),
            "unknown key; expected services or routes",
        ));
    }
    let mut services = Vec::new();
    let mut service_names = HashSet::new();
    for (index, mut table) in service_tables.into_iter().enumerate() {
        let location = format!("services[{index}].");
        let target_tables = take_list(file, &location, &mut table, "targets")?;
        let source_tables = take_list(file, &location, &mut table, "discovery_sources")?;
        let spec = validate::service(read(file, &location, table)?)
            .map_err(|error| field_invalid(file, &location, error))?;
        if !service_names.insert(spec.name.clone()) {
            return Err(invalid(
                file,
                format!("{location}name"),
                format!("service {:?} is declared twice", spec.name),
            ));
        }
        let mut targets = Vec::new();
        let mut addresses = HashSet::new();
        for (target_index, table) in target_tables.into_iter().enumerate() {
            let location = format!("{location}targets[{target_index}].");
            let target = validate::target(read(file, &location, table)?)
                .map_err(|error| field_invalid(file, &location, error))?;
            if !addresses.insert((target.host.clone(), target.port)) {
                return Err(invalid(
                    file,
                    location,
                    "this host and port are declared twice",
                ));
            }
            targets.push(target);
        }
        let mut sources = Vec::new();
        let mut source_names = HashSet::new();
        for (source_index, table) in source_tables.into_iter().enumerate() {
            let location = format!("{location}discovery_sources[{source_index}].");
            let source = validate::source(read(file, &location, table)?)
                .map_err(|error| field_invalid(file, &location, error))?;
            if !source_names.insert(source.name.clone()) {
                return Err(invalid(file, format!("{location}name"), "declared twice"));
            }
            sources.push(source);
        }
        services.push(DeclaredService {
            spec,
            targets,
            sources,
        });
    }
    let mut routes = Vec::new();
    let mut route_names = HashSet::new();
    for (index, mut table) in route_tables.into_iter().enumerate() {
        let location = format!("routes[{index}].");
        // A route names its services by name: `service` (one backend), each of `backends`,
        // and its `mirror`; a redirect names none.
        let mut backend_services = Vec::new();
        match table.remove("backends") {
            Some(toml::Value::Array(backends)) => {
                let mut resolved = Vec::with_capacity(backends.len());
                for (position, backend) in backends.into_iter().enumerate() {
                    let at = format!("{location}backends[{position}].");
                    let toml::Value::Table(mut backend) = backend else {
                        return Err(invalid(file, at, "a backend is a table with a service"));
                    };
                    backend_services.push(take_service_name(file, &at, &mut backend)?);
                    resolved.push(toml::Value::Table(backend));
                }
                table.insert("backends".to_owned(), toml::Value::Array(resolved));
            }
            Some(_) => {
                return Err(invalid(
                    file,
                    format!("{location}backends"),
                    "a list of tables, each with a service",
                ))
            }
            None if table.contains_key("redirect") && !table.contains_key("service") => {}
            None => backend_services.push(take_service_name(file, &location, &mut table)?),
        }
        let mirror_service = match table.get_mut("mirror") {
            Some(toml::Value::Table(mirror)) => Some(take_service_name(
                file,
                &format!("{location}mirror."),
                mirror,
            )?),
            _ => None,
        };
        let spec = validate::route(read(file, &location, table)?)
            .map_err(|error| field_invalid(file, &location, error))?;
        if !route_names.insert(spec.name.clone()) {
            return Err(invalid(file, format!("{location}name"), "declared twice"));
        }
        routes.push(DeclaredRoute {
            backend_services,
            mirror_service,
            spec,
        });
    }
    Ok(Resources { services, routes })
}

fn field_invalid(file: &str, location: &str, error: ValidationError) -> ResourcesError {
    invalid(file, format!("{location}{}", error.field), error.message)
}

/// A new object the file declares: mark it and report it.
async fn created(
    store: &Store,
    report: &mut ApplyReport,
    kind: ManagedKind,
    id: Id,
    label: String,
) -> Result<(), StoreError> {
    store.set_managed_by(kind, id, Some(MANAGER)).await?;
    report.created.push(label);
    Ok(())
}

/// An existing object the file declares (already updated when it `differed`): mark it if it
/// was not yet the file's, and report it.
async fn kept(
    store: &Store,
    report: &mut ApplyReport,
    (kind, id, managed_by): (ManagedKind, Id, Option<&str>),
    differed: bool,
    label: String,
) -> Result<(), StoreError> {
    let adopted = managed_by != Some(MANAGER);
    if adopted {
        store.set_managed_by(kind, id, Some(MANAGER)).await?;
    }
    if differed || adopted {
        report.changed.push(label);
    } else {
        report.unchanged.push(label);
    }
    Ok(())
}

/// Brings the store in line with `resources`; see the module documentation.
pub async fn apply(store: &Store, resources: &Resources) -> Result<ApplyReport, StoreError> {
    let mut report = ApplyReport::default();
    let current = store.load_routing_config().await?;
    let sources = store.all_sources().await?;
    let mut service_ids: HashMap<String, Id> = current
        .services
        .iter()
        .map(|service| (service.name.clone(), service.id))
        .collect();
    let declared_names: HashSet<&str> = resources
        .services
        .iter()
        .map(|declared| declared.spec.name.as_str())
        .collect();
    // Every reference must resolve before anything is written.
    for route in &resources.routes {
        for service in route.service_names() {
            if !declared_names.contains(service.as_str()) && !service_ids.contains_key(service) {
                return Err(StoreError::InvalidReference {
                    field: "service".into(),
                    message: format!(
                        "route {:?} names service {:?}, which is neither declared nor stored",
                        route.spec.name, service
                    ),
                });
            }
        }
    }

    let stored_services: HashMap<&str, &Service> = current
        .services
        .iter()
        .map(|service| (service.name.as_str(), service))
        .collect();
    // New services, and below new targets, are written in batches: one statement per row
    // made a file of 100,000 targets take a minute.
    let new_services: Vec<&ServiceSpec> = resources
        .services
        .iter()
        .map(|declared| &declared.spec)
        .filter(|spec| !stored_services.contains_key(spec.name.as_str()))
        .collect();
    service_ids.extend(
        store
            .create_managed_services(&new_services, MANAGER)
            .await?,
    );
    let mut operator_targets: HashMap<Id, Vec<&Target>> = HashMap::new();
    for target in current.targets.iter().filter(|t| t.source_id.is_none()) {
        operator_targets
            .entry(target.service_id)
            .or_default()
            .push(target);
    }
    let mut new_targets: Vec<(Id, &TargetSpec)> = Vec::new();
    let mut undeclared_targets: Vec<Id> = Vec::new();
    let mut sources_by_service: HashMap<Id, Vec<&DiscoverySource>> = HashMap::new();
    for (source, _) in &sources {
        sources_by_service
            .entry(source.service_id)
            .or_default()
            .push(source);
    }

    for declared in &resources.services {
        let name = &declared.spec.name;
        let label = format!("service {name}");
        let service_id = match stored_services.get(name.as_str()) {
            None => {
                report.created.push(label);
                service_ids[name]
            }
            Some(existing) => {
                let differs = existing.spec() != declared.spec;
                if differs {
                    store.update_service(existing.id, &declared.spec).await?;
                }
                let marks = (
                    ManagedKind::Service,
                    existing.id,
                    existing.managed_by.as_deref(),
                );
                kept(store, &mut report, marks, differs, label).await?;
                existing.id
            }
        };

        // Operator targets, by host and port.
        let existing_targets = operator_targets.remove(&service_id).unwrap_or_default();
        let by_address: HashMap<(&str, u16), &Target> = existing_targets
            .iter()
            .map(|target| ((target.host.as_str(), target.port), *target))
            .collect();
        for target in &declared.targets {
            let label = format!("target {name}/{}:{}", target.host, target.port);
            match by_address.get(&(target.host.as_str(), target.port)) {
                None => {
                    new_targets.push((service_id, target));
                    report.created.push(label);
                }
                Some(existing) => {
                    let differs = &existing.spec() != target;
                    if differs {
                        store.update_target(existing.id, target).await?;
                    }
                    let marks = (
                        ManagedKind::Target,
                        existing.id,
                        existing.managed_by.as_deref(),
                    );
                    kept(store, &mut report, marks, differs, label).await?;
                }
            }
        }
        let declared_addresses: HashSet<(&str, u16)> = declared
            .targets
            .iter()
            .map(|target| (target.host.as_str(), target.port))
            .collect();
        for existing in existing_targets {
            let declared_here =
                declared_addresses.contains(&(existing.host.as_str(), existing.port));
            if !declared_here && existing.managed_by.as_deref() == Some(MANAGER) {
                undeclared_targets.push(existing.id);
                report
                    .deleted
                    .push(format!("target {name}/{}:{}", existing.host, existing.port));
            }
        }

        // Discovery sources, by name.
        let existing_sources = sources_by_service.remove(&service_id).unwrap_or_default();
        for source in &declared.sources {
            let label = format!("discovery source {name}/{}", source.name);
            match existing_sources.iter().find(|s| s.name == source.name) {
                None => {
                    let new = store.create_source(service_id, source).await?;
                    created(
                        store,
                        &mut report,
                        ManagedKind::DiscoverySource,
                        new.id,
                        label,
                    )
                    .await?;
                }
                Some(existing) => {
                    let differs = &existing.spec() != source;
                    if differs {
                        store.update_source(existing.id, source).await?;
                    }
                    let marks = (
                        ManagedKind::DiscoverySource,
                        existing.id,
                        existing.managed_by.as_deref(),
                    );
                    kept(store, &mut report, marks, differs, label).await?;
                }
            }
        }
        for existing in existing_sources {
            let declared_here = declared.sources.iter().any(|s| s.name == existing.name);
            if !declared_here && existing.managed_by.as_deref() == Some(MANAGER) {
                store.delete_source(existing.id).await?;
                report
                    .deleted
                    .push(format!("discovery source {name}/{}", existing.name));
            }
        }
    }

    // Replacements exist before what they replace goes: a target whose address changed in the
    // file is never missing from the service meanwhile.
    store.create_managed_targets(&new_targets, MANAGER).await?;
    for id in undeclared_targets {
        store.delete_target(id).await?;
    }

    let stored_routes: HashMap<&str, &Route> = current
        .routes
        .iter()
        .map(|route| (route.name.as_str(), route))
        .collect();
    // New routes, like new targets, are written in one batch after the loop.
    let mut new_routes: Vec<RouteSpec> = Vec::new();
    for declared in &resources.routes {
        let label = format!("route {}", declared.spec.name);
        let id_of = |service: &String| {
            service_ids
                .get(service)
                .copied()
                .ok_or_else(|| StoreError::InvalidReference {
                    field: "service".into(),
                    message: format!(
                        "route {:?} names service {:?}, which is neither declared nor stored",
                        declared.spec.name, service
                    ),
                })
        };
        let mut spec = declared.spec.clone();
        for (backend, service) in spec.backends.iter_mut().zip(&declared.backend_services) {
            backend.service_id = id_of(service)?;
        }
        if let (Some(mirror), Some(service)) = (&mut spec.mirror, &declared.mirror_service) {
            mirror.service_id = id_of(service)?;
        }
        match stored_routes.get(spec.name.as_str()) {
            None => {
                new_routes.push(spec);
                report.created.push(label);
            }
            Some(existing) => {
                let differs = existing.spec() != spec;
                if differs {
                    store.update_route(existing.id, &spec).await?;
                }
                let marks = (
                    ManagedKind::Route,
                    existing.id,
                    existing.managed_by.as_deref(),
                );
                kept(store, &mut report, marks, differs, label).await?;
            }
        }
    }

    let new_routes: Vec<&RouteSpec> = new_routes.iter().collect();
    store.create_managed_routes(&new_routes, MANAGER).await?;

    // What the file created and no longer declares: routes first, then their services.
    let declared_routes: HashSet<&str> = resources
        .routes
        .iter()
        .map(|route| route.spec.name.as_str())
        .collect();
    for route in &current.routes {
        let declared = declared_routes.contains(route.name.as_str());
        if !declared && route.managed_by.as_deref() == Some(MANAGER) {
            store.delete_route(route.id).await?;
            report.deleted.push(format!("route {}", route.name));
        }
    }
    for service in &current.services {
        let declared = declared_names.contains(service.name.as_str());
        if !declared && service.managed_by.as_deref() == Some(MANAGER) {
            store.delete_service(service.id).await?;
            report.deleted.push(format!("service {}", service.name));
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use crate::model::Locality;

    #[test]
    fn a_service_declares_locality_with_the_apis_field_names() {
        let text = "[[services]]\nname = \"web\"\nlocality = { min_available_percent = 80 }\n";
        let resources = super::parse("r.toml", text).unwrap();
        assert_eq!(
            resources.services[0].spec.locality,
            Some(Locality {
                min_available_percent: 80
            })
        );
        let text = "[[services]]\nname = \"web\"\nlocality = { min_available_percent = 101 }\n";
        let Err(error) = super::parse("r.toml", text) else {
            panic!("101 % is refused");
        };
        let error = error.to_string();
        assert!(
            error.contains("services[0].locality.min_available_percent"),
            "{error}"
        );
    }

    fn file(services: usize, targets: usize, bad: Option<(usize, usize)>) -> String {
        let mut text = String::new();
        for service in 0..services {
            text.push_str(&format!("[[services]]\nname = \"s{service}\"\n"));
            for target in 0..targets {
                let port = if bad == Some((service, target)) {
                    0
                } else {
                    1_000 + target
                };
                text.push_str(&format!(
                    "[[services.targets]]\nhost = \"10.0.0.{service}\"\nport = {port}\n"
                ));
            }
        }
        text.push_str("[[routes]]\nname = \"r\"\nhosts = [\"a.test\"]\nservice = \"s1\"\n");
        text
    }

    const ROUTES: &str = r#"
[[services]]
name = "stable"
[[services]]
name = "canary"
[[services]]
name = "shadow"

[[routes]]
name = "split"
hosts = ["a.test", "*.b.test"]
path_prefix = "/api"
methods = ["GET", "POST"]
headers = [{ name = "x-env", value = "prod" }]
backends = [{ service = "stable", weight = 3 }, { service = "canary", weight = 1, subset = { tag = "v2" } }]
mirror = { service = "shadow", percent = 50 }
canary = { backend = 1, steps = [10, 50, 100] }
request_headers = { set = { "x-client" = "${client_ip}" } }
rate_limit = { requests_per_second = 1000, key = { header = "X-Api-Key" } }
max_in_flight = 50
max_request_body_bytes = 4096
request_buffer_bytes = 0
upgrades = []
priority = 7

[[routes]]
name = "plain"
service = "stable"
path_exact = "/p"
preserve_host = true

[[routes]]
name = "mirrored"
service = "canary"
mirror = { service = "canary" }

[[routes]]
name = "old"
path_prefix = "/old"
redirect = { path = "/api", status = 308 }
"#;

    /// A route without its times, and its canary without the moment its interval began.
    fn comparable(route: &crate::model::Route) -> crate::model::Route {
        let mut route = route.clone();
        route.created_at = chrono::DateTime::default();
        route.updated_at = chrono::DateTime::default();
        if let Some(status) = &mut route.canary_status {
            status.interval_started_ms = 0;
        }
        route
    }

    /// The file's routes, written in one batch, are stored as the API stores them one by one:
    /// every column and rule, their services (which then cannot be deleted), their canaries
    /// with a first history entry.
    #[tokio::test]
    async fn routes_written_in_a_batch_equal_routes_written_one_by_one() {
        let dir = tempfile::tempdir().unwrap();
        let open = |name: &str| format!("sqlite://{}/{name}.db", dir.path().display());
        let batched = crate::store::Store::connect_as(&open("batched"), "test")
            .await
            .unwrap();
        let resources = super::parse("r.toml", ROUTES).unwrap();
        let report = super::apply(&batched, &resources).await.unwrap();
        assert_eq!(
            report.created[3..],
            ["route split", "route plain", "route mirrored", "route old"]
        );

        let single = crate::store::Store::connect_as(&open("single"), "test")
            .await
            .unwrap();
        for declared in &resources.services {
            single.create_service(&declared.spec).await.unwrap();
        }
        let ids = single.load_routing_config().await.unwrap().services;
        let id_of = |name: &String| ids.iter().find(|s| &s.name == name).unwrap().id;
        for declared in &resources.routes {
            let mut spec = declared.spec.clone();
            for (backend, name) in spec.backends.iter_mut().zip(&declared.backend_services) {
                backend.service_id = id_of(name);
            }
            if let (Some(mirror), Some(name)) = (&mut spec.mirror, &declared.mirror_service) {
                mirror.service_id = id_of(name);
            }
            let route = single.create_route(&spec).await.unwrap();
            single
                .set_managed_by(super::ManagedKind::Route, route.id, Some(super::MANAGER))
                .await
                .unwrap();
        }

        let routes_of = |config: crate::model::RoutingConfig| {
            config.routes.iter().map(comparable).collect::<Vec<_>>()
        };
        let stored = routes_of(batched.load_routing_config().await.unwrap());
        assert_eq!(
            stored,
            routes_of(single.load_routing_config().await.unwrap())
        );
        assert!(stored[0].canary_status.is_some(), "{:?}", stored[0]);
        for route in &stored {
            let history = |store: crate::store::Store| async move {
                let history = store.canary_history(route.id, 10).await.unwrap();
                history
                    .into_iter()
                    .map(|decision| (decision.round, decision.state, decision.weight))
                    .collect::<Vec<_>>()
            };
            assert_eq!(
                history(batched.clone()).await,
                history(single.clone()).await
            );
        }
        assert_eq!(
            batched
                .canary_history(stored[0].id, 10)
                .await
                .unwrap()
                .len(),
            1
        );
        // route_services holds the mirror's service: it cannot be deleted under the route.
        let shadow = stored[0].mirror.as_ref().unwrap().service_id;
        let refused = batched.delete_service(shadow).await.unwrap_err();
        assert!(
            matches!(refused, crate::store::StoreError::Conflict { .. }),
            "{refused:?}"
        );
        let report = super::apply(&batched, &resources).await.unwrap();
        assert_eq!(report.unchanged.len(), 7, "{report}");
    }

    #[tokio::test]
    async fn a_large_file_is_written_in_batches_and_a_bad_target_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/raahi.db", dir.path().display());
        let store = crate::store::Store::connect_as(&url, "test").await.unwrap();
        let resources = super::parse("r.toml", &file(3, 700, None)).unwrap();
        let report = super::apply(&store, &resources).await.unwrap();
        assert_eq!(report.created.len(), 3 + 2_100 + 1, "{}", report);
        assert_eq!(report.created[1], "target s0/10.0.0.0:1000");
        // The text names the first 50 and counts the rest: one line for a log, not megabytes.
        let text = report.to_string();
        assert!(
            text.starts_with("created 2104, changed 0, unchanged 0, deleted 0; created: service s0, target s0/10.0.0.0:1000, "),
            "{text}"
        );
        assert!(text.ends_with(" and 2054 more"), "{text}");
        assert_eq!(text.matches(", ").count(), 3 + 49, "{text}");
        let config = store.load_routing_config().await.unwrap();
        assert_eq!(config.targets.len(), 2_100);
        assert!(config
            .targets
            .iter()
            .all(|target| target.managed_by.as_deref() == Some(super::MANAGER)));
        // Again: nothing to write.
        let report = super::apply(&store, &resources).await.unwrap();
        assert_eq!(report.unchanged.len(), 2_104, "{}", report);
        assert!(report.created.is_empty() && report.changed.is_empty());

        // One bad port among 2,800 targets: named, and nothing of the file is written.
        let Err(error) = super::parse("r.toml", &file(4, 700, Some((3, 123)))) else {
            panic!("port 0 is refused");
        };
        assert!(
            error.to_string().contains("services[3].targets[123].port"),
            "{error}"
        );
        let after = store.load_routing_config().await.unwrap();
        assert_eq!((after.services.len(), after.targets.len()), (3, 2_100));
    }
}
