/**
 * The tree of one root, drawn incrementally: a contract gets DOM only when
 * its parent is expanded (the first levels are, deeper ones start
 * collapsed), at most a chunk of children at a time ("show more"), and
 * changes are applied once per animation frame to the rows they touch —
 * never a re-render of the whole tree. A tree of thousands of contracts
 * keeps the DOM as small as what is open.
 *
 * Stable hooks for tests and scripts: every contract is an
 * `li[data-testid=contract][data-contract-id=<hex>]` with `data-status`,
 * `data-depth`; inside it `[data-testid=ledger]` (data-budget, -spent,
 * -reserved, -residual), `[data-testid=verified][data-verified=ok|pending|
 * running|failed]`, `[data-testid=refusal]` (data-primary) with
 * `[data-testid=violation][data-code=…]` holding `[data-field=requested]`
 * and `[data-field=allowed]`, `[data-testid=completion][data-verdict=…]`
 * with `[data-testid=refused-criterion][data-criterion=…]`, and
 * `[data-testid=audit]` with `[data-flag=…][data-value=…]`. The row's
 * `[data-testid=delegate]` is the delegate's label (a name from
 * `[console.names]`, else its workload identity, else its short key), with
 * `data-identity` when the contract carries a `delegateIdentity`; the terms
 * show that identity as `[data-testid=delegate-identity]`.
 */

import { toHex } from "../../clients/typescript/src/bytes.js";
import {
  ContractStatus,
  InvariantCode,
  Liability,
  ReceiptKind,
  TrustSource,
  Verdict,
  type ContractAudit,
  type Ledger,
} from "../../clients/typescript/src/pb.js";
import { h, replace, type Child } from "./dom.js";
import { agentName, dateTime, delegateLabel, enumName, ppm, relative, safeText, short, units } from "./format.js";
import type { ReceiptEntry, TreeModel, TreeNode } from "./model.js";

/** Children drawn at once under an expanded contract; "show more" draws the next chunk. */
export const CHUNK = 50;
/** Depth-1 contracts start expanded only when the root has at most this many children. */
export const AUTO_EXPAND_SIBLINGS = 12;
/** Refusals shown beside a contract before "all N refusals". */
const REFUSALS_SHOWN = 3;

export interface TreeHooks {
  names(): Readonly<Record<string, string>>;
  /** `node` got DOM: it may need its chain verified, its ledger or audit read. */
  shown(node: TreeNode): void;
  /** `node` was expanded by the user: its children's states may be read in one go. */
  expanded(node: TreeNode): void;
  /** `node`'s terms were opened. */
  detailsOpened(node: TreeNode): void;
}

interface NodeView {
  readonly li: HTMLLIElement;
  readonly row: HTMLDivElement;
  readonly notes: HTMLDivElement;
  readonly details: HTMLDivElement;
  readonly children: HTMLUListElement;
  readonly more: HTMLDivElement;
  /** Children drawn so far, in order. */
  drawn: number;
}

const STATUS_OPEN = new Set([ContractStatus.OPEN, ContractStatus.ACCEPTED]);

export class TreeView {
  readonly el: HTMLElement;
  readonly #model: TreeModel;
  readonly #hooks: TreeHooks;
  readonly #views = new Map<TreeNode, NodeView>();
  readonly #dirty = new Set<TreeNode>();
  readonly #childrenDirty = new Set<TreeNode>();
  #frame = 0;
  #destroyed = false;

  constructor(model: TreeModel, hooks: TreeHooks) {
    this.#model = model;
    this.#hooks = hooks;
    this.el = h("ul", { class: "tree", "data-testid": "tree", role: "tree" });
  }

