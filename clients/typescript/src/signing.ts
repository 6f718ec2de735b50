/**
 * Signing rules: PAE, key ids, payload types, strict ed25519 verification,
 * and the agent key that signs requests.
 *
 * Mirrors the Python client's `delegation_broker.signing` (and the broker's
 * `src/crypto`). Two signed forms share one rule, an ed25519 signature over
 * `PAE(type, payload)`:
 *
 * - agents and attestors sign a DSSE `Envelope`, which names its type. Every
 *   signed request is `<Name>Request{signed: Envelope}` over a `<Name>Body`
 *   starting with a `RequestHeader`; {@link Agent.signRequest} builds any of
 *   them;
 * - the broker signs a `Sealed` (payload and signature only), whose type is
 *   fixed by the field carrying it (see `verify.ts`).
 *
 * {@link verifyPaeSignature} is the one strict check both use. Signing and
 * verification are `@noble/ed25519` over `@noble/hashes`' SHA-512 (pure
 * JavaScript, the same in Node and in browsers).
 */

import * as ed from "@noble/ed25519";
import { sha256 as nobleSha256, sha512 } from "@noble/hashes/sha2.js";
import {
  clone,
  create,
  createRegistry,
  isMessage,
  toBinary,
  type DescMessage,
  type Message,
  type MessageInitShape,
  type MessageShape,
} from "@bufbuild/protobuf";

import { concatBytes, equalBytes, randomBytes, toHex, utf8 } from "./bytes.js";
import {
  AcceptBodySchema,
  AdjudicateBodySchema,
  BindIdentityBodySchema,
  CompleteBodySchema,
  DeclineBodySchema,
  DelegateBodySchema,
  EscalateBodySchema,
  OpenRootBodySchema,
  OpenSessionBodySchema,
  RecordReceiptsBodySchema,
  RevokeBodySchema,
  file_delegation_broker_v1_broker,
  type AcceptRequest,
  type AdjudicateRequest,
  type BindIdentityRequest,
  type CompleteRequest,
  type DeclineRequest,
  type DelegateRequest,
  type EscalateRequest,
  type OpenRootRequest,
  type OpenSessionRequest,
  type RecordReceiptsRequest,
  type RevokeRequest,
} from "./gen/delegation/broker/v1/broker_pb.js";
import {
  AttestationSchema,
  EnvelopeSchema,
  RequestHeaderSchema,
  SignatureSchema,
  file_delegation_broker_v1_types,
  type Envelope,
  type RequestHeader,
} from "./gen/delegation/broker/v1/types_pb.js";
import { file_delegation_broker_v1_errors } from "./gen/delegation/broker/v1/errors_pb.js";

// @noble/ed25519 needs a synchronous SHA-512 for its synchronous API.
if (ed.hashes.sha512 === undefined) ed.hashes.sha512 = sha512;

/** Most signatures the broker's verifier looks at in one envelope. */
export const MAX_SIGNATURES = 4;
/** Nonce length used for fresh request headers (the broker accepts 16..=64). */
export const NONCE_BYTES = 16;

/** Every message and enum of `delegation.broker.v1`, by full name. */
export const registry = createRegistry(
  file_delegation_broker_v1_types,
  file_delegation_broker_v1_broker,
  file_delegation_broker_v1_errors,
);

/**
 * DSSE v1 pre-authentication encoding:
 * `"DSSEv1" SP LEN(type) SP type SP LEN(body) SP body` (lengths in bytes,
 * ASCII decimal).
 */
export function pae(payloadType: string, payload: Uint8Array): Uint8Array {
  const type = utf8(payloadType);
  return concatBytes(
    utf8(`DSSEv1 ${type.length} `),
    type,
    utf8(` ${payload.length} `),
    payload,
  );
}

/** SHA-256 of `data`. */
export function sha256(data: Uint8Array): Uint8Array {
  return nobleSha256(data);
}

/** `"ed25519:"` + lowercase hex of the first 16 bytes of SHA-256(public key). */
export function keyId(publicKey: Uint8Array): string {
  if (publicKey.length !== 32) {
    throw new RangeError(`an ed25519 public key is 32 bytes, got ${publicKey.length}`);
  }
  return "ed25519:" + toHex(sha256(publicKey).subarray(0, 16));
}

