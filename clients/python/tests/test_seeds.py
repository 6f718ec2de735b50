"""The observed failures of seed 001 and seed 002, replayed from Python
(mirrors tests/e2e/seeds.rs). Every request is signed in Python and every
contract and receipt received is verified offline in Python (see
_support.Broker)."""

from __future__ import annotations

from _support import child, codes, liable_child

from delegation_broker import Agent, now_ms, pb, sha256

SEED_001_PREDICATE = "result.schema_valid && result.within_scope"


def test_seed_001_executor_without_retry_headroom_is_refused_then_13_is_issued(broker):
    orchestrator, planner, executor = Agent.generate(), Agent.generate(), Agent.generate()
    root = broker.open_root(orchestrator, budget=100)

    to_planner = liable_child(root.id, root.lineage, planner, 25, SEED_001_PREDICATE,
                              min_retry_cost=12, deadline_ms=now_ms() + 90_000)
    planner_issued = broker.delegate(orchestrator, to_planner).contract()
    planner_id = planner_issued.contract_id
    assert broker.chain(planner_id)[-1].effective_predicate == f"({SEED_001_PREDICATE}\n)"
    assert planner_issued.contract.liability == pb.LIABILITY_DELEGATE
    assert planner_issued.contract.predicate == SEED_001_PREDICATE

    # The planner does not forward the predicate; the broker keeps it anyway.
    to_executor = liable_child(planner_id, root.lineage, executor, 20, "",
                               min_retry_cost=12, deadline_ms=now_ms() + 60_000)
    refused = broker.delegate(planner, to_executor)
    receipt = refused.receipt()
    assert codes(receipt) == [pb.INVARIANT_CODE_NO_RETRY_HEADROOM]
    assert receipt.primary == pb.INVARIANT_CODE_NO_RETRY_HEADROOM
    assert (receipt.violations[0].requested, receipt.violations[0].allowed) == ("5", "12")
    assert receipt.contract_id == planner_id
    assert receipt.root_id == root.id
    assert receipt.requester_public_key == planner.public_key
    assert broker.ledger(planner_id).reserved == 0, "a refusal reserves nothing"

    to_executor.budget = 13
    executor_issued = broker.delegate(planner, to_executor).contract()
    executor_contract = executor_issued.contract
    assert executor_contract.depth == 2
    # Derived from the chain (and the broker's copy says the same).
    chain = broker.chain(executor_issued.contract_id)
    assert chain[-1].effective_predicate == f"({SEED_001_PREDICATE}\n)"
    assert broker.state(executor_issued.contract_id).effective_predicate == f"({SEED_001_PREDICATE}\n)"
    assert chain[-1].principal_public_key == planner.public_key
    assert executor_contract.predicate == ""
    assert executor_contract.min_retry_cost == 12
    planner_ledger = broker.ledger(planner_id)
    assert (planner_ledger.residual, planner_ledger.reserved, planner_ledger.open_children) == (12, 13, 1)
    assert broker.ledger(executor_issued.contract_id).residual == 13
    assert broker.ledger(root.id).reserved == 25


def test_seed_001_bad_contract_is_refused_for_both_missing_capabilities(broker):
    orchestrator, delegate = Agent.generate(), Agent.generate()
    root = broker.open_root(orchestrator)
    bad = child(root.id, root.lineage, delegate, 20, liability=pb.LIABILITY_DELEGATE, min_retry_cost=12,
                min_retry_latency_ms=15_000, deadline_ms=now_ms() + 60_000)
    receipt = broker.delegate(orchestrator, bad).receipt()
    assert codes(receipt) == [pb.INVARIANT_CODE_LIABILITY_WITHOUT_PREDICATE, pb.INVARIANT_CODE_LIABILITY_WITHOUT_ESCALATION]
    assert receipt.primary == pb.INVARIANT_CODE_LIABILITY_WITHOUT_PREDICATE


def test_seed_002_fifth_hop_exceeds_depth_four(broker):
    agents = [Agent.generate() for _ in range(6)]
    root = broker.open_root(agents[0], max_depth=4)
    parent = root.id
    for hop in range(1, 5):
        issued = broker.delegate(agents[hop - 1], child(parent, root.lineage, agents[hop], 10)).contract()
        assert issued.contract.depth == hop
        assert len(broker.chain(issued.contract_id)) == hop + 1
        parent = issued.contract_id
    refused = broker.delegate(agents[4], child(parent, root.lineage, agents[5], 5))
    receipt = refused.receipt()
    assert codes(receipt) == [pb.INVARIANT_CODE_DEPTH_EXCEEDED]
    assert (receipt.violations[0].requested, receipt.violations[0].allowed) == ("5", "4")
    assert receipt.contract_id == parent


def test_seed_002_third_hop_attenuates_trust_below_the_minimum(broker):
    agents = [Agent.generate() for _ in range(4)]
    root = broker.open_root(agents[0], min_trust=400_000)
    parent = root.id
    for hop, factor, cumulative in [(1, 0.9, 900_000), (2, 0.8, 720_000)]:
        body = child(parent, root.lineage, agents[hop], 10, delegate_attestation=broker.attest(agents[hop], factor))
        issued = broker.delegate(agents[hop - 1], body).contract()
        hop_terms = issued.contract  # each hop's trust evidence is in its own contract
        assert hop_terms.cumulative_trust_ppm == cumulative
        assert hop_terms.factor_ppm == round(factor * 1_000_000)
        assert hop_terms.trust_source == pb.TRUST_SOURCE_ATTESTATION
        assert hop_terms.risk_class == "test"
        assert hop_terms.attestation_digest == sha256(body.delegate_attestation.payload)
        assert [v.contract.cumulative_trust_ppm for v in broker.chain(issued.contract_id)][-1] == cumulative
        parent = issued.contract_id
    body = child(parent, root.lineage, agents[3], 5, delegate_attestation=broker.attest(agents[3], 0.5))
    receipt = broker.delegate(agents[2], body).receipt()
    assert codes(receipt) == [pb.INVARIANT_CODE_TRUST_ATTENUATED]
    assert (receipt.violations[0].requested, receipt.violations[0].allowed) == ("360000", "400000")


def test_seed_002_diluted_intent_is_refused(broker):
    orchestrator, delegate = Agent.generate(), Agent.generate()
    root = broker.open_root(orchestrator)
    paraphrase = sha256(b"Improve auth somehow")
    receipt = broker.delegate(orchestrator, child(root.id, paraphrase, delegate, 10)).receipt()
    assert codes(receipt) == [pb.INVARIANT_CODE_INTENT_DILUTED]


def test_an_attestation_signed_by_an_untrusted_key_counts_as_factor_zero(broker):
    orchestrator, delegate = Agent.generate(), Agent.generate()
    root = broker.open_root(orchestrator, min_trust=1)
    forged = Agent.generate().attest(delegate.public_key, 1.0, now_ms() + 60_000, "forged")
    body = child(root.id, root.lineage, delegate, 10, delegate_attestation=forged)
    receipt = broker.delegate(orchestrator, body).receipt()
    assert codes(receipt) == [pb.INVARIANT_CODE_TRUST_ATTENUATED]
