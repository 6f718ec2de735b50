"""Offline verification in Python of contracts, hop proofs and receipts from
the published keys alone (mirrors tests/e2e/offline.rs), and tampering."""

from __future__ import annotations

import pytest
from _support import child, liable_child

from delegation_broker import (
    Agent,
    BrokerKeys,
    VerificationError,
    lineage_hash,
    pb,
    sha256,
    verify_chain,
    verify_contract,
    verify_envelope,
    verify_signature,
)

FACTORS = [0.9, 0.75, 0.5]


@pytest.fixture(scope="module")
def three_hops(broker):
    agents = [Agent.generate() for _ in range(4)]
    root = broker.open_root(agents[0], min_trust=100_000)
    parent = root.id
    for hop in range(1, 4):
        if hop == 1:
            body = liable_child(parent, root.lineage, agents[hop], 50, "result.schema_valid")
        else:
            body = liable_child(parent, root.lineage, agents[hop], 50 >> hop, "")
        body.delegate_attestation.CopyFrom(broker.attest(agents[hop], FACTORS[hop - 1]))
        parent = broker.delegate(agents[hop - 1], body).contract().contract_id
    return root, parent


def test_a_chain_and_every_hop_proof_verify_offline(broker, three_hops):
    root, last_id = three_hops
    # Only the wire from here on: the published keys and the chain.
    keys = BrokerKeys(broker.stub.GetBrokerKeys(pb.GetBrokerKeysRequest()).keys)
    assert keys.current in keys
    chain = broker.stub.GetChain(pb.GetChainRequest(contract_id=last_id)).chain
    assert len(chain) == 4
    verified = verify_chain(chain, keys)
    assert verified[0].contract_id == root.id and verified[-1].contract_id == last_id
    for depth, v in enumerate(verified):
        assert v.contract.depth == depth
        assert v.contract.intent_lineage_hash == lineage_hash(v.contract.intent)
        cumulative = 1_000_000
        for i, proof in enumerate(v.hop_proofs):
            if i == 0:
                assert proof.trust_source == pb.TRUST_SOURCE_ROOT
            else:
                assert proof.factor_ppm == round(FACTORS[i - 1] * 1e6)
                assert proof.trust_source == pb.TRUST_SOURCE_ATTESTATION
                cumulative = cumulative * proof.factor_ppm // 1_000_000
            assert proof.cumulative_trust_ppm == cumulative, "floor(product) in ppm"
    last = verified[-1]
    assert last.contract.effective_predicate == "(result.schema_valid\n)"
    assert last.hop_proofs[3].cumulative_trust_ppm == 337_500  # 0.9 x 0.75 x 0.5


def test_list_children_pages_verify(broker, three_hops):
    root, _ = three_hops
    orchestrator_children = broker.stub.ListChildren(pb.ListChildrenRequest(contract_id=root.id)).children
    assert len(orchestrator_children) == 1
    holder = Agent.generate()
    extra_root = broker.open_root(holder, budget=1000)
    for _ in range(5):
        broker.delegate(holder, child(extra_root.id, extra_root.lineage, Agent.generate(), 1)).contract()
    seen, token = [], b""
    while True:
        page = broker.stub.ListChildren(pb.ListChildrenRequest(contract_id=extra_root.id, page_size=2, page_token=token))
        for state in page.children:
            assert verify_contract(state.contract, broker.keys, state.contract_id).contract.parent_id == extra_root.id
        seen += [s.contract_id for s in page.children]
        token = page.next_page_token
        if not token:
            break
    assert len(seen) == len(set(seen)) == 5


