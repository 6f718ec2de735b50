/**
 * The broker's structured errors.
 *
 * Every error the broker itself returns is a gRPC status whose
 * `grpc-status-details-bin` trailer holds a `google.rpc.Status` with one
 * `google.rpc.ErrorInfo` (domain `delegation.broker.v1`, a stable `reason`
 * from errors.proto's `ErrorReason`, and metadata such as `field` (the
 * offending request field), `limit` or `check`), plus a
 * `google.rpc.BadRequest` for INVALID_FIELD. {@link BrokerError} carries
 * all of it. A key that is not a party of a tree (nor a configured reader)
 * gets NOT_FOUND for each of its ids, exactly as for an id that does not
 * exist. Invariant refusals are not errors: they come back as signed
 * receipts in `DelegateResponse.outcome` (case "refused").
 */

import { Code, ConnectError } from "@connectrpc/connect";

import { ErrorReason } from "./gen/delegation/broker/v1/errors_pb.js";
import {
  BadRequestSchema,
  ErrorInfoSchema,
  type BadRequest,
  type ErrorInfo,
} from "./gen/google/rpc/error_details_pb.js";

/** `ErrorInfo.domain` of every error the broker returns. */
export const ERROR_DOMAIN = "delegation.broker.v1";

/** The broker's `ErrorInfo` among a ConnectError's details (domain {@link ERROR_DOMAIN} first), if any. */
export function errorInfo(error: unknown): ErrorInfo | undefined {
  if (!(error instanceof ConnectError) && !(error instanceof BrokerError)) return undefined;
  const infos = (error as ConnectError).findDetails(ErrorInfoSchema);
  return infos.find((info) => info.domain === ERROR_DOMAIN) ?? infos[0];
}

/**
 * A failed call: the gRPC status code, and what the broker's `ErrorInfo`
 * says — the stable {@link reason} (an `ErrorReason` name without its
 * prefix, e.g. "NONCE_REUSED"), the offending request {@link field} (e.g.
 * "body.header.nonce", "body.budget", "contract_id") and the other metadata
 * ({@link limit}, {@link check}, `what`, `id`, `requested`, `allowed`, ...).
 *
 * It is a `ConnectError` (`err instanceof ConnectError` holds; `code`,
 * `rawMessage`, `metadata`, `details`, `findDetails` work as there). Statuses
 * the gRPC layer makes (a broker that cannot be reached, a timeout) carry no
 * ErrorInfo: then `reason` is undefined and the code alone says what
 * happened. Act on `reason`, never on the message.
 */
export class BrokerError extends ConnectError {
  /** `ErrorInfo.reason`, e.g. "NOT_FOUND"; undefined without an ErrorInfo. */
  readonly reason: string | undefined;
  /** The reason as the generated enum; undefined without one, or for a reason this client does not know yet. */
  readonly errorReason: ErrorReason | undefined;
  /** Metadata `field`: the offending request field, when the reason names one. */
  readonly field: string | undefined;
  /** Metadata `limit`: the cap that was reached (OVERLOADED, MESSAGE_TOO_LARGE, ...). */
  readonly limit: string | undefined;
  /**
   * Metadata `check`: which check refused a workload token (reason
   * IDENTITY_REFUSED, from BindIdentity), e.g. "IDENTITY_EXPIRED"; see
   * `IDENTITY_CHECKS`.
   */
  readonly check: string | undefined;
  /** Every `ErrorInfo.metadata` entry (empty without an ErrorInfo). */
  readonly info: Readonly<Record<string, string>>;
  /** The whole `google.rpc.ErrorInfo`, when present. */
  readonly errorInfo: ErrorInfo | undefined;
  /** The `google.rpc.BadRequest` (INVALID_FIELD), when present. */
  readonly badRequest: BadRequest | undefined;

  constructor(message: string, code: Code = Code.Unknown, metadata?: HeadersInit, details: ConnectError["details"] = [], cause?: unknown) {
    super(message, code, metadata, undefined, cause);
    // Same name as ConnectError, so that `instanceof ConnectError` (which
    // checks the name) holds for a BrokerError.
    this.name = "ConnectError";
    this.details = details;
    this.errorInfo = errorInfo(this);
    this.badRequest = this.findDetails(BadRequestSchema)[0];
    this.reason = this.errorInfo?.reason || undefined;
    const value = this.reason === undefined ? undefined : (ErrorReason as unknown as Record<string, number>)[this.reason];
    this.errorReason = typeof value === "number" ? (value as ErrorReason) : undefined;
    this.info = { ...(this.errorInfo?.metadata ?? {}) };
    this.field = this.info.field;
    this.limit = this.info.limit;
    this.check = this.info.check;
  }

  /** `instanceof BrokerError` follows the prototype chain (ConnectError's own check is by name). */
  static override [Symbol.hasInstance](value: unknown): boolean {
    return Function.prototype[Symbol.hasInstance].call(this, value);
  }

  /**
   * Any caught value as a BrokerError: a BrokerError as it is, a
   * ConnectError with its code, metadata and details, anything else as
   * `ConnectError.from` would make it (`code`, default Unknown; Canceled for an abort).
   */
  static override from(reason: unknown, code: Code = Code.Unknown): BrokerError {
    if (reason instanceof BrokerError) return reason;
    const error = ConnectError.from(reason, code);
    return new BrokerError(error.rawMessage, error.code, error.metadata, error.details, error.cause ?? reason);
  }
}

/** The gRPC code's name, e.g. "PERMISSION_DENIED" (as the other clients print it). */
export function codeName(code: Code): string {
  if (code === Code.Canceled) return "CANCELLED";
  return (Code[code] ?? String(code)).replace(/([a-z])([A-Z])/g, "$1_$2").toUpperCase();
}
