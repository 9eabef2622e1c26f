// Where mepd's socket is, found the way the `mep` CLI finds it.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { homedir } from "node:os";

/** Where a socket path came from (for diagnostics). */
export interface SocketResolution {
  /** The socket path. */
  path: string;
  /** `"option"`, `"env MEP_SOCKET"`, `"file <path>"`, `"env XDG_RUNTIME_DIR"` or `"default"`. */
  source: string;
}

/**
 * Finds mepd's socket the way the `mep` CLI does, in this order: `explicit` (a
 * {@link ClientOptions.socketPath}); `$MEP_SOCKET`; the top-level `socket = "..."` key of the
 * config file (`$MEP_CONFIG` if set, else `$XDG_CONFIG_HOME/mep/config.toml`, else
 * `~/.config/mep/config.toml`); `$XDG_RUNTIME_DIR/mep/mepd.sock`; `/run/mep/mepd.sock`.
 *
 * @param explicit a path given by the caller; wins over everything
 * @param env the environment to read (default `process.env`)
 * @throws Error when `$MEP_CONFIG` names a file that cannot be read or the `socket` key is not a string
 */
export function resolveSocketPath(explicit?: string, env: Record<string, string | undefined> = process.env): SocketResolution {
  if (explicit) return { path: explicit, source: "option" };
  const fromEnv = env["MEP_SOCKET"];
  if (fromEnv) return { path: fromEnv, source: "env MEP_SOCKET" };
  const explicitConfig = env["MEP_CONFIG"];
  const home = env["HOME"] || safeHomedir();
  const configFile = explicitConfig || join(env["XDG_CONFIG_HOME"] || join(home, ".config"), "mep", "config.toml");
  let text: string | undefined;
  try {
    text = readFileSync(configFile, "utf8");
  } catch (e) {
    const code = (e as { code?: string }).code;
    if (explicitConfig || (code !== "ENOENT" && code !== "ENOTDIR")) {
      throw new Error(`cannot read config file ${configFile}: ${(e as Error).message}`);
    }
  }
  if (text !== undefined) {
    const v = tomlTopLevelString(text, "socket", configFile);
    if (v) return { path: v, source: `file ${configFile}` };
  }
  const runtime = env["XDG_RUNTIME_DIR"];
  if (runtime) return { path: join(runtime, "mep", "mepd.sock"), source: "env XDG_RUNTIME_DIR" };
  return { path: "/run/mep/mepd.sock", source: "default" };
}

function safeHomedir(): string {
  try {
    return homedir() || "/";
  } catch {
    return "/";
  }
}

/**
 * The value of a top-level `key = "string"` in a TOML document (before any `[table]`), or
 * undefined. Handles basic ("…", with escapes) and literal ('…') strings and comments.
 * @internal
 */
export function tomlTopLevelString(text: string, key: string, file = "config"): string | undefined {
  const lines = text.split(/\r?\n/);
  for (const rawLine of lines) {
    const line = rawLine.trim();
    if (line === "" || line.startsWith("#")) continue;
    if (line.startsWith("[")) return undefined; // a table: top-level keys are over
    const m = /^("(?:[^"\\]|\\.)*"|'[^']*'|[A-Za-z0-9_-]+)\s*=\s*(.*)$/.exec(line);
    if (!m) continue;
    let k = m[1]!;
    if (k.startsWith('"')) k = JSON.parse(k) as string;
    else if (k.startsWith("'")) k = k.slice(1, -1);
    if (k !== key) continue;
    const rest = m[2]!;
    if (rest.startsWith("'''") || rest.startsWith('"""')) throw new Error(`${file}: multi-line strings are not supported for "${key}"`);
    if (rest.startsWith("'")) {
      const end = rest.indexOf("'", 1);
      if (end < 0) throw new Error(`${file}: unterminated string for "${key}"`);
      return rest.slice(1, end);
    }
    if (rest.startsWith('"')) {
      const sm = /^"((?:[^"\\]|\\.)*)"/.exec(rest);
      if (!sm) throw new Error(`${file}: unterminated string for "${key}"`);
      return unescapeToml(sm[1]!);
    }
    throw new Error(`${file}: key "${key}" must be a string`);
  }
  return undefined;
}

function unescapeToml(s: string): string {
  return s.replace(/\\(u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|.)/g, (_m, e: string) => {
    switch (e[0]) {
      case "b":
        return "\b";
      case "t":
        return "\t";
      case "n":
        return "\n";
      case "f":
        return "\f";
      case "r":
        return "\r";
      case '"':
        return '"';
      case "\\":
        return "\\";
      case "u":
      case "U":
        return String.fromCodePoint(parseInt(e.slice(1), 16));
      default:
        return "\\" + e;
    }
  });
}
