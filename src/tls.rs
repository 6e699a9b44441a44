//! The one place that installs the rustls crypto provider and builds TLS configs: certificate
//! parsing and validation, SNI certificate selection for the HTTPS listener, and the client
//! configs and server name used towards upstreams (by traffic to `https` targets and by health
//! checks alike).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwap;
use chrono::{DateTime, Utc};
use http::uri::Authority;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use rustls_pki_types::pem::{PemObject, SectionKind};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

/// Why a certificate, key or CA bundle was refused. Every variant is the operator's input being
/// wrong (never worth retrying unchanged) and names the API field it concerns.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cert_pem holds no PEM CERTIFICATE block")]
    NoCertificate,
    #[error("cert_pem is not valid PEM: {0}")]
    CertificatePem(String),
    #[error(
        "cert_pem must hold only CERTIFICATE blocks, found a {0} block; the key goes in key_pem"
    )]
    NotOnlyCertificates(String),
    #[error("the leaf certificate in cert_pem cannot be parsed: {0}")]
    CertificateInvalid(String),
    #[error("key_pem holds no PEM private key (PKCS#8, PKCS#1 or SEC1)")]
    NoKey,
    #[error("key_pem is not valid PEM: {0}")]
    KeyPem(String),
    #[error("key_pem holds a key that is not supported: {0}")]
    UnsupportedKey(String),
    #[error("key_pem does not match the public key of the leaf certificate in cert_pem")]
    KeyMismatch,
    #[error("tls_ca_pem holds no PEM CERTIFICATE block")]
    NoCaCertificate,
    #[error("tls_ca_pem is not valid PEM: {0}")]
    CaPem(String),
    #[error("tls_ca_pem holds a certificate that cannot be used as a trust anchor: {0}")]
    CaInvalid(String),
    #[error("server name {sni:?} is not covered by the certificate's names {names:?}")]
    SniNotCovered { sni: String, names: Vec<String> },
}

impl TlsError {
    /// The API field whose value caused the error.
    pub fn field(&self) -> &'static str {
        match self {
            TlsError::NoCertificate
            | TlsError::CertificatePem(_)
            | TlsError::NotOnlyCertificates(_)
            | TlsError::CertificateInvalid(_) => "cert_pem",
            TlsError::NoKey
            | TlsError::KeyPem(_)
            | TlsError::UnsupportedKey(_)
            | TlsError::KeyMismatch => "key_pem",
            TlsError::NoCaCertificate | TlsError::CaPem(_) | TlsError::CaInvalid(_) => "tls_ca_pem",
            TlsError::SniNotCovered { .. } => "snis",
        }
    }
}

/// Installs ring as the process-wide rustls provider (for libraries that use the default).
/// Calling it again is harmless. Configs built here name their provider explicitly, so they do
/// not depend on this having run.
pub fn install_crypto_provider() {
    // An error only means a provider is already installed, which is what we want.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| Arc::new(rustls::crypto::ring::default_provider()))
        .clone()
}

/// A certificate chain and key that were checked to belong together.
#[derive(Clone)]
pub struct ParsedCertificate {
    /// DNS names of the leaf's subjectAltName, lowercased; wildcards as given (`*.example.com`).
    pub names: Vec<String>,
    /// Expiry of the leaf certificate.
    pub not_after: DateTime<Utc>,
    pub key: Arc<CertifiedKey>,
}

impl fmt::Debug for ParsedCertificate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ParsedCertificate")
            .field("names", &self.names)
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

/// Parses a PEM chain (leaf first) and its PEM private key and checks that the key is the leaf's.
pub fn parse_certificate(cert_pem: &str, key_pem: &str) -> Result<ParsedCertificate, TlsError> {
    // `cert_pem` is stored and shown back as given: a private key pasted into it (a combined
    // PEM file) would leak through the API.
    for section in <(SectionKind, Vec<u8>)>::pem_slice_iter(cert_pem.as_bytes()) {
        match section {
            Ok((SectionKind::Certificate, _)) => {}
            Ok((other, _)) => return Err(TlsError::NotOnlyCertificates(format!("{other:?}"))),
            Err(error) => return Err(TlsError::CertificatePem(error.to_string())),
        }
    }
    let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| TlsError::CertificatePem(error.to_string()))?;
    let leaf = chain.first().ok_or(TlsError::NoCertificate)?;
    let (names, not_after) = leaf_names_and_expiry(leaf)?;

    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|error| match error {
        rustls_pki_types::pem::Error::NoItemsFound => TlsError::NoKey,
        other => TlsError::KeyPem(other.to_string()),
    })?;
    let signing_key = provider()
        .key_provider
        .load_private_key(key)
        .map_err(|error| TlsError::UnsupportedKey(error.to_string()))?;
    let certified = CertifiedKey::new(chain, signing_key);
    match certified.keys_match() {
        Ok(()) => {}
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => {
            return Err(TlsError::KeyMismatch)
        }
        // A key whose public half cannot be compared would be served blind; refuse it.
        Err(rustls::Error::InconsistentKeys(_)) => {
            return Err(TlsError::UnsupportedKey(
                "its public key cannot be compared with the certificate's".into(),
            ))
        }
        Err(other) => return Err(TlsError::CertificateInvalid(other.to_string())),
    }
    Ok(ParsedCertificate {
        names,
        not_after,
        key: Arc::new(certified),
    })
}

