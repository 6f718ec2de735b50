-- The outbox of Watch: one row per contract issued or receipt stored,
-- written in the same transaction. `pos` is the event's place in commit
-- order, given after commit by a sequencer (any replica; one at a time,
-- under the `event_clock` row lock) to the events committed by then, in
-- `seq` order: a plain sequence number would skip events of transactions
-- that commit out of sequence order, a position given after commit
-- cannot. A cursor is a position.
CREATE TABLE events (
    seq BIGINT PRIMARY KEY,
    -- 1: a contract (its envelope is contract_envelopes.seq = seq);
    -- 2: a receipt (receipts.seq = seq).
    kind BIGINT NOT NULL,
    -- The contract the event belongs to (for a contract, itself).
    contract_seq BIGINT NOT NULL,
    -- Its tree's root: announcing an event names the tree it changed.
    root_id BYTEA NOT NULL,
    pos BIGINT UNIQUE
);
