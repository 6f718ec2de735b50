-- AggregateAudits reads each run's refusals and escalations by root; without
-- this index every run scanned the whole receipts table.
CREATE INDEX receipts_by_root ON receipts (root_id, kind);