fn leaf_names_and_expiry(
    leaf: &CertificateDer<'_>,
) -> Result<(Vec<String>, DateTime<Utc>), TlsError> {
    let (_, parsed) = x509_parser::parse_x509_certificate(leaf.as_ref())
        .map_err(|error| TlsError::CertificateInvalid(error.to_string()))?;
    let not_after_seconds = parsed.validity().not_after.timestamp();
    let not_after = DateTime::<Utc>::from_timestamp(not_after_seconds, 0).ok_or_else(|| {
        TlsError::CertificateInvalid(format!("notAfter {not_after_seconds} is out of range"))
    })?;
    let mut names = Vec::new();
    let alt_names = parsed
        .subject_alternative_name()
        .map_err(|error| TlsError::CertificateInvalid(error.to_string()))?;
    if let Some(alt_names) = alt_names {
        for name in &alt_names.value.general_names {
            if let x509_parser::extensions::GeneralName::DNSName(dns) = name {
                let dns = dns.to_ascii_lowercase();
                if !names.contains(&dns) {
                    names.push(dns);
                }
            }
        }
    }
    Ok((names, not_after))
}

/// Whether a certificate with DNS names `names` is valid for `sni`: an exact match, or a
/// `*.suffix` name and an `sni` of exactly one label more (RFC 6125), ignoring case. An `sni`
/// that is itself a wildcard is covered only by the same wildcard.
pub fn name_covered(names: &[String], sni: &str) -> bool {
    let sni = normalize_server_name(sni);
    if sni.is_empty() {
        return false;
    }
    names.iter().any(|name| {
        let name = normalize_server_name(name);
        if name == sni {
            return true;
        }
        let Some(suffix) = name.strip_prefix("*.") else {
            return false;
        };
        match sni
            .strip_suffix(suffix)
            .and_then(|rest| rest.strip_suffix('.'))
        {
            Some(label) => !label.is_empty() && !label.contains('.') && !label.contains('*'),
            None => false,
        }
    })
}

/// Checks that every server name an operator gave is covered by the certificate's names.
pub fn check_snis_covered(names: &[String], snis: &[String]) -> Result<(), TlsError> {
    match snis.iter().find(|sni| !name_covered(names, sni)) {
        Some(sni) => Err(TlsError::SniNotCovered {
            sni: sni.clone(),
            names: names.to_vec(),
        }),
        None => Ok(()),
    }
}

fn normalize_server_name(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

/// The server name for a service's upstream TLS (DESIGN §6): `tls_sni`, else `upstream_authority`
/// without its port, else the target's host. IPv6 brackets are removed; an IP address yields no
/// SNI extension and is verified against the certificate's IP addresses.
pub fn upstream_server_name<'a>(
    tls_sni: Option<&'a str>,
    upstream_authority: Option<&'a str>,
    target: &'a Authority,
) -> &'a str {
    if let Some(sni) = tls_sni.filter(|sni| !sni.is_empty()) {
        return sni;
    }
    if let Some(authority) = upstream_authority.filter(|authority| !authority.is_empty()) {
        return host_without_port(authority);
    }
    host_without_port(target.as_str())
}

fn host_without_port(authority: &str) -> &str {
    if let Some(rest) = authority.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match authority.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => authority,
    }
}

/// Parses a PEM bundle of CA certificates to trust; it must hold at least one usable certificate.
pub fn parse_ca_bundle(pem: &str) -> Result<RootCertStore, TlsError> {
    let certificates = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| TlsError::CaPem(error.to_string()))?;
    if certificates.is_empty() {
        return Err(TlsError::NoCaCertificate);
    }
    let mut roots = RootCertStore::empty();
    for certificate in certificates {
        roots
            .add(certificate)
            .map_err(|error| TlsError::CaInvalid(error.to_string()))?;
    }
    Ok(roots)
}

