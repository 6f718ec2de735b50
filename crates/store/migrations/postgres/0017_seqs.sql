-- Contract and receipt numbers. Unique and, for the children of one
-- parent, increasing in commit order (taken under the parent's row lock);
-- Watch does not rest on their order (see `events`).
CREATE SEQUENCE seqs;
