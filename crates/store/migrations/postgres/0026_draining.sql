-- Contracts whose open descendants are being ended in bounded steps
-- (core::lifecycle::Ending): a request to end one found more than one
-- writer step may end. A row is written with the request's refusal
-- (DESCENDANTS_ENDING), each step ends up to limits.cascade_step_rows of
-- the descendants in its own transaction, and the last step deletes the
-- row: a crash between steps resumes on any replica.
CREATE TABLE draining (
    -- = contracts.seq of the draining contract.
    target_seq BIGINT PRIMARY KEY,
    -- Its tree's root: a request checks only drains of its own tree.
    root_seq BIGINT NOT NULL,
    -- The status its descendants end with (EXPIRED or REVOKED).
    status BIGINT NOT NULL,
    started_at_ms BIGINT NOT NULL
);
