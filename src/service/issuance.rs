//! Issuance: OpenRoot and Delegate. Cheap checks (signature, holder)
//! come before the body is converted, off the async workers, in the
//! tenant's share of the converters.

use super::BrokerService;
use super::convert;
use super::error::ServiceError;
use crate::config::RootDenied;
use crate::core::InputError;
use crate::core::limits::{CONVERSION_DEADLINE_MS, MAX_INLINE_VERIFICATIONS};
use crate::core::tenant::Known;
use crate::pb;
use crate::store::{Answer, Outcome, Store};
use crate::telemetry::{self, Fact};

fn issued(outcome: Outcome) -> Result<pb::IssuedContract, ServiceError> {
    match outcome {
        Outcome::Issued { id, envelope } => Ok(pb::IssuedContract {
            contract_id: id.to_vec(),
            contract: Some(envelope),
        }),
        Outcome::Receipt { .. } => Err(ServiceError::Internal("a root cannot be refused".into())),
    }
}

fn delegate_response(answer: Answer) -> pb::DelegateResponse {
    let outcome = match answer.outcome {
        Outcome::Issued { id, envelope } => {
            pb::delegate_response::Outcome::Issued(pb::IssuedContract {
                contract_id: id.to_vec(),
                contract: Some(envelope),
            })
        }
        Outcome::Receipt {
            receipt_id,
            envelope,
            ..
        } => pb::delegate_response::Outcome::Refused(pb::Refusal {
            receipt_id: receipt_id.to_vec(),
            receipt: Some(envelope),
        }),
    };
    pb::DelegateResponse {
        outcome: Some(outcome),
        replayed: answer.replayed,
    }
}

/// A Delegate body as the store takes it, with its effective predicate
/// checked: parsed once here, so the writer only concatenates what is
/// known to compose and be judgeable.
fn convert_child(
    body: pb::DelegateBody,
    request: crate::command::RequestMeta,
    now_ms: i64,
    config: &crate::config::Config,
    verified: &convert::VerifiedAttestations,
    inherited: &crate::core::Predicate,
) -> Result<crate::command::NewChild, InputError> {
    let child = convert::new_child(body, request, now_ms, &config.trust, verified)?;
    crate::core::Predicate::check_effective(inherited, &child.ask.predicate, "body.predicate")?;
    Ok(child)
}

impl<S: Store> BrokerService<S> {
    pub(super) async fn open_root(
        &self,
        request: pb::OpenRootRequest,
    ) -> Result<pb::OpenRootResponse, ServiceError> {
        let now_ms = self.clock.now_ms();
        let signed = self.signed::<pb::OpenRootBody>(request.signed.as_ref(), now_ms)?;
        if !signed.fresh {
            let answer = self.late_retry(&signed, now_ms).await?;
            return Ok(pb::OpenRootResponse {
                replayed: true,
                issued: Some(issued(answer.outcome)?),
            });
        }
        // The allow-list first: a key that may not open roots costs no
        // conversion (predicate parsing) at all.
        // A key listed by itself, or any key when no identity is listed,
        // is decided without reading a binding.
        let orchestrators = &self.config.orchestrators;
        let (opener, budget) = (signed.request.agent, signed.body.budget);
        let mut admitted = orchestrators.admit(&opener, None, budget);
        let mut looked_up = None;
        if admitted == Err(RootDenied::NotListed) && !orchestrators.by_identity.is_empty() {
            let identity = self.bound_identity(&opener, now_ms).await?;
            admitted = orchestrators.admit(&opener, identity.as_deref(), budget);
            looked_up = Some(identity);
        }
        if let Err(denied) = admitted {
            // A retry of a root admitted before the list changed still
            // gets its answer: one request, one answer.
            if let Some(answer) = self.store.replay(&signed.request).await? {
                return Ok(pb::OpenRootResponse {
                    replayed: answer.replayed,
                    issued: Some(issued(answer.outcome)?),
                });
            }
            return Err(match denied {
                RootDenied::NotListed => ServiceError::PermissionDenied {
                    reason: pb::ErrorReason::NotAnOrchestrator,
                    detail: "this key may not open roots (neither it nor an identity bound to it is under [orchestrators] in the broker's configuration)".into(),
                },
                RootDenied::OverAllowance { allowed } => ServiceError::OverAllowance {
                    requested: signed.body.budget,
                    allowed,
                },
            });
        }
        let _turn = self.gate.admit(&self.config.tenants, &opener, None).await?;
        let identity = match looked_up {
            Some(identity) => identity,
            None => self.bound_identity(&opener, now_ms).await?,
        };
        let mut root = convert::new_root(signed.body, signed.request, now_ms, &self.config.limits)?;
        root.trace = telemetry::current_trace_context();
        root.identity = identity;
        let answer = self.store.open_root(root).await?;
        if let Outcome::Issued { id, .. } = &answer.outcome {
            self.gate.remember(
                *id,
                Known {
                    tenant: self.config.tenants.of(&opener),
                    delegate: opener,
                    principal: opener,
                },
            );
            telemetry::record(Fact::ContractId(id));
            telemetry::record(Fact::RootId(id));
            telemetry::record(Fact::Depth(0));
            telemetry::record(Fact::Outcome("issued", answer.replayed));
        }
        Ok(pb::OpenRootResponse {
            replayed: answer.replayed,
            issued: Some(issued(answer.outcome)?),
        })
    }

