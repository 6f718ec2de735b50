/**
 * Chains forged under a test key, to check each term of "Verifying a chain"
 * on its own (a port of the Python tests' synthetic chain and its
 * violations; every broken chain is re-linked and re-signed, so only the
 * term is wrong).
 */

import { clone, create, toBinary, type MessageInitShape } from "@bufbuild/protobuf";
import { Agent, BrokerKeys, lineageHash, pae, payloadType, pb, sha256 } from "@delegation-broker/client";

/** `message` sealed as the broker seals it, but by `signer`. */
export function seal(signer: Agent, contract: pb.Contract): pb.Sealed {
  const payload = toBinary(pb.ContractSchema, contract);
  return create(pb.SealedSchema, { payload, signature: signer.signRaw(pae(payloadType(pb.ContractSchema), payload)) });
}

/** `agents`' keys, published as broker keys. */
export function published(...agents: Agent[]): BrokerKeys {
  return new BrokerKeys(agents.map((a, i) => create(pb.BrokerKeySchema, { keyId: a.keyId, publicKey: a.publicKey, current: i === 0 })));
}

/**
 * Seals `contracts` by `signer` (each naming its key), root first, each
 * child's parentId set to the id of the contract before it (unless `link`
 * is false).
 */
export function forgeChain(signer: Agent, contracts: pb.Contract[], link = true): pb.Sealed[] {
  const out: pb.Sealed[] = [];
  for (const contract of contracts) {
    const c = clone(pb.ContractSchema, contract);
    c.brokerKeyId = signer.keyId;
    if (link && out.length > 0) c.parentId = sha256(out.at(-1)!.payload);
    out.push(seal(signer, c));
  }
  return out;
}

export const SYNTHETIC_INTENT = "a synthetic tree";
export const SYNTHETIC_DEADLINE = 4_000_000_000_000n;
/** The effective predicates of {@link syntheticChain}, root first. */
export const SYNTHETIC_EFFECTIVE = ["(result.a\n)", "(result.a\n)", "(result.a\n) && (result.b\n)", "(result.c\n)"];

/**
 * Four contracts satisfying every term: a DELEGATE root with predicate
 * `result.a`, a DELEGATE child adding nothing, a DELEGATE grandchild adding
 * `result.b`, and a PRINCIPAL leaf with `result.c` alone.
 */
export function syntheticChain(): pb.Contract[] {
  const lineage = lineageHash(SYNTHETIC_INTENT);
  const delegates = [1, 2, 3, 4].map((i) => Agent.fromSeed(new Uint8Array(32).fill(i)).publicKey);
  const hop = { intentLineageHash: lineage, issuedAtMs: 2n, escalationChannel: "e" };
  return [
    create(pb.ContractSchema, {
      depth: 0,
      intent: SYNTHETIC_INTENT,
      intentLineageHash: lineage,
      task: "root",
      delegatePublicKey: delegates[0],
      budget: 100n,
      deadlineMs: SYNTHETIC_DEADLINE,
      issuedAtMs: 1n,
      liability: pb.Liability.DELEGATE,
      predicate: "result.a",
      escalationChannel: "e",
      writeScope: ["docs", "src"],
      labels: { run: "1" },
      policy: { maxDepth: 4, minCumulativeTrustPpm: 300_000, maxChildren: 8 },
      factorPpm: 1_000_000,
      cumulativeTrustPpm: 1_000_000,
      trustSource: pb.TrustSource.ROOT,
    }),
    create(pb.ContractSchema, {
      depth: 1, task: "one", delegatePublicKey: delegates[1], budget: 50n, deadlineMs: SYNTHETIC_DEADLINE,
      liability: pb.Liability.DELEGATE, writeScope: ["src/auth"], factorPpm: 900_000, cumulativeTrustPpm: 900_000,
      trustSource: pb.TrustSource.ATTESTATION, attestationDigest: sha256(new TextEncoder().encode("attestation")),
      riskClass: "sandboxed", ...hop,
    }),
    create(pb.ContractSchema, {
      depth: 2, task: "two", delegatePublicKey: delegates[2], budget: 50n, deadlineMs: SYNTHETIC_DEADLINE - 1n,
      liability: pb.Liability.DELEGATE, predicate: "result.b", writeScope: ["src/auth/token.rs", "src/auth"],
      factorPpm: 500_001, cumulativeTrustPpm: 450_000, trustSource: pb.TrustSource.STATIC_TABLE, ...hop,
    }),
    create(pb.ContractSchema, {
      depth: 3, task: "three", delegatePublicKey: delegates[3], budget: 0n, deadlineMs: SYNTHETIC_DEADLINE - 1n,
      liability: pb.Liability.PRINCIPAL, predicate: "result.c", writeScope: [], factorPpm: 999_999,
      cumulativeTrustPpm: 449_999, trustSource: pb.TrustSource.ATTESTATION, ...hop,
    }),
  ];
}

