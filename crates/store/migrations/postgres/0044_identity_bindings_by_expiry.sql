-- Expired bindings, found for pruning without a scan.
CREATE INDEX identity_bindings_by_expiry ON identity_bindings (expires_at_ms);
