-- Contracts as issued: immutable once written. One row per contract.
CREATE TABLE contracts (
    -- Issuance order: pagination and, later, audit replay.
    seq INTEGER PRIMARY KEY,
    -- SHA-256 of the signed contract payload.
    id BLOB NOT NULL UNIQUE,
    -- NULL for roots.
    parent_id BLOB,
    -- The root's id; a root stores its own id.
    root_id BLOB NOT NULL,
    depth INTEGER NOT NULL,
    delegate_key BLOB NOT NULL,
    liability INTEGER NOT NULL,
    intent_lineage_hash BLOB NOT NULL,
    cumulative_trust_ppm INTEGER NOT NULL,
    effective_predicate TEXT NOT NULL,
    deadline_ms INTEGER NOT NULL,
    -- JSON array of normalized prefixes.
    write_scope TEXT NOT NULL,
    max_depth INTEGER NOT NULL,
    min_cumulative_trust_ppm INTEGER NOT NULL,
    max_children INTEGER NOT NULL,
    retry_headroom INTEGER NOT NULL,
    -- The encoded, broker-signed Envelope, exactly as sent to the client.
    envelope BLOB NOT NULL,
    issued_at_ms INTEGER NOT NULL
);
CREATE INDEX contracts_by_parent ON contracts (parent_id, seq);

-- The mutable part of a contract: lifecycle status and budget ledger.
-- Kept apart so a batch updates many ledgers with one upsert.
CREATE TABLE contract_state (
    id BLOB PRIMARY KEY,
    status INTEGER NOT NULL,
    budget INTEGER NOT NULL,
    reserved INTEGER NOT NULL,
    spent INTEGER NOT NULL,
    open_children INTEGER NOT NULL
);

-- Broker-signed receipts (refusals now; lifecycle events later).
CREATE TABLE receipts (
    seq INTEGER PRIMARY KEY,
    id BLOB NOT NULL UNIQUE,
    kind INTEGER NOT NULL,
    contract_id BLOB NOT NULL,
    root_id BLOB NOT NULL,
    envelope BLOB NOT NULL,
    at_ms INTEGER NOT NULL
);
CREATE INDEX receipts_by_root ON receipts (root_id, seq);

-- Every answered signed request, keyed by its nonce: the idempotency
-- record that lets a retry get the original answer.
CREATE TABLE requests (
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
);
