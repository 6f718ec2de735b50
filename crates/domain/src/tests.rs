//! Unit and property tests of the issuance invariants, without a runtime.

use super::*;
use proptest::prelude::*;

const NOW: i64 = 1_000_000;
const HOLDER: AgentKey = [1; 32];
const LINEAGE: [u8; 32] = [7; 32];

fn scope(p: &[&str]) -> Scope {
    Scope::parse(&p.iter().map(|s| s.to_string()).collect::<Vec<_>>(), "s").unwrap()
}

fn parent() -> ParentView {
    ParentView {
        ending: false,
        status: Status::Open,
        delegate_key: HOLDER,
        depth: 1,
        intent_lineage_hash: LINEAGE,
        cumulative_trust_ppm: 900_000,
        liability: Liability::Delegate,
        effective_predicate: Predicate::parse("(result.schema_valid && result.within_scope)", "p")
            .unwrap(),
        deadline_ms: NOW + 90_000,
        write_scope: scope(&["src"]),
        policy: Policy {
            max_depth: 4,
            min_cumulative_trust_ppm: 400_000,
            max_children: 8,
            retry_headroom: true,
            require_host: false,
        },
        ledger: Ledger::new(25),
    }
}

fn ask() -> ChildAsk {
    ChildAsk {
        requester: HOLDER,
        intent_lineage_hash: LINEAGE,
        budget: 13,
        deadline_ms: Some(NOW + 60_000),
        liability: Liability::Delegate,
        predicate: Predicate::default(),
        escalation_channel: "broker".into(),
        min_retry_cost: 12,
        min_retry_latency_ms: 15_000,
        write_scope: scope(&["src/exec"]),
        factor_ppm: 800_000,
        factor_note: "attested".into(),
    }
}

fn codes(p: &ParentView, a: &ChildAsk) -> Vec<InvariantCode> {
    check_delegation(p, a, NOW)
        .map(|_| Vec::new())
        .unwrap_or_else(|r| r.codes())
}

#[test]
fn a_well_formed_hop_is_issued_with_terms_by_construction() {
    let terms = check_delegation(&parent(), &ask(), NOW).unwrap();
    assert_eq!(terms.depth, 2);
    assert_eq!(terms.deadline_ms, NOW + 60_000);
    assert_eq!(terms.cumulative_trust_ppm, 720_000);
    // The inherited predicate is kept although this hop forwarded none.
    assert_eq!(
        terms.effective_predicate.as_str(),
        "(result.schema_valid && result.within_scope)"
    );
    let mut a = ask();
    a.deadline_ms = None;
    assert_eq!(
        check_delegation(&parent(), &a, NOW).unwrap().deadline_ms,
        NOW + 90_000
    );
}

#[test]
fn every_code_is_produced_alone_by_its_own_violation() {
    type Mutate = fn(&mut ParentView, &mut ChildAsk);
    let cases: [(InvariantCode, Mutate); 15] = [
        (InvariantCode::ParentNotActive, |p, a| {
            p.deadline_ms = NOW;
            a.deadline_ms = None;
            a.min_retry_latency_ms = 0;
        }),
        (InvariantCode::NotHolder, |_, a| a.requester = [9; 32]),
        (InvariantCode::DepthExceeded, |p, _| p.depth = 4),
        (InvariantCode::IntentDiluted, |_, a| {
            a.intent_lineage_hash = [8; 32]
        }),
        (InvariantCode::TrustAttenuated, |_, a| {
            a.factor_ppm = 400_000
        }),
        (InvariantCode::LiabilityWithoutPredicate, |p, _| {
            p.effective_predicate = Predicate::default()
        }),
        (InvariantCode::LiabilityWithoutEscalation, |_, a| {
            a.escalation_channel.clear()
        }),
        (InvariantCode::LiabilityFromRetainingParent, |p, _| {
            p.liability = Liability::Principal
        }),
        (InvariantCode::BelowRetryCost, |p, a| {
            p.policy.retry_headroom = false;
            a.budget = 11;
        }),
        (InvariantCode::BelowRetryLatency, |_, a| {
            a.min_retry_latency_ms = 60_001
        }),
        (InvariantCode::BudgetExceedsParent, |p, a| {
            p.policy.retry_headroom = false;
            a.budget = 26;
        }),
        (InvariantCode::DeadlineExceedsParent, |_, a| {
            a.deadline_ms = Some(NOW + 90_001)
        }),
        (InvariantCode::NoRetryHeadroom, |_, a| a.budget = 14),
        (InvariantCode::ScopeWidened, |_, a| {
            a.write_scope = scope(&["docs"])
        }),
        (InvariantCode::FanoutExceeded, |p, a| {
            p.policy.max_children = 1;
            p.ledger.open_children = 1;
            p.ledger.reserved = 1;
            p.policy.retry_headroom = false;
            a.budget = 12;
        }),
    ];
    for (code, mutate) in cases {
        let (mut p, mut a) = (parent(), ask());
        mutate(&mut p, &mut a);
        assert_eq!(codes(&p, &a), vec![code], "{}", code.as_str());
    }
}

