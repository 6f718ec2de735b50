/**
 * One root's live tree: the model fed by Watch (resumed from its last cursor
 * whenever the stream drops), the view, and the reads that complete it —
 * ledgers (debounced, only for contracts on screen, a parent's children in
 * one ListChildren when many moved), chains verified in the browser
 * (GetChain + the client's verifyChain against GetBrokerKeys), audits
 * (GetAudit, one at a time).
 */

import { Code } from "@connectrpc/connect";

import { equalBytes, fromHex, toHex } from "../../clients/typescript/src/bytes.js";
import { BrokerError, codeName } from "../../clients/typescript/src/errors.js";
import { ContractStatus, type ContractState } from "../../clients/typescript/src/pb.js";
import { BrokerKeys, VerificationError, verifyChain, verifyContract } from "../../clients/typescript/src/verify.js";
import { watch, type Watch } from "../../clients/typescript/src/watch.js";
import { isTokenRefusal, type ConsoleApi } from "./api.js";
import { h, replace, sleep, yieldToBrowser } from "./dom.js";
import { dateTime, enumName, short, units } from "./format.js";
import { TreeModel, type TreeNode } from "./model.js";
import { TreeView, delegateTag, labelChips, ledgerBar } from "./tree.js";

/** Ledger reads wait this long after the last event that moved one, and at most MAX after the first. */
const LEDGER_DEBOUNCE_MS = 200;
const LEDGER_MAX_WAIT_MS = 1_000;
/** A parent with at least this many stale children on screen is read with ListChildren. */
const LIST_CHILDREN_FROM = 8;
/** Reads and verifications in flight (a browser opens at most six HTTP/1.1 connections to the console, one held by Watch). */
const READ_CONCURRENCY = 2;
const VERIFY_CONCURRENCY = 2;
/** A tab hidden this long closes its Watch stream until it is shown again. */
const PAUSE_HIDDEN_AFTER_MS = 30_000;
/** While catching up, the browser gets a frame after this much work on events (verifying them is not free). */
const WORK_PER_YIELD_MS = 40;

/** Runs `tasks` with at most `limit` at once. */
async function pool(tasks: (() => Promise<void>)[], limit: number): Promise<void> {
  let next = 0;
  const worker = async () => {
    while (next < tasks.length) {
      const task = tasks[next++]!;
      await task();
    }
  };
  await Promise.all(Array.from({ length: Math.min(limit, tasks.length) }, worker));
}

function transient(error: BrokerError): boolean {
  return [Code.Unavailable, Code.DeadlineExceeded, Code.ResourceExhausted, Code.Unknown, Code.Aborted, Code.Internal].includes(error.code);
}

export class TreeController {
  readonly el: HTMLElement;
  readonly rootId: string;
  readonly model: TreeModel;
  readonly view: TreeView;
  readonly #api: ConsoleApi;
  readonly #header = h("div", { class: "tree-header", "data-testid": "tree-header" });
  readonly #live = h("div", { class: "live", "data-testid": "live", "data-state": "connecting" }, "connecting…");
  #closed = false;
  #watch: Watch | undefined;
  #paused = false;
  #pauseTimer: ReturnType<typeof setTimeout> | undefined;
  #unpause: () => void = () => {};
  #liveState = "connecting";
  #liveDetail = "";
  #countsFrame = 0;
  #tick: ReturnType<typeof setInterval> | undefined;
  // ledgers
  readonly #staleLedgers = new Set<TreeNode>();
  #ledgerTimer: ReturnType<typeof setTimeout> | undefined;
  #ledgerFirstStale = 0;
  #ledgerRunning = false;
  #ledgerAgain = false;
  // verification
  readonly #verifyQueue: TreeNode[] = [];
  #verifying = 0;
  // audits
  readonly #auditWanted = new Set<TreeNode>();
  #auditTimer: ReturnType<typeof setTimeout> | undefined;

  /** Called when the root's status or ledger changes (the roots list shows them too). */
  onRootChanged: (root: TreeNode) => void = () => {};

