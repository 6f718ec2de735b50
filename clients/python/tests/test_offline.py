"""Offline verification of whole chains from GetBrokerKeys and GetChain alone
(mirrors tests/e2e/offline.rs): types.proto's "Verifying a chain" written out
step by step below with nothing but ed25519 (PyNaCl), SHA-256 and the
generated message types — as a client in another language would — then every
tampering it must reject. The library's ``verify_chain`` is held to the same
verdicts; each term of the procedure is also broken on its own, in chains
forged under a test key."""

from __future__ import annotations

import hashlib

import pytest
from _support import (
    SYNTHETIC_EFFECTIVE,
    SYNTHETIC_VIOLATIONS,
    Broker,
    child,
    forge_chain,
    liable_child,
    published,
    seal,
    synthetic_chain,
)
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

from delegation_broker import (
    MAX_CHAIN_CONTRACTS,
    Agent,
    BrokerKeys,
    VerificationError,
    lineage_hash,
    pb,
    sha256,
    verify_chain,
    verify_contract,
    verify_every_signature,
    verify_receipt,
    verify_sealed,
)

CONTRACT_TYPE = b"application/vnd.delegation.broker.v1.Contract+protobuf"
FACTOR = 0.99


# --- the documented procedure, written from types.proto alone --------------------------


def _pae(type_: bytes, payload: bytes) -> bytes:
    return b"DSSEv1 %d %s %d %s" % (len(type_), type_, len(payload), payload)


def documented(chain: list[pb.Sealed], published_keys: list[pb.BrokerKey]) -> list[tuple[bytes, pb.Contract, str]]:
    """types.proto's procedure, step by step; (id, contract, effective predicate) per contract."""
    # 1. Keys whose id is the id of their bytes.
    keys = {k.key_id: bytes(k.public_key) for k in published_keys
            if k.key_id == "ed25519:" + hashlib.sha256(k.public_key).digest()[:16].hex()}
    if not chain:
        raise ValueError("empty chain")
    hops = [(hashlib.sha256(s.payload).digest(), pb.Contract.FromString(s.payload)) for s in chain]
    # 2. The leaf's signature, under the key its payload names.
    leaf = hops[-1][1]
    if leaf.broker_key_id not in keys:
        raise ValueError("the leaf's key is not published")
    try:
        VerifyKey(keys[leaf.broker_key_id]).verify(_pae(CONTRACT_TYPE, chain[-1].payload), chain[-1].signature)
    except (BadSignatureError, ValueError) as e:
        raise ValueError("the leaf's signature does not verify") from e
    # 3-5. Links, the root's terms, each hop against its parent.
    part = lambda p: f"({p}\n)"  # noqa: E731
    out: list[tuple[bytes, pb.Contract, str]] = []
    for id_, c in hops:
        if not out:
            if c.parent_id or c.depth != 0:
                raise ValueError("the chain does not start at a root")
            if c.intent_lineage_hash != hashlib.sha256(c.intent.encode()).digest():
                raise ValueError("root lineage is not SHA-256(intent)")
            if (c.trust_source, c.factor_ppm, c.cumulative_trust_ppm) != (pb.TRUST_SOURCE_ROOT, 10**6, 10**6) \
                    or not c.HasField("policy"):
                raise ValueError("root terms")
            effective = part(c.predicate) if c.predicate else ""
        else:
            parent_id, p, parent_effective = out[-1]
            root, policy = out[0][1], out[0][1].policy
            if c.parent_id != parent_id:
                raise ValueError(f"depth {c.depth}: broken link")
            if c.depth != p.depth + 1 or c.depth > policy.max_depth:
                raise ValueError("depth")
            if c.intent or c.HasField("policy") or c.labels:
                raise ValueError("a child carries the root's terms")
            if c.intent_lineage_hash != root.intent_lineage_hash:
                raise ValueError("lineage")
            if c.factor_ppm > 10**6 or c.cumulative_trust_ppm != p.cumulative_trust_ppm * c.factor_ppm // 10**6 \
                    or c.cumulative_trust_ppm < policy.min_cumulative_trust_ppm:
                raise ValueError("trust")
            if c.budget > p.budget or c.budget < 0 or c.deadline_ms > p.deadline_ms:
                raise ValueError("budget or deadline not narrowed")
            # types.proto: "under a prefix when equal to it or when it continues
            # with "/" after it" -- and, as the broker's scope rule has it (its
            # text does not say so), "/" alone covers every absolute path.
            inside = lambda path: any(  # noqa: E731
                path == q or path.startswith(q + "/") or (q == "/" and path.startswith("/")) for q in p.write_scope)
            if not all(inside(path) for path in c.write_scope):
                raise ValueError("scope widened")
            if c.liability == pb.LIABILITY_DELEGATE and p.liability != pb.LIABILITY_DELEGATE:
                raise ValueError("liability")
            inherited = parent_effective if c.liability == pb.LIABILITY_DELEGATE else ""
            if not c.predicate:
                effective = inherited
            elif not inherited:
                effective = part(c.predicate)
            else:
                effective = f"{inherited} && {part(c.predicate)}"
        if len(effective.encode()) > 65_536:
            raise ValueError("effective predicate too long")
        out.append((id_, c, effective))
    return out


