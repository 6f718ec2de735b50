/**
 * Watching a contract's subtree, every event verified, resumable by cursor.
 *
 * Watch streams every signed event of a subtree (issued contracts and
 * receipts, each a broker-signed Sealed) in commit order: first what already
 * happened after `cursor`, then live. Each event is verified against the
 * broker's published keys before it is yielded, and its cursor must be
 * greater than the last one seen, so a watch resumed from {@link Watch.cursor}
 * misses nothing and repeats nothing:
 *
 * ```ts
 * const w = watch(client, rootId, { reconnect: true });
 * for await (const event of w) {
 *   if (event.receipt?.kind === ReceiptKind.ESCALATED) break;
 * }
 * // later, or in another process: watch(client, rootId, { cursor: w.cursor })
 * ```
 *
 * `client` must carry a read session of a party of the tree or a configured
 * reader (`sessionClient`). The server never ends a healthy stream by itself
 * (it ends with OK when the broker shuts down): stop with `break`,
 * {@link Watch.cancel}, an AbortSignal or `timeoutMs`.
 */

import { create, fromBinary } from "@bufbuild/protobuf";
import { Code } from "@connectrpc/connect";

import { equalBytes, toHex } from "./bytes.js";
import { BrokerError } from "./errors.js";
import { WatchRequestSchema, type WatchRequest, type WatchResponse } from "./gen/delegation/broker/v1/broker_pb.js";
import {
  ContractSchema,
  ReceiptSchema,
  type Contract,
  type Receipt,
  type Sealed,
} from "./gen/delegation/broker/v1/types_pb.js";
import { BrokerKeys, VerificationError, verifyContract, verifyReceipt, type KeysSource } from "./verify.js";

/** One verified event of a watched subtree: exactly one of `contract` / `receipt` is set. */
export interface WatchEvent {
  /** Position in commit order; pass it back (`watch(..., { cursor })`) to resume after it. */
  readonly cursor: bigint;
  /** The contract id or receipt id: SHA-256 of the Sealed payload. */
  readonly id: Uint8Array;
  /** The broker-signed Sealed (a Contract or a Receipt), exactly as received. */
  readonly sealed: Sealed;
  /** The broker key that signed it. */
  readonly keyId: string;
  /** "contract" or "receipt". */
  readonly kind: "contract" | "receipt";
  /** A contract issued in the subtree, its signature verified (its terms against its ancestors need verifyChain). */
  readonly contract?: Contract;
  /** A receipt signed for a contract of the subtree. */
  readonly receipt?: Receipt;
}

/** What a Watch needs of a client: `watch` (with a read session) and `getBrokerKeys`. */
export interface WatchSource extends KeysSource {
  watch(request: WatchRequest, options?: { signal?: AbortSignal; timeoutMs?: number }): AsyncIterable<WatchResponse>;
}

/** How a Watch reopens its stream after it drops. */
export interface ReconnectOptions {
  /** Reopens in a row without an event in between before giving up (default 10). */
  maxAttempts?: number;
  /** Codes after which the stream is reopened (default UNAVAILABLE: a broker restarting, a connection lost). */
  retryOn?: ReadonlySet<Code>;
  /** First backoff, ms (default 100), doubled each time, at most `maxBackoffMs` (default 2_000). */
  initialBackoffMs?: number;
  maxBackoffMs?: number;
}

export interface WatchOptions {
  /** Resume after this cursor (default 0: every stored event of the subtree). */
  cursor?: bigint;
  /** The broker's keys (default: fetched with GetBrokerKeys when the watch starts). */
  keys?: BrokerKeys;
  /** Deadline of each stream, ms (DEADLINE_EXCEEDED when it passes); default none. */
  timeoutMs?: number;
  /** Ends the watch (iteration then simply stops). */
  signal?: AbortSignal;
  /**
   * Reopen the stream from the last cursor when it drops: when it ends
   * (the broker shuts down: OK) or fails with a retryable code. Off by
   * default: a dropped stream then ends the iteration (OK) or throws.
   */
  reconnect?: boolean | ReconnectOptions;
}

