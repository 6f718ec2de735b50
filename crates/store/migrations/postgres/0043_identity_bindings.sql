-- Keys bound to workload identities (BindIdentity), shared by every
-- replica; a binding ends at its token's expiry, and expired rows are
-- pruned by later bindings.
CREATE TABLE identity_bindings (
    agent_key BYTEA PRIMARY KEY,
    identity TEXT NOT NULL,
    issuer TEXT NOT NULL,
    expires_at_ms BIGINT NOT NULL
);
