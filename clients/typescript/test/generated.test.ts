/**
 * The generated code: every RPC of the service is on the client, every
 * generated file of the broker's package is re-exported by `pb`, and every
 * signed `...Body` maps to its `...Request`. (The drift check — regenerating
 * with buf into a temporary directory and comparing — is in run-tests.sh.)
 */

import assert from "node:assert/strict";
import { readdirSync } from "node:fs";
import path from "node:path";
import { test } from "node:test";

import { Agent, createBrokerClient, pb, registry, requestSchemaFor, verifySignature } from "@delegation-broker/client";
import { createNodeTransport } from "@delegation-broker/client/node";
import { createWebTransport } from "@delegation-broker/client/web";
import { createClient } from "@connectrpc/connect";
import { create, type DescMessage } from "@bufbuild/protobuf";

import { CLIENT_ROOT } from "./support.js";

test("every RPC of the Broker service is on the client", () => {
  const client = createBrokerClient(createNodeTransport("127.0.0.1:1")) as unknown as Record<string, unknown>;
  const names = pb.Broker.methods.map((m) => m.name);
  for (const method of pb.Broker.methods) assert.equal(typeof client[method.localName], "function", method.name);
  for (const expected of ["OpenRoot", "Delegate", "GetContract", "GetChain", "ListChildren", "GetReceipt", "GetBrokerKeys", "OpenSession", "BindIdentity", "Watch", "GetAudit", "AggregateAudits"]) {
    assert.ok(names.includes(expected), expected);
  }
  assert.equal(pb.Broker.typeName, "delegation.broker.v1.Broker");
  // The browser transport builds a client of the same service.
  assert.equal(typeof createClient(pb.Broker, createWebTransport("https://broker.example")).getBrokerKeys, "function");
});

test("every generated file of delegation.broker is re-exported by pb", () => {
  const dir = path.join(CLIENT_ROOT, "src", "gen", "delegation", "broker", "v1");
  const files = readdirSync(dir).filter((f) => f.endsWith("_pb.ts"));
  assert.deepEqual(files.sort(), ["broker_pb.ts", "errors_pb.ts", "types_pb.ts"], "a new proto file: add it to src/pb.ts");
  const exported = pb as unknown as Record<string, unknown>;
  for (const file of files) {
    const name = `file_delegation_broker_v1_${file.replace(/_pb\.ts$/, "")}`;
    assert.ok(exported[name], `${name} is not re-exported from src/pb.ts`);
  }
});

test("every signed ...Body maps to its ...Request, and signRequest signs any of them", () => {
  const bodies = [...registry].filter((t): t is DescMessage => t.kind === "message" && t.typeName.endsWith("Body") && t.field.header !== undefined);
  assert.deepEqual(bodies.map((b) => b.name).sort(), [
    "AcceptBody", "AdjudicateBody", "BindIdentityBody", "CompleteBody", "DeclineBody", "DelegateBody", "EscalateBody",
    "OpenRootBody", "OpenSessionBody", "RecordReceiptsBody", "RevokeBody",
  ]);
  const agent = Agent.generate();
  for (const body of bodies) {
    assert.equal(requestSchemaFor(body).typeName, body.typeName.replace(/Body$/, "Request"));
    const request = agent.signRequest(create(body)) as unknown as { $typeName: string; signed: pb.Envelope };
    assert.equal(request.$typeName, body.typeName.replace(/Body$/, "Request"));
    assert.equal(request.signed.payloadType, `application/vnd.${body.typeName}+protobuf`);
    assert.ok(verifySignature(request.signed, agent.publicKey));
  }
  assert.throws(() => requestSchemaFor(pb.ContractSchema), TypeError);
});
