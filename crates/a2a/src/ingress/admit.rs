//! Admission of a task-starting message: its chain verified offline
//! against the broker's keys, its leaf naming this agent and not past its
//! deadline, its contract open at the broker and bound to one task within
//! max_tasks and its tenant's share.

use std::time::Instant;

use a2a_pb::protojson as a2a;
use serde_json::{Map, Value};

use crate::Gateway;
use crate::ext::{self, Refused, code};
use crate::now_ms;
use broker_client::names::status_name;
use broker_domain::Id;
use broker_wire::chain::{BrokerKeys, ChainError, Hop, verify_chain};
use broker_wire::pb;

/// A task-starting message's contract, admitted and bound to the task
/// about to start.
pub(super) struct Admission<'a> {
    pub contract_id: Id,
    pub deadline_ms: i64,
    /// The broker tenant whose share of max_tasks the task counts in.
    pub tenant: String,
    pub binding: Binding<'a>,
}

/// Admits a task-starting message under the chain its `extension`
/// carries, and marks the message (`request`'s) with the contract.
pub(super) async fn admit_message<'a>(
    gateway: &'a Gateway,
    extension: Option<&Map<String, Value>>,
    request: &mut a2a::SendMessageRequest,
    started: Instant,
) -> Result<Admission<'a>, Refused> {
    let chain = ext::chain_of(extension)?;
    let (contract_id, deadline_ms) = admit_chain(gateway, &chain).await?;
    tracing::debug!(
        elapsed_us = started.elapsed().as_micros() as u64,
        "ingress: chain verified"
    );
    // The broker's state first: it names the tenant whose share binds.
    let state = gateway.contract(&contract_id).await?;
    let tenant = tenant_of(&state);
    let binding = bind(gateway, contract_id, &tenant)?;
    if let Some(message) = request.message.as_mut() {
        ext::mark(message, &contract_id);
    }
    match pb::ContractStatus::try_from(state.status) {
        Ok(pb::ContractStatus::Open) => {}
        Ok(pb::ContractStatus::Accepted) => {
            return Err(ended(
                &contract_id,
                "already accepted: its task was started".into(),
            ));
        }
        _ => {
            return Err(ended(
                &contract_id,
                format!("it is {}", status_name(state.status)),
            ));
        }
    }
    tracing::debug!(
        elapsed_us = started.elapsed().as_micros() as u64,
        "ingress: contract read"
    );
    Ok(Admission {
        contract_id,
        deadline_ms,
        tenant,
        binding,
    })
}

/// The broker tenant a contract's tree is in; a broker that does not name
/// it (older than ContractState.tenant) is counted as the shared `open`
/// one, so a share still bounds it.
pub(crate) fn tenant_of(state: &pb::ContractState) -> String {
    if state.tenant.is_empty() {
        broker_domain::tenant::OPEN_TENANT.to_owned()
    } else {
        state.tenant.clone()
    }
}

pub(crate) fn check_size(message: &a2a::Message) -> Result<(), Refused> {
    if message.parts.len() > ext::MAX_PARTS {
        return Err(Refused::new(
            code::INVALID_PARAMS,
            "MESSAGE_TOO_LARGE",
            format!(
                "message.parts: {} parts, at most {}",
                message.parts.len(),
                ext::MAX_PARTS
            ),
        )
        .with("field", "message.parts"));
    }
    Ok(())
}

/// The gateway's chain check: the binary's one verifier, the CLI's
/// (`verify_chain`: a key retired before the leaf was issued does not
/// vouch for it).
fn check_chain(sealed: &[pb::Sealed], keys: &BrokerKeys) -> Result<Vec<Hop>, ChainError> {
    verify_chain(sealed, keys, None)
}

