-- Policy.require_host: every delegation in the tree names its host.
-- Existing trees keep the old rule (a host may be named at Accept).
ALTER TABLE contracts ADD COLUMN require_host INTEGER NOT NULL DEFAULT 0;
