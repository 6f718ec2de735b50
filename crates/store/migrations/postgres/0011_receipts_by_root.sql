-- AggregateAudits reads each run's refusals and escalations by root.
CREATE INDEX receipts_by_root ON receipts (root_id, kind);
