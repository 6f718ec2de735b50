/**
 * AggregateAudits: runs grouped by label values (e.g. the arms of an
 * experiment, `group by arm`), as a table and an SVG bar chart of the
 * group rates (ratios of sums over the group, as the broker computes them).
 */

import { BrokerError, codeName } from "../../clients/typescript/src/errors.js";
import type { AuditGroup } from "../../clients/typescript/src/pb.js";
import type { ConsoleApi } from "./api.js";
import { h, replace, svg } from "./dom.js";
import { parseLabels, rate, units } from "./format.js";

interface Metric {
  readonly key: string;
  readonly label: string;
  readonly value: (g: AuditGroup) => number | undefined;
}

const METRICS: Metric[] = [
  { key: "discovery_rate", label: "discovery rate", value: (g) => g.discoveryRate },
  { key: "false_completion_rate", label: "false completion rate", value: (g) => g.falseCompletionRate },
  { key: "claim_violations_per_mutation", label: "claim violations / mutation", value: (g) => g.claimViolationsPerMutation },
  { key: "spent_over_granted", label: "spent / granted", value: (g) => g.spentOverGranted },
];

function groupName(g: AuditGroup, by: string[]): string {
  return by.map((k) => `${k}=${g.key[k] ?? ""}`).join(" ");
}

export class AuditsView {
  readonly el: HTMLElement;
  readonly #api: ConsoleApi;
  readonly #groupBy = h("input", { type: "text", value: "arm", "data-testid": "audit-group-by", spellcheck: "false", autocomplete: "off" });
  readonly #selector = h("input", { type: "search", placeholder: "only runs with labels, e.g. run=3", "data-testid": "audit-selector", spellcheck: "false", autocomplete: "off" });
  readonly #out = h("div", { class: "audit-out", "data-testid": "audit-out" });
  #loaded = false;

