//! Checks on what operators write, beyond what the JSON types already guarantee. Each check
//! names the field it refuses; accepted input comes back normalised (lower-case hosts,
//! upper-case methods). The admin API and the resources file both validate here, and each maps
//! a [`ValidationError`] to its own answer once.

use std::net::IpAddr;

use http::uri::Authority;

use crate::discovery;
use crate::model::{
    CertificateSpec, DiscoverySourceSpec, HealthCheckKind, Protocol, RemovalGuard, ServiceSpec,
    StreamRouteSpec, TargetSpec, TokenSpec, MAX_ATTEMPTS, MAX_WEIGHT,
};
use crate::tls::{self, ParsedCertificate, TlsError};

mod affinity;
mod canary;
mod json;
mod limits;
mod retry;
mod route;

pub use json::from_value;
pub use route::{route, MAX_REQUEST_BUFFER_BYTES};

/// A field an operator wrote that cannot be accepted, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ValidationError {
    /// The field's path in the document (`timeouts.connect_ms`, `targets[2].port`).
    pub field: String,
    pub message: String,
}

impl ValidationError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> ValidationError {
        ValidationError {
            field: field.into(),
            message: message.into(),
        }
    }
}

const MAX_NAME_LEN: usize = 100;
const MAX_TIMEOUT_MS: u64 = 3_600_000;
const MAX_METADATA_BYTES: usize = 16 * 1024;
/// A certificate chain, key or CA bundle larger than this is a mistake, not a PEM.
const MAX_PEM_BYTES: usize = 1024 * 1024;
const MAX_SNIS: usize = 100;

fn tls_error(error: TlsError) -> ValidationError {
    ValidationError::new(error.field(), error.to_string())
}

/// A server name as clients send it in SNI, or a `*.suffix` wildcard; lower-cased.
fn server_name(field: &str, value: &str) -> Result<String, ValidationError> {
    let lowered = value.to_ascii_lowercase();
    let plain = lowered.strip_prefix("*.").unwrap_or(&lowered);
    if !is_host_name(plain) || plain.parse::<IpAddr>().is_ok() {
        return Err(ValidationError::new(
            field,
            format!("{value:?} is not a DNS host name or a *.suffix wildcard"),
        ));
    }
    Ok(lowered)
}

/// Protocols an HTTP route can send to.
pub fn serves_http(protocol: Protocol) -> bool {
    matches!(protocol, Protocol::Http | Protocol::Https | Protocol::H2c)
}

pub fn stream_route(mut spec: StreamRouteSpec) -> Result<StreamRouteSpec, ValidationError> {
    if spec.listen.port() == 0 {
        return Err(ValidationError::new(
            "listen",
            "listen needs a fixed port (not 0): clients must know where to connect",
        ));
    }
    if let Some(sni) = &spec.sni {
        spec.sni = Some(server_name("sni", sni)?);
    }
    Ok(spec)
}

/// Parses the certificate and its key; `snis` default to the certificate's DNS names and must
/// each be covered by them.
pub fn certificate(
    mut spec: CertificateSpec,
) -> Result<(CertificateSpec, ParsedCertificate), ValidationError> {
    for (field, value) in [("cert_pem", &spec.cert_pem), ("key_pem", &spec.key_pem)] {
        if value.len() > MAX_PEM_BYTES {
            return Err(ValidationError::new(
                field,
                format!("{field} must be at most {MAX_PEM_BYTES} bytes"),
            ));
        }
    }
    let parsed = tls::parse_certificate(&spec.cert_pem, &spec.key_pem).map_err(tls_error)?;
    let snis = match spec.snis.take() {
        Some(snis) => {
            let mut normalised = Vec::with_capacity(snis.len());
            for (index, sni) in snis.iter().enumerate() {
                normalised.push(server_name(&format!("snis[{index}]"), sni)?);
            }
            tls::check_snis_covered(&parsed.names, &normalised).map_err(tls_error)?;
            normalised
        }
        None => parsed
            .names
            .iter()
            .filter(|name| server_name("snis", name).is_ok())
            .cloned()
            .collect(),
    };
    let mut snis = snis;
    snis.sort();
    snis.dedup();
    if snis.is_empty() {
        return Err(ValidationError::new(
            "snis",
            "the certificate names no DNS host (subjectAltName); give the names to serve it for in snis",
        ));
    }
    if snis.len() > MAX_SNIS {
        return Err(ValidationError::new(
            "snis",
            format!("at most {MAX_SNIS} names"),
        ));
    }
    spec.snis = Some(snis);
    Ok((spec, parsed))
}

