/**
 * Every TypeScript snippet of README.md type-checks against the package as
 * built (dist/): each in a module of its own, its imports replaced by one
 * prelude importing everything it may use and declaring the free names the
 * prose gives it (a worker, a contract id, a transport...). The three-hop
 * core is run too (example.test.ts).
 */

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import path from "node:path";
import { test } from "node:test";
import { promisify } from "node:util";

import { CLIENT_ROOT } from "./support.js";

const run = promisify(execFile);

// Only the package itself: what a snippet uses must be exported by it (its
// protobuf-es and connect runtimes included), never installed beside it.
// The one exception is a resource server's stock JOSE library: a snippet's
// imports from "jose" (a devDependency here) are kept.
const PRELUDE = `
import {
  Agent, BrokerError, BrokerKeys, Code, ConnectError, RenewingSession, callIdempotent, codeName, create,
  createBrokerClient, fromBinary, fromHex, nowMs, openSession, pb, sessionClient, sessionInterceptor, toBinary, toHex,
  verifyChain, verifyContract, verifyReceipt, watch, TokenEndpoint, TokenEndpointError, signAssertion, bindIdentity,
  IDENTITY_CHECKS, type BrokerClient,
} from "@delegation-broker/client";
import { createNodeTransport } from "@delegation-broker/client/node";
import { createWebTransport } from "@delegation-broker/client/web";
void [Agent, BrokerError, BrokerKeys, Code, ConnectError, RenewingSession, callIdempotent, codeName, create,
  createBrokerClient, fromBinary, fromHex, nowMs, openSession, pb, sessionClient, sessionInterceptor, toBinary, toHex,
  verifyChain, verifyContract, verifyReceipt, watch, TokenEndpoint, TokenEndpointError, signAssertion, bindIdentity,
  IDENTITY_CHECKS, createWebTransport];
export {};
`;

/** The free names snippets may use, declared unless the snippet declares them itself. */
const FREE: Record<string, string> = {
  client: "BrokerClient",
  keys: "BrokerKeys",
  agent: "Agent",
  worker: "Agent",
  host: "Agent",
  transport: "ReturnType<typeof createNodeTransport>",
  baseUrl: "string",
  contractId: "Uint8Array",
  rootId: "Uint8Array",
  request: "pb.DelegateRequest",
  svid: "string",
  response: "{ receiptId: Uint8Array; receipt?: pb.Sealed }",
};

function declarations(snippet: string): string {
  return Object.entries(FREE)
    .filter(([name]) => !new RegExp(`\\b(const|let) ${name}\\b`).test(snippet))
    .map(([name, type]) => `declare const ${name}: ${type};\n`)
    .join("");
}

function snippets(readme: string): string[] {
  return [...readme.matchAll(/```ts\n([\s\S]*?)```\n/g)].map((m) => m[1]!);
}

function withoutImports(source: string): string {
  return source.replace(/^import [\s\S]*?from "([^"]+)";\n/gm, (line, from: string) => (from === "jose" ? line : ""));
}

test("every TypeScript snippet of README.md type-checks", async () => {
  const all = snippets(readFileSync(path.join(CLIENT_ROOT, "README.md"), "utf8"));
  assert.ok(all.length >= 5, `${all.length} snippets`);
  const dir = path.join(CLIENT_ROOT, "build", "readme");
  rmSync(dir, { recursive: true, force: true });
  mkdirSync(dir, { recursive: true });
  const files = all.slice(1).map((snippet, i) => {
    const file = path.join(dir, `snippet-${i + 1}.ts`);
    writeFileSync(file, PRELUDE + declarations(snippet) + withoutImports(snippet));
    return file;
  });
  writeFileSync(
    path.join(dir, "tsconfig.json"),
    JSON.stringify({
      extends: path.join(CLIENT_ROOT, "tsconfig.json"),
      compilerOptions: { noEmit: true, rootDir: dir, noUnusedLocals: false },
      include: files,
    }),
  );
  try {
    await run(path.join(CLIENT_ROOT, "node_modules", ".bin", "tsc"), ["-p", path.join(dir, "tsconfig.json")]);
  } catch (e) {
    assert.fail(`README snippets do not type-check:\n${(e as { stdout?: string }).stdout}`);
  }
});
