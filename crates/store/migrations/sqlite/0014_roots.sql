-- Roots newest first, for ListRoots: a partial index holding roots only,
-- so a page is an index walk bounded by its window whatever the number of
-- children (on PostgreSQL, `parent_seq IS NULL ORDER BY seq DESC` cannot
-- use contracts_by_parent's order). Only roots pay for it on insert.
CREATE INDEX contracts_roots ON contracts (seq) WHERE parent_seq IS NULL;
