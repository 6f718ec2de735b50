//! Proto ⇄ core conversion. Every client field is validated here, once,
//! into core types; a malformed one becomes an `InputError` naming it.

use prost::Message;

use super::limits::MAX_VERIFIED_ATTESTATIONS;
use crate::command::{HopTrust, NewChild, NewRoot, RequestMeta};
use crate::config::{Limits, TrustConfig};
use crate::core::limits::{MAX_BUDGET_UNITS, MAX_CHANNEL_BYTES, MAX_HORIZON_MS, MAX_TEXT_BYTES};
use crate::core::{self, ChildAsk, Id, InputError, Liability, Policy, Predicate, Scope, trust};
use crate::crypto::{self, payload_type};
use crate::pb;
use crate::store::ContractRecord;

/// An optional 32-byte ed25519 key: empty means none.
pub fn optional_key(bytes: &[u8], field: &'static str) -> Result<Option<[u8; 32]>, InputError> {
    if bytes.is_empty() {
        return Ok(None);
    }
    crypto::public_key(bytes)
        .map(|k| Some(k.to_bytes()))
        .map_err(|e| InputError::new(field, e.to_string()))
}

/// A JSON Schema text that must parse and compile; empty means none.
fn schema(text: &str, field: &'static str) -> Result<String, InputError> {
    if text.trim().is_empty() {
        return Ok(String::new());
    }
    core::text(text, core::limits::MAX_SCHEMA_BYTES, false, field)?;
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| InputError::new(field, format!("is not JSON: {e}")))?;
    core::judge::compile_schema(&value, field)?;
    Ok(text.to_owned())
}

/// Parses a 32-byte id.
pub fn id(bytes: &[u8], field: &'static str) -> Result<Id, InputError> {
    bytes
        .try_into()
        .map_err(|_| InputError::new(field, format!("must be 32 bytes, got {}", bytes.len())))
}

fn policy(p: Option<&pb::Policy>, limits: &Limits) -> Result<Policy, InputError> {
    let p = p.ok_or_else(|| InputError::new("body.policy", "is required"))?;
    Policy::new(
        p.max_depth,
        p.min_cumulative_trust_ppm,
        p.max_children,
        !p.disable_retry_headroom,
        p.require_host,
        limits.max_depth,
        limits.max_children,
    )
}

pub fn new_root(
    body: pb::OpenRootBody,
    request: RequestMeta,
    now_ms: i64,
    limits: &Limits,
) -> Result<NewRoot, InputError> {
    core::text(&body.intent, MAX_TEXT_BYTES, true, "body.intent")?;
    core::text(&body.task, MAX_TEXT_BYTES, false, "body.task")?;
    let budget = core::budget_units(body.budget, "body.budget")?;
    if body.deadline_ms <= now_ms || body.deadline_ms > now_ms.saturating_add(MAX_HORIZON_MS) {
        return Err(InputError::new(
            "body.deadline_ms",
            format!(
                "{} must be in the future and at most {MAX_HORIZON_MS} ms away",
                body.deadline_ms
            ),
        ));
    }
    let policy = policy(body.policy.as_ref(), limits)?;
    let predicate = Predicate::parse(&body.predicate, "body.predicate")?;
    // A root's effective predicate is its own: it must be judgeable too.
    Predicate::check_effective(&Predicate::default(), &predicate, "body.predicate")?;
    let write_scope = Scope::parse(&body.write_scope, "body.write_scope")?;
    let labels = core::labels(&body.labels, "body.labels")?;
    let task = if body.task.trim().is_empty() {
        body.intent.clone()
    } else {
        body.task
    };
    Ok(NewRoot {
        identity: None,
        request,
        intent: body.intent,
        task,
        budget,
        deadline_ms: body.deadline_ms,
        policy,
        predicate,
        write_scope,
        labels,
        // The call's span is the handler's: it sets this.
        trace: None,
    })
}