fn name(field: &str, value: &str) -> Result<(), ValidationError> {
    let valid_chars = value
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if value.is_empty() || value.len() > MAX_NAME_LEN || !valid_chars {
        return Err(ValidationError::new(
            field,
            format!("{field} must be 1 to {MAX_NAME_LEN} characters of letters, digits, '-', '_' or '.'"),
        ));
    }
    Ok(())
}

/// A DNS host name (RFC 1123 labels).
fn is_host_name(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= 253
        && value.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

pub fn service(mut spec: ServiceSpec) -> Result<ServiceSpec, ValidationError> {
    name("name", &spec.name)?;
    if let Some(bundle) = &spec.tls_ca_pem {
        if bundle.len() > MAX_PEM_BYTES {
            return Err(ValidationError::new(
                "tls_ca_pem",
                format!("tls_ca_pem must be at most {MAX_PEM_BYTES} bytes"),
            ));
        }
        tls::parse_ca_bundle(bundle).map_err(tls_error)?;
    }
    if let Some(authority) = &spec.upstream_authority {
        let parsed = Authority::try_from(authority.as_str()).ok();
        let valid = parsed.as_ref().is_some_and(|parsed| {
            !parsed.as_str().contains('@')
                && (is_host_name(parsed.host())
                    || parsed.host().parse::<IpAddr>().is_ok()
                    || parsed.host().starts_with('['))
        });
        if !valid {
            return Err(ValidationError::new(
                "upstream_authority",
                "upstream_authority must be a host name or IP address with an optional :port",
            ));
        }
        spec.upstream_authority = parsed.map(|a| a.as_str().to_ascii_lowercase());
    }
    if let Some(sni) = &spec.tls_sni {
        if !is_host_name(sni) {
            return Err(ValidationError::new(
                "tls_sni",
                "tls_sni must be a DNS host name",
            ));
        }
    }
    for (field, value) in [
        ("timeouts.connect_ms", spec.timeouts.connect_ms),
        (
            "timeouts.response_header_ms",
            spec.timeouts.response_header_ms,
        ),
        ("timeouts.idle_ms", spec.timeouts.idle_ms),
    ] {
        if value == 0 || value > MAX_TIMEOUT_MS {
            return Err(ValidationError::new(
                field,
                format!("{field} must be from 1 to {MAX_TIMEOUT_MS}"),
            ));
        }
    }
    if let Some(keepalive_ms) = spec.timeouts.keepalive_ms {
        in_range("timeouts.keepalive_ms", keepalive_ms, 100, MAX_TIMEOUT_MS)?;
    }
    if let Some(check) = &spec.health_check {
        health_check(check, spec.protocol)?;
    }
    ejection(&spec.ejection)?;
    upstream_limits(&spec.limits)?;
    affinity::affinity(&mut spec)?;
    if let Some(locality) = spec.locality {
        if locality.min_available_percent > 100 {
            return Err(ValidationError::new(
                "locality.min_available_percent",
                "locality.min_available_percent must be from 0 to 100 (percent of the zone's targets)",
            ));
        }
    }
    if spec.max_attempts == 0 || spec.max_attempts > MAX_ATTEMPTS {
        return Err(ValidationError::new(
            "max_attempts",
            format!("max_attempts must be from 1 to {MAX_ATTEMPTS}"),
        ));
    }
    Ok(spec)
}

fn upstream_limits(limits: &crate::model::UpstreamLimits) -> Result<(), ValidationError> {
    if let Some(max) = limits.max_connections_per_target {
        in_range(
            "limits.max_connections_per_target",
            max.into(),
            1,
            1_000_000,
        )?;
    }
    in_range(
        "limits.max_pending_requests",
        limits.max_pending_requests.into(),
        0,
        1_000_000,
    )?;
    in_range(
        "limits.queue_timeout_ms",
        limits.queue_timeout_ms,
        1,
        MAX_TIMEOUT_MS,
    )?;
    in_range(
        "limits.max_streams_per_connection",
        limits.max_streams_per_connection.into(),
        1,
        10_000,
    )
}

fn in_range(field: &str, value: u64, low: u64, high: u64) -> Result<(), ValidationError> {
    if (low..=high).contains(&value) {
        return Ok(());
    }
    Err(ValidationError::new(
        field,
        format!("{field} must be from {low} to {high}"),
    ))
}

fn status_range(text: &str) -> Option<(u16, u16)> {
    let (low, high) = text.split_once('-').unwrap_or((text, text));
    let low: u16 = low.trim().parse().ok()?;
    let high: u16 = high.trim().parse().ok()?;
    ((100..=599).contains(&low) && (low..=599).contains(&high)).then_some((low, high))
}

fn health_check(
    check: &crate::model::HealthCheck,
    protocol: Protocol,
) -> Result<(), ValidationError> {
    if check.kind == HealthCheckKind::Tls && !protocol.targets_speak_tls() {
        return Err(ValidationError::new(
            "health_check.type",
            format!(
                "a tls health check needs an https or tls service; this one is {}: use http or tcp",
                protocol.as_str()
            ),
        ));
    }
    if check.kind == HealthCheckKind::Grpc && !matches!(protocol, Protocol::H2c | Protocol::Https) {
        return Err(ValidationError::new(
            "health_check.type",
            format!(
                "a grpc health check needs an h2c or https service; this one is {}",
                protocol.as_str()
            ),
        ));
    }
    if check.grpc_service.is_some() && check.kind != HealthCheckKind::Grpc {
        return Err(ValidationError::new(
            "health_check.grpc_service",
            "health_check.grpc_service applies only to type \"grpc\"",
        ));
    }
    if let Some(name) = &check.grpc_service {
        if name.len() > 1024 || name.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(ValidationError::new(
                "health_check.grpc_service",
                "health_check.grpc_service must be a service name of at most 1024 characters without spaces",
            ));
        }
    }
    if !check.path.starts_with('/')
        || check
            .path
            .chars()
            .any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(ValidationError::new(
            "health_check.path",
            "health_check.path must start with '/' and contain no spaces",
        ));
    }
    in_range(
        "health_check.interval_ms",
        check.interval_ms,
        100,
        MAX_TIMEOUT_MS,
    )?;
    in_range(
        "health_check.timeout_ms",
        check.timeout_ms,
        10,
        MAX_TIMEOUT_MS,
    )?;
    in_range(
        "health_check.healthy_threshold",
        check.healthy_threshold.into(),
        1,
        100,
    )?;
    in_range(
        "health_check.unhealthy_threshold",
        check.unhealthy_threshold.into(),
        1,
        100,
    )?;
    if check.expected_statuses.is_empty() {
        return Err(ValidationError::new(
            "health_check.expected_statuses",
            "health_check.expected_statuses needs at least one status or range",
        ));
    }
    for (index, range) in check.expected_statuses.iter().enumerate() {
        if status_range(range).is_none() {
            return Err(ValidationError::new(
                format!("health_check.expected_statuses[{index}]"),
                format!("{range:?} is not a status (e.g. \"200\") or range (e.g. \"200-399\") within 100-599"),
            ));
        }
    }
    if let Some(host) = &check.host {
        let valid = Authority::try_from(host.as_str())
            .is_ok_and(|authority| !authority.as_str().contains('@'));
        if !valid {
            return Err(ValidationError::new(
                "health_check.host",
                "health_check.host must be a host name with an optional :port",
            ));
        }
    }
    Ok(())
}

