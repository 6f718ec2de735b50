-- Positions go on after the last one given (the clock's `last_pos` is no
-- longer advanced); a fresh database starts at 1. Never backwards: a
-- replica migrating at the same time as another that already serves
-- would otherwise hand out again a position given meanwhile. The clock's
-- row is locked, so no position is being given while this reads them.
SELECT setval('event_positions', GREATEST(after.n, 1), after.n > 0)
FROM (
    SELECT GREATEST(
        clock.last_pos,
        (SELECT COALESCE(MAX(pos), 0) FROM events),
        (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM event_positions)
    ) AS n
    FROM event_clock AS clock WHERE clock.id = 1 FOR UPDATE
) AS after;
