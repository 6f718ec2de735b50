-- Metered units are charged to a contract's spent as they are recorded
--, no longer when it ends. An open contract's spent is
-- recomputed from what it is made of: its own metered units plus what its
-- ended children spent. (Recomputed, not incremented: the bug this fixes,
-- a late Accept pre-charging open descendants' metered units, may already
-- have written some of them in.) Ended contracts are left as they ended.
UPDATE contracts
SET spent = (CASE WHEN metered != 0 THEN observed_units ELSE 0 END)
    + COALESCE((SELECT SUM(c.spent) FROM contracts c
                WHERE c.parent_seq = contracts.seq AND c.status NOT IN (1, 2)), 0)
WHERE status IN (1, 2);