/// Verifies a chain offline and returns its leaf, refusing what does not
/// name this agent or has passed its deadline.
pub(crate) async fn admit_chain(
    gateway: &Gateway,
    chain: &pb::GetChainResponse,
) -> Result<(Id, i64), Refused> {
    let field = format!("message.metadata[{}].chain", ext::URI);
    let sealed: Vec<pb::Sealed> = chain
        .chain
        .iter()
        .map(|state| state.contract.clone().unwrap_or_default())
        .collect();
    let mut verified = check_chain(&sealed, &gateway.keys(false).await?);
    if matches!(verified, Err(ChainError::UnknownKey { .. })) {
        // A key published since the gateway last read them (a rotation).
        verified = check_chain(&sealed, &gateway.keys(true).await?);
    }
    let hops = verified.map_err(|e| {
        let reason = match e {
            ChainError::Empty | ChainError::TooLong(_) | ChainError::Undecodable { .. } => {
                "UNDECODABLE_MESSAGE"
            }
            _ => "BAD_SIGNATURE",
        };
        Refused::new(
            code::INVALID_PARAMS,
            reason,
            format!("{field} does not verify against the broker's keys: {e}"),
        )
        .with("field", field.clone())
    })?;
    let leaf = hops.last().ok_or_else(|| {
        Refused::new(
            code::INVALID_PARAMS,
            "UNDECODABLE_MESSAGE",
            format!("{field} is empty"),
        )
    })?;
    if leaf.contract.delegate_public_key != gateway.agent_key {
        return Err(Refused::new(
            code::INVALID_PARAMS,
            "NOT_DELEGATE",
            format!(
                "contract {} is for agent {}, not for this one ({}): ask the broker for a contract naming this agent",
                hex::encode(leaf.id),
                hex::encode(&leaf.contract.delegate_public_key),
                hex::encode(gateway.agent_key)
            ),
        )
        .with("contractId", hex::encode(leaf.id)));
    }
    if leaf.contract.deadline_ms <= now_ms() {
        return Err(Refused::new(
            code::INVALID_PARAMS,
            "LATE",
            format!(
                "contract {} passed its deadline ({} ms since the Unix epoch)",
                hex::encode(leaf.id),
                leaf.contract.deadline_ms
            ),
        )
        .with("contractId", hex::encode(leaf.id)));
    }
    Ok((leaf.id, leaf.contract.deadline_ms))
}

pub(crate) fn ended(contract_id: &Id, why: String) -> Refused {
    Refused::new(
        code::INVALID_PARAMS,
        "ENDED",
        format!(
            "contract {}: {why}; a new task needs a new contract",
            hex::encode(contract_id)
        ),
    )
    .with("contractId", hex::encode(contract_id))
}

/// Unbinds a contract whose task never started (a refusal or an error
/// after binding).
pub(crate) struct Binding<'a> {
    gateway: &'a Gateway,
    contract_id: Id,
    kept: bool,
}

impl Binding<'_> {
    /// Keeps the contract bound to `task` (a task id, or a label).
    pub(crate) fn keep(&mut self, task: String) {
        let mut admitted = self
            .gateway
            .admitted
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        admitted.contracts.insert(self.contract_id, Some(task));
        self.kept = true;
    }
}

impl Drop for Binding<'_> {
    fn drop(&mut self) {
        if !self.kept {
            let mut admitted = self
                .gateway
                .admitted
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            admitted.contracts.remove(&self.contract_id);
        }
    }
}

