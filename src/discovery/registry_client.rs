//! What the providers that read an HTTP registry (`http`, `consul`) share: their clients, a
//! response body read within a size limit.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use crate::discovery::DiscoveryError;
use crate::error_chain::text as error_chain;

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

/// What tells two registry clients apart. Sources with the same settings share one client (and
/// its connection pool): a client carries its own parsed root store and pool, tens of KB, which
/// thousands of sources must not each pay for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct ClientSettings {
    pub(crate) tls_verify: bool,
    /// Extra trusted roots (PEM), beside the built-in ones.
    pub(crate) ca_pem: Option<String>,
    pub(crate) connect_timeout_ms: Option<u64>,
}

/// Idle connections kept per registry host by a shared client.
const IDLE_CONNECTIONS_PER_HOST: usize = 32;

/// The client for `settings`, built on first use and shared while any source uses it.
pub(crate) fn shared_client(
    settings: &ClientSettings,
) -> Result<Arc<reqwest::Client>, ClientBuildError> {
    static CLIENTS: OnceLock<Mutex<HashMap<ClientSettings, Weak<reqwest::Client>>>> =
        OnceLock::new();
    let mut clients = CLIENTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(client) = clients.get(settings).and_then(Weak::upgrade) {
        return Ok(client);
    }
    let client = Arc::new(build_client(settings)?);
    clients.retain(|_, client| client.strong_count() > 0);
    clients.insert(settings.clone(), Arc::downgrade(&client));
    Ok(client)
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum ClientBuildError {
    #[error("is not valid PEM: {0}")]
    CaPem(String),
    #[error("cannot build the HTTP client: {0}")]
    Build(String),
}

fn build_client(settings: &ClientSettings) -> Result<reqwest::Client, ClientBuildError> {
    let mut builder = reqwest::Client::builder()
        .user_agent(concat!("raahi/", env!("CARGO_PKG_VERSION")))
        .danger_accept_invalid_certs(!settings.tls_verify)
        .pool_max_idle_per_host(IDLE_CONNECTIONS_PER_HOST)
        // Registries are reached directly: a proxy from the environment would be a surprise.
        .no_proxy();
    if let Some(ms) = settings.connect_timeout_ms {
        builder = builder.connect_timeout(Duration::from_millis(ms));
    }
    if let Some(pem) = &settings.ca_pem {
        let certificates = reqwest::Certificate::from_pem_bundle(pem.as_bytes())
            .map_err(|err| ClientBuildError::CaPem(err.to_string()))?;
        for certificate in certificates {
            builder = builder.add_root_certificate(certificate);
        }
    }
    builder
        .build()
        .map_err(|err| ClientBuildError::Build(error_chain(&err)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_with_the_same_settings_share_a_client_while_one_holds_it() {
        let settings = ClientSettings {
            tls_verify: true,
            ca_pem: None,
            connect_timeout_ms: Some(1234),
        };
        let first = shared_client(&settings).unwrap();
        let second = shared_client(&settings).unwrap();
        assert!(Arc::ptr_eq(&first, &second));
        let other = shared_client(&ClientSettings {
            tls_verify: false,
            ..settings.clone()
        })
        .unwrap();
        assert!(!Arc::ptr_eq(&first, &other));
    }

    #[test]
    fn a_bad_ca_bundle_is_named() {
        let settings = ClientSettings {
            tls_verify: true,
            ca_pem: Some("-----BEGIN CERTIFICATE-----\nnot base64\n".into()),
            connect_timeout_ms: None,
        };
        assert!(matches!(
            shared_client(&settings),
            Err(ClientBuildError::CaPem(_))
        ));
    }
}
