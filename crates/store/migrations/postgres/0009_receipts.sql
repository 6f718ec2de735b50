-- Broker-signed receipts: refusals and lifecycle transitions. `seq` comes
-- from the same sequence as contracts.seq.
CREATE TABLE receipts (
    seq BIGINT PRIMARY KEY,
    id BYTEA NOT NULL UNIQUE,
    kind BIGINT NOT NULL,
    contract_seq BIGINT NOT NULL,
    contract_id BYTEA NOT NULL,
    root_id BYTEA NOT NULL,
    envelope BYTEA NOT NULL,
    at_ms BIGINT NOT NULL
);