  /** Draws the root (once it is known). */
  mount(root: TreeNode): void {
    if (this.#views.has(root)) return;
    this.el.replaceChildren(this.#create(root));
  }

  destroy(): void {
    this.#destroyed = true;
    cancelAnimationFrame(this.#frame);
    this.#views.clear();
    this.el.replaceChildren();
  }

  isShown(node: TreeNode): boolean {
    return this.#views.has(node);
  }

  /** Every contract that has DOM now. */
  shownNodes(): IterableIterator<TreeNode> {
    return this.#views.keys();
  }

  // --- model events, applied at the next frame ------------------------------------------

  added(node: TreeNode): void {
    const parent = node.parent;
    if (parent === undefined) {
      this.mount(node);
      return;
    }
    if (this.#views.has(parent)) {
      this.#dirty.add(parent); // its toggle's count
      if (parent.expanded === true) this.#childrenDirty.add(parent);
      this.#schedule();
    }
  }

  changed(node: TreeNode): void {
    if (!this.#views.has(node)) return;
    this.#dirty.add(node);
    this.#schedule();
  }

  /** Redraws every shown row (deadlines are relative to now). */
  refreshAll(): void {
    for (const node of this.#views.keys()) this.#dirty.add(node);
    this.#schedule();
  }

  #schedule(): void {
    if (this.#frame !== 0 || this.#destroyed) return;
    const run = () => {
      this.#frame = 0;
      this.#flush();
    };
    // A hidden tab gets no frames: apply on a timer then, so the page is current when shown.
    this.#frame = document.visibilityState === "hidden" ? (setTimeout(run, 250) as unknown as number) : requestAnimationFrame(run);
  }

  #flush(): void {
    if (this.#destroyed) return;
    const parents = [...this.#childrenDirty];
    this.#childrenDirty.clear();
    for (const parent of parents) {
      const view = this.#views.get(parent);
      if (view === undefined || parent.expanded !== true) continue;
      if (parent.contract.depth === 0 && parent.children.length > AUTO_EXPAND_SIBLINGS) {
        // The root outgrew the auto-expansion rule (its children keep coming in): fold what the rule opened, not what the user did.
        for (let i = 0; i < view.drawn; i++) {
          const child = parent.children[i]!;
          if (child.autoExpanded && child.expanded === true) this.#toggle(child);
          child.autoExpanded = false;
        }
      }
      this.#drawChildren(parent, view);
    }
    const dirty = [...this.#dirty];
    this.#dirty.clear();
    for (const node of dirty) {
      const view = this.#views.get(node);
      if (view !== undefined) this.#draw(node, view);
    }
  }

  // --- drawing ------------------------------------------------------------------------

  #create(node: TreeNode): HTMLLIElement {
    if (node.expanded === undefined) {
      const depth = node.contract.depth;
      const siblings = node.parent?.children.length ?? 1;
      node.expanded = depth === 0 || (depth === 1 && siblings <= AUTO_EXPAND_SIBLINGS);
      node.autoExpanded = node.expanded;
    }
    const view: NodeView = {
      li: h("li", { class: "node", "data-testid": "contract", "data-contract-id": node.id, role: "treeitem" }),
      row: h("div", { class: "row" }),
      notes: h("div", { class: "notes" }),
      details: h("div", { class: "details", "data-testid": "details" }),
      children: h("ul", { class: "children", role: "group" }),
      more: h("div", { class: "more" }),
      drawn: 0,
    };
    view.li.append(view.row, view.details, view.notes, view.children, view.more);
    this.#views.set(node, view);
    this.#draw(node, view);
    if (node.expanded) this.#drawChildren(node, view);
    this.#hooks.shown(node);
    return view.li;
  }

  #forget(node: TreeNode): void {
    const view = this.#views.get(node);
    if (view === undefined) return;
    for (let i = 0; i < view.drawn; i++) this.#forget(node.children[i]!);
    this.#views.delete(node);
    this.#dirty.delete(node);
    this.#childrenDirty.delete(node);
  }

  #toggle(node: TreeNode): void {
    const view = this.#views.get(node);
    if (view === undefined) return;
    node.expanded = !node.expanded;
    node.autoExpanded = false;
    if (node.expanded) {
      this.#drawChildren(node, view);
      this.#hooks.expanded(node);
    } else {
      for (let i = 0; i < view.drawn; i++) this.#forget(node.children[i]!);
      view.children.replaceChildren();
      view.more.replaceChildren();
      view.drawn = 0;
      node.shownChildren = 0;
    }
    this.#draw(node, view);
  }

  #drawChildren(node: TreeNode, view: NodeView): void {
    node.shownChildren = Math.min(node.children.length, Math.max(node.shownChildren, CHUNK));
    const batch = document.createDocumentFragment();
    while (view.drawn < node.shownChildren) {
      batch.append(this.#create(node.children[view.drawn]!));
      view.drawn++;
    }
    view.children.append(batch);
    const hidden = node.children.length - view.drawn;
    if (hidden > 0) {
      replace(
        view.more,
        h(
          "button",
          {
            class: "link",
            "data-testid": "show-more",
            onclick: () => {
              node.shownChildren += CHUNK;
              this.#drawChildren(node, view);
            },
          },
          `show ${Math.min(CHUNK, hidden)} more of ${hidden} hidden children`,
        ),
      );
    } else {
      view.more.replaceChildren();
    }
  }

  #draw(node: TreeNode, view: NodeView): void {
    const names = this.#hooks.names();
    const c = node.contract;
    const status = enumName(ContractStatus, node.status);
    view.li.dataset.status = status;
    view.li.dataset.depth = String(c.depth);
    view.li.setAttribute("aria-expanded", String(node.expanded === true));

    const toggle: Child =
      node.children.length > 0
        ? h(
            "button",
            {
              class: "toggle",
              "data-testid": "toggle",
              "aria-label": node.expanded ? "collapse" : "expand",
              title: `${node.children.length} children`,
              onclick: () => this.#toggle(node),
            },
            `${node.expanded ? "▾" : "▸"} ${node.children.length}`,
          )
        : h("span", { class: "toggle leaf" }, "·");

    const deadline = Number(c.deadlineMs);
    const overdue = STATUS_OPEN.has(node.status) && deadline <= Date.now();
    replace(
      view.row,
      toggle,
      h("span", { class: "cid mono", title: `contract ${node.id}` }, short(node.id)),
      delegateTag(c, names, { "data-testid": "delegate" }),
      h("span", { class: `badge status status-${status}`, "data-testid": "status" }, status),
      h("span", { class: "pill", title: "liability" }, c.liability === Liability.DELEGATE ? "liable" : c.liability === Liability.PRINCIPAL ? "retaining" : "—"),
      h("span", { class: "pill depth", title: "depth" }, `depth ${c.depth}`),
      h(
        "span",
        {
          class: "pill trust",
          "data-testid": "trust",
          title: `cumulative trust ${c.cumulativeTrustPpm} ppm; this hop ${c.factorPpm} ppm from ${enumName(TrustSource, c.trustSource)}${c.riskClass ? `, risk class ${c.riskClass}` : ""}`,
        },
        `trust ${ppm(c.cumulativeTrustPpm)}`,
      ),
      h("span", { class: `pill deadline${overdue ? " overdue" : ""}`, "data-testid": "deadline", title: `deadline ${dateTime(c.deadlineMs)}` }, `due ${relative(deadline)}`),
      ledgerBar(node.ledger, node.ledgerReadVersion < node.ledgerVersion && node.ledgerReadVersion > 0),
      verifyMark(node),
      h(
        "button",
        {
          class: "link terms-toggle",
          "data-testid": "terms-toggle",
          "aria-expanded": String(node.detailsOpen),
          onclick: () => {
            node.detailsOpen = !node.detailsOpen;
            this.#draw(node, view);
            if (node.detailsOpen) this.#hooks.detailsOpened(node);
          },
        },
        node.detailsOpen ? "hide terms" : "terms",
      ),
    );
    view.row.classList.toggle("selected-root", c.depth === 0);

    if (node.detailsOpen) replace(view.details, terms(node, names));
    else view.details.replaceChildren();
    view.details.hidden = !node.detailsOpen;

    replace(
      view.notes,
      this.#refusals(node, view, names),
      node.completion !== undefined ? completion(node.completion, node.adjudication, names) : null,
      node.escalation !== undefined ? escalation(node.escalation) : null,
      endReason(node),
      node.audit !== undefined ? auditFlags(node.audit) : null,
    );
  }

  #refusals(node: TreeNode, view: NodeView, names: Readonly<Record<string, string>>): Child {
    const all = node.refusals;
    if (all.length === 0) return null;
    const shown = node.refusalsOpen ? all : all.slice(-REFUSALS_SHOWN);
    return h(
      "div",
      { class: "refusals", "data-testid": "refusals", "data-count": all.length },
      ...shown.map((entry) => refusal(entry, node, names)),
      all.length > REFUSALS_SHOWN
        ? h(
            "button",
            {
              class: "link",
              onclick: () => {
                node.refusalsOpen = !node.refusalsOpen;
                this.#draw(node, view);
              },
            },
            node.refusalsOpen ? "latest refusals only" : `all ${all.length} refusals`,
          )
        : null,
    );
  }
}

// --- pieces -------------------------------------------------------------------------------

/**
 * A contract's delegate on one line: its label ({@link delegateLabel}); a
 * long identity is cut short with an ellipsis (the whole of it in the
 * title, and in the terms). Set as text: an identity is what a token issuer
 * vouched for, not the operator.
 */
export function delegateTag(
  c: { readonly delegatePublicKey: Uint8Array; readonly delegateIdentity: string },
  names: Readonly<Record<string, string>>,
  attrs: Record<string, string> = {},
  cls = "delegate",
): HTMLElement {
  const label = delegateLabel(c, names);
  const identity = c.delegateIdentity === "" ? undefined : safeText(c.delegateIdentity);
  return h(
    "span",
    {
      ...attrs,
      class: `${cls}${label.fromIdentity ? " identity" : ""}`,
      "data-identity": identity,
      title: `delegate ${toHex(c.delegatePublicKey)}${identity === undefined ? "" : `\nidentity ${identity}`}`,
    },
    label.text,
  );
}

function ledgerBar(ledger: Ledger | undefined, stale: boolean): HTMLElement {
  if (ledger === undefined) return h("div", { class: "ledger", "data-testid": "ledger" }, "ledger …");
  const { budget, spent, reserved, residual } = ledger;
  const scale = Math.max(Number(budget), Number(spent) + Number(reserved), 1);
  const pct = (v: bigint) => `${(Math.max(0, Number(v)) / scale) * 100}%`;
  const seg = (cls: string, v: bigint, label: string) => {
    const el = h("span", { class: `seg ${cls}`, title: `${label} ${units(v)}` });
    el.style.width = pct(v);
    return el;
  };
  return h(
    "div",
    {
      class: `ledger${residual < 0n ? " debt" : ""}${stale ? " stale" : ""}`,
      "data-testid": "ledger",
      "data-budget": String(budget),
      "data-spent": String(spent),
      "data-reserved": String(reserved),
      "data-residual": String(residual),
      title: `budget ${units(budget)}: spent ${units(spent)}, reserved by ${ledger.openChildren} open children ${units(reserved)}, residual ${units(residual)}`,
    },
    h("span", { class: "bar", "aria-hidden": "true" }, seg("spent", spent, "spent"), seg("reserved", reserved, "reserved"), seg("residual", residual, "residual")),
    h(
      "span",
      { class: "ledger-text" },
      h("span", { class: "k" }, "spent "),
      h("span", { "data-field": "spent" }, units(spent)),
      h("span", { class: "k" }, " · reserved "),
      h("span", { "data-field": "reserved" }, units(reserved)),
      h("span", { class: "k" }, " · residual "),
      h("span", { "data-field": "residual" }, units(residual)),
      h("span", { class: "k" }, " / "),
      h("span", { "data-field": "budget" }, units(budget)),
    ),
  );
}

function verifyMark(node: TreeNode): HTMLElement {
  switch (node.verify) {
    case "ok":
      return h(
        "span",
        { class: "verify-mark verified", "data-testid": "verified", "data-verified": "ok", title: "chain verified in this browser against GetBrokerKeys: leaf signature, hash links, every hop's terms" },
        "✓ verified",
      );
    case "failed":
      return h("span", { class: "verify-mark failed", "data-testid": "verified", "data-verified": "failed", title: node.verifyError ?? "" }, "✗ does not verify");
    default:
      return h("span", { class: "verify-mark pending", "data-testid": "verified", "data-verified": node.verify, title: "chain not verified yet" }, "… verifying");
  }
}

function refusal(entry: ReceiptEntry, parent: TreeNode, names: Readonly<Record<string, string>>): HTMLElement {
  const r = entry.receipt;
  const primary = enumName(InvariantCode, r.primary);
  return h(
    "div",
    { class: "refusal", "data-testid": "refusal", "data-receipt-id": entry.id, "data-parent-id": parent.id, "data-primary": primary },
    h(
      "div",
      { class: "refusal-head" },
      h("span", { class: "badge refused" }, "REFUSED"),
      " a child of this contract, asked by ",
      h("span", { class: "delegate", title: toHex(r.requesterPublicKey) }, agentName(r.requesterPublicKey, names)),
      ` at ${dateTime(r.atMs)}`,
      h("span", { class: "mono dim", title: `receipt ${entry.id}` }, ` receipt ${short(entry.id)}`),
    ),
    h(
      "ul",
      { class: "violations" },
      ...r.violations.map((v) => {
        const code = enumName(InvariantCode, v.code);
        return h(
          "li",
          { "data-testid": "violation", "data-code": code },
          h("span", { class: "code" }, code),
          " requested ",
          h("span", { class: "value", "data-field": "requested" }, v.requested),
          " / allowed ",
          h("span", { class: "value", "data-field": "allowed" }, v.allowed),
          v.detail ? h("span", { class: "detail" }, ` — ${v.detail}`) : null,
        );
      }),
    ),
  );
}

function yesNo(value: boolean): string {
  return value ? "yes" : "no";
}

function completion(entry: ReceiptEntry, adjudication: ReceiptEntry | undefined, names: Readonly<Record<string, string>>): HTMLElement {
  const done = entry.receipt.completion;
  if (done === undefined) return h("div", { class: "completion" }, "completed (no completion in the receipt)");
  const verdict = enumName(Verdict, done.verdict);
  const judged = adjudication?.receipt.completion;
  return h(
    "div",
    { class: `completion verdict-${verdict}`, "data-testid": "completion", "data-verdict": verdict, "data-receipt-id": entry.id },
    h(
      "div",
      { class: "completion-head" },
      h("span", { class: `badge verdict verdict-${verdict}`, "data-field": "verdict" }, verdict),
      h("span", { class: "claim" }, " claim ", h("q", { "data-field": "claim" }, done.claim === "" ? "—" : done.claim)),
      h("span", { class: "dim" }, ` (${done.hasReport ? "typed report" : "prose"}) at ${dateTime(entry.receipt.atMs)}`),
    ),
    done.refusedCriteria.length > 0
      ? h(
          "ul",
          { class: "criteria" },
          ...done.refusedCriteria.map((c) =>
            h(
              "li",
              { "data-testid": "refused-criterion", "data-criterion": c.criterion },
              h("code", {}, c.criterion),
              h("span", { class: "detail" }, ` — ${c.reason}`),
            ),
          ),
        )
      : null,
    h(
      "div",
      { class: "facts" },
      `consumed ${units(done.consumed)} · returned ${units(done.returned)} · overspend ${units(done.overspend)} · claimed excess `,
      h("span", { class: done.claimedExcess > 0n ? "warn" : "", "data-field": "claimed-excess" }, units(done.claimedExcess)),
      ` · within scope ${yesNo(done.withinScope)} · schema valid ${yesNo(done.schemaValid)} · ${Math.round(Number(done.elapsedMs) / 1000)} s`,
    ),
    done.outOfScopePaths.length > 0
      ? h(
          "div",
          { class: "facts", "data-testid": "out-of-scope" },
          `outside the write scope (${done.outOfScopePathCount}): `,
          ...done.outOfScopePaths.flatMap((p, i) => [i > 0 ? ", " : "", h("code", {}, p)]),
        )
      : null,
    judged !== undefined
      ? h(
          "div",
          { class: "facts", "data-testid": "adjudication", "data-verdict": enumName(Verdict, judged.verdict) },
          `principal's verdict ${enumName(Verdict, judged.verdict)}`,
          adjudication!.receipt.reason ? ` — ${adjudication!.receipt.reason}` : "",
          ` (by ${agentName(adjudication!.receipt.requesterPublicKey, names)})`,
        )
      : null,
  );
}

function escalation(entry: ReceiptEntry): HTMLElement {
  const notice = entry.receipt.escalation;
  return h(
    "div",
    { class: "escalation", "data-testid": "escalation" },
    h("span", { class: "badge status-UNRESOLVABLE" }, "ESCALATED"),
    notice === undefined
      ? ""
      : ` ${notice.reason ? `“${notice.reason}” — ` : ""}principal's residual ${units(notice.principalResidual)}, retry ${notice.retryFeasible ? "feasible" : "not feasible"}`,
  );
}

function endReason(node: TreeNode): Child {
  const last = node.receipts.at(-1)?.receipt;
  if (last === undefined || last.reason === "" || ![ReceiptKind.DECLINED, ReceiptKind.REVOKED].includes(last.kind)) return null;
  return h("div", { class: "facts" }, `${enumName(ReceiptKind, last.kind).toLowerCase()}: ${last.reason}`);
}

function flag(name: string, label: string, value: string, alert: boolean, title = ""): HTMLElement {
  return h("span", { class: `flag${alert ? " alert" : ""}`, "data-flag": name, "data-value": value, title }, `${label} ${value}`);
}

function auditFlags(audit: ContractAudit): HTMLElement {
  return h(
    "div",
    { class: "audit", "data-testid": "audit" },
    h("span", { class: "k" }, "audit: "),
    flag("false-completion", "false completion", String(audit.falseCompletion), audit.falseCompletion, "a typed report whose verdict refused criteria"),
    flag("claim-violations", "claim violations", String(audit.claimViolations), audit.claimViolations > 0n, "host-observed mutations outside the write scope"),
    flag("discovered-paths", "discovered paths", String(audit.discoveredPaths), audit.discoveredPaths > 0, `of ${audit.evidencePaths} evidence paths, not under a file the parent named`),
    flag("conflicts", "conflicts", String(audit.conflictCount), audit.conflictCount > 0, "paths another contract of the tree also mutated"),
    h("span", { class: "dim" }, ` · ${audit.toolCalls} tool calls · ${audit.mutations} mutations`),
  );
}

function row(label: string, ...value: Child[]): Child[] {
  return [h("dt", {}, label), h("dd", {}, ...value)];
}

function terms(node: TreeNode, names: Readonly<Record<string, string>>): HTMLElement {
  const c = node.contract;
  const key = (k: Uint8Array) => (k.length === 0 ? "—" : h("span", { class: "mono", title: toHex(k) }, `${agentName(k, names)} (${toHex(k)})`));
  const predicate = node.effectivePredicate;
  const audit = node.audit;
  return h(
    "dl",
    { class: "terms", "data-testid": "terms" },
    ...row("contract", h("span", { class: "mono" }, node.id)),
    ...(node.parent !== undefined ? row("parent", h("span", { class: "mono" }, node.parent.id)) : []),
    ...(c.depth === 0 ? row("intent", h("pre", { "data-testid": "intent" }, c.intent)) : []),
    ...row("task", h("pre", {}, c.task === "" ? "—" : c.task)),
    ...row("delegate", key(c.delegatePublicKey)),
    ...(c.delegateIdentity !== ""
      ? row("identity", h("span", { class: "identity-full mono", "data-testid": "delegate-identity" }, safeText(c.delegateIdentity)))
      : []),
    ...row("host", c.hostPublicKey.length === 0 ? "— (not named at Delegate; the delegate may name one at Accept)" : key(c.hostPublicKey)),
    ...row("liability", enumName(Liability, c.liability)),
    ...row("budget", units(c.budget)),
    ...row("deadline", `${dateTime(c.deadlineMs)} (${relative(Number(c.deadlineMs))})`),
    ...row("issued", dateTime(c.issuedAtMs)),
    ...row("retry", `min cost ${units(c.minRetryCost)} · min latency ${Number(c.minRetryLatencyMs) / 1000} s`),
    ...row("trust", `${c.cumulativeTrustPpm} ppm cumulative, ${c.factorPpm} ppm this hop (${enumName(TrustSource, c.trustSource)}${c.riskClass ? `, ${c.riskClass}` : ""})`),
    ...row("predicate", h("pre", { "data-testid": "predicate" }, c.predicate === "" ? "— (none forwarded at this hop)" : c.predicate)),
    ...row("effective predicate", h("pre", { "data-testid": "effective-predicate" }, predicate === undefined ? "…" : predicate === "" ? "— (none)" : predicate)),
    ...row(
      "write scope",
      c.writeScope.length === 0
        ? "— (nothing writable)"
        : h("ul", { class: "scope", "data-testid": "write-scope" }, ...c.writeScope.map((p) => h("li", {}, h("code", {}, p)))),
    ),
    ...(c.escalationChannel !== "" ? row("escalation", c.escalationChannel) : []),
    ...(c.resultSchemaJson !== "" ? row("result schema", h("pre", {}, c.resultSchemaJson)) : []),
    ...(c.depth === 0 && c.policy !== undefined
      ? row(
          "policy",
          `max depth ${c.policy.maxDepth} · min trust ${c.policy.minCumulativeTrustPpm} ppm · max children ${c.policy.maxChildren}` +
            `${c.policy.disableRetryHeadroom ? " · no retry headroom" : ""}${c.policy.requireHost ? " · host required" : ""}`,
        )
      : []),
    ...(c.depth === 0 ? row("labels", labelChips(c.labels)) : []),
    ...row(
      "receipts",
      node.receipts.length === 0
        ? "—"
        : h(
            "ol",
            { class: "receipts" },
            ...node.receipts.map((e) =>
              h("li", { "data-kind": enumName(ReceiptKind, e.receipt.kind) }, `${enumName(ReceiptKind, e.receipt.kind)} at ${dateTime(e.receipt.atMs)} by ${agentName(e.receipt.requesterPublicKey, names)}`),
            ),
          ),
    ),
    ...(audit !== undefined
      ? [
          ...row("mutated", audit.mutationPaths.length === 0 ? "—" : audit.mutationPaths.join(", ") + (audit.mutationPathCount > audit.mutationPaths.length ? ` (${audit.mutationPathCount} in all)` : "")),
          ...row(
            "conflicts",
            audit.conflicts.length === 0
              ? "—"
              : h("ul", {}, ...audit.conflicts.map((x) => h("li", {}, h("code", {}, x.path), ` also by ${x.otherContractIds.map((id) => short(id)).join(", ")}`))),
          ),
          ...row("named by the parent", [...audit.namedScopeHints, ...audit.namedFiles].join(", ") || "—"),
        ]
      : []),
    ...(node.verify === "failed" ? row("verification", h("span", { class: "error" }, node.verifyError ?? "failed")) : []),
  );
}

/** Labels as chips. */
export function labelChips(labels: Readonly<Record<string, string>>): HTMLElement {
  const entries = Object.entries(labels).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
  return h(
    "span",
    { class: "labels" },
    ...(entries.length === 0 ? ["—"] : entries.map(([k, v]) => h("span", { class: "chip", "data-label": k }, `${k}=${v}`))),
  );
}

export { ledgerBar };