def verdict(chain: list[pb.Sealed], published_keys: list[pb.BrokerKey]) -> bool:
    """The documented procedure's verdict; the library must agree with it."""
    try:
        ours = documented(chain, published_keys)
    except Exception as e:  # noqa: BLE001 - any failure is "does not verify"
        ours = e
    try:
        library = verify_chain(chain, BrokerKeys(published_keys))
    except VerificationError as e:
        library = e
    assert isinstance(ours, Exception) == isinstance(library, Exception), \
        f"the documented procedure and the library disagree: {ours!r} / {library!r}"
    if not isinstance(library, Exception):
        assert [(v.contract_id, v.contract, v.effective_predicate) for v in library] == ours
    return not isinstance(library, Exception)


# --- chains from the broker ---------------------------------------------------------------


def chain_of(broker: Broker, depth: int):
    """A root and a liable chain ``depth`` hops deep, each hop attested at
    FACTOR, with a predicate at every other hop: (GetChain's answer, what was
    asked at each hop as (delegate, budget, predicate, attestation))."""
    agents = [Agent.generate() for _ in range(depth + 1)]
    root = broker.open_root(agents[0], budget=1_000_000, max_depth=64, predicate="result.schema_valid")
    asked = [(agents[0].public_key, 1_000_000, "result.schema_valid", None)]
    parent = root.id
    for hop in range(1, depth + 1):
        predicate = f"result.within_scope || {hop} > 100" if hop % 2 == 1 else ""
        budget = 1_000_000 - 1_000 * hop
        body = liable_child(parent, root.lineage, agents[hop], budget, predicate)
        body.delegate_attestation.CopyFrom(broker.attest(agents[hop], FACTOR))
        parent = broker.delegate(agents[hop - 1], body).contract().contract_id
        asked.append((agents[hop].public_key, budget, predicate, body.delegate_attestation))
    return list(broker.stub.GetChain(pb.GetChainRequest(contract_id=parent)).chain), asked


def sealed(chain: list[pb.ContractState]) -> list[pb.Sealed]:
    return [state.contract for state in chain]


def copy(message):
    out = type(message)()
    out.CopyFrom(message)
    return out


@pytest.fixture(scope="module")
def chains(broker):
    """Chains of depth 1, 8 and 64, and another tree's chain of depth 8."""
    return {depth: chain_of(broker, depth) for depth in (1, 8, 64)} | {"other": chain_of(broker, 8)}


