//! The request log as every backend reads it: the earlier answers to a
//! batch's (agent, nonce) keys, with the envelopes they answered with.

use std::collections::HashMap;

use prost::Message;

use super::Dialect;
use super::plan::Arg;
use super::source::{CellOf, Source, padded};
use crate::batch::{PriorRequest, RequestKey};
use crate::limits::ROWS_PER_STATEMENT;
use broker_domain::AgentKey;
use broker_wire::pb;

/// The statement that reads one chunk of keys' earlier answers, and
/// its values.
/// Padded as `source::padded` pads lists (the last key repeats).
pub(crate) fn prior_requests_text(chunk: &[RequestKey]) -> (String, Vec<Arg<'_>>) {
    use std::fmt::Write;
    let mut text = String::from(
        "SELECT r.agent_key, r.nonce, r.body_digest, r.outcome, r.ref_id, \
         COALESCE(c.envelope, x.envelope) AS envelope FROM requests r \
         LEFT JOIN contracts_with_envelope c ON r.outcome = 1 AND c.id = r.ref_id \
         LEFT JOIN receipts x ON r.outcome = 2 AND x.id = r.ref_id WHERE ",
    );
    let keys = padded(chunk.iter().collect());
    let mut args = Vec::with_capacity(keys.len() * 2);
    for (i, (agent, nonce)) in keys.into_iter().enumerate() {
        if i > 0 {
            text.push_str(" OR ");
        }
        let _ = write!(
            text,
            "(r.agent_key = ${} AND r.nonce = ${})",
            args.len() + 1,
            args.len() + 2
        );
        args.push(Arg::Blob(agent.as_slice()));
        args.push(Arg::Blob(nonce.as_slice()));
    }
    (text, args)
}

/// The earlier answers to `keys`, a statement per `ROWS_PER_STATEMENT`.
pub(crate) async fn load_prior_requests<D: Dialect, S: Source<D>>(
    src: &mut S,
    keys: &[RequestKey],
) -> Result<HashMap<RequestKey, PriorRequest>, sqlx::Error> {
    let mut prior = HashMap::new();
    for chunk in keys.chunks(ROWS_PER_STATEMENT) {
        let (text, args) = prior_requests_text(chunk);
        for row in src.rows(&text, &args).await? {
            let agent: Vec<u8> = row.cell_of("agent_key")?;
            let nonce: Vec<u8> = row.cell_of("nonce")?;
            let digest: Vec<u8> = row.cell_of("body_digest")?;
            let ref_id: Vec<u8> = row.cell_of("ref_id")?;
            let envelope: Vec<u8> = row.cell_of("envelope")?;
            let bad = |what: &str| sqlx::Error::Protocol(format!("corrupt requests row: {what}"));
            let agent: AgentKey = agent.try_into().map_err(|_| bad("agent_key"))?;
            prior.insert(
                (agent, nonce),
                PriorRequest {
                    digest: digest.try_into().map_err(|_| bad("body_digest"))?,
                    outcome: row.cell_of("outcome")?,
                    ref_id: ref_id.try_into().map_err(|_| bad("ref_id"))?,
                    envelope: pb::Sealed::decode(envelope.as_slice())
                        .map_err(|_| bad("envelope"))?,
                },
            );
        }
    }
    Ok(prior)
}
