/**
 * Offline verification of what the broker signs, from its published keys alone.
 *
 * The broker signs three messages — `Contract`, `Receipt` and `Session` — and
 * hands each out as a `Sealed`: the serialized message (`payload`) and one
 * ed25519 signature over `PAE(type, payload)`. The type is not carried: it is
 * fixed by the field the Sealed travels in (a contract field holds a Contract,
 * a receipt field a Receipt, `OpenSessionResponse.session` a Session) and
 * still goes into PAE, so a signature made for one type never passes as
 * another. The signing key's id is the payload's `brokerKeyId`: it is signed,
 * so it is read from the payload (decoded first, trusted only once the
 * signature under that key verifies). An object's id is SHA-256 of its
 * payload.
 *
 * A port of the Python client's `delegation_broker.verify`, itself following
 * types.proto's "Verifying a chain" exactly, as the broker's `src/chain.rs`
 * does: the same checks in the same order, with the same messages.
 */

import { create, fromBinary, type DescMessage, type MessageShape } from "@bufbuild/protobuf";

import { equalBytes, toHex, utf8 } from "./bytes.js";
import {
  GetBrokerKeysRequestSchema,
  type BrokerKey,
  type ContractState,
  type GetBrokerKeysRequest,
  type GetBrokerKeysResponse,
  type GetChainResponse,
} from "./gen/delegation/broker/v1/broker_pb.js";
import {
  ContractSchema,
  Liability,
  ReceiptSchema,
  SessionSchema,
  TrustSource,
  type Contract,
  type Receipt,
  type Sealed,
} from "./gen/delegation/broker/v1/types_pb.js";
import { keyId, lineageHash, payloadType, sha256, verifyPaeSignature } from "./signing.js";

/** The type a Sealed Contract is signed under (`IssuedContract.contract`, `ContractState.contract`, `WatchResponse.contract`). */
export const CONTRACT_TYPE = "application/vnd.delegation.broker.v1.Contract+protobuf";
/** The type a Sealed Receipt is signed under (`Refusal.receipt`, every `...Response.receipt`, `WatchResponse.receipt`). */
export const RECEIPT_TYPE = "application/vnd.delegation.broker.v1.Receipt+protobuf";
/** The type a Sealed Session is signed under (`OpenSessionResponse.session`). */
export const SESSION_TYPE = "application/vnd.delegation.broker.v1.Session+protobuf";

/**
 * Most contracts {@link verifyChain} accepts: the deepest policy the broker
 * allows is 64, so a chain has at most 65 contracts (this bounds the work a
 * hostile input can cause).
 */
export const MAX_CHAIN_CONTRACTS = 65;
/** Trust of 1.0, in parts per million. */
export const PPM_ONE = 1_000_000;
/** Longest effective predicate the broker issues, in UTF-8 bytes. */
export const MAX_EFFECTIVE_PREDICATE_BYTES = 65_536;

/**
 * Something the broker signed, or a chain of contracts, does not verify.
 * `index` is the position in the chain (root = 0) of the contract at fault,
 * when the error is about one contract of a chain.
 */
export class VerificationError extends Error {
  readonly index: number | undefined;

  constructor(message: string, index?: number) {
    super(index === undefined ? message : `contract ${index}: ${message}`);
    this.name = "VerificationError";
    this.index = index;
  }
}

/** What {@link BrokerKeys.fetch} needs: a client's `getBrokerKeys`. */
export interface KeysSource {
  getBrokerKeys(request: GetBrokerKeysRequest, options?: { timeoutMs?: number }): Promise<GetBrokerKeysResponse>;
}

/**
 * The broker's published verifying keys, by key id.
 *
 * Build it from `(await client.getBrokerKeys({})).keys` (or {@link fetch}).
 * Each published key must be 32 bytes and its id must be
 * `"ed25519:" + hex(SHA-256(key)[0..16])`; otherwise construction throws
 * {@link VerificationError} (a key under a wrong id must not vouch for
 * anything). Retired keys keep verifying what they signed: keep them all.
 */
export class BrokerKeys {
  readonly #keys = new Map<string, Uint8Array>();
  /** The id of the key published as current (the last one, on a replicated broker). */
  readonly current: string | undefined;

