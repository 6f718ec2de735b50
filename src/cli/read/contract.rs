//! `get`: one contract, its terms, ledger and signatures, as text or JSON.

use super::*;

/// An enum value's name without its prefix; an unknown value as a number.
fn name<E>(known: Result<&'static str, E>, prefix: &str, raw: i32) -> String {
    known
        .map(|n| n.trim_start_matches(prefix).to_owned())
        .unwrap_or_else(|_| format!("UNKNOWN({raw})"))
}

/// A contract as `get` shows it: verified, with its principal.
pub struct ContractView {
    pub state: pb::ContractState,
    pub contract: pb::Contract,
    /// Who issued it: the parent's delegate (a root's own delegate).
    pub principal: Vec<u8>,
    /// The key whose signature was checked.
    pub verified_by: String,
}

/// `get`: one contract's terms, status, ledger and effective predicate.
pub fn get(args: GetArgs) -> anyhow::Result<()> {
    let id = parse_id(&args.contract_id, "CONTRACT_ID")?;
    let view = runtime()?.block_on(async {
        let mut reader = open(&args.read).await?;
        if let Some(path) = &args.chain_out {
            let request = pb::GetChainRequest {
                contract_id: id.to_vec(),
            };
            let chain = call("GetChain", reader.client.get_chain(request)).await?;
            tokio::fs::write(path, chain.encode_to_vec())
                .await
                .with_context(|| format!("--chain-out {}: cannot write", path.display()))?;
        }
        read_contract(&mut reader, &id).await
    })?;
    let text = if args.json {
        format!("{}\n", serde_json::to_string(&contract_json(&view))?)
    } else {
        contract_text(&view)
    };
    emit(&text)?;
    Ok(())
}

/// Reads `id`, checks it is what the broker signed, and reads its parent
/// for the principal.
pub(super) async fn read_contract(
    reader: &mut Reader,
    id: &[u8; 32],
) -> anyhow::Result<ContractView> {
    let state = contract_state(reader, id).await?;
    let sealed = state.contract.clone().unwrap_or_default();
    let contract = pb::Contract::decode(sealed.payload.as_slice())
        .context("GetContract: the contract does not decode")?;
    let verified_by = verify(
        &reader.keys,
        &sealed,
        payload_type::CONTRACT,
        &contract.broker_key_id,
        contract.issued_at_ms,
        "the contract",
    )?;
    let principal = if contract.parent_id.is_empty() {
        contract.delegate_public_key.clone()
    } else {
        let parent_id = <[u8; 32]>::try_from(contract.parent_id.as_slice())
            .map_err(|_| anyhow::anyhow!("the contract's parent_id is not 32 bytes"))?;
        let parent = contract_state(reader, &parent_id).await?;
        pb::Contract::decode(parent.contract.unwrap_or_default().payload.as_slice())
            .context("GetContract: the parent does not decode")?
            .delegate_public_key
    };
    Ok(ContractView {
        state,
        contract,
        principal,
        verified_by,
    })
}

/// GetContract, with the answer's id checked against what it carries.
pub(super) async fn contract_state(
    reader: &mut Reader,
    id: &[u8; 32],
) -> anyhow::Result<pb::ContractState> {
    let state = call(
        "GetContract",
        reader.client.get_contract(pb::GetContractRequest {
            contract_id: id.to_vec(),
        }),
    )
    .await?
    .contract
    .ok_or_else(|| anyhow::anyhow!("GetContract: the broker answered without the contract"))?;
    let payload = state.contract.as_ref().map(|s| s.payload.as_slice());
    anyhow::ensure!(
        payload.is_some_and(|p| crypto::sha256(p) == *id),
        "GetContract: the contract answered for {} is not the one asked for",
        hex::encode(id)
    );
    Ok(state)
}

/// Checks a broker signature against the published keys: the key the
/// payload names, valid for its id, and not retired before `at_ms`.
/// Returns the key's id.
pub(super) fn verify(
    published: &[pb::BrokerKey],
    sealed: &pb::Sealed,
    type_: &str,
    key_id: &str,
    at_ms: i64,
    what: &str,
) -> anyhow::Result<String> {
    let keys = crate::chain::BrokerKeys::from_published(published);
    let shown: String = key_id.chars().take(80).collect();
    let key = keys.get(0, key_id).map_err(|_| {
        anyhow::anyhow!("{what} is signed by {shown:?}, which GetBrokerKeys does not publish")
    })?;
    crypto::verify_sealed(sealed, type_, key)
        .map_err(|_| anyhow::anyhow!("{what}'s signature does not verify under {shown}"))?;
    // A retired key vouches only for what it signed before it retired:
    // the chain verifier's rule, the one every verifier here applies.
    if let Err(crate::chain::ChainError::Retired { retired_at_ms, .. }) =
        keys.check_dated(0, key_id, at_ms)
    {
        anyhow::bail!(
            "{what} is dated {at_ms} ms, after its key {shown} retired ({retired_at_ms} ms)"
        );
    }
    Ok(key_id.to_owned())
}

