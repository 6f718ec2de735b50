/**
 * Cross-language proof: a chain issued to
 * TypeScript agents verifies in Python (the Python client's verify_chain)
 * and in Rust (`delegation-broker verify`), a chain issued to Python agents
 * verifies in TypeScript, and a bit flipped in any signed byte — of any
 * contract, of any id beside it, of the leaf's signature, of a receipt —
 * fails in all three. Where they verify, the three print the same terms.
 *
 * Needs the Python client: run-tests.sh installs it into
 * clients/typescript/.venv-python and exports CROSS_PYTHON; without it the
 * test fails (it is never skipped).
 */

import assert from "node:assert/strict";
import { execFile, spawnSync } from "node:child_process";
import { mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import path from "node:path";
import { after, before, test } from "node:test";
import { promisify } from "node:util";

import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import {
  Agent,
  BrokerKeys,
  VerificationError,
  fromHex,
  pb,
  toHex,
  verifyChain,
  verifyReceipt,
  verifySignature,
} from "@delegation-broker/client";

import { SYNTHETIC_VIOLATIONS, broken, flippedChains, flippedSealed, forgeChain, syntheticChain } from "./forge.js";
import { Broker, CLIENT_ROOT, asStates, brokerBin, child, issuedOf, liableChild, rustChainLines, tempDir } from "./support.js";

const CROSS_SCRIPT = path.join(CLIENT_ROOT, "test", "cross", "cross.py");
const run = promisify(execFile);

let python: string;
let broker: Broker;
let work: string;

before(async () => {
  const configured = process.env.CROSS_PYTHON;
  if (!configured) {
    throw new Error(
      "CROSS_PYTHON is not set: the cross-language test needs a Python with the Python client (delegation_broker) " +
        "installed. clients/typescript/run-tests.sh sets one up in clients/typescript/.venv-python and exports it.",
    );
  }
  const probe = spawnSync(configured, ["-c", "import delegation_broker"], { encoding: "utf8" });
  if (probe.status !== 0) {
    throw new Error(`CROSS_PYTHON=${configured} cannot import delegation_broker: ${probe.error?.message ?? probe.stderr}`);
  }
  python = configured;
  broker = await Broker.start("cross");
  work = tempDir("cross-files");
});
after(async () => {
  await broker?.close();
  if (work) rmSync(work, { recursive: true, force: true });
});

// --- the three verifiers ------------------------------------------------------------

type Verdict = string; // the printed terms (lines joined by " | ") or "error"

function pythonVerdicts(command: string, argument: string, dir: string, ...rest: string[]): Map<string, Verdict> {
  const result = spawnSync(python, [CROSS_SCRIPT, command, argument, dir, ...rest], { encoding: "utf8", maxBuffer: 64 << 20 });
  assert.equal(result.status, 0, `cross.py ${command} failed: ${result.stderr}`);
  const out = new Map<string, Verdict>();
  for (const line of result.stdout.trimEnd().split("\n")) {
    const [name, verdict] = line.split("\t") as [string, string];
    assert.ok(!verdict.startsWith("crash:"), `Python raised something other than VerificationError on ${name}: ${verdict}`);
    out.set(name, verdict.startsWith("error") ? "error" : verdict);
  }
  return out;
}

/** `delegation-broker verify ARGS`, a few at a time. */
async function rustVerdicts(jobs: [string, string[]][], parallel = 4): Promise<Map<string, Verdict>> {
  const out = new Map<string, Verdict>();
  let next = 0;
  const worker = async () => {
    while (next < jobs.length) {
      const [name, args] = jobs[next++]!;
      try {
        const { stdout } = await run(brokerBin(), ["verify", ...args], { env: { BROKER_LOG: "error", PATH: "/usr/bin:/bin" } });
        out.set(name, stdout.trimEnd().split("\n").join(" | "));
      } catch (e) {
        const stderr = (e as { stderr?: string }).stderr ?? "";
        assert.match(stderr, /^error:/, `the Rust verifier failed oddly on ${name}: ${stderr}`);
        out.set(name, "error");
      }
    }
  };
  await Promise.all(Array.from({ length: parallel }, worker));
  return out;
}

const keyArgs = (keys: Uint8Array[]) => keys.flatMap((k) => ["--public-key", toHex(k)]);

function tsChain(chain: pb.ContractState[], keys: Uint8Array[], leaf?: Uint8Array): Verdict {
  try {
    return rustChainLines(verifyChain(chain, keysOf(keys), leaf)).join(" | ");
  } catch (e) {
    assert.ok(e instanceof VerificationError, `TypeScript threw something other than VerificationError: ${String(e)}`);
    return "error";
  }
}

function tsReceipt(sealed: pb.Sealed, keys: Uint8Array[]): Verdict {
  try {
    const v = verifyReceipt(sealed, keysOf(keys));
    return `ok receipt ${toHex(v.id)} kind=RECEIPT_KIND_${pb.ReceiptKind[v.message.kind]} contract=${toHex(v.message.contractId)}`;
  } catch (e) {
    assert.ok(e instanceof VerificationError, `TypeScript threw something other than VerificationError: ${String(e)}`);
    return "error";
  }
}

function keysOf(keys: Uint8Array[]): BrokerKeys {
  return BrokerKeys.fromPublicKeys(keys);
}

/**
 * Every chain in `variants` judged by the three verifiers; returns the
 * verdicts by name, asserting the three agree on each.
 */
async function judgeChains(label: string, variants: [string, pb.ContractState[]][], keys: Uint8Array[], leaf?: Uint8Array) {
  const dir = path.join(work, `${label}-chains`);
  mkdirSync(dir, { recursive: true });
  const names = variants.map(([name], i) => [`${String(i).padStart(5, "0")}`, name] as const);
  variants.forEach(([, chain], i) => {
    writeFileSync(path.join(dir, `${names[i]![0]}.bin`), toBinary(pb.GetChainResponseSchema, create(pb.GetChainResponseSchema, { chain })));
  });
  const py = pythonVerdicts("verify-chains", keys.map(toHex).join(","), dir, ...(leaf ? [toHex(leaf)] : []));
  const leafArgs = leaf ? ["--contract-id", toHex(leaf)] : [];
  const rust = await rustVerdicts(names.map(([file]) => [file, [...keyArgs(keys), "--chain", path.join(dir, `${file}.bin`), ...leafArgs]]));
  const verdicts = new Map<string, Verdict>();
  variants.forEach(([name, chain], i) => {
    const file = names[i]![0];
    const ts = tsChain(chain, keys, leaf);
    assert.equal(py.get(file), ts, `${label} / ${name}: Python and TypeScript disagree`);
    assert.equal(rust.get(file), ts, `${label} / ${name}: Rust and TypeScript disagree`);
    verdicts.set(name, ts);
  });
  rmSync(dir, { recursive: true, force: true });
  return verdicts;
}

async function judgeReceipts(label: string, variants: [string, pb.Sealed][], keys: Uint8Array[]) {
  const dir = path.join(work, `${label}-receipts`);
  mkdirSync(dir, { recursive: true });
  variants.forEach(([, sealed], i) => writeFileSync(path.join(dir, `${String(i).padStart(5, "0")}.bin`), toBinary(pb.SealedSchema, sealed)));
  const py = pythonVerdicts("verify-receipts", keys.map(toHex).join(","), dir);
  const rust = await rustVerdicts(
    variants.map((_, i) => [String(i).padStart(5, "0"), [...keyArgs(keys), "--receipt", path.join(dir, `${String(i).padStart(5, "0")}.bin`)]]),
  );
  const verdicts = new Map<string, Verdict>();
  variants.forEach(([name, sealed], i) => {
    const file = String(i).padStart(5, "0");
    const ts = tsReceipt(sealed, keys);
    assert.equal(py.get(file), ts, `${label} / ${name}: Python and TypeScript disagree`);
    assert.equal(rust.get(file), ts, `${label} / ${name}: Rust and TypeScript disagree`);
    verdicts.set(name, ts);
  });
  rmSync(dir, { recursive: true, force: true });
  return verdicts;
}

/** The genuine chain verifies alike in all three; every flipped variant fails in all three. */
async function everyFlipFails(label: string, chain: pb.ContractState[], keys: Uint8Array[]) {
  const leaf = chain.at(-1)!.contractId;
  const variants: [string, pb.ContractState[]][] = [["genuine", chain], ...flippedChains(chain)];
  const verdicts = await judgeChains(label, variants, keys, leaf);
  assert.match(verdicts.get("genuine")!, new RegExp(`ok chain of ${chain.length} contracts$`));
  const accepted = [...verdicts].filter(([name, v]) => name !== "genuine" && v !== "error").map(([name]) => name);
  assert.deepEqual(accepted, [], `${label}: flipped variants that still verify`);
  assert.ok(variants.length > 400, `${variants.length} variants`);
  return verdicts.get("genuine")!;
}

async function everyReceiptFlipFails(label: string, receipts: pb.Sealed[], keys: Uint8Array[]) {
  for (const [i, sealed] of receipts.entries()) {
    const verdicts = await judgeReceipts(`${label}-${i}`, [["genuine", sealed], ...flippedSealed(sealed)], keys);
    assert.match(verdicts.get("genuine")!, /^ok receipt /);
    const accepted = [...verdicts].filter(([name, v]) => name !== "genuine" && v !== "error").map(([name]) => name);
    assert.deepEqual(accepted, [], `${label} receipt ${i}: flipped variants that still verify`);
  }
}

// --- the tests ------------------------------------------------------------------------

test("a chain issued to TypeScript agents verifies in Python and in Rust; a bit flipped anywhere fails in all three", async () => {
  const [orchestrator, planner, executor, reviewer] = Array.from({ length: 4 }, () => Agent.generate()) as [Agent, Agent, Agent, Agent];
  const root = await broker.openRoot(orchestrator, { minTrust: 500_000, predicate: "result.schema_valid", labels: { client: "typescript" } });
  const request = orchestrator.delegate(
    liableChild(root.id, root.lineage, planner, 40n, "result.ok", { minRetryCost: 5n, delegateAttestation: broker.attest(planner, 0.9), task: "ü — a TypeScript hop" }),
  );
  const plannerId = issuedOf(await broker.checkOutcome(await broker.client.delegate(request))).contractId;
  const executorId = issuedOf(
    await broker.delegate(planner, liableChild(plannerId, root.lineage, executor, 20n, "", { writeScope: ["src/auth"], delegateAttestation: broker.attest(executor, 0.8) })),
  ).contractId;
  const leafId = issuedOf(
    await broker.delegate(executor, child(executorId, root.lineage, reviewer, 5n, { writeScope: ["src/auth/a.rs"], predicate: "result.reviewed", delegateAttestation: broker.attest(reviewer, 0.9) })),
  ).contractId;
  const refused = await broker.delegate(reviewer, child(leafId, root.lineage, Agent.generate(), 1_000n, { writeScope: ["src/auth/a.rs"] }));
  const accepted = (await broker.client.accept(planner.accept({ contractId: plannerId }))).receipt!;
  const chain = (await broker.client.getChain({ contractId: leafId })).chain;
  const keys = broker.keys.publicKeys();

  const genuine = await everyFlipFails("typescript", chain, keys);
  assert.ok(genuine.includes(`effective_predicate="(result.schema_valid\\n) && (result.ok\\n)"`), genuine);
  assert.ok(genuine.includes("trust_ppm=648000"), genuine);
  await everyReceiptFlipFails("typescript", [refused.refused!.sealed, accepted], keys);

  // The request a TypeScript agent signed verifies in Python and Rust; a flipped byte does not.
  const envelopes: [string, pb.Envelope][] = [["genuine", request.signed!]];
  for (const at of [0, 17, request.signed!.payload.length - 1]) {
    const payload = Uint8Array.from(request.signed!.payload);
    payload[at]! ^= 1;
    envelopes.push([`payload byte ${at}`, { ...request.signed!, payload }]);
  }
  const dir = path.join(work, "envelopes");
  mkdirSync(dir, { recursive: true });
  envelopes.forEach(([, e], i) => writeFileSync(path.join(dir, `${i}.bin`), toBinary(pb.EnvelopeSchema, create(pb.EnvelopeSchema, e))));
  const py = pythonVerdicts("verify-envelopes", toHex(orchestrator.publicKey), dir);
  const rust = await rustVerdicts(envelopes.map((_, i) => [String(i), ["--public-key", toHex(orchestrator.publicKey), "--envelope", path.join(dir, `${i}.bin`)]]));
  envelopes.forEach(([name, envelope], i) => {
    const ts = verifySignature(envelope, orchestrator.publicKey) ? "ok" : "error";
    assert.equal(ts, name === "genuine" ? "ok" : "error", name);
    assert.equal(py.get(String(i)), ts, `Python on ${name}`);
    assert.equal(rust.get(String(i)) === "error" ? "error" : "ok", ts, `Rust on ${name}`);
  });
});

test("a chain issued to Python agents verifies in TypeScript (and Rust); a bit flipped anywhere fails in all three", async () => {
  const out = path.join(work, "python-issued");
  const issued = spawnSync(python, [CROSS_SCRIPT, "issue", broker.process.address, out], { encoding: "utf8" });
  assert.equal(issued.status, 0, `cross.py issue failed: ${issued.stderr}`);
  const response = fromBinary(pb.GetChainResponseSchema, readFileSync(path.join(out, "chain.bin")));
  const chain = response.chain;
  const keys = broker.keys.publicKeys();
  assert.equal(chain.length, 4);

  // TypeScript verifies what Python agents were issued, from the keys alone.
  const verified = verifyChain(response, broker.keys, chain.at(-1)!.contractId);
  assert.deepEqual(verified.map((v) => v.effectivePredicate), [
    "(result.schema_valid\n)",
    "(result.schema_valid\n) && (result.tests_pass\n)",
    "(result.schema_valid\n) && (result.tests_pass\n)",
    "(result.reviewed\n)",
  ]);
  assert.equal(verified[0]!.contract.labels.client, "python");
  assert.equal(verified[1]!.contract.task, "ü — a Python hop");
  // Also as a reader of the broker: the same bytes as TypeScript reads them.
  const again = (await broker.client.getChain({ contractId: chain.at(-1)!.contractId })).chain;
  assert.deepEqual(again.map((s) => toHex(s.contract!.payload)), chain.map((s) => toHex(s.contract!.payload)));

  await everyFlipFails("python", chain, keys);
  const receipts = ["refusal.bin", "accepted.bin"].map((f) => fromBinary(pb.SealedSchema, readFileSync(path.join(out, f))));
  await everyReceiptFlipFails("python", receipts, keys);

  // The Delegate request a Python agent signed verifies in TypeScript.
  const envelope = fromBinary(pb.EnvelopeSchema, readFileSync(path.join(out, "request.bin")));
  const signer = fromHex(readFileSync(path.join(out, "orchestrator.hex"), "utf8").trim());
  assert.ok(verifySignature(envelope, signer, "application/vnd.delegation.broker.v1.DelegateBody+protobuf"));
  assert.ok(!verifySignature({ ...envelope, payload: envelope.payload.subarray(1) }, signer));
});

test("chains forged under a test key: the three verifiers agree on every broken term", async () => {
  const signer = Agent.generate();
  const keys = [signer.publicKey];
  const variants: [string, pb.ContractState[]][] = [
    ["genuine", asStates(forgeChain(signer, syntheticChain()))],
    ["unlinked", asStates(forgeChain(signer, syntheticChain(), false))],
    ...SYNTHETIC_VIOLATIONS.map(([name, , edit]) => [name, asStates(forgeChain(signer, broken(edit)))] as [string, pb.ContractState[]]),
  ];
  const verdicts = await judgeChains("synthetic", variants, keys);
  assert.match(verdicts.get("genuine")!, /ok chain of 4 contracts$/);
  for (const [name, verdict] of verdicts) if (name !== "genuine") assert.equal(verdict, "error", name);
});
