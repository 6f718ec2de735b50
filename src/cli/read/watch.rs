//! `watch`: a tree's events as they are stored, a line each.

use super::*;

/// `watch`: the subtree's events as they come, one line each.
pub fn watch(args: WatchArgs) -> anyhow::Result<()> {
    use tokio_stream::StreamExt;
    let id = parse_id(&args.contract_id, "CONTRACT_ID")?;
    runtime()?.block_on(async {
        let mut reader = open(&args.read).await?;
        let mut events = call(
            "Watch",
            reader.client.watch(pb::WatchRequest {
                contract_id: id.to_vec(),
                cursor: args.cursor,
            }),
        )
        .await?;
        let (mut seen, mut last) = (0u64, args.cursor);
        while args.max_events.is_none_or(|max| seen < max) {
            // Live by design: an event may be hours away. Interrupting
            // ends the command; each event is bounded in bytes.
            let event = match events.next().await {
                None => return Ok(()),
                Some(Ok(event)) => event,
                Some(Err(status)) => {
                    return Err(status_error("Watch", &status).context(format!(
                        "the stream ended after cursor {last}: resume with --cursor {last}"
                    )));
                }
            };
            last = event.cursor;
            seen += 1;
            if !emit(&event_line(&event, args.json)?)? {
                return Ok(());
            }
        }
        Ok(())
    })
}

/// An event's sealed message, decoded, and its id.
fn decoded<M: Message + Default>(
    sealed: &pb::Sealed,
    what: &str,
    cursor: u64,
) -> anyhow::Result<([u8; 32], M)> {
    let message = M::decode(sealed.payload.as_slice())
        .with_context(|| format!("Watch: the {what} at cursor {cursor} does not decode"))?;
    Ok((crypto::sha256(&sealed.payload), message))
}

/// An event's JSON line: its fields, the cursor and what it is.
fn json_line(
    mut map: serde_json::Map<String, Value>,
    event: &str,
    cursor: u64,
) -> anyhow::Result<String> {
    map.insert("cursor".into(), cursor.to_string().into());
    map.insert("event".into(), event.into());
    Ok(format!("{}\n", serde_json::to_string(&Value::Object(map))?))
}

/// One Watch event as a line of text or JSON.
pub fn event_line(event: &pb::WatchResponse, json: bool) -> anyhow::Result<String> {
    let cursor = event.cursor;
    match &event.event {
        Some(pb::watch_response::Event::Contract(sealed)) => {
            let (id, c) = decoded::<pb::Contract>(sealed, "contract", cursor)?;
            if json {
                return json_line(terms_json(&id, &c), "contract", cursor);
            }
            Ok(format!(
                "{cursor} contract {} parent {} depth {} budget {} delegate {}\n",
                hex::encode(id),
                hex_or_dash(&c.parent_id),
                c.depth,
                c.budget,
                short(&c.delegate_public_key)
            ))
        }
        Some(pb::watch_response::Event::Receipt(sealed)) => {
            let (id, r) = decoded::<pb::Receipt>(sealed, "receipt", cursor)?;
            if json {
                return json_line(receipt_json(&id, &r), "receipt", cursor);
            }
            let mut line = format!(
                "{cursor} receipt {} {} id {}",
                receipt_kind_name(r.kind),
                hex::encode(&r.contract_id),
                hex::encode(id)
            );
            if let Some(completion) = &r.completion {
                let _ = write!(line, " verdict {}", verdict_name(completion.verdict));
            }
            if !r.violations.is_empty() {
                let _ = write!(line, " primary {}", code_name(r.primary));
            }
            Ok(line + "\n")
        }
        None => Ok(if json {
            format!(
                "{}\n",
                json!({"cursor": cursor.to_string(), "event": "unknown"})
            )
        } else {
            format!("{cursor} unknown event\n")
        }),
    }
}

// ---------------------------------------------------------------- receipt
