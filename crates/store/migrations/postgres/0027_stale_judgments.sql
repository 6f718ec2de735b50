-- Completions of the contract whose judgment the host made stale by
-- recording meanwhile: past core::limits::MAX_STALE_JUDGMENTS the contract
-- takes no more observations while ACCEPTED, so the next judgment is
-- current and the re-judgment loop ends.
ALTER TABLE contracts ADD COLUMN stale_judgments BIGINT NOT NULL DEFAULT 0;
