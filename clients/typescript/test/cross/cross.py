#!/usr/bin/env python3
"""The Python side of the TypeScript suite's cross-language test.

Uses the Python client (``delegation_broker``, installed from
clients/python by run-tests.sh into clients/typescript/.venv-python):

    cross.py verify-chains KEYS_HEX DIR [CONTRACT_ID_HEX]
        every DIR/*.bin (a serialized GetChainResponse), verified with
        verify_chain: one line per file, sorted by name, "NAME" + TAB + what
        `delegation-broker verify --chain` would print (its lines joined by
        " | "), or "error: ..." when it does not verify.
    cross.py verify-receipts KEYS_HEX DIR
        every DIR/*.bin (a serialized Sealed receipt), with verify_receipt:
        "NAME" TAB "ok receipt ID kind=KIND contract=ID" or "error: ...".
    cross.py verify-envelopes PUBLIC_KEY_HEX DIR
        every DIR/*.bin (a serialized Envelope), with verify_signature:
        "NAME" TAB "ok" or "error".
    cross.py issue ADDRESS OUT_DIR
        Python agents open a root and delegate three hops (orchestrator ->
        planner -> executor -> reviewer, the first two liable), ask for one
        refused child, accept one contract; writes OUT_DIR/chain.bin (GetChain
        of the leaf, read with the orchestrator's session), refusal.bin and
        accepted.bin (Sealed receipts), request.bin (the Delegate envelope the
        orchestrator signed) and orchestrator.hex (its public key).

KEYS_HEX: the broker's public keys, hex, comma-separated. A file that makes
the verifier raise anything but VerificationError prints "crash: ...".
"""

from __future__ import annotations

import sys
from pathlib import Path

import grpc

from delegation_broker import (
    Agent,
    BrokerKeys,
    VerificationError,
    key_id,
    now_ms,
    pb,
    session_stub,
    verify_chain,
    verify_contract,
    verify_receipt,
    verify_signature,
)


def keys_of(text: str) -> BrokerKeys:
    return BrokerKeys(pb.BrokerKey(key_id=key_id(bytes.fromhex(k)), public_key=bytes.fromhex(k)) for k in text.split(","))


def rust_debug(text: str) -> str:
    """``format!("{:?}", text)`` in Rust, for the printable text predicates hold."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t", "\0": "\\0"}
    return '"' + "".join(escapes.get(ch, ch if ch.isprintable() else f"\\u{{{ord(ch):x}}}") for ch in text) + '"'


def chain_lines(verified) -> list[str]:
    lines = [
        f"depth={v.contract.depth} id={v.contract_id.hex()} delegate={key_id(v.contract.delegate_public_key)} "
        f"budget={v.contract.budget} deadline_ms={v.contract.deadline_ms} trust_ppm={v.contract.cumulative_trust_ppm} "
        f"liability={pb.Liability.Name(v.contract.liability)} effective_predicate={rust_debug(v.effective_predicate)}"
        for v in verified
    ]
    return [*lines, f"ok chain of {len(verified)} contracts"]


def each(directory: str):
    for path in sorted(Path(directory).glob("*.bin")):
        yield path.stem, path.read_bytes()


def verdict(check) -> str:
    try:
        return check()
    except VerificationError as e:
        return f"error: {e}"
    except Exception as e:  # noqa: BLE001 - reported, and the TypeScript test fails on it
        return f"crash: {type(e).__name__}: {e}"


def verify_chains(keys_hex: str, directory: str, contract_id: str | None = None) -> None:
    keys = keys_of(keys_hex)
    leaf = bytes.fromhex(contract_id) if contract_id else None
    for name, data in each(directory):
        line = verdict(lambda: " | ".join(chain_lines(verify_chain(pb.GetChainResponse.FromString(data), keys, leaf))))
        print(f"{name}\t{line}")


def verify_receipts(keys_hex: str, directory: str) -> None:
    keys = keys_of(keys_hex)

    def check(data: bytes) -> str:
        verified = verify_receipt(pb.Sealed.FromString(data), keys)
        return (f"ok receipt {verified.id.hex()} kind={pb.ReceiptKind.Name(verified.message.kind)} "
                f"contract={verified.message.contract_id.hex()}")

    for name, data in each(directory):
        print(f"{name}\t{verdict(lambda: check(data))}")


def verify_envelopes(public_key_hex: str, directory: str) -> None:
    key = bytes.fromhex(public_key_hex)
    for name, data in each(directory):
        print(f"{name}\t{'ok' if verify_signature(pb.Envelope.FromString(data), key) else 'error'}")


def issue(address: str, out: str) -> None:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with grpc.insecure_channel(address) as channel:
        orchestrator, planner, executor, reviewer = (Agent.generate() for _ in range(4))
        stub = session_stub(channel, orchestrator)
        keys = BrokerKeys.fetch(stub)
        root = stub.OpenRoot(orchestrator.open_root(
            intent="Python-issued: fix the token refresh bug", budget=100, deadline_ms=now_ms() + 3_600_000,
            policy=pb.Policy(max_depth=4, max_children=8), predicate="result.schema_valid", write_scope=["src", "docs"],
            labels={"client": "python"}), timeout=10).issued
        lineage = verify_contract(root.contract, keys, root.contract_id).contract.intent_lineage_hash
        parent = root.contract_id
        hops = [
            (orchestrator, planner, dict(budget=50, liability=pb.LIABILITY_DELEGATE, predicate="result.tests_pass",
                                         escalation_channel="broker://escalate", min_retry_cost=10, write_scope=["src"])),
            (planner, executor, dict(budget=20, liability=pb.LIABILITY_DELEGATE, escalation_channel="broker://escalate",
                                     min_retry_cost=5, write_scope=["src/auth"])),
            (executor, reviewer, dict(budget=5, liability=pb.LIABILITY_PRINCIPAL, predicate="result.reviewed",
                                      write_scope=["src/auth/token.rs"])),
        ]
        request = None
        for holder, delegate, terms in hops:
            signed = holder.delegate(parent_id=parent, intent_lineage_hash=lineage, task="ü — a Python hop",
                                     delegate_public_key=delegate.public_key, **terms)
            request = request or signed
            response = stub.Delegate(signed, timeout=10)
            assert response.WhichOneof("outcome") == "issued", response
            parent = verify_contract(response.issued.contract, keys, response.issued.contract_id).contract_id
        refused = stub.Delegate(reviewer.delegate(
            parent_id=parent, intent_lineage_hash=lineage, task="too much", delegate_public_key=Agent.generate().public_key,
            budget=1_000, liability=pb.LIABILITY_PRINCIPAL), timeout=10)
        assert refused.WhichOneof("outcome") == "refused", refused
        accepted = stub.Accept(reviewer.accept(contract_id=parent), timeout=10)
        chain = stub.GetChain(pb.GetChainRequest(contract_id=parent), timeout=10)
        verify_chain(chain, keys, parent)
        (out_dir / "chain.bin").write_bytes(chain.SerializeToString())
        (out_dir / "refusal.bin").write_bytes(refused.refused.receipt.SerializeToString())
        (out_dir / "accepted.bin").write_bytes(accepted.receipt.SerializeToString())
        (out_dir / "request.bin").write_bytes(request.signed.SerializeToString())
        (out_dir / "orchestrator.hex").write_text(orchestrator.public_key.hex())


COMMANDS = {
    "verify-chains": verify_chains,
    "verify-receipts": verify_receipts,
    "verify-envelopes": verify_envelopes,
    "issue": issue,
}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(__doc__)
    COMMANDS[sys.argv[1]](*sys.argv[2:])
