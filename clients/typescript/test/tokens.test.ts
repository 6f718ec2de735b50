/**
 * The token endpoint (`serve --tokens`), end to end against the real broker:
 * agents mint tokens through the package (`TokenEndpoint`, the assertion
 * signed with the agent's own key), and a resource server written with a
 * stock JOSE library only (`jose`, plus `fetch`) discovers the endpoints
 * from the metadata, verifies the tokens against the JWKS, reads the
 * delegation's terms and its `act` chain, and introspects. Refusals are
 * checked by their exact OAuth error code.
 */

import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import {
  SignJWT,
  createRemoteJWKSet,
  decodeProtectedHeader,
  generateKeyPair,
  importJWK,
  jwtVerify,
  type JWTPayload,
  type JWTVerifyResult,
} from "jose";

import {
  Agent,
  MAX_ASSERTION_LIFETIME_S,
  TOKEN_EXCHANGE_GRANT_TYPE,
  TokenEndpoint,
  TokenEndpointError,
  base64url,
  keyId,
  nowMs,
  pb,
  signAssertion,
  toHex,
  type DelegationTokenClaims,
  type TokenActor,
} from "@delegation-broker/client";

import { Broker, HOUR_MS, child, issuedOf, type Root } from "./support.js";

const RESOURCE = "https://api.test";
const OTHER_RESOURCE = "https://other.test";
const INTROSPECTOR = { id: "rs", secret: "secret" };

// --- the resource server: jose and fetch, nothing of this package -----------------------

interface Metadata {
  issuer: string;
  token_endpoint: string;
  jwks_uri: string;
  introspection_endpoint: string;
  grant_types_supported: string[];
}

/** What a resource server for `audience` does with a bearer token: verify it offline, or ask the broker. */
class ResourceServer {
  readonly metadata: Metadata;
  readonly audience: string;
  readonly #jwks: ReturnType<typeof createRemoteJWKSet>;

  private constructor(metadata: Metadata, audience: string) {
    this.metadata = metadata;
    this.audience = audience;
    this.#jwks = createRemoteJWKSet(new URL(metadata.jwks_uri));
  }

  /** RFC 8414 discovery from the issuer's URL. */
  static async discover(issuer: string, audience: string): Promise<ResourceServer> {
    const response = await fetch(`${issuer}/.well-known/oauth-authorization-server`, { signal: AbortSignal.timeout(10_000) });
    assert.equal(response.status, 200);
    return new ResourceServer((await response.json()) as Metadata, audience);
  }

  verify(token: string): Promise<JWTVerifyResult<DelegationTokenClaims & JWTPayload>> {
    return jwtVerify<DelegationTokenClaims>(token, this.#jwks, {
      issuer: this.metadata.issuer,
      audience: this.audience,
      algorithms: ["EdDSA"],
      typ: "at+jwt",
    });
  }

  /** RFC 7662, with HTTP Basic credentials (the configured introspector's by default). */
  async introspect(token: string, credentials = `${INTROSPECTOR.id}:${INTROSPECTOR.secret}`): Promise<{ status: number; body: Record<string, unknown> }> {
    const response = await fetch(this.metadata.introspection_endpoint, {
      method: "POST",
      headers: {
        authorization: `Basic ${Buffer.from(credentials).toString("base64")}`,
        "content-type": "application/x-www-form-urlencoded",
      },
      body: new URLSearchParams({ token }).toString(),
      signal: AbortSignal.timeout(10_000),
    });
    return { status: response.status, body: (await response.json()) as Record<string, unknown> };
  }
}

/** The `act` chain as a list, nearest delegator first. */
function actors(act: TokenActor | undefined): { sub: string; contract_id: string }[] {
  const out: { sub: string; contract_id: string }[] = [];
  for (let at = act; at !== undefined; at = at.act) out.push({ sub: at.sub, contract_id: at.contract_id });
  return out;
}

// --- the broker --------------------------------------------------------------------------

let broker: Broker;
let endpoint: TokenEndpoint;
let rs: ResourceServer;