pub fn new_child(
    body: pb::DelegateBody,
    request: RequestMeta,
    now_ms: i64,
    trust_config: &TrustConfig,
    verified: &VerifiedAttestations,
) -> Result<NewChild, InputError> {
    let parent_id = id(&body.parent_id, "body.parent_id")?;
    let intent_lineage_hash = id(&body.intent_lineage_hash, "body.intent_lineage_hash")?;
    core::text(&body.task, MAX_TEXT_BYTES, true, "body.task")?;
    let delegate_key = crypto::public_key(&body.delegate_public_key)
        .map_err(|e| InputError::new("body.delegate_public_key", e.to_string()))?
        .to_bytes();
    let budget = core::budget_units(body.budget, "body.budget")?;
    let deadline_ms = match body.deadline_ms {
        0 => None,
        d if d < 0 || d > now_ms.saturating_add(MAX_HORIZON_MS) => {
            return Err(InputError::new(
                "body.deadline_ms",
                format!(
                    "{d} must be 0 (the parent's) or a unix time at most {MAX_HORIZON_MS} ms away"
                ),
            ));
        }
        d => Some(d),
    };
    let liability = Liability::from_i32(body.liability)
        .ok_or_else(|| InputError::new("body.liability", "must be PRINCIPAL or DELEGATE"))?;
    let predicate = Predicate::parse(&body.predicate, "body.predicate")?;
    core::text(
        &body.escalation_channel,
        MAX_CHANNEL_BYTES,
        false,
        "body.escalation_channel",
    )?;
    let min_retry_cost =
        core::non_negative(body.min_retry_cost, MAX_BUDGET_UNITS, "body.min_retry_cost")?;
    let min_retry_latency_ms = core::non_negative(
        body.min_retry_latency_ms,
        MAX_HORIZON_MS,
        "body.min_retry_latency_ms",
    )?;
    let write_scope = Scope::parse(&body.write_scope, "body.write_scope")?;
    let host = optional_key(&body.host_public_key, "body.host_public_key")?;
    if let Some(host) = &host {
        core::lifecycle::check_host(&delegate_key, host)?;
    }
    let result_schema_json = schema(&body.result_schema_json, "body.result_schema_json")?;
    let (factor_ppm, factor_note, hop_trust) = resolve_trust(
        body.delegate_attestation.as_ref(),
        &delegate_key,
        now_ms,
        trust_config,
        verified,
    )?;
    Ok(NewChild {
        identity: None,
        parent_id,
        ask: ChildAsk {
            requester: request.agent,
            intent_lineage_hash,
            budget,
            deadline_ms,
            liability,
            predicate,
            escalation_channel: body.escalation_channel.trim().to_owned(),
            min_retry_cost,
            min_retry_latency_ms,
            write_scope,
            factor_ppm,
            factor_note,
        },
        request,
        task: body.task,
        delegate_key,
        trust: hop_trust,
        host,
        result_schema_json,
        // Converted off the call's task: the handler sets this.
        trace: None,
    })
}

