//! The access log line of one HTTP request.

use std::net::SocketAddr;
use std::time::Duration;

use http::{header, HeaderValue, Method, Request, Response, Uri, Version};

use super::{rewrite, Exchange, ProxyBody};
use crate::telemetry::access;

/// The request line, kept only while the access log is on. Cloning a request's URI and Host
/// shares their bytes: nothing is copied or allocated.
pub(super) struct RequestLine {
    method: Method,
    uri: Uri,
    host_header: Option<HeaderValue>,
    version: Version,
}

impl RequestLine {
    pub fn of<B>(request: &Request<B>) -> RequestLine {
        RequestLine {
            method: request.method().clone(),
            uri: request.uri().clone(),
            host_header: request.headers().get(header::HOST).cloned(),
            version: request.version(),
        }
    }

    fn host(&self) -> std::borrow::Cow<'_, str> {
        rewrite::host_of(&self.uri, self.host_header.as_ref())
    }
}

pub(super) fn write(
    line: &RequestLine,
    request_id: &HeaderValue,
    client: SocketAddr,
    exchange: &Exchange,
    response: &Response<ProxyBody>,
    elapsed: Duration,
) {
    let route = exchange.route.as_ref();
    let bytes = response
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    access::write(|fields| {
        fields.str("request_id", request_id.to_str().unwrap_or(""));
        fields.ip("client", client.ip());
        fields.str("method", line.method.as_str());
        fields.str("host", &line.host());
        fields.str("path", line.uri.path());
        fields.str("protocol", protocol(line.version));
        fields.opt_str("route", route.map(|route| route.route.name.as_str()));
        fields.opt_str(
            "service",
            route.map(|route| route.service.service.name.as_str()),
        );
        fields.opt_str(
            "target",
            exchange.target.as_ref().map(|target| target.as_str()),
        );
        fields.u64("status", u64::from(response.status().as_u16()));
        fields.opt_u64("bytes", bytes);
        fields.millis("duration_ms", elapsed);
        fields.opt_millis("upstream_ms", exchange.upstream_elapsed);
    });
}

fn protocol(version: Version) -> &'static str {
    match version {
        Version::HTTP_09 => "HTTP/0.9",
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_11 => "HTTP/1.1",
        Version::HTTP_2 => "HTTP/2.0",
        Version::HTTP_3 => "HTTP/3.0",
        _ => "HTTP/?",
    }
}