  constructor(api: ConsoleApi) {
    this.#api = api;
    const form = h(
      "form",
      {
        class: "filter",
        onsubmit: (event: Event) => {
          event.preventDefault();
          void this.run();
        },
      },
      h("label", {}, "group by ", this.#groupBy),
      h("label", {}, "selector ", this.#selector),
      h("button", { type: "submit", "data-testid": "audit-run" }, "aggregate"),
    );
    this.el = h(
      "section",
      { class: "audits" },
      h("h2", {}, "Audits by group"),
      h("p", { class: "dim" }, "AggregateAudits over every run the console's reader may read; rates are ratios of sums over each group."),
      form,
      this.#out,
    );
  }

  /** Runs the aggregation once, the first time the view is shown. */
  shown(): void {
    if (!this.#loaded) void this.run();
  }

  async run(): Promise<void> {
    this.#loaded = true;
    let selector: Record<string, string>;
    const groupBy = this.#groupBy.value.split(/[\s,]+/).filter((k) => k !== "");
    try {
      selector = parseLabels(this.#selector.value);
    } catch (error) {
      replace(this.#out, h("p", { class: "error" }, (error as Error).message));
      return;
    }
    replace(this.#out, h("p", { class: "dim" }, "aggregating…"));
    try {
      const response = await this.#api.audit(() => this.#api.client.aggregateAudits({ selector, groupBy }));
      replace(this.#out, table(response.groups, groupBy), chart(response.groups, groupBy));
    } catch (caught) {
      const error = BrokerError.from(caught);
      replace(this.#out, h("p", { class: "error", "data-testid": "audit-error" }, `AggregateAudits: ${codeName(error.code)} ${error.rawMessage}`));
    }
  }
}

function table(groups: AuditGroup[], by: string[]): HTMLElement {
  if (groups.length === 0) return h("p", { class: "dim", "data-testid": "audit-empty" }, "no runs");
  const head = ["group", "runs", "contracts", "discovery", "false completions", "claim violations / mutation", "conflicts", "escalations", "refusals", "spent / granted"];
  return h(
    "table",
    { class: "audit-table", "data-testid": "audit-table" },
    h("thead", {}, h("tr", {}, ...head.map((t) => h("th", { scope: "col" }, t)))),
    h(
      "tbody",
      {},
      ...groups.map((g) => {
        const refusals = Object.entries(g.refusalsByCode).sort(([a], [b]) => (a < b ? -1 : 1));
        return h(
          "tr",
          { "data-testid": "audit-group", "data-group": groupName(g, by) },
          h("th", { scope: "row" }, groupName(g, by)),
          h("td", { "data-field": "runs" }, String(g.runs)),
          h("td", { "data-field": "contracts" }, String(g.contracts)),
          h("td", { "data-field": "discovery_rate" }, `${rate(g.discoveryRate)} (${g.discoveredPaths}/${g.evidencePaths})`),
          h("td", { "data-field": "false_completion_rate" }, `${rate(g.falseCompletionRate)} (${g.falseCompletions}/${g.withReport})`),
          h("td", { "data-field": "claim_violations_per_mutation" }, `${rate(g.claimViolationsPerMutation)} (${g.claimViolations}/${g.mutations})`),
          h("td", { "data-field": "conflicts" }, String(g.conflicts)),
          h("td", { "data-field": "escalations" }, String(g.escalations)),
          h("td", { "data-field": "refusals" }, refusals.length === 0 ? "—" : refusals.map(([code, n]) => `${code} ${n}`).join(", ")),
          h("td", { "data-field": "spent_over_granted" }, `${rate(g.spentOverGranted)} (${units(g.budgetSpent)}/${units(g.budgetGranted)})`),
        );
      }),
    ),
  );
}

const CHART = { width: 720, height: 280, left: 48, right: 12, top: 16, bottom: 56 };

function chart(groups: AuditGroup[], by: string[]): Element | null {
  if (groups.length === 0) return null;
  const plotW = CHART.width - CHART.left - CHART.right;
  const plotH = CHART.height - CHART.top - CHART.bottom;
  const values = groups.flatMap((g) => METRICS.map((m) => m.value(g) ?? 0));
  const max = Math.max(1, ...values);
  const y = (v: number) => CHART.top + plotH - (v / max) * plotH;
  const band = plotW / groups.length;
  const barW = Math.max(2, Math.min(28, (band * 0.8) / METRICS.length));
  const parts: Element[] = [];
  for (const tick of [0, 0.25, 0.5, 0.75, 1].map((t) => t * max)) {
    parts.push(
      svg("line", { x1: CHART.left, x2: CHART.left + plotW, y1: y(tick), y2: y(tick), class: "grid" }),
      svg("text", { x: CHART.left - 6, y: y(tick) + 4, "text-anchor": "end", class: "axis" }, `${Math.round(tick * 100)}%`),
    );
  }
  groups.forEach((g, gi) => {
    const x0 = CHART.left + gi * band + (band - barW * METRICS.length) / 2;
    METRICS.forEach((m, mi) => {
      const v = m.value(g);
      const x = x0 + mi * barW;
      if (v === undefined) {
        parts.push(svg("text", { x: x + barW / 2, y: y(0) - 3, "text-anchor": "middle", class: "na" }, "–"));
        return;
      }
      parts.push(
        svg(
          "rect",
          { x, y: y(v), width: barW - 2, height: Math.max(0, y(0) - y(v)), class: `bar m${mi}`, "data-group": groupName(g, by), "data-metric": m.key, "data-value": String(v) },
          svg("title", {}, `${groupName(g, by)}: ${m.label} ${rate(v)}`),
        ),
      );
    });
    parts.push(svg("text", { x: CHART.left + gi * band + band / 2, y: CHART.top + plotH + 16, "text-anchor": "middle", class: "axis" }, groupName(g, by)));
  });
  METRICS.forEach((m, mi) => {
    const x = CHART.left + mi * 170;
    parts.push(
      svg("rect", { x, y: CHART.height - 22, width: 10, height: 10, class: `bar m${mi}` }),
      svg("text", { x: x + 14, y: CHART.height - 13, class: "legend" }, m.label),
    );
  });
  return svg(
    "svg",
    { class: "audit-chart", "data-testid": "audit-chart", viewBox: `0 0 ${CHART.width} ${CHART.height}`, role: "img", "aria-label": "audit rates by group" },
    ...parts,
  );
}
