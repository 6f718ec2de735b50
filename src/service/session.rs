//! Read sessions: who is reading. A caller proves its
//! key once with a signed OpenSession request and gets a broker-signed
//! `Session`; each read carries it as `x-broker-session-bin` metadata. The
//! session is self-contained (checked against current keys alone: a
//! session signed by a key since retired is refused as BAD_SESSION, so a
//! rotation ends every session), and nothing about sessions is stored. On
//! a replicated broker every replica's current key is current: a session
//! opened through one replica reads through any other.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ed25519_dalek::VerifyingKey;
use prost::Message;
use tonic::metadata::MetadataMap;

use super::error::ServiceError;
use crate::core::AgentKey;
use crate::crypto::{self, payload_type};
use crate::pb;
use crate::stamp::Stamper;

use super::limits::MAX_VERIFIED_SESSIONS;
use crate::core::limits::MAX_SESSION_BYTES;
/// The binary metadata key a read's session travels in.
pub use crate::names::SESSION_METADATA;

/// Issues and checks sessions.
pub struct Sessions {
    stamper: Arc<Stamper>,
    /// This broker's current signing key: sessions are accepted from it
    /// and from the other current keys `published` lists (replicas), never
    /// from a retired key (perhaps retired because it leaked).
    current: (String, VerifyingKey),
    /// The keys GetBrokerKeys publishes (a replicated broker's include
    /// every replica's).
    published: super::PublishedKeys,
    ttl_ms: i64,
    /// Digest of a verified session envelope → (agent, expiry, the id of
    /// the key that sealed it: still checked at every use, so a key
    /// retired since stops its sessions at once).
    verified: Mutex<HashMap<[u8; 32], Verified>>,
}

/// A verified session: its agent, expiry and sealing key's id.
type Verified = (AgentKey, i64, String);

fn unauthenticated(reason: pb::ErrorReason, detail: impl Into<String>) -> ServiceError {
    ServiceError::Unauthenticated {
        reason,
        detail: detail.into(),
    }
}

impl Sessions {
    pub fn new(stamper: Arc<Stamper>, current: VerifyingKey, ttl_ms: i64) -> Self {
        let current = (crypto::key_id(&current.to_bytes()), current);
        Self {
            stamper,
            current,
            published: super::PublishedKeys::default(),
            ttl_ms,
            verified: Mutex::default(),
        }
    }

    /// Also accepts sessions (and OpenSession audiences) of the other
    /// current keys in `published`: a replicated broker's replicas.
    pub fn with_published(mut self, published: super::PublishedKeys) -> Self {
        self.published = published;
        self
    }

    /// The current key with this id: this broker's, or a replica's.
    fn current_key(&self, key_id: &str) -> Option<VerifyingKey> {
        if key_id == self.current.0 {
            // Its own key, unless the registry retired it (an operator's
            // `keys retire`): then not even this replica accepts it.
            let retired = self
                .published
                .read()
                .0
                .iter()
                .any(|k| k.key_id == key_id && !k.current);
            return (!retired).then_some(self.current.1);
        }
        self.published
            .read()
            .0
            .iter()
            .find(|k| k.current && k.key_id == key_id)
            .and_then(|k| crypto::public_key(&k.public_key).ok())
    }

    /// Checks that an OpenSession request was meant for this broker.
    pub fn check_audience(&self, broker_key_id: &str) -> Result<(), ServiceError> {
        if broker_key_id.is_empty() {
            return Err(crate::core::InputError::new(
                "body.broker_key_id",
                "is required: the key id of this broker's current key (GetBrokerKeys)",
            )
            .into());
        }
        if self.current_key(broker_key_id).is_none() {
            return Err(unauthenticated(
                pb::ErrorReason::WrongBroker,
                "body.broker_key_id is not this broker's current key: the request was meant for another broker (or a retired key)",
            ));
        }
        Ok(())
    }

    /// A new session for `agent`, who proved its key just now.
    pub fn open(&self, agent: AgentKey, now_ms: i64) -> pb::OpenSessionResponse {
        let expires_at_ms = now_ms.saturating_add(self.ttl_ms);
        let session = pb::Session {
            broker_key_id: String::new(),
            agent_public_key: agent.to_vec(),
            issued_at_ms: now_ms,
            expires_at_ms,
        };
        pb::OpenSessionResponse {
            session: Some(self.stamper.sign_session(&session)),
            expires_at_ms,
        }
    }

    /// The reading agent, from the request's session metadata.
    pub fn caller(&self, metadata: &MetadataMap, now_ms: i64) -> Result<AgentKey, ServiceError> {
        let Some(value) = metadata.get_bin(SESSION_METADATA) else {
            return Err(unauthenticated(
                pb::ErrorReason::NoSession,
                format!(
                    "reads need a session: call OpenSession and send the session it returns (a Sealed, serialized) as {SESSION_METADATA} metadata"
                ),
            ));
        };
        let bytes = value.to_bytes().map_err(|_| {
            unauthenticated(
                pb::ErrorReason::BadSession,
                "the session metadata is not base64",
            )
        })?;
        if bytes.len() > MAX_SESSION_BYTES {
            return Err(unauthenticated(
                pb::ErrorReason::BadSession,
                format!("the session is over {MAX_SESSION_BYTES} bytes"),
            ));
        }
        let digest = crypto::sha256(&bytes);
        let known = self.lock().get(&digest).cloned();
        let (agent, expires_at_ms, _) = match known {
            Some((_, _, key_id)) if self.current_key(&key_id).is_none() => {
                self.lock().remove(&digest);
                return Err(unauthenticated(
                    pb::ErrorReason::BadSession,
                    "the session was not signed by this broker's current key (open a new one)",
                ));
            }
            Some(known) => known,
            None => {
                let checked = self.verify(&bytes)?;
                let mut verified = self.lock();
                if verified.len() >= MAX_VERIFIED_SESSIONS {
                    verified.clear();
                }
                verified.insert(digest, checked.clone());
                checked
            }
        };
        if now_ms >= expires_at_ms {
            return Err(unauthenticated(
                pb::ErrorReason::SessionExpired,
                format!("the session expired at {expires_at_ms}; open a new one"),
            ));
        }
        Ok(agent)
    }