@pytest.mark.parametrize("depth", [1, 8, 64])
def test_whole_chains_verify_offline_with_every_term(broker, chains, depth):
    chain, asked = chains[depth]
    # Only the wire from here on: the published keys and the chain.
    published_keys = list(broker.stub.GetBrokerKeys(pb.GetBrokerKeysRequest()).keys)
    keys = BrokerKeys(published_keys)
    contracts = sealed(chain)
    assert len(contracts) == depth + 1
    assert verdict(contracts, published_keys)
    verified = verify_chain(chain, keys, chain[-1].contract_id)
    cumulative = 1_000_000
    for i, (v, state) in enumerate(zip(verified, chain, strict=True)):
        c = v.contract
        delegate, budget, predicate, attestation = asked[i]
        assert v.contract_id == state.contract_id == sha256(state.contract.payload), "id = SHA-256(payload)"
        assert v.sealed == state.contract and v.key_id == keys.current == c.broker_key_id
        assert c.depth == i
        assert c.delegate_public_key == delegate, "holder"
        assert v.principal_public_key == (asked[i - 1][0] if i else delegate), "principal: the parent's delegate"
        assert c.budget == budget and c.predicate == predicate
        assert c.intent_lineage_hash == verified[0].contract.intent_lineage_hash
        if i == 0:
            assert c.parent_id == b"" and c.intent and c.HasField("policy")
            assert c.intent_lineage_hash == lineage_hash(c.intent)
            assert (c.trust_source, c.factor_ppm) == (pb.TRUST_SOURCE_ROOT, 1_000_000)
        else:
            assert c.parent_id == verified[i - 1].contract_id
            assert not c.intent and not c.HasField("policy") and not c.labels, "the root's, not repeated"
            assert c.deadline_ms <= verified[i - 1].contract.deadline_ms
            assert (c.factor_ppm, c.trust_source) == (990_000, pb.TRUST_SOURCE_ATTESTATION)
            assert c.attestation_digest == sha256(attestation.payload) and c.risk_class == "test"
            cumulative = cumulative * 990_000 // 1_000_000
        assert c.cumulative_trust_ppm == cumulative
        # The broker's copy of the effective predicate is the derived one.
        assert v.effective_predicate == state.effective_predicate
    # Every ancestor's predicate is in the leaf's effective predicate.
    leaf = verified[-1].effective_predicate
    for _, _, predicate, _ in asked:
        if predicate:
            assert f"({predicate}\n)" in leaf
    assert leaf.startswith("(result.schema_valid\n)")
    # Linear: no contract grows with its depth (odd hops carry a predicate,
    # even ones none: compare like with like).
    sizes = [len(s.SerializeToString()) for s in contracts[1::2]]
    assert max(sizes) - min(sizes) <= 16, sizes
    # Every contract's own signature verifies too, and each one alone.
    verify_every_signature(chain, keys)
    assert verify_contract(contracts[0], keys, chain[0].contract_id).effective_predicate == "(result.schema_valid\n)"
    for state in chain[1:]:
        assert verify_contract(state.contract, keys, state.contract_id).effective_predicate is None
    # GetChainResponse itself, or the Sealed contracts, verify the same.
    response = broker.stub.GetChain(pb.GetChainRequest(contract_id=chain[-1].contract_id))
    assert verify_chain(response, keys) == verify_chain(contracts, keys) == verified


