//! The pure mapping of a Service's EndpointSlices to one endpoint set (DESIGN §4):
//! - provider key `address:port` (`[address]:port` for IPv6), one endpoint per key across slices
//!   (the best state wins: ready over serving-and-terminating);
//! - `ready` endpoints are the set; `serving` ∧ `terminating` ones are left out (so reconcile
//!   drains them: no new requests, in-flight ones finish) unless no endpoint is ready, when they
//!   are the set (KEP-1669: a Service whose pods all terminate keeps serving through them);
//!   anything else is left out;
//! - the port is the slice port named after the Service port `port` chose (`ports.rs`), or, for a
//!   headless Service without ports, the number given.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::{json, Value};

use super::ports::SlicePort;
use super::KubernetesConfig;
use crate::discovery::{revision_of, Discovered};
use crate::model::{Endpoint, ZONE_HINTS_KEY};

/// What the config, read through the Service, asks of the slices.
#[derive(Debug, Clone, PartialEq)]
pub struct Wanted {
    pub port: SlicePort,
    pub weight: u32,
    pub priority: i32,
}

impl Wanted {
    pub(super) fn of(config: &KubernetesConfig, port: SlicePort) -> Wanted {
        Wanted {
            port,
            weight: config.weight,
            priority: config.priority,
        }
    }
}

/// How an endpoint may take traffic; the better one wins when an address is in several slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Readiness {
    /// Neither ready nor serving: left out.
    Out,
    /// Serving while terminating: only when nothing is ready.
    Terminating,
    Ready,
}

fn readiness_of(endpoint: &k8s_openapi::api::discovery::v1::Endpoint) -> Readiness {
    let conditions = endpoint.conditions.clone().unwrap_or_default();
    // Nil `ready` and `serving` mean true, nil `terminating` false (the API's field docs).
    if conditions.ready.unwrap_or(true) {
        return Readiness::Ready;
    }
    if conditions.serving.unwrap_or(true) && conditions.terminating.unwrap_or(false) {
        return Readiness::Terminating;
    }
    Readiness::Out
}

/// The whole endpoint set of a Service's slices (pure). An error when no slice has the port.
pub fn endpoints_of(
    slices: &BTreeMap<String, EndpointSlice>,
    wanted: &Wanted,
) -> Result<Discovered, String> {
    let mut best: BTreeMap<SocketAddr, (Readiness, Endpoint)> = BTreeMap::new();
    let mut refused: Vec<String> = Vec::new();
    let mut port_missing: Vec<String> = Vec::new();
    // Addresses listed but not ready: the API itself says they are leaving.
    let mut not_ready: Vec<SocketAddr> = Vec::new();
    for (name, slice) in slices {
        if slice.endpoints.is_empty() {
            continue;
        }
        if !matches!(slice.address_type.as_str(), "IPv4" | "IPv6") {
            refused.push(format!(
                "slice {name}: addressType {} (only IPv4 and IPv6 addresses can be proxied to)",
                slice.address_type
            ));
            continue;
        }
        let port = match port_of(slice, wanted) {
            Ok(port) => port,
            Err(reason) => {
                port_missing.push(format!("slice {name}: {reason}"));
                continue;
            }
        };
        for endpoint in &slice.endpoints {
            let readiness = readiness_of(endpoint);
            let Some(address) = endpoint.addresses.first() else {
                continue;
            };
            // No semantics are defined for addresses beyond the first (kube-proxy ignores them).
            let Ok(ip) = address.parse::<IpAddr>() else {
                if readiness != Readiness::Out {
                    refused.push(format!(
                        "slice {name}: address {address:?} is not an IP address"
                    ));
                }
                continue;
            };
            let key = SocketAddr::new(ip, port);
            if readiness == Readiness::Out {
                not_ready.push(key);
                continue;
            }
            if best.get(&key).is_some_and(|(known, _)| *known >= readiness) {
                continue;
            }
            best.insert(
                key,
                (readiness, endpoint_of(key, endpoint, readiness, wanted)),
            );
        }
    }
    // No slice has the port: the config names a port the Service does not have, which is a
    // failed refresh (last known good keeps serving), not an empty Service.
    let usable = usable_slices(slices);
    if usable > 0 && port_missing.len() == usable {
        return Err(port_missing.join("; "));
    }
    refused.extend(port_missing);
    let any_ready = best
        .values()
        .any(|(readiness, _)| *readiness == Readiness::Ready);
    let (endpoints, terminating): (Vec<_>, Vec<_>) = best
        .into_values()
        .partition(|(readiness, _)| !any_ready || *readiness == Readiness::Ready);
    let endpoints: Vec<Endpoint> = endpoints
        .into_iter()
        .map(|(_, endpoint)| endpoint)
        .collect();
    let listed: std::collections::HashSet<&str> = endpoints
        .iter()
        .map(|endpoint| endpoint.key.as_str())
        .collect();
    let mut departures: Vec<String> = terminating
        .into_iter()
        .map(|(_, endpoint)| endpoint.key)
        .chain(not_ready.into_iter().map(|key| key.to_string()))
        .filter(|key| !listed.contains(key.as_str()))
        .collect();
    departures.sort();
    departures.dedup();
    Ok(Discovered {
        revision: revision_of(&endpoints),
        endpoints,
        ttl: None,
        refused: (!refused.is_empty()).then(|| refused.join("; ")),
        departures,
    })
}

