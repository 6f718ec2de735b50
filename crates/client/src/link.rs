//! One agent's link to the broker: its key, a read session renewed before
//! it lapses, and signed requests sent again (the same bytes) while the
//! broker is unavailable.

use std::sync::Arc;

use broker_wire::crypto::payload_type;
use broker_wire::pb;

use crate::agent::{Agent, SessionAttacher, SessionClient};
use crate::error::BrokerError;

/// A read session is renewed after this long (sessions last an hour by
/// default; renewing early keeps a slow clock from costing a call).
const SESSION_RENEW_MS: u64 = 20 * 60 * 1000;
/// Times a call is sent again (same signed request, so never twice in
/// effect) when the broker answers UNAVAILABLE.
const RETRIES: u32 = 3;
/// Pause before the first retry; doubled each time.
const RETRY_PAUSE_MS: u64 = 200;
/// Largest answer taken from the broker (a GetChain of a deep chain).
const MAX_RESPONSE_BYTES: usize = 64 * 1024 * 1024;

/// One agent's connection to the broker.
#[derive(Clone)]
pub struct Link {
    pub agent: Arc<Agent>,
    client: SessionClient,
    attacher: SessionAttacher,
    /// When the session was last opened; `None` before the first read.
    session_at: Arc<tokio::sync::Mutex<Option<tokio::time::Instant>>>,
}

impl Link {
    pub fn new(agent: Agent, channel: tonic::transport::Channel) -> Self {
        let attacher = SessionAttacher::default();
        let client = attacher
            .client(channel)
            .max_decoding_message_size(MAX_RESPONSE_BYTES);
        Self {
            agent: Arc::new(agent),
            client,
            attacher,
            session_at: Arc::default(),
        }
    }

    /// The first page of the agent's open contracts in `role` (ListHeld).
    pub async fn held(
        &self,
        role: pb::HeldRole,
        page_size: u32,
    ) -> Result<pb::ListHeldResponse, BrokerError> {
        let request = pb::ListHeldRequest {
            role: role as i32,
            page_size,
            page_token: Vec::new(),
        };
        Ok(self
            .read(|mut client| {
                let request = request.clone();
                async move { client.list_held(request).await }
            })
            .await?
            .into_inner())
    }

    /// Signs `body` as the agent (header filled in) and sends it, again
    /// with the same bytes while the broker is unavailable, carrying the
    /// W3C `trace` context when there is one.
    pub async fn call<B: Body>(
        &self,
        mut body: B,
        trace: Option<&str>,
    ) -> Result<<B::Request as Sendable>::Response, BrokerError> {
        *body.header() = Some(self.agent.header());
        let request = B::request(self.signed(B::PAYLOAD_TYPE, &body));
        let trace = trace.map(str::to_owned);
        self.send(request, move |client, request| {
            B::call(client, crate::trace::traced(request, trace.as_deref()))
        })
        .await
    }

    /// Signs a request body as the agent.
    fn signed<B: prost::Message>(&self, payload_type: &str, body: &B) -> Option<pb::Envelope> {
        Some(self.agent.sign(payload_type, body))
    }

    /// Runs a read, opening a session again once if the broker no longer
    /// takes the one held (expired early, or signed by a key since
    /// retired).
    pub async fn read<T, F, Fut>(&self, call: F) -> Result<T, BrokerError>
    where
        F: Fn(SessionClient) -> Fut,
        Fut: std::future::Future<Output = Result<T, tonic::Status>>,
    {
        match call(self.reader().await?).await {
            Err(status) if status.code() == tonic::Code::Unauthenticated => {
                *self.session_at.lock().await = None;
                Ok(call(self.reader().await?).await?)
            }
            other => Ok(other?),
        }
    }

    /// A contract as the broker holds it (GetContract).
    pub async fn contract(&self, contract_id: &[u8]) -> Result<pb::ContractState, BrokerError> {
        let request = pb::GetContractRequest {
            contract_id: contract_id.to_vec(),
        };
        self.read(|mut client| {
            let request = request.clone();
            async move { client.get_contract(request).await }
        })
        .await?
        .into_inner()
        .contract
        .ok_or_else(|| BrokerError::new("INTERNAL", "the broker answered without the contract"))
    }

    /// A contract's signed terms, e.g. a parent's lineage hash for a
    /// Delegate (a read: a stranger's contract is NOT_FOUND).
    pub async fn terms_of(&self, contract_id: &[u8]) -> Result<pb::Contract, BrokerError> {
        let state = self.contract(contract_id).await?;
        crate::terms(state.contract.as_ref()).ok_or_else(|| {
            BrokerError::new(
                "INTERNAL",
                "the broker sent a contract that does not decode",
            )
        })
    }

    /// A client whose reads carry a fresh enough session.
    pub async fn reader(&self) -> Result<SessionClient, BrokerError> {
        let mut client = self.client.clone();
        let mut opened = self.session_at.lock().await;
        let stale = opened
            .is_none_or(|at| at.elapsed() > std::time::Duration::from_millis(SESSION_RENEW_MS));
        if stale {
            self.attacher.open(&mut client, &self.agent).await?;
            *opened = Some(tokio::time::Instant::now());
        }
        Ok(client)
    }

