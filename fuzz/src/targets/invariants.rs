//! The issuance check, `core::check_delegation`, on an arbitrary parent and
//! ask (every field within what conversion and the store can produce).
//!
//! Asserts:
//! - a refusal lists each violated invariant once, in code order, never
//!   none, its primary reason the first; and the set of codes is exactly
//!   the one an independent model of docs/design.md's fifteen rules finds;
//! - the check is deterministic;
//! - issued terms are the ones built by construction (depth + 1, deadline
//!   min(parent, requested), cumulative trust floor(parent × factor)), and
//!   the parent's residual can always reserve the child's budget, after
//!   which the ledger still balances (no budget is spent that its holder
//!   did not hold);
//! - a liability-transferring child's effective predicate begins with its
//!   parent's and ends with its own (no forwarded predicate is dropped).

use std::collections::BTreeSet;

use crate::{note, paths};
use arbitrary::{Arbitrary, Unstructured};
use delegation_broker::core::limits::{
    MAX_BUDGET_UNITS, MAX_CHILDREN_CEILING, MAX_DEPTH_CEILING, MAX_HORIZON_MS, PPM_ONE,
};
use delegation_broker::core::{
    ChildAsk, InvariantCode as C, Ledger, Liability, ParentView, Policy, Predicate, Scope, Status,
    check_delegation,
};

const KEYS: [[u8; 32]; 3] = [[1; 32], [2; 32], [3; 32]];
const HASHES: [[u8; 32]; 2] = [[7; 32], [8; 32]];
const PREDICATES: &[&str] = &[
    "",
    "result.schema_valid",
    "result.within_scope && result.consumed < 10",
    "true\n|| true",
    "result.output.approved // trailing comment",
];

#[derive(Debug)]
pub struct Input {
    parent: ParentView,
    ask: ChildAsk,
    now_ms: i64,
}

fn key(u: &mut Unstructured<'_>) -> arbitrary::Result<[u8; 32]> {
    if u.ratio(1, 8)? {
        u.arbitrary()
    } else {
        Ok(*u.choose(&KEYS)?)
    }
}

fn hash(u: &mut Unstructured<'_>) -> arbitrary::Result<[u8; 32]> {
    if u.ratio(1, 8)? {
        u.arbitrary()
    } else {
        Ok(*u.choose(&HASHES)?)
    }
}

fn scope(u: &mut Unstructured<'_>) -> arbitrary::Result<Scope> {
    Ok(Scope::parse(&paths(u, 4)?, "s").unwrap_or_default())
}

fn predicate(u: &mut Unstructured<'_>) -> arbitrary::Result<Predicate> {
    Ok(Predicate::parse(u.choose(PREDICATES)?, "p").expect("fixed predicates parse"))
}

/// A value near the interesting boundaries more often than uniform.
fn amount(u: &mut Unstructured<'_>, max: i64) -> arbitrary::Result<i64> {
    Ok(match u.int_in_range(0..=3)? {
        0 => u.int_in_range(0..=16)?,
        1 => max - u.int_in_range(0..=16)?,
        _ => u.int_in_range(0..=max)?,
    }
    .clamp(0, max))
}

