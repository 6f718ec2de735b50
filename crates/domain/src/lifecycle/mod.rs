//! A contract's life after issuance (docs/design.md §Lifecycle): which event may
//! move which status where, who may revoke, and a pure in-memory model of a
//! contract tree that applies those transitions with the ledger's
//! arithmetic (`Ledger::charge`, `Ledger::settle_child`). The store applies
//! the same functions inside its transactions; the model is what the
//! property tests run arbitrary operation sequences against.
//!
//! Ending a contract, whatever the event, ends its open descendants first,
//! deepest first, so each one settles into its parent before that parent
//! settles in turn: no ended contract holds a reservation. Descendants of
//! an expired contract expire (their deadlines are no later than its); those
//! of a contract that ends any other way are revoked.

mod decide;

pub use decide::{
    Action, CompleteFacts, CompletedFacts, Decision, Ending, Facts, PlannedReceipt, ReceiptBody,
    Refused, RowUpdate, Subtree, TargetWrite, authorize, check_host, decide, drain_status,
    drain_step, judgment_due, needs_descendants,
};

use super::AgentKey;
use super::Status;
use super::ledger::{Ledger, LedgerError, Overspend, Settlement};

/// What happens to a contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Event {
    /// The delegate takes the contract on.
    Accept,
    /// The delegate refuses it before accepting.
    Decline,
    /// The delegate reports its result.
    Complete,
    /// The delegate returns it as unresolvable (docs/design.md, seed 001).
    Escalate,
    /// Its deadline passed.
    Expire,
    /// The holder of an ancestor withdrew it.
    Revoke,
    /// Its host recorded what it observed (never moves the status; only
    /// an open contract takes observations).
    Record,
}

impl Event {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Accept => "ACCEPT",
            Self::Decline => "DECLINE",
            Self::Complete => "COMPLETE",
            Self::Escalate => "ESCALATE",
            Self::Expire => "EXPIRE",
            Self::Revoke => "REVOKE",
            Self::Record => "RECORD",
        }
    }

    /// The status open descendants take when a contract ends by `self`.
    pub fn cascade_status(self) -> Status {
        match self {
            Self::Expire => Status::Expired,
            _ => Status::Revoked,
        }
    }
}

/// Why a lifecycle event was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LifecycleError {
    #[error("{} is not allowed on a {} contract", event.as_str(), from.as_str())]
    NotAllowed { from: Status, event: Event },
    /// The deadline has passed: the contract can only expire (or be
    /// revoked) now; "a completion after the deadline is refused as late".
    #[error("too late: the deadline {deadline_ms} passed at {now_ms}")]
    Late { deadline_ms: i64, now_ms: i64 },
    #[error("not expired: the deadline {deadline_ms} is after {now_ms}")]
    NotDue { deadline_ms: i64, now_ms: i64 },
}

/// The status a contract moves to on `event`, at `now_ms`. Deadlines are
/// exclusive, as at issuance: at `now_ms >= deadline_ms` the contract is
/// past its deadline.
pub fn transition(
    from: Status,
    event: Event,
    deadline_ms: i64,
    now_ms: i64,
) -> Result<Status, LifecycleError> {
    let late = now_ms >= deadline_ms;
    let to = match (from, event) {
        (Status::Open, Event::Accept) => Status::Accepted,
        (Status::Open, Event::Decline) => Status::Declined,
        (Status::Accepted, Event::Complete) => Status::Completed,
        (Status::Accepted, Event::Escalate) => Status::Unresolvable,
        (Status::Open | Status::Accepted, Event::Expire) => Status::Expired,
        (Status::Open | Status::Accepted, Event::Revoke) => Status::Revoked,
        _ => return Err(LifecycleError::NotAllowed { from, event }),
    };
    match event {
        Event::Revoke => {}
        Event::Expire if !late => {
            return Err(LifecycleError::NotDue {
                deadline_ms,
                now_ms,
            });
        }
        Event::Expire => {}
        _ if late => {
            return Err(LifecycleError::Late {
                deadline_ms,
                now_ms,
            });
        }
        _ => {}
    }
    Ok(to)
}

