// The Client: one mepd socket, typed calls for every endpoint of the socket API.
import "./polyfill.js";
import { existsSync } from "node:fs";
import { checkBind, checkLabels, checkMaxHold, checkOptions, checkPath, checkText, checkTimeoutMs, checkTtl, checkWait } from "./args.js";
import { errorFrom, expectJson, openNdjson, rawRequest, releaseProblem, type OpenStream } from "./http.js";
import type { JsonValue } from "./json.js";
import { Lease, currentLease, type LeaseOptions } from "./lease.js";
import type { MepError } from "./errors.js";
import { resolveSocketPath } from "./socket.js";
import {
  parseBranch,
  parseEvent,
  parseFetch,
  parseHealth,
  parseIdentity,
  parseLeaseInfo,
  parseLineage,
  parseSync,
  parseVerify,
  type BranchResult,
  type DaemonEvent,
  type DaemonStatus,
  type FetchResult,
  type Health,
  type LeaseInfo,
  type Lineage,
  type MemoryIdentity,
  type SyncResult,
  type VerifyResult,
} from "./types.js";

/** Options of a {@link Client}. */
export interface ClientOptions {
  /** The mepd socket; found like the CLI finds it when omitted (see {@link resolveSocketPath}). */
  socketPath?: string;
  /**
   * How long one request may take, in ms (default 30000; 0: no limit). An attach with `wait`
   * gets the wait on top. Not applied to {@link Client.sync} and {@link Client.fetch}, whose
   * answers come only once the transfer is done (see {@link TransferOptions}).
   */
  timeoutMs?: number;
  /** The environment to find the socket in (default `process.env`). */
  env?: Record<string, string | undefined>;
}

/** The daemon's event stream as an async iterator ({@link Client.events}). */
export interface DaemonEventStream extends AsyncIterableIterator<DaemonEvent> {
  /** Resolves once the daemon accepted the subscription (every later event will be seen). */
  readonly ready: Promise<void>;
  /** Ends the stream (the iterator then finishes). */
  close(): void;
}

/** Options of {@link Client.events}. */
export interface EventsOptions {
  /** Ends the iteration when aborted. */
  signal?: AbortSignal;
  /** Keep the process alive while the stream is open (default true). */
  ref?: boolean;
}

/** Options of {@link Client.sync}, {@link Lease.sync} and {@link Client.fetch}. */
export interface TransferOptions {
  /**
   * Give up (with {@link Unavailable}) when mepd has not answered within this many ms. By
   * default there is no limit: mepd answers only once the upload or download is done, however
   * long a large file takes (it gives up by itself on a transfer that makes no progress for 30 s).
   * The client's `timeoutMs` does not apply.
   */
  timeoutMs?: number;
}

/** Options of {@link Client.sync}. */
export interface SyncOptions extends TransferOptions {
  /** Only this lease's file: another agent's lease under the name since is {@link LeaseNotFound}. */
  leaseId?: string;
}

/** A lineage query: a memory file's path or a memory id. */
export type LineageQuery = string | { path: string } | { id: string };

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

/**
 * A client of one mepd (HTTP/1.1 + JSON over its Unix socket). Every call opens its own
 * connection; the daemon binds `bind: "pid"` leases to this process (SO_PEERCRED).
 * Errors are the typed {@link MepError} subclasses of the problem codes.
 */
export class Client {
  /** The socket this client talks to. */
  readonly socketPath: string;
  /** Where {@link socketPath} came from (`"option"`, `"env MEP_SOCKET"`, `"file …"`, …). */
  readonly socketSource: string;
  /** Per-request timeout in ms. */
  readonly timeoutMs: number;

  /**
   * @throws ConfigError when no `socketPath` is given and the config file cannot be used (the
   * files the `mep` CLI refuses: see {@link resolveSocketPath}); TypeError for a wrong option.
   */
  constructor(options: ClientOptions = {}) {
    checkOptions(options);
    if (options.socketPath !== undefined && checkText(options.socketPath, "socketPath") === "")
      // An empty path (an unset variable) would silently mean $MEP_SOCKET or the config file's.
      throw new TypeError("socketPath must not be empty (leave it out for $MEP_SOCKET, the config file or the default)");
    const timeoutMs = checkTimeoutMs(options.timeoutMs);
    const r = resolveSocketPath(options.socketPath, options.env ?? process.env);
    this.socketPath = r.path;
    this.socketSource = r.source;
    this.timeoutMs = timeoutMs ?? 30000;
  }

