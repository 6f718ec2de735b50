-- The SHA-256 of a tool call's arguments, when its host says it (NULL
-- otherwise, and for reads and mutations).
ALTER TABLE observations ADD COLUMN arguments_sha256 BYTEA;
