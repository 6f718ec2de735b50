/** Formatting of keys, ids, numbers and times for display. */

import { toHex } from "../../clients/typescript/src/bytes.js";

/** The first `n` hex digits of an id or key, for display (the full value goes into a title). */
export function short(value: Uint8Array | string, n = 8): string {
  const hex = typeof value === "string" ? value : toHex(value);
  return hex.length > n ? hex.slice(0, n) : hex;
}

/** An agent key as the operator named it in `[console.names]`, else its short hex. */
export function agentName(key: Uint8Array | string, names: Readonly<Record<string, string>>): string {
  const hex = typeof key === "string" ? key.toLowerCase() : toHex(key);
  if (hex === "") return "—";
  return names[hex] ?? short(hex);
}

/** Characters that could forge or reorder what the operator reads: control characters and bidirectional overrides and isolates. */
const UNSAFE = /[\u0000-\u001f\u007f-\u009f\u200e\u200f\u202a-\u202e\u2066-\u2069]/gu;

/**
 * Untrusted text (an identity a token issuer vouched for) for display, as the
 * CLI shows it: control characters and bidirectional overrides become `\u{…}`.
 */
export function safeText(text: string): string {
  return text.replace(UNSAFE, (c) => `\\u{${c.codePointAt(0)!.toString(16)}}`);
}

/**
 * A contract's delegate, as the CLI's `tree` names it: the operator's name
 * from `[console.names]`, else the workload identity the contract carries
 * (`delegateIdentity`, bound at issuance), else the key's short hex.
 */
export function delegateLabel(
  contract: { readonly delegatePublicKey: Uint8Array; readonly delegateIdentity: string },
  names: Readonly<Record<string, string>>,
): { text: string; fromIdentity: boolean } {
  const hex = toHex(contract.delegatePublicKey);
  const name = hex === "" ? undefined : names[hex];
  if (name === undefined && contract.delegateIdentity !== "") return { text: safeText(contract.delegateIdentity), fromIdentity: true };
  return { text: agentName(hex, names), fromIdentity: false };
}

/** Budget units with thousands separators (bigint-safe). */
export function units(value: bigint | number): string {
  const negative = value < 0;
  const digits = (negative ? -BigInt(value) : BigInt(value)).toString();
  const grouped = digits.replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  return negative ? `-${grouped}` : grouped;
}

/** Parts per million as a percentage, e.g. 900000 → "90%". */
export function ppm(value: number): string {
  const percent = value / 10_000;
  return `${Number.isInteger(percent) ? percent.toFixed(0) : percent.toFixed(2)}%`;
}

/** A rate in [0, 1] (or more) as a percentage. */
export function rate(value: number | undefined): string {
  if (value === undefined) return "—";
  return `${(value * 100).toFixed(1)}%`;
}

const pad = (n: number) => String(n).padStart(2, "0");

/** Unix ms as local "YYYY-MM-DD HH:MM:SS". */
export function dateTime(ms: bigint | number): string {
  const d = new Date(Number(ms));
  if (Number.isNaN(d.getTime())) return String(ms);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

/** How far `ms` is from now: "in 59 min", "3 s ago". */
export function relative(ms: bigint | number, now = Date.now()): string {
  const delta = Number(ms) - now;
  const abs = Math.abs(delta);
  let text: string;
  if (abs < 60_000) text = `${Math.round(abs / 1000)} s`;
  else if (abs < 3_600_000) text = `${Math.round(abs / 60_000)} min`;
  else if (abs < 172_800_000) text = `${(abs / 3_600_000).toFixed(1)} h`;
  else text = `${Math.round(abs / 86_400_000)} d`;
  return delta >= 0 ? `in ${text}` : `${text} ago`;
}

/** An enum value's name without its prefix (protobuf-es enums are reverse-mapped), or its number. */
export function enumName(e: Record<number, string>, value: number): string {
  return e[value] ?? String(value);
}

/** Parses a label filter: "arm=flat run=3" or "arm=flat, run=3" (keys and values without spaces, commas or '='). */
export function parseLabels(text: string): Record<string, string> {
  const out: Record<string, string> = {};
  for (const part of text.split(/[\s,]+/).filter((p) => p !== "")) {
    const at = part.indexOf("=");
    if (at <= 0) throw new Error(`"${part}" is not key=value`);
    out[part.slice(0, at)] = part.slice(at + 1);
  }
  return out;
}
