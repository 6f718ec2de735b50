//! Signing and verification: DSSE PAE, agents' envelopes, the broker's
//! sealed payloads, key ids, digests. Pure computation over bytes — no
//! storage, no transport, no clock.

use ed25519_dalek::{Signer, SigningKey, VerifyingKey};
use sha2::{Digest, Sha256};

use crate::pb;
pub use broker_domain::limits::MAX_SIGNATURES;

/// Media types of every signed payload. PAE binds the type into the
/// signature, so a signature over one message can never pass as another.
pub mod payload_type {
    pub const CONTRACT: &str = "application/vnd.delegation.broker.v1.Contract+protobuf";
    pub const RECEIPT: &str = "application/vnd.delegation.broker.v1.Receipt+protobuf";
    pub const ATTESTATION: &str = "application/vnd.delegation.broker.v1.Attestation+protobuf";
    pub const OPEN_ROOT: &str = "application/vnd.delegation.broker.v1.OpenRootBody+protobuf";
    pub const DELEGATE: &str = "application/vnd.delegation.broker.v1.DelegateBody+protobuf";
    pub const ACCEPT: &str = "application/vnd.delegation.broker.v1.AcceptBody+protobuf";
    pub const DECLINE: &str = "application/vnd.delegation.broker.v1.DeclineBody+protobuf";
    pub const COMPLETE: &str = "application/vnd.delegation.broker.v1.CompleteBody+protobuf";
    pub const ADJUDICATE: &str = "application/vnd.delegation.broker.v1.AdjudicateBody+protobuf";
    pub const ESCALATE: &str = "application/vnd.delegation.broker.v1.EscalateBody+protobuf";
    pub const REVOKE: &str = "application/vnd.delegation.broker.v1.RevokeBody+protobuf";
    pub const OPEN_SESSION: &str = "application/vnd.delegation.broker.v1.OpenSessionBody+protobuf";
    pub const BIND_IDENTITY: &str =
        "application/vnd.delegation.broker.v1.BindIdentityBody+protobuf";
    pub const SESSION: &str = "application/vnd.delegation.broker.v1.Session+protobuf";
    pub const RECORD_RECEIPTS: &str =
        "application/vnd.delegation.broker.v1.RecordReceiptsBody+protobuf";
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CryptoError {
    #[error("payload_type is {found:?}, expected {expected:?}")]
    WrongPayloadType {
        expected: &'static str,
        found: String,
    },
    #[error("no signature verifies with the expected key")]
    BadSignature,
    #[error("{0} signatures, at most {MAX_SIGNATURES} allowed")]
    TooManySignatures(usize),
    #[error("public key is not a valid ed25519 point")]
    BadPublicKey,
    #[error("public key must be 32 bytes, got {0}")]
    PublicKeyLength(usize),
}

/// DSSE's pre-authentication encoding:
/// `"DSSEv1" SP LEN(type) SP type SP LEN(body) SP body`.
pub fn pae(payload_type: &str, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + payload_type.len() + 32);
    out.extend_from_slice(b"DSSEv1 ");
    out.extend_from_slice(payload_type.len().to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(payload_type.as_bytes());
    out.push(b' ');
    out.extend_from_slice(payload.len().to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(payload);
    out
}

pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// "ed25519:" + hex of the first 16 bytes of SHA-256(public key).
pub fn key_id(public_key: &[u8; 32]) -> String {
    format!("ed25519:{}", hex::encode(&sha256(public_key)[..16]))
}

/// Parses a 32-byte public key from client bytes. Valid keys are
/// remembered (see `KEY_CACHE_ENTRIES`): decoding one is a point
/// decompression (~4.5 µs), done twice per Delegate, and agents reuse
/// their keys.
pub fn public_key(bytes: &[u8]) -> Result<VerifyingKey, CryptoError> {
    let array: &[u8; 32] = bytes
        .try_into()
        .map_err(|_| CryptoError::PublicKeyLength(bytes.len()))?;
    let cache = KEY_CACHE.get_or_init(Default::default);
    if let Some(key) = lock_keys(cache).get(array) {
        return Ok(*key);
    }
    let key = VerifyingKey::from_bytes(array).map_err(|_| CryptoError::BadPublicKey)?;
    remember(&mut lock_keys(cache), key, KEY_CACHE_ENTRIES);
    Ok(key)
}

/// Adds a decoded key, bounded by forgetting everything at once when
/// full: simple, and a full cache only costs one decompression per key to
/// refill — so a client flooding it with fresh keys (it is filled before
/// the signature is checked) costs no more than having no cache.
fn remember(
    keys: &mut std::collections::HashMap<[u8; 32], VerifyingKey>,
    key: VerifyingKey,
    capacity: usize,
) {
    if keys.len() >= capacity {
        keys.clear();
    }
    keys.insert(key.to_bytes(), key);
}

/// Most decoded keys remembered (about 200 bytes each: a few MiB).
pub const KEY_CACHE_ENTRIES: usize = 16_384;

type KeyCache = std::sync::Mutex<std::collections::HashMap<[u8; 32], VerifyingKey>>;

/// Decoded keys by their bytes. A memo of a pure function: a hit returns
/// exactly what decoding would.
static KEY_CACHE: std::sync::OnceLock<KeyCache> = std::sync::OnceLock::new();

fn lock_keys(
    cache: &KeyCache,
) -> std::sync::MutexGuard<'_, std::collections::HashMap<[u8; 32], VerifyingKey>> {
    // A panic while holding the lock cannot leave a wrong entry (inserts
    // are single calls), so a poisoned cache is still a good one.
    cache
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A fresh signing key from the operating system's CSPRNG.
pub fn generate_signing_key() -> SigningKey {
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed).expect("the operating system's CSPRNG is available");
    SigningKey::from_bytes(&seed)
}

/// Signs `payload` as a single-signature DSSE envelope.
pub fn sign_envelope(key: &SigningKey, payload_type: &str, payload: Vec<u8>) -> pb::Envelope {
    let signature = key.sign(&pae(payload_type, &payload));
    pb::Envelope {
        payload_type: payload_type.to_owned(),
        payload,
        signatures: vec![pb::Signature {
            keyid: key_id(&key.verifying_key().to_bytes()),
            sig: signature.to_bytes().to_vec(),
        }],
    }
}

/// Seals `payload` as the broker signs it: the payload and one signature
/// over PAE(payload_type, payload); the type is implied by where the
/// `Sealed` travels, the key id is inside the payload.
pub fn seal(key: &SigningKey, payload_type: &str, payload: Vec<u8>) -> pb::Sealed {
    let signature = key.sign(&pae(payload_type, &payload));
    pb::Sealed {
        payload,
        signature: signature.to_bytes().to_vec(),
    }
}

/// Checks a sealed payload's signature as `payload_type` under `key`
/// (strict verification).
pub fn verify_sealed(
    sealed: &pb::Sealed,
    payload_type: &str,
    key: &VerifyingKey,
) -> Result<(), CryptoError> {
    let signature = ed25519_dalek::Signature::from_slice(&sealed.signature)
        .map_err(|_| CryptoError::BadSignature)?;
    key.verify_strict(&pae(payload_type, &sealed.payload), &signature)
        .map_err(|_| CryptoError::BadSignature)
}

/// Checks the payload type and that some signature verifies under `key`
/// (strict verification: no malleable or small-order signatures).
pub fn verify_envelope(
    envelope: &pb::Envelope,
    expected_type: &'static str,
    key: &VerifyingKey,
) -> Result<(), CryptoError> {
    if envelope.payload_type != expected_type {
        return Err(CryptoError::WrongPayloadType {
            expected: expected_type,
            found: envelope.payload_type.chars().take(128).collect(),
        });
    }
    if envelope.signatures.len() > MAX_SIGNATURES {
        return Err(CryptoError::TooManySignatures(envelope.signatures.len()));
    }
    let message = pae(&envelope.payload_type, &envelope.payload);
    let verified = envelope.signatures.iter().any(|s| {
        ed25519_dalek::Signature::from_slice(&s.sig)
            .is_ok_and(|sig| key.verify_strict(&message, &sig).is_ok())
    });
    if verified {
        Ok(())
    } else {
        Err(CryptoError::BadSignature)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pae_matches_the_dsse_specification_example() {
        // From the DSSE protocol document.
        assert_eq!(
            pae("http://example.com/HelloWorld", b"hello world"),
            b"DSSEv1 29 http://example.com/HelloWorld 11 hello world".to_vec()
        );
    }

    #[test]
    fn remembered_keys_are_the_decoded_keys_and_bounded() {
        let key = generate_signing_key().verifying_key();
        let bytes = key.to_bytes();
        assert_eq!(public_key(&bytes).unwrap(), key);
        assert_eq!(public_key(&bytes).unwrap(), key, "a cache hit");
        // An invalid point is refused every time (never remembered).
        // (About half of all y coordinates are not on the curve.)
        let bad = (2u8..=255)
            .map(|y| {
                let mut bytes = [0u8; 32];
                bytes[0] = y;
                bytes
            })
            .find(|bytes| VerifyingKey::from_bytes(bytes).is_err())
            .expect("an invalid encoding");
        for _ in 0..2 {
            assert_eq!(public_key(&bad), Err(CryptoError::BadPublicKey));
        }
        assert_eq!(
            public_key(&[1u8; 31]),
            Err(CryptoError::PublicKeyLength(31))
        );
        let mut keys = std::collections::HashMap::new();
        for _ in 0..5 {
            remember(&mut keys, generate_signing_key().verifying_key(), 2);
            assert!(keys.len() <= 2);
        }
    }

    #[test]
    fn sealed_payloads_verify_and_tampering_fails() {
        let key = generate_signing_key();
        let sealed = seal(&key, payload_type::CONTRACT, b"payload".to_vec());
        let vk = key.verifying_key();
        verify_sealed(&sealed, payload_type::CONTRACT, &vk).unwrap();
        // The type is bound through PAE although it is not carried.
        assert_eq!(
            verify_sealed(&sealed, payload_type::RECEIPT, &vk),
            Err(CryptoError::BadSignature)
        );
        let mut tampered = sealed.clone();
        tampered.payload[0] ^= 1;
        let mut short = sealed.clone();
        short.signature.pop();
        let other = generate_signing_key().verifying_key();
        for (bad, key) in [(&tampered, &vk), (&short, &vk), (&sealed, &other)] {
            let checked = verify_sealed(bad, payload_type::CONTRACT, key);
            assert_eq!(checked, Err(CryptoError::BadSignature));
        }
    }

    #[test]
    fn envelopes_verify_and_tampering_fails() {
        let key = generate_signing_key();
        let env = sign_envelope(&key, payload_type::RECEIPT, b"payload".to_vec());
        let vk = key.verifying_key();
        verify_envelope(&env, payload_type::RECEIPT, &vk).unwrap();
        assert!(matches!(
            verify_envelope(&env, payload_type::CONTRACT, &vk),
            Err(CryptoError::WrongPayloadType { .. })
        ));
        let mut tampered = env.clone();
        tampered.payload[0] ^= 1;
        let other = generate_signing_key().verifying_key();
        for (bad, key) in [(&tampered, &vk), (&env, &other)] {
            let checked = verify_envelope(bad, payload_type::RECEIPT, key);
            assert_eq!(checked, Err(CryptoError::BadSignature));
        }
    }
}
