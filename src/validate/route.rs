//! HTTP routes: hosts, one path form, methods, request conditions, backends and filters
//! (TRAFFIC.md §3). Accepted routes come back in one normal form: `backends` always listed
//! (`service_id` folded into them), `path_prefix` `/` when no path is given, names lower-cased.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::net::IpAddr;

use http::header::HeaderName;
use http::uri::Authority;

use super::{is_host_name, name, ValidationError, MAX_TIMEOUT_MS};
use crate::model::path::{self, EscapedSlashes};
use crate::model::{
    parse_template, whole_value_regex, Backend, Condition, ConditionTest, Cors, HeaderFilter,
    Mirror, Redirect, Rewrite, RouteSpec, RouteTimeouts, MAX_BACKEND_WEIGHT,
};

const MAX_HOSTS: usize = 100;
const MAX_METHODS: usize = 16;
const MAX_PATH_LEN: usize = 1024;
/// Most a route may buffer of one request body: larger bodies stream.
pub const MAX_REQUEST_BUFFER_BYTES: u64 = 64 * 1024 * 1024;
const MAX_UPGRADES: usize = 16;
const MAX_CONDITIONS: usize = 16;
const MAX_BACKENDS: usize = 16;
const MAX_SUBSET_LABELS: usize = 16;
const MAX_HEADER_CHANGES: usize = 32;
const MAX_TEXT_LEN: usize = 1024;
const MAX_CORS_ENTRIES: usize = 64;
const MAX_CORS_AGE_S: u32 = 86_400;

