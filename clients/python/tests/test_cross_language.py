"""Python's verdict on an envelope equals the Rust `delegation-broker verify`
verdict on the very same bytes, for genuine and tampered envelopes of every
kind (contract, hop proof, refusal receipt, attestation, signed request)."""

from __future__ import annotations

import subprocess

import pytest
from _support import broker_bin, child, liable_child

from delegation_broker import (
    Agent,
    VerificationError,
    key_id,
    now_ms,
    pb,
    verify_envelope,
    verify_signature,
)

L = 2**252 + 27742317777372353535851937790883648493  # order of the ed25519 base point


def rust_verdict(tmp_path, envelope: pb.Envelope, public_key: bytes) -> bool:
    path = tmp_path / "envelope.bin"
    path.write_bytes(envelope.SerializeToString())
    result = subprocess.run(
        [str(broker_bin()), "verify", "--public-key", public_key.hex(), "--envelope", str(path)],
        capture_output=True, text=True, timeout=30, env={"BROKER_LOG": "error", "PATH": "/usr/bin:/bin"},
    )
    if result.returncode == 0:
        assert result.stdout.split() == ["ok", envelope.payload_type, key_id(public_key)]
        return True
    assert result.stderr.startswith("error:"), result.stderr
    return False


def python_verdict(envelope: pb.Envelope, public_key: bytes, keys=None) -> bool:
    """The helper layer's verdict: the full broker-envelope check when the
    envelope is a broker one and ``keys`` are given, else the signature check."""
    plain = verify_signature(envelope, public_key)
    if keys is None:
        return plain
    try:
        verify_envelope(envelope, keys)
        full = True
    except VerificationError:
        full = False
    assert full == plain, "signature-only and full verification agree on broker envelopes"
    return full


def copy(envelope: pb.Envelope) -> pb.Envelope:
    out = pb.Envelope()
    out.CopyFrom(envelope)
    return out


def tamperings(envelope: pb.Envelope):
    """(name, envelope) variants; the first is the genuine one."""
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
    other = "Contract" if "Contract" not in e.payload_type else "Receipt"
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


@pytest.fixture(scope="module")
def samples(broker):
    """(label, envelope, signer public key, is broker-signed) from a real tree."""
    orchestrator, planner, executor = Agent.generate(), Agent.generate(), Agent.generate()
    root = broker.open_root(orchestrator, min_trust=500_000)
    attestation = broker.attest(planner, 0.9)
    body = liable_child(root.id, root.lineage, planner, 40, "result.ok", min_retry_cost=5,
                        delegate_attestation=attestation)
    request = orchestrator.delegate(body)
    issued = broker.check_outcome(broker.stub.Delegate(request)).contract()
    refusal = broker.delegate(planner, child(issued.contract_id, root.lineage, executor, 5,
                                             delegate_attestation=broker.attest(executor, 0.3)))
    refusal.receipt()
    broker_key = broker.keys[issued.key_id]
    hop_proofs = pb.Contract.FromString(issued.envelope.payload).hop_proofs
    return [
        ("root contract", broker.state(root.id).contract, broker_key, True),
        ("child contract", issued.envelope, broker_key, True),
        ("root hop proof", hop_proofs[0], broker_key, True),
        ("child hop proof", hop_proofs[1], broker_key, True),
        ("refusal receipt", refusal.response.refused.receipt, broker_key, True),
        ("attestation", attestation, broker.attestor.public_key, False),
        ("delegate request", request.signed, orchestrator.public_key, False),
    ]


def test_python_and_rust_agree_on_every_envelope(tmp_path, broker, samples):
    checked = 0
    for label, envelope, public_key, broker_signed in samples:
        keys = broker.keys if broker_signed else None
        for name, variant in tamperings(envelope):
            rust = rust_verdict(tmp_path, variant, public_key)
            python = python_verdict(variant, public_key, keys)
            assert python == rust, f"{label} / {name}: python {python}, rust {rust}"
            if name == "genuine":
                assert rust, f"{label}: the genuine envelope must verify"
            elif name in ("payload bit flip", "payload extended", "signature bit flip", "non-canonical S",
                          "other payload type (known)", "other payload type (unknown)", "no signature", "five signatures"):
                assert not rust, f"{label} / {name} must not verify"
            checked += 1
        # And with a key that did not sign it.
        stranger = Agent.generate().public_key
        assert rust_verdict(tmp_path, envelope, stranger) is False
        assert python_verdict(envelope, stranger) is False
    assert checked == len(samples) * 11


def test_rust_verifies_python_signed_envelopes(tmp_path):
    agent = Agent.generate()
    for message in (
        pb.Attestation(agent_public_key=agent.public_key, factor=0.5, expires_at_ms=now_ms()),
        pb.DelegateBody(header=agent.header(), task="ü — non-ASCII task", budget=7),
        pb.OpenRootBody(header=agent.header(), intent="x" * 70_000, budget=1),  # multi-byte length in PAE
    ):
        envelope = agent.sign(message)
        assert rust_verdict(tmp_path, envelope, agent.public_key)
        assert verify_signature(envelope, agent.public_key)
