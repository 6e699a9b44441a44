//! The access log line of one HTTP request.

use std::net::SocketAddr;
use std::time::Duration;

use http::{header, HeaderValue, Method, Response, Version};

use super::{Exchange, ProxyBody};
use crate::proxy::ACCESS_LOG_TARGET;

/// The request line, kept only while the access log is on.
pub(super) struct RequestLine {
    pub method: Method,
    pub host: String,
    pub path: String,
    pub version: Version,
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
    tracing::info!(
        target: ACCESS_LOG_TARGET,
        request_id = request_id.to_str().unwrap_or(""),
        client = %client.ip(),
        method = %line.method,
        host = %line.host,
        path = %line.path,
        protocol = ?line.version,
        route = route.map(|route| route.route.name.as_str()),
        service = route.map(|route| route.service.service.name.as_str()),
        target = exchange.target.as_ref().map(|target| target.as_str()),
        status = response.status().as_u16(),
        bytes,
        duration_ms = elapsed.as_secs_f64() * 1000.0,
        upstream_ms = exchange.upstream_elapsed.map(|upstream| upstream.as_secs_f64() * 1000.0),
    );
}
