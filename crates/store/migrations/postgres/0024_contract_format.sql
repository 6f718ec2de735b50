-- The signed contract format these tables hold (SQLite's migration 10).
CREATE TABLE contract_format (version BIGINT NOT NULL);
