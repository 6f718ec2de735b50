//! Signing and verification: DSSE PAE, envelopes, key ids, digests. Pure
//! computation over bytes — no storage, no transport, no clock.

use ed25519_dalek::{Signer, SigningKey, VerifyingKey};
use sha2::{Digest, Sha256};

use crate::pb;

/// Media types of every signed payload. PAE binds the type into the
/// signature, so a signature over one message can never pass as another.
pub mod payload_type {
    pub const CONTRACT: &str = "application/vnd.delegation.broker.v1.Contract+protobuf";
    pub const HOP_PROOF: &str = "application/vnd.delegation.broker.v1.HopProof+protobuf";
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
    pub const RECORD_RECEIPTS: &str =
        "application/vnd.delegation.broker.v1.RecordReceiptsBody+protobuf";
}

/// Most signatures an envelope may carry: bounds verification work per
/// request.
pub const MAX_SIGNATURES: usize = 4;

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

/// Parses a 32-byte public key from client bytes.
pub fn public_key(bytes: &[u8]) -> Result<VerifyingKey, CryptoError> {
    let array: &[u8; 32] = bytes
        .try_into()
        .map_err(|_| CryptoError::PublicKeyLength(bytes.len()))?;
    VerifyingKey::from_bytes(array).map_err(|_| CryptoError::BadPublicKey)
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
        assert_eq!(
            verify_envelope(&tampered, payload_type::RECEIPT, &vk),
            Err(CryptoError::BadSignature)
        );
        let other = generate_signing_key().verifying_key();
        assert_eq!(
            verify_envelope(&env, payload_type::RECEIPT, &other),
            Err(CryptoError::BadSignature)
        );
    }
}
