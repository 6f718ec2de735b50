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

/// One Watch event as a line of text or JSON.
pub fn event_line(event: &pb::WatchResponse, json: bool) -> anyhow::Result<String> {
    let cursor = event.cursor;
    match &event.event {
        Some(pb::watch_response::Event::Contract(sealed)) => {
            let id = crypto::sha256(&sealed.payload);
            let c = pb::Contract::decode(sealed.payload.as_slice()).with_context(|| {
                format!("Watch: the contract at cursor {cursor} does not decode")
            })?;
            if json {
                let mut map = terms_json(&id, &c);
                map.insert("cursor".into(), cursor.to_string().into());
                map.insert("event".into(), "contract".into());
                return Ok(format!("{}\n", serde_json::to_string(&Value::Object(map))?));
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
            let id = crypto::sha256(&sealed.payload);
            let r = pb::Receipt::decode(sealed.payload.as_slice()).with_context(|| {
                format!("Watch: the receipt at cursor {cursor} does not decode")
            })?;
            if json {
                let mut map = receipt_json(&id, &r);
                map.insert("cursor".into(), cursor.to_string().into());
                map.insert("event".into(), "receipt".into());
                return Ok(format!("{}\n", serde_json::to_string(&Value::Object(map))?));
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