    pub(super) async fn delegate(
        &self,
        request: pb::DelegateRequest,
    ) -> Result<pb::DelegateResponse, ServiceError> {
        let now_ms = self.clock.now_ms();
        let signed = self.signed::<pb::DelegateBody>(request.signed.as_ref(), now_ms)?;
        if !signed.fresh {
            return Ok(delegate_response(self.late_retry(&signed, now_ms).await?));
        }
        // Cheap checks first: the parent exists and
        // the signer holds it, before any of the body is converted. A
        // stranger is answered PERMISSION_DENIED and nothing is stored in
        // anyone's tree.
        let parent_id = convert::id(&signed.body.parent_id, "body.parent_id")?;
        let signer = signed.request.agent;
        let _turn = self
            .gate
            .admit(&self.config.tenants, &signer, Some(&parent_id))
            .await?;
        let parent = self.held_parent(parent_id, &signer).await?;
        let depth = parent.depth + 1;
        if self.gate.known(&parent_id).is_none() {
            self.gate.remember(
                parent_id,
                Known {
                    tenant: parent.tenant,
                    delegate: parent.delegate_key,
                    principal: parent.delegate_key,
                },
            );
        }
        let delegate = crate::core::AgentKey::try_from(signed.body.delegate_public_key.as_slice());
        let deadline = std::time::Duration::from_millis(CONVERSION_DEADLINE_MS);
        let share = crate::pool::Share {
            tenant: parent.tenant,
            key: signed.request.agent,
        };
        // The parent's predicate is inherited under DELEGATE liability only.
        let inherited = if signed.body.liability == pb::Liability::Delegate as i32 {
            parent.effective_predicate
        } else {
            crate::core::Predicate::default()
        };
        // Most Delegates forward predicates and schemas seen before: then
        // the conversion parses no predicate or schema (the memos answer)
        // and costs less than the hand-off to a converter thread, so it
        // runs here. A new attestation that could cost at most
        // `MAX_INLINE_VERIFICATIONS` signature check (its signatures times
        // the configured attestors) costs the same here as on a converter,
        // the price of the request's own, so it stays too and saves the
        // hand-off. Anything more goes to the converters.
        let cheap = signed.body.result_schema_json.trim().is_empty()
            && signed.body.delegate_attestation.as_ref().is_none_or(|a| {
                self.verified.remembers(a)
                    || a.signatures
                        .len()
                        .saturating_mul(self.config.trust.attestors.len())
                        <= MAX_INLINE_VERIFICATIONS
            })
            && crate::core::Predicate::checked_before(&inherited, &signed.body.predicate);
        let (config, verified) = (self.config.clone(), self.verified.clone());
        let (body, request) = (signed.body, signed.request);
        let convert = move || convert_child(body, request, now_ms, &config, &verified, &inherited);
        let child = if cheap {
            convert()?
        } else {
            self.converters
                .run(share, deadline, convert)
                .await
                .map_err(converters_busy)??
        };
        let mut child = child;
        child.trace = telemetry::current_trace_context();
        child.identity = self.bound_identity(&child.delegate_key, now_ms).await?;
        let budget = child.ask.budget;
        let answer = self.store.delegate(child).await?;
        if let (Outcome::Issued { id, .. }, Ok(delegate)) = (&answer.outcome, delegate) {
            self.gate.remember(
                *id,
                Known {
                    tenant: parent.tenant,
                    delegate,
                    principal: signer,
                },
            );
        }
        self.observe_delegation(&answer, budget, depth);
        Ok(delegate_response(answer))
    }

