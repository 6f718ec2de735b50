//! The request log as every backend reads it: the earlier answers to a
//! batch's (agent, nonce) keys, with the envelopes they answered with.

use super::*;

pub(super) async fn load_prior_requests(
    conn: &mut DbConn,
    keys: &[RequestKey],
) -> Result<HashMap<RequestKey, PriorRequest>, sqlx::Error> {
    let mut prior = HashMap::new();
    for chunk in keys.chunks(ROWS_PER_STATEMENT) {
        let mut query = QueryBuilder::<Db>::new(
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
            query.push_bind(agent.as_slice());
            query.push(" AND r.nonce = ");
            query.push_bind(nonce.as_slice());
            query.push(")");
        }
        for row in query.build().fetch_all(&mut *conn).await? {
            let agent: Vec<u8> = row.try_get("agent_key")?;
            let nonce: Vec<u8> = row.try_get("nonce")?;
            let digest: Vec<u8> = row.try_get("body_digest")?;
            let ref_id: Vec<u8> = row.try_get("ref_id")?;
            let envelope: Vec<u8> = row.try_get("envelope")?;
            let bad = |what: &str| sqlx::Error::Protocol(format!("corrupt requests row: {what}"));
            let agent: AgentKey = agent.try_into().map_err(|_| bad("agent_key"))?;
            prior.insert(
                (agent, nonce),
                PriorRequest {
                    digest: digest.try_into().map_err(|_| bad("body_digest"))?,
                    outcome: row.try_get("outcome")?,
                    ref_id: ref_id.try_into().map_err(|_| bad("ref_id"))?,
                    envelope: pb::Sealed::decode(envelope.as_slice())
                        .map_err(|_| bad("envelope"))?,
                },
            );
        }
    }
    Ok(prior)
}
