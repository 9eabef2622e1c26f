// A lease held through mepd: watched on the daemon's event stream and on a local monotonic
// deadline, released explicitly, by `await using`, or when the process exits (bind "pid").
import "./polyfill.js";
import { AsyncLocalStorage } from "node:async_hooks";
import { EventEmitter } from "node:events";
import { DaemonNotRunning, InvalidRequest, LeaseExpired, LeaseLost, LeaseNotFound, type MepError, StaleFence, Unavailable } from "./errors.js";
import { openNdjson, type OpenStream } from "./http.js";
import { parseEvent, type DaemonEvent, type LeaseInfo, type SyncResult, type VerifyResult } from "./types.js";
import type { Client, TransferOptions } from "./client.js";

/** Options of {@link Client.lease} / {@link lease} and {@link withLease}. */
export interface LeaseOptions {
  /** TTL in seconds (5..300); the daemon's default (30) when omitted. */
  ttl?: number;
  /**
   * Seconds to wait, in the daemon's fair queue, for a name or memory another owner holds
   * (sent as `wait_seconds`, only when given). A wait that ends without the lease throws the
   * usual {@link NameHeld} / {@link MemoryAttached}.
   */
  wait?: number;
  /**
   * `"pid"` (default): the daemon releases the lease within ~1 s of this process's exit
   * (SIGKILL included). `"none"`: the lease outlives the process until released.
   */
  bind?: "pid" | "none";
  /**
   * Labels the control plane keeps with the lease for the operators of its tenant (`mep lease
   * ls`, `mep lease show`), beside the host name, this process's pid and executable name that
   * mepd sends as the lease's *holder* (none of it when mepd runs with `--anonymous-holder`).
   * At most 16; keys of 1-63 characters of `A-Z a-z 0-9 _ . -`; string values of at most 255
   * bytes of UTF-8 without control characters. Sent as `labels`, only when not empty.
   */
  labels?: Record<string, string>;
  /**
   * The longest hold, in whole seconds (5..31622400, i.e. up to 366 days; sent as
   * `max_hold_seconds`): the lease is never renewed past its grant plus this. The renewal that
   * would carry it past is refused and the lease is lost with reason `"max-hold"` — up to one
   * TTL before grant + `maxHold`, since mepd renews every ttl/3. Omitted: no limit.
   */
  maxHold?: number;
}

/** This library's view of a lease. */
export type LeaseState = "held" | "at-risk" | "lost" | "released";

/** What the `atRisk` event carries. */
export interface AtRiskInfo {
  /** `"degraded"`-event reason from the daemon (e.g. `"unreachable"`), `"no-renewal-heard"` or `"daemon-disconnected"`. */
  reason: string;
}

/** What the `renewed` event carries. */
export interface RenewedInfo {
  /** The control plane's new expiry. */
  expiresAt: Date;
  /** Whether this renewal cleared an at-risk state. */
  recovered: boolean;
}

/** The events of a {@link Lease} and their listener signatures. */
export interface LeaseEventMap {
  /** Renewals are failing or not heard of (the daemon's `degraded`); the lease may still recover. */
  atRisk: (info: AtRiskInfo) => void;
  /** A renewal was heard of; the local deadline moved. */
  renewed: (info: RenewedInfo) => void;
  /** The lease is gone; the token must not be used. Fired once. */
  lost: (error: LeaseLost) => void;
  /**
   * {@link Lease.release} finished (not fired for a lease that was lost before); with the
   * control plane's problem when it did not confirm the release ({@link Lease.releaseProblem}).
   */
  released: (problem: MepError | undefined) => void;
}

const als = new AsyncLocalStorage<Lease>();

/**
 * The lease of the innermost {@link withLease} (or {@link Lease.run}) around the calling code,
 * through `AsyncLocalStorage`; `undefined` outside of one.
 */
export function currentLease(): Lease | undefined {
  return als.getStore();
}

/** The local deadline's margin, as mepd and `mep run` compute it: max(1 s, 10 % of ttl). */
function marginMs(ttlS: number): number {
  return Math.max(1000, ttlS * 100);
}

const RECONNECT_MIN_MS = 100;
const RECONNECT_MAX_MS = 2000;
const KEY = Symbol("mep.lease.construct");

/**
 * Calls `f` with the lease's id; a mepd older than `lease_id` on verify and sync refuses the
 * field (400 with `unknown_fields`), and is asked again by name (the caller compares the
 * memory id and token of the answer).
 */