/**
 * The intent lineage hash every contract of a tree carries: SHA-256 of the
 * UTF-8 bytes of the root's intent.
 */
export function lineageHash(intent: string): Uint8Array {
  return sha256(utf8(intent));
}

/**
 * `application/vnd.<full proto name>+protobuf` of a message schema, a message
 * or a full name, e.g. `application/vnd.delegation.broker.v1.Contract+protobuf`.
 */
export function payloadType(of: DescMessage | Message | string): string {
  const name = typeof of === "string" ? of : "typeName" in of ? of.typeName : of.$typeName;
  return `application/vnd.${name}+protobuf`;
}

/** Unix time in milliseconds, as the bigint int64 fields take. */
export function nowMs(): bigint {
  return BigInt(Date.now());
}

// --- strict ed25519 -----------------------------------------------------------------

function decodePoint(bytes: Uint8Array): ed.Point | undefined {
  try {
    // Strict RFC 8032 decoding (zip215 = false): y < p, no "negative zero" x.
    return ed.Point.fromBytes(bytes, false);
  } catch {
    return undefined;
  }
}

const ORDER = 2n ** 252n + 27742317777372353535851937790883648493n;

function scalarLE(bytes: Uint8Array): bigint {
  let n = 0n;
  for (let i = bytes.length - 1; i >= 0; i--) n = (n << 8n) | BigInt(bytes[i]!);
  return n;
}

/**
 * True when `signature` is a valid ed25519 signature by `publicKey` over
 * `PAE(payloadType, payload)`, under strict verification.
 *
 * Strict as ed25519-dalek's `verify_strict` (the broker) and libsodium (the
 * Python client): the public key and R must be canonical encodings of points
 * that are not of small order, S must be reduced below the group order, and
 * `[S]B - [k]A` must encode to exactly R (the cofactorless equation). Anything
 * malformed (a key that is not 32 bytes, a signature that is not 64) is simply
 * false. The bytes are used exactly as given: never re-encode a payload before
 * verifying it.
 */
export function verifyPaeSignature(
  payloadType_: string,
  payload: Uint8Array,
  signature: Uint8Array,
  publicKey: Uint8Array,
): boolean {
  if (publicKey.length !== 32 || signature.length !== 64) return false;
  const A = decodePoint(publicKey);
  const rBytes = signature.subarray(0, 32);
  const R = decodePoint(rBytes);
  if (A === undefined || R === undefined || A.isSmallOrder() || R.isSmallOrder()) return false;
  const s = scalarLE(signature.subarray(32, 64));
  if (s >= ORDER) return false;
  const k = scalarLE(sha512(concatBytes(rBytes, publicKey, pae(payloadType_, payload)))) % ORDER;
  try {
    const check = ed.Point.BASE.multiply(s, false).subtract(A.multiply(k, false));
    return equalBytes(check.toBytes(), rBytes);
  } catch {
    return false;
  }
}

/**
 * True when some signature of the DSSE `envelope` (at most
 * {@link MAX_SIGNATURES}) verifies over PAE(payload_type, payload) under
 * `publicKey` ({@link verifyPaeSignature}); with `expectedType`, the
 * envelope's `payloadType` must be it. The DSSE `keyid` hint is ignored.
 *
 * For agent-signed envelopes (requests, attestations). What the broker signs
 * is a `Sealed`, not an envelope: see `verifySealed`.
 */
export function verifySignature(envelope: Envelope, publicKey: Uint8Array, expectedType?: string): boolean {
  if (expectedType !== undefined && envelope.payloadType !== expectedType) return false;
  if (publicKey.length !== 32 || envelope.signatures.length > MAX_SIGNATURES) return false;
  return envelope.signatures.some((signature) =>
    verifyPaeSignature(envelope.payloadType, envelope.payload, signature.sig, publicKey),
  );
}

/**
 * The request message schema carrying a signed body: `<Name>Request` for
 * `<Name>Body`. Throws TypeError for anything else.
 */
export function requestSchemaFor(body: DescMessage | string): DescMessage {
  const name = typeof body === "string" ? body : body.typeName;
  const bodySchema = registry.getMessage(name);
  const requestSchema = name.endsWith("Body") ? registry.getMessage(name.slice(0, -"Body".length) + "Request") : undefined;
  if (
    bodySchema === undefined ||
    requestSchema === undefined ||
    bodySchema.field.header === undefined ||
    requestSchema.field.signed === undefined
  ) {
    throw new TypeError(`${name} is not a signed request body`);
  }
  return requestSchema;
}

