// Checks of the public API's arguments, for JavaScript callers (and casts) that the types do
// not stop: a wrong argument is a TypeError or RangeError naming it, raised before anything
// is sent — not an answer of the daemon to a request it should never have seen.
import { isAbsolute } from "node:path";

/** The largest `wait` the daemon takes (seconds; its `wait_seconds` is a 32-bit count). */
export const MAX_WAIT_S = 2147483647;
/** The least and the largest `maxHold` the daemon takes (seconds): the shortest TTL, and 366 days. */
export const MIN_HOLD_S = 5;
export const MAX_HOLD_S = 366 * 24 * 3600;
/** At most this many labels; keys of 1-63 characters of `A-Z a-z 0-9 _ . -`; values of at most 255 bytes of UTF-8. */
export const MAX_LABELS = 16;
export const MAX_LABEL_VALUE_BYTES = 255;
const LABEL_KEY = /^[A-Za-z0-9_.-]{1,63}$/;

function describe(v: unknown): string {
  if (v === null) return "null";
  if (Array.isArray(v)) return "an array";
  if (typeof v === "object") {
    const name = (v as { constructor?: { name?: string } }).constructor?.name;
    return name && name !== "Object" ? `a ${name}` : "an object";
  }
  if (typeof v === "string") return `the string ${JSON.stringify(v)}`;
  return `${typeof v} ${String(v)}`;
}

/** The index of the first lone surrogate of `s` (not valid Unicode, not sendable as UTF-8), or -1. */
function loneSurrogate(s: string): number {
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    if (c >= 0xd800 && c <= 0xdbff) {
      const d = s.charCodeAt(i + 1);
      if (d >= 0xdc00 && d <= 0xdfff) {
        i++;
        continue;
      }
      return i;
    }
    if (c >= 0xdc00 && c <= 0xdfff) return i;
  }
  return -1;
}

/** A string that can be sent as UTF-8 (names, ids). @internal */
export function checkText(v: unknown, arg: string): string {
  if (typeof v !== "string") throw new TypeError(`${arg} must be a string, not ${describe(v)}`);
  const i = loneSurrogate(v);
  if (i >= 0)
    throw new TypeError(
      `${arg} is not well-formed Unicode: it has the lone surrogate U+${v.charCodeAt(i).toString(16).toUpperCase()} at index ${i}, which cannot be sent as UTF-8`,
    );
  return v;
}

/**
 * A file path (a non-empty string without NUL), made absolute but not normalized: `..` after
 * a symbolic link is for mepd to resolve as the kernel does, not text to drop. @internal
 */
export function checkPath(v: unknown, arg = "path"): string {
  if (typeof v !== "string") throw new TypeError(`${arg} must be a string (a file path), not ${describe(v)}`);
  if (v === "") throw new TypeError(`${arg} must not be empty`);
  const nul = v.indexOf("\u0000");
  if (nul >= 0) throw new TypeError(`${arg} contains a NUL character (at index ${nul})`);
  const p = checkText(v, arg);
  return isAbsolute(p) ? p : `${process.cwd()}/${p}`;
}

/** A plain object of options, or undefined. @internal */
export function checkOptions<T extends object>(v: T | undefined, arg = "options"): T {
  if (v === undefined) return {} as T;
  if (v === null || typeof v !== "object" || Array.isArray(v)) throw new TypeError(`${arg} must be an object, not ${describe(v)}`);
  return v;
}

function checkNumber(v: unknown, arg: string, what: string): number {
  if (typeof v !== "number") throw new TypeError(`${arg} must be ${what}, not ${describe(v)}`);
  if (Number.isNaN(v)) throw new RangeError(`${arg} must be ${what}, not NaN`);
  return v;
}

/** `wait`: seconds in 0..MAX_WAIT_S, or undefined. @internal */
export function checkWait(v: unknown, arg = "wait"): number | undefined {
  if (v === undefined) return undefined;
  const n = checkNumber(v, arg, "a number of seconds");
  if (!(n >= 0 && n <= MAX_WAIT_S)) throw new RangeError(`${arg} must be between 0 and ${MAX_WAIT_S} seconds, not ${n}`);
  return n;
}

