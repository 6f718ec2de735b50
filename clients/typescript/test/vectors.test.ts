/**
 * The shared signing test vectors (testdata/signing-vectors.json, written by
 * scripts/signing-vectors.py), checked with this client's code. The same file
 * is checked by the broker (tests/vectors.rs) and the Python client
 * (clients/python/tests/test_vectors.py). No broker needed.
 */

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import path from "node:path";
import { test } from "node:test";

import { create, fromBinary, toBinary, type DescMessage } from "@bufbuild/protobuf";
import {
  Agent,
  BrokerKeys,
  VerificationError,
  equalBytes,
  fromHex,
  keyId,
  lineageHash,
  pae,
  payloadType,
  pb,
  registry,
  sha256,
  toHex,
  verifyChain,
  verifyPaeSignature,
  verifyReceipt,
  verifySealed,
  verifySignature,
  type SealedSchema,
} from "@delegation-broker/client";

import { REPO_ROOT } from "./support.js";

interface Case {
  name: string;
  form: "envelope" | "sealed";
  message: string;
  payload_type: string;
  seed: string;
  public_key: string;
  key_id: string;
  body: string;
  pae: string;
  signature: string;
  signed: string;
  id: string | null;
  request_digest: string | null;
}

interface Negative {
  name: string;
  base: string;
  form: "envelope" | "sealed";
  payload_type: string;
  public_key: string;
  body: string;
  signature: string;
}

interface Vectors {
  broker_keys: { key_id: string; public_key: string; current: boolean }[];
  cases: Case[];
  chain: string[];
  negative: Negative[];
}

const VECTORS = JSON.parse(readFileSync(path.join(REPO_ROOT, "testdata", "signing-vectors.json"), "utf8")) as Vectors;
const CASES = new Map(VECTORS.cases.map((c) => [c.name, c]));

const SEALED: Record<string, SealedSchema> = {
  "delegation.broker.v1.Contract": pb.ContractSchema,
  "delegation.broker.v1.Receipt": pb.ReceiptSchema,
  "delegation.broker.v1.Session": pb.SessionSchema,
};

function get(name: string): Case {
  const found = CASES.get(name);
  assert.ok(found, `no case ${name}`);
  return found;
}

function keys(): BrokerKeys {
  return new BrokerKeys(
    VECTORS.broker_keys.map((k) =>
      create(pb.BrokerKeySchema, { keyId: k.key_id, publicKey: fromHex(k.public_key), current: k.current }),
    ),
  );
}

function sealedOf(c: { body: string; signature: string }): pb.Sealed {
  return create(pb.SealedSchema, { payload: fromHex(c.body), signature: fromHex(c.signature) });
}

function schemaOf(message: string): DescMessage {
  const schema = registry.getMessage(message);
  assert.ok(schema, `unknown message ${message}`);
  return schema;
}

function sealedSchemaOf(payloadType_: string): SealedSchema {
  const name = payloadType_.replace(/^application\/vnd\./, "").replace(/\+protobuf$/, "");
  const schema = SEALED[name];
  assert.ok(schema, `${payloadType_} is not a sealed type`);
  return schema;
}

test("the vectors cover every signed form, and negative cases", () => {
  const forms = new Set(VECTORS.cases.map((c) => `${c.form} ${c.message}`));
  for (const name of Object.keys(SEALED)) assert.ok(forms.has(`sealed ${name}`), name);
  assert.ok(VECTORS.cases.some((c) => c.form === "envelope"));
  assert.ok(VECTORS.negative.length > 0);
});

for (const c of VECTORS.cases) {
  test(`vector ${c.name}: PAE, key id, signature, re-signing, ids`, () => {
    const body = fromHex(c.body);
    const signature = fromHex(c.signature);
    const publicKey = fromHex(c.public_key);
    const agent = Agent.fromSeed(fromHex(c.seed));
    assert.equal(toHex(agent.publicKey), c.public_key, "the public key is the seed's");
    assert.equal(keyId(publicKey), c.key_id);
    assert.equal(agent.keyId, c.key_id);
    const schema = schemaOf(c.message);
    assert.equal(payloadType(schema), c.payload_type);
    assert.equal(toHex(pae(c.payload_type, body)), c.pae);
    assert.ok(verifyPaeSignature(c.payload_type, body, signature, publicKey));
    // ed25519 is deterministic: signing again from the seed gives the same bytes.
    assert.equal(toHex(agent.signRaw(pae(c.payload_type, body))), c.signature);
    assert.equal(toHex(agent.signBytes(c.payload_type, body).signatures[0]!.sig), c.signature);
    // The body is canonical protobuf: decoding and re-encoding gives it back.
    const message = fromBinary(schema, body);
    assert.equal(toHex(toBinary(schema, message)), c.body);
    const signed = fromHex(c.signed);
    if (c.form === "envelope") {
      assert.equal(SEALED[c.message], undefined);
      assert.equal(c.id, null);
      assert.equal(c.request_digest, toHex(sha256(fromHex(c.pae))));
      const envelope = fromBinary(pb.EnvelopeSchema, signed);
      assert.equal(envelope.payloadType, c.payload_type);
      assert.ok(equalBytes(envelope.payload, body));
      assert.equal(envelope.signatures.length, 1);
      assert.equal(envelope.signatures[0]!.keyid, c.key_id);
      assert.ok(equalBytes(envelope.signatures[0]!.sig, signature));
      assert.equal(toHex(toBinary(pb.EnvelopeSchema, agent.signBytes(c.payload_type, body))), c.signed);
      assert.ok(verifySignature(envelope, publicKey, c.payload_type));
      const header = (message as unknown as { header?: pb.RequestHeader }).header;
      assert.ok(header && equalBytes(header.agentPublicKey, publicKey), "a request is signed by its header's agent");
    } else {
      const sealedSchema = SEALED[c.message];
      assert.ok(sealedSchema);
      assert.equal(c.request_digest, null);
      assert.equal(c.id, toHex(sha256(body)));
      const sealed = fromBinary(pb.SealedSchema, signed);
      assert.ok(equalBytes(sealed.payload, body));
      assert.ok(equalBytes(sealed.signature, signature));
      assert.equal(toHex(toBinary(pb.SealedSchema, sealedOf(c))), c.signed);
      const verified = verifySealed(sealed, keys(), sealedSchema);
      assert.equal(toHex(verified.id), c.id);
      assert.equal(verified.keyId, c.key_id);
    }
  });
}