type Edit = (contracts: pb.Contract[]) => void;
const at = (index: number, change: (c: pb.Contract) => void): Edit => (contracts) => change(contracts[index]!);
const set = (index: number, fields: Partial<pb.Contract>): Edit => at(index, (c) => Object.assign(c, fields));
const both = (...edits: Edit[]): Edit => (contracts) => edits.forEach((edit) => edit(contracts));
const policy = (init: MessageInitShape<typeof pb.PolicySchema>) => create(pb.PolicySchema, init);

/** [what is wrong, the error it must give, how to break syntheticChain()]. */
export const SYNTHETIC_VIOLATIONS: [string, string, Edit][] = [
  ["root lineage is not SHA-256(intent)", "contract 0: intent_lineage_hash is not SHA-256", set(0, { intent: "another intent" })],
  ["root trust source", "contract 0: a root's trust", set(0, { trustSource: pb.TrustSource.STATIC_TABLE })],
  ["root factor", "contract 0: a root's trust", set(0, { factorPpm: 999_999 })],
  ["root cumulative trust", "contract 0: a root's trust", set(0, { cumulativeTrustPpm: 999_999 })],
  ["root without a policy", "contract 0: the root carries no policy", set(0, { policy: undefined })],
  ["first contract not a root", "contract 0: the first contract is not a root", set(0, { depth: 1 })],
  ["child carries an intent", "contract 2: a child carries intent", set(2, { intent: SYNTHETIC_INTENT })],
  ["child carries a policy", "contract 1: a child carries intent, policy", set(1, { policy: policy({ maxDepth: 64 }) })],
  ["child carries labels", "contract 3: a child carries intent, policy or labels", set(3, { labels: { a: "b" } })],
  ["child lineage differs", "contract 1: intent_lineage_hash differs", set(1, { intentLineageHash: sha256(new TextEncoder().encode("another")) })],
  ["depth skips one", "contract 2: depth is not its parent's + 1", both(set(2, { depth: 3 }), set(3, { depth: 4 }))],
  ["depth above max_depth", "contract 3: depth exceeds", set(0, { policy: policy({ maxDepth: 2 }) })],
  ["cumulative trust not floored", "contract 2: cumulative_trust_ppm is not floor", set(2, { cumulativeTrustPpm: 450_001 })],
  ["cumulative trust rounded up", "contract 3: cumulative_trust_ppm is not floor", set(3, { cumulativeTrustPpm: 450_000 })],
  ["factor above 1_000_000", "contract 1: cumulative_trust_ppm is not floor", set(1, { factorPpm: 1_000_001, cumulativeTrustPpm: 1_000_001 })],
  ["trust below the minimum", "contract 3: cumulative trust is below", set(0, { policy: policy({ maxDepth: 4, minCumulativeTrustPpm: 450_000 }) })],
  ["budget above the parent's", "contract 2: budget exceeds the parent's", set(2, { budget: 51n })],
  ["negative budget", "contract 3: budget exceeds the parent's", set(3, { budget: -1n })],
  ["deadline after the parent's", "contract 1: deadline is later", set(1, { deadlineMs: SYNTHETIC_DEADLINE + 1n })],
  ["scope widened", "contract 2: write_scope reaches outside", set(2, { writeScope: ["src"] })],
  ["scope widened by a shared name prefix", "contract 1: write_scope reaches outside", set(1, { writeScope: ["srcx"] })],
  ["scope widened into a sibling", "contract 3: write_scope reaches outside", set(3, { writeScope: ["src/auth", "docs"] })],
  [
    "DELEGATE under PRINCIPAL",
    "contract 3: a DELEGATE contract under a liability-retaining parent",
    both(set(2, { liability: pb.Liability.PRINCIPAL }), set(3, { liability: pb.Liability.DELEGATE })),
  ],
  ["effective predicate too long", "contract 0: the effective predicate exceeds", set(0, { predicate: "x".repeat(65_536) })],
];

