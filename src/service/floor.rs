//! The write path's floor (`bench --floor`): OpenRoot and Delegate answered
//! with exactly the crypto and RPC work issuance must do — the request
//! decoded and its signature verified (`auth::authenticate`), the
//! delegate's attestation checked as issuance checks it (decoded, its
//! signature verified once and remembered, `convert::resolve_trust`), a
//! contract of the same shape and size signed and returned — and nothing
//! else: no store, no rules, no fsync. Every write-path number in
//! BENCHMARKS.md is a ratio to it. Every other method is refused.

use ed25519_dalek::SigningKey;
use prost::Message;
use tonic::{Request, Response, Status};

use super::auth::{Authenticated, SignedBody, authenticate};
use super::convert;
use super::error::ServiceError;
use crate::clock::Clock;
use crate::config::TrustConfig;
use crate::crypto::{self, payload_type};
use crate::pb;
use crate::pb::broker_server::Broker;

/// Answers OpenRoot and Delegate as the floor of their cost.
pub struct FloorService {
    key: SigningKey,
    key_id: String,
    trust: TrustConfig,
    verified: convert::VerifiedAttestations,
    clock: std::sync::Arc<dyn Clock>,
    /// The timestamp window issuance applies (a stale request is refused
    /// here too: the floor never answers what the broker would not).
    window_ms: i64,
}

impl FloorService {
    pub fn new(
        key: SigningKey,
        trust: TrustConfig,
        clock: std::sync::Arc<dyn Clock>,
        window_ms: i64,
    ) -> Self {
        let key_id = crypto::key_id(&key.verifying_key().to_bytes());
        Self {
            key,
            key_id,
            trust,
            verified: convert::VerifiedAttestations::default(),
            clock,
            window_ms,
        }
    }

    /// Signs `contract` as the broker seals one: its id is the SHA-256 of
    /// the signed payload.
    fn issue(&self, contract: &pb::Contract) -> pb::IssuedContract {
        let payload = contract.encode_to_vec();
        let id = crypto::sha256(&payload);
        pb::IssuedContract {
            contract_id: id.to_vec(),
            contract: Some(crypto::seal(&self.key, payload_type::CONTRACT, payload)),
        }
    }

    /// The body of a signed request within the timestamp window (a stale
    /// one is refused as issuance refuses it).
    fn fresh<T: SignedBody>(
        &self,
        signed: Option<&pb::Envelope>,
        now_ms: i64,
    ) -> Result<Authenticated<T>, ServiceError> {
        let signed = authenticate::<T>(signed, now_ms, self.window_ms)?;
        if !signed.fresh {
            return Err(signed.stale_error(now_ms, self.window_ms, signed.request.timestamp_ms));
        }
        Ok(signed)
    }

    fn open_root(
        &self,
        request: &pb::OpenRootRequest,
    ) -> Result<pb::OpenRootResponse, ServiceError> {
        let now_ms = self.clock.now_ms();
        let signed = self.fresh::<pb::OpenRootBody>(request.signed.as_ref(), now_ms)?;
        let body = signed.body;
        // The fields `Stamper::root` fills, from the body as sent.
        let contract = pb::Contract {
            delegate_identity: String::new(),
            broker_key_id: self.key_id.clone(),
            parent_id: Vec::new(),
            depth: 0,
            intent_lineage_hash: crypto::sha256(body.intent.as_bytes()).to_vec(),
            intent: body.intent,
            task: body.task,
            delegate_public_key: signed.agent.to_vec(),
            budget: body.budget,
            deadline_ms: body.deadline_ms,
            issued_at_ms: now_ms,
            liability: pb::Liability::Delegate as i32,
            predicate: body.predicate,
            escalation_channel: String::new(),
            min_retry_cost: 0,
            min_retry_latency_ms: 0,
            write_scope: body.write_scope,
            policy: body.policy,
            request_digest: signed.request.digest.to_vec(),
            host_public_key: Vec::new(),
            result_schema_json: String::new(),
            labels: body.labels,
            factor_ppm: crate::core::limits::PPM_ONE,
            cumulative_trust_ppm: crate::core::limits::PPM_ONE,
            trust_source: pb::TrustSource::Root as i32,
            attestation_digest: Vec::new(),
            risk_class: String::new(),
        };
        Ok(pb::OpenRootResponse {
            replayed: false,
            issued: Some(self.issue(&contract)),
        })
    }