/// The delegate's trust factor (`core::trust::resolve`, the rule), from
/// the attestation envelope as presented: its type and payload are
/// checked here, its signature verified (or remembered) only when the
/// rule asks.
pub fn resolve_trust(
    attestation: Option<&pb::Envelope>,
    delegate_key: &[u8; 32],
    now_ms: i64,
    config: &TrustConfig,
    verified: &VerifiedAttestations,
) -> Result<(u32, String, HopTrust), InputError> {
    let static_ppm = config.static_factors_ppm.get(delegate_key).copied();
    let Some(envelope) = attestation else {
        let resolved = trust::resolve(None, delegate_key, static_ppm, now_ms, || false)?;
        return Ok(hop_trust(resolved, None, String::new()));
    };
    if envelope.payload_type != payload_type::ATTESTATION {
        return Err(InputError::new(
            "body.delegate_attestation.payload_type",
            format!("must be {:?}", payload_type::ATTESTATION),
        ));
    }
    let statement = pb::Attestation::decode(envelope.payload.as_slice()).map_err(|e| {
        InputError::new(
            "body.delegate_attestation.payload",
            format!("is not an Attestation: {e}"),
        )
    })?;
    let stated = trust::Statement {
        factor: statement.factor,
        risk_class: &statement.risk_class,
        agent_key: &statement.agent_public_key,
        not_before_ms: statement.not_before_ms,
        expires_at_ms: statement.expires_at_ms,
    };
    let resolved = trust::resolve(Some(stated), delegate_key, static_ppm, now_ms, || {
        verified.check(envelope, || {
            config.attestors.iter().any(|attestor| {
                crypto::verify_envelope(envelope, payload_type::ATTESTATION, attestor).is_ok()
            })
        })
    })?;
    Ok(hop_trust(resolved, Some(envelope), statement.risk_class))
}

/// The factor, its note, and the contract's record of where it came from
/// (the attestation's digest and risk class only when it counted).
fn hop_trust(
    resolved: trust::Resolved,
    attestation: Option<&pb::Envelope>,
    risk_class: String,
) -> (u32, String, HopTrust) {
    let (source, attestation_digest, risk_class) = match resolved.source {
        trust::Source::None => (pb::TrustSource::None, None, String::new()),
        trust::Source::StaticTable => (pb::TrustSource::StaticTable, None, String::new()),
        trust::Source::Attestation => (
            pb::TrustSource::Attestation,
            attestation.map(|e| crypto::sha256(&e.payload)),
            risk_class,
        ),
    };
    let trust = HopTrust {
        source,
        attestation_digest,
        risk_class,
    };
    (resolved.factor_ppm, resolved.note, trust)
}

/// Attestations are long-lived and presented again on every delegation to
/// the same agent; remembering the ones whose signature verified saves an
/// ed25519 verification per hop. Keyed by a digest of the whole envelope
/// (type, payload and every signature), so any change is a miss. Expiry
/// and the agent binding are still checked on every use.
#[derive(Default)]
pub struct VerifiedAttestations {
    digests: std::sync::Mutex<std::collections::HashSet<[u8; 32]>>,
}

impl VerifiedAttestations {
    fn digest(envelope: &pb::Envelope) -> [u8; 32] {
        let mut bytes = crypto::pae(&envelope.payload_type, &envelope.payload);
        for signature in &envelope.signatures {
            bytes.extend_from_slice(signature.keyid.as_bytes());
            bytes.extend_from_slice(&signature.sig);
        }
        crypto::sha256(&bytes)
    }

    /// True when `envelope`'s signature verified before: checking it again
    /// costs a digest and a lookup, no signature verification.
    pub fn remembers(&self, envelope: &pb::Envelope) -> bool {
        let digest = Self::digest(envelope);
        self.digests.lock().is_ok_and(|set| set.contains(&digest))
    }

    fn check(&self, envelope: &pb::Envelope, verify: impl FnOnce() -> bool) -> bool {
        let digest = Self::digest(envelope);
        if self.digests.lock().is_ok_and(|set| set.contains(&digest)) {
            return true;
        }
        let ok = verify();
        if ok && let Ok(mut set) = self.digests.lock() {
            if set.len() >= MAX_VERIFIED_ATTESTATIONS {
                set.clear();
            }
            set.insert(digest);
        }
        ok
    }
}

pub fn contract_state(record: ContractRecord) -> pb::ContractState {
    let ledger = record.ledger;
    pb::ContractState {
        contract_id: record.id.to_vec(),
        contract: Some(record.envelope),
        effective_predicate: record.effective_predicate,
        host_public_key: record.host_key.map(|k| k.to_vec()).unwrap_or_default(),
        tenant: record.tenant,
        status: status_to_pb(record.status) as i32,
        ledger: Some(pb::Ledger {
            budget: ledger.budget,
            reserved: ledger.reserved,
            spent: ledger.spent,
            residual: ledger.residual(),
            open_children: ledger.open_children,
        }),
    }
}