before(async () => {
  broker = await Broker.start("tokens", {
    tokens: { resources: [RESOURCE, OTHER_RESOURCE], introspectors: { [INTROSPECTOR.id]: INTROSPECTOR.secret } },
  });
  endpoint = new TokenEndpoint(broker.process.tokensUrl);
  rs = await ResourceServer.discover(broker.process.tokensUrl, RESOURCE);
});
after(async () => {
  await broker.close();
});

interface Chain {
  orchestrator: Agent;
  root: Root;
  /** Root first: the root's holder, then the delegate of depth 1, 2 and 3. */
  holders: [Agent, Agent, Agent, Agent];
  /** Root first: the contract ids of depth 0 ..= 3. */
  ids: [Uint8Array, Uint8Array, Uint8Array, Uint8Array];
}

/** root → child → grandchild → great-grandchild, each hop signed by its parent's holder. */
async function depthThree(options: { deadlineMs?: bigint } = {}): Promise<Chain> {
  const holders = [Agent.generate(), Agent.generate(), Agent.generate(), Agent.generate()] as Chain["holders"];
  const root = await broker.openRoot(holders[0], { budget: 100n, maxDepth: 4, deadlineMs: options.deadlineMs });
  const ids: Uint8Array[] = [root.id];
  for (const [depth, budget] of [[1, 50n], [2, 20n], [3, 10n]] as const) {
    ids.push(issuedOf(await broker.delegate(holders[depth - 1]!, child(ids[depth - 1]!, root.lineage, holders[depth]!, budget))).contractId);
  }
  return { orchestrator: holders[0], root, holders, ids: ids as Chain["ids"] };
}

/** Runs `call`, which must be refused by the token endpoint: its error. */
async function refused(call: () => Promise<unknown>): Promise<TokenEndpointError> {
  try {
    await call();
  } catch (caught) {
    assert.ok(caught instanceof TokenEndpointError, `expected a TokenEndpointError, got ${String(caught)}`);
    assert.ok(caught.errorDescription.length > 0, "the refusal says what was wrong");
    return caught;
  }
  assert.fail("expected a refusal, a token was minted");
}

// --- tests ---------------------------------------------------------------------------------

test("metadata: the endpoints under the issuer the broker printed, and the JWKS serves GetBrokerKeys' keys", async () => {
  const metadata = await endpoint.metadata();
  const issuer = broker.process.tokensUrl;
  assert.equal(metadata.issuer, issuer);
  assert.equal(metadata.token_endpoint, `${issuer}/token`);
  assert.equal(metadata.jwks_uri, `${issuer}/jwks`);
  assert.equal(metadata.introspection_endpoint, `${issuer}/introspect`);
  assert.deepEqual(metadata.grant_types_supported, [TOKEN_EXCHANGE_GRANT_TYPE]);
  assert.deepEqual(rs.metadata, { ...metadata }, "the package and the resource server read the same metadata");

  const jwks = (await (await fetch(metadata.jwks_uri, { signal: AbortSignal.timeout(10_000) })).json()) as { keys: Record<string, string>[] };
  const ids = broker.keys.ids();
  assert.deepEqual(jwks.keys.map((k) => k.kid).sort(), [...ids].sort());
  for (const key of jwks.keys) {
    assert.deepEqual(key, { kty: "OKP", crv: "Ed25519", x: base64url(broker.keys.get(key.kid!)!), kid: key.kid, use: "sig", alg: "EdDSA" });
  }
});