/// Headers a route's filters may not touch: Raahi frames messages and owns these.
const RESERVED_HEADERS: &[&str] = &[
    "connection",
    "content-length",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

pub fn route(mut spec: RouteSpec) -> Result<RouteSpec, ValidationError> {
    name("name", &spec.name)?;
    hosts(&mut spec.hosts)?;
    paths(&mut spec)?;
    methods(&mut spec.methods)?;
    conditions("headers", &mut spec.headers, header_name)?;
    conditions("query", &mut spec.query, query_name)?;
    conditions("cookies", &mut spec.cookies, cookie_name)?;
    backends(&mut spec)?;
    if spec.max_request_body_bytes == Some(0) {
        return Err(ValidationError::new(
            "max_request_body_bytes",
            "must be at least 1, or null for no limit",
        ));
    }
    if spec.request_buffer_bytes > MAX_REQUEST_BUFFER_BYTES {
        return Err(ValidationError::new(
            "request_buffer_bytes",
            format!("at most {MAX_REQUEST_BUFFER_BYTES} (larger bodies stream)"),
        ));
    }
    upgrades(&mut spec.upgrades)?;
    spec.request_headers = header_filter("request_headers", spec.request_headers.take(), true)?;
    spec.response_headers = header_filter("response_headers", spec.response_headers.take(), false)?;
    if let Some(redirect) = &mut spec.redirect {
        self::redirect(redirect, spec.path_prefix.is_some())?;
    }
    spec.rewrite = rewrite(spec.rewrite.take(), &spec)?;
    if let Some(mirror) = &spec.mirror {
        self::mirror(mirror)?;
    }
    if let Some(cors) = &mut spec.cors {
        self::cors(cors)?;
    }
    timeouts(&spec.timeouts)?;
    if let Some(retry) = &spec.retry {
        super::retry::retry(retry, spec.redirect.is_some())?;
    }
    if let Some(rate_limit) = &mut spec.rate_limit {
        super::limits::rate_limit(rate_limit)?;
    }
    super::limits::max_in_flight(spec.max_in_flight)?;
    if let Some(canary) = &spec.canary {
        super::canary::canary(canary, &spec.backends)?;
    }
    Ok(spec)
}

fn hosts(hosts: &mut Vec<String>) -> Result<(), ValidationError> {
    if hosts.len() > MAX_HOSTS {
        return Err(ValidationError::new(
            "hosts",
            format!("at most {MAX_HOSTS} hosts"),
        ));
    }
    for (index, host) in hosts.iter_mut().enumerate() {
        *host = host.to_ascii_lowercase();
        let plain = host.strip_prefix("*.").unwrap_or(host);
        if !is_host_name(plain) && plain.parse::<IpAddr>().is_err() {
            return Err(ValidationError::new(
                format!("hosts[{index}]"),
                format!("{host:?} is not a host name, an IP address or a *.suffix wildcard"),
            ));
        }
    }
    hosts.sort();
    hosts.dedup();
    Ok(())
}

/// One of the three path forms; prefixes and exact paths in the normal form requests are
/// matched in.
fn paths(spec: &mut RouteSpec) -> Result<(), ValidationError> {
    let given = [
        spec.path_prefix.is_some(),
        spec.path_exact.is_some(),
        spec.path_regex.is_some(),
    ];
    if given.iter().filter(|&&given| given).count() > 1 {
        let field = if spec.path_exact.is_some() && spec.path_prefix.is_some() {
            "path_exact"
        } else {
            "path_regex"
        };
        return Err(ValidationError::new(
            field,
            "give one of path_prefix, path_exact and path_regex",
        ));
    }
    if let Some(prefix) = &mut spec.path_prefix {
        normal_path("path_prefix", prefix)?;
    }
    if let Some(exact) = &mut spec.path_exact {
        normal_path("path_exact", exact)?;
    }
    if let Some(pattern) = &spec.path_regex {
        whole_regex("path_regex", pattern)?;
    }
    if given == [false; 3] {
        spec.path_prefix = Some("/".to_owned());
    }
    if spec.strip_prefix && spec.path_prefix.is_none() {
        return Err(ValidationError::new(
            "strip_prefix",
            "strip_prefix removes the path_prefix; this route has none",
        ));
    }
    Ok(())
}

/// A path as written in a route: absolute, no query or fragment, stored in its normal form. An
/// escaped slash is kept: whether requests may carry one is the listener's setting.
fn normal_path(field: &str, value: &mut String) -> Result<(), ValidationError> {
    if !value.starts_with('/')
        || value.len() > MAX_PATH_LEN
        || value
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '?' | '#'))
    {
        return Err(ValidationError::new(
            field,
            format!("{field} must start with '/' and contain no spaces, '?' or '#'"),
        ));
    }
    match path::normalize(value, EscapedSlashes::Keep) {
        Ok(Cow::Borrowed(_)) => Ok(()),
        Ok(Cow::Owned(normal)) => {
            *value = normal;
            Ok(())
        }
        Err(error) => Err(ValidationError::new(
            field,
            format!("{field} {}", error.reason()),
        )),
    }
}

/// Compiles `pattern` anchored to the whole value, as the snapshot will.
fn whole_regex(field: &str, pattern: &str) -> Result<(), ValidationError> {
    if pattern.len() > MAX_TEXT_LEN {
        return Err(ValidationError::new(
            field,
            format!("at most {MAX_TEXT_LEN} characters"),
        ));
    }
    whole_value_regex(pattern)
        .map(drop)
        .map_err(|reason| ValidationError::new(field, reason))
}

fn methods(methods: &mut Vec<String>) -> Result<(), ValidationError> {
    if methods.len() > MAX_METHODS {
        return Err(ValidationError::new(
            "methods",
            format!("at most {MAX_METHODS} methods"),
        ));
    }
    for (index, method) in methods.iter_mut().enumerate() {
        *method = method.to_ascii_uppercase();
        if method.is_empty() || !method.chars().all(|c| c.is_ascii_alphabetic()) {
            return Err(ValidationError::new(
                format!("methods[{index}]"),
                format!("{method:?} is not an HTTP method"),
            ));
        }
    }
    methods.sort();
    methods.dedup();
    Ok(())
}