impl<'a> Arbitrary<'a> for Input {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        // Most fields conform to the parent most of the time, so that hops
        // near the edge of one rule (or of a few) are common, not only
        // hops that break many at once.
        let fit = |u: &mut Unstructured<'_>| u.ratio(5, 6);
        let now_ms = u.int_in_range(0..=(1_i64 << 42))?;
        let policy = Policy::new(
            u.int_in_range(1..=MAX_DEPTH_CEILING)?,
            if fit(u)? {
                u.int_in_range(0..=1_000)?
            } else {
                u.int_in_range(0..=PPM_ONE)?
            },
            u.int_in_range(1..=MAX_CHILDREN_CEILING)?,
            u.arbitrary()?,
            u.arbitrary()?,
            MAX_DEPTH_CEILING,
            MAX_CHILDREN_CEILING,
        )
        .expect("a policy within the ceilings");
        let budget = amount(u, MAX_BUDGET_UNITS - 1)? + 1;
        let open_children = if fit(u)? {
            u.int_in_range(0..=policy.max_children - 1)?
        } else {
            u.int_in_range(0..=policy.max_children + 1)?
        };
        let reserved = if open_children == 0 {
            0
        } else {
            amount(u, budget)?
        };
        // Spent may pass the budget: a recorded overspend.
        let spent = if fit(u)? {
            amount(u, budget - reserved)?
        } else {
            amount(u, 2 * MAX_BUDGET_UNITS)?
        };
        let ledger = Ledger {
            budget,
            reserved,
            spent,
            open_children,
        };
        let parent_deadline = if fit(u)? {
            now_ms + u.int_in_range(1..=MAX_HORIZON_MS)?
        } else {
            now_ms + u.int_in_range(-MAX_HORIZON_MS..=MAX_HORIZON_MS)?
        };
        let mut effective_predicate = predicate(u)?;
        if u.ratio(1, 32)? {
            // An inherited predicate at the effective-predicate bound.
            let chunk = "(result.schema_valid\n) && ";
            effective_predicate =
                Predicate::from_trusted(format!("{}true", chunk.repeat(65_536 / chunk.len())));
        }
        let parent = ParentView {
            ending: false,
            status: if fit(u)? {
                *u.choose(&[Status::Open, Status::Accepted])?
            } else {
                *u.choose(&Status::ALL)?
            },
            delegate_key: key(u)?,
            depth: if fit(u)? {
                u.int_in_range(0..=policy.max_depth - 1)?
            } else {
                u.int_in_range(0..=policy.max_depth)?
            },
            intent_lineage_hash: hash(u)?,
            cumulative_trust_ppm: if fit(u)? {
                u.int_in_range(500_000..=PPM_ONE)?
            } else {
                u.int_in_range(0..=PPM_ONE)?
            },
            liability: if u.arbitrary()? {
                Liability::Delegate
            } else {
                Liability::Principal
            },
            effective_predicate,
            deadline_ms: parent_deadline,
            write_scope: scope(u)?,
            policy,
            ledger,
        };
        let residual = ledger.residual().max(1);
        let liability = if u.arbitrary()? {
            Liability::Delegate
        } else {
            Liability::Principal
        };
        let budget = if fit(u)? {
            u.int_in_range(1..=residual.min(MAX_BUDGET_UNITS))?
        } else {
            amount(u, MAX_BUDGET_UNITS - 1)? + 1
        };
        let ask = ChildAsk {
            requester: if fit(u)? {
                parent.delegate_key
            } else {
                key(u)?
            },
            intent_lineage_hash: if fit(u)? {
                parent.intent_lineage_hash
            } else {
                hash(u)?
            },
            budget,
            deadline_ms: match u.int_in_range(0..=3)? {
                0 => None,
                1 => Some(parent.deadline_ms + u.int_in_range(-2..=2)?),
                2 => Some(u.int_in_range(now_ms..=parent.deadline_ms.max(now_ms))?),
                _ => Some(u.int_in_range(1..=now_ms + MAX_HORIZON_MS)?),
            },
            liability,
            predicate: predicate(u)?,
            escalation_channel: if fit(u)? { "escalations" } else { "" }.to_owned(),
            min_retry_cost: if fit(u)? {
                u.int_in_range(0..=budget)?
            } else {
                amount(u, MAX_BUDGET_UNITS)?
            },
            min_retry_latency_ms: if fit(u)? {
                u.int_in_range(0..=1_000)?
            } else {
                amount(u, MAX_HORIZON_MS)?
            },
            write_scope: match u.int_in_range(0..=3)? {
                0 => Scope::default(),
                1 => parent.write_scope.clone(),
                2 => Scope::parse(
                    &parent
                        .write_scope
                        .prefixes()
                        .iter()
                        .map(|p| format!("{p}/sub"))
                        .collect::<Vec<_>>(),
                    "s",
                )
                .unwrap_or_default(),
                _ => scope(u)?,
            },
            factor_ppm: if fit(u)? {
                u.int_in_range(900_000..=PPM_ONE)?
            } else {
                u.int_in_range(0..=PPM_ONE)?
            },
            factor_note: "fuzz".into(),
        };
        Ok(Self {
            parent,
            ask,
            now_ms,
        })
    }
}

/// One input (the fuzz target's entry).
pub fn fuzz(input: Input) {
    run(&input);
}

