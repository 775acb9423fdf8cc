//! The secret one deployment's router and engines share (`--cluster-secret-file`): what proves
//! a KV side-channel peer or a caller of an internal endpoint belongs to it. Only keyed hashes
//! of it ever leave the process (HMAC-SHA256, each under a label of its own use), never the
//! secret itself.

use hmac::{Hmac, Mac as _};
use sha2::Sha256;

/// Bytes of a [`Mac`].
pub const MAC_BYTES: usize = 32;

/// A keyed hash: HMAC-SHA256.
pub type Mac = [u8; MAC_BYTES];

/// The shared secret of one deployment.
#[derive(Clone)]
pub struct ClusterSecret {
    key: Vec<u8>,
}

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

impl ClusterSecret {
    /// Fewest bytes a secret may have (after trimming surrounding whitespace): 16 random bytes
    /// written as 32 hex digits, or any longer passphrase.
    pub const MIN_BYTES: usize = 16;

    /// The secret `text` (a file's content: surrounding whitespace and newlines trimmed); an
    /// error when it is shorter than [`Self::MIN_BYTES`].
    pub fn new(text: &[u8]) -> Result<Self, String> {
        let key = text.trim_ascii();
        if key.len() < Self::MIN_BYTES {
            return Err(format!(
                "a cluster secret needs at least {} bytes (this one has {}); make one with `openssl rand -hex 32`",
                Self::MIN_BYTES,
                key.len()
            ));
        }
        Ok(Self { key: key.to_vec() })
    }

    /// HMAC-SHA256 under the secret of `label` and `parts`, each length-prefixed so that no
    /// two different lists hash the same bytes.
    pub fn mac(&self, label: &str, parts: &[&[u8]]) -> Mac {
        keyed(&self.key, label, parts)
    }

    /// The token internal HTTP endpoints (an engine's /kv/*, the router's /admin/engines)
    /// take in the [`CLUSTER_TOKEN_HEADER`] header from the deployment's own processes: a keyed
    /// hash of the secret, so a leaked token does not give the KV side channel away.
    pub fn http_token(&self) -> String {
        hex(&self.mac("tandem internal http v1", &[]))
    }

    /// An engine's answer to a router's `challenge` (`GET /kv/prove`): proof that it holds the
    /// secret, asked before the router sends an engine it found (on its command line, through
    /// `/admin/engines` or through discovery) its token or API key, so an engine that is not the
    /// deployment's learns neither.
    pub fn engine_proof(&self, challenge: &[u8]) -> String {
        hex(&self.mac("tandem engine proof v1", &[challenge]))
    }

    /// Whether `proof` answers `challenge` ([`Self::engine_proof`]), in constant time.
    pub fn check_engine_proof(&self, challenge: &[u8], proof: &[u8]) -> bool {
        constant_time_eq(proof.trim_ascii(), self.engine_proof(challenge).as_bytes())
    }

    /// Whether `header` (the [`CLUSTER_TOKEN_HEADER`] value) is [`Self::http_token`], compared
    /// in constant time.
    pub fn allows_token(&self, header: Option<&[u8]>) -> bool {
        let Some(token) = header.map(<[u8]>::trim_ascii) else { return false };
        constant_time_eq(token, self.http_token().as_bytes())
    }
}

/// The header the deployment's own processes send the cluster token in (beside any API key in
/// `Authorization`).
pub const CLUSTER_TOKEN_HEADER: &str = "x-tandem-cluster-token";

/// The header a router sends its fresh challenge to an engine in (`GET /kv/prove`).
pub const CLUSTER_CHALLENGE_HEADER: &str = "x-tandem-cluster-challenge";

/// HMAC-SHA256 under `key` of `label` and `parts`, each length-prefixed.
pub fn keyed(key: &[u8], label: &str, parts: &[&[u8]]) -> Mac {
    let mut mac = <Hmac<Sha256> as hmac::Mac>::new_from_slice(key).expect("HMAC takes a key of any length");
    for part in std::iter::once(label.as_bytes()).chain(parts.iter().copied()) {
        mac.update(&(part.len() as u64).to_be_bytes());
        mac.update(part);
    }
    mac.finalize().into_bytes().into()
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The token of a `Bearer TOKEN` header value.
pub(crate) fn bearer_token(header: &[u8]) -> Option<&[u8]> {
    let (scheme, token) = header.split_at(header.iter().position(|&b| b == b' ')?);
    scheme.eq_ignore_ascii_case(b"bearer").then(|| token.trim_ascii()).filter(|t| !t.is_empty())
}

/// Whether `a` and `b` are equal, in a time that depends only on their lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_secret_is_refused_and_whitespace_is_not_part_of_it() {
        assert!(ClusterSecret::new(b"too short").unwrap_err().contains("at least 16 bytes"));
        let a = ClusterSecret::new(b"0123456789abcdef0123\n").unwrap();
        let b = ClusterSecret::new(b"  0123456789abcdef0123").unwrap();
        assert_eq!(a.mac("x", &[b"1"]), b.mac("x", &[b"1"]));
        assert_eq!(format!("{a:?}"), "ClusterSecret(..)", "the secret never shows in logs");
    }

    #[test]
    fn macs_depend_on_the_secret_the_label_and_how_the_parts_split() {
        let a = ClusterSecret::new(b"0123456789abcdef0123").unwrap();
        let b = ClusterSecret::new(b"0123456789abcdef0124").unwrap();
        assert_ne!(a.mac("x", &[b"1"]), b.mac("x", &[b"1"]));
        assert_ne!(a.mac("x", &[b"1"]), a.mac("y", &[b"1"]));
        assert_ne!(a.mac("x", &[b"ab", b"c"]), a.mac("x", &[b"a", b"bc"]));
    }

    #[test]
    fn only_the_secrets_token_passes() {
        let a = ClusterSecret::new(b"0123456789abcdef0123").unwrap();
        let b = ClusterSecret::new(b"another secret entirely").unwrap();
        let token = a.http_token();
        assert!(a.allows_token(Some(token.as_bytes())));
        assert!(!b.allows_token(Some(token.as_bytes())));
        assert!(!a.allows_token(Some(&token.as_bytes()[1..])));
        assert!(!a.allows_token(Some(b"0123456789abcdef0123")), "the secret itself is not the token");
        assert!(!a.allows_token(None));
        assert_eq!(a.http_token().len(), 64);
    }
}
