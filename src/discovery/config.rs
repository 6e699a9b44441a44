//! What every provider config shares: the shared keys and their ranges, validation into a
//! normalised form with every default filled in, the JSON Schema and defaults the admin API
//! lists, and the checks several providers use (DNS names, resolvers, URLs).
//!
//! Validation is serde (types, unknown and missing keys) followed by explicit range and format
//! checks, so one code path serves `validate`, `build` and the error messages an operator reads.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use schemars::generate::SchemaSettings;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::discovery::{ConfigError, Schedule};
use crate::model::{DEFAULT_WEIGHT, MAX_WEIGHT};

pub const DEFAULT_INTERVAL_MS: u64 = 30_000;
pub const DEFAULT_TIMEOUT_MS: u64 = 5_000;

const INTERVAL_RANGE: (u64, u64) = (100, 86_400_000);
const TIMEOUT_RANGE: (u64, u64) = (10, 600_000);
const PORT_RANGE: (u32, u32) = (1, 65_535);

pub(crate) fn default_interval_ms() -> u64 {
    DEFAULT_INTERVAL_MS
}
pub(crate) fn default_timeout_ms() -> u64 {
    DEFAULT_TIMEOUT_MS
}
pub(crate) fn default_weight() -> u32 {
    DEFAULT_WEIGHT
}
pub(crate) fn default_true() -> bool {
    true
}

/// Preferred factor from a registry's weights (SRV, Consul: 0 to 65535, 1 the common default)
/// to target weights, so that a registry's 1 is a target's default of 100.
const REGISTRY_WEIGHT_SCALE: u32 = 100;

/// The factor for one endpoint set whose largest registry weight is `largest`: 100 when that
/// fits, else the largest integer that keeps `largest × factor` within [`MAX_WEIGHT`] (1 at
/// worst, as no registry weight exceeds it). One integer factor for the whole set keeps every
/// proportion exact; a per-weight cap would flatten all large weights to the same value.
pub(crate) fn registry_weight_scale(largest: u32) -> u32 {
    (MAX_WEIGHT / largest.clamp(1, MAX_WEIGHT)).min(REGISTRY_WEIGHT_SCALE)
}

/// The keys every provider shares, read uniformly for checks and the schedule.
pub(crate) struct SharedKeys {
    /// None for watch providers: they have no schedule.
    pub interval_ms: Option<u64>,
    pub timeout_ms: u64,
    pub weight: u32,
    pub port: Option<u32>,
}

/// A provider config: its own checks beyond what serde enforces, and its shared keys.
pub(crate) trait ProviderConfig: DeserializeOwned + Serialize + JsonSchema {
    fn shared(&self) -> SharedKeys;
    fn check(&self) -> Result<(), ConfigError>;
    /// Rewrites accepted shorthands into their full form (after `check` passed).
    fn normalise(&mut self) {}
}

/// A provider's `validate`: the config parsed, checked and written back with every default.
pub(crate) fn validate_as<T: ProviderConfig>(config: &Value) -> Result<Value, ConfigError> {
    let parsed = parse::<T>(config)?;
    serde_json::to_value(&parsed).map_err(|err| error("", err.to_string()))
}

/// A provider's JSON Schema, generated from its config type.
pub(crate) fn schema_of<T: JsonSchema>() -> Value {
    SchemaSettings::draft2020_12()
        .with(|settings| settings.inline_subschemas = true)
        .into_generator()
        .into_root_schema_for::<T>()
        .to_value()
}

/// The refresh budget inside a provider: a little under `timeout_ms`, so a provider reports its
/// own precise error (which server, which record) before the caller's outer timeout fires.
pub(crate) fn inner_budget(timeout: Duration) -> Duration {
    timeout.mul_f64(0.9)
}

/// Parses `resolver` ("ip:port", or a bare IP meaning port 53) from a config that passed `check`.
pub(crate) fn resolver_address(resolver: Option<&str>) -> Option<SocketAddr> {
    let text = resolver?;
    text.parse::<SocketAddr>().ok().or_else(|| {
        text.parse::<IpAddr>()
            .ok()
            .map(|ip| SocketAddr::new(ip, 53))
    })
}

/// The defaults are read back from the schema, so the two can never disagree.
pub(crate) fn defaults_in(schema: &Value) -> Value {
    let defaults = schema
        .get("properties")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .filter_map(|(key, property)| Some((key.clone(), property.get("default")?.clone())))
        .collect();
    Value::Object(defaults)
}

