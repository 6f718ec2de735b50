-- Linear chains changed the signed contract format in place (before any
-- release): contracts and receipts are now `Sealed`, each contract carries
-- only its own hop. Stored contracts of the old format cannot be converted
-- (a contract's id is the hash of its signed bytes), so the broker refuses
-- to open a database that holds any contract and lacks this migration; see
-- `open_writer`. Nothing changes in the schema: this records the format.
CREATE TABLE contract_format (version INTEGER NOT NULL);
INSERT INTO contract_format (version) VALUES (2);
