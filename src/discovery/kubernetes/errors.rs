//! How the API server's and kube-rs's errors read in `last_error`: the API server's own message,
//! the URL asked, and for a refusal by RBAC the permission the gateway lacks.

use kube::runtime::watcher;

use crate::discovery::DiscoveryError;
use crate::error_chain::text as error_chain;

/// An error answer (a `Status`) from the API server.
pub(super) fn refused(url: &str, status: &kube::core::Status) -> DiscoveryError {
    let mut message = if status.message.is_empty() {
        status.reason.clone()
    } else {
        status.message.clone()
    };
    if status.code == 401 {
        message.push_str(" (the API server did not accept the bearer token)");
    }
    if status.code == 403 {
        let resource = status
            .details
            .as_ref()
            .map(|details| details.kind.as_str())
            .unwrap_or_default();
        if let Some(needed) = needed_permission(resource) {
            message.push_str(&format!(
                " (the gateway's account needs {needed}: see the README's RBAC)"
            ));
        }
    }
    DiscoveryError::RegistryRefused {
        url: url.to_owned(),
        status: status.code,
        message,
    }
}

/// What the provider asks of each resource: the whole documented Role.
fn needed_permission(resource: &str) -> Option<&'static str> {
    match resource {
        "services" => Some("`get` and `watch` on `services` (API group \"\")"),
        "endpointslices" => {
            Some("`list` and `watch` on `endpointslices` (API group \"discovery.k8s.io\")")
        }
        _ => None,
    }
}

pub(super) fn client_failed(url: &str, err: &kube::Error) -> DiscoveryError {
    match err {
        kube::Error::Api(status) => refused(url, status),
        // Our own request policy's refusals read better without kube's "ServiceError: ".
        kube::Error::Service(err) => DiscoveryError::HttpRequest {
            url: url.to_owned(),
            reason: error_chain(err.as_ref()),
        },
        kube::Error::SerdeError(err) => DiscoveryError::BadJson {
            url: url.to_owned(),
            reason: err.to_string(),
        },
        other => DiscoveryError::HttpRequest {
            url: url.to_owned(),
            reason: error_chain(other),
        },
    }
}

pub(super) fn watcher_failed(url: &str, err: watcher::Error) -> DiscoveryError {
    match &err {
        watcher::Error::InitialListFailed(err) => client_failed(url, err),
        watcher::Error::WatchStartFailed(err) | watcher::Error::WatchFailed(err) => {
            client_failed(&format!("{url} (watch)"), err)
        }
        watcher::Error::WatchError(status) => refused(&format!("{url} (watch)"), status),
        watcher::Error::NoResourceVersion => DiscoveryError::BadDocument {
            url: url.to_owned(),
            location: "metadata.resourceVersion".to_owned(),
            reason: err.to_string(),
        },
    }
}

/// A 410 Gone, however it came (an ERROR event, a watch request's or a list page's HTTP
/// status): the history asked for is compacted, and a relist is the answer.
pub(super) fn is_gone(err: &watcher::Error) -> bool {
    match err {
        watcher::Error::WatchError(status) => status.code == 410,
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status)) => status.code == 410,
        _ => false,
    }
}
