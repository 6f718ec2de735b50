//! Budget ledger arithmetic of one contract. The store persists these four
//! numbers; every change goes through here so the equation
//! `budget = residual + reserved + spent` cannot be broken by a caller.
//!
//! Settlement (docs/design.md §Lifecycle): when a child ends, whatever way it
//! ends, its parent un-reserves the child's budget and is charged the
//! child's whole `spent` (its own consumption plus what its settled
//! descendants spent). Consumed units are never forgiven and never clipped:
//! a child that spent more than its budget is charged in full, and the
//! excess is returned as an [`Overspend`] fact for the store to record. The
//! parent's residual may then go negative: that negative residual *is* the
//! recorded debt, and invariant 11 refuses every further child until
//! nothing is left to refuse. The unspent part of the child's budget
//! returns to the parent's residual by the same step.

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
    #[error("consumption {0} is negative")]
    NegativeConsumption(i64),
    #[error("the child still holds {reserved} units for {open_children} open children")]
    ChildStillReserving { reserved: i64, open_children: u32 },
    #[error("the parent holds no reservation of {budget} for this child")]
    NotReserved { budget: i64 },
    #[error("spent would overflow")]
    Overflow,
}

/// A child spent more than its budget: recorded as a fact, never clipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Overspend {
    /// The child's budget.
    pub budget: i64,
    /// What it spent in total (own consumption and settled descendants).
    pub spent: i64,
    /// `spent - budget`, > 0.
    pub excess: i64,
}

/// What settling one ended child did to its parent's ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settlement {
    /// Reservation released: the child's budget.
    pub released: i64,
    /// Charged to the parent's `spent`: the child's whole `spent`.
    pub charged: i64,
    /// Back in the parent's residual: `max(0, budget - spent)`.
    pub returned: i64,
    /// Present when the child spent more than its budget.
    pub overspend: Option<Overspend>,
}

