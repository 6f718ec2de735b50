-- Watch positions (see `store::postgres::events`), taken only under the
-- `event_clock` row lock, which their transaction holds until it commits:
-- the values one transaction takes are consecutive, and they become
-- visible in the order they were taken. A sequence, not `last_pos`: an
-- update of the clock's row per commit made a new row version every
-- waiter re-checked (a third of the database's CPU per delegation with
-- three replicas, BENCHMARKS.md). CACHE 1: a session must not
-- hold values another would take after it.
CREATE SEQUENCE event_positions AS BIGINT MINVALUE 1 CACHE 1;
