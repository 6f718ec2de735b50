/**
 * The broker's token endpoint (`serve --tokens ADDR`): JWT access tokens
 * for resource servers, minted by OAuth 2.0 token exchange (RFC 8693).
 *
 * The holder of an open contract (its delegate agent) signs an assertion
 * with its own ed25519 key — a compact JWS (`alg` EdDSA) whose `iss` and
 * `sub` are its public key in hex, whose `aud` is the token endpoint and
 * which names the `contract_id` — and exchanges it for a broker-signed
 * EdDSA JWT for one configured resource. That token carries the
 * delegation's terms (`tctx`) and its delegators (RFC 8693's nested
 * `act`); a resource server checks it with any JOSE library against the
 * broker's JWKS, and may ask the introspection endpoint whether it still
 * stands (RFC 7662).
 *
 * ```ts
 * const tokens = new TokenEndpoint("http://127.0.0.1:8443");   // as `serve` prints it: "tokens on URL"
 * const { accessToken, expiresIn } = await tokens.mint(agent, contractId, "https://api.example");
 * ```
 *
 * Only the platform's `fetch` (Node ≥ 18, browsers) and the package's own
 * ed25519 signer ({@link Agent.signRaw}) are used.
 */

import { randomBytes, toHex, utf8 } from "./bytes.js";
import type { Agent } from "./signing.js";

/** RFC 8693's grant type, the only one the broker serves. */
export const TOKEN_EXCHANGE_GRANT_TYPE = "urn:ietf:params:oauth:grant-type:token-exchange";
/** RFC 8693's token type of a JWT: the assertion's `subject_token_type`, and the issued token's type. */
export const JWT_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:jwt";
/** Where the authorization server metadata is served (RFC 8414), under the endpoint's URL. */
export const TOKEN_METADATA_PATH = "/.well-known/oauth-authorization-server";
/** Longest lifetime of an assertion the broker accepts (`exp - now`), in seconds. */
export const MAX_ASSERTION_LIFETIME_S = 300;
/** Default lifetime of an assertion, in seconds. */
export const DEFAULT_ASSERTION_LIFETIME_S = 60;
/** Default timeout of each request to the token endpoint, in milliseconds. */
export const DEFAULT_TOKEN_TIMEOUT_MS = 10_000;

// --- base64url -------------------------------------------------------------------------

const B64URL = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/** base64url of `bytes`, without padding (RFC 7515 §2). */
export function base64url(bytes: Uint8Array): string {
  let out = "";
  let i = 0;
  for (; i + 3 <= bytes.length; i += 3) {
    const n = (bytes[i]! << 16) | (bytes[i + 1]! << 8) | bytes[i + 2]!;
    out += B64URL[n >> 18]! + B64URL[(n >> 12) & 63]! + B64URL[(n >> 6) & 63]! + B64URL[n & 63]!;
  }
  const rest = bytes.length - i;
  if (rest === 1) {
    const n = bytes[i]! << 16;
    out += B64URL[n >> 18]! + B64URL[(n >> 12) & 63]!;
  } else if (rest === 2) {
    const n = (bytes[i]! << 16) | (bytes[i + 1]! << 8);
    out += B64URL[n >> 18]! + B64URL[(n >> 12) & 63]! + B64URL[(n >> 6) & 63]!;
  }
  return out;
}

// --- the assertion ---------------------------------------------------------------------

/** How an assertion is built; the defaults are what the broker expects. */
export interface AssertionOptions {
  /** `iat`, seconds since the epoch; default now. */
  issuedAtS?: number;
  /** `exp - iat`, in seconds: 1 ..= {@link MAX_ASSERTION_LIFETIME_S}; default {@link DEFAULT_ASSERTION_LIFETIME_S}. */
  lifetimeS?: number;
  /**
   * `jti`: 16 ..= 128 characters, never used before (the broker refuses an
   * assertion whose `jti` it has seen); default 32 random hex digits.
   */
  jti?: string;
}