    fn verify(&self, bytes: &[u8]) -> Result<Verified, ServiceError> {
        let bad = |detail: &str| unauthenticated(pb::ErrorReason::BadSession, detail.to_owned());
        let envelope =
            pb::Sealed::decode(bytes).map_err(|_| bad("the session is not a Sealed Session"))?;
        let session = pb::Session::decode(envelope.payload.as_slice())
            .map_err(|_| bad("the session's payload is not a Session"))?;
        let Some(key) = self.current_key(&session.broker_key_id) else {
            return Err(bad(
                "the session was not signed by this broker's current key (open a new one)",
            ));
        };
        crypto::verify_sealed(&envelope, payload_type::SESSION, &key)
            .map_err(|_| bad("the session's signature does not verify"))?;
        // Only this broker's sessions verify, and it never issues one longer
        // than its lifetime: a longer one was not made by this code.
        if session.expires_at_ms.saturating_sub(session.issued_at_ms) > self.ttl_ms {
            return Err(bad("the session outlives the broker's session lifetime"));
        }
        let agent: AgentKey = session
            .agent_public_key
            .as_slice()
            .try_into()
            .map_err(|_| bad("the session names no agent"))?;
        Ok((agent, session.expires_at_ms, session.broker_key_id))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Verified>> {
        // A memo of pure checks: a poisoned one is still correct.
        self.verified
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::metadata::MetadataValue;

    fn broker(seed: u8) -> (Sessions, pb::BrokerKey) {
        let key = ed25519_dalek::SigningKey::from_bytes(&[seed; 32]);
        let public = key.verifying_key().to_bytes();
        let published = pb::BrokerKey {
            key_id: crypto::key_id(&public),
            public_key: public.to_vec(),
            current: true,
            retired_at_ms: 0,
        };
        let sessions = Sessions::new(
            Arc::new(Stamper::new(key.clone())),
            key.verifying_key(),
            1_000,
        );
        (sessions, published)
    }

    fn metadata(envelope: &pb::Sealed) -> MetadataMap {
        let mut m = MetadataMap::new();
        m.insert_bin(
            SESSION_METADATA,
            MetadataValue::from_bytes(&envelope.encode_to_vec()),
        );
        m
    }

    #[test]
    fn a_session_names_its_agent_until_it_expires_and_cannot_be_forged() {
        let (sessions, _) = broker(1);
        let opened = sessions.open([7; 32], 100);
        let envelope = opened.session.unwrap();
        assert_eq!(opened.expires_at_ms, 1_100);
        assert_eq!(sessions.caller(&metadata(&envelope), 500).unwrap(), [7; 32]);
        // Again, from the memo.
        assert_eq!(sessions.caller(&metadata(&envelope), 500).unwrap(), [7; 32]);
        let reason = |e: ServiceError| match e {
            ServiceError::Unauthenticated { reason, .. } => reason,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            reason(sessions.caller(&metadata(&envelope), 1_100).unwrap_err()),
            pb::ErrorReason::SessionExpired
        );
        assert_eq!(
            reason(sessions.caller(&MetadataMap::new(), 500).unwrap_err()),
            pb::ErrorReason::NoSession
        );
        // Another agent's key swapped into the payload breaks the signature.
        let mut forged = envelope.clone();
        let mut session = pb::Session::decode(forged.payload.as_slice()).unwrap();
        session.agent_public_key = vec![8; 32];
        forged.payload = session.encode_to_vec();
        assert_eq!(
            reason(sessions.caller(&metadata(&forged), 500).unwrap_err()),
            pb::ErrorReason::BadSession
        );
        // A session from another broker is not this broker's.
        let (other, _) = broker(2);
        let foreign = other.open([7; 32], 100).session.unwrap();
        assert_eq!(
            reason(sessions.caller(&metadata(&foreign), 500).unwrap_err()),
            pb::ErrorReason::BadSession
        );
        // A session longer than the lifetime was not issued by this code
        // (a leaked key could sign one): refused.
        let key = ed25519_dalek::SigningKey::from_bytes(&[1; 32]);
        let long = Stamper::new(key).sign_session(&pb::Session {
            broker_key_id: String::new(),
            agent_public_key: vec![7; 32],
            issued_at_ms: 100,
            expires_at_ms: 100 + 1_001,
        });
        assert_eq!(
            reason(sessions.caller(&metadata(&long), 500).unwrap_err()),
            pb::ErrorReason::BadSession
        );
        // OpenSession requests name the broker they are for.
        let (_, published) = broker(1);
        assert!(sessions.check_audience(&published.key_id).is_ok());
        assert!(matches!(
            sessions.check_audience("other"),
            Err(ServiceError::Unauthenticated {
                reason: pb::ErrorReason::WrongBroker,
                ..
            })
        ));
        assert!(matches!(
            sessions.check_audience(""),
            Err(ServiceError::Invalid(_))
        ));
    }
}
