/**
 * The console's access to the broker, over the console listener's own origin:
 *
 * - the access token `serve` printed (`#token=…`) buys a short-lived read
 *   session of the configured reader key: `POST /console/session` with
 *   `x-console-token`, answered `{session, expires_at_ms, reader_key, names}`
 *   (401 for a wrong token); the session is renewed before it expires;
 * - every gRPC-Web call carries the token (`x-console-token`) and the session
 *   (`x-broker-session-bin`, as the TypeScript client attaches it);
 * - audit calls run one at a time (the broker allows one per caller).
 *
 * No agent or broker key is ever in the browser: the console only reads.
 */

import { fromBinary } from "@bufbuild/protobuf";
import { Code, encodeBinaryHeader, type Interceptor } from "@connectrpc/connect";

import { createBrokerClient, type BrokerClient } from "../../clients/typescript/src/client.js";
import { BrokerError } from "../../clients/typescript/src/errors.js";
import { SealedSchema, SessionSchema } from "../../clients/typescript/src/pb.js";
import { SESSION_HEADER } from "../../clients/typescript/src/session.js";
import { BrokerKeys } from "../../clients/typescript/src/verify.js";
import { createWebTransport } from "../../clients/typescript/src/web.js";
import { sleep } from "./dom.js";

/** The header carrying the access token, on the session request and on every gRPC-Web call. */
export const TOKEN_HEADER = "x-console-token";
/** Where the token is kept for the tab's lifetime (never in the URL). */
export const TOKEN_STORAGE_KEY = "delegation-broker-console-token";
/** A session is renewed after this share of its lifetime. */
const RENEW_AT = 0.8;

/** The access token was refused (401 on the session request, UNAUTHENTICATED without a broker reason on a call). */
export class TokenRejected extends Error {
  constructor(message = "the access token was refused") {
    super(message);
    this.name = "TokenRejected";
  }
}

interface SessionAnswer {
  session: string;
  expires_at_ms: number;
  reader_key: string;
  names?: Record<string, string>;
}

function base64Bytes(text: string): Uint8Array {
  const binary = atob(text);
  const out = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) out[i] = binary.charCodeAt(i);
  return out;
}

async function requestSession(token: string): Promise<SessionAnswer> {
  const response = await fetch("/console/session", {
    method: "POST",
    headers: { [TOKEN_HEADER]: token },
    cache: "no-store",
    credentials: "same-origin",
  });
  if (response.status === 401) {
    let detail = "";
    try {
      detail = ((await response.json()) as { error?: string }).error ?? "";
    } catch {
      /* no JSON body */
    }
    throw new TokenRejected(detail === "" ? "the access token was refused" : `the access token was refused: ${detail}`);
  }
  if (!response.ok) throw new Error(`POST /console/session answered ${response.status}`);
  const answer = (await response.json()) as SessionAnswer;
  if (typeof answer.session !== "string" || typeof answer.reader_key !== "string") {
    throw new Error("POST /console/session answered without a session");
  }
  return answer;
}

function needsNewSession(error: BrokerError): boolean {
  return error.code === Code.Unauthenticated && (error.reason === "SESSION_EXPIRED" || error.reason === "BAD_SESSION" || error.reason === "NO_SESSION");
}

/** A token refused by the console listener: UNAUTHENTICATED without the broker's ErrorInfo. */
export function isTokenRefusal(error: unknown): boolean {
  if (error instanceof TokenRejected) return true;
  const e = BrokerError.from(error);
  return e.code === Code.Unauthenticated && e.reason === undefined;
}

type Listener = () => void;

export class ConsoleApi {
  readonly token: string;
  readonly client: BrokerClient;
  /** Hex public key the console reads as. */
  readerKey = "";
  /** The operator's address book: hex public key → name. */
  names: Readonly<Record<string, string>> = {};
  /** When the current session expires (broker clock, unix ms). */
  expiresAtMs = 0;
  keys: BrokerKeys | undefined;
  #header = "";
  #renewTimer: ReturnType<typeof setTimeout> | undefined;
  #renewing: Promise<void> | undefined;
  #auditChain: Promise<unknown> = Promise.resolve();
  #onTokenRejected: Listener = () => {};
  #onSession: Listener = () => {};

