#!/usr/bin/env python3
"""A three-hop delegation, verified offline.

orchestrator --(root, budget 100)--> planner --(50, liable)--> coder --(20, liable)--> reviewer (5)

Every request is signed here with the agent's own key; every contract that
comes back is checked against the broker's published keys, and finally the
whole chain (4 contracts) is fetched, with the orchestrator's read session,
and verified offline: the leaf's signature, the hash links back to the root,
and every hop's terms against its parent's.

    delegation-broker serve --listen 127.0.0.1:50051 --data-dir /tmp/broker --config broker.toml
    python examples/three_hops.py --target 127.0.0.1:50051 [--attestor-seed HEX]

With --attestor-seed (the 32-byte seed, hex, of an attestor the broker's
config trusts) each delegate carries an attestation and each contract records
its hop's trust factor and the attenuated cumulative trust; without it the broker finds no trust source (factor 0) and
the tree's policy must allow that (min_cumulative_trust_ppm 0).
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
    verify_chain,
    verify_contract,
    verify_receipt,
)

INTENT = "Fix the token refresh bug in src/auth/ and document it"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=os.environ.get("BROKER_ADDR", "127.0.0.1:50051"))
    parser.add_argument("--attestor-seed", default=os.environ.get("ATTESTOR_SEED"))
    args = parser.parse_args()
    attestor = Agent.from_seed(bytes.fromhex(args.attestor_seed)) if args.attestor_seed else None

    with grpc.insecure_channel(args.target) as channel:
        orchestrator, planner, coder, reviewer = (Agent.generate() for _ in range(4))
        # Reads (GetChain below) need a session: this stub's calls carry the
        # orchestrator's, opened now and renewed when due. It may read its own tree.
        stub = session_stub(channel, orchestrator)
        keys = BrokerKeys.fetch(stub)  # the broker's published verifying keys

        # 1. The orchestrator opens the root: intent, budget, deadline, policy.
        request = orchestrator.open_root(
            intent=INTENT,
            budget=100,
            deadline_ms=now_ms() + 3_600_000,
            policy=pb.Policy(max_depth=4, max_children=8, min_cumulative_trust_ppm=500_000 if attestor else 0),
            write_scope=["src", "docs"],
        )
        root = call_idempotent(stub.OpenRoot, request).issued
        lineage = verify_contract(root.contract, keys, root.contract_id).contract.intent_lineage_hash

        # 2. Three hops, each signed by the holder of the parent contract.
        hops = [
            (orchestrator, planner, dict(budget=50, liability=pb.LIABILITY_DELEGATE, predicate="result.schema_valid",
                                         min_retry_cost=10, write_scope=["src"]), 0.9),
            (planner, coder, dict(budget=20, liability=pb.LIABILITY_DELEGATE, predicate="result.tests_pass",
                                  min_retry_cost=5, write_scope=["src/auth"]), 0.8),
            (coder, reviewer, dict(budget=5, liability=pb.LIABILITY_PRINCIPAL, write_scope=["src/auth"]), 0.75),
        ]
        parent = root.contract_id
        for holder, delegate, terms, factor in hops:
            body = pb.DelegateBody(
                parent_id=parent,
                intent_lineage_hash=lineage,
                task=f"hop to {delegate.key_id}",
                delegate_public_key=delegate.public_key,
                escalation_channel="broker://escalate" if terms["liability"] == pb.LIABILITY_DELEGATE else "",
                **terms,
            )
            if attestor:
                body.delegate_attestation.CopyFrom(
                    attestor.attest(delegate.public_key, factor, now_ms() + 600_000, "example"))
            try:
                # Built and signed once; retries resend these exact bytes.
                response = call_idempotent(stub.Delegate, holder.delegate(body))
            except grpc.RpcError as e:
                info = error_info(e)
                print(f"Delegate failed: {e.code().name} {info.reason if info else ''} {dict(info.metadata) if info else ''}")
                return 1
            if response.WhichOneof("outcome") == "refused":
                receipt = verify_receipt(response.refused.receipt, keys, response.refused.receipt_id).message
                for v in receipt.violations:
                    print(f"refused: {pb.InvariantCode.Name(v.code)}: {v.detail}")
                return 1
            parent = verify_contract(response.issued.contract, keys, response.issued.contract_id).contract_id

        # 3. Anyone holding the published keys can verify the whole chain offline:
        #    one signature (the leaf's), the hash links to the root, and each
        #    hop's terms against its parent's. The effective predicate is derived.
        chain = stub.GetChain(pb.GetChainRequest(contract_id=parent)).chain
        try:
            verified = verify_chain(chain, keys, parent)
        except VerificationError as e:
            print(f"chain does not verify: {e}")
            return 1
        for v, state in zip(verified, chain, strict=True):
            c = v.contract
            print(f"depth {c.depth}: budget {c.budget} (residual {state.ledger.residual}), "
                  f"{pb.Liability.Name(c.liability)}, predicate {v.effective_predicate or '-'!r}, "
                  f"cumulative trust {c.cumulative_trust_ppm} ppm ({pb.TrustSource.Name(c.trust_source)})")
        print(f"verified a chain of {len(verified)} contracts: {len(verified) - 1} hash links and the leaf's "
              f"signature by broker key {verified[-1].key_id}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
