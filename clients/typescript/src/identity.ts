/**
 * Workload identities: binding an agent's key to the identity a workload
 * token proves (BindIdentity).
 *
 * A broker configured with `[identity.issuers.NAME]` (SPIFFE trust domains
 * or OIDC issuers, with their JWKS or SPIFFE bundle) accepts, from an agent,
 * a request signed by its key carrying a JWT from one of them: a SPIFFE
 * JWT-SVID (identity: its SPIFFE ID, `spiffe://trust-domain/path`) or an
 * OIDC ID token (identity: `"<iss>#<sub>"`). Until the token's `exp`, every
 * contract issued to that key carries the identity in its broker-signed
 * payload (`Contract.delegateIdentity`; a root its opener's), so a chain
 * verified offline names workloads, and `[orchestrators]` and `[readers]
 * identities` may name identities (exactly, or by a pattern ending in
 * `/*`) instead of keys.
 *
 * BindIdentity is not recorded in the request log: sending a request again
 * binds again, which is harmless; binding again with a fresh token renews
 * the binding (the later replaces the earlier).
 */

import type { CallOptions } from "@connectrpc/connect";

import type { BindIdentityRequest, BindIdentityResponse } from "./gen/delegation/broker/v1/broker_pb.js";
import { callIdempotent, type RetryOptions } from "./retry.js";
import type { Agent } from "./signing.js";

/**
 * The values of metadata `check` (`BrokerError.check`) of an
 * IDENTITY_REFUSED error: which check the workload token failed.
 *
 * - IDENTITY_FORMAT: not a compact JWS with JSON header and claims;
 * - IDENTITY_ISSUER: its `iss` names no configured OIDC issuer (and its
 *   `sub` is no SPIFFE ID);
 * - IDENTITY_ALGORITHM: an `alg` off the allow-list (`none`, HMAC, ...);
 * - IDENTITY_SIGNATURE: the signature does not verify under the issuer's
 *   keys (or none has its `kid`);
 * - IDENTITY_AUDIENCE: no `aud` is one of the issuer's audiences;
 * - IDENTITY_EXPIRED: `exp` has passed;
 * - IDENTITY_NOT_YET_VALID: `nbf` or `iat` in the future;
 * - IDENTITY_LIFETIME: `exp` missing, not whole seconds, or more than 24 h ahead;
 * - IDENTITY_SUBJECT: `sub` missing, or not a SPIFFE ID for a SPIFFE issuer;
 * - IDENTITY_TRUST_DOMAIN: a SPIFFE ID of a trust domain no issuer trusts;
 * - IDENTITY_KEY_BINDING: a `cnf` claim naming another key than the signer's.
 */
export const IDENTITY_CHECKS = [
  "IDENTITY_FORMAT",
  "IDENTITY_ISSUER",
  "IDENTITY_ALGORITHM",
  "IDENTITY_SIGNATURE",
  "IDENTITY_AUDIENCE",
  "IDENTITY_EXPIRED",
  "IDENTITY_NOT_YET_VALID",
  "IDENTITY_LIFETIME",
  "IDENTITY_SUBJECT",
  "IDENTITY_TRUST_DOMAIN",
  "IDENTITY_KEY_BINDING",
] as const;

/** One of {@link IDENTITY_CHECKS}. */
export type IdentityCheck = (typeof IDENTITY_CHECKS)[number];

/** What binding needs: a client's `bindIdentity` (any client of the Broker service). */
export interface IdentityBinder {
  bindIdentity(request: BindIdentityRequest, options?: CallOptions): Promise<BindIdentityResponse>;
}

/**
 * Binds `agent`'s key to the workload identity `token` (a JWT-SVID or an
 * OIDC token, compact JWS) proves, on the broker behind `client`, and
 * returns the broker's answer: the bound `identity`, the `issuer` entry
 * (`[identity.issuers.NAME]`) that vouched for it and `expiresAtMs` (the
 * token's `exp`), when the binding ends (bind again with a fresh token
 * before then).
 *
 * The request is signed once and resent unchanged on UNAVAILABLE and
 * DEADLINE_EXCEEDED ({@link callIdempotent}, `options` as there: 5 calls
 * at most, each with a 10 s deadline): BindIdentity is not recorded in the
 * broker's request log, so a resent request simply binds again, which is
 * harmless. Anything else throws the `BrokerError`: UNAUTHENTICATED,
 * reason IDENTITY_REFUSED, for a token that proves nothing (`error.check`
 * says which check, one of {@link IDENTITY_CHECKS}; nothing is bound, and
 * the same token fails again); FAILED_PRECONDITION, IDENTITY_NOT_CONFIGURED,
 * when the broker trusts no issuer.
 */
export function bindIdentity(
  client: IdentityBinder,
  agent: Agent,
  token: string,
  options: RetryOptions = {},
): Promise<BindIdentityResponse> {
  const send = (request: BindIdentityRequest, callOptions?: CallOptions) => client.bindIdentity(request, callOptions);
  return callIdempotent(send, agent.bindIdentity(token), options);
}
