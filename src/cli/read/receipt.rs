//! `receipt`: one receipt, verified, as text or JSON.

use super::*;

/// `receipt`: one receipt, decoded, verified against the broker's keys.
pub fn receipt(args: ReceiptArgs) -> anyhow::Result<()> {
    let id = parse_id(&args.receipt_id, "RECEIPT_ID")?;
    let (receipt, verified_by) = runtime()?.block_on(async {
        let mut reader = open(&args.read).await?;
        let sealed = call(
            "GetReceipt",
            reader.client.get_receipt(pb::GetReceiptRequest {
                receipt_id: id.to_vec(),
            }),
        )
        .await?
        .receipt
        .ok_or_else(|| anyhow::anyhow!("GetReceipt: the broker answered without the receipt"))?;
        anyhow::ensure!(
            crypto::sha256(&sealed.payload) == id,
            "GetReceipt: the receipt answered for {} is not the one asked for",
            hex::encode(id)
        );
        let receipt = pb::Receipt::decode(sealed.payload.as_slice())
            .context("GetReceipt: the receipt does not decode")?;
        let verified_by = verify(
            &reader.keys,
            &sealed,
            payload_type::RECEIPT,
            &receipt.broker_key_id,
            receipt.at_ms,
            "the receipt",
        )?;
        anyhow::Ok((receipt, verified_by))
    })?;
    let text = if args.json {
        let mut map = receipt_json(&id, &receipt);
        map.insert("verified".into(), true.into());
        map.insert("verified_by".into(), verified_by.into());
        format!("{}\n", serde_json::to_string(&Value::Object(map))?)
    } else {
        receipt_text(&id, &receipt, Some(&verified_by))
    };
    emit(&text)?;
    Ok(())
}

/// What `receipt` prints.
/// `verified_by`: the key whose signature was checked (`None`: not
/// checked, no line).
pub fn receipt_text(id: &[u8], r: &pb::Receipt, verified_by: Option<&str>) -> String {
    let mut f = Fields::default();
    f.add("receipt", hex::encode(id));
    f.add("kind", receipt_kind_name(r.kind));
    f.add("contract", hex::encode(&r.contract_id));
    f.add("root", hex::encode(&r.root_id));
    f.add("at", when(r.at_ms));
    f.add("requester", hex_or_dash(&r.requester_public_key));
    f.add("request digest", hex_or_dash(&r.request_digest));
    if !r.violations.is_empty() {
        f.add("primary", code_name(r.primary));
    }
    for v in &r.violations {
        f.add(
            "violation",
            format!(
                "{} requested {}, allowed {}: {}",
                code_name(v.code),
                v.requested,
                v.allowed,
                v.detail
            ),
        );
    }
    if let Some(c) = &r.completion {
        f.add("verdict", verdict_name(c.verdict));
        f.add("schema valid", c.schema_valid.to_string());
        f.add("within scope", c.within_scope.to_string());
        for criterion in &c.refused_criteria {
            f.add(
                "refused",
                format!("{}: {}", criterion.criterion, criterion.reason),
            );
        }
        if c.out_of_scope_path_count > 0 || !c.out_of_scope_paths.is_empty() {
            f.add(
                "out of scope",
                format!(
                    "{} ({} in all)",
                    c.out_of_scope_paths.join(", "),
                    c.out_of_scope_path_count
                ),
            );
        }
        f.add("claim", text_or_dash(&c.claim));
        f.add("typed report", c.has_report.to_string());
        f.add(
            "consumed",
            format!(
                "{}, returned {}, overspend {}, claimed excess {}",
                c.consumed, c.returned, c.overspend, c.claimed_excess
            ),
        );
        f.add("result digest", hex_or_dash(&c.result_digest));
        f.add("elapsed", format!("{} ms", c.elapsed_ms));
        if let Some(a) = &c.attribution {
            f.add(
                "attribution",
                format!("{} at depth {}", hex::encode(&a.agent_public_key), a.depth),
            );
        }
    }
    if let Some(e) = &r.escalation {
        f.add(
            "escalation",
            format!(
                "principal residual {}, principal deadline {}, retry feasible {}",
                e.principal_residual,
                when(e.principal_deadline_ms),
                e.retry_feasible
            ),
        );
        f.add("escalation reason", text_or_dash(&e.reason));
    }
    if !r.reason.is_empty() {
        f.add("reason", r.reason.clone());
    }
    for ended in &r.revoked_ids {
        f.add("ended", hex::encode(ended));
    }
    if r.kind == pb::ReceiptKind::Observed as i32 {
        f.add("observations", r.observations.to_string());
    }
    if let Some(verified_by) = verified_by {
        f.add("signature", format!("verified ({verified_by})"));
    }
    f.render()
}

/// A receipt as JSON (what `receipt` and `watch` share).
pub(in crate::cli) fn receipt_json(id: &[u8], r: &pb::Receipt) -> Map<String, Value> {
    let completion = r.completion.as_ref().map(|c| {
        json!({
            "verdict": verdict_name(c.verdict),
            "refused_criteria": c.refused_criteria.iter().map(|rc| json!({
                "criterion": rc.criterion,
                "reason": rc.reason,
            })).collect::<Vec<_>>(),
            "claim": c.claim,
            "has_report": c.has_report,
            "result_digest": hex::encode(&c.result_digest),
            "consumed": c.consumed,
            "overspend": c.overspend,
            "returned": c.returned,
            "claimed_excess": c.claimed_excess,
            "schema_valid": c.schema_valid,
            "within_scope": c.within_scope,
            "out_of_scope_paths": c.out_of_scope_paths,
            "out_of_scope_path_count": c.out_of_scope_path_count,
            "elapsed_ms": c.elapsed_ms,
            "attribution": c.attribution.as_ref().map(|a| json!({
                "agent_public_key": hex::encode(&a.agent_public_key),
                "depth": a.depth,
                "chain": a.chain.iter().map(hex::encode).collect::<Vec<_>>(),
            })),
        })
    });
    let escalation = r.escalation.as_ref().map(|e| {
        json!({
            "principal_residual": e.principal_residual,
            "principal_deadline_ms": e.principal_deadline_ms,
            "retry_feasible": e.retry_feasible,
            "reason": e.reason,
        })
    });
    let value = json!({
        "receipt_id": hex::encode(id),
        "broker_key_id": r.broker_key_id,
        "kind": receipt_kind_name(r.kind),
        "contract_id": hex::encode(&r.contract_id),
        "root_id": hex::encode(&r.root_id),
        "request_digest": hex::encode(&r.request_digest),
        "requester_public_key": hex::encode(&r.requester_public_key),
        "at_ms": r.at_ms,
        "at": rfc3339(r.at_ms),
        "primary": if r.violations.is_empty() { String::new() } else { code_name(r.primary) },
        "violations": r.violations.iter().map(|v| json!({
            "code": code_name(v.code),
            "requested": v.requested,
            "allowed": v.allowed,
            "detail": v.detail,
        })).collect::<Vec<_>>(),
        "completion": completion,
        "escalation": escalation,
        "reason": r.reason,
        "revoked_ids": r.revoked_ids.iter().map(hex::encode).collect::<Vec<_>>(),
        "observations": r.observations,
    });
    match value {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}
