-- The keys bound to one identity, counted at each binding (at most
-- MAX_KEYS_PER_IDENTITY live at once).
CREATE INDEX identity_bindings_by_identity ON identity_bindings (identity, expires_at_ms);