/** The claims of a holder's assertion. */
export interface AssertionClaims {
  /** The signer's ed25519 public key, lowercase hex. */
  iss: string;
  /** The same as `iss`. */
  sub: string;
  /** The token endpoint's URL, exactly as the metadata's `token_endpoint`. */
  aud: string;
  iat: number;
  exp: number;
  jti: string;
  /** The contract the token is for, lowercase hex of its 32-byte id. */
  contract_id: string;
}

/**
 * The assertion `agent` — the contract's delegate — signs to exchange for a
 * token: a compact JWS, header `{"alg":"EdDSA","typ":"JWT"}`, claims
 * {@link AssertionClaims}, signed with the agent's ed25519 key over
 * `base64url(header) "." base64url(claims)`. `tokenEndpoint` is the
 * metadata's `token_endpoint`, exactly (see {@link TokenEndpoint.assertion},
 * which looks it up). Each assertion is good for one exchange.
 */
export function signAssertion(agent: Agent, contractId: Uint8Array, tokenEndpoint: string, options: AssertionOptions = {}): string {
  if (contractId.length !== 32) throw new RangeError(`a contract id is 32 bytes, got ${contractId.length}`);
  const lifetimeS = options.lifetimeS ?? DEFAULT_ASSERTION_LIFETIME_S;
  if (!Number.isInteger(lifetimeS) || lifetimeS < 1 || lifetimeS > MAX_ASSERTION_LIFETIME_S) {
    throw new RangeError(`an assertion lives 1 ..= ${MAX_ASSERTION_LIFETIME_S} s, not ${lifetimeS}`);
  }
  const jti = options.jti ?? toHex(randomBytes(16));
  if (jti.length < 16 || jti.length > 128) throw new RangeError(`an assertion's jti is 16 ..= 128 characters, got ${jti.length}`);
  const iat = options.issuedAtS ?? Math.floor(Date.now() / 1000);
  const key = toHex(agent.publicKey);
  const claims: AssertionClaims = { iss: key, sub: key, aud: tokenEndpoint, iat, exp: iat + lifetimeS, jti, contract_id: toHex(contractId) };
  const input = `${base64url(utf8(JSON.stringify({ alg: "EdDSA", typ: "JWT" })))}.${base64url(utf8(JSON.stringify(claims)))}`;
  return `${input}.${base64url(agent.signRaw(utf8(input)))}`;
}

// --- what the endpoint answers -----------------------------------------------------------

/** The authorization server metadata (RFC 8414) the broker serves; every URL is absolute. */
export interface TokenEndpointMetadata {
  /** The `iss` of minted tokens. */
  issuer: string;
  /** Where assertions are exchanged; an assertion's `aud`. */
  token_endpoint: string;
  /** The broker's signing keys as a JWK Set (its current and retired keys). */
  jwks_uri: string;
  /** RFC 7662 introspection, for resource servers with `[tokens.introspectors]` credentials (HTTP Basic). */
  introspection_endpoint: string;
  grant_types_supported: string[];
  [member: string]: unknown;
}

/** A minted token (RFC 8693 §2.2.1). */
export interface MintedToken {
  /** The broker-signed JWT (header `typ` "at+jwt", `alg` EdDSA): send it as `Authorization: Bearer <accessToken>`. */
  accessToken: string;
  /** Seconds it lives from its `iat` (never past the contract's deadline). */
  expiresIn: number;
  /** "Bearer". */
  tokenType: string;
  /** {@link JWT_TOKEN_TYPE}. */
  issuedTokenType: string;
}

/** One delegator of a token's `act` chain: the nearest first, each earlier one nested in `act`. */
export interface TokenActor {
  /** The delegator's key id (`keyId` of its public key). */
  sub: string;
  /** The contract it holds, lowercase hex. */
  contract_id: string;
  act?: TokenActor;
}

/** A minted token's `tctx`: the terms of the contract it stands for, when it was minted. */
export interface TokenContext {
  contract_id: string;
  root_id: string;
  depth: number;
  /** Lowercase hex SHA-256 of the root's intent (`lineageHash`). */
  lineage_hash: string;
  trust_ppm: number;
  /** Budget - reserved - spent, when minted. */
  residual: number;
  deadline_ms: number;
  write_scope: string[];
}

