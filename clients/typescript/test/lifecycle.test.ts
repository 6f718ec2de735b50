/**
 * Seed 001's failure replayed through the lifecycle helpers (mirrors the
 * Python client's examples/seed_001_lifecycle.py): the executor writes
 * docs/auth.md outside src/auth and claims success, the broker judges it on
 * its host's observations (REJECTED on result.within_scope), the planner
 * escalates; every receipt verified. Also decline and adjudicate, and what
 * a stranger to a tree is told (what an unknown contract gets).
 */

import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { Code } from "@connectrpc/connect";
import { Agent, callIdempotent, equalBytes, nowMs, pb, verifyReceipt, watch } from "@delegation-broker/client";

import { Broker, ESCALATION, assertUnknowable, child, issuedOf, refusal, requestDigest } from "./support.js";

const PREDICATE = "result.schema_valid && result.within_scope";
const PATCH_SCHEMA = '{"type":"object","required":["patch"],"properties":{"patch":{"type":"string"}}}';

let broker: Broker;
before(async () => {
  broker = await Broker.start("lifecycle");
});
after(async () => {
  await broker.close();
});

test("seed 001 end to end: accept, observe, complete REJECTED on within_scope, escalate", async () => {
  const [orchestrator, planner, executor, host] = Array.from({ length: 4 }, () => Agent.generate()) as [Agent, Agent, Agent, Agent];
  const root = await broker.openRoot(orchestrator, { budget: 28n, retryHeadroom: false, maxChildren: 8 });
  const issue = async (holder: Agent, fields: Parameters<Agent["delegate"]>[0]) =>
    issuedOf(await broker.delegate(holder, { intentLineageHash: root.lineage, escalationChannel: ESCALATION, liability: pb.Liability.DELEGATE, minRetryCost: 12n, ...fields })).contractId;
  const receipt = async <R extends { signed?: pb.Envelope }>(
    call: (request: R) => Promise<{ receiptId: Uint8Array; receipt?: pb.Sealed }>,
    request: R,
    kind: pb.ReceiptKind,
  ) => {
    const response = await callIdempotent(call, request);
    const verified = await broker.checkReceipt(response, kind);
    assert.ok(equalBytes(verified.requestDigest, requestDigest(request)), "the receipt names the request that caused it");
    return verified;
  };

  const plannerId = await issue(orchestrator, { parentId: root.id, task: "plan the fix", delegatePublicKey: planner.publicKey, budget: 25n, predicate: PREDICATE, writeScope: ["src"] });
  await receipt(broker.client.accept, planner.accept({ contractId: plannerId }), pb.ReceiptKind.ACCEPTED);
  const executorId = await issue(planner, {
    parentId: plannerId,
    task: "patch src/auth/token.rs",
    delegatePublicKey: executor.publicKey,
    budget: 20n,
    writeScope: ["src/auth"],
    hostPublicKey: host.publicKey,
    resultSchemaJson: PATCH_SCHEMA,
  });
  await receipt(broker.client.accept, executor.accept({ contractId: executorId }), pb.ReceiptKind.ACCEPTED);

  const observed = await receipt(
    broker.client.recordReceipts,
    host.recordReceipts({
      contractId: executorId,
      observations: [
        { kind: pb.ObservationKind.TOOL_CALL, tool: "edit", units: 6n, atMs: nowMs() },
        { kind: pb.ObservationKind.MUTATION, path: "src/auth/token.rs", units: 6n, atMs: nowMs() },
        { kind: pb.ObservationKind.MUTATION, path: "docs/auth.md", units: 6n, atMs: nowMs() },
      ],
    }),
    pb.ReceiptKind.OBSERVED,
  );
  assert.equal(observed.observations, 3);
  const done = (
    await receipt(
      broker.client.complete,
      executor.complete({
        contractId: executorId,
        outputJson: '{"patch":"--- a/src/auth/token.rs"}',
        report: { status: "done", summary: "fixed the refresh" },
        claim: "success",
        consumed: 18n,
      }),
      pb.ReceiptKind.COMPLETED,
    )
  ).completion!;
  assert.equal(done.verdict, pb.Verdict.REJECTED);
  assert.deepEqual(done.refusedCriteria.map((r) => r.criterion), ["result.within_scope"]);
  assert.equal(done.claim, "success");
  assert.deepEqual(done.outOfScopePaths, ["docs/auth.md"]);
  assert.deepEqual([done.consumed, done.returned, done.schemaValid, done.withinScope], [18n, 2n, true, false]);

  const escalated = (await receipt(broker.client.escalate, planner.escalate({ contractId: plannerId, reason: "executor out of scope" }), pb.ReceiptKind.ESCALATED)).escalation!;
  assert.deepEqual([escalated.principalResidual, escalated.retryFeasible], [10n, false]);

  // The whole story, from the root's watch: 8 events, each verified.
  const w = watch(broker.client, root.id);
  const kinds: string[] = [];
  for await (const event of w) {
    kinds.push(event.contract ? "contract" : pb.ReceiptKind[event.receipt!.kind]!);
    if (event.receipt?.kind === pb.ReceiptKind.ESCALATED) break;
  }
  assert.deepEqual(kinds, ["contract", "contract", "ACCEPTED", "contract", "ACCEPTED", "OBSERVED", "COMPLETED", "ESCALATED"]);
});

