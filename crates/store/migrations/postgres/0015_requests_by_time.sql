-- Pruning by age (limits.request_log_retention_ms).
CREATE INDEX requests_by_time ON requests (at_ms);