/// `key: value` lines with the values aligned; a value's own lines are
/// continued under it. Every value is made safe for a terminal.
#[derive(Default)]
pub(in crate::cli) struct Fields(Vec<(String, String)>);

impl Fields {
    pub(in crate::cli) fn add(&mut self, key: &str, value: impl Into<String>) {
        self.0.push((key.to_owned(), value.into()));
    }

    pub(in crate::cli) fn render(&self) -> String {
        let width = self.0.iter().map(|(k, _)| k.len() + 1).max().unwrap_or(0);
        let mut out = String::new();
        for (key, value) in &self.0 {
            let mut label = format!("{key}:");
            for line in value.split('\n') {
                let _ = writeln!(out, "{label:width$} {}", safe(line));
                label.clear();
            }
        }
        out
    }
}

/// Bytes as hex, `-` when empty.
pub(in crate::cli) fn hex_or_dash(bytes: &[u8]) -> String {
    if bytes.is_empty() {
        "-".to_owned()
    } else {
        hex::encode(bytes)
    }
}

pub(super) fn text_or_dash(text: &str) -> String {
    if text.is_empty() {
        "-".to_owned()
    } else {
        text.to_owned()
    }
}

pub(in crate::cli) fn when(ms: i64) -> String {
    format!("{} ({ms} ms)", rfc3339(ms))
}

/// What `get` prints.
pub fn contract_text(view: &ContractView) -> String {
    let (c, state) = (&view.contract, &view.state);
    let mut f = Fields::default();
    f.add("contract", hex::encode(&state.contract_id));
    f.add(
        "parent",
        if c.parent_id.is_empty() {
            "- (a root)".to_owned()
        } else {
            hex::encode(&c.parent_id)
        },
    );
    f.add("depth", c.depth.to_string());
    f.add("status", status_name(state.status));
    f.add("delegate", hex::encode(&c.delegate_public_key));
    if !c.delegate_identity.is_empty() {
        f.add("identity", c.delegate_identity.clone());
    }
    f.add("principal", hex::encode(&view.principal));
    f.add("host", hex_or_dash(&c.host_public_key));
    if !c.intent.is_empty() {
        f.add("intent", c.intent.clone());
    }
    f.add("task", text_or_dash(&c.task));
    f.add("budget", c.budget.to_string());
    if let Some(l) = &state.ledger {
        f.add(
            "ledger",
            format!(
                "budget {} = residual {} + reserved {} + spent {}; {} open children",
                l.budget, l.residual, l.reserved, l.spent, l.open_children
            ),
        );
    }
    f.add("deadline", when(c.deadline_ms));
    f.add("issued", when(c.issued_at_ms));
    f.add("trust", trust_text(c));
    f.add("liability", liability_name(c.liability));
    f.add("escalation channel", text_or_dash(&c.escalation_channel));
    f.add(
        "retry",
        format!(
            "min cost {}, min latency {} ms",
            c.min_retry_cost, c.min_retry_latency_ms
        ),
    );
    f.add(
        "write scope",
        if c.write_scope.is_empty() {
            "- (nothing writable)".to_owned()
        } else {
            c.write_scope.join(", ")
        },
    );
    f.add("predicate", text_or_dash(&c.predicate));
    f.add(
        "effective predicate",
        text_or_dash(&state.effective_predicate),
    );
    f.add("result schema", text_or_dash(&c.result_schema_json));
    if let Some(p) = &c.policy {
        f.add("policy", policy_text(p));
    }
    if !c.labels.is_empty() {
        let mut labels: Vec<String> = c.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        labels.sort();
        f.add("labels", labels.join(", "));
    }
    f.add("lineage hash", hex::encode(&c.intent_lineage_hash));
    f.add("request digest", hex_or_dash(&c.request_digest));
    f.add("signature", format!("verified ({})", view.verified_by));
    f.render()
}