fn conditions(
    field: &str,
    conditions: &mut [Condition],
    valid_name: fn(&str) -> Option<String>,
) -> Result<(), ValidationError> {
    if conditions.len() > MAX_CONDITIONS {
        return Err(ValidationError::new(
            field,
            format!("at most {MAX_CONDITIONS} conditions"),
        ));
    }
    for (index, condition) in conditions.iter_mut().enumerate() {
        let at = format!("{field}[{index}]");
        condition.name = valid_name(&condition.name).ok_or_else(|| {
            ValidationError::new(
                format!("{at}.name"),
                format!("{:?} is not a valid name here", condition.name),
            )
        })?;
        let given = [
            condition.value.is_some(),
            condition.regex.is_some(),
            condition.present.is_some(),
        ];
        if given.iter().filter(|&&given| given).count() != 1 {
            return Err(ValidationError::new(
                at,
                "give exactly one of value, regex and present",
            ));
        }
        match condition.test() {
            ConditionTest::Value(value) => {
                if value.len() > MAX_TEXT_LEN || value.chars().any(char::is_control) {
                    return Err(ValidationError::new(
                        format!("{at}.value"),
                        format!(
                            "at most {MAX_TEXT_LEN} characters, none of them control characters"
                        ),
                    ));
                }
            }
            ConditionTest::Regex(pattern) => {
                whole_regex(&format!("{at}.regex"), pattern)?;
            }
            ConditionTest::Present(_) => {}
        }
    }
    Ok(())
}

pub(super) fn header_name(value: &str) -> Option<String> {
    HeaderName::from_bytes(value.as_bytes())
        .ok()
        .map(|name| name.as_str().to_owned())
}

pub(super) fn query_name(value: &str) -> Option<String> {
    let valid = !value.is_empty()
        && value.len() <= 256
        && !value
            .chars()
            .any(|c| c.is_control() || c.is_whitespace() || matches!(c, '&' | '=' | '#'));
    valid.then(|| value.to_owned())
}

/// A cookie name is a token (RFC 6265 §4.1.1).
pub(super) fn cookie_name(value: &str) -> Option<String> {
    let valid = !value.is_empty()
        && value.len() <= 256
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
    valid.then(|| value.to_owned())
}

/// `service_id` folds into `backends`; a redirect route has neither.
fn backends(spec: &mut RouteSpec) -> Result<(), ValidationError> {
    if let Some(service_id) = spec.service_id.take() {
        if !spec.backends.is_empty() {
            return Err(ValidationError::new(
                "service_id",
                "give service_id (one backend) or backends, not both",
            ));
        }
        spec.backends.push(Backend::whole(service_id));
    }
    if spec.redirect.is_some() {
        if !spec.backends.is_empty() {
            return Err(ValidationError::new(
                "redirect",
                "a redirect is answered by Raahi: the route takes no service_id or backends",
            ));
        }
        return Ok(());
    }
    if spec.backends.is_empty() {
        return Err(ValidationError::new(
            "service_id",
            "a route needs service_id, backends or redirect",
        ));
    }
    if spec.backends.len() > MAX_BACKENDS {
        return Err(ValidationError::new(
            "backends",
            format!("at most {MAX_BACKENDS} backends"),
        ));
    }
    for (index, backend) in spec.backends.iter().enumerate() {
        let at = format!("backends[{index}]");
        if backend.weight > MAX_BACKEND_WEIGHT {
            return Err(ValidationError::new(
                format!("{at}.weight"),
                format!("at most {MAX_BACKEND_WEIGHT}"),
            ));
        }
        subset(&format!("{at}.subset"), &backend.subset)?;
    }
    if spec.backends.iter().all(|backend| backend.weight == 0) {
        return Err(ValidationError::new(
            "backends",
            "every weight is 0: at least one backend must take requests",
        ));
    }
    Ok(())
}

