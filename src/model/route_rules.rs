//! What a route may say beyond hosts, a path and methods (TRAFFIC.md §3): request conditions,
//! weighted backends, and the filters applied on the way (Gateway API HTTPRoute names, in
//! snake_case).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::Id;

/// One condition on a request header, query parameter or cookie: exactly one of `value` (the
/// whole value, exactly), `regex` (matching the whole value) or `present`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Condition {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regex: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub present: Option<bool>,
}

/// What a condition tests, once validation has made sure exactly one was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConditionTest<'a> {
    Value(&'a str),
    Regex(&'a str),
    Present(bool),
}

impl Condition {
    pub fn test(&self) -> ConditionTest<'_> {
        match (&self.value, &self.regex, self.present) {
            (Some(value), _, _) => ConditionTest::Value(value),
            (None, Some(regex), _) => ConditionTest::Regex(regex),
            (None, None, present) => ConditionTest::Present(present.unwrap_or(true)),
        }
    }
}

/// One of the services a route sends to, with its share and the targets it may use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Backend {
    pub service_id: Id,
    /// Relative share of the route's requests; 0 sends none (kept for a later step).
    #[serde(default = "default_backend_weight")]
    pub weight: u32,
    /// Label pairs every chosen target must hold (`tag` matches one of `metadata.tags`);
    /// empty: every target of the service.
    #[serde(default)]
    pub subset: BTreeMap<String, String>,
}

pub const DEFAULT_BACKEND_WEIGHT: u32 = 1;
/// Largest backend weight, as in the Gateway API.
pub const MAX_BACKEND_WEIGHT: u32 = 1_000_000;

fn default_backend_weight() -> u32 {
    DEFAULT_BACKEND_WEIGHT
}

impl Backend {
    pub fn whole(service_id: Id) -> Backend {
        Backend {
            service_id,
            weight: DEFAULT_BACKEND_WEIGHT,
            subset: BTreeMap::new(),
        }
    }
}

/// Header changes; values may use `${client_ip}`, `${request_id}`, `${host}`, `${scheme}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HeaderFilter {
    /// Replaces every value of the header.
    #[serde(default)]
    pub set: BTreeMap<String, String>,
    /// Adds a value beside the ones already there.
    #[serde(default)]
    pub add: BTreeMap<String, String>,
    #[serde(default)]
    pub remove: Vec<String>,
}

impl HeaderFilter {
    pub fn is_empty(&self) -> bool {
        self.set.is_empty() && self.add.is_empty() && self.remove.is_empty()
    }
}

/// Answered by Raahi with a redirect; what is not given is kept from the request, and the
/// query string always is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Redirect {
    /// `http` or `https`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheme: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// The whole new path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Replaces the route's matched `path_prefix`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// 301, 302, 303, 307 or 308.
    #[serde(default = "default_redirect_status")]
    pub status: u16,
}

fn default_redirect_status() -> u16 {
    302
}

/// What goes upstream instead of what the client sent.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Rewrite {
    /// The `Host` sent; wins over `preserve_host` and the service's `upstream_authority`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// The whole path sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Replaces the route's matched `path_prefix`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
}

/// A copy of each request (or of `percent` of them) sent to another service, its answer dropped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Mirror {
    pub service_id: Id,
    #[serde(default = "default_mirror_percent")]
    pub percent: u8,
}

fn default_mirror_percent() -> u8 {
    100
}

/// Cross-origin resource sharing: preflights answered by Raahi, actual requests' answers given
/// the `Access-Control-*` headers when their origin is allowed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Cors {
    /// Exact origins (`https://app.example.com`), `https://*.example.com`, or `*`.
    #[serde(default)]
    pub allow_origins: Vec<String>,
    #[serde(default)]
    pub allow_methods: Vec<String>,
    #[serde(default)]
    pub allow_headers: Vec<String>,
    #[serde(default)]
    pub expose_headers: Vec<String>,
    #[serde(default)]
    pub allow_credentials: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_age_s: Option<u32>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RouteTimeouts {
    /// The whole exchange, retries included, until the response headers (504 `request_timeout`).
    #[serde(default)]
    pub request_ms: Option<u64>,
    /// One attempt, until its response headers (shorter than the service's own timeout wins).
    #[serde(default)]
    pub backend_request_ms: Option<u64>,
}

impl RouteTimeouts {
    pub fn is_empty(&self) -> bool {
        self.request_ms.is_none() && self.backend_request_ms.is_none()
    }
}

