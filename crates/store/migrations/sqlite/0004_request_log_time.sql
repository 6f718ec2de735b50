-- The request log is pruned by age (limits.request_log_retention_ms): an
-- index in arrival order finds the oldest entries without a scan. Entries
-- arrive in time order, so it grows at its end (about one page write per
-- fifty requests).
CREATE INDEX requests_by_time ON requests (at_ms);
