"""Python's verdict equals the Rust `delegation-broker verify` verdict on the
very same bytes: whole chains the broker issued (genuine and tampered, every
contract's terms printed alike), chains forged under a test key with each
term of "Verifying a chain" broken on its own, broker-signed receipts (a
Sealed) and agent-signed DSSE envelopes (attestations, requests)."""

from __future__ import annotations

import pytest
from _support import (
    SYNTHETIC_EFFECTIVE,
    SYNTHETIC_VIOLATIONS,
    child,
    forge_chain,
    liable_child,
    rust_chain,
    rust_chain_lines,
    rust_envelope,
    rust_receipt,
    synthetic_chain,
)

from delegation_broker import (
    Agent,
    BrokerKeys,
    VerificationError,
    key_id,
    now_ms,
    pb,
    verify_chain,
    verify_every_signature,
    verify_receipt,
    verify_signature,
)

L = 2**252 + 27742317777372353535851937790883648493  # order of the ed25519 base point


def keys_of(public_keys: list[bytes]) -> BrokerKeys:
    return BrokerKeys(pb.BrokerKey(key_id=key_id(k), public_key=k) for k in public_keys)


def chain_verdict(tmp_path, chain, public_keys, contract_id=None, all_signatures=False) -> bool:
    """Python's and Rust's verdicts on a chain; they must agree, and on
    success print the same terms for every contract."""
    try:
        python = verify_chain(chain, keys_of(public_keys), contract_id)
        if all_signatures:
            verify_every_signature(chain, keys_of(public_keys))
    except VerificationError:
        python = None
    rust = rust_chain(tmp_path / "chain.bin", chain, public_keys, contract_id, all_signatures)
    assert (python is None) == (rust is None), f"python {python is not None}, rust {rust is not None}"
    if python is None:
        return False
    expected = rust_chain_lines(python)
    if all_signatures:
        expected[-1] += ", every signature checked"
    assert rust == expected
    return True


def receipt_verdict(tmp_path, sealed: pb.Sealed, public_keys) -> bool:
    """Python's and Rust's verdicts on a Sealed receipt; they must agree."""
    try:
        verified = verify_receipt(sealed, keys_of(public_keys))
        python = (f"ok receipt {verified.id.hex()} kind={pb.ReceiptKind.Name(verified.message.kind)} "
                  f"contract={verified.message.contract_id.hex()}")
    except VerificationError:
        python = None
    rust = rust_receipt(tmp_path / "receipt.bin", sealed, public_keys)
    assert python == rust
    return python is not None


def copy(message):
    out = type(message)()
    out.CopyFrom(message)
    return out


def _with_signature(sealed: pb.Sealed, signature: bytes) -> pb.Sealed:
    out = copy(sealed)
    out.signature = signature
    return out


