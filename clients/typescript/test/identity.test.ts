/**
 * Workload identities (BindIdentity) against the real broker: a SPIFFE
 * issuer made here with `jose` (an ES256 key, its bundle in a file the
 * broker's `[identity.issuers.spire]` names) mints JWT-SVIDs; an
 * orchestrator allowed only by a SPIFFE ID pattern is refused until its key
 * is bound, then opens a root; its worker binds too; the chain GetChain
 * serves, verified offline with the package's verifier, names both
 * workloads in the broker-signed payloads. Bad tokens are refused with the
 * exact check; a key bound to a reader identity lists every root.
 */

import assert from "node:assert/strict";
import { createHmac, webcrypto } from "node:crypto";
import { rmSync, writeFileSync } from "node:fs";
import path from "node:path";
import { after, before, test } from "node:test";

import { SignJWT, decodeJwt, exportJWK, generateKeyPair, type CryptoKey, type JWTPayload } from "jose";

import {
  Agent,
  BrokerError,
  BrokerKeys,
  Code,
  ConnectError,
  IDENTITY_CHECKS,
  VerificationError,
  base64url,
  bindIdentity,
  callIdempotent,
  create,
  equalBytes,
  fromBinary,
  pb,
  toBinary,
  toHex,
  verifyChain,
  verifyEverySignature,
  verifySignature,
} from "@delegation-broker/client";

import { Broker, child, issuedOf, refusal, tempDir } from "./support.js";

const TRUST_DOMAIN = "prod.test";
const AUDIENCE = "delegation-broker";
const KID = "k1";
const ALLOWANCE = 1000n;
const ORCHESTRATOR_ID = `spiffe://${TRUST_DOMAIN}/orchestrators/planner`;
const WORKER_ID = `spiffe://${TRUST_DOMAIN}/workers/w1`;
const AUDITOR_ID = `spiffe://${TRUST_DOMAIN}/auditors/a`;

/** A SPIFFE issuer's JWT signer, as SPIRE holds it: one ES256 key. */
class TestIssuer {
  private constructor(
    readonly privateKey: CryptoKey,
    readonly publicKey: CryptoKey,
  ) {}

  static async create(): Promise<TestIssuer> {
    const { privateKey, publicKey } = await generateKeyPair("ES256");
    return new TestIssuer(privateKey, publicKey);
  }

  /** The SPIFFE bundle: a JWKS whose key is for JWT-SVIDs. */
  async bundle(): Promise<{ keys: Record<string, string>[]; spiffe_sequence: number }> {
    const jwk = await exportJWK(this.publicKey);
    return { keys: [{ kty: jwk.kty!, crv: jwk.crv!, x: jwk.x!, y: jwk.y!, kid: KID, use: "jwt-svid" }], spiffe_sequence: 1 };
  }

  /** The public key as bytes: the uncompressed SEC1 point (0x04 ‖ x ‖ y). */
  async publicKeyBytes(): Promise<Uint8Array> {
    return new Uint8Array(await webcrypto.subtle.exportKey("raw", this.publicKey as webcrypto.CryptoKey));
  }

  /** A JWT over `claims`, signed ES256 with this key (header `{alg, kid}`). */
  sign(claims: JWTPayload, header: { alg: string; kid?: string } = { alg: "ES256", kid: KID }): Promise<string> {
    return new SignJWT(claims).setProtectedHeader(header).sign(this.privateKey);
  }

  /** A JWT-SVID for `path` in the trust domain, valid five minutes; `change` edits its claims first. */
  svid(pathInDomain: string, change: (claims: JWTPayload) => void = () => {}): Promise<string> {
    const claims = svidClaims(pathInDomain);
    change(claims);
    return this.sign(claims);
  }
}

function nowS(): number {
  return Math.floor(Date.now() / 1000);
}

function svidClaims(pathInDomain: string): JWTPayload {
  const now = nowS();
  return { sub: `spiffe://${TRUST_DOMAIN}${pathInDomain}`, aud: [AUDIENCE], exp: now + 300, iat: now };
}

const encodeJson = (value: unknown) => base64url(new TextEncoder().encode(JSON.stringify(value)));

let issuer: TestIssuer;
/** Trusts the test issuer; orchestrators by SPIFFE pattern only; auditors read everything. */
let spire: Broker;
/** Trusts no issuer. */
let plain: Broker;
let bundleDir: string;

