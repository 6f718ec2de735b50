//! Budget ledger arithmetic of one contract. The store persists these four
//! numbers; every change goes through here so the equation
//! `budget = residual + reserved + spent` cannot be broken by a caller.

/// The budget ledger of one contract.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ledger {
    /// Units granted to the contract at issuance; never changes.
    pub budget: i64,
    /// Units reserved by open children (sum of their budgets).
    pub reserved: i64,
    /// Units consumed by the contract itself and by settled children.
    pub spent: i64,
    /// Children currently open: bounds fan-out (invariant 15).
    pub open_children: u32,
}

/// Why a ledger change was not applied. The invariant check runs first, so
/// reaching one of these is a bug, not a client error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    #[error("reservation of {amount} exceeds residual {residual}")]
    InsufficientResidual { amount: i64, residual: i64 },
    #[error("amount {0} is not positive")]
    NotPositive(i64),
}

impl Ledger {
    pub fn new(budget: i64) -> Self {
        debug_assert!(budget > 0);
        Self {
            budget,
            ..Self::default()
        }
    }

    /// Units still free: `budget - reserved - spent`. Negative only after a
    /// recorded overspend.
    pub fn residual(&self) -> i64 {
        self.budget - self.reserved - self.spent
    }

    /// Reserves `amount` for a new open child.
    pub fn reserve(&mut self, amount: i64) -> Result<(), LedgerError> {
        if amount <= 0 {
            return Err(LedgerError::NotPositive(amount));
        }
        let residual = self.residual();
        if amount > residual {
            return Err(LedgerError::InsufficientResidual { amount, residual });
        }
        self.reserved += amount;
        self.open_children += 1;
        debug_assert!(self.is_consistent());
        Ok(())
    }

    /// The ledger equation plus the sign constraints that hold whenever no
    /// overspend has been recorded.
    pub fn is_consistent(&self) -> bool {
        self.budget > 0
            && self.reserved >= 0
            && self.spent >= 0
            && self.budget == self.residual() + self.reserved + self.spent
            && (self.open_children > 0 || self.reserved == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn reservations_never_exceed_the_budget(budget in 1i64..10_000, asks in proptest::collection::vec(-5i64..500, 0..64)) {
            let mut ledger = Ledger::new(budget);
            let mut granted = 0i64;
            for ask in asks {
                let before = ledger;
                match ledger.reserve(ask) {
                    Ok(()) => granted += ask,
                    Err(_) => prop_assert_eq!(ledger, before),
                }
                prop_assert!(ledger.is_consistent());
                prop_assert!(ledger.residual() >= 0);
            }
            prop_assert_eq!(ledger.reserved, granted);
        }
    }
}