fn ejection(ejection: &crate::model::Ejection) -> Result<(), ValidationError> {
    in_range("ejection.failures", ejection.failures.into(), 1, 10_000)?;
    in_range(
        "ejection.window_ms",
        ejection.window_ms,
        100,
        MAX_TIMEOUT_MS,
    )?;
    in_range(
        "ejection.base_ejection_ms",
        ejection.base_ejection_ms,
        100,
        MAX_TIMEOUT_MS,
    )?;
    in_range(
        "ejection.max_ejection_ms",
        ejection.max_ejection_ms,
        ejection.base_ejection_ms,
        MAX_TIMEOUT_MS,
    )?;
    in_range(
        "ejection.max_ejection_percent",
        ejection.max_ejection_percent.into(),
        0,
        100,
    )?;
    for (index, status) in ejection.failure_statuses.iter().enumerate() {
        in_range(
            &format!("ejection.failure_statuses[{index}]"),
            (*status).into(),
            100,
            599,
        )?;
    }
    Ok(())
}

pub fn target(spec: TargetSpec) -> Result<TargetSpec, ValidationError> {
    if spec.host.parse::<IpAddr>().is_err() {
        return Err(ValidationError::new(
            "host",
            "host must be an IP address (the request path never resolves names); add a dns discovery source to follow a host name",
        ));
    }
    if spec.port == 0 {
        return Err(ValidationError::new("port", "port must be from 1 to 65535"));
    }
    if spec.weight > MAX_WEIGHT {
        return Err(ValidationError::new(
            "weight",
            format!("weight must be from 0 to {MAX_WEIGHT}"),
        ));
    }
    if !spec.metadata.is_object() {
        return Err(ValidationError::new(
            "metadata",
            "metadata must be a JSON object",
        ));
    }
    if spec.metadata.to_string().len() > MAX_METADATA_BYTES {
        return Err(ValidationError::new(
            "metadata",
            format!("metadata must serialise to at most {MAX_METADATA_BYTES} bytes"),
        ));
    }
    Ok(spec)
}