/// The delegate key a stored contract names; empty if its payload does
/// not decode (the broker signed it, so it does).
pub fn delegate_key_of(envelope: &pb::Sealed) -> Vec<u8> {
    pb::Contract::decode(envelope.payload.as_slice())
        .map(|contract| contract.delegate_public_key)
        .unwrap_or_default()
}

fn status_to_pb(status: core::Status) -> pb::ContractStatus {
    use core::Status;
    match status {
        Status::Open => pb::ContractStatus::Open,
        Status::Accepted => pb::ContractStatus::Accepted,
        Status::Completed => pb::ContractStatus::Completed,
        Status::Unresolvable => pb::ContractStatus::Unresolvable,
        Status::Expired => pb::ContractStatus::Expired,
        Status::Revoked => pb::ContractStatus::Revoked,
        Status::Declined => pb::ContractStatus::Declined,
    }
}

/// Lifecycle bodies → the store's command, one validator per body.
pub mod lifecycle {
    use super::{id, optional_key};
    use crate::command::{Action, CompleteArgs, ObservationIn};
    use crate::core::judge::{self, Verdict};
    use crate::core::limits::{
        MAX_BUDGET_UNITS, MAX_OBSERVATIONS_PER_REQUEST, MAX_OBSERVED_PATH_BYTES, MAX_REASON_BYTES,
        MAX_RESULT_BYTES, MAX_TEXT_BYTES, MAX_TOOL_NAME_BYTES,
    };
    use crate::core::{self, Id, InputError};
    use crate::pb;

    fn reason(text: &str, field: &'static str) -> Result<String, InputError> {
        core::text(text, MAX_REASON_BYTES, false, field)?;
        Ok(text.to_owned())
    }

    pub fn accept(body: pb::AcceptBody) -> Result<(Id, Action), InputError> {
        Ok((
            id(&body.contract_id, "body.contract_id")?,
            Action::Accept {
                host: optional_key(&body.host_public_key, "body.host_public_key")?,
            },
        ))
    }

    /// A body that ends a contract for a reason.
    fn ending(
        contract_id: &[u8],
        text: &str,
        action: fn(String) -> Action,
    ) -> Result<(Id, Action), InputError> {
        let contract = id(contract_id, "body.contract_id")?;
        Ok((contract, action(reason(text, "body.reason")?)))
    }

    pub fn decline(body: pb::DeclineBody) -> Result<(Id, Action), InputError> {
        ending(&body.contract_id, &body.reason, |reason| Action::Decline {
            reason,
        })
    }

    pub fn escalate(body: pb::EscalateBody) -> Result<(Id, Action), InputError> {
        ending(&body.contract_id, &body.reason, |reason| Action::Escalate {
            reason,
        })
    }

    pub fn revoke(body: pb::RevokeBody) -> Result<(Id, Action), InputError> {
        ending(&body.contract_id, &body.reason, |reason| Action::Revoke {
            reason,
        })
    }

    pub fn adjudicate(body: pb::AdjudicateBody) -> Result<(Id, Action), InputError> {
        let verdict = match pb::Verdict::try_from(body.verdict) {
            Ok(pb::Verdict::Accepted) => Verdict::Accepted,
            Ok(pb::Verdict::Rejected) => Verdict::Rejected,
            _ => {
                return Err(InputError::new(
                    "body.verdict",
                    "must be ACCEPTED or REJECTED",
                ));
            }
        };
        Ok((
            id(&body.contract_id, "body.contract_id")?,
            Action::Adjudicate {
                verdict,
                reason: reason(&body.reason, "body.reason")?,
            },
        ))
    }

