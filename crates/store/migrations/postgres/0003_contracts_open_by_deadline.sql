-- The expiry sweeper's scan.
CREATE INDEX contracts_open_by_deadline ON contracts (status, deadline_ms);
