-- Positions go on after the last one the clock gave (its `last_pos` is
-- no longer advanced); a fresh database starts at 1.
SELECT setval('event_positions', GREATEST(last_pos, 1), last_pos > 0) FROM event_clock WHERE id = 1;