const MAX_STALE_AFTER_MS: u64 = 30 * 24 * 3_600_000;
const MAX_REMOVAL_GRACE_MS: u64 = 24 * 3_600_000;
const MIN_GUARD_CONFIRM_MS: u64 = 100;
const MAX_GUARD_CONFIRM_MS: u64 = 24 * 3_600_000;

/// Checks a source; its `config` comes back normalised with every provider default filled in.
pub fn source(mut spec: DiscoverySourceSpec) -> Result<DiscoverySourceSpec, ValidationError> {
    name("name", &spec.name)?;
    if !spec.config.is_object() {
        return Err(ValidationError::new(
            "config",
            "config must be a JSON object",
        ));
    }
    spec.config = discovery::validate(spec.provider, &spec.config)
        .map_err(|error| ValidationError::new(format!("config.{}", error.field), error.message))?;
    if !(100..=MAX_STALE_AFTER_MS).contains(&spec.stale_after_ms) {
        return Err(ValidationError::new(
            "stale_after_ms",
            format!("stale_after_ms must be from 100 to {MAX_STALE_AFTER_MS}"),
        ));
    }
    if spec.removal_grace_ms > MAX_REMOVAL_GRACE_MS {
        return Err(ValidationError::new(
            "removal_grace_ms",
            format!("removal_grace_ms must be from 0 to {MAX_REMOVAL_GRACE_MS}"),
        ));
    }
    if let Some(guard) = &spec.removal_guard {
        removal_guard(guard)?;
    }
    Ok(spec)
}

fn removal_guard(guard: &RemovalGuard) -> Result<(), ValidationError> {
    if guard.max_percent > 100 {
        return Err(ValidationError::new(
            "removal_guard.max_percent",
            "max_percent must be from 0 to 100 (100 never holds; null turns the guard off)",
        ));
    }
    if !(MIN_GUARD_CONFIRM_MS..=MAX_GUARD_CONFIRM_MS).contains(&guard.confirm_ms) {
        return Err(ValidationError::new(
            "removal_guard.confirm_ms",
            format!("confirm_ms must be from {MIN_GUARD_CONFIRM_MS} to {MAX_GUARD_CONFIRM_MS}"),
        ));
    }
    Ok(())
}

