//! What the control task keeps in step with each snapshot besides the routing table: the stream
//! listeners (one per listen address of the stream routes) and the certificates the HTTPS
//! listener serves.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use rustls::sign::CertifiedKey;

use crate::model::{CertificateWithKey, Id, StreamRoute};
use crate::proxy::stream::{StreamError, StreamListeners};
use crate::tls::{self, CertResolver, CertificateSet};

/// How long to wait before binding again a stream listener whose address was taken.
const REBIND_AFTER: chrono::Duration = chrono::Duration::seconds(2);

/// Certificates read from the files named in the bootstrap config.
#[derive(Default)]
pub struct FileCertificates {
    /// Served to clients without SNI or with a name nothing else covers.
    pub default: Option<Arc<CertifiedKey>>,
    /// (names the certificate covers, certificate).
    pub others: Vec<(Vec<String>, Arc<CertifiedKey>)>,
}

/// The listeners the control task manages; `None` parts are not running in this gateway.
#[derive(Default)]
pub struct EdgeOptions {
    pub streams: Option<Arc<StreamListeners>>,
    pub certificates: Option<Arc<CertResolver>>,
    pub file_certificates: FileCertificates,
}

pub(super) struct Edge {
    options: EdgeOptions,
    /// Parsed API certificates by id, with the `updated_at` they were parsed at.
    parsed: HashMap<Id, (DateTime<Utc>, Arc<CertifiedKey>)>,
    /// Set while some stream route's address could not be bound.
    pub(super) rebind_at: Option<DateTime<Utc>>,
}

impl Edge {
    pub(super) fn new(options: EdgeOptions) -> Edge {
        Edge {
            options,
            parsed: HashMap::new(),
            rebind_at: None,
        }
    }

    /// Binds `listen` now, so the admin API can refuse a stream route whose address is taken
    /// before storing it.
    pub(super) fn bind_stream_listener(&self, listen: SocketAddr) -> Result<(), StreamError> {
        match &self.options.streams {
            Some(streams) => streams.bind(listen),
            None => Ok(()),
        }
    }

    /// Listens on every address of `routes` and stops listening on the others (their open
    /// connections continue). An address that cannot be bound is retried later.
    pub(super) fn sync_stream_listeners(&mut self, routes: &[StreamRoute], now: DateTime<Utc>) {
        let Some(streams) = &self.options.streams else {
            return;
        };
        let wanted: HashSet<SocketAddr> = routes.iter().map(|route| route.listen).collect();
        streams.retain(&wanted);
        let mut failed = false;
        for listen in &wanted {
            if let Err(error) = streams.bind(*listen) {
                tracing::error!(%error, "stream listener not bound; retrying in 2 s");
                failed = true;
            }
        }
        self.rebind_at = failed.then(|| now + REBIND_AFTER);
    }

    /// Publishes the certificate set: the config files' certificates, then the API's. Without
    /// a default certificate from the config, the oldest API certificate is the default.
    pub(super) fn publish_certificates(&mut self, certificates: &[CertificateWithKey]) {
        let Some(resolver) = &self.options.certificates else {
            return;
        };
        let ids: HashSet<Id> = certificates
            .iter()
            .map(|stored| stored.certificate.id)
            .collect();
        self.parsed.retain(|id, _| ids.contains(id));
        let mut entries = self.options.file_certificates.others.clone();
        for stored in certificates {
            let certificate = &stored.certificate;
            let cached = self
                .parsed
                .get(&certificate.id)
                .filter(|(parsed_at, _)| *parsed_at == certificate.updated_at)
                .map(|(_, key)| key.clone());
            let key = match cached {
                Some(key) => key,
                None => match tls::parse_certificate(&certificate.cert_pem, &stored.key_pem) {
                    Ok(parsed) => {
                        self.parsed
                            .insert(certificate.id, (certificate.updated_at, parsed.key.clone()));
                        parsed.key
                    }
                    Err(error) => {
                        // Checked when it was stored; only a damaged store gets here.
                        tracing::error!(certificate_id = certificate.id, %error, "stored certificate not served");
                        continue;
                    }
                },
            };
            entries.push((certificate.snis.clone(), key));
        }
        let default = self.options.file_certificates.default.clone().or_else(|| {
            certificates
                .first()
                .and_then(|first| self.parsed.get(&first.certificate.id))
                .map(|(_, key)| key.clone())
        });
        resolver.replace(CertificateSet::new(default, entries));
    }
}