/// Revocation authority: the holder (delegate key) of any ancestor of the
/// contract, i.e. its principal or any principal above it. `principals`
/// lists the delegate keys of the contract's parent, grandparent, … root,
/// and for a root the key that opened it.
pub fn may_revoke<'a>(
    requester: &AgentKey,
    principals: impl IntoIterator<Item = &'a AgentKey>,
) -> bool {
    principals.into_iter().any(|k| k == requester)
}

/// One contract of the model tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub parent: Option<usize>,
    pub children: Vec<usize>,
    pub status: Status,
    pub deadline_ms: i64,
    pub ledger: Ledger,
}

/// A contract that ended during one operation, deepest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ended {
    pub id: usize,
    pub status: Status,
    /// Units charged for the contract's own consumption as it ended: only a
    /// delegate's capped report (metered units were charged as recorded).
    pub charged_at_end: i64,
    /// Reported units beyond what was charged (see `Consumption`).
    pub unverified_excess: i64,
    /// How it settled into its parent; `None` for the root.
    pub settlement: Option<Settlement>,
    /// It spent more than its budget (for a child also in `settlement`).
    pub overspend: Option<Overspend>,
}

/// Who named the host whose metering a contract receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostChoice {
    /// The principal, at Delegate: its metering is a fact the principal
    /// chose to trust, charged in full (it may overspend the budget).
    Principal,
    /// The delegate itself, at Accept (or nobody above it, for a root): a
    /// host the delegate picked may be the delegate's own second key, so
    /// its metering is worth no more than the delegate's report.
    Delegate,
}

/// What recording `units` of host metering charges now, and what it
/// records without charging: `(charged, uncharged)`. A principal-chosen
/// host's units are charged in full; a delegate-chosen host's only up to
/// what the contract still holds (its residual, never below 0), so a host
/// the delegate controls can never put debt on the chain above it.
pub fn metering_charge(ledger: &Ledger, units: i64, host: HostChoice) -> (i64, i64) {
    let units = units.max(0);
    let charged = match host {
        HostChoice::Principal => units,
        HostChoice::Delegate => units.min(ledger.residual().max(0)),
    };
    (charged, units - charged)
}

/// What a completing contract consumed itself, and so what is charged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Consumption {
    /// The host metered it. Metered units are charged the moment they are
    /// recorded (`Tree::meter`), so they count against the residual at once
    /// and nothing more is charged at the end: never twice.
    Metered,
    /// Only the delegate's own report, which nobody observed. It is charged
    /// up to what the contract still holds (its residual, never below 0),
    /// so an unverifiable claim can never put debt on the chain above it;
    /// the rest is `Ended::unverified_excess`, recorded on the completion
    /// receipt for the principal to see. Only host metering, a fact, can
    /// overspend a budget.
    Reported(i64),
}

/// Why a model operation was refused; the tree is then unchanged.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TreeError {
    #[error("no contract {0}")]
    Unknown(usize),
    #[error("the parent is not open or past its deadline")]
    ParentNotActive,
    #[error(transparent)]
    Lifecycle(#[from] LifecycleError),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

/// A contract tree held in memory: the lifecycle and ledger rules applied
/// exactly as the store applies them, without a store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tree {
    nodes: Vec<Node>,
}

impl Tree {
    /// A tree with an open root (id 0).
    pub fn new(budget: i64, deadline_ms: i64) -> Self {
        Self {
            nodes: vec![Node {
                parent: None,
                children: Vec::new(),
                status: Status::Open,
                deadline_ms,
                ledger: Ledger::new(budget),
            }],
        }
    }