def test_every_tampering_of_a_chain_is_rejected(broker, chains):
    chain, _ = chains[8]
    other, _ = chains["other"]
    published_keys = list(broker.stub.GetBrokerKeys(pb.GetBrokerKeysRequest()).keys)
    keys = BrokerKeys(published_keys)
    genuine = sealed(chain)
    assert verdict(genuine, published_keys)

    # A changed budget of any contract, ancestors and leaf.
    for i in range(len(genuine)):
        tampered = [copy(s) for s in genuine]
        contract = pb.Contract.FromString(tampered[i].payload)
        contract.budget += 1
        tampered[i].payload = contract.SerializeToString()
        assert not verdict(tampered, published_keys), f"budget of contract {i}"
        with pytest.raises(VerificationError) as raised:
            verify_chain(tampered, keys)
        # The leaf's own signature, or the link from the changed contract's child.
        assert raised.value.index == min(i + 1, 8), raised.value
    # A flipped signature bit of the leaf.
    tampered = [copy(s) for s in genuine]
    tampered[8].signature = tampered[8].signature[:10] + bytes([tampered[8].signature[10] ^ 0x04]) + \
        tampered[8].signature[11:]
    assert not verdict(tampered, published_keys), "flipped signature"
    with pytest.raises(VerificationError, match="contract 8: the signature does not verify"):
        verify_chain(tampered, keys)
    # A flipped ancestor signature changes no term the chain proves, but
    # checking every signature catches it.
    tampered = [copy(s) for s in genuine]
    tampered[3].signature = tampered[3].signature[:10] + bytes([tampered[3].signature[10] ^ 0x04]) + \
        tampered[3].signature[11:]
    assert verdict(tampered, published_keys)
    with pytest.raises(VerificationError) as raised:
        verify_every_signature(tampered, keys)
    assert raised.value.index == 3
    # Two contracts swapped.
    for a, b in [(0, 1), (3, 4), (7, 8)]:
        tampered = list(genuine)
        tampered[a], tampered[b] = tampered[b], tampered[a]
        assert not verdict(tampered, published_keys), f"swapped {a} and {b}"
    # A wrong key: another key under its own id; under the broker's id it is
    # not even accepted as a published key.
    stranger = Agent.generate()
    other_key = pb.BrokerKey(key_id=stranger.key_id, public_key=stranger.public_key, current=True)
    assert not verdict(genuine, [other_key]), "other key"
    with pytest.raises(VerificationError, match="is not a published broker key"):
        verify_chain(genuine, BrokerKeys([other_key]))
    impostor = pb.BrokerKey(key_id=published_keys[0].key_id, public_key=stranger.public_key, current=True)
    with pytest.raises(VerificationError, match="does not match its public key"):
        BrokerKeys([impostor])
    with pytest.raises(ValueError):
        documented(genuine, [impostor])  # the documented procedure drops it: no key left
    # A cut chain: no root, or a missing middle.
    assert not verdict(genuine[1:], published_keys), "no root"
    with pytest.raises(VerificationError, match="contract 0: the first contract is not a root"):
        verify_chain(genuine[1:], keys)
    cut = genuine[:4] + genuine[5:]
    assert not verdict(cut, published_keys), "missing middle"
    with pytest.raises(VerificationError, match="contract 4: parent_id is not the id of contract 3"):
        verify_chain(cut, keys)
    # A contract of another tree spliced in, at the same depth.
    for i in (0, 4, 8):
        spliced = list(genuine)
        spliced[i] = other[i].contract
        assert not verdict(spliced, published_keys), f"spliced at {i}"
    # The other tree's chain is itself genuine.
    assert verdict(sealed(other), published_keys)
    # Not the contract asked for; an inconsistent ContractState; nothing; too much.
    with pytest.raises(VerificationError, match="not the one asked for"):
        verify_chain(chain, keys, chain[7].contract_id)
    states = [copy(s) for s in chain]
    states[2].contract_id = chain[3].contract_id
    with pytest.raises(VerificationError, match="contract 2: its contract_id is not SHA-256"):
        verify_chain(states, keys)
    with pytest.raises(VerificationError, match="empty"):
        verify_chain([], keys)
    with pytest.raises(VerificationError, match=f"more than {MAX_CHAIN_CONTRACTS} contracts"):
        verify_chain(genuine * 8, keys)
    with pytest.raises(TypeError, match="pb.Sealed"):
        verify_chain([pb.Envelope(payload=genuine[0].payload)], keys)