async function byLeaseId<T>(f: (leaseId: string | undefined) => Promise<T>, leaseId: string): Promise<T> {
  try {
    return await f(leaseId);
  } catch (e) {
    const unknown = e instanceof InvalidRequest ? e.extensions["unknown_fields"] : undefined;
    if (Array.isArray(unknown) && unknown.includes("lease_id")) return f(undefined);
    throw e;
  }
}

/**
 * A lease on an agent name and a memory file, held through the local mepd. Get one with
 * {@link lease} / {@link Client.lease} (`await using lease = await mep.lease(...)`) or
 * {@link withLease}.
 *
 * Loss is decided at two levels: *at risk* (`atRisk` is true, event `atRisk`; cleared by
 * `renewed`) and *lost* (event `lost`, {@link signal} aborted, {@link check} throws). It is lost
 * when the daemon says so (`lost`, or `released` while held), when a verify/sync is refused
 * as stale or expired, or when this library's own monotonic deadline passes with no renewal
 * heard: attach sent + ttl − margin, moved to (renewal heard + ttl − 2·margin) on each renewal,
 * margin = max(1 s, 10 % of ttl), exactly as `mep run` does.
 */
export class Lease implements AsyncDisposable {
  /** The lease's id in the daemon. */
  readonly leaseId: string;
  /** The canonical name ("My Agent" → "myagent"); the key of the lease in the daemon. */
  readonly canonicalName: string;
  /** The name as given. */
  readonly displayName: string;
  /** The memory's identity. */
  readonly memoryInstanceId: string;
  /**
   * The fencing token: an unsigned 64-bit integer, hence a `bigint` (a `number` would round
   * tokens above 2^53). Use {@link fencingHeaders} or `String(token)` to send it.
   */
  readonly token: bigint;
  /** The memory file's absolute path. */
  readonly path: string;
  /** The lease's TTL in seconds. */
  readonly ttlSeconds: number;
  /** The process the daemon binds the lease to, or null (`bind: "none"`). */
  readonly bindPid: number | null;

  readonly #client: Client;
  readonly #emitter = new EventEmitter();
  readonly #abort = new AbortController();
  #expiresAt: Date;
  #state: LeaseState = "held";
  #lostError: LeaseLost | undefined;
  #deadline: number; // performance.now() timebase
  #riskAt: number;
  #deadlineTimer: NodeTimer | undefined;
  #riskTimer: NodeTimer | undefined;
  #reconnectTimer: NodeTimer | undefined;
  #backoff = RECONNECT_MIN_MS;
  #stream: OpenStream | undefined;
  #seenGrant: boolean;
  #releasing: Promise<MepError | undefined> | undefined;
  #releaseProblem: MepError | undefined;
  #releaseStarted = false;
  #releasedLive = false;
  #watching = true;

  private constructor(key: symbol, client: Client, info: LeaseInfo, sentAt: number, stream: OpenStream | undefined, early: DaemonEvent[]) {
    if (key !== KEY) throw new TypeError("use mep.lease() or Client.lease() to get a Lease");
    if (info.fencingToken === undefined) throw new TypeError("mepd granted a lease without a fencing token");
    this.#client = client;
    this.leaseId = info.leaseId;
    this.canonicalName = info.canonicalName;
    this.displayName = info.displayName;
    this.memoryInstanceId = info.memoryInstanceId;
    this.token = info.fencingToken;
    this.path = info.path;
    this.ttlSeconds = info.ttlSeconds;
    this.bindPid = info.bindPid;
    this.#expiresAt = info.expiresAt ?? new Date(Date.now() + info.ttlSeconds * 1000);
    this.#deadline = sentAt + this.ttlSeconds * 1000 - marginMs(this.ttlSeconds);
    this.#riskAt = this.#riskPoint(sentAt);
    this.#stream = stream;
    this.#seenGrant = stream === undefined;
    this.#armTimers();
    for (const ev of early) this.#onEvent(ev);
    if (stream === undefined) this.#scheduleReconnect();
  }