/// What the principal is told when its delegate escalates (docs/design.md, seed 001): what
/// it has left, and whether it can still retry once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EscalationNotice {
    /// The principal's residual after the escalated child was settled.
    pub residual: i64,
    /// The principal's deadline.
    pub deadline_ms: i64,
    /// `deadline_ms - now`, never below 0.
    pub time_left_ms: i64,
    /// One retry under the escalated contract's `min_retry_cost` and
    /// `min_retry_latency_ms` still fits: `residual >= min_retry_cost` and
    /// `time_left_ms >= min_retry_latency_ms`.
    pub retry_feasible: bool,
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
        self.budget
            .saturating_sub(self.reserved)
            .saturating_sub(self.spent)
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

    /// Charges the contract's own consumption (exclusive of its children,
    /// which are charged when they settle). Zero is allowed; above the
    /// budget is allowed and shows as a negative residual.
    pub fn charge(&mut self, consumed: i64) -> Result<(), LedgerError> {
        if consumed < 0 {
            return Err(LedgerError::NegativeConsumption(consumed));
        }
        // Saturates: consumption is client-reported and must never make a
        // contract impossible to end.
        self.spent = self.spent.saturating_add(consumed);
        Ok(())
    }

    /// Settles an ended child against this (its parent's) ledger: releases
    /// the child's reservation and charges its whole `spent`. The same for
    /// every way a child ends (completed, escalated, declined, expired,
    /// revoked): what was consumed is gone. The child must have settled its
    /// own children first. On error nothing changed.
    pub fn settle_child(&mut self, child: &Ledger) -> Result<Settlement, LedgerError> {
        if child.reserved != 0 || child.open_children != 0 {
            return Err(LedgerError::ChildStillReserving {
                reserved: child.reserved,
                open_children: child.open_children,
            });
        }
        if child.spent < 0 {
            return Err(LedgerError::NegativeConsumption(child.spent));
        }
        if self.open_children == 0 || self.reserved < child.budget {
            return Err(LedgerError::NotReserved {
                budget: child.budget,
            });
        }
        let spent = self.spent.saturating_add(child.spent);
        self.reserved -= child.budget;
        self.open_children -= 1;
        self.spent = spent;
        let excess = child.spent - child.budget;
        Ok(Settlement {
            released: child.budget,
            charged: child.spent,
            returned: (-excess).max(0),
            overspend: (excess > 0).then_some(Overspend {
                budget: child.budget,
                spent: child.spent,
                excess,
            }),
        })
    }

    /// The principal's view after its child escalated; call it on the
    /// principal's ledger once the child is settled.
    pub fn escalation_notice(
        &self,
        deadline_ms: i64,
        now_ms: i64,
        min_retry_cost: i64,
        min_retry_latency_ms: i64,
    ) -> EscalationNotice {
        let residual = self.residual();
        let time_left_ms = deadline_ms.saturating_sub(now_ms).max(0);
        EscalationNotice {
            residual,
            deadline_ms,
            time_left_ms,
            retry_feasible: residual >= min_retry_cost && time_left_ms >= min_retry_latency_ms,
        }
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

    fn parent_with_child(budget: i64, child_budget: i64) -> Ledger {
        let mut parent = Ledger::new(budget);
        parent.reserve(child_budget).unwrap();
        parent
    }

    #[test]
    fn settling_returns_the_unspent_part() {
        let mut parent = parent_with_child(25, 13);
        let mut child = Ledger::new(13);
        child.charge(9).unwrap();
        let s = parent.settle_child(&child).unwrap();
        assert_eq!(
            (s.released, s.charged, s.returned, s.overspend),
            (13, 9, 4, None)
        );
        assert_eq!(
            (parent.reserved, parent.spent, parent.residual()),
            (0, 9, 16)
        );
        assert_eq!(parent.open_children, 0);
    }

    #[test]
    fn an_overspend_is_charged_in_full_and_reported() {
        let mut parent = parent_with_child(20, 13);
        let mut child = Ledger::new(13);
        child.charge(30).unwrap();
        let s = parent.settle_child(&child).unwrap();
        assert_eq!(
            s.overspend,
            Some(Overspend {
                budget: 13,
                spent: 30,
                excess: 17
            })
        );
        assert_eq!(s.returned, 0);
        assert_eq!(parent.spent, 30);
        assert_eq!(parent.residual(), -10);
        assert_eq!(
            parent.budget,
            parent.residual() + parent.reserved + parent.spent
        );
        // A debt blocks further reservations.
        assert!(parent.reserve(1).is_err());
    }

    #[test]
    fn settlement_preconditions_leave_the_ledger_unchanged() {
        let mut parent = parent_with_child(20, 5);
        let before = parent;
        let mut busy = Ledger::new(5);
        busy.reserve(2).unwrap();
        assert!(matches!(
            parent.settle_child(&busy),
            Err(LedgerError::ChildStillReserving { .. })
        ));
        assert!(matches!(
            parent.settle_child(&Ledger::new(6)),
            Err(LedgerError::NotReserved { budget: 6 })
        ));
        assert_eq!(parent, before);
        assert_eq!(
            Ledger::new(3).charge(-1),
            Err(LedgerError::NegativeConsumption(-1))
        );
    }

    #[test]
    fn escalation_notice_says_whether_one_retry_fits() {
        let mut parent = parent_with_child(25, 13);
        let mut child = Ledger::new(13);
        child.charge(2).unwrap();
        parent.settle_child(&child).unwrap();
        // seed 001: 23 units and 60 s left, a retry costs 12 units and 15 s.
        let n = parent.escalation_notice(160_000, 100_000, 12, 15_000);
        assert_eq!(
            (n.residual, n.time_left_ms, n.retry_feasible),
            (23, 60_000, true)
        );
        assert!(
            !parent
                .escalation_notice(160_000, 100_000, 24, 15_000)
                .retry_feasible
        );
        assert!(
            !parent
                .escalation_notice(160_000, 150_000, 12, 15_000)
                .retry_feasible
        );
        assert_eq!(parent.escalation_notice(1, 5, 0, 0).time_left_ms, 0);
    }

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
