/**
 * Idempotent replays of signed requests (the same nonce answered once), the
 * retry helper, forged requests, and typed errors (BrokerError: code,
 * ErrorReason, offending field).
 */

import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import { Code, ConnectError } from "@connectrpc/connect";
import {
  Agent,
  BrokerError,
  ERROR_DOMAIN,
  RETRYABLE,
  callIdempotent,
  codeName,
  createBrokerClient,
  equalBytes,
  nowMs,
  pb,
  verifyContract,
} from "@delegation-broker/client";
import { createNodeTransport } from "@delegation-broker/client/node";

import { Broker, assertUnknowable, child, issuedOf } from "./support.js";

let broker: Broker;
before(async () => {
  broker = await Broker.start("idempotency");
});
after(async () => {
  await broker.close();
});

/** The BrokerError a call fails with. */
async function failure(call: () => Promise<unknown>): Promise<BrokerError> {
  try {
    await call();
  } catch (error) {
    assert.ok(error instanceof BrokerError, `expected a BrokerError, got ${String(error)}`);
    assert.ok(error instanceof ConnectError, "a BrokerError is a ConnectError");
    return error;
  }
  assert.fail("the call succeeded");
}

const bytesOf = (request: pb.DelegateRequest) => toBinary(pb.DelegateRequestSchema, request);

test("resending the same signed request replays the original answer, reserved once", async () => {
  const [orchestrator, delegate] = [Agent.generate(), Agent.generate()];
  const rootRequest = orchestrator.openRoot({
    intent: "replay me",
    budget: 50n,
    deadlineMs: nowMs() + 600_000n,
    policy: { maxDepth: 2, maxChildren: 4 },
    writeScope: ["src"],
  });
  const first = await broker.client.openRoot(rootRequest);
  const again = await broker.client.openRoot(rootRequest);
  assert.deepEqual([first.replayed, again.replayed], [false, true]);
  assert.ok(
    equalBytes(toBinary(pb.IssuedContractSchema, again.issued!), toBinary(pb.IssuedContractSchema, first.issued!)),
    "the stored answer, byte for byte",
  );
  const root = broker.checkIssued(first.issued!);

  const request = orchestrator.delegate(child(root.contractId, root.contract.intentLineageHash, delegate, 20n));
  const one = await broker.client.delegate(request);
  const two = await broker.client.delegate(request);
  assert.deepEqual([one.replayed, two.replayed], [false, true]);
  assert.equal(two.outcome.case, "issued");
  assert.ok(equalBytes(toBinary(pb.DelegateResponseSchema, { ...two, replayed: false }), toBinary(pb.DelegateResponseSchema, one)));
  await broker.checkOutcome(two);
  const ledger = await broker.ledger(root.contractId);
  assert.deepEqual([ledger.reserved, ledger.residual, ledger.openChildren], [20n, 30n, 1], "reserved once");
});

test("callIdempotent resends the very same signed bytes after a lost answer, answered once", async () => {
  const [orchestrator, delegate] = [Agent.generate(), Agent.generate()];
  const root = await broker.openRoot(orchestrator);
  const request = orchestrator.delegate(child(root.id, root.lineage, delegate, 10n));
  const sent: Uint8Array[] = [];
  const lossy = async (req: pb.DelegateRequest, options?: { timeoutMs?: number }) => {
    sent.push(bytesOf(req));
    const response = await broker.client.delegate(req, options);
    if (sent.length === 1) throw new ConnectError("the answer was lost", Code.DeadlineExceeded); // the broker acted
    return response;
  };
  const response = await callIdempotent(lossy, request, { sleep: async () => {} });
  assert.equal(response.replayed, true);
  assert.equal(sent.length, 2);
  assert.ok(equalBytes(sent[0]!, bytesOf(request)) && equalBytes(sent[1]!, bytesOf(request)), "the very same signed bytes were resent");
  assert.equal(response.outcome.case, "issued");
  verifyContract(response.outcome.value!.contract!, broker.keys, response.outcome.value!.contractId);
  assert.equal((await broker.ledger(root.id)).reserved, 10n, "nothing reserved twice");
});

