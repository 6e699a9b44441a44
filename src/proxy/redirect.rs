//! A route's `redirect` (TRAFFIC.md §3), answered by Raahi: what the redirect does not name is
//! kept from the request, and the query string always is.

use bytes::Bytes;
use http::header::LOCATION;
use http::{HeaderValue, Response, StatusCode, Uri};
use http_body_util::Full;

use crate::model::{Redirect, Route};

/// The request as the redirect sees it.
pub struct Requested<'a> {
    pub uri: &'a Uri,
    /// The host the client asked for, lower case, without port.
    pub host: &'a str,
    /// The port the client named in its Host (or authority), if any.
    pub port: Option<u16>,
    pub over_tls: bool,
}

pub fn answer(
    redirect: &Redirect,
    route: &Route,
    requested: &Requested<'_>,
) -> Response<Full<Bytes>> {
    let location = location(redirect, route, requested);
    let mut response = Response::new(Full::default());
    *response.status_mut() = StatusCode::from_u16(redirect.status).unwrap_or(StatusCode::FOUND);
    match HeaderValue::from_str(&location) {
        Ok(value) => {
            response.headers_mut().insert(LOCATION, value);
        }
        // Every piece came from a valid request or a validated route.
        Err(_) => *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR,
    }
    response
}

fn location(redirect: &Redirect, route: &Route, requested: &Requested<'_>) -> String {
    let request_scheme = if requested.over_tls { "https" } else { "http" };
    let scheme = redirect.scheme.as_deref().unwrap_or(request_scheme);
    let host = redirect.hostname.as_deref().unwrap_or(requested.host);
    // A new scheme means its own default port unless one is named; the same scheme keeps the
    // port the client used.
    let port = redirect.port.or(if redirect.scheme.is_some() {
        None
    } else {
        requested.port
    });
    let default_port = if scheme == "https" { 443 } else { 80 };
    let path = requested.uri.path();
    let new_path = match (&redirect.path, &redirect.prefix, &route.path_prefix) {
        (Some(whole), _, _) => whole.clone(),
        (None, Some(replacement), Some(matched)) => replace_prefix(path, matched, replacement),
        _ => path.to_owned(),
    };
    let mut location = format!("{scheme}://");
    if host.contains(':') {
        location.push_str(&format!("[{host}]"));
    } else {
        location.push_str(host);
    }
    if let Some(port) = port.filter(|&port| port != default_port) {
        location.push_str(&format!(":{port}"));
    }
    location.push_str(&new_path);
    if let Some(query) = requested.uri.query() {
        location.push('?');
        location.push_str(query);
    }
    location
}

/// `path` with the route's matched `prefix` replaced: `/api/v1/x` under `/api` replaced by
/// `/v2` is `/v2/v1/x`; replaced by `/`, `/v1/x`.
pub fn replace_prefix(path: &str, prefix: &str, replacement: &str) -> String {
    let rest = path.get(prefix.trim_end_matches('/').len()..).unwrap_or("");
    if rest.is_empty() {
        return replacement.to_owned();
    }
    let joined = format!("{}{rest}", replacement.trim_end_matches('/'));
    if joined.starts_with('/') {
        joined
    } else {
        format!("/{joined}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_replaced_on_segments() {
        assert_eq!(replace_prefix("/api/v1/x", "/api", "/v2"), "/v2/v1/x");
        assert_eq!(replace_prefix("/api/v1/x", "/api/", "/"), "/v1/x");
        assert_eq!(replace_prefix("/api", "/api", "/new"), "/new");
        assert_eq!(replace_prefix("/api/", "/api", "/new"), "/new/");
    }
}
