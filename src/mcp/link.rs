//! The MCP servers' link to the broker: one agent's key, a read session
//! renewed before it lapses, signed requests sent again (the same bytes)
//! while the broker is unavailable, and the error a tool reports.

use std::sync::Arc;

use rmcp::model::CallToolResult;
use serde_json::{Value, json};

use crate::client::{Agent, SessionAttacher, SessionClient};
use crate::pb;

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

/// A tool's failure, as the model reads it.
#[derive(Debug)]
pub struct ToolError {
    pub reason: String,
    pub field: Option<String>,
    pub message: String,
    /// More facts for the model (requested and allowed values, a path),
    /// beside the three above in the error object.
    pub details: serde_json::Map<String, Value>,
}

impl ToolError {
    pub fn new(reason: &str, message: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            field: None,
            message: message.into(),
            details: serde_json::Map::new(),
        }
    }

    pub fn input(field: &str, message: impl Into<String>) -> Self {
        Self {
            field: Some(field.into()),
            ..Self::new("INVALID_INPUT", message)
        }
    }

    /// Adds a fact to the error object.
    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.details.insert(key.into(), value.into());
        self
    }

    /// The tool result the model reads: `isError`, the error object as
    /// structured content, and its reason and message as text.
    pub fn result(self) -> CallToolResult {
        let mut error = self.details;
        error.insert("reason".into(), self.reason.into());
        error.insert("field".into(), self.field.into());
        error.insert("message".into(), self.message.into());
        CallToolResult::structured_error(json!({ "error": error }))
    }
}

impl From<tonic::Status> for ToolError {
    fn from(status: tonic::Status) -> Self {
        use tonic_types::StatusExt as _;
        let reason = status
            .get_details_error_info()
            .map(|info| info.reason)
            .unwrap_or_else(|| code_name_of(status.code()));
        let field = status
            .get_details_bad_request()
            .and_then(|b| b.field_violations.first().map(|v| v.field.clone()))
            // The broker names a request body's fields `body.x`; the
            // tools' arguments carry the same names without the prefix.
            .map(|f| f.strip_prefix("body.").map(str::to_owned).unwrap_or(f));
        Self {
            field,
            ..Self::new(&reason, status.message())
        }
    }
}

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
    ) -> Result<pb::ListHeldResponse, ToolError> {
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

    /// Signs a request body as the agent.
    pub fn signed<B: prost::Message>(&self, payload_type: &str, body: &B) -> Option<pb::Envelope> {
        Some(self.agent.sign(payload_type, body))
    }

    /// Runs a read, opening a session again once if the broker no longer
    /// takes the one held (expired early, or signed by a key since
    /// retired).
    pub async fn read<T, F, Fut>(&self, call: F) -> Result<T, ToolError>
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

    /// A client whose reads carry a fresh enough session.
    pub async fn reader(&self) -> Result<SessionClient, ToolError> {
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
    pub async fn send<T, F, Fut>(&self, request: T, call: F) -> Result<T::Response, ToolError>
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
                        return Err(ToolError::new(
                            "OUTCOME_UNKNOWN",
                            format!(
                                "the broker could not be reached or did not answer ({}); the call may have taken effect: check with get_contract or tree before calling again",
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

macro_rules! sendable {
    ($($request:ident => $response:ident),* $(,)?) => {$(
        impl Sendable for pb::$request {
            type Response = pb::$response;
        }
    )*};
}

sendable! {
    OpenRootRequest => OpenRootResponse,
    DelegateRequest => DelegateResponse,
    AcceptRequest => AcceptResponse,
    DeclineRequest => DeclineResponse,
    CompleteRequest => CompleteResponse,
    EscalateRequest => EscalateResponse,
    RevokeRequest => RevokeResponse,
    RecordReceiptsRequest => RecordReceiptsResponse,
}

/// A gRPC code as its canonical name, e.g. NOT_FOUND (for errors
/// without an ErrorInfo).
pub fn code_name_of(code: tonic::Code) -> String {
    let mut name = String::new();
    for (i, c) in format!("{code:?}").chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            name.push('_');
        }
        name.push(c.to_ascii_uppercase());
    }
    name
}

/// At most `max` bytes of `text`, cut at a character boundary.
pub fn cut(text: &str, max: usize) -> String {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

/// A contract status as its name without the prefix, e.g. ACCEPTED.
pub fn status_name(status: i32) -> String {
    pb::ContractStatus::try_from(status)
        .map(|s| {
            s.as_str_name()
                .trim_start_matches("CONTRACT_STATUS_")
                .to_owned()
        })
        .unwrap_or_else(|_| status.to_string())
}

/// An invariant code as its name without the prefix, e.g. DEPTH_EXCEEDED.
pub fn code_name(code: i32) -> String {
    pb::InvariantCode::try_from(code)
        .map(|c| {
            c.as_str_name()
                .trim_start_matches("INVARIANT_CODE_")
                .to_owned()
        })
        .unwrap_or_else(|_| code.to_string())
}

/// A refusal's violations as a model or a person reads them:
/// `CODE (requested R, allowed A): detail`.
pub fn listed_violations(receipt: &pb::Receipt) -> Vec<String> {
    receipt
        .violations
        .iter()
        .map(|v| {
            format!(
                "{} (requested {}, allowed {}): {}",
                code_name(v.code),
                v.requested,
                v.allowed,
                v.detail
            )
        })
        .collect()
}
