/**
 * TypeScript client of the delegation broker (`delegation.broker.v1`):
 * the generated protobuf-es v2 messages and service (`pb`), and a thin
 * helper layer that runs in Node and in browsers alike —
 *
 * - {@link Agent}: an ed25519 key that signs OpenRoot, Delegate, the
 *   lifecycle requests, OpenSession, BindIdentity and attestations;
 * - {@link bindIdentity}: bind an agent's key to a workload identity (a
 *   SPIFFE JWT-SVID, an OIDC token), stamped into its contracts;
 * - {@link sessionClient}, {@link RenewingSession}, {@link openSession},
 *   {@link sessionInterceptor}: the read session every read carries
 *   (`x-broker-session-bin`), opened and renewed before it expires;
 * - {@link callIdempotent}: resend the same signed request on transient errors;
 * - {@link BrokerKeys}, {@link verifyChain}, {@link verifyContract},
 *   {@link verifyReceipt}, {@link verifySealed}, {@link verifyEverySignature}:
 *   offline verification from the broker's published keys alone;
 * - {@link watch}: a subtree's events, each verified, resumable by cursor;
 * - {@link BrokerError}: failed calls with their code, ErrorInfo reason and
 *   offending field;
 * - {@link TokenEndpoint}, {@link signAssertion}: JWT access tokens for
 *   resource servers from the broker's token endpoint (`serve --tokens`),
 *   by token exchange with an assertion the contract's delegate signs.
 *
 * Transports: `@delegation-broker/client/node` (gRPC over HTTP/2, TLS
 * optional) and `@delegation-broker/client/web` (gRPC-Web, for browsers).
 *
 * What a user needs of the runtimes underneath is re-exported here, so the
 * package alone is enough (its `@bufbuild/protobuf` and `@connectrpc/*` are
 * dependencies, at the versions the generated code needs): protobuf-es's
 * `create`, `toBinary`, `fromBinary`, `toJson`... and connect's `Code`,
 * `ConnectError`.
 */
export * as pb from "./pb.js";
export {
  clone,
  create,
  equals,
  fromBinary,
  fromJson,
  fromJsonString,
  isMessage,
  mergeFromBinary,
  protoInt64,
  toBinary,
  toJson,
  toJsonString,
  type BinaryReadOptions,
  type BinaryWriteOptions,
  type DescMessage,
  type JsonReadOptions,
  type JsonValue,
  type JsonWriteOptions,
  type MessageInitShape,
  type MessageShape,
} from "@bufbuild/protobuf";
export { Code, ConnectError, type CallOptions, type Interceptor, type Transport } from "@connectrpc/connect";
export * as rpc from "./rpc.js";
export { fromHex, toHex, equalBytes } from "./bytes.js";
export {
  Agent,
  MAX_SIGNATURES,
  NONCE_BYTES,
  keyId,
  lineageHash,
  nowMs,
  pae,
  payloadType,
  registry,
  requestSchemaFor,
  sha256,
  verifyPaeSignature,
  verifySignature,
} from "./signing.js";
export {
  BrokerKeys,
  CONTRACT_TYPE,
  MAX_CHAIN_CONTRACTS,
  MAX_EFFECTIVE_PREDICATE_BYTES,
  PPM_ONE,
  RECEIPT_TYPE,
  SESSION_TYPE,
  VerificationError,
  conjoinPredicates,
  isUnder,
  verifyChain,
  verifyContract,
  verifyEverySignature,
  verifyReceipt,
  verifySealed,
  type ChainInput,
  type KeysSource,
  type SealedSchema,
  type Verified,
  type VerifiedContract,
} from "./verify.js";
export { BrokerError, ERROR_DOMAIN, codeName, errorInfo } from "./errors.js";
export { RETRYABLE, callIdempotent, type RetryOptions } from "./retry.js";
export {
  PUBLIC_METHODS,
  RENEW_AT,
  ReadSession,
  RenewingSession,
  SESSION_HEADER,
  currentKeyId,
  openSession,
  sessionInterceptor,
  type RenewingSessionOptions,
  type SessionOpener,
  type SessionSource,
} from "./session.js";
export { brokerTransport, createBrokerClient, sessionClient, type BrokerClient } from "./client.js";
export { IDENTITY_CHECKS, bindIdentity, type IdentityBinder, type IdentityCheck } from "./identity.js";
export { Watch, watch, type ReconnectOptions, type WatchEvent, type WatchOptions, type WatchSource } from "./watch.js";
export {
  DEFAULT_ASSERTION_LIFETIME_S,
  DEFAULT_TOKEN_TIMEOUT_MS,
  JWT_TOKEN_TYPE,
  MAX_ASSERTION_LIFETIME_S,
  TOKEN_EXCHANGE_GRANT_TYPE,
  TOKEN_METADATA_PATH,
  TokenEndpoint,
  TokenEndpointError,
  base64url,
  signAssertion,
  type AssertionClaims,
  type AssertionOptions,
  type DelegationTokenClaims,
  type MintedToken,
  type TokenActor,
  type TokenContext,
  type TokenEndpointMetadata,
  type TokenEndpointOptions,
  type TokenRequestOptions,
} from "./tokens.js";
