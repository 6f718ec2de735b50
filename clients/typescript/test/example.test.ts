/** The README's three-hop example (examples/three-hops.ts) runs against the real broker, as a user would run it. */

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import path from "node:path";
import { after, before, test } from "node:test";
import { promisify } from "node:util";
import { readFileSync } from "node:fs";

import { toHex } from "@delegation-broker/client";

import { Broker, CLIENT_ROOT } from "./support.js";

const run = promisify(execFile);
const EXAMPLE = path.join(CLIENT_ROOT, "build", "examples", "three-hops.js");

let broker: Broker;
before(async () => {
  broker = await Broker.start("example");
});
after(async () => {
  await broker.close();
});

test("three hops with attestations: every hop's terms printed, the chain verified", async () => {
  const { stdout } = await run("node", [EXAMPLE, broker.process.address, toHex(broker.attestor.seed)]);
  const lines = stdout.trimEnd().split("\n");
  assert.deepEqual(lines.slice(0, 4), [
    `depth 0: budget 100 (residual 50), LIABILITY_DELEGATE, predicate "-", cumulative trust 1000000 ppm (TRUST_SOURCE_ROOT)`,
    `depth 1: budget 50 (residual 30), LIABILITY_DELEGATE, predicate "(result.schema_valid\\n)", cumulative trust 900000 ppm (TRUST_SOURCE_ATTESTATION)`,
    `depth 2: budget 20 (residual 15), LIABILITY_DELEGATE, predicate "(result.schema_valid\\n) && (result.tests_pass\\n)", cumulative trust 720000 ppm (TRUST_SOURCE_ATTESTATION)`,
    `depth 3: budget 5 (residual 5), LIABILITY_PRINCIPAL, predicate "-", cumulative trust 540000 ppm (TRUST_SOURCE_ATTESTATION)`,
  ]);
  assert.equal(lines[4], `verified a chain of 4 contracts: 3 hash links and the leaf's signature by broker key ${broker.keys.current}`);
  assert.match(lines[5]!, /^archived as \d+ bytes \(GetChainResponse\); verified again from them: 4 contracts$/);
  assert.equal(lines.length, 6);
});

test("three hops without an attestor: no trust source, the policy allows it", async () => {
  const { stdout } = await run("node", [EXAMPLE, broker.process.address]);
  assert.match(stdout, /depth 3: budget 5 \(residual 5\), LIABILITY_PRINCIPAL, predicate "-", cumulative trust 0 ppm \(TRUST_SOURCE_NONE\)/);
  assert.match(stdout, /verified a chain of 4 contracts/);
});

test("the README's three-hop core runs as printed (root → child → grandchild)", async () => {
  const source = readFileSync(path.join(CLIENT_ROOT, "examples", "three-hops-core.ts"), "utf8");
  const readme = readFileSync(path.join(CLIENT_ROOT, "README.md"), "utf8");
  assert.ok(readme.includes("```ts\n" + source + "```\n"), "README.md shows examples/three-hops-core.ts verbatim");
  const { stdout } = await run("node", [path.join(CLIENT_ROOT, "build", "examples", "three-hops-core.js")], {
    env: { ...process.env, BROKER_ADDRESS: broker.process.address },
  });
  const lines = stdout.trimEnd().split("\n");
  assert.equal(lines.length, 3);
  assert.match(lines[0]!, /^0 [0-9a-f]{16} 100n ""$/);
  assert.match(lines[1]!, /^1 [0-9a-f]{16} 50n "\(result\.schema_valid\\n\)"$/);
  assert.match(lines[2]!, /^2 [0-9a-f]{16} 20n "\(result\.schema_valid\\n\) && \(result\.tests_pass\\n\)"$/);
});
