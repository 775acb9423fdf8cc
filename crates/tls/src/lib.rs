//! TLS for tandem's ports, from the PEM files an operator names (`--tls-cert`, `--tls-key`,
//! `--tls-ca`): the material itself ([`Identity`], [`roots_from_pem`]), the HTTP ports'
//! server configuration ([`HttpsConfig`]) and, with the `http` feature, the listener `serve` and
//! the router run their HTTP on ([`http::serve`]). The KV side channel's mutual TLS is built
//! from the same material in `tandem-kv`.
//!
//! rustls with ring throughout, one provider for every port.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

#[cfg(feature = "http")]
pub mod http;

/// A certificate chain and its private key: who this process is.
pub struct Identity {
    /// The chain, this process's certificate first.
    pub certs: Vec<CertificateDer<'static>>,
    /// The key the first certificate names.
    pub key: PrivateKeyDer<'static>,
}

impl Identity {
    /// From PEM: a certificate chain and its private key. An error says which part is wrong.
    pub fn from_pem(cert_chain: &[u8], key: &[u8]) -> Result<Self, String> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_chain)
            .collect::<Result<_, _>>()
            .map_err(|e| format!("the certificate: {e}"))?;
        if certs.is_empty() {
            return Err("the certificate file holds no certificate".into());
        }
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| format!("the private key: {e}"))?;
        Ok(Self { certs, key })
    }
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Self { certs: self.certs.clone(), key: self.key.clone_key() }
    }
}

/// The CA certificates (PEM) a peer's certificate must chain to; an error if there are none.
pub fn roots_from_pem(ca: &[u8]) -> Result<Arc<rustls::RootCertStore>, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca) {
        roots.add(cert.map_err(|e| format!("the CA: {e}"))?).map_err(|e| format!("the CA: {e}"))?;
    }
    if roots.is_empty() {
        return Err("the CA file holds no certificate".into());
    }
    Ok(Arc::new(roots))
}

/// The crypto every tandem port uses.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// An HTTP port's TLS: its certificate, offered to any client (clients prove themselves with
/// API keys and the cluster token, not certificates, so the OpenAI SDK and curl connect as
/// they are). HTTP/1.1 only, which is what the servers speak.
#[derive(Clone)]
// Read only by the `http` feature's listener.
#[cfg_attr(not(feature = "http"), allow(dead_code))]
pub struct HttpsConfig(pub(crate) Arc<rustls::ServerConfig>);

impl std::fmt::Debug for HttpsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HttpsConfig(..)")
    }
}

impl HttpsConfig {
    /// The server configuration for `identity`.
    pub fn new(identity: Identity) -> Result<Self, String> {
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_single_cert(identity.certs, identity.key)
            .map_err(|e| format!("the certificate and key: {e}"))?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self(Arc::new(config)))
    }

    /// From PEM: the certificate chain and its key.
    pub fn from_pem(cert_chain: &[u8], key: &[u8]) -> Result<Self, String> {
        Self::new(Identity::from_pem(cert_chain, key)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_pem_is_refused_naming_the_part() {
        let ca = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let (cert, key) = (ca.cert.pem(), ca.key_pair.serialize_pem());
        assert!(HttpsConfig::from_pem(cert.as_bytes(), key.as_bytes()).is_ok());
        let no_cert = HttpsConfig::from_pem(b"", key.as_bytes()).unwrap_err();
        assert!(no_cert.contains("no certificate"), "{no_cert}");
        let no_key = HttpsConfig::from_pem(cert.as_bytes(), b"garbage").unwrap_err();
        assert!(no_key.contains("private key"), "{no_key}");
        let no_ca = roots_from_pem(b"").unwrap_err();
        assert!(no_ca.contains("CA"), "{no_ca}");
        let other = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let mismatched = HttpsConfig::from_pem(cert.as_bytes(), other.key_pair.serialize_pem().as_bytes());
        assert!(mismatched.is_err(), "a key of another certificate must be refused");
    }
}
