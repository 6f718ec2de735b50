-- What a host says of each tool call beside its name: the arguments'
-- SHA-256 (NULL when not said) and how it ended (ToolOutcome; 0 when not
-- said, and for reads and mutations).
ALTER TABLE observations ADD COLUMN arguments_sha256 BLOB;
ALTER TABLE observations ADD COLUMN outcome INTEGER NOT NULL DEFAULT 0;
