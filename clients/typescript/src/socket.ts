// Where mepd's socket is, found the way the `mep` CLI finds it (cli/daemon_client.cpp,
// common/config.cpp), with the config file read and checked exactly as the CLI does.
import { existsSync, readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import { homedir } from "node:os";
import { ConfigError } from "./errors.js";

/** Where a socket path came from (for diagnostics). */
export interface SocketResolution {
  /** The socket path. */
  path: string;
  /** `"option"`, `"env MEP_SOCKET"`, `"file <path>"`, `"env XDG_RUNTIME_DIR"` or `"default"`. */
  source: string;
}

/**
 * Finds mepd's socket the way the `mep` CLI does, in this order: `explicit` (a
 * {@link ClientOptions.socketPath}); `$MEP_SOCKET`; the top-level `socket` key of the
 * config file (`$MEP_CONFIG` if set, else `$XDG_CONFIG_HOME/mep/config.toml`, else
 * `~/.config/mep/config.toml`); `$XDG_RUNTIME_DIR/mep/mepd.sock`; `/run/mep/mepd.sock`.
 *
 * Unless `explicit` is given, the config file is read and checked first, whatever
 * `$MEP_SOCKET` says, as the CLI does (see {@link loadConfig}).
 *
 * @param explicit a path given by the caller; wins over everything (no config file is read)
 * @param env the environment to read (default `process.env`)
 * @throws ConfigError where the CLI refuses the config file (it exits 2)
 */
export function resolveSocketPath(explicit?: string, env: Record<string, string | undefined> = process.env): SocketResolution {
  if (explicit) return { path: explicit, source: "option" };
  const config = loadConfig(env);
  const fromEnv = env["MEP_SOCKET"];
  if (fromEnv) return { path: fromEnv, source: "env MEP_SOCKET" };
  const v = config.values["socket"];
  if (v !== undefined) return { path: v, source: `file ${config.file}` };
  const runtime = env["XDG_RUNTIME_DIR"];
  if (runtime) return { path: join(runtime, "mep", "mepd.sock"), source: "env XDG_RUNTIME_DIR" };
  return { path: "/run/mep/mepd.sock", source: "default" };
}

/** The settings of the config file ({@link loadConfig}). */
export interface ConfigFile {
  /** The file read, or undefined when there is none (the default file may be absent). */
  file: string | undefined;
  /** Its top-level settings, each as the text the CLI uses (`5` → `"5"`, `true` → `"true"`). */
  values: Record<string, string>;
}

/**
 * Reads the config file as the CLI does: `$MEP_CONFIG` (it must exist), else
 * `$XDG_CONFIG_HOME/mep/config.toml` or `~/.config/mep/config.toml` (may be absent).
 * @throws ConfigError when `$MEP_CONFIG` names a missing file, or the file is not a regular
 * file, cannot be read, or is not one the CLI accepts (see {@link parseConfig})
 */
export function loadConfig(env: Record<string, string | undefined> = process.env): ConfigFile {
  const explicitConfig = env["MEP_CONFIG"];
  const home = env["HOME"] || safeHomedir();
  const file = explicitConfig || join(env["XDG_CONFIG_HOME"] || join(home, ".config"), "mep", "config.toml");
  if (!existsSync(file)) {
    if (explicitConfig) throw new ConfigError(file, `config file ${file} does not exist`);
    return { file: undefined, values: {} };
  }
  let data: Uint8Array;
  try {
    if (!statSync(file).isFile()) throw new ConfigError(file, `config file ${file} is not a regular file`);
    data = readFileSync(file);
  } catch (e) {
    if (e instanceof ConfigError) throw e;
    throw new ConfigError(file, `config file ${file} cannot be read: ${(e as Error)?.message ?? String(e)}`);
  }
  return { file, values: parseConfig(data, file) };
}

function safeHomedir(): string {
  try {
    return homedir() || "/";
  } catch {
    return "/";
  }
}

// ---- the config file: the TOML the CLI accepts -------------------------------------------------
//
// The CLI parses the file with toml++ and then refuses any top-level value that is not a string,
// an integer or a boolean; integers and booleans are used as their text. So a config the CLI
// accepts is a flat list of `key = scalar` lines, and this reader understands exactly that: bare
// and quoted keys, the four kinds of strings (TOML 1.0 escapes), integers (decimal with _
// separators, 0x, 0o, 0b; 64-bit) and booleans, comments, blank lines. A table header, a dotted
// key, an array, an inline table, a float or a date is the CLI's "must be a string, integer or
// boolean"; anything else is not TOML. Like the CLI it works on bytes: non-ASCII is allowed in
// comments (any bytes) and in strings (valid UTF-8 only), nowhere else; a UTF-8 BOM is skipped.
// (The same reader as the Python SDK's mep/_config.py.)

const BARE_KEY = /[A-Za-z0-9_-]+/y;
const VALUE_TOKEN = /[0-9A-Za-z_+.:-]+/y;
const DEC_INT = /^[+-]?(?:0|[1-9](?:_?[0-9])*)$/;
const PREFIXED_INT = /^(?:0x[0-9A-Fa-f](?:_?[0-9A-Fa-f])*|0o[0-7](?:_?[0-7])*|0b[01](?:_?[01])*)$/;
const FLOAT = /^[+-]?(?:inf|nan|(?:0|[1-9](?:_?[0-9])*)(?:\.[0-9](?:_?[0-9])*)?(?:[eE][+-]?[0-9](?:_?[0-9])*)?)$/;
const DATE_TIME =
  /^(?:[0-9]{4}-[0-9]{2}-[0-9]{2}(?:[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?(?:[Zz]|[+-][0-9]{2}:[0-9]{2})?)?|[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?)$/;
const ESCAPES: Record<string, string> = { b: "\b", t: "\t", n: "\n", f: "\f", r: "\r", '"': '"', "\\": "\\" };
const INT64_MIN = -(2n ** 63n);
const INT64_MAX = 2n ** 63n - 1n;
const utf8 = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true });

class ConfigReader {
  readonly #t: string; // the file's bytes, one character per byte (latin1)
  #i = 0;
  #line = 1;
  readonly #label: string;

  constructor(data: Uint8Array, label: string) {
    let t = Buffer.from(data).toString("latin1");
    if (t.startsWith("\u00ef\u00bb\u00bf")) t = t.slice(3);
    this.#t = t;
    this.#label = label;
  }

  #error(what: string): ConfigError {
    return new ConfigError(this.#label, `config file ${this.#label}:${this.#line}: ${what}`);
  }

  #notScalar(key: string): ConfigError {
    return new ConfigError(this.#label, `config file ${this.#label}: key "${key}" must be a string, integer or boolean`);
  }

  #at(k = 0): string {
    return this.#t[this.#i + k] ?? "";
  }

  #skipWs(): void {
    while (this.#at() === " " || this.#at() === "\t") this.#i++;
  }

  #newlineLen(): number {
    const c = this.#at();
    if (c === "\n") return 1;
    if (c === "\r" && this.#at(1) === "\n") return 2;
    return 0;
  }

  #comment(): void {
    while (this.#i < this.#t.length && !this.#newlineLen()) {
      const o = this.#t.charCodeAt(this.#i);
      if ((o < 0x20 && o !== 0x09) || o === 0x7f) throw this.#error(`control character U+${hex4(o)} in a comment`);
      this.#i++;
    }
  }

  #outside(c: string): ConfigError {
    if (c.charCodeAt(0) >= 0x80) return this.#error("a non-ASCII character outside a quoted string or a comment");
    return this.#error(`unexpected character ${JSON.stringify(c)}`);
  }

  /** A string whose opening delimiter was consumed; returns its value. */
  #string(quote: string, multi: boolean): string {
    const bytes: number[] = [];
    if (multi) {
      const nl = this.#newlineLen();
      if (nl) {
        this.#i += nl;
        this.#line++;
      }
    }
    for (;;) {
      if (this.#i >= this.#t.length) throw this.#error("unterminated string");
      const c = this.#at();
      if (c === quote) {
        if (!multi) {
          this.#i++;
          break;
        }
        let run = 0;
        while (this.#at(run) === quote) run++;
        if (run >= 3) {
          if (run > 5) throw this.#error("too many quotes at the end of a multi-line string");
          for (let k = 0; k < run - 3; k++) bytes.push(quote.charCodeAt(0));
          this.#i += run;
          break;
        }
        for (let k = 0; k < run; k++) bytes.push(quote.charCodeAt(0));
        this.#i += run;
        continue;
      }
      const nl = this.#newlineLen();
      if (nl) {
        if (!multi) throw this.#error("unterminated string");
        bytes.push(0x0a);
        this.#i += nl;
        this.#line++;
        continue;
      }
      if (c === "\\" && quote === '"') {
        this.#escape(bytes, multi);
        continue;
      }
      const o = c.charCodeAt(0);
      if ((o < 0x20 && o !== 0x09) || o === 0x7f) throw this.#error(`control character U+${hex4(o)} in a string`);
      bytes.push(o);
      this.#i++;
    }
    try {
      return utf8.decode(Uint8Array.from(bytes));
    } catch {
      throw this.#error("invalid UTF-8 in a string");
    }
  }

  #escape(bytes: number[], multi: boolean): void {
    const e = this.#at(1);
    if (multi && (e === " " || e === "\t" || e === "\r" || e === "\n")) {
      // A line-ending backslash: whitespace to the newline, then it and all whitespace and
      // newlines after it are dropped.
      this.#i++;
      this.#skipWs();
      if (!this.#newlineLen()) throw this.#error("a backslash followed by whitespace must end the line");
      for (;;) {
        const nl = this.#newlineLen();
        if (nl) {
          this.#i += nl;
          this.#line++;
        } else if (this.#at() === " " || this.#at() === "\t") this.#i++;
        else return;
      }
    }
    const simple = ESCAPES[e];
    if (simple !== undefined) {
      bytes.push(simple.charCodeAt(0));
      this.#i += 2;
      return;
    }
    if (e === "u" || e === "U") {
      const n = e === "u" ? 4 : 8;
      const digits = this.#t.slice(this.#i + 2, this.#i + 2 + n);
      if (digits.length !== n || !/^[0-9A-Fa-f]+$/.test(digits)) throw this.#error(`escape sequence \\${e} needs ${n} hexadecimal digits`);
      const cp = parseInt(digits, 16);
      if (cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) throw this.#error(`escape sequence \\${e}${digits} is not a Unicode scalar value`);
      for (const b of Buffer.from(String.fromCodePoint(cp), "utf8")) bytes.push(b);
      this.#i += 2 + n;
      return;
    }
    throw this.#error(`unknown escape sequence '\\${e || "EOF"}'`);
  }

  #simpleKey(): string {
    const c = this.#at();
    if (c === '"' || c === "'") {
      this.#i++;
      return this.#string(c, false);
    }
    BARE_KEY.lastIndex = this.#i;
    const m = BARE_KEY.exec(this.#t);
    if (!m) throw c ? this.#outside(c) : this.#error("expected a key");
    this.#i = BARE_KEY.lastIndex;
    return m[0];
  }

  #value(key: string): string {
    for (const q of ['"', "'"]) {
      if (this.#t.startsWith(q.repeat(3), this.#i)) {
        this.#i += 3;
        return this.#string(q, true);
      }
      if (this.#t.startsWith(q, this.#i)) {
        this.#i++;
        return this.#string(q, false);
      }
    }
    const c = this.#at();
    if (c === "[" || c === "{") throw this.#notScalar(key); // an array or an inline table
    VALUE_TOKEN.lastIndex = this.#i;
    const m = VALUE_TOKEN.exec(this.#t);
    if (!m) {
      if (!c || this.#newlineLen() || c === "#") throw this.#error(`expected a value for ${JSON.stringify(key)}`);
      throw this.#outside(c);
    }
    const tok = m[0];
    this.#i = VALUE_TOKEN.lastIndex;
    if (tok === "true" || tok === "false") return tok;
    if (DEC_INT.test(tok) || PREFIXED_INT.test(tok)) {
      const digits = tok.replace(/_/g, "");
      const neg = digits.startsWith("-");
      const v = BigInt(digits.replace(/^[+-]/, ""));
      const n = neg ? -v : v;
      if (n < INT64_MIN || n > INT64_MAX) throw this.#error(`'${tok}' is not representable in 64 bits`);
      return n.toString();
    }
    if (FLOAT.test(tok) || DATE_TIME.test(tok)) throw this.#notScalar(key); // a float or a date/time
    throw this.#error(`${JSON.stringify(tok)} is not a TOML value`);
  }

  read(): Record<string, string> {
    const values: Record<string, string> = Object.create(null) as Record<string, string>;
    for (;;) {
      this.#skipWs();
      if (this.#i >= this.#t.length) return { ...values };
      const nl = this.#newlineLen();
      if (nl) {
        this.#i += nl;
        this.#line++;
        continue;
      }
      const c = this.#at();
      if (c === "#") {
        this.#comment();
        continue;
      }
      if (c === "[") {
        // A table header: a top-level key whose value is a table.
        this.#i += this.#at(1) === "[" ? 2 : 1;
        this.#skipWs();
        throw this.#notScalar(this.#simpleKey());
      }
      const key = this.#simpleKey();
      this.#skipWs();
      if (this.#at() === ".") throw this.#notScalar(key); // a dotted key: a table
      if (this.#at() !== "=") throw this.#error(`expected '=' after the key ${JSON.stringify(key)}`);
      this.#i++;
      this.#skipWs();
      const value = this.#value(key);
      if (Object.prototype.hasOwnProperty.call(values, key)) throw this.#error(`cannot redefine the key ${JSON.stringify(key)}`);
      values[key] = value;
      this.#skipWs();
      if (this.#at() === "#") this.#comment();
      if (this.#i < this.#t.length && !this.#newlineLen())
        throw this.#error(`expected a comment or a new line after the value of ${JSON.stringify(key)}, saw ${JSON.stringify(this.#at())}`);
    }
  }
}

function hex4(n: number): string {
  return n.toString(16).toUpperCase().padStart(4, "0");
}

/**
 * The top-level settings of a config file, each as the text the CLI uses (an integer in
 * decimal, a boolean as `true`/`false`). `data` is the file's bytes (a string is taken as UTF-8).
 * @throws ConfigError where the CLI refuses the file
 */
export function parseConfig(data: Uint8Array | string, label = "config"): Record<string, string> {
  return new ConfigReader(typeof data === "string" ? Buffer.from(data, "utf8") : data, label).read();
}
