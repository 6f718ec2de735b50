-- The clock's `last_pos` is retired (positions come from `event_positions`
-- since migration 39, continued after it by migration 40), and dropped: a
-- replica of a version before 39 still running then fails every write at
-- once (no such column) instead of giving positions from it, which first
-- collide with the sequence's and, once ahead of it, make the newer
-- replicas' writes collide (see `store::postgres::events`).
ALTER TABLE event_clock DROP COLUMN last_pos;
