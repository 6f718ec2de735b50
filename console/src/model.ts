/**
 * The tree of one root as the console knows it, built from the root's Watch
 * events (each a broker-signed Contract or Receipt, verified by the client's
 * watch) and completed by reads (ledgers from GetContract / ListChildren /
 * GetChain, audits from GetAudit, verification of each chain).
 *
 * Statuses follow the receipts (every status change has one); ledgers are
 * the broker's, read again (debounced) after any event that may move them.
 */

import { toHex } from "../../clients/typescript/src/bytes.js";
import {
  ContractStatus,
  ReceiptKind,
  type ContractAudit,
  type Contract,
  type ContractState,
  type Ledger,
  type Receipt,
  type Sealed,
} from "../../clients/typescript/src/pb.js";
import type { WatchEvent } from "../../clients/typescript/src/watch.js";

export interface ReceiptEntry {
  readonly id: string;
  readonly cursor: bigint;
  readonly receipt: Receipt;
}

export type VerifyState = "pending" | "running" | "ok" | "failed";

export interface TreeNode {
  readonly id: string;
  readonly idBytes: Uint8Array;
  readonly sealed: Sealed;
  readonly contract: Contract;
  readonly parent: TreeNode | undefined;
  readonly children: TreeNode[];
  status: ContractStatus;
  /** The broker's ledger as last read (or, before that, a fresh contract's: its whole budget free). */
  ledger: Ledger | undefined;
  /** Bumped by every event that may move the ledger; a read answered for an older version is read again. */
  ledgerVersion: number;
  ledgerReadVersion: number;
  effectivePredicate: string | undefined;
  /** Refusals of Delegates asked of this contract. */
  readonly refusals: ReceiptEntry[];
  /** Every receipt about this contract, in commit order. */
  readonly receipts: ReceiptEntry[];
  completion: ReceiptEntry | undefined;
  adjudication: ReceiptEntry | undefined;
  escalation: ReceiptEntry | undefined;
  observations: number;
  audit: ContractAudit | undefined;
  auditVersion: number;
  auditReadVersion: number;
  verify: VerifyState;
  verifyError: string | undefined;
  /** UI state: undefined until first shown (then decided by the auto-expansion rule). */
  expanded: boolean | undefined;
  /** Expanded by the auto-expansion rule (not by the user): folded again when the rule no longer holds. */
  autoExpanded: boolean;
  detailsOpen: boolean;
  refusalsOpen: boolean;
  /** How many children are rendered while expanded (grown by "show more"). */
  shownChildren: number;
}

export interface ModelListener {
  /** A contract joined the tree (its parent, if any, is already there). */
  added(node: TreeNode): void;
  /** Something shown about `node` changed. */
  changed(node: TreeNode): void;
  /** `node`'s ledger may have moved. */
  ledgerMoved(node: TreeNode): void;
  /** `node`'s audit may have changed. */
  auditMoved(node: TreeNode): void;
}

const ENDING: Partial<Record<ReceiptKind, ContractStatus>> = {
  [ReceiptKind.ACCEPTED]: ContractStatus.ACCEPTED,
  [ReceiptKind.DECLINED]: ContractStatus.DECLINED,
  [ReceiptKind.COMPLETED]: ContractStatus.COMPLETED,
  [ReceiptKind.ESCALATED]: ContractStatus.UNRESOLVABLE,
  [ReceiptKind.REVOKED]: ContractStatus.REVOKED,
  [ReceiptKind.EXPIRED]: ContractStatus.EXPIRED,
};

function freshLedger(contract: Contract): Ledger {
  return { $typeName: "delegation.broker.v1.Ledger", budget: contract.budget, reserved: 0n, spent: 0n, residual: contract.budget, openChildren: 0 };
}

export class TreeModel {
  readonly rootId: string;
  readonly nodes = new Map<string, TreeNode>();
  root: TreeNode | undefined;
  cursor = 0n;
  refusalCount = 0;
  /** Receipts about contracts not (yet) known: kept so nothing is lost if they come first. */
  readonly #orphans = new Map<string, ReceiptEntry[]>();
  readonly #listener: ModelListener;

  constructor(rootId: string, listener: ModelListener) {
    this.rootId = rootId;
    this.#listener = listener;
  }

  get size(): number {
    return this.nodes.size;
  }