before(async () => {
  issuer = await TestIssuer.create();
  bundleDir = tempDir("identity-bundle");
  const bundle = path.join(bundleDir, "bundle.json");
  writeFileSync(bundle, JSON.stringify(await issuer.bundle()));
  spire = await Broker.start("identity", {
    readerIdentities: [`spiffe://${TRUST_DOMAIN}/auditors/*`],
    extraConfig: [
      "",
      "[identity.issuers.spire]",
      'kind = "spiffe"',
      `trust_domain = ${JSON.stringify(TRUST_DOMAIN)}`,
      `audiences = [${JSON.stringify(AUDIENCE)}]`,
      `jwks_file = ${JSON.stringify(bundle)}`,
      "",
      "[orchestrators]",
      `${JSON.stringify(`spiffe://${TRUST_DOMAIN}/orchestrators/*`)} = ${ALLOWANCE}`,
      "",
    ].join("\n"),
  });
  plain = await Broker.start("identity-none");
});

after(async () => {
  await spire?.close();
  await plain?.close();
  rmSync(bundleDir, { recursive: true, force: true });
});

/** Runs `call`, which must fail with a BrokerError: it. */
async function brokerError(call: () => Promise<unknown>): Promise<BrokerError> {
  try {
    await call();
  } catch (caught) {
    assert.ok(caught instanceof BrokerError, `expected a BrokerError, got ${String(caught)}`);
    return caught;
  }
  assert.fail("expected a refusal, the call was answered");
}

/** A fresh key bound to spiffe://prod.test/orchestrators/<name>, and the root it opened. */
async function boundOrchestrator(name: string): Promise<{ orchestrator: Agent; identity: string; rootId: Uint8Array; lineage: Uint8Array }> {
  const orchestrator = Agent.generate();
  const identity = `spiffe://${TRUST_DOMAIN}/orchestrators/${name}`;
  const bound = await bindIdentity(spire.bare, orchestrator, await issuer.svid(`/orchestrators/${name}`));
  assert.equal(bound.identity, identity);
  const root = await spire.openRoot(orchestrator);
  return { orchestrator, identity, rootId: root.id, lineage: root.lineage };
}

// --- tests ---------------------------------------------------------------------------------

test("an orchestrator named only by a SPIFFE pattern is refused unbound, binds, opens a root; the verified chain names both workloads", async () => {
  const orchestrator = Agent.generate();
  const worker = Agent.generate();

  // Unbound, its key is nobody's orchestrator.
  const [code, reason] = await refusal(() => spire.openRoot(orchestrator));
  assert.deepEqual([code, reason], [Code.PermissionDenied, "NOT_AN_ORCHESTRATOR"]);

  const token = await issuer.svid("/orchestrators/planner");
  const bound = await bindIdentity(spire.bare, orchestrator, token);
  assert.equal(bound.$typeName, "delegation.broker.v1.BindIdentityResponse");
  assert.equal(bound.identity, ORCHESTRATOR_ID);
  assert.equal(bound.issuer, "spire");
  assert.equal(bound.expiresAtMs, BigInt(decodeJwt(token).exp!) * 1000n, "the binding ends at the token's exp");

  // Bound, the pattern's allowance holds; within it, the root opens and names its opener.
  const [overCode, overReason] = await refusal(() => spire.openRoot(orchestrator, { budget: ALLOWANCE + 1n }));
  assert.deepEqual([overCode, overReason], [Code.PermissionDenied, "ROOT_BUDGET_OVER_ALLOWANCE"]);
  const root = await spire.openRoot(orchestrator, { budget: 100n });
  assert.equal(root.contract.delegateIdentity, ORCHESTRATOR_ID);

  // The worker binds, and the orchestrator delegates to it.
  const workerBound = await bindIdentity(spire.bare, worker, await issuer.svid("/workers/w1"));
  assert.deepEqual([workerBound.identity, workerBound.issuer], [WORKER_ID, "spire"]);
  const childId = issuedOf(await spire.delegate(orchestrator, child(root.id, root.lineage, worker, 40n))).contractId;

  // GetChain, verified offline with the package's verifier, from the published keys alone.
  const served = await spire.client.getChain({ contractId: childId }, { timeoutMs: 10_000 });
  const keys = await BrokerKeys.fetch(spire.bare);
  const hops = verifyChain(served, keys, childId);
  verifyEverySignature(served, keys);
  assert.equal(hops.length, 2);
  assert.ok(equalBytes(hops[0]!.contractId, root.id) && equalBytes(hops[1]!.contractId, childId));
  assert.ok(equalBytes(hops[0]!.contract.delegatePublicKey, orchestrator.publicKey));
  assert.ok(equalBytes(hops[1]!.contract.delegatePublicKey, worker.publicKey));
  assert.deepEqual(
    hops.map((hop) => hop.contract.delegateIdentity),
    [ORCHESTRATOR_ID, WORKER_ID],
    "each contract names its delegate's workload",
  );

  // The identity is inside what the broker signed: changed, the chain no longer verifies.
  const leaf = served.chain[1]!.contract!;
  const forged = fromBinary(pb.ContractSchema, leaf.payload);
  forged.delegateIdentity = `spiffe://${TRUST_DOMAIN}/workers/someone-else`;
  const tampered = create(pb.SealedSchema, { payload: toBinary(pb.ContractSchema, forged), signature: leaf.signature });
  assert.throws(() => verifyChain([served.chain[0]!.contract!, tampered], keys), VerificationError);

  // A delegate that never bound gets a contract naming no workload.
  const stranger = Agent.generate();
  const unnamed = issuedOf(await spire.delegate(orchestrator, child(root.id, root.lineage, stranger, 10n)));
  assert.equal(unnamed.contract.delegateIdentity, "");
  assert.deepEqual(
    (await spire.chain(unnamed.contractId)).map((hop) => hop.contract.delegateIdentity),
    [ORCHESTRATOR_ID, ""],
  );
});