test("callIdempotent retries only transient codes, and gives up", async () => {
  const calls: Code[] = [];
  const failing = (code: Code) => async () => {
    calls.push(code);
    throw new ConnectError("no", code);
  };
  const noSleep = { sleep: async () => {} };
  let error = await failure(() => callIdempotent(failing(Code.InvalidArgument), {}, noSleep));
  assert.equal(error.code, Code.InvalidArgument);
  assert.deepEqual(calls, [Code.InvalidArgument]);
  calls.length = 0;
  error = await failure(() => callIdempotent(failing(Code.Unavailable), {}, { ...noSleep, attempts: 3 }));
  assert.deepEqual(calls, [Code.Unavailable, Code.Unavailable, Code.Unavailable]);
  calls.length = 0;
  // A limit (RESOURCE_EXHAUSTED) is met again by the same request.
  await failure(() => callIdempotent(failing(Code.ResourceExhausted), {}, { ...noSleep, attempts: 3 }));
  assert.deepEqual(calls, [Code.ResourceExhausted]);
  assert.deepEqual([...RETRYABLE].sort(), [Code.DeadlineExceeded, Code.Unavailable].sort());
});

test("callIdempotent against an unreachable broker gives up with UNAVAILABLE", async () => {
  const client = createBrokerClient(createNodeTransport("127.0.0.1:1")); // nothing listens on port 1
  const request = Agent.generate().openRoot({ intent: "x", budget: 1n });
  const error = await failure(() => callIdempotent(client.openRoot, request, { attempts: 2, timeoutMs: 2_000, sleep: async () => {} }));
  assert.equal(error.code, Code.Unavailable);
  assert.equal(error.reason, undefined, "the gRPC layer's status carries no ErrorInfo");
});

test("the same nonce with another body is ALREADY_EXISTS (NONCE_REUSED) naming body.header.nonce", async () => {
  const [orchestrator, delegate] = [Agent.generate(), Agent.generate()];
  const root = await broker.openRoot(orchestrator);
  const header = orchestrator.header();
  await broker.checkOutcome(await broker.client.delegate(orchestrator.delegate({ ...child(root.id, root.lineage, delegate, 10n), header })));
  const error = await failure(() => broker.client.delegate(orchestrator.delegate({ ...child(root.id, root.lineage, delegate, 11n), header })));
  assert.equal(error.code, Code.AlreadyExists);
  assert.equal(codeName(error.code), "ALREADY_EXISTS");
  assert.equal(error.reason, "NONCE_REUSED");
  assert.equal(error.errorReason, pb.ErrorReason.NONCE_REUSED);
  assert.equal(error.field, "body.header.nonce");
  assert.equal(error.errorInfo?.domain, ERROR_DOMAIN);
  assert.deepEqual({ ...error.info }, { field: "body.header.nonce" });
});