/** syntheticChain() broken by `edit`. */
export function broken(edit: Edit): pb.Contract[] {
  const contracts = syntheticChain();
  edit(contracts);
  return contracts;
}

/** (name, Sealed) variants of a broker-signed Sealed; the first is the genuine one. */
export function sealedTamperings(sealed: pb.Sealed): [string, pb.Sealed][] {
  const L = 2n ** 252n + 27742317777372353535851937790883648493n;
  const with_ = (payload: Uint8Array, signature: Uint8Array) => create(pb.SealedSchema, { payload, signature });
  const payload = Uint8Array.from(sealed.payload);
  payload[payload.length >> 1]! ^= 0x01;
  const signature = Uint8Array.from(sealed.signature);
  signature[40]! ^= 0x80;
  let s = 0n;
  for (let i = 63; i >= 32; i--) s = (s << 8n) | BigInt(sealed.signature[i]!);
  s += L; // the same signature with a non-canonical S
  const nonCanonical = Uint8Array.from(sealed.signature);
  for (let i = 32; i < 64; i++, s >>= 8n) nonCanonical[i] = Number(s & 0xffn);
  return [
    ["genuine", clone(pb.SealedSchema, sealed)],
    ["payload bit flip", with_(payload, sealed.signature)],
    ["payload extended", with_(Uint8Array.from([...sealed.payload, 0]), sealed.signature)],
    ["signature bit flip", with_(sealed.payload, signature)],
    ["non-canonical S", with_(sealed.payload, nonCanonical)],
    ["empty signature", with_(sealed.payload, new Uint8Array())],
    ["signature extended", with_(sealed.payload, Uint8Array.from([...sealed.signature, 0]))],
    ["signature truncated", with_(sealed.payload, sealed.signature.subarray(0, 63))],
  ];
}

/**
 * Every variant of `chain` with one bit flipped in a signed byte: each
 * contract's payload (every byte), each contract id beside it, and the leaf's
 * signature. Each must fail verification: a changed ancestor breaks its
 * child's link, a changed leaf its signature, a changed id its check.
 */
export function* flippedChains(chain: pb.ContractState[]): Generator<[string, pb.ContractState[]]> {
  for (let i = 0; i < chain.length; i++) {
    const state = chain[i]!;
    for (let at = 0; at < state.contract!.payload.length; at++) {
      const payload = Uint8Array.from(state.contract!.payload);
      payload[at]! ^= 0x01;
      yield [`contract ${i} payload byte ${at}`, replace(chain, i, { ...state, contract: { ...state.contract!, payload } })];
    }
    for (let at = 0; at < state.contractId.length; at++) {
      const contractId = Uint8Array.from(state.contractId);
      contractId[at]! ^= 0x01;
      yield [`contract ${i} id byte ${at}`, replace(chain, i, { ...state, contractId })];
    }
  }
  const leaf = chain.length - 1;
  for (let at = 0; at < 64; at++) {
    const signature = Uint8Array.from(chain[leaf]!.contract!.signature);
    signature[at]! ^= 0x01;
    yield [`leaf signature byte ${at}`, replace(chain, leaf, { ...chain[leaf]!, contract: { ...chain[leaf]!.contract!, signature } })];
  }
}

/** Every variant of a Sealed receipt with one bit flipped, payload and signature. */
export function* flippedSealed(sealed: pb.Sealed): Generator<[string, pb.Sealed]> {
  for (const part of ["payload", "signature"] as const) {
    for (let at = 0; at < sealed[part].length; at++) {
      const bytes = Uint8Array.from(sealed[part]);
      bytes[at]! ^= 0x01;
      yield [`${part} byte ${at}`, create(pb.SealedSchema, { ...sealed, [part]: bytes })];
    }
  }
}

function replace(chain: pb.ContractState[], index: number, state: pb.ContractState): pb.ContractState[] {
  return chain.map((s, i) => (i === index ? create(pb.ContractStateSchema, state) : s));
}