test("the same signed BindIdentity sent twice binds twice (not in the request log); a fresh token renews", async () => {
  const agent = Agent.generate();
  const request = agent.bindIdentity(await issuer.svid("/workers/w2"));
  assert.equal(request.signed!.payloadType, "application/vnd.delegation.broker.v1.BindIdentityBody+protobuf");
  const first = await callIdempotent(spire.bare.bindIdentity, request);
  const again = await callIdempotent(spire.bare.bindIdentity, request);
  assert.deepEqual([first.identity, again.identity], [`spiffe://${TRUST_DOMAIN}/workers/w2`, `spiffe://${TRUST_DOMAIN}/workers/w2`]);
  assert.equal(again.expiresAtMs, first.expiresAtMs);

  // A later binding replaces the earlier: the key is now another workload, and its contracts say so.
  const renewed = await bindIdentity(spire.bare, agent, await issuer.svid("/workers/w3"));
  assert.equal(renewed.identity, `spiffe://${TRUST_DOMAIN}/workers/w3`);
  const { orchestrator, rootId, lineage } = await boundOrchestrator("renewer");
  const issued = issuedOf(await spire.delegate(orchestrator, child(rootId, lineage, agent, 10n)));
  assert.equal(issued.contract.delegateIdentity, `spiffe://${TRUST_DOMAIN}/workers/w3`);
});

test("bindIdentity resends the very same signed request on UNAVAILABLE, and nothing else", async () => {
  const agent = Agent.generate();
  const token = await issuer.svid("/workers/w4");
  const sent: pb.BindIdentityRequest[] = [];
  const answer = create(pb.BindIdentityResponseSchema, { identity: `spiffe://${TRUST_DOMAIN}/workers/w4`, issuer: "spire", expiresAtMs: 1n });
  const flaky = (failures: Code[]) => ({
    bindIdentity: async (request: pb.BindIdentityRequest) => {
      sent.push(request);
      const code = failures.shift();
      if (code !== undefined) throw new ConnectError("injected", code);
      return answer;
    },
  });
  const noWait = { sleep: async () => {} };

  assert.equal(await bindIdentity(flaky([Code.Unavailable, Code.DeadlineExceeded]), agent, token, noWait), answer);
  assert.equal(sent.length, 3);
  for (const request of sent) assert.equal(toHex(toBinary(pb.BindIdentityRequestSchema, request)), toHex(toBinary(pb.BindIdentityRequestSchema, sent[0]!)));
  const body = fromBinary(pb.BindIdentityBodySchema, sent[0]!.signed!.payload);
  assert.equal(body.token, token);
  assert.ok(equalBytes(body.header!.agentPublicKey, agent.publicKey));
  assert.ok(verifySignature(sent[0]!.signed!, agent.publicKey, "application/vnd.delegation.broker.v1.BindIdentityBody+protobuf"));

  sent.length = 0;
  const error = await brokerError(() => bindIdentity(flaky([Code.Unauthenticated]), agent, token, noWait));
  assert.deepEqual([error.code, sent.length], [Code.Unauthenticated, 1], "a refusal is not resent");
});

