-- The public keys every replica signs with: each replica registers its
-- own at start (its secret never leaves its data directory), and every
-- replica publishes all of them (GetBrokerKeys), so a contract issued
-- through one verifies with the keys fetched from any other.
CREATE TABLE broker_keys (
    key_id TEXT PRIMARY KEY,
    public_key BYTEA NOT NULL,
    registered_at_ms BIGINT NOT NULL,
    -- Set when a replica that signed with it rotated it away: its
    -- signatures stay valid, it signs nothing new.
    retired_at_ms BIGINT
);
