/**
 * gRPC over TLS from Node: a broker with a [tls] table (a self-signed
 * certificate made with openssl), reached with createNodeTransport over
 * https:// trusting that certificate; plaintext and an untrusted
 * certificate are refused.
 */

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { readFileSync, rmSync } from "node:fs";
import path from "node:path";
import { after, before, test } from "node:test";

import { Agent, BrokerError, BrokerKeys, createBrokerClient, nowMs, sessionClient, verifyContract } from "@delegation-broker/client";
import { createNodeTransport } from "@delegation-broker/client/node";

import { BrokerProcess, tempDir } from "./support.js";

let dir: string;
let broker: BrokerProcess;
let cert: string;

before(async () => {
  dir = tempDir("tls");
  const made = spawnSync(
    "openssl",
    [
      "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
      "-keyout", path.join(dir, "key.pem"), "-out", path.join(dir, "cert.pem"), "-days", "1",
      "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost", "-addext", "basicConstraints=critical,CA:FALSE",
    ],
    { encoding: "utf8" },
  );
  if (made.error !== undefined || made.status !== 0) {
    throw new Error(`the TLS test needs openssl to make a self-signed certificate: ${made.error?.message ?? made.stderr}`);
  }
  cert = readFileSync(path.join(dir, "cert.pem"), "utf8");
  broker = await BrokerProcess.start(path.join(dir, "broker"), {
    extraConfig: `\n[tls]\ncert = "${path.join(dir, "cert.pem")}"\nkey = "${path.join(dir, "key.pem")}"\n`,
  });
});
after(async () => {
  assert.equal(await broker.stop(), 0);
  rmSync(dir, { recursive: true, force: true });
});

test("over TLS: open a root, read it with a session; plaintext and an untrusted certificate are refused", async () => {
  const port = broker.address.split(":").at(-1);
  const tls = createNodeTransport(`https://localhost:${port}`, { ca: cert });
  const orchestrator = Agent.generate();
  const client = await sessionClient(tls, orchestrator);
  const keys = await BrokerKeys.fetch(client);
  const root = (
    await client.openRoot(
      orchestrator.openRoot({ intent: "over TLS", budget: 10n, deadlineMs: nowMs() + 600_000n, policy: { maxDepth: 2, maxChildren: 2 } }),
    )
  ).issued!;
  verifyContract(root.contract!, keys, root.contractId);
  assert.ok((await client.getContract({ contractId: root.contractId })).contract);

  const untrusted = createBrokerClient(createNodeTransport(`https://localhost:${port}`));
  await assert.rejects(untrusted.getBrokerKeys({}, { timeoutMs: 5_000 }), (e: unknown) => e instanceof BrokerError && /certificate/.test(e.message));
  const plaintext = createBrokerClient(createNodeTransport(`localhost:${port}`));
  await assert.rejects(plaintext.getBrokerKeys({}, { timeoutMs: 5_000 }), (e: unknown) => e instanceof BrokerError);
});