/// The certificates the HTTPS listener can serve, indexed by server name.
#[derive(Default)]
pub struct CertificateSet {
    default: Option<Arc<CertifiedKey>>,
    exact: HashMap<String, Arc<CertifiedKey>>,
    /// Keyed by the suffix with its dot: `*.example.com` → `.example.com`.
    wildcard: HashMap<String, Arc<CertifiedKey>>,
}

impl CertificateSet {
    /// `entries` are (server names, certificate); when two entries claim the same name, the
    /// earlier one keeps it.
    pub fn new(
        default: Option<Arc<CertifiedKey>>,
        entries: Vec<(Vec<String>, Arc<CertifiedKey>)>,
    ) -> CertificateSet {
        let mut set = CertificateSet {
            default,
            ..CertificateSet::default()
        };
        for (snis, key) in entries {
            for sni in snis {
                let sni = normalize_server_name(&sni);
                match sni.strip_prefix('*') {
                    Some(suffix) if suffix.starts_with('.') => {
                        set.wildcard
                            .entry(suffix.to_string())
                            .or_insert_with(|| key.clone());
                    }
                    _ => {
                        set.exact.entry(sni).or_insert_with(|| key.clone());
                    }
                }
            }
        }
        set
    }

    /// Exact name first, then the `*.suffix` covering it, then the default.
    pub fn select(&self, sni: Option<&str>) -> Option<Arc<CertifiedKey>> {
        let Some(sni) = sni else {
            return self.default.clone();
        };
        let sni = normalize_server_name(sni);
        if let Some(key) = self.exact.get(&sni) {
            return Some(key.clone());
        }
        // A wildcard covers exactly one label (RFC 6125), as `name_covered` checks: the suffix
        // after the first label is the only candidate.
        let wildcard = sni
            .find('.')
            .filter(|&position| position > 0)
            .and_then(|position| self.wildcard.get(&sni[position..]));
        wildcard.cloned().or_else(|| self.default.clone())
    }

    pub fn is_empty(&self) -> bool {
        self.default.is_none() && self.exact.is_empty() && self.wildcard.is_empty()
    }
}

/// Picks the HTTPS listener's certificate by SNI; handshakes read the current set without a lock
/// and [`CertResolver::replace`] swaps in a new one for the next handshake.
pub struct CertResolver {
    current: ArcSwap<CertificateSet>,
}

impl CertResolver {
    pub fn new() -> Arc<CertResolver> {
        Arc::new(CertResolver {
            current: ArcSwap::from_pointee(CertificateSet::default()),
        })
    }

    pub fn replace(&self, set: CertificateSet) {
        self.current.store(Arc::new(set));
    }
}

impl fmt::Debug for CertResolver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let set = self.current.load();
        f.debug_struct("CertResolver")
            .field("has_default", &set.default.is_some())
            .field("exact_names", &set.exact.len())
            .field("wildcard_names", &set.wildcard.len())
            .finish()
    }
}

impl ResolvesServerCert for CertResolver {
    fn resolve(&self, client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let sni = client_hello.server_name();
        let chosen = self.current.load().select(sni);
        if chosen.is_none() {
            tracing::debug!(
                sni = sni.unwrap_or(""),
                "no certificate for the client's server name"
            );
        }
        chosen
    }
}

/// The HTTPS listener's config: TLS 1.2 and 1.3, ALPN `h2` then `http/1.1`, and resumption by
/// session tickets and by a session-id cache.
pub fn server_config(resolver: Arc<CertResolver>) -> Arc<rustls::ServerConfig> {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12]);
    let builder = match builder {
        Ok(builder) => builder,
        // The ring provider supports both versions; this only guards against a future change.
        Err(error) => {
            tracing::error!(%error, "TLS 1.2 and 1.3 unavailable; using the provider defaults");
            rustls::ServerConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .expect("the ring provider supports its own safe default versions")
        }
    };
    let mut config = builder.with_no_client_auth().with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    config.session_storage = rustls::server::ServerSessionMemoryCache::new(4096);
    match rustls::crypto::ring::Ticketer::new() {
        Ok(ticketer) => config.ticketer = ticketer,
        Err(error) => {
            tracing::warn!(%error, "no TLS session tickets; resumption by session id only")
        }
    }
    Arc::new(config)
}

