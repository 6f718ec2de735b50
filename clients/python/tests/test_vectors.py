"""The shared signing test vectors (testdata/signing-vectors.json, written by
scripts/signing-vectors.py), checked with this client's code. The same file is
checked by the broker (tests/vectors.rs) and the TypeScript client
(clients/typescript/test/vectors.test.ts). No broker needed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from delegation_broker import (
    Agent,
    BrokerKeys,
    VerificationError,
    key_id,
    lineage_hash,
    message_class,
    pae,
    payload_type,
    pb,
    sha256,
    verify_chain,
    verify_pae_signature,
    verify_receipt,
    verify_sealed,
    verify_signature,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
VECTORS_PATH = REPO_ROOT / "testdata" / "signing-vectors.json"
VECTORS = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))
CASES = {case["name"]: case for case in VECTORS["cases"]}
SEALED_TYPES = {"delegation.broker.v1.Contract", "delegation.broker.v1.Receipt", "delegation.broker.v1.Session"}


def b(hex_text: str) -> bytes:
    return bytes.fromhex(hex_text)


def keys() -> BrokerKeys:
    return BrokerKeys(
        pb.BrokerKey(key_id=k["key_id"], public_key=b(k["public_key"]), current=k["current"])
        for k in VECTORS["broker_keys"]
    )


def sealed_of(case: dict) -> pb.Sealed:
    return pb.Sealed(payload=b(case["body"]), signature=b(case["signature"]))


def test_every_form_is_covered():
    forms = {(case["form"], case["message"]) for case in VECTORS["cases"]}
    assert ("sealed", "delegation.broker.v1.Contract") in forms
    assert ("sealed", "delegation.broker.v1.Receipt") in forms
    assert ("sealed", "delegation.broker.v1.Session") in forms
    assert any(form == "envelope" for form, _ in forms)
    assert VECTORS["negative"], "negative cases"


@pytest.mark.parametrize("name", list(CASES))
def test_case_signs_and_verifies(name):
    case = CASES[name]
    body, signature, public_key = b(case["body"]), b(case["signature"]), b(case["public_key"])
    agent = Agent.from_seed(b(case["seed"]))
    assert agent.public_key == public_key, "the public key is the seed's"
    assert key_id(public_key) == case["key_id"] == agent.key_id
    cls = message_class(case["payload_type"])
    assert cls.DESCRIPTOR.full_name == case["message"]
    assert payload_type(cls) == case["payload_type"]
    assert pae(case["payload_type"], body) == b(case["pae"])
    assert verify_pae_signature(case["payload_type"], body, signature, public_key)
    # ed25519 is deterministic: signing again from the seed gives the same bytes.
    assert agent.sign_bytes(case["payload_type"], body).signatures[0].sig == signature
    # The body is canonical protobuf: decoding and re-encoding gives it back.
    message = cls.FromString(body)
    assert message.SerializeToString(deterministic=True) == body
    signed = b(case["signed"])
    if case["form"] == "envelope":
        assert case["message"] not in SEALED_TYPES
        assert case["id"] is None
        assert b(case["request_digest"]) == sha256(b(case["pae"]))
        envelope = pb.Envelope.FromString(signed)
        assert envelope == pb.Envelope(
            payload_type=case["payload_type"],
            payload=body,
            signatures=[pb.Signature(keyid=case["key_id"], sig=signature)],
        )
        assert envelope.SerializeToString(deterministic=True) == signed
        assert verify_signature(envelope, public_key, case["payload_type"])
        assert message.header.agent_public_key == public_key, "a request is signed by its header's agent"
    else:
        assert case["message"] in SEALED_TYPES
        assert case["request_digest"] is None
        assert b(case["id"]) == sha256(body)
        sealed = pb.Sealed.FromString(signed)
        assert sealed == sealed_of(case)
        assert sealed.SerializeToString(deterministic=True) == signed
        verified = verify_sealed(sealed, keys(), cls)
        assert verified.id == b(case["id"])
        assert verified.key_id == message.broker_key_id == case["key_id"]


def test_chain_and_bindings():
    chain = [sealed_of(CASES[name]) for name in VECTORS["chain"]]
    leaf = b(CASES[VECTORS["chain"][-1]]["id"])
    verified = verify_chain(chain, keys(), leaf)
    assert [v.contract_id for v in verified] == [b(CASES[name]["id"]) for name in VECTORS["chain"]]
    root, child = (v.contract for v in verified)
    assert root.intent_lineage_hash == lineage_hash(root.intent) == child.intent_lineage_hash
    assert root.request_digest == b(CASES["open-root"]["request_digest"])
    assert child.request_digest == b(CASES["delegate"]["request_digest"])
    assert verified[1].effective_predicate == f"({root.predicate}\n) && ({child.predicate}\n)"
    assert pb.DelegateBody.FromString(b(CASES["delegate"]["body"])).parent_id == verified[0].contract_id

    receipt = verify_receipt(sealed_of(CASES["receipt-refused"]), keys(), b(CASES["receipt-refused"]["id"])).message
    assert receipt.kind == pb.RECEIPT_KIND_REFUSED
    assert receipt.contract_id == receipt.root_id == verified[0].contract_id
    assert receipt.request_digest == b(CASES["delegate-refused"]["request_digest"])
    assert receipt.primary == pb.INVARIANT_CODE_NO_RETRY_HEADROOM

    session = verify_sealed(sealed_of(CASES["session"]), keys(), pb.Session).message
    assert session.agent_public_key == b(CASES["open-session"]["public_key"])
    opened = pb.OpenSessionBody.FromString(b(CASES["open-session"]["body"]))
    assert opened.broker_key_id == session.broker_key_id


@pytest.mark.parametrize("negative", VECTORS["negative"], ids=lambda n: n["name"])
def test_negative_case_fails(negative):
    body, signature, public_key = b(negative["body"]), b(negative["signature"]), b(negative["public_key"])
    assert not verify_pae_signature(negative["payload_type"], body, signature, public_key)
    if negative["form"] == "envelope":
        envelope = pb.Envelope(
            payload_type=negative["payload_type"], payload=body, signatures=[pb.Signature(sig=signature)]
        )
        assert not verify_signature(envelope, public_key)
    else:
        with pytest.raises(VerificationError):
            verify_sealed(pb.Sealed(payload=body, signature=signature), keys(), message_class(negative["payload_type"]))


def test_a_flipped_contract_breaks_the_chain():
    flipped = next(n for n in VECTORS["negative"] if n["base"] == VECTORS["chain"][0] and n["body"] != CASES[n["base"]]["body"])
    with pytest.raises(VerificationError):
        verify_chain([pb.Sealed(payload=b(flipped["body"]), signature=b(flipped["signature"]))], keys())
    # Flipping any single bit of the leaf's payload breaks the chain too.
    chain = [sealed_of(CASES[name]) for name in VECTORS["chain"]]
    leaf = chain[-1].payload
    for index in range(0, len(leaf), 7):
        tampered = bytearray(leaf)
        tampered[index] ^= 0x80
        with pytest.raises(VerificationError):
            verify_chain([*chain[:-1], pb.Sealed(payload=bytes(tampered), signature=chain[-1].signature)], keys())


def test_the_file_is_what_the_generator_writes():
    generator = REPO_ROOT / "scripts" / "signing-vectors.py"
    result = subprocess.run(
        [sys.executable, str(generator), "--check"], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
