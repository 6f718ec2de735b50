//! What an agent runtime written in Rust needs to talk to the broker: an
//! agent key, signed requests (with a fresh timestamp and nonce), and
//! attestations when acting as an attestor. Used by `bench` and the tests;
//! mirrors the Python helper layer.

use ed25519_dalek::SigningKey;
use prost::Message;

use crate::clock::{Clock, SystemClock};
use crate::crypto::{self, payload_type};
use crate::pb;

/// An agent (or attestor) key pair.
pub struct Agent {
    key: SigningKey,
}

impl Agent {
    pub fn generate() -> Self {
        Self {
            key: crypto::generate_signing_key(),
        }
    }

    pub fn from_seed(seed: [u8; 32]) -> Self {
        Self {
            key: SigningKey::from_bytes(&seed),
        }
    }

    pub fn public_key(&self) -> [u8; 32] {
        self.key.verifying_key().to_bytes()
    }

    pub fn seed(&self) -> [u8; 32] {
        self.key.to_bytes()
    }

    /// A header with the current time and a fresh random nonce.
    pub fn header(&self) -> pb::RequestHeader {
        let mut nonce = vec![0u8; 16];
        getrandom::fill(&mut nonce).expect("the operating system's CSPRNG is available");
        pb::RequestHeader {
            agent_public_key: self.public_key().to_vec(),
            timestamp_ms: SystemClock.now_ms(),
            nonce,
        }
    }

    /// Signs any message as a single-signature envelope.
    pub fn sign<T: Message>(&self, payload_type: &str, body: &T) -> pb::Envelope {
        crypto::sign_envelope(&self.key, payload_type, body.encode_to_vec())
    }

    /// Signs an OpenRoot body, filling in a header if it has none.
    pub fn open_root(&self, mut body: pb::OpenRootBody) -> pb::OpenRootRequest {
        body.header.get_or_insert_with(|| self.header());
        pb::OpenRootRequest {
            signed: Some(self.sign(payload_type::OPEN_ROOT, &body)),
        }
    }

    /// Signs a Delegate body, filling in a header if it has none.
    pub fn delegate(&self, mut body: pb::DelegateBody) -> pb::DelegateRequest {
        body.header.get_or_insert_with(|| self.header());
        pb::DelegateRequest {
            signed: Some(self.sign(payload_type::DELEGATE, &body)),
        }
    }

    /// As an attestor: vouches for `agent` with `factor` until `expires_at_ms`.
    pub fn attest(
        &self,
        agent: [u8; 32],
        factor: f64,
        expires_at_ms: i64,
        risk_class: &str,
    ) -> pb::Envelope {
        self.sign(
            payload_type::ATTESTATION,
            &pb::Attestation {
                agent_public_key: agent.to_vec(),
                factor,
                risk_class: risk_class.to_owned(),
                expires_at_ms,
                not_before_ms: 0,
            },
        )
    }
}