def test_tampered_envelopes_fail(broker, three_hops):
    _, last_id = three_hops
    state = broker.state(last_id)
    envelope = state.contract

    # Re-encoded payload with one field changed.
    tampered = pb.Envelope()
    tampered.CopyFrom(envelope)
    contract = pb.Contract.FromString(tampered.payload)
    contract.budget += 1
    tampered.payload = contract.SerializeToString()
    with pytest.raises(VerificationError):
        verify_contract(tampered, broker.keys)

    # One flipped bit in the signature.
    tampered.CopyFrom(envelope)
    sig = bytearray(tampered.signatures[0].sig)
    sig[7] ^= 0x01
    tampered.signatures[0].sig = bytes(sig)
    with pytest.raises(VerificationError):
        verify_envelope(tampered, broker.keys)

    # The same bytes claimed as another message type.
    tampered.CopyFrom(envelope)
    tampered.payload_type = "application/vnd.delegation.broker.v1.Receipt+protobuf"
    with pytest.raises(VerificationError):
        verify_envelope(tampered, broker.keys)

    # A hop proof with its cumulative trust raised.
    proof = pb.Envelope()
    proof.CopyFrom(pb.Contract.FromString(envelope.payload).hop_proofs[1])
    hop = pb.HopProof.FromString(proof.payload)
    hop.cumulative_trust_ppm = 1_000_000
    proof.payload = hop.SerializeToString()
    with pytest.raises(VerificationError):
        verify_envelope(proof, broker.keys, pb.HopProof)

    # The wrong contract id.
    with pytest.raises(VerificationError, match="SHA-256"):
        verify_contract(envelope, broker.keys, sha256(b"another"))

    # The untampered envelope still verifies.
    assert verify_contract(envelope, broker.keys, last_id).contract_id == last_id


def test_the_signing_key_must_be_the_one_the_payload_names(broker, three_hops):
    _, last_id = three_hops
    genuine = pb.Contract.FromString(broker.state(last_id).contract.payload)
    impostor = Agent.generate()
    # A forger signs a copy of a genuine contract with its own key...
    forged = impostor.sign(genuine)
    with pytest.raises(VerificationError, match="no signature verifies"):
        verify_envelope(forged, broker.keys)
    # ...and even when its key is (wrongly) published next to the broker's,
    # the payload still names the broker's key, so it is refused.
    published = list(broker.stub.GetBrokerKeys(pb.GetBrokerKeysRequest()).keys)
    published.append(pb.BrokerKey(key_id=impostor.key_id, public_key=impostor.public_key, current=False))
    with pytest.raises(VerificationError, match="names broker key"):
        verify_envelope(forged, BrokerKeys(published))
    # A published key whose id does not match is rejected outright.
    published[-1].key_id = published[0].key_id
    with pytest.raises(VerificationError, match="does not match"):
        BrokerKeys(published)


def test_agent_signed_envelopes_are_not_broker_envelopes(broker):
    agent = Agent.generate()
    attestation = broker.attest(agent, 0.5)
    assert verify_signature(attestation, broker.attestor.public_key, "application/vnd.delegation.broker.v1.Attestation+protobuf")
    with pytest.raises(VerificationError, match="not signed by the broker"):
        verify_envelope(attestation, broker.keys)


def test_envelopes_signed_before_a_key_rotation_still_verify(tmp_path):
    """`delegation-broker rotate-key` retires the signing key; GetBrokerKeys then
    publishes both, and a chain mixing old and new signatures verifies."""
    import subprocess

    from _support import Broker, broker_bin

    workdir = tmp_path / "rotating"
    before = Broker(workdir)
    orchestrator, delegate = Agent.generate(), Agent.generate()
    root = before.open_root(orchestrator)
    old_key = before.keys.current
    assert before.close() == 0

    subprocess.run([str(broker_bin()), "rotate-key", "--data-dir", str(workdir / "data")],
                   check=True, capture_output=True, timeout=60, env={"BROKER_LOG": "warn"})

    after = Broker(workdir, attestor=before.attestor)
    try:
        assert len(after.keys) == 2 and old_key in after.keys and after.keys.current != old_key
        published = after.stub.GetBrokerKeys(pb.GetBrokerKeysRequest()).keys
        assert published[0].current and not published[1].current, "current first"
        issued = after.delegate(orchestrator, child(root.id, root.lineage, delegate, 10)).contract()
        assert issued.key_id == after.keys.current
        chain = verify_chain(after.stub.GetChain(pb.GetChainRequest(contract_id=issued.contract_id)).chain, after.keys)
        assert [v.key_id for v in chain] == [old_key, after.keys.current]
        assert pb.HopProof.FromString(issued.contract.hop_proofs[0].payload).broker_key_id == old_key
        # Only the current key: the old root no longer verifies.
        only_new = BrokerKeys([k for k in published if k.current])
        with pytest.raises(VerificationError):
            verify_contract(chain[0].envelope, only_new)
    finally:
        assert after.close() == 0