  private constructor(token: string) {
    this.token = token;
    const interceptor: Interceptor = (next) => async (request) => {
      request.header.set(TOKEN_HEADER, this.token);
      request.header.set(SESSION_HEADER, this.#header);
      try {
        return await next(request);
      } catch (caught) {
        const error = BrokerError.from(caught);
        if (isTokenRefusal(error)) this.#onTokenRejected();
        if (request.stream || !needsNewSession(error)) throw error;
        // A session the broker no longer takes (a sleeping laptop missed the renewal): renew once and resend (reads are safe to repeat).
        await this.renew();
        request.header.set(SESSION_HEADER, this.#header);
        return await next(request);
      }
    };
    this.client = createBrokerClient(createWebTransport(location.origin, { interceptors: [interceptor] }));
  }

  /** Opens the console's session with `token`; throws {@link TokenRejected} for a wrong one. */
  static async open(token: string): Promise<ConsoleApi> {
    const api = new ConsoleApi(token);
    await api.renew();
    api.keys = await BrokerKeys.fetch(api.client);
    return api;
  }

  /** Called when the token is refused later on (the broker restarted with a new one). */
  onTokenRejected(listener: Listener): void {
    this.#onTokenRejected = listener;
  }

  /** Called after each new session. */
  onSession(listener: Listener): void {
    this.#onSession = listener;
  }

  /** Asks for a new session now (shared by concurrent callers) and schedules the next renewal. */
  renew(): Promise<void> {
    if (this.#renewing !== undefined) return this.#renewing;
    this.#renewing = this.#renew().finally(() => {
      this.#renewing = undefined;
    });
    return this.#renewing;
  }

  async #renew(): Promise<void> {
    const requestedAt = Date.now();
    const answer = await requestSession(this.token);
    const sealedBytes = base64Bytes(answer.session);
    const sealed = fromBinary(SealedSchema, sealedBytes);
    const session = fromBinary(SessionSchema, sealed.payload);
    this.#header = encodeBinaryHeader(sealedBytes);
    this.readerKey = answer.reader_key.toLowerCase();
    this.names = Object.fromEntries(Object.entries(answer.names ?? {}).map(([k, v]) => [k.toLowerCase(), v]));
    this.expiresAtMs = Number(answer.expires_at_ms);
    // The lifetime by the broker's clock, counted on ours from the request: clock skew does not matter.
    const lifetime = Math.max(1_000, this.expiresAtMs - Number(session.issuedAtMs));
    this.#schedule(requestedAt + Math.floor(lifetime * RENEW_AT) - Date.now());
    this.#onSession();
  }

  #schedule(delayMs: number): void {
    clearTimeout(this.#renewTimer);
    this.#renewTimer = setTimeout(() => {
      this.renew().catch((error: unknown) => {
        if (error instanceof TokenRejected) this.#onTokenRejected();
        else this.#schedule(10_000); // the broker is away: try again soon
      });
    }, Math.max(1_000, delayMs));
  }

  /** Stops renewing. */
  close(): void {
    clearTimeout(this.#renewTimer);
  }

  /**
   * Runs audit calls (GetAudit, AggregateAudits) one at a time: the broker
   * runs one per caller at once and answers more RESOURCE_EXHAUSTED
   * (OVERLOADED), which is retried a few times with backoff.
   */
  audit<T>(call: () => Promise<T>): Promise<T> {
    const run = async (): Promise<T> => {
      for (let attempt = 0; ; attempt++) {
        try {
          return await call();
        } catch (caught) {
          const error = BrokerError.from(caught);
          if (error.code !== Code.ResourceExhausted || attempt >= 5) throw error;
          await sleep(250 * 2 ** attempt);
        }
      }
    };
    const result = this.#auditChain.then(run, run);
    this.#auditChain = result.catch(() => undefined);
    return result;
  }
}