type Init<Desc extends DescMessage> = MessageInitShape<Desc>;

/**
 * An agent's (or an attestor's) ed25519 key pair.
 *
 * ```ts
 * const agent = Agent.generate();
 * const request = agent.delegate({ parentId, intentLineageHash, task: "plan", ... });
 * const response = await client.delegate(request);
 * ```
 */
export class Agent {
  readonly #seed: Uint8Array;
  /** The 32-byte ed25519 public key. */
  readonly publicKey: Uint8Array;
  /** `"ed25519:"` + hex of the first 16 bytes of SHA-256(public key). */
  readonly keyId: string;

  private constructor(seed: Uint8Array) {
    this.#seed = Uint8Array.from(seed);
    this.publicKey = ed.getPublicKey(this.#seed);
    this.keyId = keyId(this.publicKey);
  }

  /** A fresh key from the platform's CSPRNG. */
  static generate(): Agent {
    return new Agent(randomBytes(32));
  }

  /**
   * The key whose 32-byte secret seed is `seed` (what `delegation-broker
   * keygen` writes, hex-encoded: pass `fromHex(text.trim())`).
   */
  static fromSeed(seed: Uint8Array): Agent {
    if (seed.length !== 32) throw new RangeError(`an ed25519 seed is 32 bytes, got ${seed.length}`);
    return new Agent(seed);
  }

  /** The 32-byte secret seed. Keep it secret. */
  get seed(): Uint8Array {
    return Uint8Array.from(this.#seed);
  }

  toString(): string {
    return `Agent(${this.keyId})`;
  }

  /**
   * A request header with the current time and a fresh random nonce.
   *
   * The nonce is the idempotency key: to retry, resend the request built from
   * this header unchanged (see `callIdempotent`), never a rebuilt one.
   */
  header(): RequestHeader {
    return create(RequestHeaderSchema, {
      agentPublicKey: this.publicKey,
      timestampMs: nowMs(),
      nonce: randomBytes(NONCE_BYTES),
    });
  }

  /** The raw ed25519 signature of `message` (64 bytes). */
  signRaw(message: Uint8Array): Uint8Array {
    return ed.sign(message, this.#seed);
  }

  /**
   * A single-signature DSSE envelope over `message`'s serialized bytes; the
   * payload type defaults to {@link payloadType} of the schema.
   */
  sign<Desc extends DescMessage>(schema: Desc, message: Init<Desc>, type?: string): Envelope {
    const payload = toBinary(schema, create(schema, message));
    return this.signBytes(type ?? payloadType(schema), payload);
  }

  /** A single-signature DSSE envelope over `payload` as given. */
  signBytes(type: string, payload: Uint8Array): Envelope {
    return create(EnvelopeSchema, {
      payloadType: type,
      payload,
      signatures: [create(SignatureSchema, { keyid: this.keyId, sig: this.signRaw(pae(type, payload)) })],
    });
  }

  /**
   * The signed request for any request body: a `<Name>Body` message in,
   * `<Name>Request{signed: <envelope over the body>}` out, with payload type
   * `application/vnd.delegation.broker.v1.<Name>Body+protobuf`.
   *
   * A body without a `header` gets a fresh one (current time, new nonce);
   * `body` itself is not modified. Every per-RPC method below
   * ({@link openRoot}, {@link delegate}, {@link accept}, ...) is this with the
   * body type fixed.
   */
  signRequest(body: Message): Message {
    const bodySchema = registry.getMessage(body.$typeName);
    if (bodySchema === undefined) throw new TypeError(`${body.$typeName} is not a broker message`);
    const requestSchema = requestSchemaFor(bodySchema);
    const filled = this.#withHeader(bodySchema, body);
    return create(requestSchema, { signed: this.signBytes(payloadType(bodySchema), toBinary(bodySchema, filled)) } as never);
  }

  #withHeader<Desc extends DescMessage>(schema: Desc, init: Init<Desc> | MessageShape<Desc>): MessageShape<Desc> {
    const body: MessageShape<Desc> = isMessage(init, schema) ? clone(schema, init) : create(schema, init as Init<Desc>);
    const fields = body as unknown as { header?: RequestHeader };
    if (fields.header === undefined) fields.header = this.header();
    return body;
  }

  #request<Desc extends DescMessage, Req extends Message>(schema: Desc, init: Init<Desc>): Req {
    return this.signRequest(this.#withHeader(schema, init)) as Req;
  }

  /** A signed OpenRoot request over an `OpenRootBody` (or its fields); a fresh header unless given. */
  openRoot(body: Init<typeof OpenRootBodySchema>): OpenRootRequest {
    return this.#request(OpenRootBodySchema, body);
  }

  /** A signed Delegate request over a `DelegateBody` (or its fields); a fresh header unless given. */
  delegate(body: Init<typeof DelegateBodySchema>): DelegateRequest {
    return this.#request(DelegateBodySchema, body);
  }

  /**
   * A signed OpenSession request: the broker answers with a read session for
   * this key, to send as the `x-broker-session-bin` header of every read (see
   * `openSession` in session.ts, which fills in the broker's key id for you).
   * `brokerKeyId` (required) is the broker's current key id from
   * GetBrokerKeys; the timestamp must be within the broker's window.
   */
  openSession(body: Init<typeof OpenSessionBodySchema>): OpenSessionRequest {
    return this.#request(OpenSessionBodySchema, body);
  }

  /**
   * A signed BindIdentity request: binds this key to the workload identity a
   * JWT from an issuer of the broker's `[identity]` configuration proves (a
   * SPIFFE JWT-SVID, an OIDC token), until the token's `exp`. Takes the token
   * itself (`agent.bindIdentity(token)`) or a `BindIdentityBody`'s fields
   * (`{ token }`; a fresh header unless given). `bindIdentity(client, agent,
   * token)` (identity.ts) builds and sends it.
   */
  bindIdentity(body: string | Init<typeof BindIdentityBodySchema>): BindIdentityRequest {
    return this.#request(BindIdentityBodySchema, typeof body === "string" ? { token: body } : body);
  }

  /** As the contract's delegate: accept it (`contractId`; optionally `hostPublicKey`). */
  accept(body: Init<typeof AcceptBodySchema>): AcceptRequest {
    return this.#request(AcceptBodySchema, body);
  }

  /** As the contract's delegate: decline it (`contractId`, `reason`). */
  decline(body: Init<typeof DeclineBodySchema>): DeclineRequest {
    return this.#request(DeclineBodySchema, body);
  }

  /** As the contract's delegate: report the result (`contractId`, `outputJson`, `report`, `claim`, `consumed`). */
  complete(body: Init<typeof CompleteBodySchema>): CompleteRequest {
    return this.#request(CompleteBodySchema, body);
  }

  /** As the principal: record the verdict on a completed contract pending it. */
  adjudicate(body: Init<typeof AdjudicateBodySchema>): AdjudicateRequest {
    return this.#request(AdjudicateBodySchema, body);
  }

  /** As the contract's delegate: return it as unresolvable (`contractId`, `reason`). */
  escalate(body: Init<typeof EscalateBodySchema>): EscalateRequest {
    return this.#request(EscalateBodySchema, body);
  }

  /** As the holder of any ancestor: revoke a contract and its open descendants. */
  revoke(body: Init<typeof RevokeBodySchema>): RevokeRequest {
    return this.#request(RevokeBodySchema, body);
  }

  /** As the contract's host: record observations (`contractId`, `observations`: 1..=256). */
  recordReceipts(body: Init<typeof RecordReceiptsBodySchema>): RecordReceiptsRequest {
    return this.#request(RecordReceiptsBodySchema, body);
  }

  /**
   * As an attestor: an Attestation envelope vouching for `agentPublicKey` with
   * trust `factor` in (0, 1] (floored to ppm) from `notBeforeMs` (0: at once)
   * until `expiresAtMs`. The broker must trust this key
   * (`[trust] attestors = ["<hex public key>"]`).
   */
  attest(
    agentPublicKey: Uint8Array,
    factor: number,
    expiresAtMs: bigint,
    riskClass = "",
    notBeforeMs = 0n,
  ): Envelope {
    return this.sign(AttestationSchema, { agentPublicKey, factor, riskClass, expiresAtMs, notBeforeMs });
  }
}
