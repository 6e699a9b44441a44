//! What the providers that read an HTTP registry (`http`, `consul`) share: a response body read
//! within a size limit, and an error told with all its causes.

use crate::discovery::DiscoveryError;

/// An error and its causes, "a: b: c", skipping a cause that repeats its parent's words.
pub(crate) fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let words = cause.to_string();
        if !text.contains(&words) {
            text.push_str(": ");
            text.push_str(&words);
        }
        source = cause.source();
    }
    text
}

/// A response body, refusing more than `limit` bytes: a declared length is checked before
/// reading, and a chunked body is counted as it arrives and abandoned at the limit.
pub(crate) async fn read_limited(
    mut response: reqwest::Response,
    url: &str,
    limit: u64,
    request_error: impl Fn(reqwest::Error) -> DiscoveryError,
) -> Result<Vec<u8>, DiscoveryError> {
    let too_large = || DiscoveryError::TooLarge {
        url: url.to_owned(),
        limit,
    };
    let declared = response.content_length().unwrap_or(0);
    if declared > limit {
        return Err(too_large());
    }
    let mut body = Vec::with_capacity(usize::try_from(declared).unwrap_or(0));
    while let Some(chunk) = response.chunk().await.map_err(&request_error)? {
        if (body.len() + chunk.len()) as u64 > limit {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}
