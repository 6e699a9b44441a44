//! What the control task keeps in step with each snapshot besides the routing table: the stream
//! listeners (one per listen address of the stream routes) and the certificates the HTTPS
//! listener serves.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use chrono::{DateTime, Utc};
use rustls::sign::CertifiedKey;

use crate::model::{CertificateWithKey, Id, StreamRoute};
use crate::proxy::stream::{BindError, StreamListeners};
use crate::tls::{self, CertResolver, CertificateSet};

/// First wait before binding again a stream listener whose address was taken; it doubles up to
/// [`REBIND_MAX`] while the address stays taken.
const REBIND_FIRST: chrono::Duration = chrono::Duration::seconds(2);
const REBIND_MAX: chrono::Duration = chrono::Duration::seconds(60);

/// Certificates read from the files named in the bootstrap config.
#[derive(Default)]
pub struct FileCertificates {
    /// Served to clients without SNI or with a name nothing else covers.
    pub default: Option<Arc<CertifiedKey>>,
    /// (names the certificate covers, certificate).
    pub others: Vec<(Vec<String>, Arc<CertifiedKey>)>,
    /// One per certificate file, for `/metrics`.
    pub expiries: Vec<FileCertificateExpiry>,
}

/// A certificate file's expiry, reported beside the API certificates' so that a file nobody
/// renewed is seen before clients see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileCertificateExpiry {
    pub cert_file: String,
    /// The first name the certificate covers.
    pub sni: String,
    pub not_after: DateTime<Utc>,
}

/// The expiries of the certificate files currently served, shared with the admin API.
pub type FileExpiries = Arc<ArcSwap<Vec<FileCertificateExpiry>>>;

/// The listeners the control task manages; `None` parts are not running in this gateway.
#[derive(Default)]
pub struct EdgeOptions {
    pub streams: Option<Arc<StreamListeners>>,
    pub certificates: Option<Arc<CertResolver>>,
    pub file_certificates: FileCertificates,
}

pub(super) struct Edge {
    options: EdgeOptions,
    file_expiries: FileExpiries,
    /// Parsed API certificates by id, with the `updated_at` they were parsed at.
    parsed: HashMap<Id, (DateTime<Utc>, Arc<CertifiedKey>)>,
    /// Set while some stream route's address could not be bound.
    pub(super) rebind_at: Option<DateTime<Utc>>,
    rebind_backoff: chrono::Duration,
    /// The listen addresses of the live snapshot's stream routes.
    wanted: HashSet<SocketAddr>,
    /// Addresses bound for admin calls whose route is not stored yet (with how many calls), so
    /// a rebuild in between does not close them.
    pending: HashMap<SocketAddr, usize>,
}

impl Edge {
    pub(super) fn new(options: EdgeOptions) -> Edge {
        let expiries = options.file_certificates.expiries.clone();
        Edge {
            options,
            file_expiries: Arc::new(ArcSwap::from_pointee(expiries)),
            parsed: HashMap::new(),
            rebind_at: None,
            rebind_backoff: REBIND_FIRST,
            wanted: HashSet::new(),
            pending: HashMap::new(),
        }
    }

    /// Binds `listen` now, so the admin API can refuse a stream route whose address is taken
    /// before storing it. The address counts as wanted until [`Edge::release_pending`].
    pub(super) fn bind_stream_listener(&mut self, listen: SocketAddr) -> Result<(), BindError> {
        if let Some(streams) = &self.options.streams {
            streams.bind(listen)?;
        }
        *self.pending.entry(listen).or_default() += 1;
        Ok(())
    }

    pub(super) fn replace_file_certificates(&mut self, certificates: FileCertificates) {
        self.file_expiries
            .store(Arc::new(certificates.expiries.clone()));
        self.options.file_certificates = certificates;
    }

    pub(super) fn file_expiries(&self) -> FileExpiries {
        self.file_expiries.clone()
    }

    /// The admin call that bound `listen` has stored its route (or failed to).
    pub(super) fn release_pending(&mut self, listen: SocketAddr) {
        if let Some(count) = self.pending.get_mut(&listen) {
            *count -= 1;
            if *count == 0 {
                self.pending.remove(&listen);
            }
        }
    }

    /// Listens on every address of `routes` and stops listening on the others (their open
    /// connections continue). An address that cannot be bound is retried later.
    pub(super) fn sync_stream_listeners(&mut self, routes: &[StreamRoute], now: DateTime<Utc>) {
        let Some(streams) = &self.options.streams else {
            return;
        };
        self.wanted = routes.iter().map(|route| route.listen).collect();
        let mut kept = self.wanted.clone();
        kept.extend(self.pending.keys());
        streams.retain(&kept);
        self.bind_wanted(now);
    }

    /// Binds every wanted address not bound yet; while one fails, retries with a growing pause.
    pub(super) fn bind_wanted(&mut self, now: DateTime<Utc>) {
        let Some(streams) = &self.options.streams else {
            return;
        };
        let mut failed = false;
        for listen in &self.wanted {
            if let Err(error) = streams.bind(*listen) {
                tracing::error!(%error, retry_in_s = self.rebind_backoff.num_seconds(), "stream listener not bound");
                failed = true;
            }
        }
        if failed {
            self.rebind_at = Some(now + self.rebind_backoff);
            self.rebind_backoff = (self.rebind_backoff * 2).min(REBIND_MAX);
        } else {
            self.rebind_at = None;
            self.rebind_backoff = REBIND_FIRST;
        }
    }

    /// Publishes the certificate set. A name served by an API certificate and by a config file's
    /// goes to the API's: the API is where operators change certificates live. Without a
    /// default certificate from the config, the oldest API certificate is the default.
    pub(super) fn publish_certificates(&mut self, certificates: &[CertificateWithKey]) {
        let Some(resolver) = &self.options.certificates else {
            return;
        };
        let ids: HashSet<Id> = certificates
            .iter()
            .map(|stored| stored.certificate.id)
            .collect();
        self.parsed.retain(|id, _| ids.contains(id));
        let mut entries = Vec::with_capacity(certificates.len());
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
        // The set keeps the first entry of a shared name.
        entries.extend(self.options.file_certificates.others.iter().cloned());
        let default = self.options.file_certificates.default.clone().or_else(|| {
            certificates
                .first()
                .and_then(|first| self.parsed.get(&first.certificate.id))
                .map(|(_, key)| key.clone())
        });
        resolver.replace(CertificateSet::new(default, entries));
    }
}