#[test]
fn seed_001_executor_is_refused_for_retry_headroom_then_issued_at_13() {
    let (p, mut a) = (parent(), ask());
    a.budget = 20;
    let refusal = check_delegation(&p, &a, NOW).unwrap_err();
    assert_eq!(refusal.codes(), vec![InvariantCode::NoRetryHeadroom]);
    assert_eq!(refusal.violations()[0].requested, "5");
    assert_eq!(refusal.violations()[0].allowed, "12");
}

#[test]
fn seed_001_bad_contract_lists_both_liability_violations() {
    let mut p = parent();
    p.effective_predicate = Predicate::default();
    p.ledger = Ledger::new(100);
    let mut a = ask();
    a.budget = 20;
    a.escalation_channel.clear();
    let refusal = check_delegation(&p, &a, NOW).unwrap_err();
    assert_eq!(
        refusal.codes(),
        vec![
            InvariantCode::LiabilityWithoutPredicate,
            InvariantCode::LiabilityWithoutEscalation
        ]
    );
    assert_eq!(refusal.primary(), InvariantCode::LiabilityWithoutPredicate);
}

#[test]
fn principal_children_may_skip_predicate_and_escalation() {
    let mut a = ask();
    a.liability = Liability::Principal;
    a.escalation_channel.clear();
    a.budget = 25; // no retry headroom needed when liability stays.
    let terms = check_delegation(&parent(), &a, NOW).unwrap();
    assert!(terms.effective_predicate.is_empty());
}

#[test]
fn the_primary_reason_is_the_lowest_code() {
    let (mut p, mut a) = (parent(), ask());
    p.status = Status::Open;
    p.deadline_ms = NOW - 1;
    a.requester = [3; 32];
    a.budget = 1_000;
    let refusal = check_delegation(&p, &a, NOW).unwrap_err();
    assert_eq!(refusal.primary(), InvariantCode::ParentNotActive);
    let c = refusal.codes();
    assert!(c.windows(2).all(|w| w[0] < w[1]), "{c:?}");
    assert!(
        c.contains(&InvariantCode::NotHolder) && c.contains(&InvariantCode::BudgetExceedsParent)
    );
}

proptest! {
    /// Any sequence of sibling asks, checked and reserved one after another
    /// as the store does inside its transaction, never overspends the parent.
    #[test]
    fn sequential_siblings_never_overspend(budget in 1i64..1_000, asks in proptest::collection::vec(1i64..200, 0..80)) {
        let mut p = parent();
        p.ledger = Ledger::new(budget);
        p.policy.retry_headroom = false;
        p.policy.max_children = 1_024;
        let mut issued = 0i64;
        for amount in asks {
            let mut a = ask();
            a.budget = amount;
            a.min_retry_cost = 0;
            match check_delegation(&p, &a, NOW) {
                Ok(_) => {
                    p.ledger.reserve(amount).expect("a checked reservation applies");
                    issued += amount;
                }
                Err(r) => prop_assert!(r.codes().contains(&InvariantCode::BudgetExceedsParent)),
            }
            prop_assert!(p.ledger.is_consistent());
        }
        prop_assert!(issued <= budget);
        prop_assert_eq!(p.ledger.reserved, issued);
    }

    /// Deadlines compose by minimum and never exceed the parent's.
    #[test]
    fn effective_deadline_is_the_minimum(requested in proptest::option::of(NOW..NOW + 200_000)) {
        let mut a = ask();
        a.deadline_ms = requested;
        a.min_retry_latency_ms = 0;
        let p = parent();
        match check_delegation(&p, &a, NOW) {
            Ok(t) => {
                prop_assert!(t.deadline_ms <= p.deadline_ms);
                prop_assert_eq!(t.deadline_ms, requested.unwrap_or(p.deadline_ms));
            }
            Err(r) => prop_assert_eq!(r.codes(), vec![InvariantCode::DeadlineExceedsParent]),
        }
    }
}