test("a forged request is refused: UNAUTHENTICATED (BAD_SIGNATURE), nothing recorded", async () => {
  const [orchestrator, delegate, mallory] = [Agent.generate(), Agent.generate(), Agent.generate()];
  const root = await broker.openRoot(orchestrator);

  // The payload changed after signing (another delegate's key swapped in).
  const tampered = orchestrator.delegate(child(root.id, root.lineage, delegate, 10n));
  const body = fromBinary(pb.DelegateBodySchema, tampered.signed!.payload);
  body.delegatePublicKey = mallory.publicKey;
  tampered.signed!.payload = toBinary(pb.DelegateBodySchema, body);
  let error = await failure(() => broker.client.delegate(tampered));
  assert.deepEqual([error.code, error.reason], [Code.Unauthenticated, "BAD_SIGNATURE"]);

  // Signed by mallory in the orchestrator's name (the header names the orchestrator's key).
  const impersonated = mallory.delegate({ ...child(root.id, root.lineage, mallory, 10n), header: orchestrator.header() });
  error = await failure(() => broker.client.delegate(impersonated));
  assert.deepEqual([error.code, error.reason], [Code.Unauthenticated, "BAD_SIGNATURE"]);

  // A genuine signature over another type's payload.
  const retyped = orchestrator.delegate(child(root.id, root.lineage, delegate, 10n));
  const envelope = mallory.signBytes("application/vnd.delegation.broker.v1.OpenRootBody+protobuf", retyped.signed!.payload);
  error = await failure(() => broker.client.delegate(create(pb.DelegateRequestSchema, { signed: { ...envelope, payloadType: retyped.signed!.payloadType } })));
  assert.equal(error.code, Code.Unauthenticated);

  // Signed correctly, but not by the holder, nothing stored. Mallory is no party of the tree, so
  // it is told exactly what an unknown parent gets (NOT_FOUND, message and all).
  const grandchild = Agent.generate();
  const [, , info] = await assertUnknowable(
    (parent) => broker.client.delegate(mallory.delegate(child(parent, root.lineage, grandchild, 10n))),
    root.id,
    "Delegate",
  );
  assert.deepEqual(info, { what: "parent contract", id: "<id>" });

  const ledger = await broker.ledger(root.id);
  assert.deepEqual([ledger.reserved, ledger.openChildren], [0n, 0], "none of them reserved anything");

  // A party of the tree that does not hold the parent is told why: PERMISSION_DENIED (NOT_HOLDER).
  issuedOf(await broker.delegate(orchestrator, child(root.id, root.lineage, delegate, 10n)));
  error = await failure(() => broker.client.delegate(delegate.delegate(child(root.id, root.lineage, grandchild, 10n))));
  assert.deepEqual([error.code, error.reason], [Code.PermissionDenied, "NOT_HOLDER"]);
  const later = await broker.ledger(root.id);
  assert.deepEqual([later.reserved, later.openChildren], [10n, 1], "only the holder's own Delegate reserved");
});

test("errors carry their ErrorReason and the offending field", async () => {
  const [orchestrator, delegate] = [Agent.generate(), Agent.generate()];
  const root = await broker.openRoot(orchestrator);

  let error = await failure(() =>
    broker.client.delegate(orchestrator.delegate(child(root.id, root.lineage, delegate, 10n, { liability: pb.Liability.UNSPECIFIED }))),
  );
  assert.deepEqual([error.code, error.reason, error.field], [Code.InvalidArgument, "INVALID_FIELD", "body.liability"]);
  assert.equal(error.errorReason, pb.ErrorReason.INVALID_FIELD);
  assert.equal(error.badRequest?.fieldViolations[0]?.field, "body.liability", "a google.rpc.BadRequest names it too");

  error = await failure(() => broker.client.openRoot(orchestrator.openRoot({ intent: "x", budget: 1n, deadlineMs: nowMs() + 60_000n })));
  assert.deepEqual([error.code, error.reason, error.field], [Code.InvalidArgument, "INVALID_FIELD", "body.policy"]);

  const stale = { ...child(root.id, root.lineage, delegate, 10n), header: { ...orchestrator.header(), timestampMs: nowMs() - 600_000n } };
  error = await failure(() => broker.client.delegate(orchestrator.delegate(stale)));
  assert.deepEqual([error.code, error.reason], [Code.Unauthenticated, "STALE_TIMESTAMP"]);

  error = await failure(() => broker.client.getContract({ contractId: new Uint8Array(32) }));
  assert.deepEqual([error.code, error.reason, error.info.what], [Code.NotFound, "NOT_FOUND", "contract"]);
  assert.equal(error.info.id, "00".repeat(32));

  error = await failure(() => broker.client.getContract({ contractId: new Uint8Array(3) }));
  assert.deepEqual([error.code, error.reason, error.field], [Code.InvalidArgument, "INVALID_FIELD", "contract_id"]);
  assert.equal(error.rawMessage.length > 0, true);
  assert.match(error.message, /^\[invalid_argument\]/);
});

test("BrokerError.from keeps a ConnectError's code and reads no reason without ErrorInfo", () => {
  const plain = BrokerError.from(new ConnectError("gone", Code.Unavailable));
  assert.equal(plain.code, Code.Unavailable);
  assert.equal(plain.reason, undefined);
  assert.equal(plain.field, undefined);
  assert.ok(BrokerError.from(plain) === plain);
  assert.equal(BrokerError.from(new Error("x")).code, Code.Unknown);
  assert.ok(!(new ConnectError("x") instanceof BrokerError), "a plain ConnectError is not a BrokerError");
});