  /**
   * Attaches through the daemon with the event stream opened first, so no `lost` can slip
   * in between the grant and the watch.
   * @internal
   */
  static async acquire(client: Client, name: string, path: string, opts: LeaseOptions): Promise<Lease> {
    let lease: Lease | undefined;
    const early: DaemonEvent[] = [];
    let streamEnded = false;
    const stream = openNdjson(client.socketPath, "/v1/events", {
      onObject(o) {
        const ev = parseEvent(o);
        if (!ev) return;
        if (lease) lease.#onEvent(ev);
        else early.push(ev);
      },
      onEnd(err) {
        streamEnded = true;
        if (lease) lease.#onStreamEnd(err);
      },
    }, { unref: false, openTimeoutMs: client.timeoutMs }); // kept alive until the attach answered, then unref'd
    try {
      await stream.ready;
    } catch (e) {
      // No daemon, or one that did not answer within the client's timeoutMs: the attach
      // would fare no better. Otherwise (a refusal) the attach below tells which error to
      // report; without a stream the lease still has its local deadline and reconnects in
      // the background.
      if (e instanceof DaemonNotRunning || e instanceof Unavailable) {
        stream.close();
        throw e;
      }
    }
    const sentAt = performance.now();
    let info: LeaseInfo;
    try {
      info = await client.attach(name, path, opts);
    } catch (e) {
      stream.close();
      throw e;
    }
    stream.setRef(false);
    // After a wait the grant is no earlier than the request plus granted_after_ms: the local
    // deadline counts from there (else a wait longer than the TTL is a lost lease).
    const after = info.raw["granted_after_ms"];
    const grantedFrom = typeof after === "number" && after > 0 ? sentAt + after : sentAt;
    try {
      lease = new Lease(KEY, client, info, grantedFrom, streamEnded ? undefined : stream, early);
    } catch (e) {
      // The daemon holds a lease no one could release: give it back.
      stream.close();
      await client.detach(info.canonicalName, info.leaseId).catch(() => {});
      throw e;
    }
    return lease;
  }

  // ---- state ---------------------------------------------------------------------------

  /** `held`, `at-risk`, `lost` or `released` (evaluates the local deadline now). */
  get state(): LeaseState {
    this.#checkDeadline();
    return this.#state;
  }

  /** True while renewals are failing or overdue (the daemon's `degraded`); false once renewed, lost or released. */
  get atRisk(): boolean {
    this.#checkDeadline();
    return this.#state === "at-risk";
  }

  /**
   * After a release the control plane did not confirm, its problem (e.g. {@link Unavailable}):
   * the lease ended on this host, but the control plane may hold the name until the lease
   * expires there. Undefined otherwise.
   */
  get releaseProblem(): MepError | undefined {
    return this.#releaseProblem;
  }

  /** True once the lease is lost (not for a clean {@link release}). */
  get isLost(): boolean {
    this.#checkDeadline();
    return this.#state === "lost";
  }

  /** Why the lease was lost (see {@link LeaseLostReason}), or undefined while it was not. */
  get lostReason(): string | undefined {
    this.#checkDeadline();
    return this.#state === "lost" ? this.#lostError?.reason : undefined;
  }

