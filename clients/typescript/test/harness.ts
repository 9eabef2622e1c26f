// Test harness: real `mep server`, `mep store` and `mepd` processes in private temporary
// directories (HOME and XDG_* inside), stopped by PID (SIGCONT, SIGTERM, then SIGKILL).
// Every wait is bounded. No mocks of the daemon.
import { spawn, spawnSync, type ChildProcess } from "node:child_process";
import { request } from "node:http";
import { closeSync, existsSync, mkdirSync, mkdtempSync, openSync, readFileSync, rmSync, statSync, writeFileSync } from "node:fs";
import { join, resolve } from "node:path";
import { tmpdir } from "node:os";
import { Client } from "@mep/client";

// Made absolute: the processes run with the sandbox as their working directory.
export const MEP_BIN = process.env["MEP_BIN"] ? resolve(process.env["MEP_BIN"]) : "";
export const MEPD_BIN = process.env["MEPD_BIN"] ? resolve(process.env["MEPD_BIN"]) : "";
const START_TIMEOUT_MS = 30000;
const STOP_GRACE_MS = 5000;

function executable(p: string): boolean {
  try {
    return statSync(p).isFile();
  } catch {
    return false;
  }
}

/** Why the tests that need real processes are skipped, or undefined when they can run. */
export const binSkip: string | undefined = (() => {
  if (!MEP_BIN || !MEPD_BIN)
    return "MEP_BIN and MEPD_BIN are not set (point them at the mep and mepd binaries, e.g. MEP_BIN=../../build/cli/mep MEPD_BIN=../../build/daemon/mepd npm test)";
  if (!executable(MEP_BIN)) return `MEP_BIN=${MEP_BIN} is not a file`;
  if (!executable(MEPD_BIN)) return `MEPD_BIN=${MEPD_BIN} is not a file`;
  return undefined;
})();

/**
 * Why the data-plane tests are skipped, or undefined. `mep store --help` must exit 0 AND be
 * the store's own help (a CLI without the subcommand prints the top-level help and exits 0
 * too), and mepd must take `--store`.
 */
export const storeSkip: string | undefined = (() => {
  if (binSkip) return binSkip;
  const h = spawnSync(MEP_BIN, ["store", "--help"], { encoding: "utf8", timeout: 10000, env: cleanBaseEnv() });
  const text = `${h.stdout ?? ""}${h.stderr ?? ""}`;
  if (h.status !== 0) return `'mep store --help' exited ${h.status}: this mep has no data plane yet`;
  if (!/--dir\b/.test(text) || !/--listen\b/.test(text)) return "'mep store --help' printed the top-level help: this mep has no 'store' subcommand yet";
  const d = spawnSync(MEPD_BIN, ["--help"], { encoding: "utf8", timeout: 10000, env: cleanBaseEnv() });
  if (!/--store\b/.test(`${d.stdout ?? ""}${d.stderr ?? ""}`)) return "this mepd has no --store option yet";
  return undefined;
})();

if (binSkip) console.log(`# mep process tests skipped: ${binSkip}`);
else if (storeSkip) console.log(`# mep data-plane tests skipped: ${storeSkip}`);

function cleanBaseEnv(): Record<string, string> {
  const env: Record<string, string> = {};
  for (const [k, v] of Object.entries(process.env)) {
    if (v === undefined || k.startsWith("MEP_") || k.startsWith("XDG_")) continue;
    env[k] = v;
  }
  return env;
}

const setpriv = ["/usr/bin/setpriv", "/bin/setpriv"].find((p) => existsSync(p));
const live = new Set<Proc>();
process.on("exit", () => {
  for (const p of live) {
    try {
      if (p.pid) process.kill(p.pid, "SIGKILL");
    } catch {
      /* gone */
    }
  }
});

/** Sleeps `ms`. */
export function sleep(ms: number): Promise<void> {
  return new Promise((r) => setTimeout(r, ms));
}

/** Polls `pred` every 20 ms until it is truthy or `timeoutMs` passed; returns its last value. */
export async function waitFor<T>(pred: () => T | Promise<T>, timeoutMs: number, what = "condition"): Promise<T> {
  const end = performance.now() + timeoutMs;
  for (;;) {
    const v = await pred();
    if (v) return v;
    if (performance.now() > end) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await sleep(20);
  }
}

/** One child process whose stdout and stderr go to a log file. */
export class Proc {
  readonly child: ChildProcess;
  readonly pid: number;
  #exited = false;
  #exit: Promise<void>;