  /** A contract (from Watch, or the root's GetContract before the first event). */
  addContract(id: Uint8Array, sealed: Sealed, contract: Contract): TreeNode {
    const hex = toHex(id);
    const known = this.nodes.get(hex);
    if (known !== undefined) return known;
    const parent = contract.parentId.length === 0 ? undefined : this.nodes.get(toHex(contract.parentId));
    if (hex !== this.rootId && parent === undefined) {
      throw new Error(`contract ${hex} arrived before its parent ${toHex(contract.parentId)}`);
    }
    const node: TreeNode = {
      id: hex,
      idBytes: id,
      sealed,
      contract,
      parent,
      children: [],
      status: ContractStatus.OPEN,
      ledger: freshLedger(contract),
      ledgerVersion: 1,
      ledgerReadVersion: 0,
      effectivePredicate: undefined,
      refusals: [],
      receipts: [],
      completion: undefined,
      adjudication: undefined,
      escalation: undefined,
      observations: 0,
      audit: undefined,
      auditVersion: 1,
      auditReadVersion: 0,
      verify: "pending",
      verifyError: undefined,
      expanded: undefined,
      autoExpanded: false,
      detailsOpen: false,
      refusalsOpen: false,
      shownChildren: 0,
    };
    this.nodes.set(hex, node);
    if (hex === this.rootId) this.root = node;
    if (parent !== undefined) {
      parent.children.push(node);
      this.#ledgerMoved(parent);
    }
    this.#listener.added(node);
    this.#listener.ledgerMoved(node);
    for (const entry of this.#orphans.get(hex) ?? []) this.#applyReceipt(entry);
    this.#orphans.delete(hex);
    return node;
  }

  /** One verified Watch event. */
  apply(event: WatchEvent): void {
    if (event.cursor > this.cursor) this.cursor = event.cursor;
    if (event.contract !== undefined) {
      this.addContract(event.id, event.sealed, event.contract);
    } else if (event.receipt !== undefined) {
      this.#applyReceipt({ id: toHex(event.id), cursor: event.cursor, receipt: event.receipt });
    }
  }

  /** The broker's current state of a contract (GetContract, ListChildren, GetChain, ListRoots). */
  applyState(state: ContractState, readForVersion?: number): void {
    const node = this.nodes.get(toHex(state.contractId));
    if (node === undefined) return;
    let changed = false;
    if (state.effectivePredicate !== node.effectivePredicate && state.contract !== undefined) {
      node.effectivePredicate = state.effectivePredicate;
      changed = true;
    }
    if (state.ledger !== undefined && (readForVersion === undefined || readForVersion >= node.ledgerReadVersion)) {
      node.ledger = state.ledger;
      if (readForVersion !== undefined) node.ledgerReadVersion = readForVersion;
      changed = true;
    }
    // Statuses follow receipts; a state read before a receipt arrived may lag, one read after may lead.
    if (node.receipts.length === 0 && state.status !== ContractStatus.UNSPECIFIED && state.status !== node.status) {
      node.status = state.status;
      changed = true;
    }
    if (changed) this.#listener.changed(node);
  }

  #ledgerMoved(node: TreeNode): void {
    node.ledgerVersion++;
    this.#listener.ledgerMoved(node);
  }

  #auditMoved(node: TreeNode): void {
    node.auditVersion++;
    this.#listener.auditMoved(node);
  }

  #applyReceipt(entry: ReceiptEntry): void {
    const receipt = entry.receipt;
    const target = this.nodes.get(toHex(receipt.contractId));
    if (target === undefined) {
      const hex = toHex(receipt.contractId);
      const list = this.#orphans.get(hex) ?? [];
      list.push(entry);
      this.#orphans.set(hex, list);
      return;
    }
    if (receipt.kind === ReceiptKind.REFUSED) {
      // Beside the parent it was asked of; nothing reserved, nothing moves.
      target.refusals.push(entry);
      this.refusalCount++;
      this.#listener.changed(target);
      return;
    }
    target.receipts.push(entry);
    const status = ENDING[receipt.kind];
    if (status !== undefined && !(receipt.kind === ReceiptKind.ACCEPTED && target.status !== ContractStatus.OPEN)) {
      target.status = status;
    }
    switch (receipt.kind) {
      case ReceiptKind.COMPLETED:
        target.completion = entry;
        this.#auditMoved(target);
        break;
      case ReceiptKind.ADJUDICATED:
        target.adjudication = entry;
        this.#auditMoved(target);
        break;
      case ReceiptKind.ESCALATED:
        target.escalation = entry;
        break;
      case ReceiptKind.OBSERVED:
        target.observations += receipt.observations;
        this.#auditMoved(target);
        break;
      default:
        break;
    }
    // Contracts this transition ended with the target (its open descendants).
    const endedAs = receipt.kind === ReceiptKind.EXPIRED ? ContractStatus.EXPIRED : ContractStatus.REVOKED;
    for (const endedId of receipt.revokedIds) {
      const ended = this.nodes.get(toHex(endedId));
      if (ended === undefined || ended === target) continue;
      if (ended.status === ContractStatus.OPEN || ended.status === ContractStatus.ACCEPTED) ended.status = endedAs;
      this.#ledgerMoved(ended);
      if (ended.parent !== undefined && ended.parent !== target) this.#ledgerMoved(ended.parent);
      this.#listener.changed(ended);
    }
    if (receipt.kind !== ReceiptKind.ACCEPTED) {
      this.#ledgerMoved(target);
      if (target.parent !== undefined) this.#ledgerMoved(target.parent);
    }
    this.#listener.changed(target);
  }
}
