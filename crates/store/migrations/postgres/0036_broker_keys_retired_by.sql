-- Why a key was retired: 'rotation' (its replica rotated it away), 'ttl'
-- (its replica stopped heartbeating; undone if it comes back), 'operator'
-- (`delegation-broker keys retire`; never undone).
ALTER TABLE broker_keys ADD COLUMN retired_by TEXT;
