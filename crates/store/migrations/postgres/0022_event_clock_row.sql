-- The tag is random in 1..=32767 (15 bits above a cursor's 48-bit
-- position; see `store::postgres::events`).
INSERT INTO event_clock (id, last_pos, tag) VALUES (1, 0, 1 + floor(random() * 32767)::BIGINT);
