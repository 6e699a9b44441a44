//! The pure mapping of the config's `port` to the port the EndpointSlices carry, through the
//! Service object (DESIGN §4):
//! - a number is a Service port (`spec.ports[].port`, what clients of the Service dial);
//! - a name is a Service port's name;
//! - unset is the Service's only TCP port.
//!
//! The chosen Service port is then found in each slice *by its name*: the EndpointSlice
//! controller names every slice port after its Service port and resolves `targetPort` per pod (a
//! named target port may be a different number on each pod), so the slice's number is the
//! endpoints' port and the Service's `targetPort` is never read for traffic.

use std::fmt::Write as _;

use k8s_openapi::api::core::v1::{Service, ServicePort};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::PortRef;

/// The port to take from each slice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlicePort {
    /// The slice port with this name ("" for a Service's single unnamed port).
    Named(String),
    /// A headless Service without ports: its slices carry none ("all ports"), so the endpoints
    /// are reached on this number.
    Any(u16),
}

/// The slice port for `wanted` on `service`, or why the config cannot be served as written.
/// `shown` names the Service in errors ("shop/web").
pub fn slice_port(
    service: &Service,
    wanted: Option<&PortRef>,
    shown: &str,
) -> Result<SlicePort, String> {
    let spec = service.spec.clone().unwrap_or_default();
    if spec.type_.as_deref() == Some("ExternalName") {
        return Err(format!(
            "Service {shown} is of type ExternalName ({}): it has no endpoints to proxy to",
            spec.external_name.as_deref().unwrap_or("no name")
        ));
    }
    let ports = spec.ports.unwrap_or_default();
    if ports.is_empty() {
        return match wanted {
            Some(PortRef::Number(number)) => Ok(SlicePort::Any(
                u16::try_from(*number).map_err(|_| format!("port {number} is out of range"))?,
            )),
            Some(PortRef::Name(name)) => Err(format!(
                "Service {shown} has no ports (headless), so no port named {name:?}; set \"port\" \
                 to the endpoints' port number"
            )),
            None => Err(format!(
                "Service {shown} has no ports (headless); set \"port\" to the endpoints' port \
                 number"
            )),
        };
    }
    let chosen = match wanted {
        Some(PortRef::Number(number)) => by_number(&ports, *number, shown)?,
        Some(PortRef::Name(name)) => by_name(&ports, name, shown)?,
        None => only_tcp(&ports, shown)?,
    };
    Ok(SlicePort::Named(chosen.name.clone().unwrap_or_default()))
}

fn by_number<'a>(
    ports: &'a [ServicePort],
    number: u32,
    shown: &str,
) -> Result<&'a ServicePort, String> {
    let matching: Vec<&ServicePort> = ports
        .iter()
        .filter(|port| u32::try_from(port.port).ok() == Some(number))
        .collect();
    if let Some(tcp) = matching.iter().find(|port| is_tcp(port)) {
        return Ok(tcp);
    }
    if let Some(other) = matching.first() {
        return Err(format!(
            "Service {shown} port {number} is {}; only TCP can be proxied",
            protocol_of(other)
        ));
    }
    let mut message = format!(
        "Service {shown} has no port {number} (its ports: {})",
        describe(ports)
    );
    // The meaning of a number changed: it used to be the endpoints' port. Say how to fix a
    // config written that way rather than guess which port was meant.
    if let Some(targeted) = ports
        .iter()
        .find(|port| port.target_port == Some(IntOrString::Int(number as i32)))
    {
        let _ = write!(
            message,
            "; {number} is the target port of Service port {}: \"port\" is the Service's port, \
             set {}",
            targeted.port,
            suggestion(targeted)
        );
    }
    Err(message)
}

fn by_name<'a>(
    ports: &'a [ServicePort],
    name: &str,
    shown: &str,
) -> Result<&'a ServicePort, String> {
    let Some(port) = ports.iter().find(|port| port.name.as_deref() == Some(name)) else {
        return Err(format!(
            "Service {shown} has no port named {name:?} (its ports: {})",
            describe(ports)
        ));
    };
    if !is_tcp(port) {
        return Err(format!(
            "Service {shown} port {name:?} is {}; only TCP can be proxied",
            protocol_of(port)
        ));
    }
    Ok(port)
}

/// With no `port` chosen the Service must have one TCP port; guessing among several would send
/// traffic to a metrics or admin port.
fn only_tcp<'a>(ports: &'a [ServicePort], shown: &str) -> Result<&'a ServicePort, String> {
    let tcp: Vec<&ServicePort> = ports.iter().filter(|port| is_tcp(port)).collect();
    match tcp.as_slice() {
        [only] => Ok(only),
        [] => Err(format!(
            "Service {shown} has no TCP port (its ports: {}); only TCP can be proxied",
            describe(ports)
        )),
        _ => Err(format!(
            "Service {shown} has several TCP ports ({}); set \"port\" to the number or name of \
             the one to use",
            describe(ports)
        )),
    }
}

fn is_tcp(port: &ServicePort) -> bool {
    protocol_of(port) == "TCP"
}

fn protocol_of(port: &ServicePort) -> &str {
    port.protocol.as_deref().unwrap_or("TCP")
}

/// What to write in `port` for this Service port: its number, or its name too when it has one.
fn suggestion(port: &ServicePort) -> String {
    match port.name.as_deref().filter(|name| !name.is_empty()) {
        Some(name) => format!("{} or {name:?}", port.port),
        None => port.port.to_string(),
    }
}