  constructor(
    readonly label: string,
    argv: string[],
    env: Record<string, string>,
    readonly logPath: string,
    cwd?: string,
  ) {
    const fd = openSync(logPath, "a");
    // setpriv --pdeathsig: the child dies with this test process even if it is SIGKILLed.
    const [cmd, ...args] = setpriv ? [setpriv, "--pdeathsig", "KILL", "--", ...argv] : argv;
    this.child = spawn(cmd!, args, { env, cwd, stdio: ["ignore", fd, fd] });
    closeSync(fd);
    if (!this.child.pid) throw new Error(`cannot start ${label}: ${argv.join(" ")}`);
    this.pid = this.child.pid;
    live.add(this);
    this.#exit = new Promise((r) =>
      this.child.once("exit", () => {
        this.#exited = true;
        live.delete(this);
        r();
      }),
    );
  }

  get alive(): boolean {
    return !this.#exited;
  }

  log(): string {
    try {
      return readFileSync(this.logPath, "utf8");
    } catch {
      return "";
    }
  }

  /** Waits until the log matches `re`; returns the match. */
  async waitForLog(re: RegExp, timeoutMs = START_TIMEOUT_MS): Promise<RegExpMatchArray> {
    const end = performance.now() + timeoutMs;
    for (;;) {
      const m = this.log().match(re);
      if (m) return m;
      if (!this.alive) throw new Error(`${this.label} exited before logging ${re}:\n${this.log()}`);
      if (performance.now() > end) throw new Error(`${this.label} did not log ${re} within ${timeoutMs} ms:\n${this.log()}`);
      await sleep(20);
    }
  }

  signal(sig: string): void {
    if (this.alive) process.kill(this.pid, sig);
  }

  /** Waits for exit at most `ms`; true if it exited. */
  async waitExit(ms: number): Promise<boolean> {
    if (!this.alive) return true;
    let t: NodeTimer | undefined;
    const timedOut = new Promise<boolean>((r) => (t = setTimeout(() => r(false), ms)));
    const r = await Promise.race([this.#exit.then(() => true), timedOut]);
    clearTimeout(t);
    return r;
  }

  /** SIGCONT (in case it is stopped), SIGTERM, SIGKILL after a grace; always reaps. */
  async stop(): Promise<void> {
    if (!this.alive) return;
    try {
      process.kill(this.pid, "SIGCONT");
      process.kill(this.pid, "SIGTERM");
    } catch {
      /* gone */
    }
    if (await this.waitExit(STOP_GRACE_MS)) return;
    try {
      process.kill(this.pid, "SIGKILL");
    } catch {
      /* gone */
    }
    await this.waitExit(STOP_GRACE_MS);
  }

  async kill9(): Promise<void> {
    this.signal("SIGKILL");
    await this.waitExit(STOP_GRACE_MS);
  }
}

/** A running `mep server`. */
export interface Server {
  proc: Proc;
  url: string;
  db: string;
}

/** A running mepd. */
export interface Daemon {
  proc: Proc;
  socket: string;
  stateDir: string;
  client: Client;
  argv: string[];
  /** Starts it again (same socket and state) after a stop. */
  restart(): Promise<void>;
}

/** A running `mep store`. */
export interface Store {
  proc: Proc;
  url: string;
  /** A bearer token the store accepts (`mep token new`), and the file that holds it. */
  token: string;
  tokenFile: string;
}

/** A private directory with HOME and XDG_* inside, and the processes started in it. */
export class Sandbox implements AsyncDisposable {
  readonly dir: string;
  readonly env: Record<string, string>;
  readonly procs: Proc[] = [];
  #n = 0;

  private constructor(dir: string) {
    this.dir = dir;
    const home = join(dir, "home");
    const env = cleanBaseEnv();
    env["HOME"] = home;
    env["XDG_CONFIG_HOME"] = join(home, "config");
    env["XDG_STATE_HOME"] = join(home, "state");
    env["XDG_RUNTIME_DIR"] = join(home, "run");
    for (const d of ["config", "state", "run"]) mkdirSync(join(home, d), { recursive: true, mode: 0o700 });
    this.env = env;
  }

  static create(): Sandbox {
    return new Sandbox(mkdtempSync(join(tmpdir(), "mep-ts-")));
  }

  /** A path inside the sandbox. */
  path(...parts: string[]): string {
    return join(this.dir, ...parts);
  }

  spawn(label: string, argv: string[], env: Record<string, string> = this.env): Proc {
    const p = new Proc(label, argv, env, this.path(`${label.replace(/\W+/g, "-")}-${this.#n++}.log`), this.dir);
    this.procs.push(p);
    return p;
  }

  async startServer(): Promise<Server> {
    const db = "sqlite:" + this.path("control.db");
    const proc = this.spawn("mep-server", [MEP_BIN, "server", "--db", db, "--listen", "127.0.0.1:0"]);
    const m = await proc.waitForLog(/mep server listening on (http:\/\/127\.0\.0\.1:\d+)/);
    return { proc, url: m[1]!, db };
  }

  /** A bearer token for `tenant` (of `scope` lease or admin) on the server's database, written to a 0600 file; returns the file. */
  tokenFile(server: Server, tenant: string, scope: "lease" | "admin" = "lease"): string {
    const scopeArgs = scope === "lease" ? [] : ["--scope", scope]; // the default (and all an older mep knows)
    const r = spawnSync(MEP_BIN, ["token", "create", "--db", server.db, "--tenant", tenant, ...scopeArgs], { encoding: "utf8", env: this.env, timeout: 20000 });
    if (r.status !== 0) throw new Error(`mep token create failed (${r.status}): ${r.stderr}`);
    const token = r.stdout.trim();
    const file = this.path(`token-${tenant}-${this.#n++}`);
    writeFileSync(file, token + "\n", { mode: 0o600 });
    return file;
  }

  async startStore(): Promise<Store> {
    const n = this.#n++;
    const dir = this.path(`store-${n}`);
    mkdirSync(dir, { recursive: true });
    // Every request to the store is authenticated: a token for the daemons, its hash for the store.
    const made = spawnSync(MEP_BIN, ["token", "new"], { encoding: "utf8", env: this.env, timeout: 20000 });
    if (made.status !== 0) throw new Error(`mep token new failed: ${made.stderr}`);
    const token = made.stdout.trim();
    const tokenFile = this.path(`store-${n}.token`);
    writeFileSync(tokenFile, token + "\n", { mode: 0o600 });
    const hashed = spawnSync(MEP_BIN, ["token", "hash", token], { encoding: "utf8", env: this.env, timeout: 20000 });
    if (hashed.status !== 0) throw new Error(`mep token hash failed: ${hashed.stderr}`);
    const hashes = this.path(`store-${n}.hashes`);
    writeFileSync(hashes, hashed.stdout);
    const proc = this.spawn("mep-store", [MEP_BIN, "store", "--listen", "127.0.0.1:0", "--dir", dir, "--token-file", hashes]);
    const m = await proc.waitForLog(/mep store listening on (http:\/\/[^\s]+)/);
    return { proc, url: m[1]!, token, tokenFile };
  }

  async startMepd(
    opts: { tag?: string; controlPlane?: string; tokenFile?: string; store?: Store; extraArgs?: string[] } = {},
  ): Promise<Daemon> {
    const tag = opts.tag ?? `mepd${this.#n++}`;
    const socket = this.path(`${tag}-run`, "mep", "mepd.sock");
    const stateDir = this.path(`${tag}-state`);
    const argv = [MEPD_BIN, "--socket", socket, "--state-dir", stateDir];
    if (opts.controlPlane) argv.push("--control-plane", opts.controlPlane, "--token-file", opts.tokenFile ?? "");
    if (opts.store) argv.push("--store", opts.store.url, "--store-token-file", opts.store.tokenFile);
    argv.push(...(opts.extraArgs ?? []));
    const start = async (): Promise<Proc> => {
      const proc = this.spawn(tag, argv);
      await proc.waitForLog(new RegExp("listening on " + socket.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")));
      return proc;
    };
    const d: Daemon = {
      proc: await start(),
      socket,
      stateDir,
      client: new Client({ socketPath: socket }),
      argv,
      restart: async () => {
        d.proc = await start();
      },
    };
    await d.client.health();
    return d;
  }

  async [Symbol.asyncDispose](): Promise<void> {
    for (const p of [...this.procs].reverse()) await p.stop();
    if (!process.env["MEP_TEST_KEEP"]) rmSync(this.dir, { recursive: true, force: true });
  }
}

/** The server's `GET /v1/leases/{name}` (holder, granted_at, hold_until, …) with the token in `tokenFile`. */
export function serverLease(server: Server, name: string, tokenFile: string): Promise<Record<string, unknown>> {
  const u = new URL(server.url);
  const token = readFileSync(tokenFile, "utf8").trim();
  return new Promise((resolveAnswer, reject) => {
    const req = request(
      { host: u.hostname, port: Number(u.port), method: "GET", path: "/v1/leases/" + encodeURIComponent(name), headers: { Authorization: `Bearer ${token}` }, agent: false },
      (res) => {
        const chunks: Uint8Array[] = [];
        res.on("data", (c: Uint8Array) => chunks.push(c));
        res.on("end", () => {
          const text = Buffer.concat(chunks).toString("utf8");
          if (res.statusCode !== 200) reject(new Error(`GET /v1/leases/${name} answered ${res.statusCode}: ${text}`));
          else resolveAnswer(JSON.parse(text) as Record<string, unknown>);
        });
      },
    );
    req.setTimeout(20000, () => req.destroy(new Error("the server did not answer")));
    req.on("error", reject);
    req.end();
  });
}

/** Creates a new, empty memory file through `client` in the sandbox; returns its path. */
export async function newMemory(sb: Sandbox, client: Client, name: string): Promise<string> {
  const p = sb.path(`${name}.uai`);
  await client.init(p);
  return p;
}
