/**
 * Watch: every event of a subtree verified, in commit order; resumed from a
 * cursor with nothing missed and nothing repeated, by hand and after a
 * dropped stream (the broker restarting under a live watch).
 */

import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { Code } from "@connectrpc/connect";
import { Agent, BrokerError, Watch, equalBytes, pb, toHex, watch, type WatchEvent } from "@delegation-broker/client";

import { Broker, child, issuedOf } from "./support.js";

let broker: Broker;
before(async () => {
  broker = await Broker.start("watch");
});
after(async () => {
  await broker.close();
});

/** The next `n` events of `w` (failing after `timeoutMs`). */
async function take(w: Watch, n: number, timeoutMs = 20_000): Promise<WatchEvent[]> {
  const events: WatchEvent[] = [];
  const timer = setTimeout(() => w.cancel(), timeoutMs);
  try {
    while (events.length < n) {
      const next = await w.next();
      if (next.done) break;
      events.push(next.value);
    }
  } finally {
    clearTimeout(timer);
  }
  assert.equal(events.length, n, `expected ${n} events before the timeout, got ${events.length}`);
  return events;
}

const ids = (events: WatchEvent[]) => events.map((e) => `${e.cursor}:${e.kind}:${toHex(e.id)}`);

/** orchestrator → worker, accepted, and a refusal: 4 events. */
async function smallTree() {
  const [orchestrator, worker] = [Agent.generate(), Agent.generate()];
  const root = await broker.openRoot(orchestrator);
  const childId = issuedOf(await broker.delegate(orchestrator, child(root.id, root.lineage, worker, 20n))).contractId;
  await broker.checkReceipt(await broker.client.accept(worker.accept({ contractId: childId })), pb.ReceiptKind.ACCEPTED);
  await broker.delegate(worker, child(childId, root.lineage, Agent.generate(), 1_000n)); // refused: over budget
  return { orchestrator, worker, root, childId };
}

test("a watch from cursor 0 yields every event of the subtree, verified, in commit order", async () => {
  const { root, childId } = await smallTree();
  const w = watch(broker.client, root.id, { keys: broker.keys });
  const events = await take(w, 4);
  await w.return();
  assert.deepEqual(events.map((e) => e.kind), ["contract", "contract", "receipt", "receipt"]);
  assert.ok(equalBytes(events[0]!.id, root.id));
  assert.ok(equalBytes(events[1]!.id, childId));
  assert.equal(events[2]!.receipt!.kind, pb.ReceiptKind.ACCEPTED);
  assert.equal(events[3]!.receipt!.kind, pb.ReceiptKind.REFUSED);
  assert.equal(events[3]!.receipt!.primary, pb.InvariantCode.BUDGET_EXCEEDS_PARENT);
  for (let i = 1; i < events.length; i++) assert.ok(events[i]!.cursor > events[i - 1]!.cursor, "cursors strictly increase");
  assert.equal(w.cursor, events.at(-1)!.cursor);
  assert.ok(w.cancelled);
  // Watching the child: its own subtree only.
  const sub = await take(watch(broker.client, childId), 3).catch((e: unknown) => e);
  assert.ok(Array.isArray(sub), String(sub));
  assert.deepEqual(sub.map((e) => e.kind), ["contract", "receipt", "receipt"]);
});

test("a watch resumed from a cursor misses nothing and repeats nothing, then follows live", async () => {
  const { orchestrator, root } = await smallTree();
  const all = await take(watch(broker.client, root.id), 4);

  // `break` out of a for-await after two events ends the stream; resume from its cursor.
  const first = watch(broker.client, root.id);
  const seen: WatchEvent[] = [];
  for await (const event of first) {
    seen.push(event);
    if (seen.length === 2) break;
  }
  assert.ok(first.cancelled, "break ends the stream");
  const resumed = watch(broker.client, root.id, { cursor: first.cursor });
  seen.push(...(await take(resumed, 2)));
  assert.deepEqual(ids(seen), ids(all), "the same events, each once");

  // Live: a contract issued now arrives on the resumed stream.
  const live = issuedOf(await broker.delegate(orchestrator, child(root.id, root.lineage, Agent.generate(), 5n))).contractId;
  const [next] = await take(resumed, 1);
  assert.ok(equalBytes(next!.id, live));
  assert.ok(next!.cursor > all.at(-1)!.cursor);

  // resume(): cancels this one and carries on after its cursor (nothing new yet, then the next event).
  const again = resumed.resume();
  assert.ok(resumed.cancelled);
  await broker.checkReceipt(await broker.client.revoke(orchestrator.revoke({ contractId: live, reason: "done" })), pb.ReceiptKind.REVOKED);
  const [revoked] = await take(again, 1);
  assert.equal(revoked!.receipt!.kind, pb.ReceiptKind.REVOKED);
  assert.ok(equalBytes(revoked!.receipt!.contractId, live));
  await again.return();
});

test("a dropped stream resumes from the last cursor: the broker restarts under a live watch", async () => {
  const { orchestrator, root } = await smallTree();
  const w = watch(broker.client, root.id, { reconnect: { maxAttempts: 40, initialBackoffMs: 50, maxBackoffMs: 500 } });
  const before = await take(w, 4);
  const pending = take(w, 2, 40_000); // waits across the restart

  await broker.process.restart(); // SIGTERM: the stream ends UNAVAILABLE, the watch reconnects
  // Same data directory, same key: the reader's session and the cursor stay valid.
  const a = issuedOf(await broker.delegate(orchestrator, child(root.id, root.lineage, Agent.generate(), 3n))).contractId;
  const b = issuedOf(await broker.delegate(orchestrator, child(root.id, root.lineage, Agent.generate(), 4n))).contractId;
  const after = await pending;
  assert.deepEqual(after.map((e) => toHex(e.id)), [toHex(a), toHex(b)], "exactly the new events, once each");
  assert.ok(after[0]!.cursor > before.at(-1)!.cursor);
  assert.ok(w.streams >= 2, `the stream was reopened (${w.streams} streams)`);
  await w.return();

  // And from cursor 0 again, the whole history: the 4 events before, the 2 after.
  assert.deepEqual(ids(await take(watch(broker.client, root.id), 6)), ids([...before, ...after]));
});

test("without reconnect, a broker shutdown ends the iteration; an AbortSignal ends it too", async () => {
  const { root } = await smallTree();
  const abort = new AbortController();
  const w = watch(broker.client, root.id, { signal: abort.signal });
  await take(w, 4);
  const pending = w.next();
  abort.abort();
  assert.deepEqual(await pending, { done: true, value: undefined });

  // A broker that stops ends the stream UNAVAILABLE (resume with the
  // last cursor, here or on another replica): without reconnect the
  // iteration throws it.
  const ending = watch(broker.client, root.id);
  await take(ending, 4);
  const end = ending.next();
  const thrown = end.then(
    () => undefined,
    (e: unknown) => e,
  );
  await broker.process.restart();
  const error = await thrown;
  assert.ok(error instanceof BrokerError, `the stream ended with an error: ${String(error)}`);
  assert.equal(error.code, Code.Unavailable, "UNAVAILABLE when the broker shut down");
});