    /// The parent of a Delegate, which `signer` must hold: a stranger is
    /// told what an unknown parent gets, a party that does not hold it is
    /// denied.
    async fn held_parent(
        &self,
        parent_id: crate::core::Id,
        signer: &crate::core::AgentKey,
    ) -> Result<crate::store::IssuingParent, ServiceError> {
        let unknown = || ServiceError::not_found(crate::store::Entity::ParentContract, parent_id);
        let parent = self
            .store
            .issuing_parent(parent_id)
            .await?
            .ok_or_else(unknown)?;
        telemetry::record(Fact::ParentId(&parent_id));
        telemetry::record(Fact::RootId(&parent.root_id));
        if parent.delegate_key == *signer {
            return Ok(parent);
        }
        if !self.may_know(signer, parent_id).await? {
            return Err(unknown());
        }
        Err(ServiceError::PermissionDenied {
            reason: pb::ErrorReason::NotHolder,
            detail: "the request is not signed by the parent contract's delegate key (only its holder may delegate from it); nothing was recorded".into(),
        })
    }

    /// The Delegate's facts on its span and in the metrics (a replay is
    /// not counted again).
    pub(super) fn observe_delegation(
        &self,
        answer: &crate::store::Answer,
        budget: i64,
        depth: u32,
    ) {
        match &answer.outcome {
            Outcome::Issued { id, .. } => {
                telemetry::record(Fact::ContractId(id));
                telemetry::record(Fact::Depth(depth));
                telemetry::record(Fact::Outcome("issued", answer.replayed));
                if !answer.replayed {
                    self.metrics.delegations_issued.inc();
                    self.metrics
                        .budget_reserved_units
                        .inc_by(u64::try_from(budget).unwrap_or(0));
                }
            }
            Outcome::Receipt { decided, .. } => {
                let code =
                    |c: i32| pb::InvariantCode::try_from(c).map_or("UNKNOWN", |c| c.as_str_name());
                if telemetry::recording() {
                    let codes: Vec<&str> = decided.codes.iter().map(|c| code(*c)).collect();
                    telemetry::record(Fact::RefusedCodes(&codes));
                }
                telemetry::record(Fact::Outcome("refused", answer.replayed));
                if !answer.replayed {
                    self.metrics
                        .delegations_refused
                        .with_label_values(&[crate::metrics::invariant_label(decided.primary)])
                        .inc();
                }
            }
        }
    }
}

/// A Delegate body the converters could not take: retried with the same
/// nonce, nothing recorded.
fn converters_busy(e: crate::pool::PoolError) -> ServiceError {
    match e {
        crate::pool::PoolError::TimedOut(ms) => ServiceError::Retry {
            reason: pb::ErrorReason::ConvertersBusy,
            detail: format!(
                "the Delegate body could not be checked within {ms} ms (every converter is busy); nothing was recorded: retry with the same nonce"
            ),
        },
        crate::pool::PoolError::Full => ServiceError::Retry {
            reason: pb::ErrorReason::ConvertersBusy,
            detail: format!(
                "this tree's tenant already has {} Delegates waiting for a converter; nothing was recorded: retry with the same nonce",
                crate::core::limits::MAX_WAITING_PER_TENANT
            ),
        },
        other => ServiceError::Internal(format!("converting the Delegate body: {other}")),
    }
}
