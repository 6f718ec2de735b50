/**
 * A three-hop delegation, signed in TypeScript and verified offline.
 *
 *   orchestrator --(root, 100)--> planner --(50, liable)--> coder --(20, liable)--> reviewer (5)
 *
 * Every request is signed here with the agent's own key; every contract that
 * comes back is checked against the broker's published keys, and finally the
 * whole chain (4 contracts) is read with the orchestrator's session and
 * verified offline: the leaf's signature, the hash links back to the root,
 * and every hop's terms against its parent's.
 *
 *   delegation-broker serve --listen 127.0.0.1:50051 --data-dir /tmp/broker --config broker.toml
 *   node build/examples/three-hops.js 127.0.0.1:50051 [ATTESTOR_SEED_HEX]
 *
 * With an attestor seed (an attestor the broker's config trusts) each
 * delegate carries an attestation and each contract records its hop's trust;
 * without it the delegates have no trust source (factor 0) and the tree's
 * policy must allow that (minCumulativeTrustPpm 0).
 */

import {
  Agent,
  BrokerError,
  BrokerKeys,
  callIdempotent,
  fromBinary,
  fromHex,
  nowMs,
  pb,
  sessionClient,
  toBinary,
  verifyChain,
  verifyContract,
  verifyReceipt,
} from "@delegation-broker/client";
import { createNodeTransport } from "@delegation-broker/client/node";

const INTENT = "Fix the token refresh bug in src/auth/ and document it";

export async function main(target: string, attestorSeed?: string): Promise<number> {
  const attestor = attestorSeed ? Agent.fromSeed(fromHex(attestorSeed)) : undefined;
  const [orchestrator, planner, coder, reviewer] = [Agent.generate(), Agent.generate(), Agent.generate(), Agent.generate()];
  // Reads (GetChain below) need a session: this client's calls carry the
  // orchestrator's, opened now and renewed when due. It may read its own tree.
  const client = await sessionClient(createNodeTransport(target), orchestrator);
  const keys = await BrokerKeys.fetch(client); // the broker's published verifying keys

  // 1. The orchestrator opens the root: intent, budget, deadline, policy.
  const rootRequest = orchestrator.openRoot({
    intent: INTENT,
    budget: 100n, // int64 fields are bigint
    deadlineMs: nowMs() + 3_600_000n,
    policy: { maxDepth: 4, maxChildren: 8, minCumulativeTrustPpm: attestor ? 500_000 : 0 },
    writeScope: ["src", "docs"],
  });
  const root = (await callIdempotent(client.openRoot, rootRequest)).issued!;
  const lineage = verifyContract(root.contract!, keys, root.contractId).contract.intentLineageHash;

  // 2. Three hops, each signed by the holder of the parent contract.
  const hops = [
    { holder: orchestrator, delegate: planner, factor: 0.9,
      terms: { budget: 50n, liability: pb.Liability.DELEGATE, predicate: "result.schema_valid", minRetryCost: 10n, writeScope: ["src"] } },
    { holder: planner, delegate: coder, factor: 0.8,
      terms: { budget: 20n, liability: pb.Liability.DELEGATE, predicate: "result.tests_pass", minRetryCost: 5n, writeScope: ["src/auth"] } },
    { holder: coder, delegate: reviewer, factor: 0.75,
      terms: { budget: 5n, liability: pb.Liability.PRINCIPAL, writeScope: ["src/auth"] } },
  ];
  let parent = root.contractId;
  for (const { holder, delegate, factor, terms } of hops) {
    const request = holder.delegate({
      parentId: parent,
      intentLineageHash: lineage,
      task: `hop to ${delegate.keyId}`,
      delegatePublicKey: delegate.publicKey,
      escalationChannel: terms.liability === pb.Liability.DELEGATE ? "broker://escalate" : "",
      delegateAttestation: attestor?.attest(delegate.publicKey, factor, nowMs() + 600_000n, "example"),
      ...terms,
    });
    let response: pb.DelegateResponse;
    try {
      // Signed once; retries resend these exact bytes (same nonce: answered once).
      response = await callIdempotent(client.delegate, request);
    } catch (e) {
      const error = BrokerError.from(e);
      console.log(`Delegate failed: ${error.code} ${error.reason ?? ""} ${error.field ?? ""}`);
      return 1;
    }
    if (response.outcome.case === "refused") {
      const receipt = verifyReceipt(response.outcome.value.receipt!, keys, response.outcome.value.receiptId).message;
      for (const v of receipt.violations) console.log(`refused: ${pb.InvariantCode[v.code]}: ${v.detail}`);
      return 1;
    }
    const issued = response.outcome.value!;
    parent = verifyContract(issued.contract!, keys, issued.contractId).contractId;
  }

  // 3. Anyone holding the published keys can verify the whole chain offline:
  //    one signature (the leaf's), the hash links to the root, and each hop's
  //    terms against its parent's. The effective predicate is derived.
  const response = await client.getChain({ contractId: parent });
  const { chain } = response;
  const verified = verifyChain(chain, keys, parent);
  verified.forEach((v, i) => {
    const c = v.contract;
    console.log(
      `depth ${c.depth}: budget ${c.budget} (residual ${chain[i]!.ledger!.residual}), LIABILITY_${pb.Liability[c.liability]}, ` +
        `predicate ${JSON.stringify(v.effectivePredicate || "-")}, cumulative trust ${c.cumulativeTrustPpm} ppm ` +
        `(TRUST_SOURCE_${pb.TrustSource[c.trustSource]})`,
    );
  });
  console.log(`verified a chain of ${verified.length} contracts: ${verified.length - 1} hash links and the leaf's signature by broker key ${verified.at(-1)!.keyId}`);

  // 4. The chain as bytes (a serialized GetChainResponse: what `delegation-broker
  //    verify --chain FILE` reads) verifies again from those bytes alone.
  const archived = toBinary(pb.GetChainResponseSchema, response);
  const again = verifyChain(fromBinary(pb.GetChainResponseSchema, archived).chain, keys, parent);
  console.log(`archived as ${archived.length} bytes (GetChainResponse); verified again from them: ${again.length} contracts`);
  return 0;
}

if (import.meta.url === `file://${process.argv[1]}`) {
  process.exitCode = await main(process.argv[2] ?? "127.0.0.1:50051", process.argv[3]);
}
