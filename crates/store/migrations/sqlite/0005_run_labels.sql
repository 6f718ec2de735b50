-- Runs by label, for AggregateAudits: one row per label of each root, so a
-- label selector is an index lookup instead of a scan of every root (whose
-- labels are a JSON column). Children are not listed: a run is found by
-- its root.
CREATE TABLE run_labels (
    label_key TEXT NOT NULL,
    label_value TEXT NOT NULL,
    root_seq INTEGER NOT NULL,
    PRIMARY KEY (label_key, label_value, root_seq)
) WITHOUT ROWID;
-- Roots written before this migration. (json_each is SQLite's; the
-- PostgreSQL migrations would use jsonb_each_text.)
INSERT INTO run_labels (label_key, label_value, root_seq)
    SELECT j.key, j.value, c.seq FROM contracts c, json_each(c.labels) j
    WHERE c.parent_seq IS NULL;
