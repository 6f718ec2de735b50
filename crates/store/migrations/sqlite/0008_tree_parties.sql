-- Reads are answered only to a tree's parties: the
-- key that opened its root and every key that is or was a delegate or a
-- host in it. These make "is this key a party of this tree" an index seek
-- instead of a scan of the tree; both lead with root_seq, so a tree's
-- entries sit together and inserting one touches the pages of its tree.
CREATE INDEX contracts_by_root_delegate ON contracts (root_seq, delegate_key);
CREATE INDEX contracts_by_root_host ON contracts (root_seq, host_key) WHERE host_key IS NOT NULL;