const sleep = (ms: number, signal?: AbortSignal) =>
  new Promise<void>((resolve) => {
    const timer = setTimeout(done, ms);
    function done() {
      clearTimeout(timer);
      signal?.removeEventListener("abort", done);
      resolve();
    }
    signal?.addEventListener("abort", done);
  });

/**
 * An async iterator over the verified events of `contractId`'s subtree after
 * a cursor. Use {@link watch} to open one.
 *
 * Besides each event's signature (and, for a root contract, its terms), a
 * watch that knows the subtree from its start (cursor 0, or resumed from one
 * that did) checks that every contract hangs below the watched one (its
 * parent is a contract seen before) and every receipt is about one of them.
 * Anything that does not verify throws {@link VerificationError} and cancels
 * the stream. When an event names a broker key the watch does not know (a
 * rotation during a long watch), the published keys are fetched once more
 * before giving up.
 */
export class Watch implements AsyncIterable<WatchEvent>, AsyncIterator<WatchEvent> {
  readonly contractId: Uint8Array;
  /** The cursor of the last event yielded (or the starting one): resume after it. */
  cursor: bigint;
  /** Streams opened so far (1 + reconnections). */
  streams = 0;
  keys: BrokerKeys | undefined;
  readonly #client: WatchSource;
  readonly #options: WatchOptions;
  readonly #reconnect: Required<ReconnectOptions> | undefined;
  #subtree: Set<string> | undefined;
  readonly #abort = new AbortController();
  readonly #events: AsyncGenerator<WatchEvent>;

  constructor(client: WatchSource, contractId: Uint8Array, options: WatchOptions = {}, subtree?: Set<string>) {
    const cursor = options.cursor ?? 0n;
    if (cursor < 0n) throw new RangeError("cursor must be >= 0");
    this.contractId = Uint8Array.from(contractId);
    this.cursor = cursor;
    this.keys = options.keys;
    this.#client = client;
    this.#options = options;
    const reconnect = options.reconnect === true ? {} : options.reconnect || undefined;
    this.#reconnect =
      reconnect === undefined
        ? undefined
        : {
            maxAttempts: reconnect.maxAttempts ?? 10,
            retryOn: reconnect.retryOn ?? new Set([Code.Unavailable]),
            initialBackoffMs: reconnect.initialBackoffMs ?? 100,
            maxBackoffMs: reconnect.maxBackoffMs ?? 2_000,
          };
    this.#subtree = subtree !== undefined ? new Set(subtree) : cursor === 0n ? new Set([toHex(this.contractId)]) : undefined;
    if (options.signal !== undefined) {
      if (options.signal.aborted) this.#abort.abort();
      else options.signal.addEventListener("abort", () => this.cancel(), { once: true });
    }
    this.#events = this.#run();
  }

  [Symbol.asyncIterator](): this {
    return this;
  }

  next(): Promise<IteratorResult<WatchEvent>> {
    return this.#events.next();
  }

  /** Ends the iteration (as `break` does) and the stream. */
  async return(): Promise<IteratorResult<WatchEvent>> {
    this.cancel();
    return this.#events.return(undefined);
  }

  /** True once cancelled. */
  get cancelled(): boolean {
    return this.#abort.signal.aborted;
  }

  /** Ends the stream; a pending or later `next()` ends the iteration. Safe to call more than once. */
  cancel(): void {
    this.#abort.abort();
  }

