#!/usr/bin/env python3
"""Writes testdata/signing-vectors.json: fixed signing test vectors for every
signed form of the broker's protocol (proto/delegation/broker/v1/types.proto,
"Verifying a chain"), built with the Python client's own code
(clients/python/src/delegation_broker: signing.py, verify.py, pb.py).

    clients/typescript/.venv-python/bin/python scripts/signing-vectors.py          # (re)write
    clients/typescript/.venv-python/bin/python scripts/signing-vectors.py --check  # fail on drift

Any Python with the client's dependencies (protobuf, PyNaCl) works; the
client's sources are read from this checkout, not from an installed copy.

Everything is fixed (seeds, timestamps, nonces; ed25519 is deterministic and
bodies are serialized deterministically), so a rerun writes the same bytes.
The vectors are checked by clients/python/tests/test_vectors.py,
clients/typescript/test/vectors.test.ts and tests/vectors.rs: each recomputes
PAE, the key id, the signature from the seed, the ids and request digests,
verifies every signature strictly, verifies the chain and the receipt with
its client's verifier, and expects each negative case to fail.

The story they tell, in one tree: an orchestrator opens a root (request
`open-root`, contract `contract-root`), delegates a liable child to a worker
(request `delegate`, contract `contract-child`, trust from the operator's
static table), asks for a second child that would leave it no retry headroom
(request `delegate-refused`, refusal receipt `receipt-refused`), and opens a
read session (request `open-session`, session `session`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
OUTPUT = REPO_ROOT / "testdata" / "signing-vectors.json"
sys.path.insert(0, str(REPO_ROOT / "clients" / "python" / "src"))
sys.dont_write_bytecode = True  # no __pycache__ left in the client's sources

from delegation_broker import pb  # noqa: E402
from delegation_broker.signing import Agent, key_id, lineage_hash, pae, payload_type, sha256, verify_pae_signature  # noqa: E402
from delegation_broker.verify import (  # noqa: E402
    BrokerKeys,
    VerificationError,
    verify_chain,
    verify_receipt,
    verify_sealed,
)


def seed(name: str) -> bytes:
    """A fixed 32-byte seed: SHA-256 of a label (test keys only, never secret)."""
    return hashlib.sha256(f"delegation-broker signing vectors: {name}".encode()).digest()


def nonce(name: str) -> bytes:
    """A fixed 16-byte nonce."""
    return hashlib.sha256(f"delegation-broker signing vectors: nonce {name}".encode()).digest()[:16]


ORCHESTRATOR = Agent.from_seed(seed("orchestrator"))
WORKER = Agent.from_seed(seed("worker"))
BROKER = Agent.from_seed(seed("broker"))
BROKER_KEY_ID = key_id(BROKER.public_key)

# Unix ms: 2027-01-15T08:00:00Z, and offsets from it.
T0 = 1_800_000_000_000
# Non-ASCII on purpose: the lineage hash is over UTF-8 bytes, PAE lengths count bytes.
INTENT = "Fix the naïve date parsing in billing — every test green"
ROOT_PREDICATE = "result.schema_valid && result.within_scope"


def serialize(message) -> bytes:
    return message.SerializeToString(deterministic=True)


def hexs(data: bytes) -> str:
    return bytes(data).hex()


def signer_fields(agent: Agent) -> dict:
    return {"seed": hexs(agent.seed), "public_key": hexs(agent.public_key), "key_id": agent.key_id}


def request_case(name: str, agent: Agent, body, note: str) -> tuple[dict, pb.Envelope]:
    """An agent-signed request: a DSSE Envelope over the body (what
    Agent.sign_request puts in `<Name>Request.signed`)."""
    envelope = agent.sign(body)
    type_ = envelope.payload_type
    assert type_ == payload_type(body)
    signed_pae = pae(type_, envelope.payload)
    case = {
        "name": name,
        "note": note,
        "form": "envelope",
        "message": body.DESCRIPTOR.full_name,
        "payload_type": type_,
        **signer_fields(agent),
        "body": hexs(envelope.payload),
        "pae": hexs(signed_pae),
        "signature": hexs(envelope.signatures[0].sig),
        # The serialized Envelope, as it travels in the request's `signed` field.
        "signed": hexs(serialize(envelope)),
        # Requests have no id; SHA-256(PAE) is what the broker records as the
        # request_digest of the contract or receipt the request caused.
        "id": None,
        "request_digest": hexs(sha256(signed_pae)),
    }
    return case, envelope


def sealed_case(name: str, message, note: str) -> tuple[dict, pb.Sealed]:
    """A broker-signed Sealed: the payload and one signature over
    PAE(type, payload), the type implied by the message (the field carrying it)."""
    body = serialize(message)
    type_ = payload_type(message)
    signature = BROKER.sign_bytes(type_, body).signatures[0].sig
    sealed = pb.Sealed(payload=body, signature=signature)
    case = {
        "name": name,
        "note": note,
        "form": "sealed",
        "message": message.DESCRIPTOR.full_name,
        "payload_type": type_,
        **signer_fields(BROKER),
        "body": hexs(body),
        "pae": hexs(pae(type_, body)),
        "signature": hexs(signature),
        # The serialized Sealed, as it travels (e.g. IssuedContract.contract).
        "signed": hexs(serialize(sealed)),
        # SHA-256 of the payload: the contract's, receipt's or session's id.
        "id": hexs(sha256(body)),
        "request_digest": None,
    }
    return case, sealed


def flip(hex_text: str, index: int) -> str:
    data = bytearray(bytes.fromhex(hex_text))
    data[index] ^= 0x01
    return data.hex()


def build() -> dict:
    cases: list[dict] = []

    # 1. The orchestrator opens a root.
    open_root = pb.OpenRootBody(
        header=pb.RequestHeader(agent_public_key=ORCHESTRATOR.public_key, timestamp_ms=T0, nonce=nonce("open-root")),
        intent=INTENT,
        task="plan the fix and dispatch it",
        budget=100,
        deadline_ms=T0 + 3_600_000,
        policy=pb.Policy(max_depth=4, min_cumulative_trust_ppm=250_000, max_children=8),
        predicate=ROOT_PREDICATE,
        write_scope=["src/billing", "tests/billing"],
        labels={"arm": "flat"},
    )
    case, open_root_env = request_case(
        "open-root", ORCHESTRATOR, open_root, "OpenRootBody signed by the orchestrator (OpenRootRequest.signed)"
    )
    cases.append(case)
    open_root_digest = sha256(pae(open_root_env.payload_type, open_root_env.payload))

    # 2. The broker stamps the root contract.
    root = pb.Contract(
        broker_key_id=BROKER_KEY_ID,
        depth=0,
        intent=INTENT,
        intent_lineage_hash=lineage_hash(INTENT),
        task=open_root.task,
        delegate_public_key=ORCHESTRATOR.public_key,
        budget=100,
        deadline_ms=open_root.deadline_ms,
        issued_at_ms=T0 + 5,
        liability=pb.LIABILITY_DELEGATE,
        predicate=ROOT_PREDICATE,
        write_scope=list(open_root.write_scope),
        policy=open_root.policy,
        request_digest=open_root_digest,
        labels={"arm": "flat"},
        factor_ppm=1_000_000,
        cumulative_trust_ppm=1_000_000,
        trust_source=pb.TRUST_SOURCE_ROOT,
    )
    case, root_sealed = sealed_case(
        "contract-root", root, "the root contract the broker issued for open-root (a one-contract chain)"
    )
    cases.append(case)
    root_id = sha256(root_sealed.payload)

    # 3. The orchestrator delegates a liable child to the worker.
    delegate = pb.DelegateBody(
        header=pb.RequestHeader(agent_public_key=ORCHESTRATOR.public_key, timestamp_ms=T0 + 1_000, nonce=nonce("delegate")),
        parent_id=root_id,
        intent_lineage_hash=lineage_hash(INTENT),
        task="fix parse_date and its tests",
        delegate_public_key=WORKER.public_key,
        budget=40,
        deadline_ms=T0 + 1_800_000,
        liability=pb.LIABILITY_DELEGATE,
        predicate="result.within_scope",
        escalation_channel="orchestrator-inbox",
        min_retry_cost=10,
        min_retry_latency_ms=60_000,
        write_scope=["src/billing/dates"],
    )
    case, delegate_env = request_case(
        "delegate", ORCHESTRATOR, delegate, "DelegateBody signed by the orchestrator, the root's holder (DelegateRequest.signed)"
    )
    cases.append(case)

    # 4. The broker stamps the child (trust from the operator's static table).
    child = pb.Contract(
        broker_key_id=BROKER_KEY_ID,
        parent_id=root_id,
        depth=1,
        intent_lineage_hash=lineage_hash(INTENT),
        task=delegate.task,
        delegate_public_key=WORKER.public_key,
        budget=40,
        deadline_ms=delegate.deadline_ms,
        issued_at_ms=T0 + 1_005,
        liability=pb.LIABILITY_DELEGATE,
        predicate=delegate.predicate,
        escalation_channel=delegate.escalation_channel,
        min_retry_cost=10,
        min_retry_latency_ms=60_000,
        write_scope=list(delegate.write_scope),
        request_digest=sha256(pae(delegate_env.payload_type, delegate_env.payload)),
        factor_ppm=800_000,
        cumulative_trust_ppm=800_000,
        trust_source=pb.TRUST_SOURCE_STATIC_TABLE,
    )
    case, child_sealed = sealed_case(
        "contract-child", child, "the child issued for delegate; chain [contract-root, contract-child]"
    )
    cases.append(case)

    # 5. A second child would leave the root 60 - 55 = 5 units, below its
    #    min_retry_cost 10: refused with NO_RETRY_HEADROOM.
    refused = pb.DelegateBody(
        header=pb.RequestHeader(
            agent_public_key=ORCHESTRATOR.public_key, timestamp_ms=T0 + 2_000, nonce=nonce("delegate-refused")
        ),
        parent_id=root_id,
        intent_lineage_hash=lineage_hash(INTENT),
        task="rewrite the invoice renderer",
        delegate_public_key=WORKER.public_key,
        budget=55,
        deadline_ms=T0 + 1_800_000,
        liability=pb.LIABILITY_DELEGATE,
        predicate="result.schema_valid",
        escalation_channel="orchestrator-inbox",
        min_retry_cost=10,
        min_retry_latency_ms=60_000,
        write_scope=["src/billing/invoices"],
    )
    case, refused_env = request_case(
        "delegate-refused", ORCHESTRATOR, refused, "a DelegateBody the broker refuses (receipt-refused)"
    )
    cases.append(case)

    receipt = pb.Receipt(
        broker_key_id=BROKER_KEY_ID,
        kind=pb.RECEIPT_KIND_REFUSED,
        contract_id=root_id,
        root_id=root_id,
        request_digest=sha256(pae(refused_env.payload_type, refused_env.payload)),
        requester_public_key=ORCHESTRATOR.public_key,
        at_ms=T0 + 2_004,
        primary=pb.INVARIANT_CODE_NO_RETRY_HEADROOM,
        violations=[
            pb.Violation(
                code=pb.INVARIANT_CODE_NO_RETRY_HEADROOM,
                requested="5",
                allowed="10",
                detail="the parent would keep 5 units, below the child's min_retry_cost 10: it could not retry once",
            )
        ],
    )
    case, _ = sealed_case("receipt-refused", receipt, "the refusal receipt of delegate-refused, about contract-root")
    cases.append(case)

    # 6. The orchestrator opens a read session; the broker seals it.
    open_session = pb.OpenSessionBody(
        header=pb.RequestHeader(
            agent_public_key=ORCHESTRATOR.public_key, timestamp_ms=T0 + 3_000, nonce=nonce("open-session")
        ),
        broker_key_id=BROKER_KEY_ID,
    )
    case, _ = request_case(
        "open-session", ORCHESTRATOR, open_session, "OpenSessionBody signed by the orchestrator (OpenSessionRequest.signed)"
    )
    cases.append(case)

    session = pb.Session(
        broker_key_id=BROKER_KEY_ID,
        agent_public_key=ORCHESTRATOR.public_key,
        issued_at_ms=T0 + 3_003,
        expires_at_ms=T0 + 3_003 + 900_000,
    )
    case, _ = sealed_case(
        "session", session, "the read session opened by open-session (OpenSessionResponse.session, x-broker-session-bin)"
    )
    cases.append(case)

    by_name = {c["name"]: c for c in cases}

    # Negative cases: each must NOT verify (strict ed25519 over
    # PAE(payload_type, body) under public_key).
    def negative(name: str, base: str, why: str, **changes) -> dict:
        c = by_name[base]
        out = {
            "name": name,
            "base": base,
            "why": why,
            "form": c["form"],
            "payload_type": c["payload_type"],
            "public_key": c["public_key"],
            "body": c["body"],
            "signature": c["signature"],
        }
        out.update(changes)
        return out

    root_body_len = len(bytes.fromhex(by_name["contract-root"]["body"]))
    negatives = [
        negative(
            "contract-root-body-byte-flipped",
            "contract-root",
            "one bit of the payload flipped (in the middle of the body): the signature no longer covers it",
            body=flip(by_name["contract-root"]["body"], root_body_len // 2),
        ),
        negative(
            "receipt-signature-byte-flipped",
            "receipt-refused",
            "one bit of the signature's S half flipped",
            signature=flip(by_name["receipt-refused"]["signature"], 40),
        ),
        negative(
            "delegate-body-byte-flipped",
            "delegate",
            "one bit of the request body's last byte flipped",
            body=flip(by_name["delegate"]["body"], len(bytes.fromhex(by_name["delegate"]["body"])) - 1),
        ),
        negative(
            "session-as-receipt",
            "session",
            "the session's exact bytes and signature, checked as a Receipt: PAE binds the type, which a Sealed does not carry",
            payload_type=payload_type(pb.Receipt),
        ),
        negative(
            "open-root-wrong-key",
            "open-root",
            "the orchestrator's request checked under the worker's key",
            public_key=hexs(WORKER.public_key),
        ),
    ]

    document = {
        "description": (
            "Signing test vectors of the delegation broker's protocol (proto/delegation/broker/v1/types.proto). "
            "Generated by scripts/signing-vectors.py (do not edit by hand); checked in Rust (tests/vectors.rs), "
            "Python (clients/python/tests/test_vectors.py) and TypeScript (clients/typescript/test/vectors.test.ts). "
            "Bytes are lowercase hex. Test keys only: the seeds are public."
        ),
        "rules": {
            "pae": 'PAE(type, body) = "DSSEv1" SP LEN(type) SP type SP LEN(body) SP body (LEN: byte length, ASCII decimal)',
            "signature": "ed25519 (RFC 8032, deterministic) over PAE(payload_type, body), verified strictly",
            "key_id": '"ed25519:" + hex(SHA-256(public_key)[0..16])',
            "envelope": "agent-signed requests: DSSE Envelope{payload_type, payload = body, signatures = [{keyid, sig}]}",
            "sealed": "broker-signed: Sealed{payload = body, signature}; the type is implied by the carrying field, still in PAE",
            "id": "sealed forms: SHA-256(body) (contract, receipt, session id); requests have none",
            "request_digest": "envelopes: SHA-256(PAE(payload_type, body)), what the resulting contract or receipt records",
            "lineage_hash": "Contract.intent_lineage_hash = SHA-256(UTF-8 bytes of the root's intent)",
        },
        "broker_keys": [{"key_id": BROKER_KEY_ID, "public_key": hexs(BROKER.public_key), "current": True}],
        "cases": cases,
        # Root first, as GetChain returns it; the leaf's id is the last case's id.
        "chain": ["contract-root", "contract-child"],
        "negative": negatives,
    }
    self_check(document, [root_sealed, child_sealed])
    return document


def self_check(document: dict, chain: list[pb.Sealed]) -> None:
    """The client's own verifier accepts every positive case and refuses every
    negative one (a generator bug must not reach the file)."""
    keys = BrokerKeys([pb.BrokerKey(key_id=k["key_id"], public_key=bytes.fromhex(k["public_key"])) for k in document["broker_keys"]])
    for c in document["cases"]:
        assert verify_pae_signature(
            c["payload_type"], bytes.fromhex(c["body"]), bytes.fromhex(c["signature"]), bytes.fromhex(c["public_key"])
        ), c["name"]
        if c["form"] == "sealed":
            cls = {"Contract": pb.Contract, "Receipt": pb.Receipt, "Session": pb.Session}[c["message"].rsplit(".", 1)[1]]
            verify_sealed(pb.Sealed.FromString(bytes.fromhex(c["signed"])), keys, cls)
    by_name = {c["name"]: c for c in document["cases"]}
    ids = [by_name[name]["id"] for name in document["chain"]]
    verified = verify_chain(chain, keys, bytes.fromhex(ids[-1]))
    assert [v.contract_id.hex() for v in verified] == ids
    receipt_case = by_name["receipt-refused"]
    verify_receipt(pb.Sealed.FromString(bytes.fromhex(receipt_case["signed"])), keys, bytes.fromhex(receipt_case["id"]))
    for n in document["negative"]:
        assert not verify_pae_signature(
            n["payload_type"], bytes.fromhex(n["body"]), bytes.fromhex(n["signature"]), bytes.fromhex(n["public_key"])
        ), n["name"]
    try:
        bad = pb.Sealed(payload=bytes.fromhex(document["negative"][0]["body"]), signature=chain[0].signature)
        verify_chain([bad], keys)
    except VerificationError:
        pass
    else:
        raise AssertionError("a flipped contract verified")


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed file instead of writing it")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else None
        if current != text:
            print(f"{args.output} is not what scripts/signing-vectors.py generates: rerun it and commit", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output.relative_to(REPO_ROOT) if args.output.is_relative_to(REPO_ROOT) else args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
