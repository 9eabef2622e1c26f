// JSON that keeps 64-bit integers exact: fencing tokens are unsigned 64-bit per the spec,
// and JSON.parse would round any integer above 2^53 - 1.

/** A parsed JSON value; integers outside ±(2^53 − 1) come back as `bigint`. */
export type JsonValue = null | boolean | number | bigint | string | JsonValue[] | { [k: string]: JsonValue };

/**
 * Parses JSON like `JSON.parse`, except that an integer literal outside the safe range is
 * returned as a `bigint` instead of a rounded number. {@link Client.request} answers are parsed
 * with it.
 *
 * @throws SyntaxError on malformed input
 */
export function parseJson(text: string): JsonValue {
  let i = 0;
  const n = text.length;
  const fail = (what: string): never => {
    throw new SyntaxError(`invalid JSON at offset ${i}: ${what}`);
  };
  const ws = () => {
    while (i < n) {
      const c = text.charCodeAt(i);
      if (c === 0x20 || c === 0x09 || c === 0x0a || c === 0x0d) i++;
      else break;
    }
  };
  const value = (depth: number): JsonValue => {
    if (depth > 512) fail("nested too deeply");
    ws();
    const c = text[i];
    if (c === "{") {
      i++;
      const o: { [k: string]: JsonValue } = {};
      ws();
      if (text[i] === "}") {
        i++;
        return o;
      }
      for (;;) {
        ws();
        if (text[i] !== '"') fail("expected a string key");
        const k = str();
        ws();
        if (text[i] !== ":") fail("expected ':'");
        i++;
        const v = value(depth + 1);
        Object.defineProperty(o, k, { value: v, enumerable: true, writable: true, configurable: true });
        ws();
        if (text[i] === ",") {
          i++;
          continue;
        }
        if (text[i] === "}") {
          i++;
          return o;
        }
        fail("expected ',' or '}'");
      }
    }
    if (c === "[") {
      i++;
      const a: JsonValue[] = [];
      ws();
      if (text[i] === "]") {
        i++;
        return a;
      }
      for (;;) {
        a.push(value(depth + 1));
        ws();
        if (text[i] === ",") {
          i++;
          continue;
        }
        if (text[i] === "]") {
          i++;
          return a;
        }
        fail("expected ',' or ']'");
      }
    }
    if (c === '"') return str();
    if (c === "t" && text.startsWith("true", i)) {
      i += 4;
      return true;
    }
    if (c === "f" && text.startsWith("false", i)) {
      i += 5;
      return false;
    }
    if (c === "n" && text.startsWith("null", i)) {
      i += 4;
      return null;
    }
    return num();
  };
  const str = (): string => {
    // text[i] === '"'
    const start = i;
    i++;
    let simple = true;
    while (i < n) {
      const c = text[i];
      if (c === '"') break;
      if (c === "\\") {
        simple = false;
        i += 2;
        continue;
      }
      if (text.charCodeAt(i) < 0x20) fail("control character in string");
      i++;
    }
    if (i >= n) fail("unterminated string");
    i++;
    const raw = text.slice(start, i);
    return simple ? raw.slice(1, -1) : (JSON.parse(raw) as string);
  };
  const num = (): number | bigint => {
    const m = /-?(?:0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?/y;
    m.lastIndex = i;
    const r = m.exec(text);
    if (!r) return fail("unexpected character");
    i = m.lastIndex;
    const lit = r[0];
    if (r[1] === undefined && r[2] === undefined) {
      const v = Number(lit);
      return Number.isSafeInteger(v) ? v : BigInt(lit);
    }
    return Number(lit);
  };
  const out = value(0);
  ws();
  if (i !== n) fail("trailing characters");
  return out;
}

/**
 * `JSON.stringify` that writes a `bigint` as a bare integer literal.
 * @internal
 */
export function stringifyJson(v: unknown): string {
  const marks: string[] = [];
  const s = JSON.stringify(v, (_k, x: unknown) => {
    if (typeof x === "bigint") {
      marks.push(x.toString());
      return `\u0000big${marks.length - 1}\u0000`;
    }
    return x;
  });
  if (marks.length === 0) return s;
  return s.replace(/"\\u0000big(\d+)\\u0000"/g, (_m, k: string) => marks[Number(k)] ?? "0");
}

/** A fencing token (number, bigint or decimal string) as a bigint; throws if it is none. @internal */
export function toToken(v: unknown, what = "fencing_token"): bigint {
  if (typeof v === "bigint") return v;
  if (typeof v === "number" && Number.isInteger(v)) return BigInt(v);
  if (typeof v === "string" && /^\d+$/.test(v)) return BigInt(v);
  throw new TypeError(`${what} is not an integer: ${String(v)}`);
}

/** Like {@link toToken} but undefined for a missing value. @internal */
export function toTokenOpt(v: unknown): bigint | undefined {
  return v === undefined || v === null ? undefined : toToken(v);
}
