-- Open contracts by delegate and by host, newest first, for ListHeld:
-- partial indexes holding OPEN (1) and ACCEPTED (2) contracts only, so a
-- page reads only rows it shows, and an ended contract leaves the index.
CREATE INDEX contracts_held_by_delegate ON contracts (delegate_key, seq) WHERE status IN (1, 2);
CREATE INDEX contracts_held_by_host ON contracts (host_key, seq) WHERE status IN (1, 2) AND host_key IS NOT NULL;
