-- Open contracts by delegate, newest first, for ListHeld: a partial index
-- holding OPEN (1) and ACCEPTED (2) contracts only, so a page reads only
-- rows it shows, and an ended contract leaves the index.
CREATE INDEX contracts_held_by_delegate ON contracts (delegate_key, seq) WHERE status IN (1, 2);
