-- Watch reads a subtree's events after a cursor.
CREATE INDEX events_by_contract ON events (contract_seq, pos);