test("decline returns the reservation; adjudicate records the principal's verdict", async () => {
  const [orchestrator, worker, other] = [Agent.generate(), Agent.generate(), Agent.generate()];
  const root = await broker.openRoot(orchestrator);
  const declined = issuedOf(await broker.delegate(orchestrator, child(root.id, root.lineage, worker, 30n))).contractId;
  const decline = await broker.client.decline(worker.decline({ contractId: declined, reason: "busy" }));
  assert.equal((await broker.checkReceipt(decline, pb.ReceiptKind.DECLINED)).reason, "busy");
  assert.equal((await broker.ledger(root.id)).reserved, 0n);

  const judged = issuedOf(await broker.delegate(orchestrator, child(root.id, root.lineage, other, 10n))).contractId;
  await broker.checkReceipt(await broker.client.accept(other.accept({ contractId: judged })), pb.ReceiptKind.ACCEPTED);
  const completion = (await broker.checkReceipt(await broker.client.complete(other.complete({ contractId: judged, outputJson: "{}", claim: "done" })), pb.ReceiptKind.COMPLETED)).completion!;
  assert.equal(completion.verdict, pb.Verdict.PENDING_PRINCIPAL, "liability-retaining, no predicate: the principal judges");
  const adjudicated = await broker.client.adjudicate(orchestrator.adjudicate({ contractId: judged, verdict: pb.Verdict.ACCEPTED, reason: "looks right" }));
  const receipt = verifyReceipt(adjudicated.receipt!, broker.keys, adjudicated.receiptId).message;
  assert.equal(receipt.kind, pb.ReceiptKind.ADJUDICATED);
  assert.equal(receipt.completion!.verdict, pb.Verdict.ACCEPTED);
});

test("a stranger's lifecycle call is answered as for an unknown contract; a party is told why", async () => {
  const [orchestrator, worker, host, stranger] = Array.from({ length: 4 }, () => Agent.generate()) as [Agent, Agent, Agent, Agent];
  const root = await broker.openRoot(orchestrator);
  const contractId = issuedOf(await broker.delegate(orchestrator, child(root.id, root.lineage, worker, 10n))).contractId;
  await broker.checkReceipt(await broker.client.accept(worker.accept({ contractId, hostPublicKey: host.publicKey })), pb.ReceiptKind.ACCEPTED);
  const client = broker.client;
  const observations = [{ kind: pb.ObservationKind.TOOL_CALL, tool: "ls", units: 1n, atMs: nowMs() }];
  const calls: [string, (id: Uint8Array) => Promise<unknown>][] = [
    ["Accept", (id) => client.accept(stranger.accept({ contractId: id }))],
    ["Decline", (id) => client.decline(stranger.decline({ contractId: id, reason: "no" }))],
    ["Complete", (id) => client.complete(stranger.complete({ contractId: id, outputJson: "{}", claim: "done" }))],
    ["Escalate", (id) => client.escalate(stranger.escalate({ contractId: id, reason: "stuck" }))],
    ["Revoke", (id) => client.revoke(stranger.revoke({ contractId: id, reason: "mine now" }))],
    ["RecordReceipts", (id) => client.recordReceipts(stranger.recordReceipts({ contractId: id, observations }))],
    ["Adjudicate", (id) => client.adjudicate(stranger.adjudicate({ contractId: id, verdict: pb.Verdict.ACCEPTED, reason: "fine" }))],
  ];
  for (const id of [contractId, root.id]) {
    for (const [name, call] of calls) {
      const [, , info] = await assertUnknowable(call, id, name);
      assert.deepEqual(info, { what: "contract", id: "<id>" }, name);
    }
  }
  // The tree's parties are told why they are refused.
  const why = async (call: () => Promise<unknown>) => (await refusal(call)).slice(0, 2);
  assert.deepEqual(await why(() => client.revoke(worker.revoke({ contractId, reason: "x" }))), [Code.PermissionDenied, "NOT_ANCESTOR"]);
  assert.deepEqual(await why(() => client.recordReceipts(worker.recordReceipts({ contractId, observations }))), [Code.PermissionDenied, "NOT_HOST"]);
  assert.deepEqual(await why(() => client.escalate(host.escalate({ contractId, reason: "x" }))), [Code.PermissionDenied, "NOT_DELEGATE"]);
  assert.equal((await broker.state(contractId)).status, pb.ContractStatus.ACCEPTED, "nothing changed");
});
