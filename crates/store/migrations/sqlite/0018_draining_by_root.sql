-- Drains by tree: issuance reads only the drains of its parents' trees
-- (`drain::DRAINS_OF_ROOTS`), not the whole table, so a tenant that starts
-- many drains at once makes only its own trees' issuance read them.
CREATE INDEX draining_by_root ON draining (root_seq);