/** The claims of a token the broker mints (what a resource server reads once it verified it). */
export interface DelegationTokenClaims {
  iss: string;
  /** The contract's delegate: its key id. */
  sub: string;
  /** The same as `sub` (RFC 9068). */
  client_id: string;
  /** The resource. */
  aud: string;
  iat: number;
  exp: number;
  jti: string;
  /** The tree: the root contract's id, lowercase hex. */
  txn: string;
  /** The delegators, nearest first; absent for a root. */
  act?: TokenActor;
  tctx: TokenContext;
}

/**
 * The token endpoint refused (an RFC 6749 §5.2 error answer) or answered
 * something that is not a valid answer.
 *
 * `error` is the answer's code — `invalid_request`, `invalid_grant` (the
 * assertion is bad, expired or replayed, its signer does not hold the
 * contract, or the contract or an ancestor ended or is past its deadline),
 * `invalid_target` (a resource the broker does not mint for),
 * `unsupported_grant_type`, `invalid_client`, `temporarily_unavailable`
 * (503: retry later) — or `invalid_response` when the answer was not
 * understood. Act on `error`; `errorDescription` says what was wrong, for
 * people. Failing to reach the endpoint, or its timeout, rejects with
 * `fetch`'s own error instead (a `TypeError`, or a `DOMException` named
 * "TimeoutError").
 */
export class TokenEndpointError extends Error {
  /** The OAuth error code, or "invalid_response". */
  readonly error: string;
  /** `error_description`: what was wrong ("" when the answer gave none). */
  readonly errorDescription: string;
  /** The HTTP status of the answer. */
  readonly status: number;

  constructor(error: string, errorDescription: string, status: number) {
    super(`token endpoint: ${error} (HTTP ${status})${errorDescription ? `: ${errorDescription}` : ""}`);
    this.name = "TokenEndpointError";
    this.error = error;
    this.errorDescription = errorDescription;
    this.status = status;
  }

  /** True for an answer worth retrying later with a new assertion (503, `temporarily_unavailable`). */
  get retryable(): boolean {
    return this.status === 503 || this.error === "temporarily_unavailable";
  }
}

/** Options of one request. */
export interface TokenRequestOptions {
  /** This request's timeout, in milliseconds; default the endpoint's. */
  timeoutMs?: number;
  /** Aborts the request. */
  signal?: AbortSignal;
}

export interface TokenEndpointOptions {
  /** Each request's timeout, in milliseconds; default {@link DEFAULT_TOKEN_TIMEOUT_MS}. */
  timeoutMs?: number;
  /** The `fetch` to use; default the platform's. */
  fetch?: typeof globalThis.fetch;
}

