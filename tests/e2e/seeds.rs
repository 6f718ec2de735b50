//! The observed failures of seed 001 and seed 002, replayed.

use broker_client::Agent;
use delegation_broker::pb::InvariantCode as Code;

use crate::harness::*;

const SEED_001_PREDICATE: &str = "result.schema_valid && result.within_scope";

/// seed 001: orchestrator → planner (25) → executor (20, liable) leaves the
/// planner 5 < 12 units to retry: refused at contract time.
#[tokio::test]
async fn seed_001_executor_without_retry_headroom_is_refused_then_13_is_issued() {
    let (mut broker, orchestrator, root) =
        Broker::start_with_root_of(RootSpec::with(|s| s.budget = 100)).await;
    let [planner, executor] = agents();

    let mut to_planner = root.liable_child(&planner, 25, SEED_001_PREDICATE);
    to_planner.min_retry_cost = 12;
    to_planner.deadline_ms = now_ms() + 90_000;
    let planner_id = broker.issue(&orchestrator, to_planner).await;
    assert_eq!(
        broker.effective_predicate(&planner_id).await,
        format!("({SEED_001_PREDICATE}\n)")
    );

    // The planner does not forward the predicate; the broker keeps it anyway.
    let mut to_executor = liable_child(&planner_id, &root.lineage, &executor, 20, "");
    to_executor.min_retry_cost = 12;
    to_executor.deadline_ms = now_ms() + 60_000;
    let receipt = broker.refuse_verified(&planner, to_executor.clone()).await;
    assert_eq!(codes(&receipt), vec![Code::NoRetryHeadroom]);
    assert_eq!(receipt.primary, Code::NoRetryHeadroom as i32);
    assert_eq!(requested_and_allowed(&receipt), ("5", "12"));
    assert_eq!(receipt.contract_id, planner_id);
    assert_eq!(
        broker.ledger(&planner_id).await.reserved,
        0,
        "a refusal reserves nothing"
    );

    to_executor.budget = 13;
    let (executor_id, executor_contract) = broker
        .delegate(&planner, to_executor)
        .await
        .unwrap()
        .issued();
    assert_eq!(executor_contract.depth, 2);
    assert_eq!(
        broker.effective_predicate(&executor_id).await,
        format!("({SEED_001_PREDICATE}\n)")
    );
    assert_eq!(executor_contract.predicate, "");
    let planner_ledger = broker.ledger(&planner_id).await;
    assert_eq!((planner_ledger.residual, planner_ledger.reserved), (12, 13));
    assert_eq!(broker.ledger(&executor_id).await.residual, 13);
    broker.assert_ledgers_balance(&root.id).await;
    broker.stop().await;
}

/// The bounds the first violation names: what was asked, what was allowed.
fn requested_and_allowed(receipt: &delegation_broker::pb::Receipt) -> (&str, &str) {
    let violation = &receipt.violations[0];
    (&violation.requested, &violation.allowed)
}

/// seed 001's `bad` contract: liability DELEGATE with neither predicate nor
/// escalation channel → one refusal listing both.
#[tokio::test]
async fn seed_001_bad_contract_is_refused_for_both_missing_capabilities() {
    let (mut broker, orchestrator, root) = Broker::start_with_root().await;
    let delegate = Agent::generate();
    let mut bad = root.child(&delegate, 20);
    bad.liability = delegation_broker::pb::Liability::Delegate as i32;
    bad.min_retry_cost = 12;
    bad.min_retry_latency_ms = 15_000;
    bad.deadline_ms = now_ms() + 60_000;
    let receipt = broker.refuse_verified(&orchestrator, bad).await;
    assert_eq!(
        codes(&receipt),
        vec![
            Code::LiabilityWithoutPredicate,
            Code::LiabilityWithoutEscalation
        ]
    );
    assert_eq!(receipt.primary, Code::LiabilityWithoutPredicate as i32);
    broker.stop().await;
}

/// Seed 002's start: a broker, `n` agents, and a root the first opened
/// with `spec`.
async fn seed_002_chain_start(n: usize, spec: RootSpec) -> (Broker, Vec<Agent>, Root) {
    let mut broker = Broker::start().await;
    let agents: Vec<Agent> = (0..n).map(|_| Agent::generate()).collect();
    let root = broker.open_root(&agents[0], spec).await;
    (broker, agents, root)
}