/// Binds `contract_id` (in a tree of broker tenant `tenant`) to the task
/// about to start, within max_tasks and the tenant's share of it.
pub(crate) fn bind<'a>(
    gateway: &'a Gateway,
    contract_id: Id,
    tenant: &str,
) -> Result<Binding<'a>, Refused> {
    let max_tasks = gateway.config.max_tasks;
    let share = gateway.config.tasks_per_tenant();
    let mut admitted = gateway.admitted.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(task) = admitted.contracts.get(&contract_id) {
        return Err(ended(
            &contract_id,
            match task {
                Some(task) => format!("already bound to task {:?}", ext::echoed(task)),
                None => "a task is being started under it".into(),
            },
        ));
    }
    if admitted.tasks.len() >= max_tasks || admitted.of_tenant(tenant) >= share {
        // Forget tasks whose contract has ended; refuse when too few have.
        let done: Vec<String> = admitted
            .tasks
            .iter()
            .filter(|(_, slot)| slot.progress.try_lock().is_ok_and(|p| p.0.ended))
            .map(|(id, _)| id.clone())
            .collect();
        for id in done {
            // An ended contract is refused by the broker's state from
            // here on: its binding need not be remembered either.
            if let Some(slot) = admitted.forget(&id) {
                admitted.contracts.remove(&slot.contract_id);
            }
        }
        if admitted.tasks.len() >= max_tasks {
            return Err(Refused::new(
                code::INTERNAL,
                "OVERLOADED",
                format!("this gateway follows {max_tasks} tasks already (max_tasks)"),
            )
            .with("limit", "max_tasks"));
        }
        // Many keys are one tenant when the broker says so (free keys all
        // share `open`): they cannot take the others' places.
        if admitted.of_tenant(tenant) >= share {
            return Err(Refused::new(
                code::INTERNAL,
                "OVERLOADED",
                format!(
                    "this gateway follows {share} tasks of tenant {:?} already, its share of max_tasks (max_tasks_per_tenant)",
                    ext::echoed(tenant)
                ),
            )
            .with("limit", "max_tasks_per_tenant")
            .with("tenant", ext::echoed(tenant)));
        }
    }
    admitted.contracts.insert(contract_id, None);
    Ok(Binding {
        gateway,
        contract_id,
        kept: false,
    })
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::*;

    #[test]
    fn a_message_of_too_many_parts_is_refused_by_name() {
        let part = a2a::Part {
            content: Some(a2a::part::Content::Text("x".into())),
            ..Default::default()
        };
        let mut message = a2a::Message {
            parts: vec![part; ext::MAX_PARTS],
            ..Default::default()
        };
        assert!(check_size(&message).is_ok());
        message.parts.push(message.parts[0].clone());
        let refused = check_size(&message).unwrap_err();
        assert_eq!(refused.reason, "MESSAGE_TOO_LARGE");
        assert_eq!(refused.metadata["field"], "message.parts");
    }

    #[test]
    fn a_chain_signed_after_its_key_retired_is_refused() {
        let key = broker_wire::crypto::generate_signing_key();
        let (chain, _) = broker_wire::chain::fixture::stamped_chain(&key, 1, "true", |_| {
            broker_wire::chain::fixture::Hop {
                budget: 10,
                liability: broker_domain::Liability::Delegate,
                predicate: String::new(),
                factor_ppm: 900_000,
            }
        });
        let issued_at_ms = pb::Contract::decode(chain[1].payload.as_slice())
            .unwrap()
            .issued_at_ms;
        let public = key.verifying_key().to_bytes();
        let keys = |retired_at_ms: i64| {
            BrokerKeys::from_published(&[pb::BrokerKey {
                key_id: broker_wire::crypto::key_id(&public),
                public_key: public.to_vec(),
                current: false,
                retired_at_ms,
            }])
        };
        assert!(check_chain(&chain, &keys(issued_at_ms + 1)).is_ok());
        assert!(matches!(
            check_chain(&chain, &keys(issued_at_ms)),
            Err(ChainError::Retired { index: 1, .. })
        ));
    }

    #[test]
    fn oversized_extension_metadata_is_refused_before_it_is_read() {
        let big = "A".repeat(ext::MAX_EXTENSION_BYTES + 1);
        let mut message = a2a::Message {
            metadata: serde_json::from_value(serde_json::json!({ ext::URI: { "chain": big } }))
                .ok(),
            ..Default::default()
        };
        assert_eq!(
            ext::take(&mut message).unwrap_err().reason,
            "MESSAGE_TOO_LARGE"
        );
    }
}