/// Compiled size a route's regex may reach; the `regex` crate matches in linear time, and this
/// bounds the memory a route's automaton takes in every snapshot.
pub const REGEX_SIZE_LIMIT: usize = 256 * 1024;

/// Compiles `pattern` to match a whole value (path, header, query or cookie value), as
/// validation checks it and the snapshot uses it.
pub fn whole_value_regex(pattern: &str) -> Result<regex::Regex, String> {
    regex::RegexBuilder::new(&format!("^(?:{pattern})$"))
        .size_limit(REGEX_SIZE_LIMIT)
        .build()
        .map_err(|error| match error {
            regex::Error::CompiledTooBig(_) => {
                format!("the regex compiles larger than {REGEX_SIZE_LIMIT} bytes")
            }
            other => other.to_string(),
        })
}

/// The variables a header value may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variable {
    ClientIp,
    RequestId,
    Host,
    Scheme,
}

/// A piece of a header value: text as written, or a variable filled per request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplatePart {
    Text(String),
    Variable(Variable),
}

/// Splits `value` into text and `${...}` variables; `$` not followed by `{` is text.
pub fn parse_template(value: &str) -> Result<Vec<TemplatePart>, String> {
    let mut parts = Vec::new();
    let mut rest = value;
    while let Some(start) = rest.find("${") {
        if start > 0 {
            parts.push(TemplatePart::Text(rest[..start].to_owned()));
        }
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("{value:?} opens ${{ without closing it"))?;
        let variable = match &after[..end] {
            "client_ip" => Variable::ClientIp,
            "request_id" => Variable::RequestId,
            "host" => Variable::Host,
            "scheme" => Variable::Scheme,
            other => {
                return Err(format!(
                    "unknown variable ${{{other}}}; known: ${{client_ip}}, ${{request_id}}, ${{host}}, ${{scheme}}"
                ))
            }
        };
        parts.push(TemplatePart::Variable(variable));
        rest = &after[end + 1..];
    }
    if !rest.is_empty() {
        parts.push(TemplatePart::Text(rest.to_owned()));
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_split_text_and_variables() {
        assert_eq!(
            parse_template("ip=${client_ip};id=${request_id}").unwrap(),
            vec![
                TemplatePart::Text("ip=".into()),
                TemplatePart::Variable(Variable::ClientIp),
                TemplatePart::Text(";id=".into()),
                TemplatePart::Variable(Variable::RequestId),
            ]
        );
        assert_eq!(
            parse_template("$5 ${host}").unwrap(),
            vec![
                TemplatePart::Text("$5 ".into()),
                TemplatePart::Variable(Variable::Host)
            ]
        );
        assert!(parse_template("${nope}").unwrap_err().contains("${nope}"));
        assert!(parse_template("${host").is_err());
    }
}

/// A route's request rate (TRAFFIC.md §6): GCRA per key, `burst` requests at once and
/// `requests_per_second` after; past it 429 `rate_limited`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    /// Requests admitted per second and key, in the long run (fractions allowed: 0.5 is one
    /// request every two seconds).
    pub requests_per_second: f64,
    /// Requests a key at rest may send at once; null: one second's worth
    /// (⌈`requests_per_second`⌉, at least 1).
    #[serde(default)]
    pub burst: Option<u32>,
    #[serde(default)]
    pub key: RateLimitKey,
    #[serde(default)]
    pub scope: RateLimitScope,
    /// Keys tracked at once; past it the idlest key is forgotten.
    #[serde(default = "default_rate_limit_max_keys")]
    pub max_keys: u32,
}

/// The keys tracked by default per rate-limited route.
pub const DEFAULT_RATE_LIMIT_MAX_KEYS: u32 = 100_000;

fn default_rate_limit_max_keys() -> u32 {
    DEFAULT_RATE_LIMIT_MAX_KEYS
}

impl RateLimit {
    /// Requests a key at rest may send at once.
    pub fn effective_burst(&self) -> u32 {
        self.burst
            .unwrap_or_else(|| self.requests_per_second.ceil().clamp(1.0, u32::MAX as f64) as u32)
    }
}

/// What one rate-limit allowance is kept for: each client address, each value of a header (a
/// request without the header is keyed by its client address), or the whole route.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum RateLimitKey {
    #[default]
    ClientIp,
    Header(String),
    Route,
}

/// `instance`: each gateway admits the whole rate; `cluster`: the gateways sharing a store
/// admit it together, each a share following its recent demand.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RateLimitScope {
    #[default]
    Instance,
    Cluster,
}
