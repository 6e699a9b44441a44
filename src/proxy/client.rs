//! Pooled keep-alive upstream HTTP clients, one per service (and its connection settings), so
//! a pool's lock is shared only by the requests of one service, never by all requests.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::body::UpstreamRequestBody;
use crate::model::{Id, Timeouts};

pub type UpstreamClient = Client<HttpConnector, UpstreamRequestBody>;

/// A service and the connection settings its pool was built with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct PoolSettings {
    service_id: Id,
    connect_ms: u64,
    idle_ms: u64,
}

/// Clients are created on first use and kept; the request path reads them lock-free.
#[derive(Default)]
pub struct UpstreamClients {
    clients: ArcSwap<HashMap<PoolSettings, Arc<UpstreamClient>>>,
}

impl UpstreamClients {
    pub fn for_service(&self, service_id: Id, timeouts: &Timeouts) -> Arc<UpstreamClient> {
        let settings = PoolSettings {
            service_id,
            connect_ms: timeouts.connect_ms,
            idle_ms: timeouts.idle_ms,
        };
        if let Some(client) = self.clients.load().get(&settings) {
            return client.clone();
        }
        let created = Arc::new(new_client(settings));
        let mut chosen = created.clone();
        self.clients.rcu(|current| {
            let mut next = HashMap::clone(current);
            chosen = next
                .entry(settings)
                .or_insert_with(|| created.clone())
                .clone();
            next
        });
        chosen
    }
}

fn new_client(settings: PoolSettings) -> UpstreamClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_millis(settings.connect_ms)));
    connector.set_keepalive(Some(Duration::from_secs(60)));
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_millis(settings.idle_ms))
        .build(connector)
}
