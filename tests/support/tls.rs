//! A throwaway CA and server certificates for TLS tests.

use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A CA and one leaf certificate it signed for `localhost` and 127.0.0.1.
pub struct TestPki {
    /// The CA certificate, PEM.
    pub ca_pem: String,
    /// The leaf chain.
    pub leaf_chain: Vec<CertificateDer<'static>>,
    /// The leaf key, PKCS#8 DER.
    pub leaf_key: Vec<u8>,
    /// Leaf certificate, PEM.
    pub leaf_pem: String,
    /// Leaf key, PEM.
    pub leaf_key_pem: String,
}

impl TestPki {
    /// Makes a fresh CA and leaf.
    pub fn new() -> TestPki {
        let ca_key = KeyPair::generate().expect("ca key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca_params, ca_key).expect("ca cert");
        let leaf_key = KeyPair::generate().expect("leaf key");
        let leaf_params =
            CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
                .expect("leaf params");
        let leaf = leaf_params.signed_by(&leaf_key, &ca).expect("leaf cert");
        TestPki {
            ca_pem: ca.pem(),
            leaf_chain: vec![leaf.der().clone()],
            leaf_key: leaf_key.serialize_der(),
            leaf_pem: leaf.pem(),
            leaf_key_pem: leaf_key.serialize_pem(),
        }
    }

    /// A rustls server config for the leaf, offering `alpn`.
    pub fn server_config(&self, alpn: &[&[u8]]) -> Arc<rustls::ServerConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(
                self.leaf_chain.clone(),
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.leaf_key.clone())),
            )
            .expect("server cert");
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(config)
    }
}
