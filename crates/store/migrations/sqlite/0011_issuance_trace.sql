-- The trace context (W3C: trace id 16 bytes, span id 8, flags 1) of the
-- call that issued a contract, when that call was traced: later calls on
-- the contract (Accept, RecordReceipts, Complete, Escalate, …) link their
-- spans to it, so one task is one connected trace even when the agents
-- never pass the context to each other. Beside the immutable envelope
-- (the append-only table), never in the contract rows that are updated.
ALTER TABLE contract_envelopes ADD COLUMN trace_context BLOB;
