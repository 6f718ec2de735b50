"""The signing rules, checked against fixed vectors (no broker needed)."""

from __future__ import annotations

import hashlib

import pytest

from _support import published, seal

from delegation_broker import (
    SESSION_TYPE,
    Agent,
    VerificationError,
    key_id,
    lineage_hash,
    message_class,
    pae,
    payload_type,
    pb,
    sha256,
    verify_pae_signature,
    verify_receipt,
    verify_sealed,
    verify_signature,
)

L = 2**252 + 27742317777372353535851937790883648493  # order of the ed25519 base point

# RFC 8032, section 7.1, TEST 1.
RFC8032_SEED = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
RFC8032_PUBLIC = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")


def test_pae_matches_the_dsse_specification_example():
    assert pae("http://example.com/HelloWorld", b"hello world") == b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"


def test_pae_lengths_are_in_bytes():
    assert pae("t\u00fc", b"\x00" * 10) == b"DSSEv1 3 t\xc3\xbc 10 " + b"\x00" * 10


def test_key_id_and_seed():
    agent = Agent.from_seed(RFC8032_SEED)
    assert agent.public_key == RFC8032_PUBLIC
    assert agent.seed == RFC8032_SEED
    assert agent.key_id == key_id(RFC8032_PUBLIC) == "ed25519:" + hashlib.sha256(RFC8032_PUBLIC).digest()[:16].hex()
    with pytest.raises(ValueError):
        key_id(b"short")


def test_payload_types_name_the_messages():
    for name in ("OpenRootBody", "DelegateBody", "Contract", "Receipt", "Session", "Attestation"):
        cls = getattr(pb, name)
        assert payload_type(cls) == f"application/vnd.delegation.broker.v1.{name}+protobuf"
        assert message_class(payload_type(cls)) is cls


def test_lineage_hash():
    assert lineage_hash("é") == hashlib.sha256("é".encode()).digest()


def test_signed_requests_have_one_signature_and_a_fresh_header():
    agent = Agent.generate()
    first = agent.delegate(pb.DelegateBody(budget=1))
    second = agent.delegate(budget=1)
    for request in (first, second):
        envelope = request.signed
        assert envelope.payload_type == "application/vnd.delegation.broker.v1.DelegateBody+protobuf"
        assert len(envelope.signatures) == 1 and envelope.signatures[0].keyid == agent.key_id
        assert verify_signature(envelope, agent.public_key)
        header = pb.DelegateBody.FromString(envelope.payload).header
        assert header.agent_public_key == agent.public_key and 16 <= len(header.nonce) <= 64
    nonce = lambda r: pb.DelegateBody.FromString(r.signed.payload).header.nonce  # noqa: E731
    assert nonce(first) != nonce(second)


def test_an_explicit_header_is_kept_and_the_body_is_not_mutated():
    agent = Agent.generate()
    header = agent.header()
    body = pb.OpenRootBody(header=header, intent="x")
    assert pb.OpenRootBody.FromString(agent.open_root(body).signed.payload).header == header
    bare = pb.OpenRootBody(intent="x")
    agent.open_root(bare)
    assert not bare.HasField("header")
    with pytest.raises(TypeError):
        agent.open_root(bare, intent="y")


def test_verify_signature_rejects_tampering_and_other_keys():
    agent = Agent.generate()
    envelope = agent.sign(pb.Attestation(agent_public_key=b"\x01" * 32, factor=0.5))
    assert verify_signature(envelope, agent.public_key)
    assert verify_signature(envelope, agent.public_key, payload_type(pb.Attestation))
    assert not verify_signature(envelope, agent.public_key, payload_type(pb.Contract))
    assert not verify_signature(envelope, Agent.generate().public_key)
    assert not verify_signature(envelope, b"\x00" * 31)
    assert not verify_signature(envelope, b"\x01" + b"\x00" * 31)  # small-order (identity) key
    envelope.payload = envelope.payload + b"\x00"
    assert not verify_signature(envelope, agent.public_key)


def test_verify_pae_signature_is_strict():
    agent = Agent.generate()
    payload = b"\x0a\x03abc"
    signature = agent.sign_bytes(SESSION_TYPE, payload).signatures[0].sig
    assert verify_pae_signature(SESSION_TYPE, payload, signature, agent.public_key)
    assert not verify_pae_signature(SESSION_TYPE, payload, signature, agent.public_key[:31])
    assert not verify_pae_signature(SESSION_TYPE, payload, signature, Agent.generate().public_key)
    # The type is signed: the same bytes under another type do not verify.
    assert not verify_pae_signature(payload_type(pb.Receipt), payload, signature, agent.public_key)
    # The same signature with S + L (non-canonical), a flipped bit, a short or long one.
    s = int.from_bytes(signature[32:], "little") + L
    assert not verify_pae_signature(SESSION_TYPE, payload, signature[:32] + s.to_bytes(32, "little"), agent.public_key)
    assert not verify_pae_signature(SESSION_TYPE, payload, signature[:5] + bytes([signature[5] ^ 1]) + signature[6:],
                                    agent.public_key)
    assert not verify_pae_signature(SESSION_TYPE, payload, signature[:63], agent.public_key)
    assert not verify_pae_signature(SESSION_TYPE, payload, signature + b"\x00", agent.public_key)
    # Small-order key and R: the identity point, with S = 0, "verifies" any
    # message under a non-strict verifier.
    identity = b"\x01" + b"\x00" * 31
    assert not verify_pae_signature(SESSION_TYPE, payload, identity + b"\x00" * 32, identity)


def test_a_sealed_is_verified_under_the_key_its_payload_names_and_its_type():
    broker_key, other = Agent.generate(), Agent.generate()
    keys = published(broker_key, other)
    session = pb.Session(broker_key_id=broker_key.key_id, agent_public_key=b"\x07" * 32, issued_at_ms=1,
                         expires_at_ms=2)
    sealed = seal(broker_key, session)
    verified = verify_sealed(sealed, keys, pb.Session)
    assert (verified.message, verified.key_id, verified.id) == (session, broker_key.key_id, sha256(sealed.payload))
    assert verified.sealed is sealed
    # The signature binds the type: a Session is no Receipt.
    with pytest.raises(VerificationError):
        verify_sealed(sealed, keys, pb.Receipt)
    with pytest.raises(VerificationError):
        verify_receipt(sealed, keys)
    # Signed by a published key other than the one the payload names.
    with pytest.raises(VerificationError, match=f"does not verify under broker key {broker_key.key_id}"):
        verify_sealed(seal(other, session), keys, pb.Session)
    # Naming a key that is not published.
    stranger = Agent.generate()
    renamed = pb.Session(broker_key_id=stranger.key_id)
    with pytest.raises(VerificationError, match="not a published broker key"):
        verify_sealed(seal(stranger, renamed), keys, pb.Session)
    # Not decodable; not a broker message type; not a Sealed.
    with pytest.raises(VerificationError, match="not a delegation.broker.v1.Session"):
        verify_sealed(pb.Sealed(payload=b"\xff\xff", signature=sealed.signature), keys, pb.Session)
    with pytest.raises(VerificationError, match="not signed by the broker"):
        verify_sealed(sealed, keys, pb.Attestation)
    with pytest.raises(TypeError):
        verify_sealed(broker_key.sign(session), keys, pb.Session)
