//! `children`: a contract's children, a line each.

use super::*;

/// `children`: one line per child, in issuance order, page by page.
pub fn children(args: ChildrenArgs) -> anyhow::Result<()> {
    let id = parse_id(&args.contract_id, "CONTRACT_ID")?;
    runtime()?.block_on(async {
        let mut reader = open(&args.read).await?;
        let (mut printed, mut page_token) = (0u32, Vec::new());
        loop {
            let left = args.max.saturating_sub(printed);
            let page = call(
                "ListChildren",
                reader.client.list_children(pb::ListChildrenRequest {
                    contract_id: id.to_vec(),
                    page_size: CHILDREN_PAGE.min(left),
                    page_token,
                }),
            )
            .await?;
            // A page longer than asked is cut: `--max` holds whatever the
            // broker sends.
            let cut = page.children.len() > left as usize;
            for state in page.children.iter().take(left as usize) {
                let line = child_line(state, args.json)
                    .with_context(|| format!("ListChildren: child {printed}"))?;
                if !emit(&line)? {
                    return Ok(());
                }
                printed += 1;
            }
            if page.next_page_token.is_empty() && !cut {
                return Ok(());
            }
            if printed >= args.max {
                // A next page may be empty: "may", not "are".
                eprintln!(
                    "… there may be more children: only the first {} are shown (--max)",
                    args.max
                );
                return Ok(());
            }
            page_token = page.next_page_token;
        }
    })
}

/// One child as a line of text or JSON.
pub fn child_line(state: &pb::ContractState, json: bool) -> anyhow::Result<String> {
    let sealed = state.contract.clone().unwrap_or_default();
    anyhow::ensure!(
        crypto::sha256(&sealed.payload).as_slice() == state.contract_id,
        "its id is not SHA-256 of its contract"
    );
    let c = pb::Contract::decode(sealed.payload.as_slice()).context("it does not decode")?;
    if json {
        let mut map = terms_json(&state.contract_id, &c);
        map.insert("status".into(), status_name(state.status).into());
        map.insert("ledger".into(), ledger_json(state.ledger.as_ref()));
        map.insert(
            "effective_predicate".into(),
            state.effective_predicate.clone().into(),
        );
        return Ok(format!("{}\n", serde_json::to_string(&Value::Object(map))?));
    }
    Ok(format!(
        "{} {:<12} depth {} budget {} delegate {}\n",
        hex::encode(&state.contract_id),
        status_name(state.status),
        c.depth,
        c.budget,
        short(&c.delegate_public_key)
    ))
}

// ---------------------------------------------------------------- watch
