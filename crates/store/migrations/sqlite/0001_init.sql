-- Contracts: the signed envelope, the facts the invariant check needs, and
-- the mutable status and ledger. One row per contract.
CREATE TABLE contracts (
    -- Issuance order, assigned by the store's single writer. The parent
    -- index is keyed by it (not by the random ids) so that inserting a
    -- batch of children touches a few recent index pages, not one random
    -- page per row: that is most of a commit's write volume.
    seq INTEGER PRIMARY KEY,
    -- SHA-256 of the signed contract payload.
    id BLOB NOT NULL UNIQUE,
    -- NULL for roots.
    parent_seq INTEGER,
    parent_id BLOB,
    -- A root stores its own.
    root_seq INTEGER NOT NULL,
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
    issued_at_ms INTEGER NOT NULL,
    -- Mutable: lifecycle status and budget ledger.
    status INTEGER NOT NULL,
    budget INTEGER NOT NULL,
    reserved INTEGER NOT NULL,
    spent INTEGER NOT NULL,
    open_children INTEGER NOT NULL,
    -- The host whose observations count (named at Delegate or Accept).
    host_key BLOB,
    -- The broker's (or, for PENDING_PRINCIPAL, the principal's) verdict
    -- once completed; 0 before.
    verdict INTEGER NOT NULL DEFAULT 0,
    -- Host observations recorded, their metered units, and whether any
    -- observation carried units (then they, not the delegate's report, are
    -- what the contract is charged).
    observations INTEGER NOT NULL DEFAULT 0,
    observed_units INTEGER NOT NULL DEFAULT 0,
    metered INTEGER NOT NULL DEFAULT 0,
    -- The run's labels (JSON object), copied from the root.
    labels TEXT NOT NULL DEFAULT '{}',
    -- Set at completion: 1 typed report, 0 prose; NULL before.
    has_report INTEGER,
    -- Set at completion: criteria the verdict refused.
    downgrades INTEGER NOT NULL DEFAULT 0,
    -- Set at completion: the delegate's claim, kept beside the verdict.
    claim TEXT NOT NULL DEFAULT ''
);
CREATE INDEX contracts_by_root ON contracts (root_seq, seq);
CREATE INDEX contracts_open_by_deadline ON contracts (status, deadline_ms);
CREATE INDEX contracts_by_parent ON contracts (parent_seq, seq);

-- Broker-signed receipts: refusals and lifecycle transitions. `seq` comes
-- from the same writer counter as contracts.seq, so contracts and receipts
-- merge into one commit-ordered event stream (Watch).
CREATE TABLE receipts (
    seq INTEGER PRIMARY KEY,
    id BLOB NOT NULL UNIQUE,
    kind INTEGER NOT NULL,
    contract_seq INTEGER NOT NULL,
    contract_id BLOB NOT NULL,
    root_id BLOB NOT NULL,
    envelope BLOB NOT NULL,
    at_ms INTEGER NOT NULL
);
CREATE INDEX receipts_by_contract ON receipts (contract_seq, seq);

-- Host-observed facts, append-only.
CREATE TABLE observations (
    seq INTEGER PRIMARY KEY,
    contract_seq INTEGER NOT NULL,
    kind INTEGER NOT NULL,
    path TEXT NOT NULL,
    tool TEXT NOT NULL,
    units INTEGER NOT NULL,
    at_ms INTEGER NOT NULL
);
CREATE INDEX observations_by_contract ON observations (contract_seq, seq);

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
