CREATE INDEX contracts_by_root_host ON contracts (root_seq, host_key) WHERE host_key IS NOT NULL;
