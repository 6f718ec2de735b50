-- Open contracts by host, newest first, for ListHeld (as 0031).
CREATE INDEX contracts_held_by_host ON contracts (host_key, seq) WHERE status IN (1, 2) AND host_key IS NOT NULL;