test("the assertion is a standard EdDSA JWT by the agent's key, for the token endpoint", async () => {
  const agent = Agent.generate();
  const contractId = new Uint8Array(32).fill(7);
  const assertion = await endpoint.assertion(agent, contractId);
  const { token_endpoint } = await endpoint.metadata();
  assert.deepEqual(decodeProtectedHeader(assertion), { alg: "EdDSA", typ: "JWT" });
  const key = await importJWK({ kty: "OKP", crv: "Ed25519", x: base64url(agent.publicKey) }, "EdDSA");
  const { payload } = await jwtVerify(assertion, key, {
    issuer: toHex(agent.publicKey),
    subject: toHex(agent.publicKey),
    audience: token_endpoint,
    algorithms: ["EdDSA"],
    typ: "JWT",
  });
  assert.equal(payload.contract_id, toHex(contractId));
  assert.equal(payload.exp! - payload.iat!, 60);
  assert.match(payload.jti!, /^[0-9a-f]{32}$/);
  assert.notEqual((await endpoint.assertion(agent, contractId)).split(".")[1], assertion.split(".")[1], "a fresh jti each time");
  // Signed by another key, it does not verify under this agent's.
  await assert.rejects(jwtVerify(signAssertion(Agent.generate(), contractId, token_endpoint), key));
  assert.throws(() => signAssertion(agent, contractId, token_endpoint, { lifetimeS: MAX_ASSERTION_LIFETIME_S + 1 }), RangeError);
  assert.throws(() => signAssertion(agent, contractId.subarray(1), token_endpoint), RangeError);
});

test("a depth-3 token verifies with jose; its tctx is the contract's terms and its act chain is GetChain's delegators", async () => {
  const { root, holders, ids } = await depthThree();
  const leaf = holders[3];
  // The depth-3 contract reserves some of its budget for a child: residual = 10 - reserved.
  issuedOf(await broker.delegate(leaf, child(ids[3], root.lineage, Agent.generate(), 4n)));

  const minted = await endpoint.mint(leaf, ids[3], RESOURCE);
  assert.equal(minted.tokenType, "Bearer");
  assert.equal(minted.issuedTokenType, "urn:ietf:params:oauth:token-type:jwt");
  const { payload, protectedHeader } = await rs.verify(minted.accessToken);

  assert.equal(protectedHeader.alg, "EdDSA");
  assert.ok(broker.keys.has(protectedHeader.kid!), `kid ${protectedHeader.kid} is a key GetBrokerKeys publishes`);
  assert.equal(payload.iss, rs.metadata.issuer);
  assert.equal(payload.aud, RESOURCE);
  assert.equal(payload.sub, leaf.keyId);
  assert.equal(payload.client_id, leaf.keyId);
  assert.equal(payload.txn, toHex(root.id));
  assert.equal(payload.exp - payload.iat, minted.expiresIn);
  assert.ok(minted.expiresIn > 0 && minted.expiresIn <= 300, `${minted.expiresIn}: the default lifetime is 5 minutes`);

  const chain = await broker.chain(ids[3]);
  const held = chain.at(-1)!;
  const ledger = await broker.ledger(ids[3]);
  assert.ok(ledger.reserved > 0n && ledger.residual < ledger.budget, "the depth-3 contract has a reservation");
  const tctx = payload.tctx;
  assert.equal(tctx.depth, 3);
  assert.equal(tctx.lineage_hash, toHex(root.lineage));
  assert.equal(tctx.residual, Number(ledger.residual));
  assert.equal(tctx.contract_id, toHex(ids[3]));
  assert.equal(tctx.root_id, toHex(root.id));
  assert.equal(tctx.trust_ppm, held.contract.cumulativeTrustPpm);
  assert.equal(tctx.deadline_ms, Number(held.contract.deadlineMs));
  assert.deepEqual(tctx.write_scope, held.contract.writeScope);
  assert.ok(payload.exp * 1000 <= tctx.deadline_ms);

  // The act chain: each ancestor's delegate key id, nearest first, as the broker serves the chain.
  const served = chain
    .slice(0, -1)
    .reverse()
    .map((hop) => ({ sub: keyId(hop.contract.delegatePublicKey), contract_id: toHex(hop.contractId) }));
  assert.deepEqual(actors(payload.act), served);
  assert.deepEqual(
    actors(payload.act).map((a) => a.sub),
    [holders[2].keyId, holders[1].keyId, holders[0].keyId],
    "the grandchild's, the child's and the root's holders",
  );

  // A root's token has no act; a token for another resource is not this resource server's.
  const rootToken = await rs.verify((await endpoint.mint(holders[0], root.id, RESOURCE)).accessToken);
  assert.equal(rootToken.payload.act, undefined);
  assert.equal(rootToken.payload.tctx.depth, 0);
  const other = await endpoint.mint(leaf, ids[3], OTHER_RESOURCE);
  await assert.rejects(rs.verify(other.accessToken), (e: Error) => (e as { code?: string }).code === "ERR_JWT_CLAIM_VALIDATION_FAILED");

  // Introspection: active, with the token's claims.
  const { status, body } = await rs.introspect(minted.accessToken);
  assert.equal(status, 200);
  assert.equal(body.active, true);
  assert.equal(body.token_type, "Bearer");
  assert.deepEqual([body.sub, body.jti, body.aud], [payload.sub, payload.jti, RESOURCE]);
  assert.deepEqual(body.act, payload.act);
});

