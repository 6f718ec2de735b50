-- Contracts: the facts the invariant check needs and the mutable status
-- and ledger, one row per contract (the same columns as SQLite's table;
-- integers are BIGINT so both backends decode them as i64). The signed
-- envelope lives in `contract_envelopes`: this row is updated by every
-- delegation from it and stays narrow.
-- One DDL statement per migration (CockroachDB and YugabyteDB run DDL
-- outside the transaction of the statements around it).
CREATE TABLE contracts (
    -- From the `seqs` sequence, taken after the parent's row lock: the
    -- children of one parent are numbered in commit order (ListChildren's
    -- page cursor), a child after its parent.
    seq BIGINT PRIMARY KEY,
    -- SHA-256 of the signed contract payload.
    id BYTEA NOT NULL UNIQUE,
    parent_seq BIGINT,
    parent_id BYTEA,
    root_seq BIGINT NOT NULL,
    root_id BYTEA NOT NULL,
    depth BIGINT NOT NULL,
    delegate_key BYTEA NOT NULL,
    liability BIGINT NOT NULL,
    intent_lineage_hash BYTEA NOT NULL,
    cumulative_trust_ppm BIGINT NOT NULL,
    effective_predicate TEXT NOT NULL,
    deadline_ms BIGINT NOT NULL,
    write_scope TEXT NOT NULL,
    max_depth BIGINT NOT NULL,
    min_cumulative_trust_ppm BIGINT NOT NULL,
    max_children BIGINT NOT NULL,
    retry_headroom BIGINT NOT NULL,
    require_host BIGINT NOT NULL DEFAULT 0,
    issued_at_ms BIGINT NOT NULL,
    status BIGINT NOT NULL,
    budget BIGINT NOT NULL,
    reserved BIGINT NOT NULL,
    spent BIGINT NOT NULL,
    open_children BIGINT NOT NULL,
    host_key BYTEA,
    verdict BIGINT NOT NULL DEFAULT 0,
    observations BIGINT NOT NULL DEFAULT 0,
    observed_units BIGINT NOT NULL DEFAULT 0,
    metered BIGINT NOT NULL DEFAULT 0,
    metered_uncharged BIGINT NOT NULL DEFAULT 0,
    labels TEXT NOT NULL DEFAULT '{}',
    has_report BIGINT,
    downgrades BIGINT NOT NULL DEFAULT 0,
    claim TEXT NOT NULL DEFAULT ''
);
