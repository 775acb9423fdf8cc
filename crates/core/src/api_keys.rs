//! Who may use an OpenAI API: the keys a server or router accepts as `Authorization: Bearer
//! KEY` (`--api-key`, as vLLM's), checked without the time it takes saying how much of a key
//! matched.

use sha2::{Digest, Sha256};

use crate::cluster_secret::{bearer_token, constant_time_eq};

/// The API keys a server accepts; none: every caller is let in.
#[derive(Clone, Default)]
pub struct ApiKeys {
    /// SHA-256 of each key: a presented key is hashed and compared with every digest in
    /// constant time, so neither its length nor a matching prefix shows in the timing.
    digests: Vec<[u8; 32]>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} keys)", self.digests.len())
    }
}

/// A key that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("an API key must be non-empty printable ASCII without spaces (HTTP headers carry it)")]
pub struct InvalidApiKey;

impl ApiKeys {
    /// Accepts each of `keys` (surrounding whitespace trimmed); an error for an empty key or
    /// one an HTTP header cannot carry.
    pub fn new<S: AsRef<str>>(keys: impl IntoIterator<Item = S>) -> Result<Self, InvalidApiKey> {
        let mut digests = Vec::new();
        for key in keys {
            let key = key.as_ref().trim();
            if key.is_empty() || !key.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(InvalidApiKey);
            }
            digests.push(digest(key.as_bytes()));
        }
        Ok(Self { digests })
    }

    /// Whether any key is required.
    pub fn required(&self) -> bool {
        !self.digests.is_empty()
    }

    /// Whether a request whose `Authorization` header is `header` may pass: always, when no
    /// key is required; else when it is `Bearer KEY` (the scheme in any case) with one of the
    /// keys.
    pub fn allows(&self, header: Option<&[u8]>) -> bool {
        if !self.required() {
            return true;
        }
        let Some(token) = header.and_then(bearer_token) else { return false };
        let presented = digest(token);
        // Every digest is compared in full, with no early exit.
        self.digests.iter().fold(false, |found, d| found | constant_time_eq(d, &presented))
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_listed_bearer_key_passes_and_no_keys_let_everyone_in() {
        let keys = ApiKeys::new(["sk-one", " sk-two\n"]).unwrap();
        assert!(keys.required());
        assert!(keys.allows(Some(b"Bearer sk-one")));
        assert!(keys.allows(Some(b"bearer  sk-two ")), "scheme in any case, the token trimmed");
        for bad in [&b"Bearer sk-on"[..], b"Bearer sk-one1", b"Basic sk-one", b"sk-one", b"Bearer ", b""] {
            assert!(!keys.allows(Some(bad)), "{:?}", String::from_utf8_lossy(bad));
        }
        assert!(!keys.allows(None));
        let open = ApiKeys::new(Vec::<String>::new()).unwrap();
        assert!(!open.required() && open.allows(None));
        assert_eq!(ApiKeys::new([""]).unwrap_err(), InvalidApiKey);
        assert_eq!(ApiKeys::new(["two words"]).unwrap_err(), InvalidApiKey);
        assert_eq!(format!("{keys:?}"), "ApiKeys(2 keys)", "a key never shows in logs");
    }
}