  constructor(api: ConsoleApi, rootId: string) {
    this.#api = api;
    this.rootId = rootId;
    this.model = new TreeModel(rootId, {
      added: (node) => {
        this.view.added(node);
        this.#countsSoon();
      },
      changed: (node) => {
        this.view.changed(node);
        if (node === this.model.root) this.#countsSoon();
      },
      ledgerMoved: (node) => this.#ledgerStale(node),
      auditMoved: (node) => this.#wantAudit(node),
    });
    this.view = new TreeView(this.model, {
      names: () => this.#api.names,
      shown: (node) => {
        this.#enqueueVerify(node);
        if (node.ledgerReadVersion < node.ledgerVersion) this.#ledgerStale(node);
        this.#wantAudit(node);
      },
      expanded: () => this.#scheduleLedgers(),
      detailsOpened: (node) => this.#wantAudit(node, true),
    });
    this.el = h("section", { class: "tree-pane-inner", "data-testid": "tree-pane", "data-root-id": rootId }, this.#header, this.#live, this.view.el);
  }

  /** Reads the root, draws it and starts watching its tree. */
  async start(): Promise<void> {
    const client = this.#api.client;
    replace(this.#header, h("p", { class: "dim" }, `loading root ${short(this.rootId)}…`));
    let state: ContractState;
    try {
      state = (await client.getContract({ contractId: fromHex(this.rootId) })).contract!;
    } catch (caught) {
      const error = BrokerError.from(caught);
      replace(
        this.#header,
        h(
          "p",
          { class: "error", "data-testid": "tree-error" },
          error.code === Code.NotFound ? `no root ${this.rootId} that this console may read` : `cannot read the root: ${codeName(error.code)} ${error.rawMessage}`,
        ),
      );
      this.#setLive("stopped", "");
      return;
    }
    if (this.#closed) return;
    const root = verifyContract(state.contract!, this.#keys(), state.contractId);
    if (root.contract.depth !== 0) {
      replace(this.#header, h("p", { class: "error" }, `${this.rootId} is not a root`));
      return;
    }
    const node = this.model.addContract(root.contractId, state.contract!, root.contract);
    this.model.applyState(state, node.ledgerVersion);
    this.#drawHeader();
    this.#tick = setInterval(() => this.view.refreshAll(), 30_000);
    document.addEventListener("visibilitychange", this.#onVisibility);
    void this.#watchLoop();
  }

  close(): void {
    this.#closed = true;
    document.removeEventListener("visibilitychange", this.#onVisibility);
    clearTimeout(this.#pauseTimer);
    this.#unpause();
    this.#watch?.cancel();
    this.view.destroy();
    clearTimeout(this.#ledgerTimer);
    clearTimeout(this.#auditTimer);
    clearInterval(this.#tick);
    cancelAnimationFrame(this.#countsFrame);
  }

  /**
   * A hidden tab lets go of its stream after a while and picks it up again,
   * from the last cursor, when shown: the console listener speaks HTTP/1.1,
   * and a browser opens at most six connections to it, for all its tabs.
   */
  #onVisibility = (): void => {
    clearTimeout(this.#pauseTimer);
    if (document.visibilityState === "hidden") {
      this.#pauseTimer = setTimeout(() => {
        this.#paused = true;
        this.#watch?.cancel();
      }, PAUSE_HIDDEN_AFTER_MS);
    } else if (this.#paused) {
      this.#paused = false;
      this.#unpause();
    }
  };

  #keys(): BrokerKeys {
    if (this.#api.keys === undefined) throw new Error("broker keys not loaded");
    return this.#api.keys;
  }

  // --- Watch ----------------------------------------------------------------------------

  async #watchLoop(): Promise<void> {
    let w = watch(this.#api.client, fromHex(this.rootId), { keys: this.#keys() });
    this.#watch = w;
    let backoff = 500;
    while (!this.#closed) {
      try {
        this.#setLive("live", "");
        let since = performance.now();
        for await (const event of w) {
          this.model.apply(event);
          backoff = 500;
          this.#countsSoon();
          if (performance.now() - since > WORK_PER_YIELD_MS) {
            await yieldToBrowser();
            since = performance.now();
          }
        }
        if (this.#closed) return;
        if (!this.#paused) this.#setLive("reconnecting", "the stream ended (broker restarting?)");
      } catch (caught) {
        if (this.#closed) return;
        if (caught instanceof VerificationError) {
          this.#setLive("error", `an event did not verify, watch stopped: ${caught.message}`);
          return;
        }
        if (isTokenRefusal(caught)) {
          this.#setLive("stopped", "the access token was refused");
          return;
        }
        const error = BrokerError.from(caught);
        if (error.code === Code.Unauthenticated) await this.#api.renew().catch(() => undefined);
        this.#setLive("reconnecting", `${codeName(error.code)}: ${error.rawMessage}`);
      }
      if (this.#paused) {
        this.#setLive("paused", "the tab is hidden; it resumes from the last event when shown");
        await new Promise<void>((resolve) => (this.#unpause = resolve));
        backoff = 500;
      } else {
        await sleep(backoff);
        backoff = Math.min(backoff * 2, 10_000);
      }
      if (this.#closed) return;
      if (this.#api.keys !== w.keys && w.keys !== undefined) this.#api.keys = w.keys; // refetched after a rotation
      w = w.resume(); // right after the last cursor seen: nothing missed, nothing twice
      this.#watch = w;
    }
  }

  #setLive(state: string, detail: string): void {
    this.#liveState = state;
    this.#liveDetail = detail;
    this.#drawCounts();
  }

  #countsSoon(): void {
    if (this.#countsFrame !== 0) return;
    this.#countsFrame = requestAnimationFrame(() => {
      this.#countsFrame = 0;
      this.#drawCounts();
      this.#drawHeader();
      if (this.model.root !== undefined) this.onRootChanged(this.model.root);
    });
  }

  #drawCounts(): void {
    const m = this.model;
    this.#live.dataset.state = this.#liveState;
    this.#live.dataset.contracts = String(m.size);
    this.#live.dataset.cursor = String(m.cursor);
    const dot = this.#liveState === "live" ? "●" : this.#liveState === "reconnecting" ? "◌" : "■";
    replace(
      this.#live,
      h("span", { class: `dot ${this.#liveState}` }, dot),
      ` ${this.#liveState === "live" ? "live" : this.#liveState}`,
      ` · ${m.size} contracts · ${m.refusalCount} refusals · cursor ${m.cursor}`,
      this.#liveDetail !== "" ? h("span", { class: "dim" }, ` — ${this.#liveDetail}`) : null,
    );
  }

  #drawHeader(): void {
    const root = this.model.root;
    if (root === undefined) return;
    const c = root.contract;
    replace(
      this.#header,
      h(
        "div",
        { class: "root-title" },
        h("span", { class: `badge status status-${enumName(ContractStatus, root.status)}` }, enumName(ContractStatus, root.status)),
        h("h2", { "data-testid": "root-intent" }, c.intent),
      ),
      h(
        "div",
        { class: "root-meta" },
        h("span", { class: "mono", title: root.id }, `root ${short(root.id, 16)}`),
        " · opened by ",
        delegateTag(c, this.#api.names, {}, "who"),
        ` at ${dateTime(c.issuedAtMs)} · budget ${units(c.budget)}`,
        c.policy !== undefined ? ` · max depth ${c.policy.maxDepth}, max children ${c.policy.maxChildren}` : "",
        " · ",
        labelChips(c.labels),
      ),
      h("div", { class: "root-ledger" }, ledgerBar(root.ledger, false)),
    );
  }

  // --- ledgers --------------------------------------------------------------------------

  #ledgerStale(node: TreeNode): void {
    this.#staleLedgers.add(node);
    if (this.view.isShown(node)) this.#scheduleLedgers();
  }

  #scheduleLedgers(): void {
    if (this.#closed) return;
    const now = Date.now();
    if (this.#ledgerTimer === undefined) this.#ledgerFirstStale = now;
    clearTimeout(this.#ledgerTimer);
    const wait = Math.max(0, Math.min(LEDGER_DEBOUNCE_MS, this.#ledgerFirstStale + LEDGER_MAX_WAIT_MS - now));
    this.#ledgerTimer = setTimeout(() => {
      this.#ledgerTimer = undefined;
      void this.#readLedgers();
    }, wait);
  }

  async #readLedgers(): Promise<void> {
    if (this.#ledgerRunning) {
      this.#ledgerAgain = true;
      return;
    }
    this.#ledgerRunning = true;
    try {
      const due: TreeNode[] = [];
      for (const node of this.#staleLedgers) {
        if (node.ledgerReadVersion >= node.ledgerVersion) this.#staleLedgers.delete(node);
        else if (this.view.isShown(node)) due.push(node);
      }
      const byParent = new Map<TreeNode | undefined, TreeNode[]>();
      for (const node of due) {
        const list = byParent.get(node.parent) ?? [];
        list.push(node);
        byParent.set(node.parent, list);
      }
      const tasks: (() => Promise<void>)[] = [];
      for (const [parent, nodes] of byParent) {
        if (parent !== undefined && nodes.length >= LIST_CHILDREN_FROM) tasks.push(() => this.#readChildren(parent));
        else for (const node of nodes) tasks.push(() => this.#readOne(node));
      }
      await pool(tasks, READ_CONCURRENCY);
    } finally {
      this.#ledgerRunning = false;
    }
    if (this.#closed) return;
    const again = this.#ledgerAgain || [...this.#staleLedgers].some((n) => this.view.isShown(n) && n.ledgerReadVersion < n.ledgerVersion);
    this.#ledgerAgain = false;
    if (again) this.#scheduleLedgers();
  }

  async #readOne(node: TreeNode): Promise<void> {
    const version = node.ledgerVersion;
    try {
      const state = (await this.#api.client.getContract({ contractId: node.idBytes })).contract;
      if (state !== undefined) this.model.applyState(state, version);
    } catch (caught) {
      this.#readFailed(caught);
    }
  }

  async #readChildren(parent: TreeNode): Promise<void> {
    const versions = new Map(parent.children.map((child) => [child.id, child.ledgerVersion]));
    let pageToken: Uint8Array = new Uint8Array();
    try {
      for (let page = 0; page < 100; page++) {
        const response = await this.#api.client.listChildren({ contractId: parent.idBytes, pageSize: 1000, pageToken });
        for (const state of response.children) this.model.applyState(state, versions.get(toHex(state.contractId)) ?? 0);
        if (response.nextPageToken.length === 0 || this.#closed) break;
        pageToken = response.nextPageToken;
      }
    } catch (caught) {
      this.#readFailed(caught);
    }
  }

  #readFailed(caught: unknown): void {
    const error = BrokerError.from(caught);
    if (!transient(error) && error.code !== Code.Unauthenticated) console.warn("console: read failed", error);
    // The node stays stale: it is read again at the next event, or now after a pause.
    setTimeout(() => this.#scheduleLedgers(), 2_000);
  }

  // --- verification in the browser --------------------------------------------------------

  #enqueueVerify(node: TreeNode): void {
    if (node.verify !== "pending" || this.#verifyQueue.includes(node)) return;
    this.#verifyQueue.push(node);
    this.#pumpVerify();
  }

  #pumpVerify(): void {
    while (this.#verifying < VERIFY_CONCURRENCY && this.#verifyQueue.length > 0 && !this.#closed) {
      const node = this.#verifyQueue.shift()!;
      if (node.verify !== "pending" || !this.view.isShown(node)) continue; // enqueued again when shown
      this.#verifying++;
      node.verify = "running";
      this.view.changed(node);
      void this.#verify(node).finally(() => {
        this.#verifying--;
        this.#pumpVerify();
      });
    }
  }

  /**
   * GetChain, then types.proto's "Verifying a chain" in the browser (the
   * client's verifyChain: the leaf's signature under a published key, the
   * hash links, every hop's terms) — and the contracts shown must be the
   * very bytes verified.
   */
  async #verify(node: TreeNode): Promise<void> {
    const version = node.ledgerVersion;
    try {
      const states = (await this.#api.client.getChain({ contractId: node.idBytes })).chain;
      let verified;
      try {
        verified = verifyChain(states, this.#keys(), node.idBytes);
      } catch (error) {
        if (!(error instanceof VerificationError) || !/not a published broker key/.test(error.message)) throw error;
        this.#api.keys = await BrokerKeys.fetch(this.#api.client); // a key published since the page loaded
        verified = verifyChain(states, this.#keys(), node.idBytes);
      }
      verified.forEach((hop, i) => {
        const shown = this.model.nodes.get(toHex(hop.contractId));
        if (shown !== undefined && !equalBytes(shown.sealed.payload, hop.sealed.payload)) {
          throw new VerificationError("the contract shown is not the one verified", i);
        }
        const state = states[i]!;
        if (state.effectivePredicate !== hop.effectivePredicate) {
          throw new VerificationError("the broker's effective predicate differs from the one derived from the chain", i);
        }
      });
      const leaf = verified.at(-1)!;
      node.effectivePredicate = leaf.effectivePredicate;
      node.verify = "ok";
      node.verifyError = undefined;
      this.model.applyState(states.at(-1)!, version);
    } catch (caught) {
      if (caught instanceof VerificationError || caught instanceof TypeError) {
        node.verify = "failed";
        node.verifyError = caught.message;
      } else {
        // Not a verdict on the chain (the broker is away, a session renewing): try again later.
        node.verify = "pending";
        setTimeout(() => this.#enqueueVerify(node), 2_000);
      }
    }
    this.view.changed(node);
  }

  // --- audits ---------------------------------------------------------------------------

  #wantAudit(node: TreeNode, force = false): void {
    if (!this.view.isShown(node)) return;
    const wanted = force || node.completion !== undefined || node.detailsOpen || node.audit !== undefined;
    if (!wanted || (node.audit !== undefined && node.auditReadVersion >= node.auditVersion)) return;
    this.#auditWanted.add(node);
    clearTimeout(this.#auditTimer);
    this.#auditTimer = setTimeout(() => void this.#readAudits(), 300);
  }

  async #readAudits(): Promise<void> {
    const nodes = [...this.#auditWanted];
    this.#auditWanted.clear();
    for (const node of nodes) {
      if (this.#closed) return;
      if (!this.view.isShown(node)) continue;
      const version = node.auditVersion;
      try {
        const audit = (await this.#api.audit(() => this.#api.client.getAudit({ contractId: node.idBytes }))).audit;
        if (audit !== undefined) {
          node.audit = audit;
          node.auditReadVersion = version;
          this.view.changed(node);
        }
      } catch (caught) {
        const error = BrokerError.from(caught);
        if (transient(error)) setTimeout(() => this.#wantAudit(node, true), 2_000);
        else console.warn("console: GetAudit failed", error);
      }
    }
  }
}
