#!/usr/bin/env node
// The TypeScript side of the Go suite's cross-language test, on the
// TypeScript client's build (clients/typescript/dist; CROSS_TS_DIST names
// it). The same commands and output as clients/typescript/test/cross/cross.py:
//
//   cross.mjs verify-chains KEYS_HEX DIR [CONTRACT_ID_HEX]
//   cross.mjs verify-receipts KEYS_HEX DIR
//   cross.mjs issue ADDRESS OUT_DIR
//
// verify-*: one line per DIR/*.bin, "NAME" TAB what `delegation-broker
// verify` prints (lines joined by " | ") or "error: ...". issue: TypeScript
// agents open a root and delegate three hops, one refused child, one accept;
// writes chain.bin, refusal.bin, accepted.bin, request.bin, orchestrator.hex.
import { readdirSync, readFileSync, writeFileSync, mkdirSync } from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const dist = process.env.CROSS_TS_DIST;
if (!dist) throw new Error("CROSS_TS_DIST is not set");
const ts = await import(pathToFileURL(path.join(dist, "index.js")).href);
const { createNodeTransport } = await import(pathToFileURL(path.join(dist, "node.js")).href);
const { create, fromBinary, toBinary } = await import(pathToFileURL(path.join(dist, "..", "node_modules", "@bufbuild", "protobuf", "dist", "esm", "index.js")).href);
const { pb } = ts;

const keysOf = (text) => ts.BrokerKeys.fromPublicKeys(text.split(",").map(ts.fromHex));

function rustDebug(text) {
  const escapes = { "\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t", "\0": "\\0" };
  return '"' + [...text].map((ch) => escapes[ch] ?? ch).join("") + '"';
}

function chainLines(verified) {
  const lines = verified.map((v) => {
    const c = v.contract;
    return `depth=${c.depth} id=${ts.toHex(v.contractId)} delegate=${ts.keyId(c.delegatePublicKey)} budget=${c.budget} ` +
      `deadline_ms=${c.deadlineMs} trust_ppm=${c.cumulativeTrustPpm} liability=LIABILITY_${pb.Liability[c.liability]} ` +
      `effective_predicate=${rustDebug(v.effectivePredicate)}`;
  });
  return [...lines, `ok chain of ${verified.length} contracts`];
}

function each(dir, check) {
  for (const name of readdirSync(dir).filter((f) => f.endsWith(".bin")).sort()) {
    let line;
    try {
      line = check(readFileSync(path.join(dir, name)));
    } catch (e) {
      line = e instanceof ts.VerificationError ? `error: ${e.message}` : `crash: ${e}`;
    }
    console.log(`${name.slice(0, -4)}\t${line}`);
  }
}

const [command, ...args] = process.argv.slice(2);
if (command === "verify-chains") {
  const keys = keysOf(args[0]);
  const leaf = args[2] ? ts.fromHex(args[2]) : undefined;
  each(args[1], (data) => chainLines(ts.verifyChain(fromBinary(pb.GetChainResponseSchema, data), keys, leaf)).join(" | "));
} else if (command === "verify-receipts") {
  const keys = keysOf(args[0]);
  each(args[1], (data) => {
    const v = ts.verifyReceipt(fromBinary(pb.SealedSchema, data), keys);
    return `ok receipt ${ts.toHex(v.id)} kind=RECEIPT_KIND_${pb.ReceiptKind[v.message.kind]} contract=${ts.toHex(v.message.contractId)}`;
  });
} else if (command === "issue") {
  const [address, out] = args;
  mkdirSync(out, { recursive: true });
  const transport = createNodeTransport(address);
  const [orchestrator, planner, executor, reviewer] = [0, 1, 2, 3].map(() => ts.Agent.generate());
  const client = await ts.sessionClient(transport, orchestrator);
  const keys = await ts.BrokerKeys.fetch(client);
  const root = (await client.openRoot(orchestrator.openRoot({
    intent: "TypeScript-issued: fix the token refresh bug", budget: 100n, deadlineMs: ts.nowMs() + 3_600_000n,
    policy: { maxDepth: 4, maxChildren: 8 }, predicate: "result.schema_valid", writeScope: ["src", "docs"], labels: { client: "typescript" },
  }))).issued;
  const lineage = ts.verifyContract(root.contract, keys, root.contractId).contract.intentLineageHash;
  let parent = root.contractId;
  let request;
  const hops = [
    [orchestrator, planner, { budget: 50n, liability: pb.Liability.DELEGATE, predicate: "result.tests_pass", escalationChannel: "broker://escalate", minRetryCost: 10n, writeScope: ["src"] }],
    [planner, executor, { budget: 20n, liability: pb.Liability.DELEGATE, escalationChannel: "broker://escalate", minRetryCost: 5n, writeScope: ["src/auth"] }],
    [executor, reviewer, { budget: 5n, liability: pb.Liability.PRINCIPAL, predicate: "result.reviewed", writeScope: ["src/auth/token.rs"] }],
  ];
  for (const [holder, delegate, terms] of hops) {
    const signed = holder.delegate({ parentId: parent, intentLineageHash: lineage, task: "ü — a TypeScript hop", delegatePublicKey: delegate.publicKey, ...terms });
    request ??= signed;
    const response = await client.delegate(signed);
    if (response.outcome.case !== "issued") throw new Error("refused");
    parent = ts.verifyContract(response.outcome.value.contract, keys, response.outcome.value.contractId).contractId;
  }
  const refused = await client.delegate(reviewer.delegate({ parentId: parent, intentLineageHash: lineage, task: "too much", delegatePublicKey: ts.Agent.generate().publicKey, budget: 1000n, liability: pb.Liability.PRINCIPAL }));
  if (refused.outcome.case !== "refused") throw new Error("not refused");
  const accepted = await client.accept(reviewer.accept({ contractId: parent }));
  const chain = await client.getChain({ contractId: parent });
  ts.verifyChain(chain, keys, parent);
  writeFileSync(path.join(out, "chain.bin"), toBinary(pb.GetChainResponseSchema, chain));
  writeFileSync(path.join(out, "refusal.bin"), toBinary(pb.SealedSchema, refused.outcome.value.receipt));
  writeFileSync(path.join(out, "accepted.bin"), toBinary(pb.SealedSchema, accepted.receipt));
  writeFileSync(path.join(out, "request.bin"), toBinary(pb.EnvelopeSchema, request.signed));
  writeFileSync(path.join(out, "orchestrator.hex"), ts.toHex(orchestrator.publicKey) + "\n");
} else {
  throw new Error(`unknown command ${command}`);
}
