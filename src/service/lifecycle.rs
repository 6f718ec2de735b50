//! Lifecycle RPCs (Accept, Decline, Complete, Adjudicate, Escalate,
//! Revoke, RecordReceipts): one generic path (`LifecycleRpc`) that
//! authenticates, converts the body and applies it through the store.

use super::BrokerService;
use super::auth;
use super::convert;
use super::error::ServiceError;
use crate::command::{Action, LifecycleCommand};
use crate::core::InputError;
use crate::pb;
use crate::store::{Decided, Outcome, Store};
use crate::telemetry::{self, Fact};

/// A lifecycle body's conversion to (contract, action).
type Convert<B> = fn(B) -> Result<(crate::core::Id, Action), InputError>;

/// One lifecycle RPC: its signed body, how the body becomes a command,
/// and its response (every lifecycle RPC answers with its receipt).
pub(super) trait LifecycleRpc {
    type Body: auth::SignedBody;
    type Response;
    /// The body's conversion to (contract, action).
    const CONVERT: Convert<Self::Body>;
    /// The contract the body names, for admission (before conversion).
    fn named(body: &Self::Body) -> &[u8];
    fn signed(&self) -> Option<&pb::Envelope>;
    fn response(receipt_id: Vec<u8>, receipt: Option<pb::Sealed>, replayed: bool)
    -> Self::Response;
}

macro_rules! lifecycle_rpc {
    ($($request:ident, $body:ident, $response:ident, $convert:path;)*) => {$(
        impl LifecycleRpc for pb::$request {
            type Body = pb::$body;
            type Response = pb::$response;
            const CONVERT: Convert<pb::$body> = $convert;
            fn named(body: &pb::$body) -> &[u8] {
                &body.contract_id
            }
            fn signed(&self) -> Option<&pb::Envelope> {
                self.signed.as_ref()
            }
            fn response(
                receipt_id: Vec<u8>,
                receipt: Option<pb::Sealed>,
                replayed: bool,
            ) -> pb::$response {
                pb::$response {
                    receipt_id,
                    receipt,
                    replayed,
                }
            }
        }
    )*};
}

lifecycle_rpc! {
    AcceptRequest, AcceptBody, AcceptResponse, convert::lifecycle::accept;
    DeclineRequest, DeclineBody, DeclineResponse, convert::lifecycle::decline;
    CompleteRequest, CompleteBody, CompleteResponse, convert::lifecycle::complete;
    AdjudicateRequest, AdjudicateBody, AdjudicateResponse, convert::lifecycle::adjudicate;
    EscalateRequest, EscalateBody, EscalateResponse, convert::lifecycle::escalate;
    RevokeRequest, RevokeBody, RevokeResponse, convert::lifecycle::revoke;
    RecordReceiptsRequest, RecordReceiptsBody, RecordReceiptsResponse, convert::lifecycle::record;
}

impl<S: Store> BrokerService<S> {
    /// Any lifecycle RPC: the one path all seven take.
    pub(super) async fn transition<R: LifecycleRpc>(
        &self,
        request: tonic::Request<R>,
    ) -> Result<R::Response, ServiceError> {
        let (receipt_id, receipt, replayed) = self
            .lifecycle::<R::Body>(request.get_ref().signed(), R::CONVERT, R::named)
            .await?;
        Ok(R::response(receipt_id, receipt, replayed))
    }

    /// Authenticates a lifecycle request, converts its body and applies it.
    pub(super) async fn lifecycle<T: auth::SignedBody>(
        &self,
        signed: Option<&pb::Envelope>,
        convert: Convert<T>,
        named: fn(&T) -> &[u8],
    ) -> Result<(Vec<u8>, Option<pb::Sealed>, bool), ServiceError> {
        let now_ms = self.clock.now_ms();
        let signed = self.signed::<T>(signed, now_ms)?;
        let answer = if signed.fresh {
            // The turn before the conversion: converting a Complete parses
            // its output, the largest work a request brings.
            let named = crate::core::Id::try_from(named(&signed.body)).ok();
            let _turn = self
                .gate
                .admit(&self.config.tenants, &signed.request.agent, named.as_ref())
                .await?;
            let (contract_id, action) = convert(signed.body)?;
            telemetry::record(Fact::ContractId(&contract_id));
            // One task, one connected trace: this call's span links to the
            // one that issued the contract, even when the agents passed no
            // context between them.
            if telemetry::current_trace_context().is_some()
                && let Some(issued) = self.store.issuance_trace(contract_id).await?
            {
                telemetry::link_to(&issued);
            }
            let signer = signed.request.agent;
            let answer = self
                .store
                .transition(LifecycleCommand {
                    request: Some(signed.request),
                    contract_id,
                    action,
                })
                .await;
            match answer {
                Ok(answer) => answer,
                // A stranger is told what an unknown contract gets, however
                // the store refused it (who may act, or its state).
                Err(
                    e @ (crate::store::StoreError::PermissionDenied { .. }
                    | crate::store::StoreError::FailedPrecondition { .. }),
                ) => {
                    return Err(if self.may_know(&signer, contract_id).await? {
                        e.into()
                    } else {
                        ServiceError::not_found(crate::store::Entity::Contract, contract_id)
                    });
                }
                Err(e) => return Err(e.into()),
            }
        } else {
            self.late_retry(&signed, now_ms).await?
        };
        match answer.outcome {
            Outcome::Receipt {
                receipt_id,
                envelope,
                decided,
            } => {
                self.note_transition(&decided, answer.replayed);
                Ok((receipt_id.to_vec(), Some(envelope), answer.replayed))
            }
            // A nonce first used for an issuance request.
            Outcome::Issued { .. } => Err(ServiceError::NonceReused),
        }
    }

    /// Names a lifecycle receipt on the call's span and, unless it is a
    /// replayed answer, counts it by kind and verdict (labels from the
    /// enums: bounded).
    pub(super) fn note_transition(&self, decided: &Decided, replayed: bool) {
        let kind = pb::ReceiptKind::try_from(decided.kind).map_or("UNKNOWN", |k| k.as_str_name());
        telemetry::record(Fact::Outcome(kind, replayed));
        telemetry::record(Fact::RootId(&decided.root_id));
        let verdict = pb::Verdict::try_from(decided.verdict)
            .ok()
            .filter(|v| *v != pb::Verdict::Unspecified)
            .map_or("", |v| v.as_str_name());
        if !verdict.is_empty() {
            telemetry::record(Fact::Verdict(verdict));
        }
        if replayed {
            return;
        }
        self.metrics
            .transitions
            .with_label_values(&[kind, verdict])
            .inc();
        // Adjudications repeat a completion's figures: counted once, here.
        if decided.kind == pb::ReceiptKind::Completed as i32 {
            self.metrics
                .budget_spent_units
                .inc_by(u64::try_from(decided.consumed).unwrap_or(0));
            self.metrics
                .budget_returned_units
                .inc_by(u64::try_from(decided.returned).unwrap_or(0));
        }
    }
}
