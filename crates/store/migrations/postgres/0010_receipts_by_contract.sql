CREATE INDEX receipts_by_contract ON receipts (contract_seq, seq);
