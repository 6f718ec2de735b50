CREATE INDEX observations_by_contract ON observations (contract_seq, seq);