/// Slices with IP endpoints: the ones a port is looked up in.
fn usable_slices(slices: &BTreeMap<String, EndpointSlice>) -> usize {
    slices
        .values()
        .filter(|slice| {
            !slice.endpoints.is_empty() && matches!(slice.address_type.as_str(), "IPv4" | "IPv6")
        })
        .count()
}

fn tcp_ports(
    slice: &EndpointSlice,
) -> impl Iterator<Item = &k8s_openapi::api::discovery::v1::EndpointPort> {
    slice
        .ports
        .iter()
        .flatten()
        .filter(|port| port.protocol.as_deref().unwrap_or("TCP") == "TCP")
}

/// The port of one slice's endpoints for the wanted port.
fn port_of(slice: &EndpointSlice, wanted: &Wanted) -> Result<u16, String> {
    let ports = slice.ports.as_deref().unwrap_or_default();
    let number = |port: &k8s_openapi::api::discovery::v1::EndpointPort| {
        port.port
            .and_then(|number| u16::try_from(number).ok())
            .filter(|number| *number != 0)
    };
    match &wanted.port {
        SlicePort::Named(name) => {
            let Some(port) = ports
                .iter()
                .find(|port| port.name.as_deref().unwrap_or_default() == name)
            else {
                return Err(format!(
                    "no port named {name:?} (its ports: {})",
                    describe_ports(ports)
                ));
            };
            let protocol = port.protocol.as_deref().unwrap_or("TCP");
            if protocol != "TCP" {
                return Err(format!(
                    "port {name:?} is {protocol}; only TCP can be proxied"
                ));
            }
            number(port).ok_or_else(|| format!("port {name:?} has no number"))
        }
        SlicePort::Any(wanted_number) => {
            // No ports, or a port without a number, means "all ports".
            let all_ports = ports.is_empty() || ports.iter().any(|port| port.port.is_none());
            if all_ports || tcp_ports(slice).any(|port| number(port) == Some(*wanted_number)) {
                return Ok(*wanted_number);
            }
            Err(format!(
                "no TCP port {wanted_number} (its ports: {})",
                describe_ports(ports)
            ))
        }
    }
}

