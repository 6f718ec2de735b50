-- Drains by tree: issuance reads only the drains of its parents' trees
-- (`writer::DRAINS_AND_NUMBERS`), not the whole table, so a tenant that
-- starts many drains at once makes only its own trees' issuance read them.
CREATE INDEX draining_by_root ON draining (root_seq);
