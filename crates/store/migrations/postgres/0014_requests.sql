-- Every answered signed request, keyed by (agent, nonce): the idempotency
-- record. Its primary key is what decides between replicas: a request
-- answered through one replica and retried through another finds this
-- row (or, if both run at once, one insert waits for the other and fails,
-- and that transaction is redone and replays the stored answer).
CREATE TABLE requests (
    agent_key BYTEA NOT NULL,
    nonce BYTEA NOT NULL,
    body_digest BYTEA NOT NULL,
    -- 1: a contract was issued (ref_id is its id); 2: a receipt answered
    -- it (ref_id is the receipt's id).
    outcome BIGINT NOT NULL,
    ref_id BYTEA NOT NULL,
    at_ms BIGINT NOT NULL,
    PRIMARY KEY (agent_key, nonce)
);