test("bad workload tokens are refused UNAUTHENTICATED, IDENTITY_REFUSED, naming the check; nothing is bound", async () => {
  const agent = Agent.generate();
  const now = nowS();
  const claims = svidClaims("/orchestrators/a");

  // HS256 keyed with the issuer's public key bytes: the classic algorithm confusion.
  const hsInput = `${encodeJson({ alg: "HS256", kid: KID })}.${encodeJson(claims)}`;
  const hsTag = createHmac("sha256", await issuer.publicKeyBytes()).update(hsInput).digest();
  const hs256 = `${hsInput}.${base64url(new Uint8Array(hsTag))}`;

  // Another key, posing as the issuer's (same kid).
  const impostor = await TestIssuer.create();

  const cases: [string, string, string][] = [
    ["expired", await issuer.svid("/orchestrators/a", (c) => Object.assign(c, { iat: now - 900, exp: now - 600 })), "IDENTITY_EXPIRED"],
    ["wrong audience", await issuer.svid("/orchestrators/a", (c) => Object.assign(c, { aud: ["someone-else"] })), "IDENTITY_AUDIENCE"],
    ["alg none", `${encodeJson({ alg: "none" })}.${encodeJson(claims)}.`, "IDENTITY_ALGORITHM"],
    ["HS256 keyed with the issuer's public key", hs256, "IDENTITY_ALGORITHM"],
    [
      "another trust domain",
      await issuer.svid("/orchestrators/a", (c) => Object.assign(c, { sub: "spiffe://staging.test/orchestrators/a" })),
      "IDENTITY_TRUST_DOMAIN",
    ],
    ["signed by another key", await impostor.svid("/orchestrators/a"), "IDENTITY_SIGNATURE"],
    ["not a JWT", "not.a.jwt", "IDENTITY_FORMAT"],
    ["valid for more than 24 h", await issuer.svid("/orchestrators/a", (c) => Object.assign(c, { exp: now + 25 * 3600 })), "IDENTITY_LIFETIME"],
    ["issued in the future", await issuer.svid("/orchestrators/a", (c) => Object.assign(c, { iat: now + 3600, exp: now + 7200 })), "IDENTITY_NOT_YET_VALID"],
  ];
  for (const [what, token, check] of cases) {
    const error = await brokerError(() => bindIdentity(spire.bare, agent, token));
    assert.deepEqual(
      [error.code, error.reason, error.errorReason, error.check, error.info.check],
      [Code.Unauthenticated, "IDENTITY_REFUSED", pb.ErrorReason.IDENTITY_REFUSED, check, check],
      `${what}: ${error.rawMessage}`,
    );
    assert.ok((IDENTITY_CHECKS as readonly string[]).includes(error.check!), `${what}: ${error.check} is a documented check`);
    assert.ok(error.rawMessage.length > 0, `${what}: the message says what was wrong`);
  }

  // Nothing was bound: the key is still nobody's orchestrator, until a good token binds it.
  const [code, reason] = await refusal(() => spire.openRoot(agent));
  assert.deepEqual([code, reason], [Code.PermissionDenied, "NOT_AN_ORCHESTRATOR"]);
  assert.equal((await bindIdentity(spire.bare, agent, await issuer.svid("/orchestrators/a"))).identity, `spiffe://${TRUST_DOMAIN}/orchestrators/a`);
  assert.equal((await spire.openRoot(agent)).contract.delegateIdentity, `spiffe://${TRUST_DOMAIN}/orchestrators/a`);
});

test("a key bound to a [readers] identity lists every root; an unbound key does not", async () => {
  const { rootId } = await boundOrchestrator("lister");
  const listed = async (agent: Agent) => {
    const client = await spire.clientFor(agent);
    const { roots } = await client.listRoots({ pageSize: 1000 }, { timeoutMs: 10_000 });
    return roots.map((state) => toHex(state.contractId));
  };

  const auditor = Agent.generate();
  const unbound = Agent.generate();
  assert.ok(!(await listed(auditor)).includes(toHex(rootId)), "before binding, the auditor's key is a stranger");

  const bound = await bindIdentity(spire.bare, auditor, await issuer.svid("/auditors/a"));
  assert.equal(bound.identity, AUDITOR_ID);
  assert.ok((await listed(auditor)).includes(toHex(rootId)), "the bound auditor sees the orchestrator's root");
  const chain = await (await spire.clientFor(auditor)).getChain({ contractId: rootId }, { timeoutMs: 10_000 });
  assert.equal(chain.chain.length, 1);

  assert.deepEqual(await listed(unbound), [], "an unbound key lists no root (it opened none)");

  // A key bound to an identity outside [readers] identities is no reader.
  const worker = Agent.generate();
  await bindIdentity(spire.bare, worker, await issuer.svid("/workers/w9"));
  assert.ok(!(await listed(worker)).includes(toHex(rootId)));
});

test("a broker that trusts no issuer: FAILED_PRECONDITION, IDENTITY_NOT_CONFIGURED", async () => {
  const error = await brokerError(async () => bindIdentity(plain.bare, Agent.generate(), await issuer.svid("/workers/w1")));
  assert.deepEqual(
    [error.code, error.reason, error.errorReason, error.check],
    [Code.FailedPrecondition, "IDENTITY_NOT_CONFIGURED", pb.ErrorReason.IDENTITY_NOT_CONFIGURED, undefined],
    error.rawMessage,
  );
});