pub fn token(spec: TokenSpec) -> Result<TokenSpec, ValidationError> {
    name("name", &spec.name)?;
    if spec.name.starts_with("configured-admin") {
        return Err(ValidationError::new(
            "name",
            "names starting with \"configured-admin\" are kept for the token set by admin.token",
        ));
    }
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{LbPolicy, Role, RouteSpec, Timeouts};

    fn service_spec() -> ServiceSpec {
        ServiceSpec {
            limits: crate::model::UpstreamLimits::default(),
            name: "web".into(),
            protocol: Protocol::Http,
            upstream_authority: Some("Shop.Example:8443".into()),
            tls_sni: None,
            tls_verify: true,
            tls_ca_pem: None,
            lb_policy: LbPolicy::RoundRobin,
            hash_on: None,
            hash_balance_factor: None,
            session_persistence: None,
            locality: None,
            timeouts: Timeouts::default(),
            max_attempts: 3,
            health_check: None,
            ejection: Default::default(),
        }
    }

    fn field_of(result: Result<impl std::fmt::Debug, ValidationError>) -> String {
        match result {
            Err(error) => error.field,
            other => panic!("expected a validation error, got {other:?}"),
        }
    }

    #[test]
    fn locality_takes_a_percent_from_0_to_100() {
        use crate::model::Locality;
        let with = |min_available_percent| {
            service(ServiceSpec {
                locality: Some(Locality {
                    min_available_percent,
                }),
                ..service_spec()
            })
        };
        assert_eq!(field_of(with(101)), "locality.min_available_percent");
        assert!(with(0).is_ok());
        assert!(with(100).is_ok());
        let defaulted: Locality = serde_json::from_str("{}").unwrap();
        assert_eq!(defaulted.min_available_percent, 70);
    }

    #[test]
    fn service_limits_name_the_field_out_of_range() {
        use crate::model::UpstreamLimits;
        let limited = |limits: UpstreamLimits| {
            field_of(service(ServiceSpec {
                limits,
                ..service_spec()
            }))
        };
        let base = UpstreamLimits::default();
        assert_eq!(
            limited(UpstreamLimits {
                max_connections_per_target: Some(0),
                ..base
            }),
            "limits.max_connections_per_target"
        );
        assert_eq!(
            limited(UpstreamLimits {
                queue_timeout_ms: 0,
                ..base
            }),
            "limits.queue_timeout_ms"
        );
        let accepted = service(ServiceSpec {
            limits: UpstreamLimits {
                max_connections_per_target: Some(8),
                max_pending_requests: 0,
                ..base
            },
            ..service_spec()
        });
        assert!(accepted.is_ok(), "{accepted:?}");
    }

    #[test]
    fn service_checks_name_authority_timeouts_attempts() {
        let accepted = service(service_spec()).unwrap();
        assert_eq!(
            accepted.upstream_authority.as_deref(),
            Some("shop.example:8443")
        );
        let mut bad = service_spec();
        bad.name = "has space".into();
        assert_eq!(field_of(service(bad)), "name");
        let mut bad = service_spec();
        bad.upstream_authority = Some("user@host".into());
        assert_eq!(field_of(service(bad)), "upstream_authority");
        let mut bad = service_spec();
        bad.timeouts.connect_ms = 0;
        assert_eq!(field_of(service(bad)), "timeouts.connect_ms");
        let mut bad = service_spec();
        bad.max_attempts = 0;
        assert_eq!(field_of(service(bad)), "max_attempts");
        let mut bad = service_spec();
        bad.tls_ca_pem = Some("not a certificate".into());
        assert_eq!(field_of(service(bad)), "tls_ca_pem");
    }

    #[test]
    fn a_tls_check_needs_a_service_whose_targets_speak_tls() {
        let with_check = |protocol: Protocol, kind: &str| ServiceSpec {
            protocol,
            health_check: Some(serde_json::from_value(serde_json::json!({"type": kind})).unwrap()),
            ..service_spec()
        };
        for protocol in [Protocol::Https, Protocol::Tls] {
            assert!(service(with_check(protocol, "tls")).is_ok(), "{protocol:?}");
        }
        for protocol in [Protocol::Http, Protocol::Tcp] {
            assert_eq!(
                field_of(service(with_check(protocol, "tls"))),
                "health_check.type",
                "{protocol:?}"
            );
        }
        for protocol in Protocol::ALL {
            for kind in ["http", "tcp"] {
                assert!(
                    service(with_check(*protocol, kind)).is_ok(),
                    "{kind} check on {protocol:?}"
                );
            }
        }
    }

    #[test]
    fn target_needs_ip_port_and_sane_weight() {
        let spec = TargetSpec {
            host: "127.0.0.1".into(),
            port: 80,
            weight: 100,
            priority: 0,
            enabled: true,
            metadata: serde_json::json!({}),
        };
        assert!(target(spec.clone()).is_ok());
        assert_eq!(
            field_of(target(TargetSpec {
                host: "example.com".into(),
                ..spec.clone()
            })),
            "host"
        );
        assert_eq!(
            field_of(target(TargetSpec {
                port: 0,
                ..spec.clone()
            })),
            "port"
        );
        assert_eq!(
            field_of(target(TargetSpec {
                weight: 70_000,
                ..spec.clone()
            })),
            "weight"
        );
        assert_eq!(
            field_of(target(TargetSpec {
                metadata: serde_json::json!([1]),
                ..spec
            })),
            "metadata"
        );
    }

    #[test]
    fn route_normalises_and_names_bad_entries() {
        let spec = RouteSpec {
            name: "r".into(),
            hosts: vec!["API.Example.com".into(), "*.example.com".into()],
            path_prefix: Some("/api".into()),
            methods: vec!["get".into()],
            service_id: Some(1),
            request_buffer_bytes: 1024,
            upgrades: vec!["WebSocket".into(), "websocket".into()],
            ..RouteSpec::default()
        };
        let accepted = route(spec.clone()).unwrap();
        assert_eq!(accepted.upgrades, vec!["websocket"]);
        for (bad, field) in [
            (
                RouteSpec {
                    upgrades: vec!["websocket".into(), "H2C".into()],
                    ..spec.clone()
                },
                "upgrades[1]",
            ),
            (
                RouteSpec {
                    upgrades: vec!["web socket".into()],
                    ..spec.clone()
                },
                "upgrades[0]",
            ),
            (
                RouteSpec {
                    max_request_body_bytes: Some(0),
                    ..spec.clone()
                },
                "max_request_body_bytes",
            ),
            (
                RouteSpec {
                    request_buffer_bytes: MAX_REQUEST_BUFFER_BYTES + 1,
                    ..spec.clone()
                },
                "request_buffer_bytes",
            ),
        ] {
            assert_eq!(field_of(route(bad)), field);
        }
        assert_eq!(accepted.hosts, vec!["*.example.com", "api.example.com"]);
        assert_eq!(accepted.methods, vec!["GET"]);
        assert_eq!(
            field_of(route(RouteSpec {
                hosts: vec!["ok.test".into(), "bad host".into()],
                ..spec.clone()
            })),
            "hosts[1]"
        );
        assert_eq!(
            field_of(route(RouteSpec {
                path_prefix: Some("api".into()),
                ..spec.clone()
            })),
            "path_prefix"
        );
        for (written, stored) in [
            ("/%61pi/./v1", "/api/v1"),
            ("//api//v1/", "/api/v1/"),
            ("/api/v1/..", "/api/"),
            ("/a%2fb", "/a%2Fb"),
            ("/api", "/api"),
        ] {
            let accepted = route(RouteSpec {
                path_prefix: Some(written.into()),
                ..spec.clone()
            })
            .unwrap();
            assert_eq!(accepted.path_prefix.as_deref(), Some(stored), "{written}");
        }
        for climbs_or_malformed in ["/../x", "/a/../..", "/a%2", "/a%zz"] {
            let error = route(RouteSpec {
                path_prefix: Some(climbs_or_malformed.into()),
                ..spec.clone()
            })
            .unwrap_err();
            assert_eq!(error.field, "path_prefix", "{climbs_or_malformed}");
            assert!(
                error.message.starts_with("path_prefix "),
                "{}",
                error.message
            );
        }
        assert_eq!(
            field_of(route(RouteSpec {
                methods: vec!["G3T".into()],
                ..spec
            })),
            "methods[0]"
        );
        assert_eq!(
            field_of(token(TokenSpec {
                name: String::new(),
                role: Role::Viewer
            })),
            "name"
        );
    }
}
