-- What the sequencer has yet to place.
CREATE INDEX events_unsequenced ON events (seq) WHERE pos IS NULL;