/// A client config for an `https` upstream. With `verify`, the server certificate must chain to
/// `ca_pem` when given, else to the public web roots; without it any certificate is accepted
/// (the handshake signatures are still checked). ALPN offers `h2` then `http/1.1`.
pub fn client_config(
    verify: bool,
    ca_pem: Option<&str>,
) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let custom_roots = ca_pem.map(parse_ca_bundle).transpose()?;
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|error| TlsError::CaInvalid(error.to_string()))?;
    let mut config = if verify {
        let roots = custom_roots.unwrap_or_else(|| RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        });
        builder.with_root_certificates(roots).with_no_client_auth()
    } else {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AcceptAnyServerCertificate {
                provider: provider(),
            }))
            .with_no_client_auth()
    };
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// For `tls_verify: false`: trusts any server certificate, but still checks that the server holds
/// its key, so the session is at least encrypted to whoever answered.
#[derive(Debug)]
struct AcceptAnyServerCertificate {
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for AcceptAnyServerCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn self_signed(names: &[&str]) -> (String, String) {
        let names: Vec<String> = names.iter().map(|name| name.to_string()).collect();
        let generated = rcgen::generate_simple_self_signed(names).expect("rcgen");
        (generated.cert.pem(), generated.signing_key.serialize_pem())
    }

    fn key_for(names: &[&str]) -> Arc<CertifiedKey> {
        let (cert, key) = self_signed(names);
        parse_certificate(&cert, &key).expect("valid").key
    }

    #[test]
    fn parses_names_expiry_and_key() {
        let (cert, key) = self_signed(&["API.example.com", "*.example.org"]);
        let parsed = parse_certificate(&cert, &key).expect("valid certificate");
        assert_eq!(parsed.names, vec!["api.example.com", "*.example.org"]);
        assert!(parsed.not_after > crate::clock::now());
        assert_eq!(parsed.key.cert.len(), 1);
    }

    #[test]
    fn refuses_a_key_of_another_certificate() {
        let (cert, _) = self_signed(&["a.example.com"]);
        let (_, other_key) = self_signed(&["a.example.com"]);
        let error = parse_certificate(&cert, &other_key).expect_err("mismatch");
        assert!(matches!(error, TlsError::KeyMismatch), "{error:?}");
        assert_eq!(error.field(), "key_pem");
    }

    #[test]
    fn refuses_garbage_and_missing_pem() {
        let (cert, key) = self_signed(&["a.example.com"]);
        let error = parse_certificate("not a certificate", &key).expect_err("garbage");
        assert!(matches!(error, TlsError::NoCertificate), "{error:?}");
        assert_eq!(error.field(), "cert_pem");

        let broken = "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n";
        let error = parse_certificate(broken, &key).expect_err("bad base64");
        assert_eq!(error.field(), "cert_pem");

        let truncated = &cert[..cert.len() / 2];
        let error = parse_certificate(truncated, &key).expect_err("truncated");
        assert_eq!(error.field(), "cert_pem");

        let not_der = "-----BEGIN CERTIFICATE-----\naGVsbG8=\n-----END CERTIFICATE-----\n";
        let error = parse_certificate(not_der, &key).expect_err("not DER");
        assert!(
            matches!(error, TlsError::CertificateInvalid(_)),
            "{error:?}"
        );

        let error = parse_certificate(&cert, "").expect_err("no key");
        assert!(matches!(error, TlsError::NoKey), "{error:?}");
        assert_eq!(error.field(), "key_pem");

        let junk_key = "-----BEGIN PRIVATE KEY-----\naGVsbG8=\n-----END PRIVATE KEY-----\n";
        let error = parse_certificate(&cert, junk_key).expect_err("junk key");
        assert!(matches!(error, TlsError::UnsupportedKey(_)), "{error:?}");
        assert_eq!(error.field(), "key_pem");
    }

    #[test]
    fn wildcard_covers_one_label_only() {
        let names = vec!["*.example.com".to_string(), "api.example.org".to_string()];
        assert!(name_covered(&names, "www.example.com"));
        assert!(name_covered(&names, "WWW.Example.COM."));
        assert!(name_covered(&names, "*.example.com"));
        assert!(name_covered(&names, "API.example.org"));
        assert!(!name_covered(&names, "example.com"));
        assert!(!name_covered(&names, "a.b.example.com"));
        assert!(!name_covered(&names, "*.a.example.com"));
        assert!(!name_covered(&names, "www.example.org"));
        assert!(!name_covered(&names, ""));
        assert!(check_snis_covered(&names, &["a.example.com".into()]).is_ok());
        let error = check_snis_covered(&names, &["x.org".into()]).expect_err("not covered");
        assert_eq!(error.field(), "snis");
    }

