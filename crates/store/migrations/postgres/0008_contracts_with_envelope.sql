-- Contracts with their envelope, for the queries that return them.
CREATE VIEW contracts_with_envelope AS
    SELECT c.*, e.envelope FROM contracts c JOIN contract_envelopes e ON e.seq = c.seq;
