//! Request authentication: every mutating request is a DSSE envelope signed
//! by the acting agent over its exact payload bytes, with a fresh timestamp
//! and a nonce (the idempotency key).

use prost::Message;

use super::error::ServiceError;
use crate::command::RequestMeta;
use crate::core::limits::{MAX_NONCE_BYTES, MIN_NONCE_BYTES};
use crate::core::{AgentKey, InputError};
use crate::crypto;
use crate::pb;

/// A verified request body and who signed it.
pub struct Authenticated<T> {
    pub body: T,
    pub request: RequestMeta,
    pub agent: AgentKey,
    /// False when the timestamp is outside the window: such a request may
    /// only be answered from the idempotency log (a late retry of a request
    /// the broker already answered), never executed.
    pub fresh: bool,
}

impl<T: SignedBody> Authenticated<T> {
    /// Refuses a stale request outright: for the calls the request log
    /// does not answer again (OpenSession, BindIdentity).
    pub fn require_fresh(&self, now_ms: i64, window_ms: i64) -> Result<(), ServiceError> {
        if self.fresh {
            return Ok(());
        }
        let timestamp_ms = self.body.header().map_or(0, |h| h.timestamp_ms);
        Err(self.stale_error(now_ms, window_ms, timestamp_ms))
    }
}

impl<T> Authenticated<T> {
    /// The error for a stale request with no stored answer.
    pub fn stale_error(&self, now_ms: i64, window_ms: i64, timestamp_ms: i64) -> ServiceError {
        let skew_ms = now_ms.saturating_sub(timestamp_ms).saturating_abs();
        ServiceError::Unauthenticated {
            reason: pb::ErrorReason::StaleTimestamp,
            detail: format!(
                "body.header.timestamp_ms is {skew_ms} ms from the broker's clock, beyond the {window_ms} ms window"
            ),
        }
    }
}

/// Request payloads that start with a `RequestHeader`.
pub trait SignedBody: Message + Default {
    const PAYLOAD_TYPE: &'static str;
    fn header(&self) -> Option<&pb::RequestHeader>;
}

macro_rules! signed_body {
    ($($body:ty => $payload_type:ident),* $(,)?) => {$(
        impl SignedBody for $body {
            const PAYLOAD_TYPE: &'static str = crypto::payload_type::$payload_type;
            fn header(&self) -> Option<&pb::RequestHeader> {
                self.header.as_ref()
            }
        }
    )*};
}

signed_body! {
    pb::OpenRootBody => OPEN_ROOT,
    pb::DelegateBody => DELEGATE,
    pb::AcceptBody => ACCEPT,
    pb::DeclineBody => DECLINE,
    pb::CompleteBody => COMPLETE,
    pb::AdjudicateBody => ADJUDICATE,
    pb::EscalateBody => ESCALATE,
    pb::RevokeBody => REVOKE,
    pb::RecordReceiptsBody => RECORD_RECEIPTS,
    pb::OpenSessionBody => OPEN_SESSION,
    pb::BindIdentityBody => BIND_IDENTITY,
}

/// Decodes, verifies and freshness-checks a signed request.
pub fn authenticate<T: SignedBody>(
    signed: Option<&pb::Envelope>,
    now_ms: i64,
    window_ms: i64,
) -> Result<Authenticated<T>, ServiceError> {
    let envelope = signed.ok_or_else(|| InputError::new("signed", "is required"))?;
    if envelope.payload_type != T::PAYLOAD_TYPE {
        return Err(InputError::new(
            "signed.payload_type",
            format!("must be {:?}", T::PAYLOAD_TYPE),
        )
        .into());
    }
    if envelope.signatures.len() != 1 {
        return Err(InputError::new(
            "signed.signatures",
            format!(
                "exactly one signature required, got {}",
                envelope.signatures.len()
            ),
        )
        .into());
    }
    let body = T::decode(envelope.payload.as_slice()).map_err(|e| {
        InputError::new(
            "signed.payload",
            format!("is not a valid {}: {e}", T::PAYLOAD_TYPE),
        )
    })?;
    let header = body
        .header()
        .ok_or_else(|| InputError::new("body.header", "is required"))?;
    let key = crypto::public_key(&header.agent_public_key)
        .map_err(|e| InputError::new("body.header.agent_public_key", e.to_string()))?;
    if !(MIN_NONCE_BYTES..=MAX_NONCE_BYTES).contains(&header.nonce.len()) {
        return Err(InputError::new(
            "body.header.nonce",
            format!(
                "{} bytes, must be {MIN_NONCE_BYTES}..={MAX_NONCE_BYTES}",
                header.nonce.len()
            ),
        )
        .into());
    }
    crypto::verify_envelope(envelope, T::PAYLOAD_TYPE, &key).map_err(|e| {
        ServiceError::Unauthenticated {
            reason: pb::ErrorReason::BadSignature,
            detail: format!("signed: {e}"),
        }
    })?;
    let skew_ms = now_ms.saturating_sub(header.timestamp_ms).saturating_abs();
    let fresh = skew_ms <= window_ms;
    let agent = key.to_bytes();
    let request = RequestMeta {
        agent,
        nonce: header.nonce.clone(),
        digest: crypto::sha256(&crypto::pae(&envelope.payload_type, &envelope.payload)),
        timestamp_ms: header.timestamp_ms,
    };
    Ok(Authenticated {
        body,
        request,
        agent,
        fresh,
    })
}

impl<S: crate::store::Store> super::BrokerService<S> {
    /// A signed request's body under this broker's timestamp window, its
    /// signer recorded on the call's span.
    pub(super) fn signed<T: SignedBody>(
        &self,
        envelope: Option<&pb::Envelope>,
        now_ms: i64,
    ) -> Result<Authenticated<T>, ServiceError> {
        let window_ms = self.config.limits.timestamp_window_ms;
        let signed = authenticate::<T>(envelope, now_ms, window_ms)?;
        crate::telemetry::record(crate::telemetry::Fact::AgentKey(&signed.agent));
        Ok(signed)
    }
}