def sealed_tamperings(sealed: pb.Sealed):
    """(name, Sealed) variants of a broker-signed Sealed; the first is the genuine one."""
    yield "genuine", copy(sealed)
    payload = bytearray(sealed.payload)
    payload[len(payload) // 2] ^= 0x01
    yield "payload bit flip", pb.Sealed(payload=bytes(payload), signature=sealed.signature)
    yield "payload extended", pb.Sealed(payload=sealed.payload + b"\x00", signature=sealed.signature)
    signature = bytearray(sealed.signature)
    signature[40] ^= 0x80
    yield "signature bit flip", _with_signature(sealed, bytes(signature))
    s = int.from_bytes(sealed.signature[32:], "little") + L  # the same signature, non-canonical S
    yield "non-canonical S", _with_signature(sealed, sealed.signature[:32] + s.to_bytes(32, "little"))
    yield "empty signature", _with_signature(sealed, b"")
    yield "signature extended", _with_signature(sealed, sealed.signature + b"\x00")
    yield "signature truncated", _with_signature(sealed, sealed.signature[:63])


@pytest.fixture(scope="module")
def issued(broker):
    """A tree: orchestrator → planner (liable, attested 0.9) → executor
    (liable, attested 0.8, a narrower scope) → reviewer (attested 0.9); a
    refusal and an acceptance receipt; the attestation and the request the
    agents signed; another tree's chain of the same depth, for splicing."""
    orchestrator, planner, executor, reviewer = (Agent.generate() for _ in range(4))
    root = broker.open_root(orchestrator, min_trust=500_000, predicate="result.schema_valid")
    attestation = broker.attest(planner, 0.9)
    request = orchestrator.delegate(liable_child(root.id, root.lineage, planner, 40, "result.ok", min_retry_cost=5,
                                                 delegate_attestation=attestation))
    planner_id = broker.check_outcome(broker.stub.Delegate(request)).contract().contract_id
    executor_id = broker.delegate(planner, liable_child(
        planner_id, root.lineage, executor, 20, "", write_scope=["src/auth"],
        delegate_attestation=broker.attest(executor, 0.8))).contract().contract_id
    leaf_id = broker.delegate(executor, child(executor_id, root.lineage, reviewer, 5, write_scope=["src/auth/a.rs"],
                                              delegate_attestation=broker.attest(reviewer, 0.9))).contract().contract_id
    refusal = broker.delegate(planner, child(planner_id, root.lineage, Agent.generate(), 5,
                                             delegate_attestation=broker.attest(Agent.generate(), 0.3)))
    assert refusal.receipt().primary == pb.INVARIANT_CODE_TRUST_ATTENUATED
    accepted = broker.stub.Accept(planner.accept(contract_id=planner_id), timeout=10)
    broker.check_receipt(accepted, kind=pb.RECEIPT_KIND_ACCEPTED)
    agents = [Agent.generate() for _ in range(4)]
    other_root = broker.open_root(agents[0])
    other_leaf = other_root.id
    for hop in range(1, 4):
        other_leaf = broker.delegate(agents[hop - 1], child(other_leaf, other_root.lineage, agents[hop],
                                                            10 - hop)).contract().contract_id
    return dict(
        chain=list(broker.stub.GetChain(pb.GetChainRequest(contract_id=leaf_id)).chain),
        other=list(broker.stub.GetChain(pb.GetChainRequest(contract_id=other_leaf)).chain),
        refusal=refusal.response.refused.receipt,
        accepted=accepted.receipt,
        attestation=attestation,
        request=request.signed,
        orchestrator=orchestrator,
    )


def test_python_and_rust_agree_on_a_chain_and_every_tampering(tmp_path, broker, issued):
    chain, other = issued["chain"], issued["other"]
    keys = [broker.keys[k] for k in broker.keys]
    genuine = [state.contract for state in chain]
    leaf_id = chain[-1].contract_id
    verdict = lambda contracts, **kw: chain_verdict(tmp_path, contracts, kw.pop("public_keys", keys), **kw)  # noqa: E731

    assert verdict(chain)
    assert verdict(chain, contract_id=leaf_id, all_signatures=True)
    assert verdict(chain[:2], contract_id=chain[1].contract_id), "a prefix is the chain of its last contract"
    effective = verify_chain(chain, broker.keys)
    assert [v.effective_predicate for v in effective] == [state.effective_predicate for state in chain] == [
        "(result.schema_valid\n)", "(result.schema_valid\n) && (result.ok\n)",
        "(result.schema_valid\n) && (result.ok\n)", ""]
    assert [v.contract.cumulative_trust_ppm for v in effective] == [1_000_000, 900_000, 720_000, 648_000]

    # A changed budget of any contract, ancestors and leaf.
    for i in range(len(genuine)):
        tampered = [copy(s) for s in genuine]
        contract = pb.Contract.FromString(tampered[i].payload)
        contract.budget += 1
        tampered[i].payload = contract.SerializeToString()
        assert not verdict(tampered), f"budget of contract {i}"
    # The leaf's Sealed tampered with (its signature is the one checked).
    for name, variant in sealed_tamperings(genuine[-1]):
        assert verdict(genuine[:-1] + [variant]) == (name == "genuine"), name
    # An ancestor's signature flipped: the chain still proves every term, but
    # not every signature verifies.
    tampered = list(genuine)
    tampered[1] = dict(sealed_tamperings(genuine[1]))["signature bit flip"]
    assert verdict(tampered)
    assert not verdict(tampered, all_signatures=True)
    # Swapped, cut, spliced, repeated, too long.
    for a, b in [(0, 1), (1, 2), (2, 3)]:
        swapped = list(genuine)
        swapped[a], swapped[b] = swapped[b], swapped[a]
        assert not verdict(swapped), f"swapped {a} and {b}"
    assert not verdict(genuine[1:]), "no root"
    assert not verdict(genuine[:2] + genuine[3:]), "missing middle"
    for i in range(len(genuine)):
        spliced = list(genuine)
        spliced[i] = other[i].contract
        assert not verdict(spliced), f"spliced at {i}"
    assert verdict(other)
    assert not verdict(genuine[:1] + genuine), "the root twice"
    assert not verdict(genuine * 17), "more than 65 contracts"
    # Not the contract asked for; a stranger's key; a receipt as a contract.
    assert not verdict(chain, contract_id=chain[2].contract_id)
    assert not verdict(chain, public_keys=[Agent.generate().public_key])
    assert not verdict([issued["accepted"]]), "a receipt is not a contract"


def test_python_and_rust_agree_on_every_term_of_forged_chains(tmp_path):
    """Chains forged under a test key (its public key given to both
    verifiers), re-linked and re-signed after each change: the term checks
    alone decide, and they decide alike."""
    signer = Agent.generate()
    keys = [signer.public_key]
    genuine = forge_chain(signer, synthetic_chain())
    assert chain_verdict(tmp_path, genuine, keys, all_signatures=True)
    assert [v.effective_predicate for v in verify_chain(genuine, keys_of(keys))] == SYNTHETIC_EFFECTIVE
    for name, _, breaks in SYNTHETIC_VIOLATIONS:
        assert not chain_verdict(tmp_path, forge_chain(signer, breaks(synthetic_chain())), keys), name
    assert not chain_verdict(tmp_path, forge_chain(signer, synthetic_chain(), link=False), keys), "unlinked"
    # "/" covers every absolute path, and only those.
    contracts = synthetic_chain()[:2]
    contracts[0].ClearField("write_scope")
    contracts[0].write_scope.append("/")
    contracts[1].ClearField("write_scope")
    contracts[1].write_scope.extend(["/etc", "/"])
    assert chain_verdict(tmp_path, forge_chain(signer, contracts), keys)
    contracts[1].write_scope.append("etc")
    assert not chain_verdict(tmp_path, forge_chain(signer, contracts), keys)


def test_a_root_scope_of_slash_covers_absolute_paths(tmp_path, broker):
    """The broker issues "/etc" under "/" ("/" alone means every absolute
    path); both verifiers accept the chain, though a literal reading of
    types.proto's scope sentence ("equal to it or continues with "/" after
    it") would not."""
    orchestrator, worker = Agent.generate(), Agent.generate()
    root = broker.open_root(orchestrator, scope=("/",))
    leaf = broker.delegate(orchestrator, child(root.id, root.lineage, worker, 5, write_scope=["/etc"])).contract()
    chain = list(broker.stub.GetChain(pb.GetChainRequest(contract_id=leaf.contract_id)).chain)
    assert [list(v.contract.write_scope) for v in broker.chain(leaf.contract_id)] == [["/"], ["/etc"]]
    assert chain_verdict(tmp_path, chain, [broker.keys[k] for k in broker.keys], leaf.contract_id)
    refused = broker.delegate(worker, child(leaf.contract_id, root.lineage, Agent.generate(), 1, write_scope=["/"]))
    assert refused.receipt().primary == pb.INVARIANT_CODE_SCOPE_WIDENED


def test_python_and_rust_agree_on_every_receipt_tampering(tmp_path, broker, issued):
    keys = [broker.keys[k] for k in broker.keys]
    for label in ("refusal", "accepted"):
        for name, variant in sealed_tamperings(issued[label]):
            assert receipt_verdict(tmp_path, variant, keys) == (name == "genuine"), f"{label} / {name}"
        # With a key that did not sign it; as the other type.
        assert not receipt_verdict(tmp_path, issued[label], [Agent.generate().public_key]), label
    for state in issued["chain"]:
        assert not receipt_verdict(tmp_path, state.contract, keys), "a contract is not a receipt"


def envelope_tamperings(envelope: pb.Envelope):
    """(name, envelope) variants of an agent-signed DSSE envelope; the first is the genuine one."""
    yield "genuine", copy(envelope)
    e = copy(envelope)
    payload = bytearray(e.payload)
    payload[len(payload) // 2] ^= 0x01
    e.payload = bytes(payload)
    yield "payload bit flip", e
    e = copy(envelope)
    e.payload = e.payload + b"\x00"
    yield "payload extended", e
    e = copy(envelope)
    sig = bytearray(e.signatures[0].sig)
    sig[40] ^= 0x80
    e.signatures[0].sig = bytes(sig)
    yield "signature bit flip", e
    e = copy(envelope)
    sig = e.signatures[0].sig
    s = int.from_bytes(sig[32:], "little") + L  # same signature, non-canonical S
    e.signatures[0].sig = sig[:32] + s.to_bytes(32, "little")
    yield "non-canonical S", e
    e = copy(envelope)
    e.payload_type = e.payload_type.replace("+protobuf", "+json")
    yield "other payload type (unknown)", e
    e = copy(envelope)
    other = "DelegateBody" if "DelegateBody" not in e.payload_type else "Attestation"
    e.payload_type = f"application/vnd.delegation.broker.v1.{other}+protobuf"
    yield "other payload type (known)", e
    e = copy(envelope)
    del e.signatures[:]
    yield "no signature", e
    e = copy(envelope)
    e.signatures.insert(0, pb.Signature(keyid="ed25519:bogus", sig=b"\x01" * 64))
    yield "bogus signature before the genuine one", e
    e = copy(envelope)
    e.signatures[0].keyid = "ed25519:" + "00" * 16
    yield "wrong keyid hint (unauthenticated)", e
    e = copy(envelope)
    for _ in range(4):
        e.signatures.add(keyid="x", sig=b"\x02" * 64)
    yield "five signatures", e


def test_python_and_rust_agree_on_every_agent_envelope(tmp_path, broker, issued):
    samples = [
        ("attestation", issued["attestation"], broker.attestor.public_key),
        ("delegate request", issued["request"], issued["orchestrator"].public_key),
    ]
    checked = 0
    for label, envelope, public_key in samples:
        for name, variant in envelope_tamperings(envelope):
            rust = rust_envelope(tmp_path / "envelope.bin", variant, public_key)
            python = verify_signature(variant, public_key)
            assert python == rust, f"{label} / {name}: python {python}, rust {rust}"
            if name == "genuine":
                assert rust, f"{label}: the genuine envelope must verify"
            elif name not in ("bogus signature before the genuine one", "wrong keyid hint (unauthenticated)"):
                assert not rust, f"{label} / {name} must not verify"
            checked += 1
        # And with a key that did not sign it.
        stranger = Agent.generate().public_key
        assert rust_envelope(tmp_path / "envelope.bin", envelope, stranger) is False
        assert verify_signature(envelope, stranger) is False
    assert checked == len(samples) * 11


def test_rust_verifies_python_signed_envelopes(tmp_path):
    agent = Agent.generate()
    for message in (
        pb.Attestation(agent_public_key=agent.public_key, factor=0.5, expires_at_ms=now_ms()),
        pb.DelegateBody(header=agent.header(), task="ü — non-ASCII task", budget=7),
        pb.OpenRootBody(header=agent.header(), intent="x" * 70_000, budget=1),  # multi-byte length in PAE
    ):
        envelope = agent.sign(message)
        assert rust_envelope(tmp_path / "envelope.bin", envelope, agent.public_key)
        assert verify_signature(envelope, agent.public_key)
