-- Write volume: SQLite rewrites a whole page for every changed row, and a
-- delegation changes its parent's ledger. With the signed envelope (1–4
-- KiB) inside the contract row, each such update rewrote a page holding a
-- single contract. Envelopes are immutable, so they move to an append-only
-- table keyed by the same sequence number; the contract rows that are
-- updated stay narrow (about ten to a page).
CREATE TABLE contract_envelopes (
    -- = contracts.seq
    seq INTEGER PRIMARY KEY,
    -- The encoded, broker-signed Envelope, exactly as sent to the client.
    envelope BLOB NOT NULL
);
INSERT INTO contract_envelopes (seq, envelope) SELECT seq, envelope FROM contracts;
ALTER TABLE contracts DROP COLUMN envelope;

-- Contracts with their envelope, for the queries that return them.
CREATE VIEW contracts_with_envelope AS
    SELECT c.*, e.envelope FROM contracts c JOIN contract_envelopes e ON e.seq = c.seq;

-- The request log is only ever looked up by its key: one B-tree keyed by
-- (agent_key, nonce) instead of a rowid table plus an index on it, which
-- wrote two pages per request.
CREATE TABLE requests_by_key (
    agent_key BLOB NOT NULL,
    nonce BLOB NOT NULL,
    -- SHA-256 of PAE(payload_type, payload) of the signed request.
    body_digest BLOB NOT NULL,
    -- 1: a contract was issued (ref_id is its id); 2: refused (ref_id is
    -- the refusal receipt's id).
    outcome INTEGER NOT NULL,
    ref_id BLOB NOT NULL,
    at_ms INTEGER NOT NULL,
    PRIMARY KEY (agent_key, nonce)
) WITHOUT ROWID;
INSERT INTO requests_by_key SELECT agent_key, nonce, body_digest, outcome, ref_id, at_ms FROM requests;
DROP TABLE requests;
ALTER TABLE requests_by_key RENAME TO requests;
