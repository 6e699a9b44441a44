//! Upstream connections: TCP, and TLS with the service's SNI and trust settings.
