-- Contracts whose open descendants are being ended in bounded steps
-- (core::lifecycle::Ending): a request to end one found more than one
-- writer step may end. A row is written with the request's refusal
-- (DESCENDANTS_ENDING), each step ends up to limits.cascade_step_rows of
-- the descendants in its own transaction, and the last step deletes the
-- row: a crash between steps resumes at the next start.
CREATE TABLE draining (
    -- = contracts.seq of the draining contract.
    target_seq INTEGER PRIMARY KEY,
    -- Its tree's root: a request checks only drains of its own tree.
    root_seq INTEGER NOT NULL,
    -- The status its descendants end with (EXPIRED or REVOKED).
    status INTEGER NOT NULL,
    started_at_ms INTEGER NOT NULL
);
