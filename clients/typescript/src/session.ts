/**
 * Read sessions: the identity every read carries.
 *
 * Reads (GetContract, GetChain, ListChildren, GetReceipt, Watch, GetAudit,
 * AggregateAudits) are answered only to a tree's parties (the key that opened
 * its root, its delegates and hosts) and to the reader keys in the broker's
 * `[readers]` config. A caller proves its key once with a signed OpenSession
 * request and gets a broker-signed `Session` (a `Sealed`), which it then
 * sends, protobuf-encoded, as the binary header `x-broker-session-bin` of
 * every read until it expires (one hour by default).
 *
 * Without one a read fails UNAUTHENTICATED (reason NO_SESSION; BAD_SESSION
 * when it does not verify, SESSION_EXPIRED after it expired); a key that is
 * neither a party of the tree nor a configured reader gets NOT_FOUND (reason
 * NOT_FOUND), exactly the answer for an id that does not exist, so it cannot
 * tell which ids exist.
 */

import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import { encodeBinaryHeader, type Interceptor } from "@connectrpc/connect";

import {
  GetBrokerKeysRequestSchema,
  type GetBrokerKeysRequest,
  type GetBrokerKeysResponse,
  type OpenSessionRequest,
  type OpenSessionResponse,
} from "./gen/delegation/broker/v1/broker_pb.js";
import { SealedSchema, SessionSchema, type Sealed } from "./gen/delegation/broker/v1/types_pb.js";
import type { Agent } from "./signing.js";

/** The binary gRPC metadata key a read's session travels in. */
export const SESSION_HEADER = "x-broker-session-bin";
/** Default fraction of a session's lifetime after which {@link RenewingSession} opens a new one. */
export const RENEW_AT = 0.9;

/** What opening a session needs: a client's `getBrokerKeys` and `openSession`. */
export interface SessionOpener {
  getBrokerKeys(request: GetBrokerKeysRequest, options?: { timeoutMs?: number }): Promise<GetBrokerKeysResponse>;
  openSession(request: OpenSessionRequest, options?: { timeoutMs?: number }): Promise<OpenSessionResponse>;
}

/**
 * A session the broker issued (OpenSessionResponse): the Sealed to send with
 * reads, and what it says. Not verified here (the broker verifies it at every
 * read), only decoded; `verifySealed(session.sealed, keys, SessionSchema)`
 * verifies it offline.
 */
export class ReadSession {
  constructor(
    /** The broker-signed Session, exactly as received. */
    readonly sealed: Sealed,
    /** The key the session reads as. */
    readonly agentPublicKey: Uint8Array,
    /** Unix ms (broker clock) at which the broker issued it. */
    readonly issuedAtMs: bigint,
    /** Unix ms (broker clock) from which the broker refuses it (SESSION_EXPIRED). */
    readonly expiresAtMs: bigint,
  ) {}

  /** Decodes an OpenSessionResponse. */
  static fromResponse(response: OpenSessionResponse): ReadSession {
    if (response.session === undefined) throw new TypeError("the OpenSessionResponse carries no session");
    const session = fromBinary(SessionSchema, response.session.payload);
    return new ReadSession(
      response.session,
      session.agentPublicKey,
      session.issuedAtMs,
      response.expiresAtMs !== 0n ? response.expiresAtMs : session.expiresAtMs,
    );
  }

  /** How long the broker accepts it, ms (`expiresAtMs - issuedAtMs`). */
  get lifetimeMs(): number {
    const ms = this.expiresAtMs - this.issuedAtMs;
    return ms > 0n ? Number(ms) : 0;
  }

  /** The raw value of `x-broker-session-bin`: the Sealed session, protobuf-encoded. */
  headerBytes(): Uint8Array {
    return toBinary(SealedSchema, this.sealed);
  }

  /** The header value as sent (base64, as gRPC binary headers are). */
  headerValue(): string {
    return encodeBinaryHeader(this.headerBytes());
  }

  /** Call headers carrying this session: `client.getContract(req, { headers: session.headers() })`. */
  headers(): Record<string, string> {
    return { [SESSION_HEADER]: this.headerValue() };
  }
}

/**
 * The key id of the broker's current signing key (GetBrokerKeys, public):
 * what an OpenSession request must name.
 */
export async function currentKeyId(client: SessionOpener, options: { timeoutMs?: number } = {}): Promise<string> {
  const response = await client.getBrokerKeys(create(GetBrokerKeysRequestSchema), { timeoutMs: options.timeoutMs ?? 10_000 });
  const current = response.keys.find((key) => key.current);
  if (current === undefined) throw new Error("the broker published no current key");
  return current.keyId;
}

