/**
 * Read sessions against the real broker: reads need one
 * (x-broker-session-bin), are answered only to the tree's parties and
 * configured readers, and the helpers open, attach and renew them.
 */

import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { after, before, test } from "node:test";

import { fromBinary } from "@bufbuild/protobuf";
import { Code, createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import {
  Agent,
  BrokerError,
  ReadSession,
  RenewingSession,
  SESSION_HEADER,
  SESSION_TYPE,
  VerificationError,
  createBrokerClient,
  currentKeyId,
  equalBytes,
  nowMs,
  openSession,
  pb,
  payloadType,
  sessionClient,
  sessionInterceptor,
  verifyReceipt,
  verifySealed,
  verifySignature,
  watch,
  type BrokerClient,
} from "@delegation-broker/client";
import { createNodeTransport } from "@delegation-broker/client/node";

import { Broker, HOUR_MS, assertUnknowable, child, issuedOf, refusal } from "./support.js";

async function failure(call: () => Promise<unknown>): Promise<[Code, string | undefined]> {
  try {
    await call();
  } catch (error) {
    const e = BrokerError.from(error);
    return [e.code, e.reason];
  }
  assert.fail("the call succeeded");
}

/** orchestrator → worker (hosted by host), accepted, with one receipt. */
interface Tree {
  orchestrator: Agent;
  worker: Agent;
  host: Agent;
  rootId: Uint8Array;
  childId: Uint8Array;
  receiptId: Uint8Array;
}

async function tree(broker: Broker): Promise<Tree> {
  const [orchestrator, worker, host] = [Agent.generate(), Agent.generate(), Agent.generate()];
  const root = await broker.openRoot(orchestrator, { labels: { run: "sessions" } });
  const childId = issuedOf(
    await broker.delegate(orchestrator, child(root.id, root.lineage, worker, 20n, { hostPublicKey: host.publicKey })),
  ).contractId;
  const accepted = await broker.client.accept(worker.accept({ contractId: childId }));
  await broker.checkReceipt(accepted, pb.ReceiptKind.ACCEPTED);
  return { orchestrator, worker, host, rootId: root.id, childId, receiptId: accepted.receiptId };
}

/** Every read RPC about the tree, with `headers`. */
function reads(client: BrokerClient, t: Tree, headers?: Record<string, string>): [string, () => Promise<unknown>][] {
  const options = { timeoutMs: 10_000, headers };
  return [
    ["GetContract", () => client.getContract({ contractId: t.childId }, options)],
    ["GetChain", () => client.getChain({ contractId: t.childId }, options)],
    ["ListChildren", () => client.listChildren({ contractId: t.rootId }, options)],
    ["GetReceipt", () => client.getReceipt({ receiptId: t.receiptId }, options)],
    ["GetAudit", () => client.getAudit({ contractId: t.childId }, options)],
    [
      "Watch",
      async () => {
        const abort = new AbortController();
        try {
          for await (const event of client.watch({ contractId: t.rootId }, { ...options, signal: abort.signal })) return event;
        } finally {
          abort.abort();
        }
      },
    ],
  ];
}

let broker: Broker;
let t: Tree;
before(async () => {
  broker = await Broker.start("sessions");
  t = await tree(broker);
});
after(async () => {
  await broker.close();
});

test("OpenSession is a signed request and returns a broker-signed Session", async () => {
  const agent = Agent.generate();
  const request = agent.openSession({ brokerKeyId: "k" });
  assert.equal(request.signed!.payloadType, "application/vnd.delegation.broker.v1.OpenSessionBody+protobuf");
  assert.equal(request.signed!.payloadType, payloadType(pb.OpenSessionBodySchema));
  assert.ok(verifySignature(request.signed!, agent.publicKey));
  const body = fromBinary(pb.OpenSessionBodySchema, request.signed!.payload);
  assert.ok(equalBytes(body.header!.agentPublicKey, agent.publicKey));
  assert.equal(body.header!.nonce.length, 16);
  // A request naming another broker opens nothing here.
  assert.deepEqual(await failure(() => broker.bare.openSession(request)), [Code.Unauthenticated, "WRONG_BROKER"]);

  const before = nowMs();
  const session = await openSession(broker.bare, agent);
  const verified = verifySealed(session.sealed, broker.keys, pb.SessionSchema);
  assert.ok(equalBytes(verified.message.agentPublicKey, agent.publicKey));
  assert.ok(equalBytes(session.agentPublicKey, agent.publicKey));
  assert.equal(session.expiresAtMs, verified.message.expiresAtMs);
  assert.equal(session.lifetimeMs, Number(HOUR_MS), "the broker's default session lifetime");
  assert.ok(session.issuedAtMs - before < 60_000n && before - session.issuedAtMs < 60_000n);
  assert.equal(payloadType(pb.SessionSchema), SESSION_TYPE);
  assert.ok(equalBytes(fromBinary(pb.SealedSchema, session.headerBytes()).signature, session.sealed.signature));
  assert.deepEqual(Object.keys(session.headers()), [SESSION_HEADER]);
  assert.equal(await currentKeyId(broker.bare), broker.keys.current);
  const another = await openSession(broker.bare, agent);
  assert.ok(!equalBytes(another.sealed.payload, session.sealed.payload), "every call opens a new session");
  // A session is a Session: it passes as nothing else.
  assert.throws(() => verifyReceipt(session.sealed, broker.keys), VerificationError);
});

test("a read without a session is refused (NO_SESSION); with one, answered", async () => {
  for (const [name, call] of reads(broker.bare, t)) {
    assert.deepEqual(await failure(call), [Code.Unauthenticated, "NO_SESSION"], name);
  }
  // By hand: the orchestrator's session as a header of each call.
  const session = await openSession(broker.bare, t.orchestrator);
  for (const [name, call] of reads(broker.bare, t, session.headers())) {
    assert.ok(await call(), name);
  }
  const state = (await broker.bare.getContract({ contractId: t.childId }, { headers: session.headers() })).contract!;
  assert.ok(equalBytes(state.contractId, t.childId));
});

test("every party of the tree reads it, a configured reader too; a stranger cannot tell its ids from random ones", async () => {
  for (const agent of [t.orchestrator, t.worker, t.host, broker.reader]) {
    const client = await broker.clientFor(agent);
    for (const [name, call] of reads(client, t)) assert.ok(await call(), name);
  }
  // Every read of the tree is answered as the same read of random ids: NOT_FOUND, message and all.
  const stranger = await broker.clientFor(Agent.generate());
  const random = () => new Uint8Array(randomBytes(32));
  const fake: Tree = { ...t, rootId: random(), childId: random(), receiptId: random() };
  const fakeReads = reads(stranger, fake);
  for (const [i, [name, call]] of reads(stranger, t).entries()) {
    const answer = await refusal(call, t.rootId, t.childId, t.receiptId);
    assert.deepEqual(answer, await refusal(fakeReads[i]![1], fake.rootId, fake.childId, fake.receiptId), name);
    const what = name === "GetReceipt" ? "receipt" : "contract";
    assert.deepEqual(answer.slice(0, 3), [Code.NotFound, "NOT_FOUND", { what, id: "<id>" }], name);
  }
  // The watch helper, too.
  await assertUnknowable(async (id) => {
    for await (const event of watch(stranger, id, { keys: broker.keys })) return event;
  }, t.rootId, "watch");
});

test("a tampered or foreign session is BAD_SESSION", async () => {
  const session = await openSession(broker.bare, t.orchestrator);
  const flipped = { ...session.sealed, signature: session.sealed.signature.map((b, i) => (i === 10 ? b ^ 1 : b)) };
  const forged = new ReadSession(flipped, session.agentPublicKey, session.issuedAtMs, session.expiresAtMs);
  assert.deepEqual(await failure(() => broker.bare.getContract({ contractId: t.childId }, { headers: forged.headers() })), [
    Code.Unauthenticated,
    "BAD_SESSION",
  ]);
  assert.deepEqual(
    await failure(() => broker.bare.getContract({ contractId: t.childId }, { headers: { [SESSION_HEADER]: "not base64!" } })),
    [Code.Unauthenticated, "BAD_SESSION"],
  );
});

test("sessionInterceptor on a transport of one's own; GetBrokerKeys and OpenSession stay public", async () => {
  const keeper = new RenewingSession(t.worker, broker.bare);
  const transport = createGrpcTransport({ baseUrl: `http://${broker.process.address}`, interceptors: [sessionInterceptor(keeper)] });
  const client = createClient(pb.Broker, transport);
  const children = (await client.listChildren({ contractId: t.rootId })).children;
  assert.equal(children.length, 1);
  assert.ok(equalBytes(children[0]!.contractId, t.childId));
  // The interceptor renews through `broker.bare`; the same intercepted client may open sessions too.
  assert.ok(await openSession(client, t.worker));
  const withOwn = await openSession(broker.bare, t.orchestrator);
  const state = await client.getContract({ contractId: t.rootId }, { headers: withOwn.headers() });
  assert.ok(state.contract, "a call's own session header is kept");
});

test("sessions renew before they expire, and after SESSION_EXPIRED", async () => {
  const short = await Broker.start("short-sessions", { limits: { session_ttl_ms: 2_000 } });
  try {
    const s = await tree(short);
    const session = await openSession(short.bare, s.orchestrator);
    assert.equal(session.lifetimeMs, 2_000);

    // Renewed on the first call after renewAt of its lifetime (by the local clock).
    const client = await sessionClient(short.transport, s.orchestrator, { renewAt: 0.5 });
    const first = await client.session.current();
    assert.equal(client.session.needsRenewal(), false);
    await client.getContract({ contractId: s.rootId });
    assert.equal(await client.session.current(), first, "not renewed before renewAt");
    await new Promise((resolve) => setTimeout(resolve, 1_100));
    assert.equal(client.session.needsRenewal(), true);
    await client.getContract({ contractId: s.rootId });
    const second = await client.session.current();
    assert.notEqual(second, first, "renewed on the first call past renewAt");
    assert.ok(second.issuedAtMs >= first.issuedAtMs);

    // Past its expiry, the broker refuses a session.
    await new Promise((resolve) => setTimeout(resolve, 2_100));
    assert.deepEqual(await failure(() => short.bare.getContract({ contractId: s.rootId }, { headers: session.headers() })), [
      Code.Unauthenticated,
      "SESSION_EXPIRED",
    ]);

    // A renewing session whose clock says "fresh" (a suspended laptop, a
    // skewed clock) gets SESSION_EXPIRED once, renews, and the read is answered.
    const frozen = Date.now();
    const stale = new RenewingSession(s.orchestrator, short.bare, { clock: () => frozen });
    await stale.current();
    await new Promise((resolve) => setTimeout(resolve, 2_100));
    const reads = createBrokerClient(short.transport, { session: stale });
    assert.ok((await reads.getContract({ contractId: s.rootId })).contract);
    // A fixed ReadSession is not renewed.
    const fixed = createBrokerClient(short.transport, { session });
    assert.deepEqual(await failure(() => fixed.getContract({ contractId: s.rootId })), [Code.Unauthenticated, "SESSION_EXPIRED"]);
  } finally {
    await short.close();
  }
});

test("the renewing session is shared by concurrent calls", async () => {
  let opened = 0;
  const counting = {
    getBrokerKeys: broker.bare.getBrokerKeys,
    openSession: (request: pb.OpenSessionRequest, options?: { timeoutMs?: number }) => {
      opened++;
      return broker.bare.openSession(request, options);
    },
  };
  const keeper = new RenewingSession(t.orchestrator, counting);
  const client = createBrokerClient(createNodeTransport(broker.process.address), { session: keeper });
  await Promise.all(Array.from({ length: 8 }, () => client.getContract({ contractId: t.rootId })));
  assert.equal(opened, 1);
  assert.throws(() => new RenewingSession(t.orchestrator, counting, { renewAt: 0 }), RangeError);
});