/// A poll provider's schedule (a watch provider has no interval: it falls back to the default).
pub(crate) fn schedule_of(config: &impl ProviderConfig) -> Schedule {
    let shared = config.shared();
    Schedule {
        interval: Duration::from_millis(shared.interval_ms.unwrap_or(DEFAULT_INTERVAL_MS)),
        timeout: Duration::from_millis(shared.timeout_ms),
    }
}

/// Deserialises and checks a config; every failure names the offending key.
pub(crate) fn parse<T: ProviderConfig>(config: &Value) -> Result<T, ConfigError> {
    if !config.is_object() {
        return Err(error("", "the config must be a JSON object"));
    }
    let mut parsed: T = serde_path_to_error::deserialize(config).map_err(serde_error)?;
    check_shared(&parsed.shared())?;
    parsed.check()?;
    parsed.normalise();
    Ok(parsed)
}

fn check_shared(shared: &SharedKeys) -> Result<(), ConfigError> {
    if let Some(interval_ms) = shared.interval_ms {
        check_range("interval_ms", interval_ms, INTERVAL_RANGE)?;
    }
    check_range("timeout_ms", shared.timeout_ms, TIMEOUT_RANGE)?;
    check_range("weight", shared.weight, (0, MAX_WEIGHT))?;
    if let Some(port) = shared.port {
        check_range("port", port, PORT_RANGE)?;
    }
    Ok(())
}

pub(crate) fn check_range<N: PartialOrd + std::fmt::Display>(
    field: &str,
    value: N,
    (min, max): (N, N),
) -> Result<(), ConfigError> {
    if value < min || value > max {
        return Err(error(
            field,
            format!("must be between {min} and {max}, got {value}"),
        ));
    }
    Ok(())
}

/// Host names as resolvers accept them: dot-separated labels of letters, digits, `-` and `_`
/// (service labels and some container names use `_`), an optional trailing dot for "absolute".
pub(crate) fn check_dns_name(field: &str, name: &str) -> Result<(), ConfigError> {
    let relative = name.strip_suffix('.').unwrap_or(name);
    if relative.is_empty() {
        return Err(error(field, "must not be empty"));
    }
    if relative.parse::<IpAddr>().is_ok() {
        return Err(error(
            field,
            "is an IP address, not a DNS name; add the address as a target instead",
        ));
    }
    if relative.len() > 253 {
        return Err(error(field, "is longer than 253 characters"));
    }
    for label in relative.split('.') {
        let valid = (1..=63).contains(&label.len())
            && label
                .bytes()
                .all(|byte| byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_')
            && !label.starts_with('-')
            && !label.ends_with('-');
        if !valid {
            return Err(error(
                field,
                format!(
                    "is not a valid DNS name: label {label:?} must be 1 to 63 letters, digits, \
                     '-' or '_', not starting or ending with '-'"
                ),
            ));
        }
    }
    Ok(())
}

/// A bare resolver IP gets the DNS port written out, so the stored config says what is used.
pub(crate) fn normalised_resolver(resolver: Option<&str>) -> Option<String> {
    resolver_address(resolver).map(|address| address.to_string())
}

pub(crate) fn check_resolver(resolver: Option<&str>) -> Result<(), ConfigError> {
    let Some(text) = resolver else {
        return Ok(());
    };
    match resolver_address(Some(text)) {
        Some(address) if address.port() != 0 => Ok(()),
        _ => Err(error(
            "resolver",
            format!(
                "must be an IP address and port such as 10.0.0.2:53 or [fd00::2]:53, got {text:?}"
            ),
        )),
    }
}

pub(crate) fn check_url(field: &str, url: &str) -> Result<(), ConfigError> {
    let parsed = reqwest::Url::parse(url)
        .map_err(|err| error(field, format!("is not a valid URL: {err}")))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(error(
            field,
            format!("must use http or https, not {:?}", parsed.scheme()),
        ));
    }
    if parsed.host_str().unwrap_or_default().is_empty() {
        return Err(error(field, "must name a host"));
    }
    Ok(())
}

/// serde reports a missing key at its parent; the operator wants the key itself. (An unknown
/// key's path already ends with it.)
fn serde_error(err: serde_path_to_error::Error<serde_json::Error>) -> ConfigError {
    let message = err.inner().to_string();
    let mut field = render_path(err.path());
    let last_key = match err.path().iter().next_back() {
        Some(serde_path_to_error::Segment::Map { key }) => Some(key.as_str()),
        _ => None,
    };
    if let Some(key) = named_key(&message).filter(|key| Some(*key) != last_key) {
        if !field.is_empty() {
            field.push('.');
        }
        field.push_str(key);
    }
    ConfigError { field, message }
}

fn named_key(message: &str) -> Option<&str> {
    let rest = message
        .strip_prefix("unknown field `")
        .or_else(|| message.strip_prefix("missing field `"))?;
    rest.split('`').next()
}