/// `80 "http" → 8080/TCP, 9090 "metrics" → metrics/TCP`
fn describe(ports: &[ServicePort]) -> String {
    ports
        .iter()
        .map(|port| {
            let mut text = port.port.to_string();
            if let Some(name) = port.name.as_deref().filter(|name| !name.is_empty()) {
                let _ = write!(text, " {name:?}");
            }
            match &port.target_port {
                Some(IntOrString::Int(number)) => {
                    let _ = write!(text, " → {number}");
                }
                Some(IntOrString::String(name)) => {
                    let _ = write!(text, " → {name}");
                }
                None => {}
            }
            let _ = write!(text, "/{}", protocol_of(port));
            text
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use serde_json::{json, Value};

    pub(in crate::discovery::kubernetes) fn service(ports: Value) -> Service {
        serde_json::from_value(json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": "shop", "resourceVersion": "5"},
            "spec": {"type": "ClusterIP", "ports": ports},
        }))
        .expect("a Service")
    }

    fn resolve(ports: Value, wanted: Option<PortRef>) -> Result<SlicePort, String> {
        slice_port(&service(ports), wanted.as_ref(), "shop/web")
    }

    fn named(name: &str) -> Result<SlicePort, String> {
        Ok(SlicePort::Named(name.to_owned()))
    }

    fn web_ports() -> Value {
        json!([
            {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"},
            {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"},
        ])
    }

    #[test]
    fn a_number_is_the_service_port_and_gives_its_name() {
        assert_eq!(
            resolve(web_ports(), Some(PortRef::Number(80))),
            named("http")
        );
        assert_eq!(
            resolve(web_ports(), Some(PortRef::Number(9090))),
            named("metrics")
        );
        // A single unnamed port: the slices carry it with the name "".
        let single = json!([{"port": 80, "targetPort": 8080}]);
        assert_eq!(
            resolve(single.clone(), Some(PortRef::Number(80))),
            named("")
        );
        assert_eq!(resolve(single, None), named(""));
    }

    #[test]
    fn a_target_port_number_is_refused_with_the_service_port_to_write() {
        let error = resolve(web_ports(), Some(PortRef::Number(8080))).unwrap_err();
        assert_eq!(
            error,
            "Service shop/web has no port 8080 (its ports: 80 \"http\" → 8080/TCP, 9090 \
             \"metrics\" → metrics/TCP); 8080 is the target port of Service port 80: \"port\" is \
             the Service's port, set 80 or \"http\""
        );
        let error = resolve(web_ports(), Some(PortRef::Number(81))).unwrap_err();
        assert_eq!(
            error,
            "Service shop/web has no port 81 (its ports: 80 \"http\" → 8080/TCP, 9090 \
             \"metrics\" → metrics/TCP)"
        );
    }

    #[test]
    fn a_service_port_number_wins_over_another_ports_target_port() {
        let ports = json!([
            {"name": "http", "port": 80, "targetPort": 8080},
            {"name": "alt", "port": 8080, "targetPort": 9000},
        ]);
        assert_eq!(resolve(ports, Some(PortRef::Number(8080))), named("alt"));
    }

    #[test]
    fn names_protocols_and_the_unset_port() {
        assert_eq!(
            resolve(web_ports(), Some(PortRef::Name("metrics".into()))),
            named("metrics")
        );
        assert_eq!(
            resolve(web_ports(), Some(PortRef::Name("grpc".into()))).unwrap_err(),
            "Service shop/web has no port named \"grpc\" (its ports: 80 \"http\" → 8080/TCP, \
             9090 \"metrics\" → metrics/TCP)"
        );
        let unset = resolve(web_ports(), None).unwrap_err();
        assert!(unset.contains("several TCP ports"), "{unset}");
        let dns = json!([
            {"name": "dns", "port": 53, "protocol": "UDP"},
            {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
        ]);
        assert_eq!(
            resolve(dns.clone(), Some(PortRef::Number(53))),
            named("dns-tcp")
        );
        assert_eq!(resolve(dns.clone(), None), named("dns-tcp"));
        assert_eq!(
            resolve(dns, Some(PortRef::Name("dns".into()))).unwrap_err(),
            "Service shop/web port \"dns\" is UDP; only TCP can be proxied"
        );
        let udp = json!([{"name": "dns", "port": 53, "protocol": "UDP"}]);
        assert!(resolve(udp.clone(), None)
            .unwrap_err()
            .contains("has no TCP port"));
        assert!(resolve(udp, Some(PortRef::Number(53)))
            .unwrap_err()
            .contains("port 53 is UDP"));
    }

    #[test]
    fn a_headless_service_without_ports_takes_the_number_as_the_endpoints_port() {
        assert_eq!(
            resolve(Value::Null, Some(PortRef::Number(5432))),
            Ok(SlicePort::Any(5432))
        );
        assert!(resolve(Value::Null, None)
            .unwrap_err()
            .contains("has no ports (headless)"));
    }

    #[test]
    fn an_external_name_service_has_no_endpoints() {
        let mut external = service(Value::Null);
        let spec = external.spec.as_mut().unwrap();
        spec.type_ = Some("ExternalName".into());
        spec.external_name = Some("db.example.com".into());
        assert_eq!(
            slice_port(&external, Some(&PortRef::Number(5432)), "shop/web").unwrap_err(),
            "Service shop/web is of type ExternalName (db.example.com): it has no endpoints to \
             proxy to"
        );
    }
}
