CREATE INDEX contracts_by_parent ON contracts (parent_seq, seq);
