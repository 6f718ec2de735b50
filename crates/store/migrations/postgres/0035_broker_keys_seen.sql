-- When the replica signing with this key last said it is alive (the
-- database's clock, ms): a key not seen for limits.replica_key_ttl_ms is
-- retired, so a dead replica's key opens no more sessions.
ALTER TABLE broker_keys ADD COLUMN seen_at_ms BIGINT;