test("vectors: the chain verifies and every binding holds", () => {
  const chain = VECTORS.chain.map((name) => sealedOf(get(name)));
  const ids = VECTORS.chain.map((name) => get(name).id!);
  const verified = verifyChain(chain, keys(), fromHex(ids[ids.length - 1]!));
  assert.deepEqual(verified.map((v) => toHex(v.contractId)), ids);
  const [root, child] = verified.map((v) => v.contract);
  assert.ok(root && child);
  assert.ok(equalBytes(root.intentLineageHash, lineageHash(root.intent)));
  assert.ok(equalBytes(child.intentLineageHash, root.intentLineageHash));
  assert.equal(toHex(root.requestDigest), get("open-root").request_digest);
  assert.equal(toHex(child.requestDigest), get("delegate").request_digest);
  assert.equal(verified[1]!.effectivePredicate, `(${root.predicate}\n) && (${child.predicate}\n)`);
  assert.equal(toHex(fromBinary(pb.DelegateBodySchema, fromHex(get("delegate").body)).parentId), ids[0]);

  const refused = get("receipt-refused");
  const receipt = verifyReceipt(sealedOf(refused), keys(), fromHex(refused.id!)).message;
  assert.equal(receipt.kind, pb.ReceiptKind.REFUSED);
  assert.equal(toHex(receipt.contractId), ids[0]);
  assert.equal(toHex(receipt.rootId), ids[0]);
  assert.equal(toHex(receipt.requestDigest), get("delegate-refused").request_digest);
  assert.equal(receipt.primary, pb.InvariantCode.NO_RETRY_HEADROOM);

  const session = verifySealed(sealedOf(get("session")), keys(), pb.SessionSchema).message;
  assert.equal(toHex(session.agentPublicKey), get("open-session").public_key);
  assert.equal(fromBinary(pb.OpenSessionBodySchema, fromHex(get("open-session").body)).brokerKeyId, session.brokerKeyId);
});

for (const n of VECTORS.negative) {
  test(`negative vector ${n.name} fails`, () => {
    const body = fromHex(n.body);
    const signature = fromHex(n.signature);
    const publicKey = fromHex(n.public_key);
    assert.equal(verifyPaeSignature(n.payload_type, body, signature, publicKey), false);
    if (n.form === "envelope") {
      const envelope = create(pb.EnvelopeSchema, {
        payloadType: n.payload_type,
        payload: body,
        signatures: [{ sig: signature }],
      });
      assert.equal(verifySignature(envelope, publicKey), false);
    } else {
      assert.throws(() => verifySealed(sealedOf(n), keys(), sealedSchemaOf(n.payload_type)), VerificationError);
    }
  });
}

test("vectors: a flipped bit anywhere in the leaf breaks the chain", () => {
  const chain = VECTORS.chain.map((name) => sealedOf(get(name)));
  const flipped = VECTORS.negative.find((n) => n.base === VECTORS.chain[0] && n.body !== get(n.base).body);
  assert.ok(flipped);
  assert.throws(() => verifyChain([sealedOf(flipped)], keys()), VerificationError);
  const leaf = chain[chain.length - 1]!;
  for (let index = 0; index < leaf.payload.length; index += 7) {
    const tampered = Uint8Array.from(leaf.payload);
    tampered[index] = tampered[index]! ^ 0x80;
    const forged = create(pb.SealedSchema, { payload: tampered, signature: leaf.signature });
    assert.throws(() => verifyChain([...chain.slice(0, -1), forged], keys()), VerificationError, `byte ${index}`);
  }
});
