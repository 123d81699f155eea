//! rustls client settings for `https` upstreams.

use std::sync::Arc;

use rustls::{ClientConfig, RootCertStore};

use portcullis_config::TlsSettings;
use portcullis_net::client_tls::{NoVerify, system_roots};

/// Builds the client TLS config for an upstream. ALPN is left to the
/// connector, which offers the HTTP versions the upstream is set up for.
pub fn client_config(tls: &TlsSettings) -> ClientConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap_or_else(|_| {
            ClientConfig::builder_with_provider(provider.clone())
                .with_protocol_versions(&[&rustls::version::TLS13])
                .expect("TLS 1.3 is supported by ring")
        });
    if tls.insecure_skip_verify {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerify(provider)))
            .with_no_client_auth()
    } else {
        let mut roots = RootCertStore::empty();
        let (_, ignored) = roots.add_parsable_certificates(system_roots().iter().cloned());
        if ignored > 0 {
            tracing::debug!(ignored, "skipped unparsable system CA certificates");
        }
        for cert in &tls.ca_certs {
            if let Err(e) = roots.add(cert.clone()) {
                tracing::warn!(error = %e, "skipped an unusable certificate from ca_file");
            }
        }
        builder.with_root_certificates(roots).with_no_client_auth()
    }
}