fn subset(field: &str, subset: &BTreeMap<String, String>) -> Result<(), ValidationError> {
    if subset.len() > MAX_SUBSET_LABELS {
        return Err(ValidationError::new(
            field,
            format!("at most {MAX_SUBSET_LABELS} labels"),
        ));
    }
    for (label, value) in subset {
        if label.is_empty() || label.len() > 256 || value.len() > MAX_TEXT_LEN {
            return Err(ValidationError::new(
                format!("{field}.{label}"),
                format!("labels are 1 to 256 characters, values at most {MAX_TEXT_LEN}"),
            ));
        }
    }
    Ok(())
}

fn upgrades(upgrades: &mut Vec<String>) -> Result<(), ValidationError> {
    if upgrades.len() > MAX_UPGRADES {
        return Err(ValidationError::new(
            "upgrades",
            format!("at most {MAX_UPGRADES} protocols"),
        ));
    }
    for (index, protocol) in upgrades.iter_mut().enumerate() {
        *protocol = protocol.to_ascii_lowercase();
        let is_token = !protocol.is_empty()
            && protocol.len() <= 64
            && protocol
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
        if !is_token {
            return Err(ValidationError::new(
                format!("upgrades[{index}]"),
                format!("{protocol:?} is not a protocol name such as \"websocket\""),
            ));
        }
        // HTTP/2 over a tunnelled upgrade would bypass every route rule (RFC 9113 §3.1).
        if protocol == "h2c" {
            return Err(ValidationError::new(
                format!("upgrades[{index}]"),
                "h2c is never passed: HTTP/2 goes to targets through Raahi, not through a tunnel",
            ));
        }
    }
    upgrades.sort();
    upgrades.dedup();
    Ok(())
}

/// Names lower-cased; values parsed as templates; an empty filter is none.
fn header_filter(
    field: &str,
    filter: Option<HeaderFilter>,
    request: bool,
) -> Result<Option<HeaderFilter>, ValidationError> {
    let Some(filter) = filter else {
        return Ok(None);
    };
    let changes = filter.set.len() + filter.add.len() + filter.remove.len();
    if changes > MAX_HEADER_CHANGES {
        return Err(ValidationError::new(
            field,
            format!("at most {MAX_HEADER_CHANGES} changes"),
        ));
    }
    let checked_name = |at: String, name: &str| -> Result<String, ValidationError> {
        let lowered = header_name(name).ok_or_else(|| {
            ValidationError::new(at.clone(), format!("{name:?} is not a header name"))
        })?;
        if RESERVED_HEADERS.contains(&lowered.as_str()) {
            return Err(ValidationError::new(
                at,
                format!("{lowered} frames the message and is Raahi's to set"),
            ));
        }
        if request && lowered == "host" {
            return Err(ValidationError::new(
                at,
                "the Host sent upstream is set with rewrite.hostname",
            ));
        }
        Ok(lowered)
    };
    let mut normal = HeaderFilter::default();
    for (kind, from, to) in [
        ("set", &filter.set, &mut normal.set),
        ("add", &filter.add, &mut normal.add),
    ] {
        for (name, value) in from {
            let at = format!("{field}.{kind}.{name}");
            let lowered = checked_name(at.clone(), name)?;
            header_value(&at, value)?;
            to.insert(lowered, value.clone());
        }
    }
    for (index, name) in filter.remove.iter().enumerate() {
        normal
            .remove
            .push(checked_name(format!("{field}.remove[{index}]"), name)?);
    }
    normal.remove.sort();
    normal.remove.dedup();
    Ok((!normal.is_empty()).then_some(normal))
}

fn header_value(field: &str, value: &str) -> Result<(), ValidationError> {
    if value.len() > MAX_TEXT_LEN || value.bytes().any(|b| (b < 0x20 && b != b'\t') || b == 0x7f) {
        return Err(ValidationError::new(
            field,
            format!("at most {MAX_TEXT_LEN} characters, none of them control characters"),
        ));
    }
    parse_template(value).map_err(|reason| ValidationError::new(field, reason))?;
    Ok(())
}

