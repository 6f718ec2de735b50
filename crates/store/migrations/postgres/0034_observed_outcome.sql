-- How a tool call ended (ToolOutcome; 0 when its host does not say, and
-- for reads and mutations).
ALTER TABLE observations ADD COLUMN outcome BIGINT NOT NULL DEFAULT 0;
