//! A route's `cors` (TRAFFIC.md §3): preflights answered by Raahi and never forwarded; the
//! answers to allowed origins' actual requests given the `Access-Control-*` fields. An origin
//! not allowed gets no `Access-Control-Allow-*` field, which is how a browser is told no.

use bytes::Bytes;
use http::header::{
    ACCESS_CONTROL_ALLOW_CREDENTIALS, ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS,
    ACCESS_CONTROL_ALLOW_ORIGIN, ACCESS_CONTROL_EXPOSE_HEADERS, ACCESS_CONTROL_MAX_AGE,
    ACCESS_CONTROL_REQUEST_HEADERS, ACCESS_CONTROL_REQUEST_METHOD, ORIGIN, VARY,
};
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode};
use http_body_util::Full;

use crate::model::Cors;

/// A CORS preflight: `OPTIONS` with `Origin` and `Access-Control-Request-Method`.
pub fn is_preflight(method: &Method, headers: &HeaderMap) -> bool {
    method == Method::OPTIONS
        && headers.contains_key(ORIGIN)
        && headers.contains_key(ACCESS_CONTROL_REQUEST_METHOD)
}

/// The method a preflight asks about, which routes are matched with.
pub fn requested_method(headers: &HeaderMap) -> Option<Method> {
    Method::from_bytes(headers.get(ACCESS_CONTROL_REQUEST_METHOD)?.as_bytes()).ok()
}

/// Raahi's answer to a preflight: 204, with the permissions when the origin is allowed.
pub fn preflight(cors: &Cors, request: &HeaderMap) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::default());
    *response.status_mut() = StatusCode::NO_CONTENT;
    let headers = response.headers_mut();
    headers.append(VARY, HeaderValue::from_static("origin"));
    let Some(allowed) = request
        .get(ORIGIN)
        .and_then(|origin| allowed_origin(cors, origin))
    else {
        return response;
    };
    headers.insert(ACCESS_CONTROL_ALLOW_ORIGIN, allowed);
    if cors.allow_credentials {
        headers.insert(
            ACCESS_CONTROL_ALLOW_CREDENTIALS,
            HeaderValue::from_static("true"),
        );
    }
    let methods = if cors.allow_methods.iter().any(|method| method == "*") {
        request.get(ACCESS_CONTROL_REQUEST_METHOD).cloned()
    } else {
        listed(&cors.allow_methods)
    };
    if let Some(methods) = methods {
        headers.insert(ACCESS_CONTROL_ALLOW_METHODS, methods);
    }
    let allow_headers = if cors.allow_headers.iter().any(|name| name == "*") {
        request.get(ACCESS_CONTROL_REQUEST_HEADERS).cloned()
    } else {
        listed(&cors.allow_headers)
    };
    if let Some(allow_headers) = allow_headers {
        headers.insert(ACCESS_CONTROL_ALLOW_HEADERS, allow_headers);
    }
    if let Some(age) = cors.max_age_s {
        headers.insert(ACCESS_CONTROL_MAX_AGE, HeaderValue::from(age));
    }
    response
}

/// Gives an actual request's answer the fields its allowed origin needs.
pub fn decorate(cors: &Cors, origin: Option<&HeaderValue>, response: &mut HeaderMap) {
    let Some(allowed) = origin.and_then(|origin| allowed_origin(cors, origin)) else {
        return;
    };
    response.insert(ACCESS_CONTROL_ALLOW_ORIGIN, allowed);
    response.append(VARY, HeaderValue::from_static("origin"));
    if cors.allow_credentials {
        response.insert(
            ACCESS_CONTROL_ALLOW_CREDENTIALS,
            HeaderValue::from_static("true"),
        );
    }
    if let Some(exposed) = listed(&cors.expose_headers) {
        response.insert(ACCESS_CONTROL_EXPOSE_HEADERS, exposed);
    }
}

