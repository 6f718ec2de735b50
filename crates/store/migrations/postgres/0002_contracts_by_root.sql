CREATE INDEX contracts_by_root ON contracts (root_seq, seq);