fn run(input: &Input) {
    let (parent, ask, now) = (&input.parent, &input.ask, input.now_ms);
    let outcome = check_delegation(parent, ask, now);
    assert_eq!(
        outcome,
        check_delegation(parent, ask, now),
        "not deterministic"
    );
    let expected = model(parent, ask, now);
    match outcome {
        Err(refusal) => {
            note(if refusal.codes().len() == 1 {
                "refused, one code"
            } else {
                "refused"
            });
            let codes = refusal.codes();
            assert!(!codes.is_empty());
            assert!(
                codes.windows(2).all(|w| w[0] < w[1]),
                "not sorted or repeated: {codes:?}"
            );
            assert_eq!(refusal.primary(), codes[0]);
            let got: BTreeSet<C> = codes.into_iter().collect();
            assert_eq!(got, expected, "refusal differs from the model");
        }
        Ok(terms) => {
            note("issued");
            assert!(
                expected.is_empty(),
                "issued, but the model refuses {expected:?}"
            );
            assert_eq!(terms.depth, parent.depth + 1);
            let deadline = ask
                .deadline_ms
                .map_or(parent.deadline_ms, |d| d.min(parent.deadline_ms));
            assert_eq!(terms.deadline_ms, deadline);
            let trust =
                u64::from(parent.cumulative_trust_ppm) * u64::from(ask.factor_ppm) / 1_000_000;
            assert_eq!(u64::from(terms.cumulative_trust_ppm), trust);
            let text = terms.effective_predicate.as_str();
            if ask.liability == Liability::Delegate {
                assert!(!text.is_empty());
                assert!(
                    text.starts_with(parent.effective_predicate.as_str()),
                    "{text:?}"
                );
                if !ask.predicate.is_empty() {
                    assert!(text.ends_with(&format!("({}\n)", ask.predicate.as_str())));
                }
            } else {
                assert_eq!(
                    Some(&terms.effective_predicate),
                    Predicate::conjoin(&Predicate::default(), &ask.predicate).as_ref()
                );
            }
            // The reservation the store makes next always fits, and the
            // ledger balances after it.
            let mut ledger = parent.ledger;
            ledger
                .reserve(ask.budget)
                .expect("an issued child's budget fits the residual");
            assert!(ledger.is_consistent(), "{ledger:?}");
            assert_eq!(ledger.residual(), parent.ledger.residual() - ask.budget);
            assert!(ledger.open_children <= parent.policy.max_children);
        }
    }
}

/// docs/design.md §Invariants, rule by rule, in wide arithmetic.
fn model(parent: &ParentView, ask: &ChildAsk, now: i64) -> BTreeSet<C> {
    let mut out = BTreeSet::new();
    let mut rule = |broken: bool, code: C| {
        if broken {
            out.insert(code);
        }
    };
    let l = &parent.ledger;
    let residual = i128::from(l.budget) - i128::from(l.reserved) - i128::from(l.spent);
    let transfers = ask.liability == Liability::Delegate;
    let deadline = ask
        .deadline_ms
        .map_or(parent.deadline_ms, |d| d.min(parent.deadline_ms));
    let effective_empty = match Predicate::conjoin(&parent.effective_predicate, &ask.predicate) {
        Some(p) => p.is_empty(),
        None => true,
    };
    rule(
        !parent.status.is_open() || now >= parent.deadline_ms,
        C::ParentNotActive,
    );
    rule(ask.requester != parent.delegate_key, C::NotHolder);
    rule(parent.depth + 1 > parent.policy.max_depth, C::DepthExceeded);
    rule(
        ask.intent_lineage_hash != parent.intent_lineage_hash,
        C::IntentDiluted,
    );
    let trust = u64::from(parent.cumulative_trust_ppm) * u64::from(ask.factor_ppm) / 1_000_000;
    rule(
        trust < u64::from(parent.policy.min_cumulative_trust_ppm),
        C::TrustAttenuated,
    );
    rule(transfers && effective_empty, C::LiabilityWithoutPredicate);
    rule(
        transfers && ask.escalation_channel.is_empty(),
        C::LiabilityWithoutEscalation,
    );
    rule(
        transfers && parent.liability == Liability::Principal,
        C::LiabilityFromRetainingParent,
    );
    rule(ask.budget < ask.min_retry_cost, C::BelowRetryCost);
    rule(
        i128::from(deadline) - i128::from(now) < i128::from(ask.min_retry_latency_ms),
        C::BelowRetryLatency,
    );
    rule(i128::from(ask.budget) > residual, C::BudgetExceedsParent);
    rule(
        ask.deadline_ms.is_some_and(|d| d > parent.deadline_ms),
        C::DeadlineExceedsParent,
    );
    rule(
        transfers
            && parent.policy.retry_headroom
            && residual - i128::from(ask.budget) < i128::from(ask.min_retry_cost),
        C::NoRetryHeadroom,
    );
    let within = |p: &String| {
        parent.write_scope.prefixes().iter().any(|q| {
            if q == "/" {
                p.starts_with('/')
            } else {
                p == q
                    || p.strip_prefix(q.as_str())
                        .is_some_and(|r| r.starts_with('/'))
            }
        })
    };
    rule(
        !ask.write_scope.prefixes().iter().all(within),
        C::ScopeWidened,
    );
    rule(
        l.open_children >= parent.policy.max_children,
        C::FanoutExceeded,
    );
    out
}