def test_every_term_of_the_procedure_is_checked_on_its_own():
    """Chains forged under a test key, re-linked and re-signed after each
    change: only the term is wrong, so only the term check can catch it."""
    signer = Agent.generate()
    keys = published(signer)
    key_list = [pb.BrokerKey(key_id=signer.key_id, public_key=signer.public_key, current=True)]
    genuine = forge_chain(signer, synthetic_chain())
    assert verdict(genuine, key_list)
    verified = verify_chain(genuine, keys)
    assert [v.effective_predicate for v in verified] == SYNTHETIC_EFFECTIVE
    assert verified[-1].principal_public_key == verified[2].contract.delegate_public_key
    for name, message, breaks in SYNTHETIC_VIOLATIONS:
        forged = forge_chain(signer, breaks(synthetic_chain()))
        assert not verdict(forged, key_list), name
        with pytest.raises(VerificationError) as raised:
            verify_chain(forged, keys)
        assert str(raised.value).startswith(message), f"{name}: {raised.value}"
        assert raised.value.index == int(message.split()[1].rstrip(":")), name
    # Unlinked (each parent_id left empty): every child then names no parent.
    with pytest.raises(VerificationError, match="contract 1: parent_id is not the id of contract 0"):
        verify_chain(forge_chain(signer, synthetic_chain(), link=False), keys)
    # "/" covers every absolute path, and only those.
    contracts = synthetic_chain()[:2]
    contracts[0].ClearField("write_scope")
    contracts[0].write_scope.append("/")
    contracts[1].ClearField("write_scope")
    contracts[1].write_scope.extend(["/etc", "/"])
    assert verdict(forge_chain(signer, contracts), key_list)
    contracts[1].write_scope.append("etc")
    assert not verdict(forge_chain(signer, contracts), key_list)


def test_list_children_pages_verify(broker, chains):
    chain, _ = chains[1]
    assert len(broker.stub.ListChildren(pb.ListChildrenRequest(contract_id=chain[0].contract_id)).children) == 1
    holder = Agent.generate()
    extra_root = broker.open_root(holder, budget=1000)
    for _ in range(5):
        broker.delegate(holder, child(extra_root.id, extra_root.lineage, Agent.generate(), 1)).contract()
    seen, token = [], b""
    while True:
        page = broker.stub.ListChildren(pb.ListChildrenRequest(contract_id=extra_root.id, page_size=2, page_token=token))
        for state in page.children:
            assert verify_contract(state.contract, broker.keys, state.contract_id).contract.parent_id == extra_root.id
            assert verify_chain([broker.state(extra_root.id), state], broker.keys)[1].principal_public_key \
                == holder.public_key
        seen += [s.contract_id for s in page.children]
        token = page.next_page_token
        if not token:
            break
    assert len(seen) == len(set(seen)) == 5


def test_a_tampered_contract_alone_fails(broker, chains):
    chain, _ = chains[8]
    state = chain[4]
    genuine = state.contract

    # Re-encoded payload with one field changed.
    tampered = copy(genuine)
    contract = pb.Contract.FromString(tampered.payload)
    contract.budget += 1
    tampered.payload = contract.SerializeToString()
    with pytest.raises(VerificationError, match="signature does not verify"):
        verify_contract(tampered, broker.keys)
    # One flipped bit in the signature; no signature.
    tampered = copy(genuine)
    tampered.signature = tampered.signature[:7] + bytes([tampered.signature[7] ^ 0x01]) + tampered.signature[8:]
    with pytest.raises(VerificationError, match="signature does not verify"):
        verify_contract(tampered, broker.keys)
    with pytest.raises(VerificationError, match="signature does not verify"):
        verify_contract(pb.Sealed(payload=genuine.payload), broker.keys)
    # The same bytes verified as another type: the type is bound through PAE.
    with pytest.raises(VerificationError):
        verify_sealed(genuine, broker.keys, pb.Receipt)
    with pytest.raises(VerificationError):
        verify_receipt(genuine, broker.keys)
    with pytest.raises(VerificationError, match="not signed by the broker"):
        verify_sealed(genuine, broker.keys, pb.Attestation)
    # The wrong contract id.
    with pytest.raises(VerificationError, match="is not SHA-256"):
        verify_contract(genuine, broker.keys, sha256(b"another"))
    with pytest.raises(VerificationError, match="not the one asked for"):
        verify_contract(chain[0].contract, broker.keys, sha256(b"another"))
    # An agent's envelope is no Sealed.
    with pytest.raises(TypeError, match="verify_signature"):
        verify_contract(pb.Envelope(payload=genuine.payload), broker.keys)

    # The untampered contract still verifies.
    assert verify_contract(genuine, broker.keys, state.contract_id).contract_id == state.contract_id
    assert verify_sealed(genuine, broker.keys, pb.Contract).id == state.contract_id


