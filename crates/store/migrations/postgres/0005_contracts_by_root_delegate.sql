-- "Is this key a party of this tree": an index seek (reads are answered
-- only to a tree's parties).
CREATE INDEX contracts_by_root_delegate ON contracts (root_seq, delegate_key);
