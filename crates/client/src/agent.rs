//! An agent's key, its signed requests (with a fresh timestamp and nonce),
//! attestations when acting as an attestor, and the read session its
//! calls carry. Mirrors the Python and TypeScript helper layers.

use ed25519_dalek::SigningKey;
use prost::Message;

use broker_wire::clock::{Clock, SystemClock};
use broker_wire::crypto::{self, payload_type};
use broker_wire::pb;

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

    /// A signed BindIdentity request: binds this key to the workload
    /// identity `token` (a JWT-SVID or OIDC token) proves.
    pub fn bind_identity(&self, token: &str) -> pb::BindIdentityRequest {
        let body = pb::BindIdentityBody {
            header: Some(self.header()),
            token: token.to_owned(),
        };
        pb::BindIdentityRequest {
            signed: Some(self.sign(payload_type::BIND_IDENTITY, &body)),
        }
    }

    /// The assertion that proves this agent holds `contract_id` to the
    /// token endpoint at `token_endpoint` (a JWT it signs itself, EdDSA,
    /// living `lifetime_s`).
    pub fn token_assertion(
        &self,
        token_endpoint: &str,
        contract_id: &[u8; 32],
        now_s: i64,
        lifetime_s: i64,
    ) -> String {
        let mut jti = [0u8; 16];
        getrandom::fill(&mut jti).expect("the operating system's CSPRNG is available");
        let me = hex::encode(self.public_key());
        let serde_json::Value::Object(claims) = serde_json::json!({
            "iss": me,
            "sub": me,
            "aud": token_endpoint,
            "iat": now_s,
            "exp": now_s + lifetime_s,
            "jti": hex::encode(jti),
            "contract_id": hex::encode(contract_id),
        }) else {
            unreachable!("a JSON object literal")
        };
        broker_wire::jwt::sign(&self.key, "JWT", None, &claims)
    }

    /// Signs any message as a single-signature envelope.
    pub fn sign<T: Message>(&self, payload_type: &str, body: &T) -> pb::Envelope {
        crypto::sign_envelope(&self.key, payload_type, body.encode_to_vec())
    }

    /// A signed OpenSession request for the broker whose current key id is
    /// `broker_key_id` (from GetBrokerKeys): the broker answers with a
    /// session for this key, to attach to reads (see `SessionAttacher`).
    pub fn open_session(&self, broker_key_id: &str) -> pb::OpenSessionRequest {
        let body = pb::OpenSessionBody {
            header: Some(self.header()),
            broker_key_id: broker_key_id.to_owned(),
        };
        pb::OpenSessionRequest {
            signed: Some(self.sign(payload_type::OPEN_SESSION, &body)),
        }
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

/// A gRPC client whose every call carries the session its `SessionAttacher`
/// holds (reads need one; other calls ignore it).
pub type SessionClient = pb::broker_client::BrokerClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, SessionAttacher>,
>;

/// Attaches a read session (`x-broker-session-bin` metadata) to every call
/// of a client that does not carry one of its own; set or replace the
/// session at any time, e.g. before it expires. Clones share the session.
#[derive(Clone, Default)]
pub struct SessionAttacher(
    std::sync::Arc<std::sync::RwLock<Option<tonic::metadata::BinaryMetadataValue>>>,
);

impl SessionAttacher {
    /// Uses `session` (OpenSessionResponse.session) from now on.
    pub fn set(&self, session: &pb::Sealed) {
        let value = tonic::metadata::BinaryMetadataValue::from_bytes(&session.encode_to_vec());
        *self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(value);
    }

    /// A client over `channel` that sends this attacher's session.
    pub fn client(&self, channel: tonic::transport::Channel) -> SessionClient {
        pb::broker_client::BrokerClient::with_interceptor(channel, self.clone())
    }

    /// Opens a session for `agent` on the broker behind `client` (asking
    /// it for its current key first) and attaches it from now on.
    pub async fn open(
        &self,
        client: &mut SessionClient,
        agent: &Agent,
    ) -> Result<(), tonic::Status> {
        let keys = client
            .get_broker_keys(pb::GetBrokerKeysRequest {})
            .await?
            .into_inner()
            .keys;
        let current = keys
            .iter()
            .find(|k| k.current)
            .ok_or_else(|| tonic::Status::internal("the broker published no current key"))?;
        let session = client
            .open_session(agent.open_session(&current.key_id))
            .await?
            .into_inner();
        let envelope = session
            .session
            .ok_or_else(|| tonic::Status::internal("OpenSession answered no session"))?;
        self.set(&envelope);
        Ok(())
    }
}

impl tonic::service::Interceptor for SessionAttacher {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        let session = self
            .0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        // A call that carries its own session keeps it.
        let key = broker_wire::names::SESSION_METADATA;
        if let Some(value) = session
            && request.metadata().get_bin(key).is_none()
        {
            request.metadata_mut().insert_bin(key, value);
        }
        Ok(request)
    }
}
