//! The request log as every backend reads it: the earlier answers to a
//! batch's (agent, nonce) keys, with the envelopes they answered with.

use std::collections::HashMap;

use prost::Message;
use sqlx::QueryBuilder;

use super::{Cell, Dialect, PushArg, QueryExt};
use crate::batch::{PriorRequest, RequestKey};
use crate::limits::ROWS_PER_STATEMENT;
use broker_domain::AgentKey;
use broker_wire::pb;

/// The statement that reads one chunk of keys' earlier answers.
pub(crate) fn prior_requests_query<D: Dialect>(chunk: &[RequestKey]) -> QueryBuilder<D> {
    let mut query = QueryBuilder::<D>::new(
        "SELECT r.agent_key, r.nonce, r.body_digest, r.outcome, r.ref_id, \
         COALESCE(c.envelope, x.envelope) AS envelope FROM requests r \
         LEFT JOIN contracts_with_envelope c ON r.outcome = 1 AND c.id = r.ref_id \
         LEFT JOIN receipts x ON r.outcome = 2 AND x.id = r.ref_id WHERE ",
    );
    let mut first = true;
    for (agent, nonce) in chunk {
        if !first {
            query.push(" OR ");
        }
        first = false;
        query.push("(r.agent_key = ");
        query.push_arg(agent.as_slice());
        query.push(" AND r.nonce = ");
        query.push_arg(nonce.as_slice());
        query.push(")");
    }
    query
}

/// The earlier answers to `keys`, a statement per `ROWS_PER_STATEMENT`.
pub(crate) async fn load_prior_requests<D: Dialect>(
    conn: &mut D::Connection,
    keys: &[RequestKey],
) -> Result<HashMap<RequestKey, PriorRequest>, sqlx::Error> {
    let mut prior = HashMap::new();
    for chunk in keys.chunks(ROWS_PER_STATEMENT) {
        let mut query = prior_requests_query::<D>(chunk);
        for row in query.build().all(&mut *conn).await? {
            let agent: Vec<u8> = row.cell("agent_key")?;
            let nonce: Vec<u8> = row.cell("nonce")?;
            let digest: Vec<u8> = row.cell("body_digest")?;
            let ref_id: Vec<u8> = row.cell("ref_id")?;
            let envelope: Vec<u8> = row.cell("envelope")?;
            let bad = |what: &str| sqlx::Error::Protocol(format!("corrupt requests row: {what}"));
            let agent: AgentKey = agent.try_into().map_err(|_| bad("agent_key"))?;
            prior.insert(
                (agent, nonce),
                PriorRequest {
                    digest: digest.try_into().map_err(|_| bad("body_digest"))?,
                    outcome: row.cell("outcome")?,
                    ref_id: ref_id.try_into().map_err(|_| bad("ref_id"))?,
                    envelope: pb::Sealed::decode(envelope.as_slice())
                        .map_err(|_| bad("envelope"))?,
                },
            );
        }
    }
    Ok(prior)
}