    /// A tree over nodes loaded from the store: a contract, its open
    /// descendants and (as a node without parent) its parent, so the store
    /// ends and settles them with exactly this model's rules.
    pub fn from_nodes(nodes: Vec<Node>) -> Self {
        Self { nodes }
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn node(&self, id: usize) -> Result<&Node, TreeError> {
        self.nodes.get(id).ok_or(TreeError::Unknown(id))
    }

    /// Issues a child of `parent` (the budget/deadline part of the issuance
    /// check; the other invariants are `check_delegation`'s). The child's
    /// deadline is `min(parent, requested)`.
    pub fn delegate(
        &mut self,
        parent: usize,
        budget: i64,
        deadline_ms: i64,
        now_ms: i64,
    ) -> Result<usize, TreeError> {
        let p = self.node(parent)?;
        if !p.status.is_open() || now_ms >= p.deadline_ms {
            return Err(TreeError::ParentNotActive);
        }
        let deadline_ms = deadline_ms.min(p.deadline_ms);
        let mut ledger = p.ledger;
        ledger.reserve(budget)?;
        let id = self.nodes.len();
        self.nodes[parent].ledger = ledger;
        self.nodes[parent].children.push(id);
        self.nodes.push(Node {
            parent: Some(parent),
            children: Vec::new(),
            status: Status::Open,
            deadline_ms,
            ledger: Ledger::new(budget),
        });
        Ok(id)
    }

    pub fn accept(&mut self, id: usize, now_ms: i64) -> Result<(), TreeError> {
        let n = self.node(id)?;
        self.nodes[id].status = transition(n.status, Event::Accept, n.deadline_ms, now_ms)?;
        Ok(())
    }

    /// Charges `units` the host metered to open contract `id` at once: they
    /// leave its residual now, not when it ends (see `metering_charge`).
    /// Returns the units recorded but not charged.
    pub fn meter(&mut self, id: usize, units: i64, host: HostChoice) -> Result<i64, TreeError> {
        let n = self.node(id)?;
        if !n.status.is_open() {
            return Err(LifecycleError::NotAllowed {
                from: n.status,
                event: Event::Record,
            }
            .into());
        }
        let (charged, uncharged) = metering_charge(&n.ledger, units, host);
        self.nodes[id].ledger.charge(charged)?;
        Ok(uncharged)
    }

    /// Completes `id`, charging its own consumption as `consumed` says.
    pub fn complete(
        &mut self,
        id: usize,
        consumed: Consumption,
        now_ms: i64,
    ) -> Result<Vec<Ended>, TreeError> {
        self.end(id, Event::Complete, consumed, now_ms)
    }

    /// The remaining ways to end charge nothing more: what the host metered
    /// is already charged, and no report is taken.
    pub fn escalate(&mut self, id: usize, now_ms: i64) -> Result<Vec<Ended>, TreeError> {
        self.end(id, Event::Escalate, Consumption::Metered, now_ms)
    }

    pub fn decline(&mut self, id: usize, now_ms: i64) -> Result<Vec<Ended>, TreeError> {
        self.end(id, Event::Decline, Consumption::Metered, now_ms)
    }

    /// Revokes `id` and every open descendant.
    pub fn revoke(&mut self, id: usize, now_ms: i64) -> Result<Vec<Ended>, TreeError> {
        self.end(id, Event::Revoke, Consumption::Metered, now_ms)
    }

    pub fn expire(&mut self, id: usize, now_ms: i64) -> Result<Vec<Ended>, TreeError> {
        self.end(id, Event::Expire, Consumption::Metered, now_ms)
    }

    /// Ends `id` by `event`: its open descendants first (deepest first),
    /// then itself. All or nothing.
    fn end(
        &mut self,
        id: usize,
        event: Event,
        consumed: Consumption,
        now_ms: i64,
    ) -> Result<Vec<Ended>, TreeError> {
        let n = self.node(id)?;
        let status = transition(n.status, event, n.deadline_ms, now_ms)?;
        let mut next = self.clone();
        let mut ended = Vec::new();
        for d in self.open_descendants_post_order(id) {
            ended.push(next.settle(d, event.cascade_status(), Consumption::Metered)?);
        }
        ended.push(next.settle(id, status, consumed)?);
        *self = next;
        Ok(ended)
    }

    /// Charges `id`'s own consumption, sets its final status and settles it
    /// into its parent. Its children must have ended already, so its
    /// residual is all it still holds.
    fn settle(
        &mut self,
        id: usize,
        status: Status,
        consumed: Consumption,
    ) -> Result<Ended, TreeError> {
        let (charged_at_end, unverified_excess) = match consumed {
            Consumption::Metered => (0, 0),
            Consumption::Reported(units) => {
                let held = self.nodes[id].ledger.residual().max(0);
                let charged = units.clamp(0, held);
                (charged, units.saturating_sub(charged).max(0))
            }
        };
        self.nodes[id].ledger.charge(charged_at_end)?;
        self.nodes[id].status = status;
        let child = self.nodes[id].ledger;
        let settlement = match self.nodes[id].parent {
            Some(p) => Some(self.nodes[p].ledger.settle_child(&child)?),
            None => None,
        };
        let excess = child.spent - child.budget;
        Ok(Ended {
            id,
            status,
            charged_at_end,
            unverified_excess,
            settlement,
            overspend: (excess > 0).then_some(Overspend {
                budget: child.budget,
                spent: child.spent,
                excess,
            }),
        })
    }

    /// Open strict descendants of `id`, every child before its parent.
    fn open_descendants_post_order(&self, id: usize) -> Vec<usize> {
        // Pre-order with an explicit stack, reversed: a parent is pushed
        // before its children, so reversing puts children first.
        let mut order = Vec::new();
        let mut stack: Vec<usize> = self.nodes[id].children.clone();
        while let Some(c) = stack.pop() {
            if self.nodes[c].status.is_open() {
                order.push(c);
                stack.extend(self.nodes[c].children.iter().copied());
            }
        }
        order.reverse();
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T0: i64 = 1_000;

    #[test]
    fn transitions_follow_the_lifecycle_diagram() {
        use Event::*;
        use Status::*;
        let ok = |from, ev| transition(from, ev, T0 + 10, T0);
        assert_eq!(ok(Open, Accept), Ok(Accepted));
        assert_eq!(ok(Open, Decline), Ok(Declined));
        assert_eq!(ok(Accepted, Complete), Ok(Completed));
        assert_eq!(ok(Accepted, Escalate), Ok(Unresolvable));
        assert_eq!(ok(Accepted, Revoke), Ok(Revoked));
        assert!(matches!(
            ok(Open, Complete),
            Err(LifecycleError::NotAllowed { .. })
        ));
        assert!(matches!(
            ok(Accepted, Decline),
            Err(LifecycleError::NotAllowed { .. })
        ));
        assert!(matches!(
            ok(Open, Expire),
            Err(LifecycleError::NotDue { .. })
        ));
        for s in Status::ALL.into_iter().filter(|s| s.is_ended()) {
            for ev in [Accept, Decline, Complete, Escalate, Expire, Revoke] {
                assert!(transition(s, ev, T0, T0 + 1).is_err(), "{s:?} {ev:?}");
            }
        }
        // At the deadline a completion is late; only expiry and revocation
        // remain.
        assert_eq!(
            transition(Accepted, Complete, T0, T0),
            Err(LifecycleError::Late {
                deadline_ms: T0,
                now_ms: T0
            })
        );
        assert_eq!(transition(Accepted, Expire, T0, T0), Ok(Expired));
        assert_eq!(transition(Open, Revoke, T0, T0 + 5), Ok(Revoked));
    }

    #[test]
    fn status_wire_values_round_trip() {
        for s in Status::ALL {
            assert_eq!(Status::from_i32(s.as_i32()), Some(s));
            assert_eq!(s.is_open(), !s.is_ended());
        }
        assert_eq!(Status::Declined.as_i32(), 7);
        assert_eq!(Status::from_i32(0), None);
        assert_eq!(Status::from_i32(8), None);
    }

    #[test]
    fn only_an_ancestors_holder_may_revoke() {
        let chain = [[2u8; 32], [1u8; 32]];
        assert!(may_revoke(&[1; 32], &chain));
        assert!(!may_revoke(&[3; 32], &chain));
    }

    #[test]
    fn seed_001_rejected_executor_settles_and_parent_can_retry() {
        let mut t = Tree::new(25, T0 + 90_000);
        let exec = t.delegate(0, 13, T0 + 60_000, T0).unwrap();
        t.accept(exec, T0).unwrap();
        let ended = t.complete(exec, Consumption::Reported(11), T0 + 1).unwrap();
        assert_eq!(ended.len(), 1);
        assert_eq!(ended[0].settlement.unwrap().returned, 2);
        let root = &t.node(0).unwrap().ledger;
        assert_eq!((root.reserved, root.spent, root.residual()), (0, 11, 14));
        assert!(t.delegate(0, 12, T0 + 60_000, T0 + 2).is_ok());
    }

    #[test]
    fn revoke_cascades_deepest_first_and_charges_what_was_consumed() {
        let mut t = Tree::new(100, T0 + 1_000);
        let a = t.delegate(0, 60, T0 + 900, T0).unwrap();
        let b = t.delegate(a, 30, T0 + 800, T0).unwrap();
        let c = t.delegate(b, 10, T0 + 800, T0).unwrap();
        let d = t.delegate(a, 5, T0 + 800, T0).unwrap();
        t.accept(d, T0).unwrap();
        t.complete(d, Consumption::Reported(4), T0).unwrap();
        t.meter(a, 7, HostChoice::Principal).unwrap();
        let ended = t.revoke(a, T0 + 1).unwrap();
        let ids: Vec<usize> = ended.iter().map(|e| e.id).collect();
        assert_eq!(ids, vec![c, b, a]);
        assert!(ended.iter().all(|e| e.status == Status::Revoked));
        let root = t.node(0).unwrap().ledger;
        // d's 4 reached a, a's own 7 on top; all of it reached the root.
        assert_eq!((root.reserved, root.spent, root.open_children), (0, 11, 0));
    }

    #[test]
    fn expiry_cascades_as_expiry_and_a_refused_event_changes_nothing() {
        let mut t = Tree::new(50, T0 + 100);
        let a = t.delegate(0, 20, T0 + 100, T0).unwrap();
        let b = t.delegate(a, 10, T0 + 100, T0).unwrap();
        let before = t.clone();
        assert!(t.expire(a, T0 + 99).is_err());
        assert!(t.complete(a, Consumption::Reported(1), T0).is_err()); // not accepted
        assert_eq!(t, before);
        let ended = t.expire(a, T0 + 100).unwrap();
        assert_eq!(ended[0].id, b);
        assert!(ended.iter().all(|e| e.status == Status::Expired));
    }

    /// Metered units leave the residual at once, so a
    /// parent whose host metered its whole budget cannot issue a child.
    #[test]
    fn metered_units_count_against_the_residual_at_once() {
        let mut t = Tree::new(100, T0 + 1_000);
        assert_eq!(t.meter(0, 100, HostChoice::Principal), Ok(0));
        assert_eq!(t.node(0).unwrap().ledger.residual(), 0);
        assert!(matches!(
            t.delegate(0, 100, T0 + 900, T0),
            Err(TreeError::Ledger(LedgerError::InsufficientResidual { .. }))
        ));
    }

    /// An ancestor accepting (or ending) after its
    /// descendant's host metered units charges them once, and the
    /// descendant's settlement says consumed 4, returned 26.
    #[test]
    fn a_late_accept_above_a_metered_descendant_charges_once() {
        let mut t = Tree::new(100, T0 + 1_000);
        let a = t.delegate(0, 60, T0 + 900, T0).unwrap();
        let b = t.delegate(a, 30, T0 + 900, T0).unwrap();
        t.accept(b, T0).unwrap();
        t.meter(b, 4, HostChoice::Principal).unwrap();
        t.accept(a, T0).unwrap();
        let ended = t.complete(b, Consumption::Metered, T0 + 1).unwrap();
        assert_eq!(t.node(b).unwrap().ledger.spent, 4);
        let s = ended[0].settlement.unwrap();
        assert_eq!((s.charged, s.returned), (4, 26));
        let al = t.node(a).unwrap().ledger;
        assert_eq!((al.spent, al.residual()), (4, 56));
        // a escalates: nothing of b is charged again.
        t.escalate(a, T0 + 2).unwrap();
        assert_eq!(t.node(0).unwrap().ledger.spent, 4);
    }

    /// A report nobody observed is charged at most what
    /// the contract still holds; the rest is recorded, not charged.
    #[test]
    fn an_unverified_report_is_charged_at_most_the_residual() {
        let mut t = Tree::new(100, T0 + 1_000);
        let a = t.delegate(0, 10, T0 + 900, T0).unwrap();
        t.accept(a, T0).unwrap();
        let ended = t
            .complete(a, Consumption::Reported(1_000_000_000_000_000), T0)
            .unwrap();
        let e = ended[0];
        assert_eq!(
            (e.charged_at_end, e.unverified_excess),
            (10, 999_999_999_999_990)
        );
        assert_eq!(e.overspend, None);
        let root = t.node(0).unwrap().ledger;
        assert_eq!((root.spent, root.residual()), (10, 90));
        // Metered units are a fact: they may overspend, and are charged in full.
        let b = t.delegate(0, 10, T0 + 900, T0).unwrap();
        t.accept(b, T0).unwrap();
        t.meter(b, 25, HostChoice::Principal).unwrap();
        let ended = t.complete(b, Consumption::Metered, T0).unwrap();
        assert_eq!(ended[0].overspend.map(|o| o.excess), Some(15));
        assert_eq!(t.node(0).unwrap().ledger.spent, 35);
        // An ended contract takes no metering.
        assert!(t.meter(b, 1, HostChoice::Principal).is_err());
        // A host the delegate chose is charged up to the residual only.
        let c = t.delegate(0, 10, T0 + 900, T0).unwrap();
        t.accept(c, T0).unwrap();
        assert_eq!(t.meter(c, 1_000_000, HostChoice::Delegate), Ok(999_990));
        assert_eq!(t.meter(c, 5, HostChoice::Delegate), Ok(5));
        let ended = t.complete(c, Consumption::Metered, T0).unwrap();
        assert_eq!(ended[0].overspend, None);
        assert_eq!(t.node(0).unwrap().ledger.spent, 45);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Delegate {
            parent: usize,
            budget: i64,
            deadline: i64,
        },
        Accept(usize),
        Meter(usize, i64, bool),
        /// `None`: the host metered it.
        Complete(usize, Option<i64>),
        Escalate(usize),
        Decline(usize),
        Revoke(usize),
        Expire(usize),
        Tick(i64),
    }

    fn op() -> impl Strategy<Value = Op> {
        let id = 0usize..1024;
        let units = 0i64..40;
        prop_oneof![
            6 => (id.clone(), 1i64..60, 1i64..4_000).prop_map(|(parent, budget, deadline)| Op::Delegate { parent, budget, deadline }),
            2 => id.clone().prop_map(Op::Accept),
            2 => (id.clone(), units.clone(), any::<bool>()).prop_map(|(i, c, p)| Op::Meter(i, c, p)),
            2 => (id.clone(), proptest::option::of(0i64..200)).prop_map(|(i, c)| Op::Complete(i, c)),
            1 => id.clone().prop_map(Op::Escalate),
            1 => id.clone().prop_map(Op::Decline),
            1 => id.clone().prop_map(Op::Revoke),
            1 => id.prop_map(Op::Expire),
            1 => (1i64..100).prop_map(Op::Tick),
        ]
    }

    /// Conservation: after every operation,
    /// for every contract, the ledger equation holds, `reserved` is exactly
    /// what its open children hold, an ended contract holds nothing, every
    /// unit consumed is charged exactly once, a negative residual is backed
    /// by a reported overspend, and an ended contract has no open
    /// descendant.
    fn check(
        t: &Tree,
        consumed: i64,
        overspent: &[bool],
        metered: &[bool],
    ) -> Result<(), TestCaseError> {
        let nodes = t.nodes();
        let mut unsettled_spent = 0i64;
        for (i, n) in nodes.iter().enumerate() {
            let l = n.ledger;
            prop_assert_eq!(l.budget, l.residual() + l.reserved + l.spent, "node {}", i);
            prop_assert!(l.spent >= 0 && l.reserved >= 0);
            let open: Vec<&Node> = n
                .children
                .iter()
                .map(|&c| &nodes[c])
                .filter(|c| c.status.is_open())
                .collect();
            prop_assert_eq!(
                l.reserved,
                open.iter().map(|c| c.ledger.budget).sum::<i64>()
            );
            prop_assert_eq!(l.open_children as usize, open.len());
            if n.status.is_ended() {
                prop_assert_eq!(l.reserved, 0, "ended node {} holds a reservation", i);
                prop_assert_eq!(l.open_children, 0);
                prop_assert!(open.is_empty(), "ended node {} has open children", i);
            }
            if l.residual() < 0 {
                // Debt comes only from facts: host metering of this node, or
                // a child's recorded overspend.
                let backed = overspent[i] || metered[i] || n.children.iter().any(|&c| overspent[c]);
                prop_assert!(backed, "node {} is in debt without a recorded overspend", i);
            }
            if n.parent.is_none() || n.status.is_open() {
                unsettled_spent += l.spent;
            }
        }
        prop_assert_eq!(unsettled_spent, consumed, "spent is not what was consumed");
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn ledger_invariants_hold_over_any_operation_sequence(
            root_budget in 1i64..600,
            ops in proptest::collection::vec(op(), 0..120),
        ) {
            let mut now = T0;
            let mut t = Tree::new(root_budget, T0 + 5_000);
            let mut consumed = 0i64;
            let mut overspent = vec![false];
            let mut metered = vec![false; 1];
            for op in ops {
                let before = t.clone();
                let len = t.nodes().len();
                let open: Vec<usize> = (0..len).filter(|&i| t.nodes()[i].status.is_open()).collect();
                // Mostly open targets (ended ones only test refusals), and the
                // root rarely, so trees grow before they end.
                let target = |pick: usize, may_be_root: bool| -> usize {
                    if pick % 8 == 7 {
                        return pick % (len + 1); // any node, or an unknown one
                    }
                    let root_ok = may_be_root || pick.is_multiple_of(16);
                    let candidates: Vec<usize> =
                        open.iter().copied().filter(|&i| root_ok || i != 0).collect();
                    match candidates.len() {
                        0 => len,
                        n => candidates[pick % n],
                    }
                };
                let result = match op.clone() {
                    Op::Delegate { parent, budget, deadline } => t
                        .delegate(target(parent, true), budget, now + deadline, now)
                        .map(|_| Vec::new()),
                    Op::Accept(i) => t.accept(target(i, true), now).map(|_| Vec::new()),
                    Op::Meter(i, c, principal) => {
                        let target = target(i, true);
                        let host = if principal { HostChoice::Principal } else { HostChoice::Delegate };
                        t.meter(target, c, host).map(|uncharged| {
                            consumed += c - uncharged;
                            metered.resize(t.nodes().len(), false);
                            // Only a principal's host can put a node in debt.
                            metered[target] |= principal;
                            Vec::new()
                        })
                    }
                    Op::Complete(i, c) => {
                        let target = target(i, false);
                        let how = c.map_or(Consumption::Metered, Consumption::Reported);
                        let r = t.complete(target, how, now);
                        if let (Ok(ended), Some(reported)) = (&r, c) {
                            let own = ended.last().expect("the target ends last");
                            prop_assert_eq!(own.id, target);
                            prop_assert_eq!(own.charged_at_end + own.unverified_excess, reported);
                            // An unverified report never creates debt.
                            prop_assert!(own.unverified_excess == 0 || t.nodes()[target].ledger.residual() <= 0);
                            consumed += own.charged_at_end;
                        }
                        r
                    }
                    Op::Escalate(i) => t.escalate(target(i, false), now),
                    Op::Decline(i) => t.decline(target(i, false), now),
                    Op::Revoke(i) => {
                        let target = target(i, false);
                        let r = t.revoke(target, now);
                        if r.is_ok() {
                            let mut stack = vec![target];
                            while let Some(x) = stack.pop() {
                                prop_assert!(t.nodes()[x].status.is_ended(), "revoke missed {}", x);
                                stack.extend(t.nodes()[x].children.iter().copied());
                            }
                        }
                        r
                    }
                    Op::Expire(i) => t.expire(target(i, false), now),
                    Op::Tick(dt) => {
                        now += dt;
                        Ok(Vec::new())
                    }
                };
                overspent.resize(t.nodes().len(), false);
                metered.resize(t.nodes().len(), false);
                match result {
                    Ok(ended) => {
                        for e in ended {
                            prop_assert!(t.nodes()[e.id].status.is_ended());
                            if e.overspend.is_some() {
                                overspent[e.id] = true;
                            }
                            if let Some(s) = e.settlement {
                                prop_assert_eq!(s.overspend, e.overspend);
                            }
                        }
                    }
                    Err(_) => prop_assert_eq!(&t, &before, "a refused {:?} changed the tree", op),
                }
                check(&t, consumed, &overspent, &metered)?;
            }
        }
    }
}