fn describe_ports(ports: &[k8s_openapi::api::discovery::v1::EndpointPort]) -> String {
    if ports.is_empty() {
        return "none".to_owned();
    }
    ports
        .iter()
        .map(|port| {
            format!(
                "{}={}/{}",
                port.name
                    .as_deref()
                    .filter(|name| !name.is_empty())
                    .unwrap_or("(unnamed)"),
                port.port
                    .map_or("*".to_owned(), |number| number.to_string()),
                port.protocol.as_deref().unwrap_or("TCP")
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn endpoint_of(
    key: SocketAddr,
    endpoint: &k8s_openapi::api::discovery::v1::Endpoint,
    readiness: Readiness,
    wanted: &Wanted,
) -> Endpoint {
    let mut metadata = serde_json::Map::new();
    if let Some(pod) = endpoint
        .target_ref
        .as_ref()
        .filter(|reference| reference.kind.as_deref().unwrap_or("Pod") == "Pod")
        .and_then(|reference| reference.name.clone())
    {
        metadata.insert("pod".to_owned(), json!(pod));
    }
    if let Some(node) = &endpoint.node_name {
        metadata.insert("node".to_owned(), json!(node));
    }
    if let Some(zone) = &endpoint.zone {
        metadata.insert("zone".to_owned(), json!(zone));
    }
    // The zones the EndpointSlice controller allocated the endpoint to; a service with
    // `locality` follows them as kube-proxy does when every endpoint has them (TRAFFIC.md §4).
    let for_zones: Vec<&str> = endpoint
        .hints
        .iter()
        .flat_map(|hints| hints.for_zones.iter().flatten())
        .map(|zone| zone.name.as_str())
        .filter(|name| !name.is_empty())
        .collect();
    if !for_zones.is_empty() {
        metadata.insert(ZONE_HINTS_KEY.to_owned(), json!(for_zones));
    }
    if readiness == Readiness::Terminating {
        metadata.insert("terminating".to_owned(), json!(true));
    }
    Endpoint {
        key: key.to_string(),
        host: key.ip().to_string(),
        port: key.port(),
        weight: wanted.weight,
        priority: wanted.priority,
        enabled: true,
        metadata: Value::Object(metadata),
    }
}

/// A slice's name, its identity within the Service.
pub(super) fn name_of(slice: &EndpointSlice) -> String {
    slice.metadata.name.clone().unwrap_or_default()
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(in crate::discovery::kubernetes) fn slice(
        name: &str,
        address_type: &str,
        ports: Value,
        endpoints: Value,
    ) -> EndpointSlice {
        serde_json::from_value(json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": "shop", "resourceVersion": "7"},
            "addressType": address_type,
            "ports": ports,
            "endpoints": endpoints,
        }))
        .expect("an EndpointSlice")
    }

    pub(in crate::discovery::kubernetes) fn endpoint(
        address: &str,
        ready: bool,
        serving: bool,
        terminating: bool,
    ) -> Value {
        json!({
            "addresses": [address],
            "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
            "nodeName": "node-1",
            "zone": "zone-a",
            "targetRef": {"kind": "Pod", "name": format!("web-{address}"), "namespace": "shop"},
        })
    }

    pub(in crate::discovery::kubernetes) fn http_port() -> Value {
        json!([{"name": "http", "port": 8080, "protocol": "TCP"}])
    }

    fn http() -> SlicePort {
        SlicePort::Named("http".to_owned())
    }

    fn wanted(port: SlicePort) -> Wanted {
        Wanted {
            port,
            weight: 100,
            priority: 0,
        }
    }

    fn set(slices: Vec<EndpointSlice>, port: SlicePort) -> Result<Discovered, String> {
        let slices = slices
            .into_iter()
            .map(|slice| (name_of(&slice), slice))
            .collect();
        endpoints_of(&slices, &wanted(port))
    }

    pub(in crate::discovery::kubernetes) fn keys(discovered: &Discovered) -> Vec<&str> {
        discovered
            .endpoints
            .iter()
            .map(|endpoint| endpoint.key.as_str())
            .collect()
    }

    #[test]
    fn ready_endpoints_are_the_set_with_pod_node_and_zone() {
        let discovered = set(
            vec![slice(
                "web-1",
                "IPv4",
                http_port(),
                json!([
                    endpoint("10.0.0.1", true, true, false),
                    endpoint("10.0.0.2", false, false, false),
                ]),
            )],
            http(),
        )
        .unwrap();
        assert_eq!(keys(&discovered), ["10.0.0.1:8080"]);
        let only = &discovered.endpoints[0];
        assert_eq!((only.host.as_str(), only.port), ("10.0.0.1", 8080));
        assert_eq!(
            only.metadata,
            json!({"pod": "web-10.0.0.1", "node": "node-1", "zone": "zone-a"})
        );
        assert_eq!(discovered.refused, None);
    }

    #[test]
    fn zone_hints_are_kept_in_metadata_only_when_given() {
        let mut hinted = endpoint("10.0.0.1", true, true, false);
        hinted["hints"] = json!({"forZones": [{"name": "zone-a"}, {"name": "zone-b"}]});
        let mut empty = endpoint("10.0.0.2", true, true, false);
        empty["hints"] = json!({"forZones": []});
        let bare = endpoint("10.0.0.3", true, true, false);
        let discovered = set(
            vec![slice(
                "web-1",
                "IPv4",
                http_port(),
                json!([hinted, empty, bare]),
            )],
            http(),
        )
        .unwrap();
        let hints: Vec<Option<&Value>> = discovered
            .endpoints
            .iter()
            .map(|endpoint| endpoint.metadata.get(ZONE_HINTS_KEY))
            .collect();
        assert_eq!(hints, [Some(&json!(["zone-a", "zone-b"])), None, None]);
    }

    #[test]
    fn terminating_endpoints_serve_only_while_none_is_ready() {
        let rolling = set(
            vec![slice(
                "web-1",
                "IPv4",
                http_port(),
                json!([
                    endpoint("10.0.0.1", true, true, false),
                    endpoint("10.0.0.2", false, true, true),
                ]),
            )],
            http(),
        )
        .unwrap();
        assert_eq!(keys(&rolling), ["10.0.0.1:8080"]);
        assert_eq!(
            rolling.departures,
            ["10.0.0.2:8080"],
            "terminating: an explicit departure the removal guard never holds"
        );
        let all_terminating = set(
            vec![slice(
                "web-1",
                "IPv4",
                http_port(),
                json!([
                    endpoint("10.0.0.1", false, true, true),
                    endpoint("10.0.0.2", false, true, true),
                    endpoint("10.0.0.3", false, false, true),
                ]),
            )],
            http(),
        )
        .unwrap();
        assert_eq!(keys(&all_terminating), ["10.0.0.1:8080", "10.0.0.2:8080"]);
        assert_eq!(
            all_terminating.departures,
            ["10.0.0.3:8080"],
            "neither ready nor serving"
        );
        assert_eq!(
            all_terminating.endpoints[0].metadata["terminating"],
            json!(true)
        );
    }

    #[test]
    fn missing_conditions_mean_ready() {
        let discovered = set(
            vec![slice(
                "web-1",
                "IPv4",
                http_port(),
                json!([{"addresses": ["10.0.0.9"]}]),
            )],
            http(),
        )
        .unwrap();
        assert_eq!(keys(&discovered), ["10.0.0.9:8080"]);
    }

    #[test]
    fn an_address_in_two_slices_is_one_endpoint_in_its_best_state() {
        let discovered = set(
            vec![
                slice(
                    "web-a",
                    "IPv4",
                    http_port(),
                    json!([endpoint("10.0.0.1", false, true, true)]),
                ),
                slice(
                    "web-b",
                    "IPv4",
                    http_port(),
                    json!([
                        endpoint("10.0.0.1", true, true, false),
                        endpoint("10.0.0.2", true, true, false)
                    ]),
                ),
            ],
            http(),
        )
        .unwrap();
        assert_eq!(keys(&discovered), ["10.0.0.1:8080", "10.0.0.2:8080"]);
        assert!(discovered.endpoints[0]
            .metadata
            .get("terminating")
            .is_none());
    }

    #[test]
    fn ipv6_slices_use_brackets_in_the_key() {
        let discovered = set(
            vec![
                slice(
                    "web-v4",
                    "IPv4",
                    http_port(),
                    json!([endpoint("10.0.0.1", true, true, false)]),
                ),
                slice(
                    "web-v6",
                    "IPv6",
                    http_port(),
                    json!([endpoint("fd00::1", true, true, false)]),
                ),
            ],
            http(),
        )
        .unwrap();
        assert_eq!(keys(&discovered), ["10.0.0.1:8080", "[fd00::1]:8080"]);
        assert_eq!(discovered.endpoints[1].host, "fd00::1");
    }

    #[test]
    fn a_named_port_picks_its_number_in_each_slice() {
        let ports = json!([
            {"name": "metrics", "port": 9090, "protocol": "TCP"},
            {"name": "http", "port": 8080, "protocol": "TCP"},
        ]);
        let moved = json!([{"name": "http", "port": 8081}, {"name": "metrics", "port": 9090}]);
        let slices = vec![
            slice(
                "web-a",
                "IPv4",
                ports,
                json!([endpoint("10.0.0.1", true, true, false)]),
            ),
            slice(
                "web-b",
                "IPv4",
                moved,
                json!([endpoint("10.0.0.2", true, true, false)]),
            ),
        ];
        let discovered = set(slices.clone(), http()).unwrap();
        assert_eq!(keys(&discovered), ["10.0.0.1:8080", "10.0.0.2:8081"]);
        let metrics = set(slices, SlicePort::Named("metrics".to_owned())).unwrap();
        assert_eq!(keys(&metrics), ["10.0.0.1:9090", "10.0.0.2:9090"]);
    }

    #[test]
    fn a_port_the_service_does_not_have_fails_the_refresh() {
        let slices = vec![slice(
            "web-a",
            "IPv4",
            http_port(),
            json!([endpoint("10.0.0.1", true, true, false)]),
        )];
        let error = set(slices.clone(), SlicePort::Named("grpc".to_owned())).unwrap_err();
        assert_eq!(
            error,
            "slice web-a: no port named \"grpc\" (its ports: http=8080/TCP)"
        );
        let error = set(slices, SlicePort::Named(String::new())).unwrap_err();
        assert!(error.contains("no port named \"\""), "{error}");
    }

    #[test]
    fn a_slice_without_the_port_is_refused_when_others_have_it() {
        let discovered = set(
            vec![
                slice(
                    "web-a",
                    "IPv4",
                    http_port(),
                    json!([endpoint("10.0.0.1", true, true, false)]),
                ),
                slice(
                    "web-b",
                    "IPv4",
                    json!([{"name": "admin", "port": 7000}]),
                    json!([endpoint("10.0.0.2", true, true, false)]),
                ),
            ],
            http(),
        )
        .unwrap();
        assert_eq!(keys(&discovered), ["10.0.0.1:8080"]);
        assert!(discovered
            .refused
            .unwrap()
            .contains("slice web-b: no port named"));
    }

    #[test]
    fn udp_ports_are_not_proxied_and_no_ports_take_the_configured_number() {
        let dns = json!([
            {"name": "dns", "port": 53, "protocol": "UDP"},
            {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
        ]);
        let slices = vec![slice(
            "dns-a",
            "IPv4",
            dns,
            json!([endpoint("10.0.0.5", true, true, false)]),
        )];
        assert_eq!(
            keys(&set(slices.clone(), SlicePort::Named("dns-tcp".to_owned())).unwrap()),
            ["10.0.0.5:53"]
        );
        let error = set(slices, SlicePort::Named("dns".to_owned())).unwrap_err();
        assert!(error.contains("is UDP"), "{error}");
        let headless = vec![slice(
            "db-a",
            "IPv4",
            json!([]),
            json!([endpoint("10.0.0.6", true, true, false)]),
        )];
        assert_eq!(
            keys(&set(headless, SlicePort::Any(5432)).unwrap()),
            ["10.0.0.6:5432"]
        );
        let numbered = vec![slice(
            "db-b",
            "IPv4",
            json!([{"name": "", "port": 5433}]),
            json!([endpoint("10.0.0.7", true, true, false)]),
        )];
        assert!(set(numbered, SlicePort::Any(5432))
            .unwrap_err()
            .contains("no TCP port 5432"));
    }

    #[test]
    fn fqdn_slices_and_an_empty_service_are_successful_sets() {
        let discovered = set(
            vec![slice(
                "ext",
                "FQDN",
                http_port(),
                json!([{"addresses": ["db.example.com"]}]),
            )],
            http(),
        )
        .unwrap();
        assert!(discovered.endpoints.is_empty());
        assert!(discovered.refused.unwrap().contains("addressType FQDN"));
        let empty = set(vec![], http()).unwrap();
        assert!(empty.endpoints.is_empty());
        assert_eq!(empty.refused, None);
    }

    #[test]
    fn the_same_slices_give_the_same_revision() {
        let make = || {
            set(
                vec![slice(
                    "web-a",
                    "IPv4",
                    http_port(),
                    json!([endpoint("10.0.0.1", true, true, false)]),
                )],
                http(),
            )
            .unwrap()
        };
        assert_eq!(make().revision, make().revision);
    }
}
