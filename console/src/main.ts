/**
 * The delegation broker's console: the page `serve --console` serves.
 *
 * The access token comes in the address `serve` prints (`#token=…`); it is
 * moved to sessionStorage and taken out of the address at once. Without a
 * token the page shows only the prompt. With one it opens a read session of
 * the configured reader and shows the roots, the live tree of the chosen
 * root (`#root=<hex>`) and the audit comparison.
 */

import { ConsoleApi, TOKEN_STORAGE_KEY, TokenRejected } from "./api.js";
import { AuditsView } from "./audits.js";
import { TreeController } from "./controller.js";
import { byId, h, replace } from "./dom.js";
import { agentName, dateTime } from "./format.js";
import { RootsView } from "./roots.js";

interface App {
  api: ConsoleApi;
  roots: RootsView;
  audits: AuditsView;
  tree: TreeController | undefined;
}

let app: App | undefined;

function hashParams(): URLSearchParams {
  return new URLSearchParams(location.hash.replace(/^#/, ""));
}

/** The token from `#token=…` (then removed from the address) or from this tab's sessionStorage. */
function takeToken(): string | undefined {
  const params = hashParams();
  const fromHash = params.get("token");
  if (fromHash !== null && fromHash !== "") {
    sessionStorage.setItem(TOKEN_STORAGE_KEY, fromHash);
    params.delete("token");
    const rest = params.toString();
    history.replaceState(history.state, "", `${location.pathname}${location.search}${rest === "" ? "" : `#${rest}`}`);
  }
  return sessionStorage.getItem(TOKEN_STORAGE_KEY) ?? undefined;
}

function showPrompt(message = ""): void {
  app?.tree?.close();
  app?.api.close();
  app = undefined;
  byId("app").hidden = true;
  byId("tabs").hidden = true;
  replace(byId("whoami"));
  byId("prompt").hidden = false;
  byId("prompt-error").textContent = message;
  byId<HTMLInputElement>("token-input").focus();
}

async function connect(token: string): Promise<void> {
  app?.tree?.close();
  app?.api.close();
  app = undefined;
  byId("prompt-error").textContent = "";
  byId("prompt").hidden = true;
  replace(byId("whoami"), h("span", { class: "dim" }, "connecting…"));
  let api: ConsoleApi;
  try {
    api = await ConsoleApi.open(token);
  } catch (error) {
    if (error instanceof TokenRejected) sessionStorage.removeItem(TOKEN_STORAGE_KEY);
    showPrompt(error instanceof TokenRejected ? error.message : `cannot reach the console: ${(error as Error).message}`);
    return;
  }
  api.onTokenRejected(() => {
    sessionStorage.removeItem(TOKEN_STORAGE_KEY);
    showPrompt("the access token is no longer accepted (was the broker restarted?): enter the new one");
  });
  const whoami = () =>
    replace(
      byId("whoami"),
      "reading as ",
      h("span", { class: "delegate", "data-testid": "reader", title: api.readerKey }, agentName(api.readerKey, api.names)),
      h("span", { class: "dim", "data-testid": "session-expiry" }, ` · session until ${dateTime(api.expiresAtMs)}`),
    );
  api.onSession(whoami);
  whoami();
  const roots = new RootsView(api, (rootId) => {
    location.hash = `root=${rootId}`;
  });
  const audits = new AuditsView(api);
  app = { api, roots, audits, tree: undefined };
  replace(byId("roots"), roots.el);
  replace(byId("view-audits"), audits.el);
  byId("app").hidden = false;
  byId("tabs").hidden = false;
  showTab("tree");
  void roots.load();
  route();
}

function showTab(tab: string): void {
  for (const button of document.querySelectorAll<HTMLButtonElement>("#tabs button[data-tab]")) {
    button.setAttribute("aria-selected", String(button.dataset.tab === tab));
  }
  byId("view-tree").hidden = tab !== "tree";
  byId("view-audits").hidden = tab !== "audits";
  if (tab === "audits") app?.audits.shown();
}

/** Shows the root the address names (`#root=<hex>`). */
function route(): void {
  if (app === undefined) return;
  const rootId = (hashParams().get("root") ?? "").toLowerCase();
  if (!/^[0-9a-f]{64}$/.test(rootId)) {
    app.tree?.close();
    app.tree = undefined;
    replace(byId("tree-pane"), h("p", { class: "dim empty", "data-testid": "no-root" }, "Choose a root to see its tree."));
    return;
  }
  if (app.tree?.rootId === rootId) return;
  app.tree?.close();
  const tree = new TreeController(app.api, rootId);
  const roots = app.roots;
  tree.onRootChanged = (root) => roots.update(rootId, root.status, root.ledger);
  app.tree = tree;
  app.roots.select(rootId);
  showTab("tree");
  replace(byId("tree-pane"), tree.el);
  void tree.start();
}

function main(): void {
  byId("prompt-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const input = byId<HTMLInputElement>("token-input");
    const token = input.value.trim().replace(/^.*#token=/, "");
    input.value = "";
    if (token === "") return;
    sessionStorage.setItem(TOKEN_STORAGE_KEY, token);
    void connect(token);
  });
  for (const button of document.querySelectorAll<HTMLButtonElement>("#tabs button[data-tab]")) {
    button.addEventListener("click", () => showTab(button.dataset.tab!));
  }
  window.addEventListener("hashchange", () => {
    // A pasted address with a new token: take it in (and out of the address).
    if (hashParams().has("token")) {
      const token = takeToken();
      if (token !== undefined) void connect(token);
      return;
    }
    route();
  });
  const token = takeToken();
  if (token === undefined) showPrompt();
  else void connect(token);
}

main();