fn redirect(redirect: &mut Redirect, has_prefix: bool) -> Result<(), ValidationError> {
    if let Some(scheme) = &mut redirect.scheme {
        *scheme = scheme.to_ascii_lowercase();
        if scheme != "http" && scheme != "https" {
            return Err(ValidationError::new("redirect.scheme", "http or https"));
        }
    }
    if let Some(hostname) = &mut redirect.hostname {
        *hostname = hostname.to_ascii_lowercase();
        if !is_host_name(hostname) && hostname.parse::<IpAddr>().is_err() {
            return Err(ValidationError::new(
                "redirect.hostname",
                format!("{hostname:?} is not a host name or an IP address"),
            ));
        }
    }
    if redirect.port == Some(0) {
        return Err(ValidationError::new("redirect.port", "1 to 65535"));
    }
    new_path(
        "redirect",
        &mut redirect.path,
        &mut redirect.prefix,
        has_prefix,
    )?;
    if ![301, 302, 303, 307, 308].contains(&redirect.status) {
        return Err(ValidationError::new(
            "redirect.status",
            "301, 302, 303, 307 or 308",
        ));
    }
    let changes_something = redirect.scheme.is_some()
        || redirect.hostname.is_some()
        || redirect.port.is_some()
        || redirect.path.is_some()
        || redirect.prefix.is_some();
    if !changes_something {
        return Err(ValidationError::new(
            "redirect",
            "a redirect to the same URL would loop: give scheme, hostname, port, path or prefix",
        ));
    }
    Ok(())
}

/// `path` or `prefix` (which replaces the route's `path_prefix`), not both.
fn new_path(
    field: &str,
    path: &mut Option<String>,
    prefix: &mut Option<String>,
    has_prefix: bool,
) -> Result<(), ValidationError> {
    if path.is_some() && prefix.is_some() {
        return Err(ValidationError::new(
            format!("{field}.prefix"),
            "give path or prefix, not both",
        ));
    }
    if let Some(path) = path {
        normal_path(&format!("{field}.path"), path)?;
    }
    if let Some(prefix) = prefix {
        if !has_prefix {
            return Err(ValidationError::new(
                format!("{field}.prefix"),
                "prefix replaces the route's path_prefix; this route has none (use path)",
            ));
        }
        normal_path(&format!("{field}.prefix"), prefix)?;
    }
    Ok(())
}

fn rewrite(rewrite: Option<Rewrite>, spec: &RouteSpec) -> Result<Option<Rewrite>, ValidationError> {
    let Some(mut rewrite) = rewrite else {
        return Ok(None);
    };
    if let Some(hostname) = &mut rewrite.hostname {
        *hostname = hostname.to_ascii_lowercase();
        if hostname.parse::<Authority>().is_err() || hostname.contains('@') {
            return Err(ValidationError::new(
                "rewrite.hostname",
                format!("{hostname:?} is not a host name (with an optional :port)"),
            ));
        }
    }
    new_path(
        "rewrite",
        &mut rewrite.path,
        &mut rewrite.prefix,
        spec.path_prefix.is_some(),
    )?;
    if spec.strip_prefix && (rewrite.path.is_some() || rewrite.prefix.is_some()) {
        return Err(ValidationError::new(
            "strip_prefix",
            "rewrite sets the path sent upstream; strip_prefix would contradict it",
        ));
    }
    let empty = rewrite.hostname.is_none() && rewrite.path.is_none() && rewrite.prefix.is_none();
    Ok((!empty).then_some(rewrite))
}

fn mirror(mirror: &Mirror) -> Result<(), ValidationError> {
    if mirror.percent > 100 {
        return Err(ValidationError::new("mirror.percent", "0 to 100"));
    }
    Ok(())
}

