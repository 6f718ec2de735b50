-- Metered units are charged to a contract's spent as they are recorded
-- (issue 11, item 2), no longer when it ends. Open contracts metered before
-- this migration move their metered units into spent now; ended ones
-- already had them charged.
UPDATE contracts SET spent = spent + observed_units WHERE metered != 0 AND status IN (1, 2);