    #[test]
    fn selects_exact_then_one_label_wildcard_then_default() {
        let default = key_for(&["default.test"]);
        let exact = key_for(&["api.example.com"]);
        let wide = key_for(&["*.example.com"]);
        let narrow = key_for(&["*.eu.example.com"]);
        let set = CertificateSet::new(
            Some(default.clone()),
            vec![
                (vec!["API.example.com".into()], exact.clone()),
                (vec!["*.example.com".into()], wide.clone()),
                (vec!["*.eu.example.com".into()], narrow.clone()),
            ],
        );
        let pick = |sni: Option<&str>| set.select(sni).expect("a certificate");
        assert!(Arc::ptr_eq(&pick(Some("api.example.com")), &exact));
        assert!(Arc::ptr_eq(&pick(Some("www.example.com")), &wide));
        assert!(Arc::ptr_eq(&pick(Some("www.eu.example.com")), &narrow));
        // A wildcard covers one label only: a deeper name gets the default, not a certificate
        // the client would refuse.
        assert!(Arc::ptr_eq(&pick(Some("a.b.eu.example.com")), &default));
        assert!(Arc::ptr_eq(&pick(Some("example.com")), &default));
        assert!(Arc::ptr_eq(&pick(Some("other.test")), &default));
        assert!(Arc::ptr_eq(&pick(None), &default));

        let without_default = CertificateSet::new(None, vec![(vec!["a.test".into()], exact)]);
        assert!(without_default.select(Some("b.test")).is_none());
        assert!(without_default.select(None).is_none());
        assert!(CertificateSet::new(None, Vec::new()).is_empty());
    }

    #[test]
    fn a_key_in_cert_pem_is_refused() {
        let (cert, key) = self_signed(&["a.test"]);
        let combined = format!("{cert}{key}");
        let error = parse_certificate(&combined, &key).expect_err("a key block in cert_pem");
        assert_eq!(error.field(), "cert_pem");
        assert!(error.to_string().contains("only CERTIFICATE"), "{error}");
    }

    #[test]
    fn earlier_entry_keeps_a_shared_name() {
        let first = key_for(&["a.test"]);
        let second = key_for(&["a.test"]);
        let set = CertificateSet::new(
            None,
            vec![
                (vec!["a.test".into()], first.clone()),
                (vec!["a.test".into()], second),
            ],
        );
        assert!(Arc::ptr_eq(
            &set.select(Some("a.test")).expect("cert"),
            &first
        ));
    }

    #[test]
    fn ca_bundle_needs_a_certificate() {
        let (cert, _) = self_signed(&["ca.test"]);
        let (other, _) = self_signed(&["ca2.test"]);
        let roots = parse_ca_bundle(&format!("{cert}{other}")).expect("bundle");
        assert_eq!(roots.len(), 2);
        let error = parse_ca_bundle("nothing here").expect_err("empty");
        assert!(matches!(error, TlsError::NoCaCertificate));
        assert_eq!(error.field(), "tls_ca_pem");
        let error = parse_ca_bundle("-----BEGIN CERTIFICATE-----\n!!\n-----END CERTIFICATE-----\n")
            .expect_err("bad pem");
        assert_eq!(error.field(), "tls_ca_pem");
        assert!(client_config(true, Some("nothing")).is_err());
        assert!(client_config(true, Some(&cert)).is_ok());
        assert!(client_config(false, None).is_ok());
        assert!(client_config(true, None).is_ok());
    }

    #[test]
    fn server_config_offers_h2_and_http1() {
        install_crypto_provider();
        install_crypto_provider();
        let config = server_config(CertResolver::new());
        assert_eq!(
            config.alpn_protocols,
            vec![b"h2".to_vec(), b"http/1.1".to_vec()]
        );
    }

    #[test]
    fn server_name_follows_sni_then_authority_then_target() {
        let target = Authority::from_static("10.0.0.7:8443");
        assert_eq!(
            upstream_server_name(Some("sni.test"), Some("api.test:443"), &target),
            "sni.test"
        );
        assert_eq!(
            upstream_server_name(None, Some("api.test:443"), &target),
            "api.test"
        );
        assert_eq!(
            upstream_server_name(None, Some("api.test"), &target),
            "api.test"
        );
        assert_eq!(upstream_server_name(None, None, &target), "10.0.0.7");
        let v6 = Authority::from_static("[::1]:8443");
        assert_eq!(upstream_server_name(None, None, &v6), "::1");
        assert_eq!(upstream_server_name(Some(""), Some("[::2]:1"), &v6), "::2");
    }
}
