//! API keys: `flk_<id>_<secret>`, where `id` is a short public identifier (16 hex characters,
//! safe to log and to use as a rate limit descriptor) and `secret` is 32 bytes of OS randomness
//! (base64url). Only the SHA-256 of the whole key is stored; the key is shown once.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use rand::TryRngCore;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The recognisable prefix of every key (secret scanners can look for it).
pub const KEY_PREFIX: &str = "flk_";
const ID_BYTES: usize = 8;
const SECRET_BYTES: usize = 32;

/// A freshly issued key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedKey {
    /// The public id.
    pub id: String,
    /// The whole key, to be shown once.
    pub key: String,
    /// What is stored.
    pub hash: [u8; 32],
}

/// Why random bytes could not be had.
#[derive(Debug, thiserror::Error)]
#[error("the operating system's random number generator failed: {0}")]
pub struct RandomnessError(String);

fn os_random<const N: usize>() -> Result<[u8; N], RandomnessError> {
    let mut buf = [0u8; N];
    rand::rngs::OsRng
        .try_fill_bytes(&mut buf)
        .map_err(|e| RandomnessError(e.to_string()))?;
    Ok(buf)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Generates a new key from OS randomness.
pub fn generate() -> Result<IssuedKey, RandomnessError> {
    let id = hex(&os_random::<ID_BYTES>()?);
    let secret = URL_SAFE_NO_PAD.encode(os_random::<SECRET_BYTES>()?);
    let key = format!("{KEY_PREFIX}{id}_{secret}");
    let hash = hash_key(&key);
    Ok(IssuedKey { id, key, hash })
}

/// SHA-256 of the key text.
pub fn hash_key(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// The length of a key's public id: 16 lower-case hex characters.
pub const ID_LEN: usize = ID_BYTES * 2;

/// The length of a key's secret: its 32 bytes in base64url without padding, 43 characters.
pub const SECRET_LEN: usize = (SECRET_BYTES * 4).div_ceil(3);

/// The length of a whole key: prefix, id, `_`, secret.
const KEY_LEN: usize = KEY_PREFIX.len() + ID_LEN + 1 + SECRET_LEN;

/// Whether `id` has the form of a key's public id: 16 lower-case hex characters.
pub fn is_id(id: &str) -> bool {
    id.len() == ID_LEN && id.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
}

/// The public id of a well-formed key, `None` if the text cannot be a key.
pub fn parse_id(key: &str) -> Option<&str> {
    let rest = key.strip_prefix(KEY_PREFIX)?;
    let (id, secret) = rest.split_once('_')?;
    let id_ok = is_id(id);
    let secret_ok = secret.len() == SECRET_LEN
        && secret
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_');
    (id_ok && secret_ok).then_some(id)
}

/// The public id of a well-formed key found anywhere in `text` (a key pasted with its quotes,
/// a `Bearer ` prefix or a trailing space), `None` if there is none.
pub fn find_key_id(text: &str) -> Option<&str> {
    text.match_indices(KEY_PREFIX).find_map(|(start, _)| {
        let candidate = text.get(start..start + KEY_LEN)?;
        parse_id(candidate)
    })
}

/// Constant-time comparison of a presented key with a stored hash.
pub fn matches(key: &str, stored_hash: &[u8]) -> bool {
    bool::from(hash_key(key).as_slice().ct_eq(stored_hash))
}

/// Constant-time comparison of two secrets of any length (hashes both first).
pub fn secrets_equal(presented: &str, expected: &str) -> bool {
    bool::from(hash_key(presented).ct_eq(&hash_key(expected)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_keys_parse_and_match_their_hash_only() {
        let k = generate().unwrap();
        assert!(k.key.starts_with("flk_"));
        assert_eq!(parse_id(&k.key), Some(k.id.as_str()));
        assert!(matches(&k.key, &k.hash));
        let other = generate().unwrap();
        assert_ne!(k.key, other.key);
        assert!(!matches(&other.key, &k.hash));
        // At least 32 bytes of randomness: 43 base64url characters.
        assert_eq!(k.key.len(), 4 + 16 + 1 + 43);
    }

    #[test]
    fn malformed_keys_have_no_id() {
        let k = generate().unwrap();
        for bad in [
            "",
            "flk_",
            "flk_abc_def",
            &k.key[4..],
            &k.key[..k.key.len() - 1],
            &k.key.replace("flk_", "flx_"),
            "flk_0123456789ABCDEF_aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        ] {
            assert_eq!(parse_id(bad), None, "{bad}");
        }
    }

    #[test]
    fn only_lower_case_hex_of_the_right_length_is_an_id() {
        assert!(is_id(&generate().unwrap().id));
        assert!(is_id("0123456789abcdef"));
        for bad in [
            "",
            "0123456789abcde",
            "0123456789abcdef0",
            "0123456789ABCDEF",
            "0123456789abcde\0",
            "0123456789abcdeg",
        ] {
            assert!(!is_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn secret_comparison() {
        assert!(secrets_equal("token", "token"));
        assert!(!secrets_equal("token", "token2"));
        assert!(!secrets_equal("", "x"));
    }
}