function isRecord(value: unknown): value is Record<string, unknown> {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

function snippet(text: string): string {
  return text.length > 200 ? `${text.slice(0, 200)}…` : text;
}

/**
 * The broker's token endpoint at `url`: the base URL `serve --tokens`
 * prints ("tokens on http://127.0.0.1:8443"), or the configured
 * `[tokens] issuer`. The metadata is fetched from `url` +
 * {@link TOKEN_METADATA_PATH} once, then kept; tokens are minted at the
 * metadata's `token_endpoint`.
 */
export class TokenEndpoint {
  /** The base URL (without a trailing slash). */
  readonly url: string;
  readonly #timeoutMs: number;
  readonly #fetch: typeof globalThis.fetch;
  #metadata: Promise<TokenEndpointMetadata> | undefined;

  constructor(url: string | URL, options: TokenEndpointOptions = {}) {
    this.url = String(url).replace(/\/+$/, "");
    if (!/^https?:\/\//.test(this.url)) throw new TypeError(`the token endpoint's URL must be http(s): ${JSON.stringify(this.url)}`);
    this.#timeoutMs = options.timeoutMs ?? DEFAULT_TOKEN_TIMEOUT_MS;
    this.#fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
  }

  /** The metadata (RFC 8414), fetched on the first call (again with `refresh`, or after a failure). */
  metadata(options: TokenRequestOptions & { refresh?: boolean } = {}): Promise<TokenEndpointMetadata> {
    if (this.#metadata === undefined || options.refresh) {
      const fetched = this.#fetchMetadata(options);
      this.#metadata = fetched;
      fetched.catch(() => {
        if (this.#metadata === fetched) this.#metadata = undefined;
      });
    }
    return this.#metadata;
  }

  async #fetchMetadata(options: TokenRequestOptions): Promise<TokenEndpointMetadata> {
    const body = await this.#request(this.url + TOKEN_METADATA_PATH, undefined, options);
    for (const member of ["issuer", "token_endpoint", "jwks_uri", "introspection_endpoint"]) {
      if (typeof body[member] !== "string") {
        throw new TokenEndpointError("invalid_response", `the metadata has no ${member}`, 200);
      }
    }
    if (!Array.isArray(body.grant_types_supported)) body.grant_types_supported = [];
    return body as TokenEndpointMetadata;
  }

  /** An assertion by `agent` for `contractId`, addressed to this endpoint's `token_endpoint` ({@link signAssertion}). */
  async assertion(agent: Agent, contractId: Uint8Array, options: AssertionOptions & TokenRequestOptions = {}): Promise<string> {
    const { token_endpoint } = await this.metadata(options);
    return signAssertion(agent, contractId, token_endpoint, options);
  }

  /**
   * A token for `resource` (one of the broker's `[tokens] resources`),
   * standing for `contractId`: `agent` must be its delegate, and the
   * contract and every ancestor open and before their deadlines. Signs a
   * fresh assertion and exchanges it; throws {@link TokenEndpointError}
   * when refused.
   */
  async mint(
    agent: Agent,
    contractId: Uint8Array,
    resource: string,
    options: AssertionOptions & TokenRequestOptions = {},
  ): Promise<MintedToken> {
    return this.exchange(await this.assertion(agent, contractId, options), resource, options);
  }

  /** Exchanges a signed assertion (see {@link assertion}) for a token for `resource` (RFC 8693). */
  async exchange(assertion: string, resource: string, options: TokenRequestOptions = {}): Promise<MintedToken> {
    const { token_endpoint } = await this.metadata(options);
    const form = new URLSearchParams({
      grant_type: TOKEN_EXCHANGE_GRANT_TYPE,
      subject_token: assertion,
      subject_token_type: JWT_TOKEN_TYPE,
      resource,
    });
    const body = await this.#request(token_endpoint, form, options);
    if (typeof body.access_token !== "string" || typeof body.expires_in !== "number") {
      throw new TokenEndpointError("invalid_response", "the answer has no access_token or expires_in", 200);
    }
    return {
      accessToken: body.access_token,
      expiresIn: body.expires_in,
      tokenType: typeof body.token_type === "string" ? body.token_type : "Bearer",
      issuedTokenType: typeof body.issued_token_type === "string" ? body.issued_token_type : JWT_TOKEN_TYPE,
    };
  }

  /** A GET, or a POST of `form`; a JSON object on 200, else a TokenEndpointError. */
  async #request(url: string, form: URLSearchParams | undefined, options: TokenRequestOptions): Promise<Record<string, unknown>> {
    const timeout = AbortSignal.timeout(options.timeoutMs ?? this.#timeoutMs);
    const signal = options.signal === undefined ? timeout : AbortSignal.any([timeout, options.signal]);
    const headers: Record<string, string> = { accept: "application/json" };
    if (form !== undefined) headers["content-type"] = "application/x-www-form-urlencoded";
    const response = await this.#fetch(url, {
      method: form === undefined ? "GET" : "POST",
      headers,
      body: form?.toString(),
      signal,
    });
    const text = await response.text();
    let body: unknown;
    try {
      body = JSON.parse(text);
    } catch {
      body = undefined;
    }
    if (response.status === 200 && isRecord(body)) return body;
    if (isRecord(body) && typeof body.error === "string") {
      const description = typeof body.error_description === "string" ? body.error_description : "";
      throw new TokenEndpointError(body.error, description, response.status);
    }
    throw new TokenEndpointError("invalid_response", `${url} answered ${response.status}: ${JSON.stringify(snippet(text))}`, response.status);
  }
}