/// seed 002 gate 1: with max_depth 4 the fifth hop is refused.
#[tokio::test]
async fn seed_002_fifth_hop_exceeds_depth_four() {
    let (mut broker, agents, root) =
        seed_002_chain_start(6, RootSpec::with(|s| s.max_depth = 4)).await;
    let mut parent = root.id.clone();
    for hop in 1..=4 {
        let (id, contract) = broker
            .delegate(
                &agents[hop - 1],
                child(&parent, &root.lineage, &agents[hop], 10),
            )
            .await
            .unwrap()
            .issued();
        assert_eq!(contract.depth as usize, hop);
        // Only its own hop: the format does not grow with depth.
        assert_eq!(contract.parent_id, parent);
        parent = id;
    }
    let receipt = broker
        .refuse_verified(&agents[4], child(&parent, &root.lineage, &agents[5], 5))
        .await;
    assert_eq!(codes(&receipt), vec![Code::DepthExceeded]);
    assert_eq!(requested_and_allowed(&receipt), ("5", "4"));
    broker.stop().await;
}

/// seed 002 gate 3: attested factors 0.9, 0.8, 0.5 against a minimum of 0.4
/// → the third hop (cumulative 0.36) is refused.
#[tokio::test]
async fn seed_002_third_hop_attenuates_trust_below_the_minimum() {
    let (mut broker, agents, root) =
        seed_002_chain_start(4, RootSpec::with(|s| s.min_trust = 400_000)).await;
    let mut parent = root.id.clone();
    for (hop, factor, cumulative) in [(1, 0.9, 900_000), (2, 0.8, 720_000)] {
        let mut body = child(&parent, &root.lineage, &agents[hop], 10);
        body.delegate_attestation = Some(broker.attest(&agents[hop], factor));
        let (id, contract) = broker
            .delegate(&agents[hop - 1], body)
            .await
            .unwrap()
            .issued();
        assert_eq!(contract.cumulative_trust_ppm, cumulative);
        assert_eq!(
            contract.trust_source,
            delegation_broker::pb::TrustSource::Attestation as i32
        );
        parent = id;
    }
    let mut body = child(&parent, &root.lineage, &agents[3], 5);
    body.delegate_attestation = Some(broker.attest(&agents[3], 0.5));
    let receipt = broker.refuse_verified(&agents[2], body).await;
    assert_eq!(codes(&receipt), vec![Code::TrustAttenuated]);
    assert_eq!(requested_and_allowed(&receipt), ("360000", "400000"));
    broker.stop().await;
}

/// seed 002 gate 2: a paraphrased intent (another lineage hash) is refused.
#[tokio::test]
async fn seed_002_diluted_intent_is_refused() {
    let (mut broker, orchestrator, root) = Broker::start_with_root().await;
    let delegate = Agent::generate();
    let paraphrase = delegation_broker::crypto::sha256(b"Improve auth somehow");
    let receipt = broker
        .refuse_verified(&orchestrator, child(&root.id, &paraphrase, &delegate, 10))
        .await;
    assert_eq!(codes(&receipt), vec![Code::IntentDiluted]);
    broker.stop().await;
}

/// seed 000: the host metered 4 units, the delegate reports 11. The
/// charge is the host's 4; the 7 nobody observed stay on the completion
/// as `claimed_excess` for the principal to see, and `tree` shows them.
#[tokio::test]
async fn seed_000_a_claim_beyond_the_metering_is_shown_not_charged() {
    let (mut broker, orchestrator, root) = Broker::start_with_root().await;
    let [worker, host] = agents();
    let id = broker.issue(&orchestrator, root.child(&worker, 20)).await;
    broker.accept(&worker, &id, Some(&host)).await.unwrap();
    broker.observe(&host, &id, tool_call("search", 4)).await;
    let completion = broker
        .completion(&worker, complete_body(&id, "{}", "done", 11))
        .await;
    assert_eq!((completion.consumed, completion.claimed_excess), (4, 7));
    assert_eq!(
        broker.ledger(&id).await.spent,
        4,
        "only the metering is charged"
    );
    let data = delegation_broker::cli::tree::fetch(
        &mut broker.client,
        &root.id,
        delegation_broker::cli::tree::DEFAULT_TREE_CONTRACTS,
    )
    .await
    .expect("the tree reads");
    let drawn = delegation_broker::cli::tree::render(&data, &Default::default());
    assert!(
        drawn.contains("consumed 4, returned 16, claimed excess 7"),
        "{drawn}"
    );
    broker.stop().await;
}
