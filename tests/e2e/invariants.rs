//! Each of the fifteen invariant codes, produced over gRPC, each refusal
//! verified with the published key and fetched again.

use std::collections::BTreeSet;

use broker_client::Agent;
use delegation_broker::pb::{self, InvariantCode as Code};

use crate::harness::*;

struct Case {
    broker: Broker,
    orchestrator: Agent,
    delegate: Agent,
    root: Root,
    seen: BTreeSet<i32>,
}

impl Case {
    async fn new(spec: RootSpec) -> Self {
        let mut broker = Broker::start().await;
        let orchestrator = Agent::generate();
        let root = broker.open_root(&orchestrator, spec).await;
        Self {
            broker,
            orchestrator,
            delegate: Agent::generate(),
            root,
            seen: BTreeSet::new(),
        }
    }

    /// Sends `body` signed by `signer` and expects exactly `expected`.
    async fn expect(&mut self, signer: &Agent, body: pb::DelegateBody, expected: &[Code]) {
        let before = self.broker.ledger(&body.parent_id).await;
        let receipt = self.broker.refuse_verified(signer, body.clone()).await;
        assert_eq!(codes(&receipt), expected);
        assert_eq!(receipt.primary, expected[0] as i32);
        assert_eq!(receipt.requester_public_key, signer.public_key().to_vec());
        for v in &receipt.violations {
            assert!(
                !v.detail.is_empty() && !v.requested.is_empty() && !v.allowed.is_empty(),
                "{v:?}"
            );
        }
        assert_eq!(
            self.broker.ledger(&body.parent_id).await,
            before,
            "a refusal changes no ledger"
        );
        self.seen.extend(expected.iter().map(|c| *c as i32));
    }

    fn body(&self, budget: i64) -> pb::DelegateBody {
        self.root.child(&self.delegate, budget)
    }
}

#[tokio::test]
async fn every_invariant_code_is_refused_with_a_verifiable_receipt() {
    let mut case = Case::new(RootSpec::with(|s| {
        (s.budget, s.max_depth, s.max_children) = (100, 1, 2)
    }))
    .await;
    let orchestrator = Agent::from_seed(case.orchestrator.seed());

    // 2. Signed by someone who does not hold the parent: not a refusal
    // receipt but PERMISSION_DENIED, so strangers store nothing in the tree.
    // 4. A lineage hash that is not the root's.
    let mut body = case.body(10);
    body.intent_lineage_hash = vec![0; 32];
    case.expect(&orchestrator, body, &[Code::IntentDiluted])
        .await;
    // 6 + 7. Liable child without predicate or escalation channel.
    let mut body = case.body(10);
    body.liability = pb::Liability::Delegate as i32;
    case.expect(
        &orchestrator,
        body,
        &[
            Code::LiabilityWithoutPredicate,
            Code::LiabilityWithoutEscalation,
        ],
    )
    .await;
    // 9. Budget below one retry.
    let mut body = case.body(5);
    body.min_retry_cost = 10;
    case.expect(&orchestrator, body, &[Code::BelowRetryCost])
        .await;
    // 10. Not enough time left for one retry.
    let mut body = case.body(10);
    body.deadline_ms = now_ms() + 10_000;
    body.min_retry_latency_ms = 60_000;
    case.expect(&orchestrator, body, &[Code::BelowRetryLatency])
        .await;
    // 11. More than the parent's residual.
    let body = case.body(101);
    case.expect(&orchestrator, body, &[Code::BudgetExceedsParent])
        .await;
    // 12. A later deadline than the parent's.
    let mut body = case.body(10);
    body.deadline_ms = case.root.contract.deadline_ms + 1_000;
    case.expect(&orchestrator, body, &[Code::DeadlineExceedsParent])
        .await;
    // 13. A liable child that leaves the principal no retry.
    let mut body = case
        .root
        .liable_child(&case.delegate, 95, "result.schema_valid");
    body.min_retry_cost = 10;
    case.expect(&orchestrator, body, &[Code::NoRetryHeadroom])
        .await;
    // 14. Writing outside the parent's scope.
    let mut body = case.body(10);
    body.write_scope = vec!["src/auth".into(), "/etc".into()];
    case.expect(&orchestrator, body, &[Code::ScopeWidened])
        .await;

    // 3 and 8 need a child: a liability-retaining child at max depth.
    let delegate = Agent::from_seed(case.delegate.seed());
    let child_id = case.broker.issue(&orchestrator, case.body(10)).await;
    let grandchild = Agent::generate();
    let mut body = liable_child(
        &child_id,
        &case.root.lineage,
        &grandchild,
        5,
        "result.schema_valid",
    );
    body.write_scope = vec![];
    case.expect(
        &delegate,
        body,
        &[Code::DepthExceeded, Code::LiabilityFromRetainingParent],
    )
    .await;
    // 15. max_children is 2: one more child is fine, the third is refused.
    case.broker.issue(&orchestrator, case.body(10)).await;
    let body = case.body(10);
    case.expect(&orchestrator, body, &[Code::FanoutExceeded])
        .await;

    // 5. A policy with a trust floor and a delegate nobody vouches for.
    let mut trust = Case::new(RootSpec::with(|s| s.min_trust = 1)).await;
    let orchestrator2 = Agent::from_seed(trust.orchestrator.seed());
    let body = trust.body(10);
    trust
        .expect(&orchestrator2, body, &[Code::TrustAttenuated])
        .await;
    case.seen.extend(trust.seen.iter());

    // 1. The parent's deadline has passed (the broker's clock moves on).
    let mut late = Case::new(RootSpec::default()).await;
    let orchestrator3 = Agent::from_seed(late.orchestrator.seed());
    late.broker.clock.advance_ms(2 * HOUR_MS);
    let mut body = late.body(10);
    body.header = Some(header_at(&orchestrator3, now_ms() + 2 * HOUR_MS));
    // No time is left either, so the retry-latency invariant fails too.
    late.expect(
        &orchestrator3,
        body,
        &[Code::ParentNotActive, Code::BelowRetryLatency],
    )
    .await;
    case.seen.extend(late.seen.iter());

    // NOT_HOLDER (2) is answered before any receipt is stored.
    let all: BTreeSet<i32> = (1..=15).filter(|&c| c != Code::NotHolder as i32).collect();
    assert_eq!(case.seen, all, "every code that is a refusal is produced");
    for c in [case.broker, trust.broker, late.broker] {
        c.stop().await;
    }
}