  /** The control plane's expiry as last heard (updated on each renewal). */
  get expiresAt(): Date {
    return new Date(this.#expiresAt.getTime());
  }

  /** Milliseconds left before this library's local deadline (≤ 0 once passed). */
  get remainingMs(): number {
    return this.#deadline - performance.now();
  }

  /**
   * Aborts when the lease stops being usable: on loss (reason: the {@link LeaseLost} error) and
   * on {@link release} (reason: a LeaseLost with reason `"released-by-holder"`). Pass it to
   * `fetch()`, timers and loops so work stops with the lease.
   */
  get signal(): AbortSignal {
    this.#checkDeadline();
    return this.#abort.signal;
  }

  /** Throws {@link LeaseLost} if the lease is lost or released; otherwise returns. Cheap and local. */
  check(): void {
    this.#checkDeadline();
    if (this.#state === "lost" || this.#state === "released") throw this.#lostError ?? this.#releasedError();
  }

  /**
   * `{"Fencing-Token": "<token>"}`, for writes to storage that applies the fencing rule
   * (refuse a token lower than the highest seen). Throws {@link LeaseLost} once the lease is
   * lost or released (from the first {@link release} call on), as {@link check} does.
   */
  fencingHeaders(): { "Fencing-Token": string } {
    this.check();
    return { "Fencing-Token": this.token.toString() };
  }

  /**
   * Asks the control plane, through the daemon (`POST /v1/verify`), whether this lease's token
   * is still the current one. Throws {@link LeaseLost} without asking when already lost;
   * {@link StaleFence} (409) or {@link LeaseExpired} (410) when the control plane says no (the
   * lease is then lost too); {@link Unavailable} when it cannot be asked.
   */
  async verify(): Promise<VerifyResult> {
    this.check();
    let r: VerifyResult;
    try {
      // This lease by its id: after a loss the name may hold another agent's lease, whose
      // token can be equal to ours (tokens count per memory).
      r = await byLeaseId((id) => this.#client.verify(this.canonicalName, id), this.leaseId);
    } catch (e) {
      this.#loseOnRefusal(e);
      throw e;
    }
    if (r.fencingToken !== this.token || r.memoryInstanceId !== this.memoryInstanceId) this.#lose("token-changed");
    this.check(); // lost meanwhile (an event, the local deadline): the answer does not count
    return r;
  }

  /**
   * Uploads the memory file's bytes to the data plane under this lease's token
   * (`POST /v1/sync`). Throws {@link LeaseLost} without asking when already lost;
   * {@link StaleFence} when the store has seen a higher token (the lease is then lost);
   * {@link StoreNotConfigured}, {@link StoreUnavailable}, {@link InsufficientStorage}.
   *
   * mepd answers only once the upload is done, so there is no time limit by default (the
   * client's `timeoutMs` does not apply): pass `{ timeoutMs }` to give up earlier.
   */
  async sync(options: TransferOptions = {}): Promise<SyncResult> {
    this.check();
    let r: SyncResult;
    try {
      r = await byLeaseId((leaseId) => this.#client.sync(this.canonicalName, { ...options, leaseId }), this.leaseId);
    } catch (e) {
      this.#loseOnRefusal(e);
      throw e;
    }
    if (r.fencingToken !== this.token || r.memoryInstanceId !== this.memoryInstanceId) this.#lose("token-changed");
    this.check();
    return r;
  }

  /** Runs `fn` with this lease as {@link currentLease}. */
  run<R>(fn: () => R): R {
    return als.run(this, fn);
  }

  /**
   * Releases the lease (`POST /v1/detach`). Idempotent: while a call is pending or once one
   * succeeded, another call returns its promise. From the first call on, {@link state} is
   * `"released"`, {@link signal} is aborted and {@link check} throws: the token must not be
   * used any more. A lost lease is only cleaned up in the daemon if the daemon's record is
   * still this lease's.
   *
   * If mepd cannot be reached (e.g. {@link DaemonNotRunning} while it restarts) the promise
   * rejects and the lease is *not* released: the daemon keeps it (a restarted mepd re-adopts
   * it) until this process exits. Call `release()` again — it retries — once the daemon is back.
   *
   * Resolves to undefined, or to {@link releaseProblem} when the control plane did not confirm
   * the release: the lease is released on this host all the same.
   */
  release(): Promise<MepError | undefined> {
    if (this.#releasing) return this.#releasing;
    if (!this.#releaseStarted) {
      this.#releaseStarted = true;
      this.#checkDeadline();
      this.#releasedLive = this.#state === "held" || this.#state === "at-risk";
      this.#stopWatching();
      if (this.#releasedLive) {
        this.#state = "released";
        this.#lostError = undefined;
        this.#abort.abort(this.#releasedError());
      }
    }
    const wasLive = this.#releasedLive;
    const attempt = (async () => {
      if (wasLive) {
        try {
          this.#releaseProblem = await this.#client.detach(this.canonicalName, this.leaseId);
        } catch (e) {
          if (!(e instanceof LeaseNotFound)) throw e;
        }
        this.#emit("released", this.#releaseProblem);
        return this.#releaseProblem;
      }
      // Lost: the daemon may keep a `lost` record under the name. Detach is by name only, so
      // detach only while that record is still ours (not a newer holder's).
      try {
        const info = await this.#client.getLease(this.canonicalName);
        if (info.leaseId === this.leaseId) await this.#client.detach(this.canonicalName, this.leaseId);
      } catch {
        // best effort: nothing of ours is held
      }
      return undefined;
    })();
    this.#releasing = attempt;
    // A failed attempt is forgotten, so that the next release() tries again.
    attempt.then(undefined, () => {
      if (this.#releasing === attempt) this.#releasing = undefined;
    });
    return attempt;
  }

  /** `await using lease = await mep.lease(...)` releases here; same as {@link release}. */
  async [Symbol.asyncDispose](): Promise<void> {
    await this.release();
  }

  /** Adds a listener (see {@link LeaseEventMap}). A listener that throws does not stop the others; its error is rethrown asynchronously. */
  on<K extends keyof LeaseEventMap>(event: K, listener: LeaseEventMap[K]): this {
    this.#emitter.on(event, listener);
    return this;
  }

  /** Adds a one-time listener. */
  once<K extends keyof LeaseEventMap>(event: K, listener: LeaseEventMap[K]): this {
    this.#emitter.once(event, listener);
    return this;
  }

  /** Removes a listener. */
  off<K extends keyof LeaseEventMap>(event: K, listener: LeaseEventMap[K]): this {
    this.#emitter.off(event, listener);
    return this;
  }

  /** A JSON-friendly summary (the token as a decimal string). */
  toJSON(): Record<string, unknown> {
    return {
      leaseId: this.leaseId,
      canonicalName: this.canonicalName,
      displayName: this.displayName,
      memoryInstanceId: this.memoryInstanceId,
      fencingToken: this.token.toString(),
      expiresAt: this.#expiresAt.toISOString(),
      path: this.path,
      state: this.state,
      lostReason: this.lostReason,
    };
  }

  // ---- internals -----------------------------------------------------------------------

  #releasedError(): LeaseLost {
    return new LeaseLost({ canonicalName: this.canonicalName, fencingToken: this.token, reason: "released-by-holder" });
  }

  #emit(event: keyof LeaseEventMap, ...args: unknown[]): void {
    for (const fn of this.#emitter.rawListeners(event)) {
      try {
        (fn as (...a: unknown[]) => unknown)(...args);
      } catch (e) {
        queueMicrotask(() => {
          throw e;
        });
      }
    }
  }

  /** The at-risk point: halfway between when a renewal is due at the latest (ttl/3 + 10 % jitter) and the deadline. */
  #riskPoint(base: number): number {
    const due = base + (this.ttlSeconds * 1000 * 1.1) / 3;
    return due + Math.max(0, this.#deadline - due) / 2;
  }

  #armTimers(): void {
    clearTimeout(this.#deadlineTimer);
    clearTimeout(this.#riskTimer);
    const now = performance.now();
    this.#deadlineTimer = setTimeout(() => this.#checkDeadline(), Math.max(0, this.#deadline - now) + 1).unref();
    if (this.#state === "held" && this.#riskAt < this.#deadline) {
      this.#riskTimer = setTimeout(() => {
        if (this.#state === "held" && performance.now() >= this.#riskAt) this.#setAtRisk("no-renewal-heard");
      }, Math.max(0, this.#riskAt - now) + 1).unref();
    }
  }

  #checkDeadline(): void {
    this.#deadlinePassed();
  }

  /** Marks the lease lost if its local deadline has passed; true if it is (now) lost or released. */
  #deadlinePassed(): boolean {
    if ((this.#state === "held" || this.#state === "at-risk") && performance.now() >= this.#deadline) this.#lose("deadline");
    return this.#state === "lost" || this.#state === "released";
  }

  #setAtRisk(reason: string): void {
    if (this.#state !== "held") return;
    this.#state = "at-risk";
    clearTimeout(this.#riskTimer);
    this.#emit("atRisk", { reason } satisfies AtRiskInfo);
  }

  #lose(reason: string, cause?: unknown): void {
    if (this.#state === "lost" || this.#state === "released") return;
    this.#state = "lost";
    this.#lostError = new LeaseLost({ canonicalName: this.canonicalName, fencingToken: this.token, reason, cause });
    this.#stopWatching();
    this.#abort.abort(this.#lostError);
    this.#emit("lost", this.#lostError);
  }

  /** A refusal of verify/sync that means the token is no longer current. */
  #loseOnRefusal(e: unknown): void {
    if (e instanceof StaleFence) this.#lose("stale-fence", e);
    else if (e instanceof LeaseExpired) this.#lose("lease-expired", e);
    else if (e instanceof LeaseNotFound) this.#lose("not-found", e);
  }

  #stopWatching(): void {
    this.#watching = false;
    clearTimeout(this.#deadlineTimer);
    clearTimeout(this.#riskTimer);
    clearTimeout(this.#reconnectTimer);
    this.#deadlineTimer = this.#riskTimer = this.#reconnectTimer = undefined;
    const s = this.#stream;
    this.#stream = undefined;
    s?.close();
  }

  #onEvent(ev: DaemonEvent): void {
    if (ev.canonicalName !== this.canonicalName) return;
    if (this.#state === "lost" || this.#state === "released") return;
    if (ev.leaseId !== undefined) {
      // A daemon that names the lease in its events: attribution is exact. Another lease
      // granted under the name after ours means ours is gone; its other events are not ours.
      if (ev.leaseId !== this.leaseId) {
        if (ev.event === "granted" && this.#seenGrant) this.#lose("token-changed");
        return;
      }
      this.#seenGrant = true;
      if (ev.event === "granted") return;
    } else if (!this.#seenGrant) {
      // Events before our own `granted` belong to an earlier holder of the name.
      if (ev.event === "granted" && ev.fencingToken === this.token) this.#seenGrant = true;
      return;
    }
    if (this.#deadlinePassed()) return; // a renewal heard late must not revive a lease whose deadline passed
    const otherToken = ev.fencingToken !== undefined && ev.fencingToken !== this.token;
    switch (ev.event) {
      case "granted":
      case "renewed": {
        if (otherToken) {
          this.#lose("token-changed");
          return;
        }
        const now = performance.now();
        this.#deadline = now + this.ttlSeconds * 1000 - 2 * marginMs(this.ttlSeconds);
        this.#riskAt = this.#riskPoint(now);
        if (ev.expiresAt) this.#expiresAt = ev.expiresAt;
        const recovered = this.#state === "at-risk";
        this.#state = "held";
        this.#armTimers();
        this.#emit("renewed", { expiresAt: this.expiresAt, recovered } satisfies RenewedInfo);
        return;
      }
      case "degraded":
        if (!otherToken) this.#setAtRisk(ev.reason ?? "degraded");
        return;
      case "lost":
        if (!otherToken) this.#lose(ev.reason ?? "lost");
        return;
      case "released":
        if (!otherToken && !this.#releasing) this.#lose("released");
        return;
      default:
        return;
    }
  }

  #onStreamEnd(_err: MepError | undefined): void {
    if (!this.#watching) return;
    if (this.#state === "lost" || this.#state === "released" || this.#releasing) return;
    this.#stream = undefined;
    this.#setAtRisk("daemon-disconnected");
    this.#scheduleReconnect();
  }

  #scheduleReconnect(): void {
    if (!this.#watching) return;
    if (this.#state === "lost" || this.#state === "released" || this.#releasing) return;
    clearTimeout(this.#reconnectTimer);
    const delay = this.#backoff;
    this.#backoff = Math.min(RECONNECT_MAX_MS, this.#backoff * 2);
    this.#reconnectTimer = setTimeout(() => this.#reconnect(), delay).unref();
  }

  #reconnect(): void {
    if (!this.#watching) return;
    if (this.#state === "lost" || this.#state === "released" || this.#releasing) return;
    let opened = false;
    const stream = openNdjson(this.#client.socketPath, "/v1/events", {
      onObject: (o) => {
        const ev = parseEvent(o);
        if (ev && this.#stream === stream) this.#onEvent(ev);
      },
      onEnd: (err) => {
        if (this.#stream === stream) this.#onStreamEnd(err);
        else if (this.#stream === undefined && !opened) this.#scheduleReconnect();
      },
    }, { openTimeoutMs: this.#client.timeoutMs });
    stream.ready.then(
      async () => {
        opened = true;
        if (!this.#watching || this.#state === "lost" || this.#state === "released" || this.#releasing) {
          stream.close();
          return;
        }
        this.#stream = stream;
        this.#seenGrant = true; // a new stream carries only events after now
        this.#backoff = RECONNECT_MIN_MS;
        // What happened while we were not listening (the daemon restarted: it re-adopts its leases).
        try {
          const info = await this.#client.getLease(this.canonicalName);
          if (info.state === "lost") this.#lose(info.lostReason ?? "lost");
          else if (info.leaseId !== this.leaseId || (info.fencingToken !== undefined && info.fencingToken !== this.token)) this.#lose("token-changed");
          else if (info.state === "degraded") this.#setAtRisk("degraded");
        } catch (e) {
          if (e instanceof LeaseNotFound) this.#lose("not-found", e);
          // anything else: the stream's end will bring us back here
        }
      },
      () => {
        /* onEnd reschedules */
      },
    );
  }
}
