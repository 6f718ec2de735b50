/**
 * Test support: runs the real broker binary ($BROKER_BIN) and drives it
 * through the package as a user would install it (imported by its name, so
 * from dist/). Everything broker-signed that comes back is verified offline
 * on arrival.
 */

import { spawn, type ChildProcess } from "node:child_process";
import { createHash, randomBytes } from "node:crypto";
import { createWriteStream, existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync, type WriteStream } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";
import assert from "node:assert/strict";

import { create, toBinary } from "@bufbuild/protobuf";
import { Code, type Transport } from "@connectrpc/connect";
import {
  Agent,
  BrokerError,
  BrokerKeys,
  createBrokerClient,
  equalBytes,
  lineageHash,
  nowMs,
  pae,
  pb,
  sessionClient,
  sha256,
  toHex,
  verifyChain,
  verifyContract,
  verifyEverySignature,
  verifyReceipt,
  type BrokerClient,
  type Verified,
  type VerifiedContract,
} from "@delegation-broker/client";
import { createNodeTransport } from "@delegation-broker/client/node";

/** clients/typescript */
export const CLIENT_ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
/** The repository. */
export const REPO_ROOT = path.resolve(CLIENT_ROOT, "../..");
export const HOUR_MS = 3_600_000n;
export const INTENT = "Fix the token refresh bug in src/auth/ and document it";
export const ESCALATION = "broker://escalate";

/** $BROKER_BIN (relative paths from the repo root), else the debug build. */
export function brokerBin(): string {
  const configured = process.env.BROKER_BIN || "target/debug/delegation-broker";
  const bin = path.isAbsolute(configured) ? configured : path.join(REPO_ROOT, configured);
  if (!existsSync(bin)) {
    throw new Error(`broker binary not found at ${bin}: build it (cargo build --bin delegation-broker) or set BROKER_BIN`);
  }
  return bin;
}

/** A fresh temporary directory, removed by the caller (or left for inspection on failure). */
export function tempDir(prefix: string): string {
  return mkdtempSync(path.join(tmpdir(), `broker-ts-${prefix}-`));
}

function hexKeys(agents: Agent[]): string {
  return agents.map((a) => `"${toHex(a.publicKey)}"`).join(", ");
}

/** How long after its start a broker is given before a SIGTERM (see BrokerProcess.stop). */
const SIGNAL_HANDLER_GRACE_MS = 1_000;

/** The `[tokens]` table: the token endpoint's settings (it is served, on `--tokens 127.0.0.1:0`, when given). */
export interface TokensOptions {
  /** The audiences tokens may be minted for. */
  resources: string[];
  lifetimeMinutes?: number;
  issuer?: string;
  /** Resource servers that may introspect: client id → its secret (the config holds its SHA-256). */
  introspectors?: Record<string, string>;
}

export interface BrokerProcessOptions {
  attestors?: Agent[];
  readers?: Agent[];
  /** Identity patterns whose bound keys read every tree (`[readers] identities`). */
  readerIdentities?: string[];
  limits?: Record<string, number>;
  env?: Record<string, string>;
  /** Serve the token endpoint (`--tokens`) with this `[tokens]` table. */
  tokens?: TokensOptions;
  /** More TOML, appended to the config (e.g. a [tls] table). */
  extraConfig?: string;
}

/** The `[tokens]` TOML (strings as JSON strings: valid TOML basic strings for what tests use). */
function tokensToml(tokens: TokensOptions): string {
  const q = (text: string) => JSON.stringify(text);
  let text = `\n[tokens]\nresources = [${tokens.resources.map(q).join(", ")}]\n`;
  if (tokens.lifetimeMinutes !== undefined) text += `lifetime_minutes = ${tokens.lifetimeMinutes}\n`;
  if (tokens.issuer !== undefined) text += `issuer = ${q(tokens.issuer)}\n`;
  text += "\n[tokens.introspectors]\n";
  for (const [id, secret] of Object.entries(tokens.introspectors ?? {})) {
    text += `${q(id)} = ${q(createHash("sha256").update(secret, "utf8").digest("hex"))}\n`;
  }
  return text;
}

/**
 * `delegation-broker serve` on 127.0.0.1:0 (or a given address) with a data
 * directory of its own and a config trusting `attestors` and letting
 * `readers` read every tree; stderr goes to `broker.log` in its directory.
 * With `tokens`, the token endpoint too (`--tokens 127.0.0.1:0`), at
 * {@link tokensUrl}.
 */
