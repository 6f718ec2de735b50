-- One row the writer rewrites to probe whether the disk takes writes
-- again after a failure (disk full, read-only, I/O error): health turns
-- SERVING once it does. `headroom` is as large as the probe asks, so a
-- probe passes only when a batch's worth of space is free, not when one
-- small row fits a hole the failed write left in the WAL.
CREATE TABLE health_probe (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    at_ms INTEGER NOT NULL,
    headroom BLOB NOT NULL
);