/** `ttl`: a whole number of seconds (the daemon checks 5..300), or undefined. @internal */
export function checkTtl(v: unknown, arg = "ttl"): number | undefined {
  if (v === undefined) return undefined;
  const n = checkNumber(v, arg, "a whole number of seconds");
  if (!Number.isSafeInteger(n)) throw new RangeError(`${arg} must be a whole number of seconds, not ${n}`);
  return n;
}

/** `bind`: `"pid"` or `"none"`, or undefined. @internal */
export function checkBind(v: unknown): "pid" | "none" | undefined {
  if (v === undefined || v === "pid" || v === "none") return v;
  throw new TypeError(`bind must be "pid" or "none", not ${describe(v)}`);
}

/** A timeout in ms: > 0, or 0 / Infinity for none (returned as 0), or undefined. @internal */
export function checkTimeoutMs(v: unknown, arg = "timeoutMs"): number | undefined {
  if (v === undefined) return undefined;
  const n = checkNumber(v, arg, "a number of milliseconds");
  if (!(n >= 0)) throw new RangeError(`${arg} must be >= 0 ms (0 or Infinity: no limit), not ${n}`);
  return Number.isFinite(n) ? n : 0;
}

/** `maxHold`: a whole number of seconds in MIN_HOLD_S..MAX_HOLD_S, or undefined. @internal */
export function checkMaxHold(v: unknown, arg = "maxHold"): number | undefined {
  if (v === undefined) return undefined;
  const n = checkNumber(v, arg, "a whole number of seconds");
  if (!Number.isSafeInteger(n)) throw new RangeError(`${arg} must be a whole number of seconds, not ${n}`);
  if (n < MIN_HOLD_S || n > MAX_HOLD_S) throw new RangeError(`${arg} must be between ${MIN_HOLD_S} and ${MAX_HOLD_S} seconds (366 days), not ${n}`);
  return n;
}

/** The index of the first control character (C0, DEL, C1) of `s`, or -1. */
function controlCharacter(s: string): number {
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    if (c < 0x20 || (c >= 0x7f && c < 0xa0)) return i;
  }
  return -1;
}

/**
 * `labels`: a plain object of at most MAX_LABELS string values, keys of 1-63 characters of
 * `A-Z a-z 0-9 _ . -`, values of at most 255 bytes of UTF-8 without control characters, or
 * undefined; returned as a copy. @internal
 */
export function checkLabels(v: unknown, arg = "labels"): Record<string, string> | undefined {
  if (v === undefined) return undefined;
  if (v === null || typeof v !== "object" || Array.isArray(v) || v instanceof Map)
    throw new TypeError(`${arg} must be an object of string values, not ${describe(v)}`);
  const entries = Object.entries(v as Record<string, unknown>);
  if (entries.length > MAX_LABELS) throw new RangeError(`${arg} holds at most ${MAX_LABELS} labels, not ${entries.length}`);
  const out: Record<string, string> = {};
  for (const [k, value] of entries) {
    if (!LABEL_KEY.test(k)) throw new TypeError(`${arg}: the key ${JSON.stringify(k)} must be 1-63 characters of A-Z a-z 0-9 _ . -`);
    const what = `${arg}[${JSON.stringify(k)}]`;
    if (typeof value !== "string") throw new TypeError(`${what} must be a string, not ${describe(value)}`);
    checkText(value, what);
    const bytes = new TextEncoder().encode(value).length;
    if (bytes > MAX_LABEL_VALUE_BYTES) throw new RangeError(`${what} must be at most ${MAX_LABEL_VALUE_BYTES} bytes of UTF-8, not ${bytes}`);
    const c = controlCharacter(value);
    if (c >= 0)
      throw new TypeError(`${what} contains the control character U+${value.charCodeAt(c).toString(16).toUpperCase().padStart(4, "0")} at index ${c}`);
    Object.defineProperty(out, k, { value, enumerable: true, writable: true, configurable: true });
  }
  return out;
}