    pub fn complete(body: pb::CompleteBody) -> Result<(Id, Action), InputError> {
        let contract_id = id(&body.contract_id, "body.contract_id")?;
        if body.output_json.len() > MAX_RESULT_BYTES {
            return Err(InputError::new(
                "body.output_json",
                format!(
                    "{} bytes, at most {MAX_RESULT_BYTES}",
                    body.output_json.len()
                ),
            ));
        }
        let output: serde_json::Value = if body.output_json.trim().is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::from_str(&body.output_json)
                .map_err(|e| InputError::new("body.output_json", format!("is not JSON: {e}")))?
        };
        judge::check_output(&output, "body.output_json")?;
        judge::check_claim(&body.claim, "body.claim")?;
        if let Some(report) = &body.report {
            core::text(&report.status, 64, false, "body.report.status")?;
            core::text(
                &report.summary,
                MAX_TEXT_BYTES,
                false,
                "body.report.summary",
            )?;
        }
        let reported_consumed =
            core::non_negative(body.consumed, MAX_BUDGET_UNITS, "body.consumed")?;
        Ok((
            contract_id,
            Action::Complete(Box::new(CompleteArgs {
                output_digest: crate::crypto::sha256(body.output_json.as_bytes()),
                output,
                has_report: body.report.is_some(),
                claim: body.claim,
                reported_consumed,
                // Set by the store when it takes the command.
                received_at_ms: None,
                prejudged: None,
            })),
        ))
    }

    pub fn record(body: pb::RecordReceiptsBody) -> Result<(Id, Action), InputError> {
        let contract_id = id(&body.contract_id, "body.contract_id")?;
        if body.observations.is_empty() || body.observations.len() > MAX_OBSERVATIONS_PER_REQUEST {
            return Err(InputError::new(
                "body.observations",
                format!(
                    "{} observations, must be 1..={MAX_OBSERVATIONS_PER_REQUEST}",
                    body.observations.len()
                ),
            ));
        }
        let mut observations = Vec::with_capacity(body.observations.len());
        for o in body.observations {
            let kind = match pb::ObservationKind::try_from(o.kind) {
                Ok(
                    k @ (pb::ObservationKind::ToolCall
                    | pb::ObservationKind::Read
                    | pb::ObservationKind::Mutation),
                ) => k,
                _ => {
                    return Err(InputError::new(
                        "body.observations.kind",
                        "must be TOOL_CALL, READ or MUTATION",
                    ));
                }
            };
            let needs_path = kind != pb::ObservationKind::ToolCall;
            core::text(
                &o.path,
                MAX_OBSERVED_PATH_BYTES,
                needs_path,
                "body.observations.path",
            )?;
            core::text(
                &o.tool,
                MAX_TOOL_NAME_BYTES,
                false,
                "body.observations.tool",
            )?;
            let units = core::non_negative(o.units, MAX_BUDGET_UNITS, "body.observations.units")?;
            let is_call = kind == pb::ObservationKind::ToolCall;
            let arguments_sha256 = match o.arguments_sha256.len() {
                0 => None,
                32 if is_call => o.arguments_sha256.as_slice().try_into().ok(),
                _ => {
                    return Err(InputError::new(
                        "body.observations.arguments_sha256",
                        "must be empty, or 32 bytes on a TOOL_CALL",
                    ));
                }
            };
            let outcome = match pb::ToolOutcome::try_from(o.outcome) {
                Ok(pb::ToolOutcome::Unspecified) => pb::ToolOutcome::Unspecified,
                Ok(outcome) if is_call => outcome,
                _ => {
                    return Err(InputError::new(
                        "body.observations.outcome",
                        "must be UNSPECIFIED, or SUCCEEDED or FAILED on a TOOL_CALL",
                    ));
                }
            };
            observations.push(ObservationIn {
                kind,
                path: o.path,
                tool: o.tool,
                units,
                at_ms: o.at_ms,
                arguments_sha256,
                outcome,
            });
        }
        Ok((contract_id, Action::Record { observations }))
    }
}