test("a token never outlives its contract: exp is the deadline when that comes first", async () => {
  const deadlineMs = nowMs() + 120_000n;
  const { holders, ids } = await depthThree({ deadlineMs });
  const minted = await endpoint.mint(holders[3], ids[3], RESOURCE);
  const { payload } = await rs.verify(minted.accessToken);
  assert.equal(payload.exp, Number(deadlineMs / 1000n));
  assert.ok(minted.expiresIn < 300);
});

test("refusals: not the holder, a resource not allowed, an expired or replayed assertion (exact error codes)", async () => {
  const { orchestrator, holders, ids } = await depthThree();
  const leaf = holders[3];

  // The signer must be the contract's delegate: not its delegator, not a stranger.
  for (const signer of [holders[2], orchestrator, Agent.generate()]) {
    const error = await refused(() => endpoint.mint(signer, ids[3], RESOURCE));
    assert.deepEqual([error.error, error.status], ["invalid_grant", 400]);
  }
  // An unknown contract is refused alike.
  assert.equal((await refused(() => endpoint.mint(leaf, new Uint8Array(32).fill(9), RESOURCE))).error, "invalid_grant");

  const target = await refused(() => endpoint.mint(leaf, ids[3], "https://elsewhere.test"));
  assert.deepEqual([target.error, target.status], ["invalid_target", 400]);

  // Expired: issued ten minutes ago, lived a minute.
  const nowS = Math.floor(Date.now() / 1000);
  const expired = await refused(() => endpoint.mint(leaf, ids[3], RESOURCE, { issuedAtS: nowS - 600, lifetimeS: 60 }));
  assert.deepEqual([expired.error, expired.status], ["invalid_grant", 400]);
  assert.match(expired.errorDescription, /expired/);

  // Replayed: the same assertion (same jti) twice.
  const assertion = await endpoint.assertion(leaf, ids[3]);
  await rs.verify((await endpoint.exchange(assertion, RESOURCE)).accessToken);
  const replayed = await refused(() => endpoint.exchange(assertion, RESOURCE));
  assert.deepEqual([replayed.error, replayed.status], ["invalid_grant", 400]);
  assert.match(replayed.errorDescription, /jti/);
  // A new assertion with the same jti is a replay too.
  const jti = JSON.parse(Buffer.from(assertion.split(".")[1]!, "base64url").toString()).jti as string;
  assert.equal((await refused(() => endpoint.mint(leaf, ids[3], RESOURCE, { jti }))).error, "invalid_grant");
  // ...and a fresh one is fine.
  await endpoint.mint(leaf, ids[3], RESOURCE);
});

