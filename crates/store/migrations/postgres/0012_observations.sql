-- Host-observed facts, append-only. `seq` only orders one contract's
-- observations (nothing rests on its order across transactions).
CREATE TABLE observations (
    seq BIGSERIAL PRIMARY KEY,
    contract_seq BIGINT NOT NULL,
    kind BIGINT NOT NULL,
    path TEXT NOT NULL,
    tool TEXT NOT NULL,
    units BIGINT NOT NULL,
    at_ms BIGINT NOT NULL
);
