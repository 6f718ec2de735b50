-- Units a host recorded but the ledger did not charge: metering by a host
-- the delegate chose itself is charged only up to the contract's residual
--; the rest is kept here and shown on the completion receipt.
ALTER TABLE contracts ADD COLUMN metered_uncharged INTEGER NOT NULL DEFAULT 0;