/// A hop's trust: cumulative, this hop's factor and where it came from.
fn trust_text(c: &pb::Contract) -> String {
    let source = name(
        pb::TrustSource::try_from(c.trust_source).map(|s| s.as_str_name()),
        "TRUST_SOURCE_",
        c.trust_source,
    );
    let mut trust = format!(
        "{} ({} ppm), this hop {} from {source}",
        ppm(c.cumulative_trust_ppm),
        c.cumulative_trust_ppm,
        ppm(c.factor_ppm)
    );
    if !c.risk_class.is_empty() {
        let _ = write!(trust, ", risk class {}", c.risk_class);
    }
    if !c.attestation_digest.is_empty() {
        let _ = write!(
            trust,
            ", attestation {}",
            hex::encode(&c.attestation_digest)
        );
    }
    trust
}

/// A root's policy on one line.
fn policy_text(p: &pb::Policy) -> String {
    format!(
        "max depth {}, min trust {}, max children {}, retry headroom {}, host required {}",
        p.max_depth,
        ppm(p.min_cumulative_trust_ppm),
        p.max_children,
        if p.disable_retry_headroom {
            "off"
        } else {
            "on"
        },
        if p.require_host { "yes" } else { "no" }
    )
}

/// A contract's signed terms as JSON (what `get` and `watch` share).
pub(in crate::cli) fn terms_json(id: &[u8], c: &pb::Contract) -> Map<String, Value> {
    let policy = c.policy.as_ref().map(|p| {
        json!({
            "max_depth": p.max_depth,
            "min_cumulative_trust_ppm": p.min_cumulative_trust_ppm,
            "max_children": p.max_children,
            "disable_retry_headroom": p.disable_retry_headroom,
            "require_host": p.require_host,
        })
    });
    let value = json!({
        "contract_id": hex::encode(id),
        "parent_id": hex::encode(&c.parent_id),
        "depth": c.depth,
        "broker_key_id": c.broker_key_id,
        "intent": c.intent,
        "intent_lineage_hash": hex::encode(&c.intent_lineage_hash),
        "task": c.task,
        "delegate_public_key": hex::encode(&c.delegate_public_key),
        "delegate_identity": c.delegate_identity,
        "host_public_key": hex::encode(&c.host_public_key),
        "budget": c.budget,
        "deadline_ms": c.deadline_ms,
        "deadline": rfc3339(c.deadline_ms),
        "issued_at_ms": c.issued_at_ms,
        "issued_at": rfc3339(c.issued_at_ms),
        "liability": liability_name(c.liability),
        "predicate": c.predicate,
        "escalation_channel": c.escalation_channel,
        "min_retry_cost": c.min_retry_cost,
        "min_retry_latency_ms": c.min_retry_latency_ms,
        "write_scope": c.write_scope,
        "policy": policy,
        "request_digest": hex::encode(&c.request_digest),
        "result_schema_json": c.result_schema_json,
        "labels": c.labels.iter().collect::<std::collections::BTreeMap<_, _>>(),
        "factor_ppm": c.factor_ppm,
        "cumulative_trust_ppm": c.cumulative_trust_ppm,
        "trust_source": name(
            pb::TrustSource::try_from(c.trust_source).map(|s| s.as_str_name()),
            "TRUST_SOURCE_",
            c.trust_source,
        ),
        "attestation_digest": hex::encode(&c.attestation_digest),
        "risk_class": c.risk_class,
    });
    match value {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

pub(in crate::cli) fn ledger_json(ledger: Option<&pb::Ledger>) -> Value {
    ledger.map_or(Value::Null, |l| {
        json!({
            "budget": l.budget,
            "reserved": l.reserved,
            "spent": l.spent,
            "residual": l.residual,
            "open_children": l.open_children,
        })
    })
}

/// What `get --json` prints: the terms, then the broker's state of them.
pub fn contract_json(view: &ContractView) -> Value {
    let mut map = terms_json(&view.state.contract_id, &view.contract);
    map.insert("status".into(), status_name(view.state.status).into());
    map.insert("ledger".into(), ledger_json(view.state.ledger.as_ref()));
    map.insert(
        "effective_predicate".into(),
        view.state.effective_predicate.clone().into(),
    );
    map.insert(
        "principal_public_key".into(),
        hex::encode(&view.principal).into(),
    );
    map.insert("verified".into(), true.into());
    map.insert("verified_by".into(), view.verified_by.clone().into());
    Value::Object(map)
}

// ---------------------------------------------------------------- children
