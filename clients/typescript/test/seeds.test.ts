/**
 * Seed 001 (liability propagation) and seed 002 (depth and trust) replayed
 * from TypeScript against the real broker, as the Python client's
 * test_seeds.py does: every request signed here, every contract and receipt
 * verified offline on arrival.
 */

import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { Agent, equalBytes, nowMs, pb, sha256 } from "@delegation-broker/client";
import { Broker, child, codes, issuedOf, liableChild, refusalOf } from "./support.js";

const SEED_001_PREDICATE = "result.schema_valid && result.within_scope";

let broker: Broker;
before(async () => {
  broker = await Broker.start("seeds");
});
after(async () => {
  await broker.close();
});

test("seed 001: the executor without retry headroom is refused (NO_RETRY_HEADROOM), then 13 is issued, the planner keeps 12", async () => {
  const [orchestrator, planner, executor] = [Agent.generate(), Agent.generate(), Agent.generate()];
  const root = await broker.openRoot(orchestrator, { budget: 100n });

  const toPlanner = liableChild(root.id, root.lineage, planner, 25n, SEED_001_PREDICATE, {
    minRetryCost: 12n,
    deadlineMs: nowMs() + 90_000n,
  });
  const plannerIssued = issuedOf(await broker.delegate(orchestrator, toPlanner));
  const plannerId = plannerIssued.contractId;
  assert.equal((await broker.chain(plannerId)).at(-1)!.effectivePredicate, `(${SEED_001_PREDICATE}\n)`);
  assert.equal(plannerIssued.contract.liability, pb.Liability.DELEGATE);
  assert.equal(plannerIssued.contract.predicate, SEED_001_PREDICATE);

  // The planner does not forward the predicate; the broker keeps it anyway.
  const toExecutor = liableChild(plannerId, root.lineage, executor, 20n, "", { minRetryCost: 12n, deadlineMs: nowMs() + 60_000n });
  const receipt = refusalOf(await broker.delegate(planner, toExecutor));
  assert.deepEqual(codes(receipt), [pb.InvariantCode.NO_RETRY_HEADROOM]);
  assert.equal(receipt.primary, pb.InvariantCode.NO_RETRY_HEADROOM);
  assert.deepEqual([receipt.violations[0]!.requested, receipt.violations[0]!.allowed], ["5", "12"]);
  assert.ok(equalBytes(receipt.contractId, plannerId));
  assert.ok(equalBytes(receipt.rootId, root.id));
  assert.ok(equalBytes(receipt.requesterPublicKey, planner.publicKey));
  assert.equal((await broker.ledger(plannerId)).reserved, 0n, "a refusal reserves nothing");

  const executorIssued = issuedOf(await broker.delegate(planner, { ...toExecutor, budget: 13n }));
  const executorContract = executorIssued.contract;
  assert.equal(executorContract.depth, 2);
  assert.equal(executorContract.budget, 13n);
  // Derived from the chain (and the broker's copy says the same).
  const chain = await broker.chain(executorIssued.contractId);
  assert.equal(chain.at(-1)!.effectivePredicate, `(${SEED_001_PREDICATE}\n)`);
  assert.equal((await broker.state(executorIssued.contractId)).effectivePredicate, `(${SEED_001_PREDICATE}\n)`);
  assert.ok(equalBytes(chain.at(-1)!.principalPublicKey!, planner.publicKey));
  assert.equal(executorContract.predicate, "");
  assert.equal(executorContract.minRetryCost, 12n);
  const plannerLedger = await broker.ledger(plannerId);
  assert.deepEqual([plannerLedger.residual, plannerLedger.reserved, plannerLedger.openChildren], [12n, 13n, 1]);
  assert.equal((await broker.ledger(executorIssued.contractId)).residual, 13n);
  assert.equal((await broker.ledger(root.id)).reserved, 25n);
});

test("seed 001: a liable contract without predicate or escalation is refused for both", async () => {
  const [orchestrator, delegate] = [Agent.generate(), Agent.generate()];
  const root = await broker.openRoot(orchestrator);
  const bad = child(root.id, root.lineage, delegate, 20n, {
    liability: pb.Liability.DELEGATE,
    minRetryCost: 12n,
    minRetryLatencyMs: 15_000n,
    deadlineMs: nowMs() + 60_000n,
  });
  const receipt = refusalOf(await broker.delegate(orchestrator, bad));
  assert.deepEqual(codes(receipt), [pb.InvariantCode.LIABILITY_WITHOUT_PREDICATE, pb.InvariantCode.LIABILITY_WITHOUT_ESCALATION]);
  assert.equal(receipt.primary, pb.InvariantCode.LIABILITY_WITHOUT_PREDICATE);
});

test("seed 002: the fifth hop exceeds depth four", async () => {
  const agents = Array.from({ length: 6 }, () => Agent.generate());
  const root = await broker.openRoot(agents[0]!, { maxDepth: 4 });
  let parent = root.id;
  for (let hop = 1; hop <= 4; hop++) {
    const issued = issuedOf(await broker.delegate(agents[hop - 1]!, child(parent, root.lineage, agents[hop]!, 10n)));
    assert.equal(issued.contract.depth, hop);
    assert.equal((await broker.chain(issued.contractId)).length, hop + 1);
    parent = issued.contractId;
  }
  const receipt = refusalOf(await broker.delegate(agents[4]!, child(parent, root.lineage, agents[5]!, 5n)));
  assert.deepEqual(codes(receipt), [pb.InvariantCode.DEPTH_EXCEEDED]);
  assert.deepEqual([receipt.violations[0]!.requested, receipt.violations[0]!.allowed], ["5", "4"]);
  assert.ok(equalBytes(receipt.contractId, parent));
});

test("seed 002: trust attenuates hop by hop below the minimum; a diluted intent is refused", async () => {
  const agents = Array.from({ length: 4 }, () => Agent.generate());
  const root = await broker.openRoot(agents[0]!, { minTrust: 400_000 });
  let parent = root.id;
  for (const [hop, factor, cumulative] of [[1, 0.9, 900_000], [2, 0.8, 720_000]] as const) {
    const body = child(parent, root.lineage, agents[hop]!, 10n, { delegateAttestation: broker.attest(agents[hop]!, factor) });
    const issued = issuedOf(await broker.delegate(agents[hop - 1]!, body));
    assert.equal(issued.contract.cumulativeTrustPpm, cumulative);
    assert.equal(issued.contract.factorPpm, Math.round(factor * 1_000_000));
    assert.equal(issued.contract.trustSource, pb.TrustSource.ATTESTATION);
    assert.ok(equalBytes(issued.contract.attestationDigest, sha256(body.delegateAttestation!.payload!)));
    parent = issued.contractId;
  }
  const body = child(parent, root.lineage, agents[3]!, 5n, { delegateAttestation: broker.attest(agents[3]!, 0.5) });
  const receipt = refusalOf(await broker.delegate(agents[2]!, body));
  assert.deepEqual(codes(receipt), [pb.InvariantCode.TRUST_ATTENUATED]);
  assert.deepEqual([receipt.violations[0]!.requested, receipt.violations[0]!.allowed], ["360000", "400000"]);

  const orchestrator = Agent.generate();
  const other = await broker.openRoot(orchestrator);
  const paraphrase = sha256(new TextEncoder().encode("Improve auth somehow"));
  const diluted = refusalOf(await broker.delegate(orchestrator, child(other.id, paraphrase, Agent.generate(), 10n)));
  assert.deepEqual(codes(diluted), [pb.InvariantCode.INTENT_DILUTED]);
});
