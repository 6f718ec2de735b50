-- The last position given, and this database's tag: cursors carry it, so
-- a cursor from another database is refused, not misread.
CREATE TABLE event_clock (
    id BIGINT PRIMARY KEY,
    last_pos BIGINT NOT NULL,
    tag BIGINT NOT NULL
);
