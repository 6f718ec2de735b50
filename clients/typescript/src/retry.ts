/**
 * Idempotent retries of signed requests.
 *
 * A signed request's nonce is its idempotency key: sending the *same*
 * request again (same nonce, same bytes) returns the broker's original answer
 * with `replayed: true` and reserves nothing twice. So a retry must resend the
 * request it already signed, never rebuild (and re-sign) it.
 */

import { Code, type CallOptions } from "@connectrpc/connect";

import { BrokerError } from "./errors.js";

/**
 * Codes after which resending the same signed request is safe and useful:
 * the transport failed, the answer was lost or timed out, or the broker shed
 * load (UNAVAILABLE with reason OVERLOADED, JUDGES_BUSY, ...: "retry later
 * with the same nonce"). RESOURCE_EXHAUSTED is not among them: it names a
 * limit that a resent request meets again (see errors.proto).
 */
export const RETRYABLE: ReadonlySet<Code> = new Set([Code.Unavailable, Code.DeadlineExceeded]);

export interface RetryOptions {
  /** Calls in all, the first included (default 5). */
  attempts?: number;
  /** Deadline of each call, ms (default 10_000). */
  timeoutMs?: number;
  /** Backoff before the second call, ms (default 100); doubled each time, jittered to 50–100%. */
  initialBackoffMs?: number;
  /** Longest backoff, ms (default 2_000). */
  maxBackoffMs?: number;
  /** Codes that are retried (default {@link RETRYABLE}). */
  retryOn?: ReadonlySet<Code>;
  /** Other options of every call (headers, signal, ...). */
  callOptions?: CallOptions;
  /** For tests: how to wait. */
  sleep?: (ms: number) => Promise<void>;
}

const defaultSleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

/**
 * Calls `method(request, {timeoutMs})`, resending the very same `request` on
 * a retryable status, up to `attempts` calls in all, with jittered
 * exponential backoff. Throws the last error as a {@link BrokerError}.
 *
 * `request` must be a signed request built once (`agent.delegate(...)`,
 * `agent.openRoot(...)`). A resent request the broker already answered gets
 * that answer from its request log (kept for
 * `limits.request_log_retention_ms`, 30 days by default), however late; one
 * it never saw is checked afresh, and refused as stale once its timestamp is
 * outside the broker's window (default 5 minutes).
 *
 * ```ts
 * const request = agent.delegate(body);
 * const response = await callIdempotent(client.delegate, request);
 * response.replayed; // true when an earlier attempt had reached the broker
 * ```
 */
export async function callIdempotent<Req, Res>(
  method: (request: Req, options?: CallOptions) => Promise<Res>,
  request: Req,
  options: RetryOptions = {},
): Promise<Res> {
  const attempts = options.attempts ?? 5;
  if (!Number.isInteger(attempts) || attempts < 1) throw new RangeError("attempts must be at least 1");
  const retryOn = options.retryOn ?? RETRYABLE;
  const initial = options.initialBackoffMs ?? 100;
  const max = options.maxBackoffMs ?? 2_000;
  const sleep = options.sleep ?? defaultSleep;
  for (let attempt = 0; ; attempt++) {
    try {
      return await method(request, { ...options.callOptions, timeoutMs: options.timeoutMs ?? 10_000 });
    } catch (caught) {
      const error = BrokerError.from(caught);
      if (!retryOn.has(error.code) || attempt === attempts - 1 || options.callOptions?.signal?.aborted) throw error;
      const backoff = Math.min(max, initial * 2 ** attempt);
      await sleep(backoff * (0.5 + Math.random() / 2));
    }
  }
}