/// `headers.X-Api-Key`, `record_types[1]`: dots between keys, brackets for indexes.
pub(crate) fn render_path(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut rendered = String::new();
    for segment in path.iter() {
        match segment {
            Segment::Seq { index } => rendered.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if !rendered.is_empty() {
                    rendered.push('.');
                }
                rendered.push_str(key);
            }
            Segment::Unknown => {
                if !rendered.is_empty() {
                    rendered.push('.');
                }
                rendered.push('?');
            }
        }
    }
    rendered
}

pub(crate) fn error(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        message: message.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::{build, descriptors, validate, Fetch};
    use crate::model::ProviderKind;
    use serde_json::json;

    fn field_of(kind: ProviderKind, config: Value) -> String {
        validate(kind, &config)
            .expect_err("config should be rejected")
            .field
    }

    #[test]
    fn validate_fills_defaults() {
        let dns = validate(
            ProviderKind::Dns,
            &json!({"hostname": "api.internal", "port": 80}),
        )
        .unwrap();
        assert_eq!(
            dns,
            json!({
                "hostname": "api.internal", "port": 80, "record_types": ["a", "aaaa"],
                "interval_ms": 30000, "timeout_ms": 5000, "weight": 100, "priority": 0
            })
        );
        let srv = validate(
            ProviderKind::DnsSrv,
            &json!({"service_name": "_http._tcp.api.internal"}),
        )
        .unwrap();
        assert_eq!(srv["use_record_weight"], json!(true));
        assert_eq!(srv["use_record_priority"], json!(true));
        assert_eq!(srv["interval_ms"], json!(DEFAULT_INTERVAL_MS));
        let http = validate(
            ProviderKind::Http,
            &json!({"url": "http://10.0.0.1/registry"}),
        )
        .unwrap();
        assert_eq!(http["headers"], json!({}));
        assert_eq!(http["tls_verify"], json!(true));
        assert_eq!(http["timeout_ms"], json!(DEFAULT_TIMEOUT_MS));
        // Normalising is idempotent: what validate returns validates to itself.
        assert_eq!(validate(ProviderKind::Http, &http).unwrap(), http);
    }

    #[test]
    fn dns_without_port_names_port() {
        let err = validate(ProviderKind::Dns, &json!({"hostname": "api.internal"})).unwrap_err();
        assert_eq!(err.field, "port");
        assert!(err.message.contains("missing field"), "{}", err.message);
    }

    #[test]
    fn unknown_key_is_named() {
        let err = validate(
            ProviderKind::Dns,
            &json!({"hostname": "api.internal", "port": 80, "hostnme": "x"}),
        )
        .unwrap_err();
        assert_eq!(err.field, "hostnme");
        assert!(err.message.contains("unknown field"), "{}", err.message);
    }

    #[test]
    fn bad_values_name_their_path() {
        let base = |extra: Value| {
            let mut config = json!({"hostname": "api.internal", "port": 80});
            config
                .as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            config
        };
        assert_eq!(
            field_of(
                ProviderKind::Dns,
                base(json!({"resolver": "dns.example:53"}))
            ),
            "resolver"
        );
        assert_eq!(
            field_of(ProviderKind::Dns, base(json!({"resolver": "10.0.0.1:0"}))),
            "resolver"
        );
        assert_eq!(
            field_of(
                ProviderKind::Dns,
                base(json!({"record_types": ["a", "mx"]}))
            ),
            "record_types[1]"
        );
        assert_eq!(
            field_of(ProviderKind::Dns, base(json!({"record_types": []}))),
            "record_types"
        );
        assert_eq!(
            field_of(ProviderKind::Dns, base(json!({"record_types": ["a", "a"]}))),
            "record_types[1]"
        );
        assert_eq!(
            field_of(ProviderKind::Dns, base(json!({"port": 0}))),
            "port"
        );
        assert_eq!(
            field_of(ProviderKind::Dns, base(json!({"port": 70000}))),
            "port"
        );
        assert_eq!(
            field_of(ProviderKind::Dns, base(json!({"interval_ms": 50}))),
            "interval_ms"
        );
        assert_eq!(
            field_of(ProviderKind::Dns, base(json!({"timeout_ms": 600_001}))),
            "timeout_ms"
        );
        assert_eq!(
            field_of(ProviderKind::Dns, base(json!({"weight": 65_536}))),
            "weight"
        );
        assert_eq!(
            field_of(ProviderKind::Dns, base(json!({"hostname": "bad..name"}))),
            "hostname"
        );
        assert_eq!(
            field_of(ProviderKind::Dns, base(json!({"hostname": "-x.internal"}))),
            "hostname"
        );
        assert_eq!(
            field_of(ProviderKind::Dns, base(json!({"hostname": "10.0.0.1"}))),
            "hostname"
        );
        assert_eq!(field_of(ProviderKind::DnsSrv, json!({})), "service_name");
        assert_eq!(
            field_of(
                ProviderKind::Http,
                json!({"url": "http://10.0.0.1/", "headers": {"X Bad": "1"}})
            ),
            "headers.X Bad"
        );
        assert_eq!(
            field_of(
                ProviderKind::Http,
                json!({"url": "http://10.0.0.1/", "headers": {"X-Bad": "a\nb"}})
            ),
            "headers.X-Bad"
        );
        assert_eq!(
            field_of(
                ProviderKind::Http,
                json!({"url": "http://10.0.0.1/", "endpoints_path": "data..items"})
            ),
            "endpoints_path"
        );
        assert_eq!(
            field_of(
                ProviderKind::Http,
                json!({"url": "http://10.0.0.1/", "port": 0})
            ),
            "port"
        );
        assert_eq!(
            field_of(ProviderKind::Http, json!(["not", "an", "object"])),
            ""
        );
    }

    #[test]
    fn resolver_accepts_ip_with_or_without_port() {
        for (resolver, normalised) in [
            ("10.0.0.2:53", "10.0.0.2:53"),
            ("[fd00::2]:5353", "[fd00::2]:5353"),
            ("10.0.0.2", "10.0.0.2:53"),
            ("fd00::2", "[fd00::2]:53"),
        ] {
            let config = json!({"hostname": "api.internal", "port": 80, "resolver": resolver});
            let valid = validate(ProviderKind::Dns, &config).unwrap();
            assert_eq!(valid["resolver"], json!(normalised));
        }
        assert_eq!(
            resolver_address(Some("10.0.0.2")),
            Some("10.0.0.2:53".parse().unwrap())
        );
    }

    #[test]
    fn url_must_be_http_or_https() {
        let err = validate(ProviderKind::Http, &json!({"url": "ftp://10.0.0.1/x"})).unwrap_err();
        assert_eq!(err.field, "url");
        assert!(err.message.contains("http or https"), "{}", err.message);
        assert_eq!(
            field_of(ProviderKind::Http, json!({"url": "not a url"})),
            "url"
        );
        validate(
            ProviderKind::Http,
            &json!({"url": "https://registry.internal/v1/endpoints"}),
        )
        .unwrap();
    }

    #[test]
    fn build_gives_the_schedule() {
        let config =
            json!({"hostname": "api.internal", "port": 80, "interval_ms": 1000, "timeout_ms": 200});
        let Ok(Fetch::Poll { schedule, .. }) = build(ProviderKind::Dns, &config) else {
            panic!("dns is a poll provider");
        };
        assert_eq!(
            schedule,
            Schedule {
                interval: Duration::from_millis(1000),
                timeout: Duration::from_millis(200)
            }
        );
        assert_eq!(
            build(ProviderKind::Http, &json!({"url": "gopher://x/"}))
                .err()
                .unwrap()
                .field,
            "url"
        );
    }

    #[test]
    fn descriptors_list_every_provider_with_schema_and_defaults() {
        let descriptors = descriptors();
        let names: Vec<&str> = descriptors.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["dns", "dns-srv", "http", "consul", "kubernetes"]);
        for (descriptor, required) in descriptors.iter().zip(["hostname", "service_name", "url"]) {
            let schema = &descriptor.config_schema;
            assert!(
                schema["properties"][required].is_object(),
                "{}: {schema}",
                descriptor.name
            );
            assert!(
                schema["required"]
                    .as_array()
                    .unwrap()
                    .contains(&json!(required)),
                "{}: {schema}",
                descriptor.name
            );
            assert_eq!(schema["additionalProperties"], json!(false));
            assert_eq!(
                descriptor.defaults["interval_ms"],
                json!(DEFAULT_INTERVAL_MS)
            );
            assert_eq!(descriptor.defaults["timeout_ms"], json!(DEFAULT_TIMEOUT_MS));
            assert_eq!(descriptor.defaults["weight"], json!(100));
            assert!(!descriptor.description.is_empty());
        }
        assert_eq!(
            descriptors[0].defaults["record_types"],
            json!(["a", "aaaa"])
        );
        assert_eq!(
            descriptors[0].config_schema["properties"]["port"]["maximum"],
            json!(65535)
        );
        assert_eq!(descriptors[2].defaults["tls_verify"], json!(true));
    }
}
