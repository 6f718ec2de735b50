import { Agent, BrokerKeys, callIdempotent, nowMs, pb, sessionClient, toHex, verifyChain, verifyContract,
         verifyReceipt } from "@delegation-broker/client";
import { createNodeTransport } from "@delegation-broker/client/node";

const [orchestrator, planner, coder] = [Agent.generate(), Agent.generate(), Agent.generate()];
// Every call of this client carries the orchestrator's read session (reads need one; see "Reads").
const client = await sessionClient(createNodeTransport(process.env.BROKER_ADDRESS ?? "127.0.0.1:50051"), orchestrator);
const keys = await BrokerKeys.fetch(client);            // GetBrokerKeys: current and retired keys

// The root: signed once (fresh timestamp and nonce); callIdempotent resends these exact bytes.
const root = (await callIdempotent(client.openRoot, orchestrator.openRoot({
  intent: "Fix the token refresh bug in src/auth/", budget: 100n, deadlineMs: nowMs() + 3_600_000n,
  policy: { maxDepth: 4, maxChildren: 8 }, writeScope: ["src"],
}))).issued!;
const lineage = verifyContract(root.contract!, keys, root.contractId).contract.intentLineageHash;

// One hop: signed by the parent's holder, verified as it comes back (a refusal is a signed receipt).
async function delegate(holder: Agent, body: Parameters<Agent["delegate"]>[0]): Promise<Uint8Array> {
  const response = await callIdempotent(client.delegate, holder.delegate(body));
  if (response.outcome.case === "refused") {
    const refusal = verifyReceipt(response.outcome.value.receipt!, keys, response.outcome.value.receiptId).message;
    throw new Error(`refused: ${refusal.violations.map((v) => pb.InvariantCode[v.code]).join(", ")}`);
  }
  const issued = response.outcome.value!;
  return verifyContract(issued.contract!, keys, issued.contractId).contractId;
}

// root → child: the planner, liable (a predicate, an escalation channel, retry headroom).
const plannerId = await delegate(orchestrator, {
  parentId: root.contractId, intentLineageHash: lineage, task: "plan the fix",
  delegatePublicKey: planner.publicKey, budget: 50n, liability: pb.Liability.DELEGATE,
  predicate: "result.schema_valid", escalationChannel: "broker://escalate", minRetryCost: 10n, writeScope: ["src"],
});
// child → grandchild: signed by the planner, the child's holder; liable too, a narrower scope.
const coderId = await delegate(planner, {
  parentId: plannerId, intentLineageHash: lineage, task: "patch src/auth/token.rs",
  delegatePublicKey: coder.publicKey, budget: 20n, liability: pb.Liability.DELEGATE,
  predicate: "result.tests_pass", escalationChannel: "broker://escalate", minRetryCost: 5n, writeScope: ["src/auth"],
});

// Anyone holding the published keys verifies the whole chain offline.
const chain = verifyChain((await client.getChain({ contractId: coderId })).chain, keys, coderId);
for (const hop of chain) {
  console.log(hop.contract.depth, toHex(hop.contractId).slice(0, 16), hop.contract.budget, JSON.stringify(hop.effectivePredicate));
}
// 0 … 100n ""   1 … 50n "(result.schema_valid\n)"   2 … 20n "(result.schema_valid\n) && (result.tests_pass\n)":
// the coder is judged on both predicates, its own and the one it inherits from the liable planner.