  /**
   * One raw call: `method path` with a JSON `body`; resolves with the parsed JSON answer of a
   * 2xx, throws the typed error of anything else. For endpoints this version does not wrap.
   */
  async request(method: string, path: string, body?: unknown, opts: { timeoutMs?: number; signal?: AbortSignal } = {}): Promise<JsonValue | undefined> {
    const r = await rawRequest(this.socketPath, method, path, body, { timeoutMs: opts.timeoutMs ?? this.timeoutMs, signal: opts.signal });
    if (r.status < 200 || r.status > 299) throw errorFrom(r);
    return r.json;
  }

  #call(method: string, path: string, body: unknown, expect: number | number[], timeoutMs = this.timeoutMs) {
    return expectJson(this.socketPath, method, path, body, { timeoutMs }, expect);
  }

  // ---- leases ----------------------------------------------------------------------------

  /**
   * Claims `name` for the memory file `path` and returns a watched {@link Lease}: use with
   * `await using` or call {@link Lease.release}. The event stream is opened before the attach.
   *
   * @param name the agent's display name ("My Agent"; canonical "myagent")
   * @param path the `.uai` memory file (relative to the current directory); must exist — create it with {@link init}
   * @param options `ttl`, `wait`, `bind`, `labels` and `maxHold`: see {@link LeaseOptions}
   * @throws NameHeld, NameConfusable, MemoryAttached (423, {@link Held}: with `retryAfter` and, for a requester of the holder's tenant, `holder`), InvalidName (422, `reason`), InvalidTtl, InvalidRequest, Unavailable, DaemonNotRunning; TypeError or RangeError for a wrong argument, before anything is sent
   */
  async lease(name: string, path: string, options: LeaseOptions = {}): Promise<Lease> {
    attachBody(name, path, options); // wrong arguments reject here, before the event stream opens
    return Lease.acquire(this, name, path, options);
  }

  /**
   * Runs `fn` under a lease and releases it afterwards, also when `fn` throws (its error is
   * rethrown, never replaced by a release failure). Inside, {@link currentLease} is the lease.
   */
  async withLease<R>(name: string, path: string, fn: (lease: Lease) => R | Promise<R>, options: LeaseOptions = {}): Promise<R> {
    if (typeof fn !== "function") throw new TypeError(`fn must be a function, not ${fn === null ? "null" : typeof fn}`);
    const lease = await this.lease(name, path, options);
    let result: R;
    try {
      result = await lease.run(() => fn(lease));
    } catch (e) {
      try {
        await lease.release();
      } catch (releaseError) {
        process.emitWarning(
          `mep: releasing "${lease.canonicalName}" after an error failed: ${(releaseError as Error)?.message ?? String(releaseError)}`,
          "MepReleaseWarning",
        );
      }
      throw e;
    }
    await lease.release();
    return result;
  }

  /**
   * The raw attach (`POST /v1/attach`) without any watching; prefer {@link lease}. The path
   * is made absolute here.
   */
  async attach(name: string, path: string, options: LeaseOptions = {}): Promise<LeaseInfo> {
    const body = attachBody(name, path, options);
    const wait = body["wait_seconds"] as number | undefined;
    const extra = wait !== undefined && wait > 0 ? Math.ceil(wait * 1000) : 0;
    const r = await this.#call("POST", "/v1/attach", body, 201, this.timeoutMs > 0 ? this.timeoutMs + extra : 0);
    return parseLeaseInfo(r.json);
  }

  /**
   * Releases the daemon's lease on `name` (`POST /v1/detach`); with `leaseId`, only that
   * lease, not one granted to another agent under the name after it ended.
   *
   * Resolves to undefined when the control plane confirmed the release. Otherwise the daemon
   * still ended the lease here, but the control plane may hold the name until the lease
   * expires there: the result is the control plane's problem (not thrown), e.g.
   * {@link Unavailable} or {@link LeaseExpired} (what makes `mep release` exit 5 or 4).
   * @throws LeaseNotFound
   */
  async detach(name: string, leaseId?: string): Promise<MepError | undefined> {
    return releaseProblem(await this.#call("POST", "/v1/detach", leaseBody(name, leaseId), [200, 204]));
  }

  /** Every lease the daemon keeps (`GET /v1/leases`). */
  async leases(): Promise<LeaseInfo[]> {
    const r = await this.#call("GET", "/v1/leases", undefined, 200);
    const o = r.json as { leases?: JsonValue[] } | undefined;
    return Array.isArray(o?.leases) ? o.leases.map(parseLeaseInfo) : [];
  }

  /** One lease by canonical name (`GET /v1/leases/{name}`). @throws LeaseNotFound */
  async getLease(canonicalName: string): Promise<LeaseInfo> {
    const r = await this.#call("GET", "/v1/leases/" + encodeURIComponent(checkText(canonicalName, "canonicalName")), undefined, 200);
    return parseLeaseInfo(r.json);
  }

  /**
   * Asks the control plane (through the daemon, `POST /v1/verify`) whether the lease on
   * `name` still has the current token; with `leaseId`, only that lease (another agent's
   * lease under the name since is {@link LeaseNotFound}).
   * @throws StaleFence (409), LeaseExpired (410), LeaseNotFound, Unavailable
   */
  async verify(name: string, leaseId?: string): Promise<VerifyResult> {
    const r = await this.#call("POST", "/v1/verify", leaseBody(name, leaseId), 200);
    return parseVerify(r.json);
  }

  /**
   * Uploads the memory file of the lease on `name` to the data plane under its token
   * (`POST /v1/sync`). No time limit unless `options.timeoutMs` (see {@link TransferOptions});
   * with `options.leaseId`, only that lease's file (another agent's lease under the name
   * since is {@link LeaseNotFound}).
   * @throws StaleFence, LeaseExpired, LeaseNotFound, StoreNotConfigured, StoreUnavailable, InsufficientStorage
   */
  async sync(name: string, options: SyncOptions = {}): Promise<SyncResult> {
    const o = checkOptions(options);
    const timeoutMs = checkTimeoutMs(o.timeoutMs) ?? 0;
    const r = await this.#call("POST", "/v1/sync", leaseBody(name, o.leaseId), 200, timeoutMs);
    return parseSync(r.json);
  }

  /**
   * Downloads the latest stored object of a memory into the NEW file `path`, bound to that
   * memory's identity (`POST /v1/fetch`). No time limit unless `options.timeoutMs` (see
   * {@link TransferOptions}).
   * @throws MemoryNotFound, InvalidRequest (file exists), StoreNotConfigured, StoreUnavailable
   */
  async fetch(memoryInstanceId: string, path: string, options: TransferOptions = {}): Promise<FetchResult> {
    const timeoutMs = checkTimeoutMs(checkOptions(options).timeoutMs) ?? 0;
    const body = { memory_instance_id: checkText(memoryInstanceId, "memoryInstanceId"), path: checkPath(path) };
    const r = await this.#call("POST", "/v1/fetch", body, [200, 201], timeoutMs);
    return parseFetch(r.json);
  }

  // ---- memories -----------------------------------------------------------------------------

  /** Creates a new, empty memory file with a fresh identity (`POST /v1/init`). @throws InvalidRequest when it exists */
  async init(path: string): Promise<MemoryIdentity> {
    const r = await this.#call("POST", "/v1/init", { path: checkPath(path) }, [200, 201]);
    return parseIdentity(r.json);
  }

  /**
   * Copies a held memory to `newPath` as a new identity with recorded lineage
   * (`POST /v1/branch`; needs a live lease on `path`'s memory). @throws LeaseNotFound
   */
  async branch(path: string, newPath: string): Promise<BranchResult> {
    const r = await this.#call("POST", "/v1/branch", { path: checkPath(path), new_path: checkPath(newPath, "newPath") }, [200, 201]);
    return parseBranch(r.json);
  }

  /** The identity of a memory file (`GET /v1/identify`). @throws InvalidRequest when there is no such file */
  async identify(path: string): Promise<MemoryIdentity> {
    const q = "?path=" + encodeURIComponent(checkPath(path));
    const r = await this.#call("GET", "/v1/identify" + q, undefined, 200);
    return parseIdentity(r.json);
  }

  /**
   * A memory's ancestors and children (`GET /v1/lineage`), by file path or memory id. A
   * string that is a UUID and no existing file is taken as an id.
   * @throws MemoryNotFound
   */
  async lineage(query: LineageQuery): Promise<Lineage> {
    let q: string;
    if (typeof query === "string") {
      checkPath(query, "query");
      q = UUID.test(query) && !existsSync(query) ? "?id=" + encodeURIComponent(query) : "?path=" + encodeURIComponent(checkPath(query, "query"));
    } else if (query !== null && typeof query === "object" && "id" in query) q = "?id=" + encodeURIComponent(checkText(query.id, "query.id"));
    else if (query !== null && typeof query === "object" && "path" in query) q = "?path=" + encodeURIComponent(checkPath(query.path, "query.path"));
    else throw new TypeError("query must be a path, a memory id, {path} or {id}");
    const r = await this.#call("GET", "/v1/lineage" + q, undefined, 200);
    return parseLineage(r.json);
  }

  // ---- the daemon ---------------------------------------------------------------------------

  /** `GET /healthz`. @throws DaemonNotRunning */
  async health(): Promise<Health> {
    const r = await this.#call("GET", "/healthz", undefined, 200);
    return parseHealth(r.json);
  }

  /** The daemon's health and every lease it keeps (what `mep status` shows). */
  async status(): Promise<DaemonStatus> {
    const [h, l] = await Promise.all([this.health(), this.leases()]);
    return { ...h, leaseList: l };
  }

  /**
   * The daemon's event stream (`GET /v1/events`) as an async iterator of every lease's
   * events; filter by `canonicalName`. It finishes when the daemon stops (no reconnect);
   * the first `next()` rejects with {@link DaemonNotRunning} when there is no daemon.
   */
  events(options: EventsOptions = {}): DaemonEventStream {
    const queue: DaemonEvent[] = [];
    const waiters: { resolve(r: IteratorResult<DaemonEvent>): void; reject(e: unknown): void }[] = [];
    let finished = false;
    let failure: MepError | undefined;
    const flush = () => {
      while (waiters.length > 0 && (queue.length > 0 || finished)) {
        const w = waiters.shift()!;
        if (queue.length > 0) w.resolve({ value: queue.shift()!, done: false });
        else if (failure) {
          const f = failure;
          failure = undefined;
          w.reject(f);
        } else w.resolve({ value: undefined, done: true });
      }
    };
    const stream: OpenStream = openNdjson(
      this.socketPath,
      "/v1/events",
      {
        onObject(o) {
          const ev = parseEvent(o);
          if (ev) queue.push(ev);
          flush();
        },
        onEnd(err) {
          finished = true;
          failure = err;
          options.signal?.removeEventListener("abort", onAbort);
          flush();
        },
      },
      { unref: options.ref === false, openTimeoutMs: this.timeoutMs },
    );
    function onAbort() {
      stream.close();
    }
    options.signal?.addEventListener("abort", onAbort, { once: true });
    if (options.signal?.aborted) stream.close();
    const it: DaemonEventStream = {
      ready: stream.ready,
      close: () => stream.close(),
      next() {
        return new Promise<IteratorResult<DaemonEvent>>((resolve, reject) => {
          waiters.push({ resolve, reject });
          flush();
        });
      },
      async return() {
        stream.close();
        options.signal?.removeEventListener("abort", onAbort);
        queue.length = 0;
        return { value: undefined, done: true };
      },
      [Symbol.asyncIterator]() {
        return it;
      },
    };
    return it;
  }
}

/** `{name, lease_id?}`: the body of detach, verify and sync. */
function leaseBody(name: string, leaseId: string | undefined): Record<string, string> {
  checkText(name, "name");
  return leaseId === undefined ? { name } : { name, lease_id: checkText(leaseId, "leaseId") };
}

/** The body of `POST /v1/attach`, every argument checked. */
function attachBody(name: string, path: string, options: LeaseOptions): Record<string, unknown> {
  const o = checkOptions(options);
  const body: Record<string, unknown> = { name: checkText(name, "name"), path: checkPath(path), bind: checkBind(o.bind) ?? "pid" };
  const ttl = checkTtl(o.ttl);
  if (ttl !== undefined) body["ttl_seconds"] = ttl;
  const wait = checkWait(o.wait);
  if (wait !== undefined) body["wait_seconds"] = wait;
  const labels = checkLabels(o.labels);
  // None or empty: not sent (a mepd that predates labels takes the attach).
  if (labels !== undefined && Object.keys(labels).length > 0) body["labels"] = labels;
  const maxHold = checkMaxHold(o.maxHold);
  if (maxHold !== undefined) body["max_hold_seconds"] = maxHold;
  return body;
}

export { currentLease };