/// The `Access-Control-Allow-Origin` value for the request's origin, when it is allowed:
/// `*` for any origin without credentials, else the origin itself.
fn allowed_origin(cors: &Cors, origin: &HeaderValue) -> Option<HeaderValue> {
    let text = origin.to_str().ok()?.to_ascii_lowercase();
    let mut allowed = false;
    for pattern in &cors.allow_origins {
        if pattern == "*" {
            if !cors.allow_credentials {
                return Some(HeaderValue::from_static("*"));
            }
            allowed = true;
        } else if origin_matches(pattern, &text) {
            allowed = true;
        }
    }
    allowed.then(|| origin.clone())
}

/// `https://*.example.com` matches `https://a.example.com` (one or more labels), not
/// `https://example.com`; other patterns match exactly.
fn origin_matches(pattern: &str, origin: &str) -> bool {
    match pattern.split_once("://*.") {
        Some((scheme, suffix)) => origin
            .strip_prefix(scheme)
            .and_then(|rest| rest.strip_prefix("://"))
            .and_then(|host| host.strip_suffix(suffix))
            .is_some_and(|label| label.len() > 1 && label.ends_with('.')),
        None => pattern == origin,
    }
}

fn listed(values: &[String]) -> Option<HeaderValue> {
    if values.is_empty() {
        return None;
    }
    HeaderValue::from_str(&values.join(", ")).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cors() -> Cors {
        Cors {
            allow_origins: vec![
                "https://app.example.com".into(),
                "https://*.tools.example.com".into(),
            ],
            allow_methods: vec!["GET".into(), "PUT".into()],
            allow_headers: vec!["x-token".into()],
            expose_headers: vec!["x-request-id".into()],
            allow_credentials: true,
            max_age_s: Some(600),
        }
    }

    fn request(origin: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(ORIGIN, HeaderValue::from_str(origin).unwrap());
        headers.insert(
            ACCESS_CONTROL_REQUEST_METHOD,
            HeaderValue::from_static("PUT"),
        );
        headers
    }

    #[test]
    fn an_allowed_origin_gets_every_permission() {
        let response = preflight(&cors(), &request("https://app.example.com"));
        let headers = response.headers();
        assert_eq!(response.status(), StatusCode::NO_CONTENT);
        assert_eq!(
            headers[ACCESS_CONTROL_ALLOW_ORIGIN],
            "https://app.example.com"
        );
        assert_eq!(headers[ACCESS_CONTROL_ALLOW_METHODS], "GET, PUT");
        assert_eq!(headers[ACCESS_CONTROL_ALLOW_HEADERS], "x-token");
        assert_eq!(headers[ACCESS_CONTROL_ALLOW_CREDENTIALS], "true");
        assert_eq!(headers[ACCESS_CONTROL_MAX_AGE], "600");
        let wildcard = preflight(&cors(), &request("https://a.tools.example.com"));
        assert!(wildcard.headers().contains_key(ACCESS_CONTROL_ALLOW_ORIGIN));
    }

    #[test]
    fn another_origin_gets_no_permission() {
        for origin in [
            "https://evil.example.com",
            "http://app.example.com",
            "https://tools.example.com",
            "https://x.tools.example.com.evil.test",
        ] {
            let response = preflight(&cors(), &request(origin));
            assert!(
                !response.headers().contains_key(ACCESS_CONTROL_ALLOW_ORIGIN),
                "{origin}"
            );
        }
    }

    #[test]
    fn any_origin_without_credentials_is_a_star() {
        let open = Cors {
            allow_origins: vec!["*".into()],
            allow_credentials: false,
            ..cors()
        };
        let mut response = HeaderMap::new();
        let origin = HeaderValue::from_static("https://x.test");
        decorate(&open, Some(&origin), &mut response);
        assert_eq!(response[ACCESS_CONTROL_ALLOW_ORIGIN], "*");
        assert_eq!(response[ACCESS_CONTROL_EXPOSE_HEADERS], "x-request-id");
    }
}