export class BrokerProcess {
  readonly workdir: string;
  readonly configPath: string;
  address = "";
  /** The token endpoint's URL as `serve` prints it ("tokens on URL"); "" without `tokens`. */
  tokensUrl = "";
  readonly #tokens: boolean;
  #child: ChildProcess | undefined;
  #startedAt = 0;
  #log: WriteStream | undefined;
  readonly #env: Record<string, string>;

  private constructor(workdir: string, options: BrokerProcessOptions) {
    this.workdir = workdir;
    mkdirSync(workdir, { recursive: true });
    this.configPath = path.join(workdir, "broker.toml");
    let text = `[trust]\nattestors = [${hexKeys(options.attestors ?? [])}]\n\n[readers]\nkeys = [${hexKeys(options.readers ?? [])}]\n`;
    if (options.readerIdentities !== undefined) {
      text += `identities = [${options.readerIdentities.map((pattern) => JSON.stringify(pattern)).join(", ")}]\n`;
    }
    if (options.limits !== undefined) {
      text += "\n[limits]\n" + Object.entries(options.limits).map(([k, v]) => `${k} = ${v}\n`).join("");
    }
    if (options.tokens !== undefined) text += tokensToml(options.tokens);
    writeFileSync(this.configPath, text + (options.extraConfig ?? ""));
    this.#env = options.env ?? {};
    this.#tokens = options.tokens !== undefined;
  }

  static async start(workdir: string, options: BrokerProcessOptions = {}): Promise<BrokerProcess> {
    const broker = new BrokerProcess(workdir, options);
    await broker.#spawn("127.0.0.1:0");
    return broker;
  }

  get logPath(): string {
    return path.join(this.workdir, "broker.log");
  }

