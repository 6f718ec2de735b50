-- Contracts with their envelope, for the queries that return them (made
-- again after 0027 added a column: see 0028).
CREATE VIEW contracts_with_envelope AS
    SELECT c.*, e.envelope FROM contracts c JOIN contract_envelopes e ON e.seq = c.seq;