    /// Sends a signed request, again (the same bytes) while the broker is
    /// UNAVAILABLE: the nonce makes a repeat harmless.
    async fn send<T, F, Fut>(&self, request: T, call: F) -> Result<T::Response, BrokerError>
    where
        T: Sendable,
        F: Fn(SessionClient, T) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T::Response>, tonic::Status>>,
    {
        use tonic_types::StatusExt as _;
        let mut pause = std::time::Duration::from_millis(RETRY_PAUSE_MS);
        let mut tries = 0;
        loop {
            match call(self.client.clone(), request.clone()).await {
                Ok(response) => return Ok(response.into_inner()),
                Err(status) => {
                    // The broker's own answers carry an ErrorInfo; a bare
                    // status is the transport's (a dropped connection, a
                    // timeout): the request may or may not have been done.
                    let transport = status.get_details_error_info().is_none();
                    let again = transport || status.code() == tonic::Code::Unavailable;
                    if again && tries < RETRIES {
                        tries += 1;
                        tokio::time::sleep(pause).await;
                        pause *= 2;
                        continue;
                    }
                    if transport {
                        return Err(BrokerError::new(
                            "OUTCOME_UNKNOWN",
                            format!(
                                "the broker could not be reached or did not answer ({}); the call may have taken effect: read the contract (GetContract) before calling again",
                                status.message().chars().take(200).collect::<String>()
                            ),
                        ));
                    }
                    return Err(status.into());
                }
            }
        }
    }
}

/// A request that can be sent again as is.
pub trait Sendable: Clone + Send + 'static {
    type Response;
}

/// A request body an agent signs: its payload type, the request that
/// carries it, and the RPC that takes it. `Link::call` fills in the
/// header, signs, sends again while the broker is unavailable, and passes
/// the trace context on.
pub trait Body: prost::Message + Sized {
    const PAYLOAD_TYPE: &'static str;
    type Request: Sendable;
    /// The signer's header (key, time, nonce).
    fn header(&mut self) -> &mut Option<pb::RequestHeader>;
    /// The request carrying the signed body.
    fn request(signed: Option<pb::Envelope>) -> Self::Request;
    /// The RPC.
    fn call(
        client: SessionClient,
        request: tonic::Request<Self::Request>,
    ) -> impl std::future::Future<
        Output = Result<tonic::Response<<Self::Request as Sendable>::Response>, tonic::Status>,
    > + Send;
}

macro_rules! signed_calls {
    ($($body:ident => $request:ident, $response:ident, $method:ident, $payload:ident;)*) => {$(
        impl Sendable for pb::$request {
            type Response = pb::$response;
        }

        impl Body for pb::$body {
            const PAYLOAD_TYPE: &'static str = payload_type::$payload;
            type Request = pb::$request;
            fn header(&mut self) -> &mut Option<pb::RequestHeader> {
                &mut self.header
            }
            fn request(signed: Option<pb::Envelope>) -> Self::Request {
                pb::$request { signed }
            }
            async fn call(
                mut client: SessionClient,
                request: tonic::Request<Self::Request>,
            ) -> Result<tonic::Response<pb::$response>, tonic::Status> {
                client.$method(request).await
            }
        }
    )*};
}

signed_calls! {
    OpenRootBody => OpenRootRequest, OpenRootResponse, open_root, OPEN_ROOT;
    DelegateBody => DelegateRequest, DelegateResponse, delegate, DELEGATE;
    AcceptBody => AcceptRequest, AcceptResponse, accept, ACCEPT;
    DeclineBody => DeclineRequest, DeclineResponse, decline, DECLINE;
    CompleteBody => CompleteRequest, CompleteResponse, complete, COMPLETE;
    AdjudicateBody => AdjudicateRequest, AdjudicateResponse, adjudicate, ADJUDICATE;
    EscalateBody => EscalateRequest, EscalateResponse, escalate, ESCALATE;
    RevokeBody => RevokeRequest, RevokeResponse, revoke, REVOKE;
    RecordReceiptsBody => RecordReceiptsRequest, RecordReceiptsResponse, record_receipts, RECORD_RECEIPTS;
    BindIdentityBody => BindIdentityRequest, BindIdentityResponse, bind_identity, BIND_IDENTITY;
}

/// An answer that carries the receipt the broker signed for it.
pub trait Receipted {
    fn receipt(self) -> Option<pb::Sealed>;
}

macro_rules! receipted {
    ($($response:ident),* $(,)?) => {$(
        impl Receipted for pb::$response {
            fn receipt(self) -> Option<pb::Sealed> {
                self.receipt
            }
        }
    )*};
}

receipted! {
    AcceptResponse,
    DeclineResponse,
    CompleteResponse,
    AdjudicateResponse,
    EscalateResponse,
    RevokeResponse,
    RecordReceiptsResponse,
}

/// A body that ends a contract for a stated reason: a decline, an
/// escalation or a revocation.
pub trait Ending: Body + Default {
    fn ending(contract_id: Vec<u8>, reason: String) -> Self;
}

macro_rules! endings {
    ($($body:ident),* $(,)?) => {$(
        impl Ending for pb::$body {
            fn ending(contract_id: Vec<u8>, reason: String) -> Self {
                pb::$body {
                    contract_id,
                    reason,
                    ..Default::default()
                }
            }
        }
    )*};
}

endings! {
    DeclineBody,
    EscalateBody,
    RevokeBody,
}