    fn delegate(
        &self,
        request: &pb::DelegateRequest,
    ) -> Result<pb::DelegateResponse, ServiceError> {
        let now_ms = self.clock.now_ms();
        let signed = self.fresh::<pb::DelegateBody>(request.signed.as_ref(), now_ms)?;
        let body = signed.body;
        let delegate_key =
            convert::optional_key(&body.delegate_public_key, "body.delegate_public_key")?
                .ok_or_else(|| {
                    crate::core::InputError::new("body.delegate_public_key", "is required")
                })?;
        let (factor_ppm, _note, trust) = convert::resolve_trust(
            body.delegate_attestation.as_ref(),
            &delegate_key,
            now_ms,
            &self.trust,
            &self.verified,
        )?;
        // The fields `Stamper::child` fills, from the body as sent (the
        // depth and the cumulative trust a broker would derive from the
        // parent are numbers of the same size).
        let contract = pb::Contract {
            delegate_identity: String::new(),
            broker_key_id: self.key_id.clone(),
            parent_id: body.parent_id,
            depth: 1,
            intent: String::new(),
            intent_lineage_hash: body.intent_lineage_hash,
            task: body.task,
            delegate_public_key: body.delegate_public_key,
            budget: body.budget,
            deadline_ms: now_ms.saturating_add(FLOOR_DEADLINE_MS),
            issued_at_ms: now_ms,
            liability: body.liability,
            predicate: body.predicate,
            escalation_channel: body.escalation_channel,
            min_retry_cost: body.min_retry_cost,
            min_retry_latency_ms: body.min_retry_latency_ms,
            write_scope: body.write_scope,
            policy: None,
            request_digest: signed.request.digest.to_vec(),
            host_public_key: body.host_public_key,
            result_schema_json: body.result_schema_json,
            labels: Default::default(),
            factor_ppm,
            cumulative_trust_ppm: factor_ppm,
            trust_source: trust.source as i32,
            attestation_digest: trust
                .attestation_digest
                .map(|d| d.to_vec())
                .unwrap_or_default(),
            risk_class: trust.risk_class,
        };
        Ok(pb::DelegateResponse {
            outcome: Some(pb::delegate_response::Outcome::Issued(
                self.issue(&contract),
            )),
            replayed: false,
        })
    }
}

/// The deadline the floor's contracts carry (a broker's is the parent's):
/// any number of the same encoded size will do.
const FLOOR_DEADLINE_MS: i64 = 3_600_000;

fn not_in_the_floor() -> Status {
    ServiceError::Unavailable(
        "the floor (`bench --floor`) answers only OpenRoot and Delegate".into(),
    )
    .into()
}

/// The Broker service with OpenRoot and Delegate as above and every other
/// method refused.
macro_rules! floor_broker {
    ($($method:ident($request:ty) -> $response:ty;)*) => {
        #[tonic::async_trait]
        impl Broker for FloorService {
            async fn open_root(
                &self,
                request: Request<pb::OpenRootRequest>,
            ) -> Result<Response<pb::OpenRootResponse>, Status> {
                Ok(Response::new(FloorService::open_root(self, request.get_ref())?))
            }

            async fn delegate(
                &self,
                request: Request<pb::DelegateRequest>,
            ) -> Result<Response<pb::DelegateResponse>, Status> {
                Ok(Response::new(FloorService::delegate(self, request.get_ref())?))
            }

            type WatchStream = std::pin::Pin<
                Box<dyn tokio_stream::Stream<Item = Result<pb::WatchResponse, Status>> + Send>,
            >;

            async fn watch(
                &self,
                _: Request<pb::WatchRequest>,
            ) -> Result<Response<Self::WatchStream>, Status> {
                Err(not_in_the_floor())
            }

            type WatchContractsStream = std::pin::Pin<
                Box<dyn tokio_stream::Stream<Item = Result<pb::WatchContractsResponse, Status>> + Send>,
            >;

            async fn watch_contracts(
                &self,
                _: Request<tonic::Streaming<pb::WatchContractsRequest>>,
            ) -> Result<Response<Self::WatchContractsStream>, Status> {
                Err(not_in_the_floor())
            }

            $(
                async fn $method(&self, _: Request<$request>) -> Result<Response<$response>, Status> {
                    Err(not_in_the_floor())
                }
            )*
        }
    };
}

floor_broker! {
    accept(pb::AcceptRequest) -> pb::AcceptResponse;
    decline(pb::DeclineRequest) -> pb::DeclineResponse;
    complete(pb::CompleteRequest) -> pb::CompleteResponse;
    adjudicate(pb::AdjudicateRequest) -> pb::AdjudicateResponse;
    escalate(pb::EscalateRequest) -> pb::EscalateResponse;
    revoke(pb::RevokeRequest) -> pb::RevokeResponse;
    record_receipts(pb::RecordReceiptsRequest) -> pb::RecordReceiptsResponse;
    get_contract(pb::GetContractRequest) -> pb::GetContractResponse;
    get_chain(pb::GetChainRequest) -> pb::GetChainResponse;
    list_children(pb::ListChildrenRequest) -> pb::ListChildrenResponse;
    list_roots(pb::ListRootsRequest) -> pb::ListRootsResponse;
    list_held(pb::ListHeldRequest) -> pb::ListHeldResponse;
    get_receipt(pb::GetReceiptRequest) -> pb::GetReceiptResponse;
    get_audit(pb::GetAuditRequest) -> pb::GetAuditResponse;
    aggregate_audits(pb::AggregateAuditsRequest) -> pb::AggregateAuditsResponse;
    open_session(pb::OpenSessionRequest) -> pb::OpenSessionResponse;
    bind_identity(pb::BindIdentityRequest) -> pb::BindIdentityResponse;
    get_broker_keys(pb::GetBrokerKeysRequest) -> pb::GetBrokerKeysResponse;
}