  /**
   * Cancels this watch and opens a new one right after {@link cursor}, with
   * the same keys, options and subtree knowledge.
   */
  resume(options: Omit<WatchOptions, "cursor" | "keys"> = {}): Watch {
    this.cancel();
    return new Watch(
      this.#client,
      this.contractId,
      { ...this.#options, ...options, cursor: this.cursor, keys: this.keys },
      this.#subtree,
    );
  }

  async *#run(): AsyncGenerator<WatchEvent> {
    let failures = 0;
    while (!this.cancelled) {
      if (this.keys === undefined) this.keys = await BrokerKeys.fetch(this.#client);
      const stream = new AbortController();
      const stop = () => stream.abort();
      this.#abort.signal.addEventListener("abort", stop);
      let error: BrokerError | undefined;
      try {
        this.streams++;
        const responses = this.#client.watch(create(WatchRequestSchema, { contractId: this.contractId, cursor: this.cursor }), {
          signal: stream.signal,
          timeoutMs: this.#options.timeoutMs,
        });
        for await (const response of responses) {
          const event = await this.#verify(response);
          this.cursor = event.cursor;
          failures = 0;
          yield event;
        }
      } catch (caught) {
        if (caught instanceof VerificationError) {
          this.cancel();
          throw caught;
        }
        if (this.cancelled) return;
        error = BrokerError.from(caught);
      } finally {
        this.#abort.signal.removeEventListener("abort", stop);
        stream.abort();
      }
      if (this.cancelled) return;
      const reconnect = this.#reconnect;
      if (reconnect === undefined) {
        if (error !== undefined) throw error;
        return; // the broker ended the stream (it shut down)
      }
      if (error !== undefined && !reconnect.retryOn.has(error.code)) throw error;
      if (++failures > reconnect.maxAttempts) {
        throw error ?? new BrokerError(`the stream ended ${failures - 1} times in a row`, Code.Unavailable);
      }
      const backoff = Math.min(reconnect.maxBackoffMs, reconnect.initialBackoffMs * 2 ** (failures - 1));
      await sleep(backoff, this.#abort.signal);
    }
  }

  // --- verification ---------------------------------------------------------------

  async #verify(response: WatchResponse): Promise<WatchEvent> {
    if (response.cursor <= this.cursor) {
      throw new VerificationError(`cursor ${response.cursor} does not advance past ${this.cursor}`);
    }
    const event = response.event;
    if (event.case === undefined) throw new VerificationError(`event at cursor ${response.cursor} is empty`);
    let verified: WatchEvent;
    try {
      verified = this.#decode(response.cursor, event.case, event.value);
    } catch (e) {
      const named = namedKey(event.case, event.value);
      if (!(e instanceof VerificationError) || named === undefined || this.keys!.has(named)) throw e;
      this.keys = await BrokerKeys.fetch(this.#client); // perhaps a key published since the watch began
      verified = this.#decode(response.cursor, event.case, event.value);
    }
    this.#checkSubtree(verified);
    return verified;
  }

  #decode(cursor: bigint, kind: "contract" | "receipt", sealed: Sealed): WatchEvent {
    if (kind === "contract") {
      const contract = verifyContract(sealed, this.keys!);
      return { cursor, id: contract.contractId, sealed, keyId: contract.keyId, kind, contract: contract.contract };
    }
    const receipt = verifyReceipt(sealed, this.keys!);
    return { cursor, id: receipt.id, sealed, keyId: receipt.keyId, kind, receipt: receipt.message };
  }

  #checkSubtree(event: WatchEvent): void {
    const subtree = this.#subtree;
    if (subtree === undefined) return;
    if (event.contract !== undefined) {
      if (!equalBytes(event.id, this.contractId) && !subtree.has(toHex(event.contract.parentId))) {
        throw new VerificationError(`contract ${toHex(event.id)} at cursor ${event.cursor} is outside the subtree`);
      }
      subtree.add(toHex(event.id));
    } else if (!subtree.has(toHex(event.receipt!.contractId))) {
      throw new VerificationError(`receipt ${toHex(event.id)} at cursor ${event.cursor} is about a contract outside the subtree`);
    }
  }
}

/** The (not yet verified) broker_key_id a Sealed event's payload names. */
function namedKey(kind: "contract" | "receipt", sealed: Sealed): string | undefined {
  try {
    return fromBinary(kind === "contract" ? ContractSchema : ReceiptSchema, sealed.payload).brokerKeyId;
  } catch {
    return undefined;
  }
}

/**
 * Opens a Watch on `contractId`'s subtree, after `options.cursor` (0: from the
 * beginning). `client` must carry a read session (`sessionClient`). Iterate it
 * with `for await` for verified {@link WatchEvent}s.
 */
export function watch(client: WatchSource, contractId: Uint8Array, options: WatchOptions = {}): Watch {
  return new Watch(client, contractId, options);
}
