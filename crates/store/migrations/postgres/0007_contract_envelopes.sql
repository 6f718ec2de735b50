-- The signed envelope of each contract, append-only, and the trace
-- context of the call that issued it (W3C: trace id 16 bytes, span id 8,
-- flags 1), when that call was traced.
CREATE TABLE contract_envelopes (
    seq BIGINT PRIMARY KEY,
    envelope BYTEA NOT NULL,
    trace_context BYTEA
);
