/**
 * A few DOM helpers. Everything shown comes from agents (tasks, intents,
 * labels, claims, paths) and from the operator's address book: it is set as
 * text, never as HTML.
 */

export type Child = Node | string | number | bigint | null | undefined | false;
export type Attrs = Record<string, string | number | bigint | boolean | null | undefined | EventListener>;

function apply(el: Element, attrs: Attrs | undefined): void {
  if (attrs === undefined) return;
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (typeof value === "function") {
      el.addEventListener(name.replace(/^on/, ""), value);
    } else {
      el.setAttribute(name, value === true ? "" : String(value));
    }
  }
}

function append(el: Element, children: Child[]): void {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
}

/** An HTML element: `h("span", { class: "badge", "data-status": "OPEN" }, "OPEN")`. */
export function h<K extends keyof HTMLElementTagNameMap>(tag: K, attrs?: Attrs, ...children: Child[]): HTMLElementTagNameMap[K] {
  const el = document.createElement(tag);
  apply(el, attrs);
  append(el, children);
  return el;
}

const SVG_NS = "http://www.w3.org/2000/svg";

/** An SVG element. */
export function svg(tag: string, attrs?: Attrs, ...children: Child[]): SVGElement {
  const el = document.createElementNS(SVG_NS, tag) as SVGElement;
  apply(el, attrs);
  append(el, children);
  return el;
}

/** Replaces `el`'s children. */
export function replace(el: Element, ...children: Child[]): void {
  el.replaceChildren();
  append(el, children);
}

/** The element with this id (it must exist in index.html). */
export function byId<T extends HTMLElement = HTMLElement>(id: string): T {
  const el = document.getElementById(id);
  if (el === null) throw new Error(`index.html has no #${id}`);
  return el as T;
}

/** Resolves at the next animation frame (or a macrotask when the page is hidden), letting the browser paint and handle input. */
export function yieldToBrowser(): Promise<void> {
  return new Promise((resolve) => {
    if (document.visibilityState === "hidden") setTimeout(resolve, 0);
    else requestAnimationFrame(() => resolve());
  });
}

export const sleep = (ms: number): Promise<void> => new Promise((resolve) => setTimeout(resolve, ms));