fn cors(cors: &mut Cors) -> Result<(), ValidationError> {
    for (field, list) in [
        ("cors.allow_origins", &cors.allow_origins),
        ("cors.allow_methods", &cors.allow_methods),
        ("cors.allow_headers", &cors.allow_headers),
        ("cors.expose_headers", &cors.expose_headers),
    ] {
        if list.len() > MAX_CORS_ENTRIES {
            return Err(ValidationError::new(
                field,
                format!("at most {MAX_CORS_ENTRIES} entries"),
            ));
        }
    }
    if cors.allow_origins.is_empty() {
        return Err(ValidationError::new(
            "cors.allow_origins",
            "name the origins allowed (or \"*\")",
        ));
    }
    for (index, origin) in cors.allow_origins.iter_mut().enumerate() {
        *origin = origin.to_ascii_lowercase();
        if !is_origin_pattern(origin) {
            return Err(ValidationError::new(
                format!("cors.allow_origins[{index}]"),
                format!("{origin:?} is not \"*\", an origin (https://app.example.com) or https://*.example.com"),
            ));
        }
        if origin == "*" && cors.allow_credentials {
            return Err(ValidationError::new(
                format!("cors.allow_origins[{index}]"),
                "browsers refuse credentials with the origin \"*\": name the origins",
            ));
        }
    }
    for (index, method) in cors.allow_methods.iter_mut().enumerate() {
        *method = method.to_ascii_uppercase();
        let valid = method == "*"
            || (!method.is_empty() && method.chars().all(|c| c.is_ascii_alphabetic()));
        if !valid {
            return Err(ValidationError::new(
                format!("cors.allow_methods[{index}]"),
                format!("{method:?} is not an HTTP method"),
            ));
        }
    }
    for (field, list) in [
        ("cors.allow_headers", &mut cors.allow_headers),
        ("cors.expose_headers", &mut cors.expose_headers),
    ] {
        for (index, name) in list.iter_mut().enumerate() {
            if name == "*" {
                continue;
            }
            *name = header_name(name).ok_or_else(|| {
                ValidationError::new(
                    format!("{field}[{index}]"),
                    format!("{name:?} is not a header name"),
                )
            })?;
        }
    }
    if cors.max_age_s.is_some_and(|age| age > MAX_CORS_AGE_S) {
        return Err(ValidationError::new(
            "cors.max_age_s",
            format!("at most {MAX_CORS_AGE_S}"),
        ));
    }
    Ok(())
}

/// `*`, `scheme://host[:port]`, or `scheme://*.suffix[:port]`.
fn is_origin_pattern(origin: &str) -> bool {
    if origin == "*" {
        return true;
    }
    let Some((scheme, rest)) = origin.split_once("://") else {
        return false;
    };
    let scheme_ok = !scheme.is_empty()
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    let authority = rest.strip_prefix("*.").unwrap_or(rest);
    let host = match authority.rsplit_once(':') {
        Some((host, port)) if !host.ends_with(']') || authority.starts_with('[') => {
            if port.parse::<u16>().is_err() {
                return false;
            }
            host
        }
        _ => authority,
    };
    scheme_ok && (is_host_name(host) || host.trim_matches(['[', ']']).parse::<IpAddr>().is_ok())
}

fn timeouts(timeouts: &RouteTimeouts) -> Result<(), ValidationError> {
    for (field, value) in [
        ("timeouts.request_ms", timeouts.request_ms),
        ("timeouts.backend_request_ms", timeouts.backend_request_ms),
    ] {
        if value.is_some_and(|ms| ms == 0 || ms > MAX_TIMEOUT_MS) {
            return Err(ValidationError::new(
                field,
                format!("1 to {MAX_TIMEOUT_MS} ms, or null"),
            ));
        }
    }
    if let (Some(request), Some(backend)) = (timeouts.request_ms, timeouts.backend_request_ms) {
        if backend > request {
            return Err(ValidationError::new(
                "timeouts.backend_request_ms",
                "longer than timeouts.request_ms, which bounds every attempt",
            ));
        }
    }
    Ok(())
}