  constructor(keys: Iterable<BrokerKey>) {
    let current: string | undefined;
    for (const key of keys) {
      if (key.publicKey.length !== 32) {
        throw new VerificationError(
          `published key ${JSON.stringify(key.keyId.slice(0, 80))} is ${key.publicKey.length} bytes, not 32`,
        );
      }
      if (key.keyId !== keyId(key.publicKey)) {
        throw new VerificationError(`published key id ${JSON.stringify(key.keyId.slice(0, 80))} does not match its public key`);
      }
      this.#keys.set(key.keyId, Uint8Array.from(key.publicKey));
      if (key.current) current = key.keyId;
    }
    if (this.#keys.size === 0) throw new VerificationError("no broker keys");
    this.current = current;
  }

  /** Calls `GetBrokerKeys` (public: no session needed). */
  static async fetch(client: KeysSource, options: { timeoutMs?: number } = {}): Promise<BrokerKeys> {
    const response = await client.getBrokerKeys(create(GetBrokerKeysRequestSchema), {
      timeoutMs: options.timeoutMs ?? 10_000,
    });
    return new BrokerKeys(response.keys);
  }

  /** Keys given as raw 32-byte public keys (e.g. read from a file), none marked current. */
  static fromPublicKeys(publicKeys: Iterable<Uint8Array>): BrokerKeys {
    return new BrokerKeys(
      Array.from(publicKeys, (publicKey) => ({ keyId: keyId(publicKey), publicKey, current: false, retiredAtMs: 0n }) as BrokerKey),
    );
  }

  has(id: string): boolean {
    return this.#keys.has(id);
  }

  get(id: string): Uint8Array | undefined {
    return this.#keys.get(id);
  }

  /** Every key id. */
  ids(): string[] {
    return [...this.#keys.keys()];
  }

  /** Every public key. */
  publicKeys(): Uint8Array[] {
    return [...this.#keys.values()];
  }

  get size(): number {
    return this.#keys.size;
  }
}

/** A verified Sealed: its decoded message, the key that signed it, the Sealed as received and its id. */
export interface Verified<T> {
  readonly message: T;
  readonly keyId: string;
  readonly sealed: Sealed;
  /** SHA-256 of the payload. */
  readonly id: Uint8Array;
}

/**
 * A verified contract: its id, its terms and what follows from its chain.
 *
 * From {@link verifyChain}, every field is proven (the leaf's signature
 * covers each ancestor through the hash links). From {@link verifyContract}
 * (a contract alone), `effectivePredicate` and `principalPublicKey` are known
 * for a root only and undefined for a child: they need its ancestors.
 */
export interface VerifiedContract {
  /** SHA-256 of the payload. */
  readonly contractId: Uint8Array;
  /** The decoded Contract. */
  readonly contract: Contract;
  /** The broker key that signed it (its `brokerKeyId`). */
  readonly keyId: string;
  /** The Sealed exactly as received. */
  readonly sealed: Sealed;
  /** What the broker judges a completion on, derived root → leaf; "" when there is none. */
  readonly effectivePredicate: string | undefined;
  /** Who issued it: the parent's delegate (a root's own delegate). */
  readonly principalPublicKey: Uint8Array | undefined;
}

/** The schemas of the three messages the broker seals. */
export type SealedSchema = typeof ContractSchema | typeof ReceiptSchema | typeof SessionSchema;

// --- one Sealed ---------------------------------------------------------------------

function decode<Desc extends DescMessage>(schema: Desc, payload: Uint8Array, index?: number): MessageShape<Desc> {
  try {
    return fromBinary(schema, payload);
  } catch {
    throw new VerificationError(`the payload is not a ${schema.typeName}`, index);
  }
}

function asSealed(sealed: unknown): Sealed {
  const typeName = (sealed as { $typeName?: string } | undefined)?.$typeName;
  if (typeName !== "delegation.broker.v1.Sealed") {
    throw new TypeError(
      `expected a Sealed (what the broker signs), got ${typeName ?? typeof sealed}` +
        (typeName === "delegation.broker.v1.Envelope" ? ": agent-signed envelopes are checked with verifySignature" : ""),
    );
  }
  return sealed as Sealed;
}

function checkSignature(sealed: Sealed, type: string, id: string, keys: BrokerKeys, index?: number): void {
  const key = keys.get(id);
  if (key === undefined) {
    throw new VerificationError(`signed by ${JSON.stringify(id.slice(0, 80))}, which is not a published broker key`, index);
  }
  if (!verifyPaeSignature(type, sealed.payload, sealed.signature, key)) {
    throw new VerificationError(`the signature does not verify under broker key ${id}`, index);
  }
}

/**
 * Verifies any broker-signed Sealed whose message type is `schema`
 * (`ContractSchema`, `ReceiptSchema` or `SessionSchema`: the type the field
 * carrying it implies) and returns the decoded message.
 *
 * The payload is decoded to read `brokerKeyId`, which must name a published
 * key; the signature must then verify, strictly, under that key over
 * `PAE("application/vnd.delegation.broker.v1.<Type>+protobuf", payload)`.
 * Only then are the message's fields to be trusted. Throws
 * {@link VerificationError} otherwise (TypeError for something not a Sealed).
 */
export function verifySealed<Desc extends SealedSchema>(
  sealed: Sealed,
  keys: BrokerKeys,
  schema: Desc,
): Verified<MessageShape<Desc>> {
  sealed = asSealed(sealed);
  if (schema.field.brokerKeyId === undefined) {
    throw new VerificationError(`${schema.typeName} is not signed by the broker (no broker_key_id)`);
  }
  const message = decode(schema, sealed.payload);
  const id = (message as { brokerKeyId: string }).brokerKeyId;
  checkSignature(sealed, payloadType(schema), id, keys);
  return { message, keyId: id, sealed, id: sha256(sealed.payload) };
}

/**
 * Verifies a broker-signed Receipt (refusals and every lifecycle receipt)
 * and, when `receiptId` is given, that it is SHA-256 of the payload. A
 * receipt binds to its contract by `contractId`: with a chain verified up to
 * that id it proves the event happened to exactly those terms.
 */
export function verifyReceipt(sealed: Sealed, keys: BrokerKeys, receiptId?: Uint8Array): Verified<Receipt> {
  const verified = verifySealed(sealed, keys, ReceiptSchema);
  if (receiptId !== undefined && !equalBytes(receiptId, verified.id)) {
    throw new VerificationError(`receipt id ${toHex(receiptId)} is not SHA-256(payload) ${toHex(verified.id)}`);
  }
  return verified;
}

/**
 * Verifies one contract on its own: its signature ({@link verifySealed})
 * and, when `contractId` is given, that it is SHA-256 of the payload.
 *
 * A root is the one-element chain it is: its terms are checked as
 * {@link verifyChain} checks a root's and its effective predicate is derived.
 * A child is checked only as far as it can be alone (it names a parent,
 * depth ≥ 1, no intent, policy or labels of its own); its terms against its
 * ancestors need {@link verifyChain}.
 */
export function verifyContract(sealed: Sealed, keys: BrokerKeys, contractId?: Uint8Array): VerifiedContract {
  sealed = asSealed(sealed);
  const decoded = decode(ContractSchema, sealed.payload);
  if (decoded.parentId.length === 0 && decoded.depth === 0) {
    return verifyChain([sealed], keys, contractId)[0]!;
  }
  const verified = verifySealed(sealed, keys, ContractSchema);
  if (contractId !== undefined && !equalBytes(contractId, verified.id)) {
    throw new VerificationError(`contract id ${toHex(contractId)} is not SHA-256(payload) ${toHex(verified.id)}`);
  }
  const contract = verified.message;
  if (contract.parentId.length === 0 || contract.depth === 0) {
    throw new VerificationError("neither a root (no parent_id, depth 0) nor a child (a parent_id, depth >= 1)");
  }
  if (carriesTreeTerms(contract)) {
    throw new VerificationError("a child carries intent, policy or labels (the root's apply)");
  }
  return {
    contractId: verified.id,
    contract,
    keyId: verified.keyId,
    sealed,
    effectivePredicate: undefined,
    principalPublicKey: undefined,
  };
}

// --- chains ---------------------------------------------------------------------------

/** What {@link verifyChain} takes: GetChain's answer, its `chain`, or the Sealed contracts. */
export type ChainInput = GetChainResponse | Iterable<ContractState | Sealed>;

function chainItems(chain: ChainInput): Sealed[] {
  const items: Iterable<ContractState | Sealed> =
    (chain as GetChainResponse).$typeName === "delegation.broker.v1.GetChainResponse"
      ? (chain as GetChainResponse).chain
      : (chain as Iterable<ContractState | Sealed>);
  const out: Sealed[] = [];
  let index = 0;
  for (const item of items) {
    if (out.length > MAX_CHAIN_CONTRACTS) break; // too long anyway; do not read on
    if (item.$typeName === "delegation.broker.v1.ContractState") {
      const state = item as ContractState;
      if (state.contract === undefined) throw new VerificationError("carries no contract", index);
      if (state.contractId.length > 0 && !equalBytes(state.contractId, sha256(state.contract.payload))) {
        throw new VerificationError("its contract_id is not SHA-256 of its payload", index);
      }
      out.push(state.contract);
    } else {
      out.push(asSealed(item));
    }
    index++;
  }
  return out;
}

function bounded(sealed: Sealed[]): void {
  if (sealed.length === 0) throw new VerificationError("the chain is empty");
  if (sealed.length > MAX_CHAIN_CONTRACTS) {
    throw new VerificationError(`more than ${MAX_CHAIN_CONTRACTS} contracts: not a chain (the deepest policy is 64)`);
  }
}

/**
 * One step of the effective predicate's derivation (`Contract.predicate` in
 * types.proto): `inherited` (the parent's effective predicate for a DELEGATE
 * child, "" for a root or a PRINCIPAL child) conjoined with this contract's
 * own `predicate`, each part as `"(" + p + "\n)"`. Throws
 * {@link VerificationError} past 65_536 UTF-8 bytes (the broker's limit).
 */
export function conjoinPredicates(inherited: string, predicate: string): string {
  let text: string;
  if (predicate === "") text = inherited;
  else if (inherited === "") text = `(${predicate}\n)`;
  else text = `${inherited} && (${predicate}\n)`;
  if (utf8(text).length > MAX_EFFECTIVE_PREDICATE_BYTES) {
    throw new VerificationError(`the effective predicate exceeds ${MAX_EFFECTIVE_PREDICATE_BYTES} bytes`);
  }
  return text;
}

/**
 * A path is under a prefix when equal to it or when it continues with "/"
 * after it; "/" alone covers every absolute path (the broker's scope rule).
 */
export function isUnder(path: string, prefix: string): boolean {
  if (prefix === "/") return path.startsWith("/");
  return path === prefix || path.startsWith(prefix + "/");
}

function carriesTreeTerms(c: Contract): boolean {
  return c.intent !== "" || c.policy !== undefined || Object.keys(c.labels).length > 0;
}

/** Steps 3–5 of "Verifying a chain": the hash links, the root's terms and each hop's terms, root → leaf. */
function checkTerms(sealed: Sealed[], ids: Uint8Array[], contracts: Contract[]): VerifiedContract[] {
  const root = contracts[0]!;
  if (root.parentId.length > 0 || root.depth !== 0) {
    throw new VerificationError(
      "the first contract is not a root (it names a parent or has depth > 0): the chain is cut",
      0,
    );
  }
  if (!equalBytes(root.intentLineageHash, lineageHash(root.intent))) {
    throw new VerificationError("intent_lineage_hash is not SHA-256(intent)", 0);
  }
  if (root.trustSource !== TrustSource.ROOT || root.factorPpm !== PPM_ONE || root.cumulativeTrustPpm !== PPM_ONE) {
    throw new VerificationError("a root's trust is ROOT, 1_000_000 ppm", 0);
  }
  const policy = root.policy;
  if (policy === undefined) throw new VerificationError("the root carries no policy", 0);

  const step = (index: number, inherited: string, own: string): string => {
    try {
      return conjoinPredicates(inherited, own);
    } catch (e) {
      throw new VerificationError((e as Error).message, index);
    }
  };

  const out: VerifiedContract[] = [
    {
      contractId: ids[0]!,
      contract: root,
      keyId: root.brokerKeyId,
      sealed: sealed[0]!,
      effectivePredicate: step(0, "", root.predicate),
      principalPublicKey: root.delegatePublicKey,
    },
  ];
  for (let index = 1; index < contracts.length; index++) {
    const parent = out[index - 1]!;
    const p = contracts[index - 1]!;
    const c = contracts[index]!;
    const fail = (detail: string) => new VerificationError(detail, index);
    if (!equalBytes(c.parentId, ids[index - 1]!)) throw fail(`parent_id is not the id of contract ${index - 1}`);
    if (c.depth !== p.depth + 1) throw fail("depth is not its parent's + 1");
    if (c.depth > policy.maxDepth) throw fail("depth exceeds the root policy's max_depth");
    if (carriesTreeTerms(c)) throw fail("a child carries intent, policy or labels (the root's apply)");
    if (!equalBytes(c.intentLineageHash, root.intentLineageHash)) throw fail("intent_lineage_hash differs from the root's");
    // Integers only (uint32 × uint32 < 2^64): every language computes the same floor.
    const expected = (BigInt(p.cumulativeTrustPpm) * BigInt(c.factorPpm)) / BigInt(PPM_ONE);
    if (c.factorPpm > PPM_ONE || BigInt(c.cumulativeTrustPpm) !== expected) {
      throw fail("cumulative_trust_ppm is not floor(parent x factor_ppm / 1_000_000)");
    }
    if (c.cumulativeTrustPpm < policy.minCumulativeTrustPpm) throw fail("cumulative trust is below the root policy's minimum");
    if (c.budget > p.budget || c.budget < 0n) throw fail("budget exceeds the parent's");
    if (c.deadlineMs > p.deadlineMs) throw fail("deadline is later than the parent's");
    if (!c.writeScope.every((path) => p.writeScope.some((prefix) => isUnder(path, prefix)))) {
      throw fail("write_scope reaches outside the parent's");
    }
    if (c.liability === Liability.DELEGATE && p.liability !== Liability.DELEGATE) {
      throw fail("a DELEGATE contract under a liability-retaining parent");
    }
    const inherited = c.liability === Liability.DELEGATE ? (parent.effectivePredicate ?? "") : "";
    out.push({
      contractId: ids[index]!,
      contract: c,
      keyId: c.brokerKeyId,
      sealed: sealed[index]!,
      effectivePredicate: step(index, inherited, c.predicate),
      principalPublicKey: p.delegatePublicKey,
    });
  }
  return out;
}

/**
 * Verifies a chain of contracts, root first — GetChain's answer (the
 * response, its `chain`, or the Sealed contracts) — and returns every
 * contract's id, terms and derived effective predicate.
 *
 * This is types.proto's "Verifying a chain", step by step:
 *
 * 1. keys: `keys` holds only keys whose id matches them ({@link BrokerKeys});
 * 2. the leaf's signature: the last contract's payload names its
 *    `brokerKeyId`, which must be published, and its signature must verify
 *    strictly over `PAE(Contract type, payload)`. It is the only signature
 *    checked: the broker signs a child only after checking it against its
 *    stored parent, and the child's payload commits to the parent's exact
 *    bytes (step 3), so this one signature proves every ancestor's terms too;
 * 3. hash links: each contract's id is SHA-256 of its payload; each
 *    `parentId` must be its parent's id and each `depth` the parent's + 1,
 *    and the first contract must be a root (no `parentId`, depth 0).
 *    `contractId`, when given, must be the leaf's id;
 * 4. the root's terms: `intentLineageHash` = SHA-256(`intent`), trust source
 *    ROOT with `factorPpm` and `cumulativeTrustPpm` 1_000_000, and a `policy`;
 * 5. each hop against its parent, root → leaf: no `intent`, `policy` or
 *    `labels` of its own; the root's lineage hash; `cumulativeTrustPpm` =
 *    floor(parent's × `factorPpm` / 1_000_000) (`factorPpm` at most
 *    1_000_000) and at least the root policy's `minCumulativeTrustPpm`;
 *    depth at most the policy's `maxDepth`; budget at most the parent's (and
 *    not negative); deadline at most the parent's; every `writeScope` prefix
 *    inside the parent's scope ({@link isUnder}); a DELEGATE child only under
 *    a DELEGATE parent. The effective predicate is derived along the way
 *    ({@link conjoinPredicates}).
 *
 * More than {@link MAX_CHAIN_CONTRACTS} contracts are refused. Throws
 * {@link VerificationError} (`index` names the contract at fault, root = 0).
 */
export function verifyChain(chain: ChainInput, keys: BrokerKeys, contractId?: Uint8Array): VerifiedContract[] {
  const sealed = chainItems(chain);
  bounded(sealed);
  const contracts = sealed.map((s, index) => decode(ContractSchema, s.payload, index));
  const ids = sealed.map((s) => sha256(s.payload));
  const last = sealed.length - 1;
  if (contractId !== undefined && !equalBytes(contractId, ids[last]!)) {
    throw new VerificationError(
      `the last contract's id is ${toHex(ids[last]!)}, not the one asked for (${toHex(contractId)})`,
    );
  }
  checkSignature(sealed[last]!, CONTRACT_TYPE, contracts[last]!.brokerKeyId, keys, last);
  return checkTerms(sealed, ids, contracts);
}

/**
 * Checks every contract's own signature (strictly, under the key its payload
 * names), for an auditor who keeps each contract on its own. {@link verifyChain}
 * does not need this: the leaf's signature covers the chain. Throws
 * {@link VerificationError} naming the first contract whose signature does
 * not verify; it checks neither links nor terms.
 */
export function verifyEverySignature(chain: ChainInput, keys: BrokerKeys): void {
  const sealed = chainItems(chain);
  bounded(sealed);
  sealed.forEach((item, index) => {
    const contract = decode(ContractSchema, item.payload, index);
    checkSignature(item, CONTRACT_TYPE, contract.brokerKeyId, keys, index);
  });
}