def test_the_signing_key_must_be_the_one_the_payload_names(broker, chains):
    chain, _ = chains[1]
    genuine = chain[-1].contract
    impostor = Agent.generate()
    # A forger seals a genuine contract with its own key...
    forged = seal(impostor, pb.Contract.FromString(genuine.payload))
    with pytest.raises(VerificationError, match="signature does not verify"):
        verify_contract(forged, broker.keys)
    # ...and even when its key is (wrongly) published next to the broker's,
    # the payload still names the broker's key, under which it does not verify.
    published_keys = list(broker.stub.GetBrokerKeys(pb.GetBrokerKeysRequest()).keys)
    published_keys.append(pb.BrokerKey(key_id=impostor.key_id, public_key=impostor.public_key, current=False))
    with pytest.raises(VerificationError, match=f"under broker key {broker.keys.current}"):
        verify_contract(forged, BrokerKeys(published_keys))
    # Naming its own key instead changes the payload: it verifies only where
    # that key is published (as a broker key: the trust is in the key list).
    renamed = pb.Contract.FromString(genuine.payload)
    renamed.broker_key_id = impostor.key_id
    with pytest.raises(VerificationError, match="not a published broker key"):
        verify_contract(seal(impostor, renamed), broker.keys)
    assert verify_contract(seal(impostor, renamed), BrokerKeys(published_keys)).key_id == impostor.key_id
    # A published key whose id does not match is rejected outright.
    published_keys[-1].key_id = published_keys[0].key_id
    with pytest.raises(VerificationError, match="does not match"):
        BrokerKeys(published_keys)


def test_contracts_signed_before_a_key_rotation_still_verify(tmp_path):
    """`delegation-broker rotate-key` retires the signing key; GetBrokerKeys then
    publishes both, and a chain mixing old and new signatures verifies."""
    import subprocess

    from _support import broker_bin

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
        published_keys = after.stub.GetBrokerKeys(pb.GetBrokerKeysRequest()).keys
        assert published_keys[0].current and not published_keys[1].current, "current first"
        issued = after.delegate(orchestrator, child(root.id, root.lineage, delegate, 10)).contract()
        assert issued.key_id == after.keys.current
        states = after.stub.GetChain(pb.GetChainRequest(contract_id=issued.contract_id)).chain
        chain = verify_chain(states, after.keys)
        assert [v.key_id for v in chain] == [old_key, after.keys.current]
        verify_every_signature(states, after.keys)
        # Only the current key: the chain still verifies (one signature, the
        # leaf's, by the new key), but the old root alone, or every signature, no longer.
        only_new = BrokerKeys([k for k in published_keys if k.current])
        assert verify_chain(states, only_new)[0].contract_id == root.id
        with pytest.raises(VerificationError, match="not a published broker key"):
            verify_contract(chain[0].sealed, only_new)
        with pytest.raises(VerificationError) as raised:
            verify_every_signature(states, only_new)
        assert raised.value.index == 0
        # Only the old key: the leaf does not verify.
        only_old = BrokerKeys([k for k in published_keys if not k.current])
        with pytest.raises(VerificationError, match="contract 1: signed by"):
            verify_chain(states, only_old)
    finally:
        assert after.close() == 0