/**
 * Asks the broker for its current key id, then calls OpenSession with a
 * request freshly signed by `agent` naming it, and returns the session.
 * Every call opens a new one.
 */
export async function openSession(
  client: SessionOpener,
  agent: Agent,
  options: { timeoutMs?: number } = {},
): Promise<ReadSession> {
  const timeoutMs = options.timeoutMs ?? 10_000;
  const request = agent.openSession({ brokerKeyId: await currentKeyId(client, { timeoutMs }) });
  return ReadSession.fromResponse(await client.openSession(request, { timeoutMs }));
}

/** Anything that yields the session header of a call: a {@link ReadSession} (fixed) or a {@link RenewingSession}. */
export interface SessionSource {
  headerValue(): string | Promise<string>;
}

export interface RenewingSessionOptions {
  /** Fraction of the lifetime after which the next call opens a new session, in (0, 1] (default 0.9). */
  renewAt?: number;
  /** Deadline of the GetBrokerKeys and OpenSession calls, ms (default 10_000). */
  timeoutMs?: number;
  /** Unix ms now; for tests. */
  clock?: () => number;
}

/**
 * `agent`'s read session on the broker behind `client`, opened when first
 * needed and opened again on the first call after `renewAt` (0.9) of its
 * lifetime has passed.
 *
 * The lifetime is the broker's (`expiresAtMs - issuedAtMs`), counted by this
 * client's clock from when the session was requested, so a skew between the
 * two clocks does not matter. Renewal is lazy (nothing runs in the
 * background) and concurrent callers share one renewal. `client` is used
 * only for GetBrokerKeys and OpenSession, which never carry a session.
 */
export class RenewingSession implements SessionSource {
  readonly agent: Agent;
  readonly renewAt: number;
  readonly #client: SessionOpener;
  readonly #timeoutMs: number;
  readonly #clock: () => number;
  #session: ReadSession | undefined;
  #renewAfterMs = 0;
  #opening: Promise<ReadSession> | undefined;

  constructor(agent: Agent, client: SessionOpener, options: RenewingSessionOptions = {}) {
    const renewAt = options.renewAt ?? RENEW_AT;
    if (!(renewAt > 0 && renewAt <= 1)) throw new RangeError("renewAt must be in (0, 1]");
    this.agent = agent;
    this.renewAt = renewAt;
    this.#client = client;
    this.#timeoutMs = options.timeoutMs ?? 10_000;
    this.#clock = options.clock ?? Date.now;
  }

  /** True when there is no session yet, or `now` is past `renewAt` of the current one's lifetime. */
  needsRenewal(now: number = this.#clock()): boolean {
    return this.#session === undefined || now >= this.#renewAfterMs;
  }

  /** The session to send now, opening a new one first if {@link needsRenewal}. */
  async current(): Promise<ReadSession> {
    if (this.#opening !== undefined) return this.#opening;
    if (this.needsRenewal()) return this.renew();
    return this.#session!;
  }

  /** Opens a new session now, whatever the age of the current one (e.g. after SESSION_EXPIRED or BAD_SESSION). */
  renew(): Promise<ReadSession> {
    if (this.#opening !== undefined) return this.#opening;
    const requestedMs = this.#clock(); // before the call: errs on the early side
    this.#opening = openSession(this.#client, this.agent, { timeoutMs: this.#timeoutMs })
      .then((session) => {
        this.#session = session;
        this.#renewAfterMs = requestedMs + Math.floor(session.lifetimeMs * this.renewAt);
        return session;
      })
      .finally(() => {
        this.#opening = undefined;
      });
    return this.#opening;
  }

  /** The header value of {@link current}. */
  async headerValue(): Promise<string> {
    return (await this.current()).headerValue();
  }

  toString(): string {
    return `RenewingSession(${this.agent.keyId})`;
  }
}

/** RPCs that never carry a session: they are public (and opening one must not need one). */
export const PUBLIC_METHODS: ReadonlySet<string> = new Set(["OpenSession", "GetBrokerKeys"]);

/**
 * An interceptor adding `source`'s session (`x-broker-session-bin`) to every
 * call but the public OpenSession and GetBrokerKeys and calls whose headers
 * already carry a session; for transports you build yourself:
 * `createGrpcTransport({ baseUrl, interceptors: [sessionInterceptor(session)] })`.
 * With a {@link RenewingSession}, a call may first open a new session.
 */
export function sessionInterceptor(source: SessionSource): Interceptor {
  return (next) => async (request) => {
    if (!PUBLIC_METHODS.has(request.method.name) && !request.header.has(SESSION_HEADER)) {
      request.header.set(SESSION_HEADER, await source.headerValue());
    }
    return next(request);
  };
}