  async #spawn(listen: string): Promise<void> {
    this.#log = createWriteStream(this.logPath, { flags: "a" });
    const args = ["serve", "--listen", listen, "--data-dir", path.join(this.workdir, "data"), "--config", this.configPath];
    // A restart keeps the token endpoint's address too (its URL is the tokens' issuer).
    if (this.#tokens) args.push("--tokens", this.tokensUrl === "" ? "127.0.0.1:0" : new URL(this.tokensUrl).host);
    const child = spawn(brokerBin(), args, {
      stdio: ["ignore", "pipe", "pipe"],
      env: { ...process.env, BROKER_LOG: process.env.BROKER_LOG ?? "warn", ...this.#env },
    });
    this.#child = child;
    this.#startedAt = Date.now();
    child.stderr!.pipe(this.#log);
    // Once serving, the broker prints "listening on ADDR", then "tokens on URL" with --tokens.
    const wanted = this.#tokens ? 2 : 1;
    const announced: string[] = [];
    const lines = createInterface({ input: child.stdout! });
    await new Promise<void>((resolve) => {
      const timer = setTimeout(resolve, 30_000);
      const done = () => {
        clearTimeout(timer);
        resolve();
      };
      // Read every line to the end, so the broker never blocks on (or dies of) a full or closed stdout.
      lines.on("line", (line) => {
        if (announced.length < wanted) announced.push(line.trim());
        if (announced.length === wanted) done();
      });
      child.once("exit", done);
    });
    const [first = "", second = ""] = announced;
    const prefix = "listening on ";
    const tokensPrefix = "tokens on ";
    if (!first.startsWith(prefix) || (this.#tokens && !second.startsWith(tokensPrefix))) {
      await this.stop();
      throw new Error(`broker did not start (lines ${JSON.stringify(announced)}); log:\n${readFileSync(this.logPath, "utf8")}`);
    }
    this.address = first.slice(prefix.length);
    if (this.#tokens) this.tokensUrl = second.slice(tokensPrefix.length);
  }

  /** SIGTERM (graceful drain), then SIGKILL if it lingers; the exit code (or the signal's name). */
  async stop(timeoutMs = 15_000): Promise<number | string> {
    const child = this.#child;
    if (child === undefined) return 0;
    this.#child = undefined;
    // The broker installs its SIGTERM handler lazily, some time after it
    // prints its address (and even after it first answers): a SIGTERM in
    // between kills it without draining. Give it that time.
    const age = Date.now() - this.#startedAt;
    if (age < SIGNAL_HANDLER_GRACE_MS) await new Promise((resolve) => setTimeout(resolve, SIGNAL_HANDLER_GRACE_MS - age));
    const exited = new Promise<number | string>((resolve) => {
      if (child.exitCode !== null || child.signalCode !== null) resolve(child.exitCode ?? child.signalCode!);
      else child.once("exit", (code, signal) => resolve(code ?? signal ?? -1));
    });
    child.kill("SIGTERM");
    const timer = setTimeout(() => child.kill("SIGKILL"), timeoutMs);
    const code = await exited;
    clearTimeout(timer);
    await new Promise<void>((resolve) => this.#log!.end(resolve));
    return code;
  }

  /** Stops the broker and starts it again on the same address and data directory (same key, same state). */
  async restart(pauseMs = 0): Promise<void> {
    const code = await this.stop();
    assert.equal(code, 0, "the broker drains and exits 0 on SIGTERM");
    if (pauseMs > 0) await new Promise((resolve) => setTimeout(resolve, pauseMs));
    await this.#spawn(this.address);
  }
}

export interface Root {
  id: Uint8Array;
  lineage: Uint8Array;
  contract: pb.Contract;
}

export interface Outcome {
  response: pb.DelegateResponse;
  issued?: VerifiedContract;
  refused?: Verified<pb.Receipt>;
}

export function issuedOf(outcome: Outcome): VerifiedContract {
  assert.ok(outcome.issued, `expected an issued contract, got a refusal ${JSON.stringify(outcome.refused?.message.violations.map((v) => v.detail))}`);
  return outcome.issued;
}

export function refusalOf(outcome: Outcome): pb.Receipt {
  assert.ok(outcome.refused, "expected a refusal, the child was issued");
  return outcome.refused.message;
}

export interface OpenRootOptions {
  budget?: bigint;
  maxDepth?: number;
  minTrust?: number;
  maxChildren?: number;
  predicate?: string;
  deadlineMs?: bigint;
  scope?: string[];
  intent?: string;
  retryHeadroom?: boolean;
  labels?: Record<string, string>;
}

/**
 * A running broker plus clients, its published keys, a trusted attestor and
 * a configured reader. `client` carries the reader's session (it reads every
 * tree); `bare` carries none.
 */
export class Broker {
  readonly attestor: Agent;
  readonly reader: Agent;
  readonly process: BrokerProcess;
  readonly transport: Transport;
  readonly bare: BrokerClient;
  readonly client: BrokerClient;
  readonly keys: BrokerKeys;
  /** Everything broker-signed received. */
  readonly received: { sealed: pb.Sealed; kind: "contract" | "receipt" }[] = [];

  private constructor(process: BrokerProcess, attestor: Agent, reader: Agent, transport: Transport, client: BrokerClient, keys: BrokerKeys) {
    this.process = process;
    this.attestor = attestor;
    this.reader = reader;
    this.transport = transport;
    this.bare = createBrokerClient(transport);
    this.client = client;
    this.keys = keys;
  }

  static async start(
    name: string,
    options: {
      limits?: Record<string, number>;
      attestor?: Agent;
      tokens?: TokensOptions;
      readerIdentities?: string[];
      extraConfig?: string;
    } = {},
  ): Promise<Broker> {
    const attestor = options.attestor ?? Agent.generate();
    const reader = Agent.generate();
    const process = await BrokerProcess.start(tempDir(name), {
      attestors: [attestor],
      readers: [reader],
      limits: options.limits,
      tokens: options.tokens,
      readerIdentities: options.readerIdentities,
      extraConfig: options.extraConfig,
    });
    const transport = createNodeTransport(process.address);
    const client = await sessionClient(transport, reader);
    const keys = await BrokerKeys.fetch(client);
    return new Broker(process, attestor, reader, transport, client, keys);
  }

  /** Stops the broker (it must exit 0 on SIGTERM) and removes its directory. */
  async close(): Promise<void> {
    const code = await this.process.stop();
    assert.equal(code, 0, `broker exited with ${code} on SIGTERM; log:\n${readFileSync(this.process.logPath, "utf8")}`);
    rmSync(this.process.workdir, { recursive: true, force: true });
  }

  /** A client on the same transport whose reads are `agent`'s (session opened now). */
  clientFor(agent: Agent): Promise<BrokerClient> {
    return sessionClient(this.transport, agent);
  }

  // --- requests -------------------------------------------------------------------

  async openRoot(orchestrator: Agent, options: OpenRootOptions = {}): Promise<Root> {
    const intent = options.intent ?? INTENT;
    const request = orchestrator.openRoot({
      intent,
      budget: options.budget ?? 100n,
      deadlineMs: options.deadlineMs ?? nowMs() + HOUR_MS,
      policy: {
        maxDepth: options.maxDepth ?? 4,
        minCumulativeTrustPpm: options.minTrust ?? 0,
        maxChildren: options.maxChildren ?? 64,
        disableRetryHeadroom: options.retryHeadroom === false,
      },
      predicate: options.predicate ?? "",
      writeScope: options.scope ?? ["src", "docs"],
      labels: options.labels ?? {},
    });
    const response = await this.client.openRoot(request, { timeoutMs: 10_000 });
    const issued = this.checkIssued(response.issued!);
    assert.equal(issued.contract.depth, 0);
    assert.ok(equalBytes(issued.contract.delegatePublicKey, orchestrator.publicKey));
    assert.ok(equalBytes(issued.contract.intentLineageHash, lineageHash(intent)));
    return { id: issued.contractId, lineage: issued.contract.intentLineageHash, contract: issued.contract };
  }

  async delegate(holder: Agent, body: DelegateInit): Promise<Outcome> {
    return this.checkOutcome(await this.client.delegate(holder.delegate(body), { timeoutMs: 10_000 }));
  }

  // --- verification of everything received ----------------------------------------

  checkIssued(issued: pb.IssuedContract): VerifiedContract {
    const verified = verifyContract(issued.contract!, this.keys, issued.contractId);
    this.received.push({ sealed: issued.contract!, kind: "contract" });
    return verified;
  }

  async checkRefusal(refusal: pb.Refusal): Promise<Verified<pb.Receipt>> {
    const verified = verifyReceipt(refusal.receipt!, this.keys, refusal.receiptId);
    assert.equal(verified.message.kind, pb.ReceiptKind.REFUSED);
    const again = (await this.client.getReceipt({ receiptId: refusal.receiptId }, { timeoutMs: 10_000 })).receipt!;
    assert.ok(equalBytes(toBinary(pb.SealedSchema, again), toBinary(pb.SealedSchema, refusal.receipt!)), "GetReceipt returns the receipt as issued");
    this.received.push({ sealed: refusal.receipt!, kind: "receipt" });
    return verified;
  }

  async checkOutcome(response: pb.DelegateResponse): Promise<Outcome> {
    switch (response.outcome.case) {
      case "issued":
        return { response, issued: this.checkIssued(response.outcome.value) };
      case "refused":
        return { response, refused: await this.checkRefusal(response.outcome.value) };
      default:
        assert.fail("a DelegateResponse with no outcome");
    }
  }

  /** Any lifecycle response: its receipt verifies and is what GetReceipt returns. */
  async checkReceipt(response: { receiptId: Uint8Array; receipt?: pb.Sealed }, kind?: pb.ReceiptKind): Promise<pb.Receipt> {
    const receipt = verifyReceipt(response.receipt!, this.keys, response.receiptId).message;
    if (kind !== undefined) assert.equal(receipt.kind, kind);
    this.received.push({ sealed: response.receipt!, kind: "receipt" });
    return receipt;
  }

  // --- reads ----------------------------------------------------------------------

  async state(contractId: Uint8Array): Promise<pb.ContractState> {
    return (await this.client.getContract({ contractId }, { timeoutMs: 10_000 })).contract!;
  }

  async ledger(contractId: Uint8Array): Promise<pb.Ledger> {
    const ledger = (await this.state(contractId)).ledger!;
    assert.equal(ledger.budget, ledger.residual + ledger.reserved + ledger.spent);
    return ledger;
  }

  /** GetChain, verified (every signature too); the broker's effective predicates must be the derived ones. */
  async chain(contractId: Uint8Array): Promise<VerifiedContract[]> {
    const states = (await this.client.getChain({ contractId }, { timeoutMs: 10_000 })).chain;
    const verified = verifyChain(states, this.keys, contractId);
    verifyEverySignature(states, this.keys);
    verified.forEach((hop, i) => {
      assert.ok(equalBytes(hop.contractId, states[i]!.contractId));
      assert.equal(hop.effectivePredicate, states[i]!.effectivePredicate, `depth ${hop.contract.depth}`);
    });
    return verified;
  }

  attest(agent: Agent, factor: number): pb.Envelope {
    return this.attestor.attest(agent.publicKey, factor, nowMs() + HOUR_MS, "test");
  }
}

export type DelegateInit = Parameters<Agent["delegate"]>[0];

/** A Delegate body (no header: the signer adds one), liability PRINCIPAL, nothing else asked of it. */
export function child(parent: Uint8Array, lineage: Uint8Array, delegate: Agent, budget: bigint, fields: Partial<pb.DelegateBody> = {}): DelegateInit {
  return {
    parentId: parent,
    intentLineageHash: lineage,
    task: "work on src/auth/token.rs",
    delegatePublicKey: delegate.publicKey,
    budget,
    liability: pb.Liability.PRINCIPAL,
    writeScope: ["src"],
    ...fields,
  } as DelegateInit;
}

/** The same with liability DELEGATE, an escalation channel and `predicate`. */
export function liableChild(
  parent: Uint8Array,
  lineage: Uint8Array,
  delegate: Agent,
  budget: bigint,
  predicate: string,
  fields: Partial<pb.DelegateBody> = {},
): DelegateInit {
  return child(parent, lineage, delegate, budget, { liability: pb.Liability.DELEGATE, predicate, escalationChannel: ESCALATION, ...fields });
}

export function codes(receipt: pb.Receipt): pb.InvariantCode[] {
  return receipt.violations.map((v) => v.code);
}

/** SHA-256 of PAE(payload_type, payload) of a signed request: what the broker records as request_digest. */
export function requestDigest(request: { signed?: pb.Envelope }): Uint8Array {
  return sha256(pae(request.signed!.payloadType, request.signed!.payload));
}

// --- refusals --------------------------------------------------------------------------

/** A refused call's answer: code, `ErrorInfo` reason and metadata, message. */
export type Answer = [Code, string | undefined, Record<string, string>, string];

/**
 * Runs `call`, which must fail; its answer, each of `ids` (lowercase hex)
 * written `<id>` in the metadata and the message, so answers about different
 * ids compare.
 */
export async function refusal(call: () => Promise<unknown>, ...ids: Uint8Array[]): Promise<Answer> {
  const masked = (text: string) => ids.reduce((t, id) => t.replaceAll(toHex(id), "<id>"), text);
  try {
    await call();
  } catch (caught) {
    const error = BrokerError.from(caught);
    const info = Object.fromEntries(Object.entries(error.info).map(([k, v]) => [k, masked(v)]));
    return [error.code, error.reason, info, masked(error.rawMessage)];
  }
  assert.fail("expected a refusal, the call was answered");
}

/**
 * `call(id)` is made by a stranger to `realId`'s tree (no party of it, nor a
 * configured reader): its answer for `realId` must be its answer for a random
 * 32-byte id (code, reason, metadata and message, the id aside), and that is
 * NOT_FOUND, so the stranger cannot tell that `realId` exists. Returns it.
 */
export async function assertUnknowable(call: (id: Uint8Array) => Promise<unknown>, realId: Uint8Array, what = ""): Promise<Answer> {
  const randomId = new Uint8Array(randomBytes(32));
  const real = await refusal(() => call(realId), realId);
  assert.deepEqual(real, await refusal(() => call(randomId), randomId), `${what}: a real id answered unlike a random one`);
  assert.deepEqual(real.slice(0, 2), [Code.NotFound, "NOT_FOUND"], what);
  return real;
}

// --- the Rust verifier ----------------------------------------------------------------

/** `format!("{:?}", text)` in Rust, for the printable text predicates hold. */
export function rustDebug(text: string): string {
  const escapes: Record<string, string> = { "\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t", "\0": "\\0" };
  let out = '"';
  for (const ch of text) {
    const cp = ch.codePointAt(0)!;
    out += escapes[ch] ?? (cp < 0x20 || cp === 0x7f ? `\\u{${cp.toString(16)}}` : ch);
  }
  return out + '"';
}

/** What `delegation-broker verify --chain` prints for a chain TypeScript verified. */
export function rustChainLines(verified: VerifiedContract[], allSignatures = false): string[] {
  const lines = verified.map((v) => {
    const c = v.contract;
    const delegate = c.delegatePublicKey.length === 32 ? keyIdOf(c.delegatePublicKey) : keyIdOf(new Uint8Array(32));
    return (
      `depth=${c.depth} id=${toHex(v.contractId)} delegate=${delegate} budget=${c.budget} deadline_ms=${c.deadlineMs} ` +
      `trust_ppm=${c.cumulativeTrustPpm} liability=LIABILITY_${pb.Liability[c.liability]} effective_predicate=${rustDebug(v.effectivePredicate!)}`
    );
  });
  return [...lines, `ok chain of ${verified.length} contracts${allSignatures ? ", every signature checked" : ""}`];
}

function keyIdOf(publicKey: Uint8Array): string {
  return "ed25519:" + toHex(sha256(publicKey).subarray(0, 16));
}

/** The ContractStates of Sealed contracts (ids computed), for the Rust CLI. */
export function asStates(chain: (pb.ContractState | pb.Sealed)[]): pb.ContractState[] {
  return chain.map((item) =>
    item.$typeName === "delegation.broker.v1.ContractState"
      ? (item as pb.ContractState)
      : create(pb.ContractStateSchema, { contractId: sha256((item as pb.Sealed).payload), contract: item as pb.Sealed }),
  );
}