test("refusals: an ended contract (declined, revoked) mints no token", async () => {
  const orchestrator = Agent.generate();
  const root = await broker.openRoot(orchestrator);

  const decliner = Agent.generate();
  const declined = issuedOf(await broker.delegate(orchestrator, child(root.id, root.lineage, decliner, 10n))).contractId;
  await endpoint.mint(decliner, declined, RESOURCE); // open: minted
  await broker.checkReceipt(await broker.client.decline(decliner.decline({ contractId: declined, reason: "busy" })), pb.ReceiptKind.DECLINED);
  const afterDecline = await refused(() => endpoint.mint(decliner, declined, RESOURCE));
  assert.deepEqual([afterDecline.error, afterDecline.status], ["invalid_grant", 400]);
  assert.match(afterDecline.errorDescription, /declined/i);

  const worker = Agent.generate();
  const revoked = issuedOf(await broker.delegate(orchestrator, child(root.id, root.lineage, worker, 10n))).contractId;
  await endpoint.mint(worker, revoked, RESOURCE); // open: minted
  await broker.checkReceipt(await broker.client.revoke(orchestrator.revoke({ contractId: revoked, reason: "no longer needed" })), pb.ReceiptKind.REVOKED);
  const afterRevoke = await refused(() => endpoint.mint(worker, revoked, RESOURCE));
  assert.deepEqual([afterRevoke.error, afterRevoke.status], ["invalid_grant", 400]);
  assert.match(afterRevoke.errorDescription, /revoked/i);

  // The root itself still mints.
  await endpoint.mint(orchestrator, root.id, RESOURCE);
});

test("introspection: active while the chain stands, inactive within 1 s of the root's revocation", async () => {
  const { orchestrator, root, holders, ids } = await depthThree();
  const { accessToken } = await endpoint.mint(holders[3], ids[3], RESOURCE);
  const before = await rs.introspect(accessToken);
  assert.deepEqual([before.status, before.body.active], [200, true]);

  await broker.checkReceipt(await broker.client.revoke(orchestrator.revoke({ contractId: root.id, reason: "stop everything" })), pb.ReceiptKind.REVOKED);
  const revokedAt = performance.now();
  let answer = await rs.introspect(accessToken);
  while (answer.body.active !== false && performance.now() - revokedAt < 1_000) {
    await new Promise((resolve) => setTimeout(resolve, 50));
    answer = await rs.introspect(accessToken);
  }
  assert.equal(answer.status, 200);
  assert.deepEqual(answer.body, { active: false }, "inactive within 1 s of the root's revocation, and nothing else said");

  // The signature still verifies offline (hence introspection); minting again is refused.
  assert.equal((await rs.verify(accessToken)).payload.tctx.depth, 3);
  assert.equal((await refused(() => endpoint.mint(holders[3], ids[3], RESOURCE))).error, "invalid_grant");
});

test("introspection: wrong credentials are 401 invalid_client; a foreign or malformed token is inactive", async () => {
  const { holders, ids } = await depthThree();
  const { accessToken } = await endpoint.mint(holders[3], ids[3], RESOURCE);
  assert.equal((await rs.introspect(accessToken)).body.active, true, "with the right credentials");

  for (const credentials of [`${INTROSPECTOR.id}:wrong`, `someone:${INTROSPECTOR.secret}`, INTROSPECTOR.id]) {
    const { status, body } = await rs.introspect(accessToken, credentials);
    assert.equal(status, 401, credentials);
    assert.equal(body.error, "invalid_client", credentials);
    assert.equal(body.active, undefined, "nothing about the token");
  }

  // The same claims and kid, signed by another key: not the broker's token.
  const { payload, protectedHeader } = await rs.verify(accessToken);
  const { privateKey } = await generateKeyPair("EdDSA", { crv: "Ed25519" });
  const forged = await new SignJWT({ ...payload }).setProtectedHeader(protectedHeader).sign(privateKey);
  await assert.rejects(rs.verify(forged), (e: Error) => (e as { code?: string }).code === "ERR_JWS_SIGNATURE_VERIFICATION_FAILED");
  assert.deepEqual((await rs.introspect(forged)).body, { active: false });
  assert.deepEqual((await rs.introspect("not-a-jwt")).body, { active: false });
});

test("with its contract's deadline an hour away, a token lives lifetime_minutes (default 5)", async () => {
  const orchestrator = Agent.generate();
  const root = await broker.openRoot(orchestrator, { deadlineMs: nowMs() + HOUR_MS });
  const minted = await endpoint.mint(orchestrator, root.id, RESOURCE);
  assert.equal(minted.expiresIn, 300, "lifetime_minutes defaults to 5");
});
