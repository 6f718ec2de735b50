#!/usr/bin/env python3
"""Seed 001's failure, replayed through the contract lifecycle.

orchestrator --(root 28)--> planner --(25, liable: schema_valid && within_scope)--> executor (20, liable, host, src/auth)

The executor's host records a tool call and two mutations, one of them
outside src/auth; the executor claims success anyway. The broker judges the
completion on what the host observed (REJECTED on result.within_scope,
claim kept beside the verdict), settles the budget, and the stranded planner
escalates. A watch on the root, dropped halfway and resumed from its cursor,
sees every event exactly once, each verified against the broker's keys.

    delegation-broker serve --listen 127.0.0.1:50051 --data-dir /tmp/broker
    python examples/seed_001_lifecycle.py --target 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from delegation_broker import (
    Agent,
    BrokerKeys,
    VerificationError,
    call_idempotent,
    error_info,
    now_ms,
    pb,
    session_stub,
    verify_contract,
    verify_receipt,
    watch,
)

INTENT = "Fix the token refresh bug in src/auth/ and document it"
PREDICATE = "result.schema_valid && result.within_scope"
PATCH_SCHEMA = '{"type":"object","required":["patch"],"properties":{"patch":{"type":"string"}}}'


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=os.environ.get("BROKER_ADDR", "127.0.0.1:50051"))
    args = parser.parse_args()

    with grpc.insecure_channel(args.target) as channel:
        orchestrator, planner, executor, host = (Agent.generate() for _ in range(4))
        # The watch below is a read: this stub's calls carry the orchestrator's
        # session (opened now, renewed when due). It may read its own tree.
        stub = session_stub(channel, orchestrator)
        keys = BrokerKeys.fetch(stub)

        def receipt(rpc, request) -> pb.Receipt:
            """Sends a signed lifecycle request (retrying safely) and verifies its receipt."""
            response = call_idempotent(getattr(stub, rpc), request)
            return verify_receipt(response.receipt, keys, response.receipt_id).message

        def issue(holder: Agent, **terms) -> bytes:
            response = call_idempotent(stub.Delegate, holder.delegate(
                intent_lineage_hash=lineage, escalation_channel="broker://escalate",
                liability=pb.LIABILITY_DELEGATE, min_retry_cost=12, **terms))
            if response.WhichOneof("outcome") != "issued":
                refusal = verify_receipt(response.refused.receipt, keys).message
                raise SystemExit(f"refused: {[pb.InvariantCode.Name(v.code) for v in refusal.violations]}")
            return verify_contract(response.issued.contract, keys, response.issued.contract_id).contract_id

        # Seed 001's chain: retry headroom off, or the executor could not be issued at all.
        root = call_idempotent(stub.OpenRoot, orchestrator.open_root(
            intent=INTENT, budget=28, deadline_ms=now_ms() + 3_600_000, write_scope=["src", "docs"],
            policy=pb.Policy(max_depth=4, max_children=8, disable_retry_headroom=True))).issued
        lineage = verify_contract(root.contract, keys, root.contract_id).contract.intent_lineage_hash
        root_id = root.contract_id

        # The orchestrator watches its tree; the connection drops after three events.
        events = watch(stub, root_id, keys=keys, timeout=60)

        planner_id = issue(orchestrator, parent_id=root_id, task="plan the fix", delegate_public_key=planner.public_key,
                           budget=25, predicate=PREDICATE, write_scope=["src"])
        receipt("Accept", planner.accept(contract_id=planner_id))
        executor_id = issue(planner, parent_id=planner_id, task="patch src/auth/token.rs",
                            delegate_public_key=executor.public_key, budget=20, write_scope=["src/auth"],
                            host_public_key=host.public_key, result_schema_json=PATCH_SCHEMA)
        receipt("Accept", executor.accept(contract_id=executor_id))
        seen = [next(events) for _ in range(3)]
        events.cancel()

        # The host records what it saw; the executor claims success.
        observed = [
            pb.Observation(kind=pb.OBSERVATION_KIND_TOOL_CALL, tool="edit", units=6, at_ms=now_ms()),
            pb.Observation(kind=pb.OBSERVATION_KIND_MUTATION, path="src/auth/token.rs", units=6, at_ms=now_ms()),
            pb.Observation(kind=pb.OBSERVATION_KIND_MUTATION, path="docs/auth.md", units=6, at_ms=now_ms()),
        ]
        receipt("RecordReceipts", host.record_receipts(contract_id=executor_id, observations=observed))
        done = receipt("Complete", executor.complete(
            contract_id=executor_id, output_json='{"patch":"--- a/src/auth/token.rs"}',
            report=pb.TypedReport(status="done", summary="fixed the refresh"), claim="success", consumed=18)).completion
        print(f"executor: {pb.Verdict.Name(done.verdict)} on {[r.criterion for r in done.refused_criteria]} "
              f"(claimed {done.claim!r}; out of scope {list(done.out_of_scope_paths)}), "
              f"consumed {done.consumed}, returned {done.returned}")

        escalated = receipt("Escalate", planner.escalate(contract_id=planner_id, reason="executor out of scope"))
        print(f"planner: escalated, principal residual {escalated.escalation.principal_residual}, "
              f"retry feasible {escalated.escalation.retry_feasible}")

        # Back online: resume after the last event seen, until the escalation.
        events = events.resume(timeout=60)
        with events:
            for event in events:
                seen.append(event)
                if event.receipt and event.receipt.kind == pb.RECEIPT_KIND_ESCALATED:
                    break
        cursors = [e.cursor for e in seen]
        assert cursors == sorted(set(cursors)), "nothing twice, in commit order"
        names = [e.kind if e.contract else pb.ReceiptKind.Name(e.receipt.kind)[len("RECEIPT_KIND_"):] for e in seen]
        print(f"root watch (resumed once at cursor {cursors[2]}): {', '.join(names)}; "
              f"{len(seen)} events, all verified")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except grpc.RpcError as e:
        info = error_info(e)
        print(f"broker error {e.code().name}: {info.reason if info else ''} {e.details()}", file=sys.stderr)
        sys.exit(1)
    except VerificationError as e:
        print(f"verification failed: {e}", file=sys.stderr)
        sys.exit(1)
