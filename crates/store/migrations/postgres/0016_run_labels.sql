-- Runs by label, for AggregateAudits: one row per label of each root.
CREATE TABLE run_labels (
    label_key TEXT NOT NULL,
    label_value TEXT NOT NULL,
    root_seq BIGINT NOT NULL,
    PRIMARY KEY (label_key, label_value, root_seq)
);
