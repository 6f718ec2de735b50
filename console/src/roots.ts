/**
 * The roots the console's reader may read (ListRoots: newest first, a page
 * at a time), filtered by label equality ("arm=flat run=3").
 */

import { toHex } from "../../clients/typescript/src/bytes.js";
import { BrokerError, codeName } from "../../clients/typescript/src/errors.js";
import { ContractSchema, ContractStatus, type ContractState, type Ledger } from "../../clients/typescript/src/pb.js";
import { fromBinary } from "@bufbuild/protobuf";
import type { ConsoleApi } from "./api.js";
import { h, replace } from "./dom.js";
import { dateTime, enumName, parseLabels, short } from "./format.js";
import { delegateTag, labelChips, ledgerBar } from "./tree.js";

const PAGE_SIZE = 50;
/** ListRoots looks at no more than 1,000 roots per call, so a page may be short or empty: read on up to this many calls. */
const MAX_CALLS_PER_LOAD = 20;

export class RootsView {
  readonly el: HTMLElement;
  readonly #api: ConsoleApi;
  readonly #onSelect: (rootId: string) => void;
  readonly #filter = h("input", {
    id: "root-filter",
    type: "search",
    placeholder: "label filter, e.g. arm=flat run=3",
    "data-testid": "root-filter",
    spellcheck: "false",
    autocomplete: "off",
  });
  readonly #list = h("ul", { class: "roots", "data-testid": "roots" });
  readonly #more = h("div", { class: "more" });
  readonly #message = h("p", { class: "dim", role: "status" });
  #selected = "";
  #labels: Record<string, string> = {};
  #token: Uint8Array = new Uint8Array();
  #generation = 0;

  constructor(api: ConsoleApi, onSelect: (rootId: string) => void) {
    this.#api = api;
    this.#onSelect = onSelect;
    const form = h(
      "form",
      {
        class: "filter",
        onsubmit: (event: Event) => {
          event.preventDefault();
          void this.load();
        },
      },
      this.#filter,
      h("button", { type: "submit", "data-testid": "root-filter-apply" }, "filter"),
      h("button", { type: "button", class: "link", title: "read the newest roots again", onclick: () => void this.load() }, "refresh"),
    );
    this.el = h("div", { class: "roots-pane" }, h("h2", {}, "Roots"), form, this.#message, this.#list, this.#more);
  }

  select(rootId: string): void {
    this.#selected = rootId;
    for (const li of this.#list.querySelectorAll<HTMLElement>("li[data-root-id]")) {
      li.classList.toggle("selected", li.dataset.rootId === rootId);
    }
  }

  /** The tree view's newer status and ledger of a root, when it is listed. */
  update(rootId: string, status: ContractStatus, ledger: Ledger | undefined): void {
    const li = this.#list.querySelector<HTMLElement>(`li[data-root-id="${rootId}"]`);
    if (li === null) return;
    const name = enumName(ContractStatus, status);
    const badge = li.querySelector<HTMLElement>(".badge.status");
    if (badge !== null && badge.textContent !== name) {
      badge.textContent = name;
      badge.className = `badge status status-${name}`;
    }
    li.querySelector(".ledger")?.replaceWith(ledgerBar(ledger, false));
  }

  /** Reads the newest roots matching the filter (from scratch). */
  async load(): Promise<void> {
    try {
      this.#labels = parseLabels(this.#filter.value);
    } catch (error) {
      replace(this.#message, h("span", { class: "error" }, (error as Error).message));
      return;
    }
    this.#token = new Uint8Array();
    this.#list.replaceChildren();
    await this.#loadMore(++this.#generation);
  }

  async #loadMore(generation: number): Promise<void> {
    replace(this.#message, "loading…");
    this.#more.replaceChildren();
    let found = 0;
    try {
      for (let call = 0; call < MAX_CALLS_PER_LOAD; call++) {
        const response = await this.#api.client.listRoots({ labels: this.#labels, pageSize: PAGE_SIZE, pageToken: this.#token });
        if (generation !== this.#generation) return;
        for (const root of response.roots) this.#list.append(this.#row(root));
        found += response.roots.length;
        this.#token = response.nextPageToken;
        if (this.#token.length === 0 || found >= PAGE_SIZE) break;
      }
    } catch (caught) {
      if (generation !== this.#generation) return;
      const error = BrokerError.from(caught);
      replace(this.#message, h("span", { class: "error", "data-testid": "roots-error" }, `ListRoots: ${codeName(error.code)} ${error.rawMessage}`));
      return;
    }
    const total = this.#list.childElementCount;
    const filtered = Object.keys(this.#labels).length > 0;
    replace(this.#message, total === 0 ? (filtered ? "no root carries these labels" : "no roots yet") : `${total} roots${filtered ? " matching" : ""}, newest first`);
    if (this.#token.length > 0) {
      replace(this.#more, h("button", { class: "link", "data-testid": "roots-more", onclick: () => void this.#loadMore(generation) }, "older roots…"));
    }
  }

  #row(state: ContractState): HTMLElement {
    const id = toHex(state.contractId);
    const contract = fromBinary(ContractSchema, state.contract!.payload);
    const status = enumName(ContractStatus, state.status);
    const intent = contract.intent.length > 140 ? `${contract.intent.slice(0, 140)}…` : contract.intent;
    return h(
      "li",
      { "data-testid": "root", "data-root-id": id, class: id === this.#selected ? "selected" : "" },
      h(
        "button",
        { class: "root-button", title: `root ${id}`, onclick: () => this.#onSelect(id) },
        h(
          "span",
          { class: "root-line" },
          h("span", { class: `badge status status-${status}` }, status),
          h("span", { class: "intent" }, intent),
        ),
        h(
          "span",
          { class: "root-line dim" },
          h("span", { class: "mono" }, short(id)),
          h("span", {}, " · ", delegateTag(contract, this.#api.names, {}, "who"), ` · ${dateTime(contract.issuedAtMs)} · `),
          labelChips(contract.labels),
        ),
        ledgerBar(state.ledger, false),
      ),
    );
  }
}
