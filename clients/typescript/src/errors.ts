// Errors: one class per RFC 9457 problem code of mepd (the three 423 ones under the base Held), plus DaemonNotRunning, LeaseLost and ConfigError.

/** Every problem `code` mepd (and the control plane behind it) answers with, and its HTTP status. */
export const PROBLEM_CODES = {
  "invalid-request": 400,
  "idempotency-key-missing": 400,
  "idempotency-key-invalid": 400,
  unauthenticated: 401,
  forbidden: 403,
  "not-found": 404,
  "memory-not-found": 404,
  "lease-not-found": 404,
  "method-not-allowed": 405,
  "memory-id-taken": 409,
  "stale-fence": 409,
  "idempotency-request-in-flight": 409,
  "lease-expired": 410,
  "payload-too-large": 413,
  "unsupported-media-type": 415,
  "invalid-name": 422,
  "invalid-ttl": 422,
  "idempotency-key-reused": 422,
  "name-held": 423,
  "name-confusable": 423,
  "memory-attached": 423,
  "rate-limited": 429,
  internal: 500,
  "store-not-configured": 501,
  "transaction-conflict": 503,
  unavailable: 503,
  "migration-in-progress": 503,
  "store-unavailable": 503,
  "insufficient-storage": 507,
  "control-plane-unreachable": 503,
} as const;

/** A problem code mepd documents (see {@link PROBLEM_CODES}). */
export type ProblemCode = keyof typeof PROBLEM_CODES;

/** The members of an RFC 9457 problem body, as mepd sends them. */
export interface ProblemBody {
  type?: string;
  title?: string;
  status?: number;
  detail?: string;
  instance?: string;
  code?: string;
  [extension: string]: unknown;
}

/** What every {@link MepError} constructor takes. */
export interface MepErrorInit {
  /** The problem's `code` (a {@link ProblemCode}, or a code this version does not know). */
  code: string;
  /** The HTTP status (0 when the error was decided locally, without an answer). */
  status: number;
  /** The problem's short `title`. */
  title?: string;
  /** The problem's `detail`: what went wrong, for people. */
  detail?: string;
  /** The problem's `instance` (the daemon's request id). */
  instance?: string;
  /** The problem's `type` URI. */
  type?: string;
  /** Seconds from the `Retry-After` header (423, 429, 503), when sent. */
  retryAfter?: number;
  /** Members of the problem body beyond the standard ones (`reason`, `codepoint`, …). */
  extensions?: Record<string, unknown>;
  /** The underlying error, if any. */
  cause?: unknown;
}

/**
 * The base class of every error this package throws. Catch it to handle any mep failure;
 * catch a subclass ({@link NameHeld}, {@link LeaseLost}, …) for one kind.
 */
export class MepError extends Error {
  /** The stable problem code, e.g. `"name-held"` (`"lease-lost"` for {@link LeaseLost}). */
  readonly code: string;
  /** The HTTP status mepd answered with; 0 when decided by this library without an answer. */
  readonly status: number;
  /** The problem's title. */
  readonly title: string;
  /** The problem's detail (also the error's `message`). */
  readonly detail: string;
  /** The daemon's request id for this problem, when it gave one. */
  readonly instance: string | undefined;
  /** The problem's `type` URI. */
  readonly type: string | undefined;
  /** Seconds to wait before retrying, from the `Retry-After` header, when sent. */
  readonly retryAfter: number | undefined;
  /** Every member of the problem body beyond type, title, status, detail, instance and code. */
  readonly extensions: Readonly<Record<string, unknown>>;

  constructor(init: MepErrorInit) {
    const detail = init.detail ?? init.title ?? init.code;
    super(detail, init.cause === undefined ? undefined : { cause: init.cause });
    this.name = new.target.name;
    this.code = init.code;
    this.status = init.status;
    this.title = init.title ?? init.code;
    this.detail = detail;
    this.instance = init.instance;
    this.type = init.type;
    this.retryAfter = init.retryAfter;
    this.extensions = Object.freeze({ ...(init.extensions ?? {}) });
  }
}

/** 400 `invalid-request`: a malformed request, e.g. a memory file that does not exist (create it with {@link init}). */
export class InvalidRequest extends MepError {}
/** 400 `idempotency-key-missing`. */
export class IdempotencyKeyMissing extends MepError {}
/** 400 `idempotency-key-invalid`. */
export class IdempotencyKeyInvalid extends MepError {}
/** 401 `unauthenticated`: the daemon's token was refused by the control plane. */
export class Unauthenticated extends MepError {}
/** 403 `forbidden`: e.g. the socket's peer is not allowed. */
export class Forbidden extends MepError {}
/** 404 `not-found`: no such endpoint (an older mepd that lacks it). */
export class NotFound extends MepError {}
/** 404 `memory-not-found`: no such memory (or, for fetch, no stored object). */
export class MemoryNotFound extends MepError {}
/** 404 `lease-not-found`: the daemon holds no lease under that name. */
export class LeaseNotFound extends MepError {}
/** 405 `method-not-allowed`. */
export class MethodNotAllowed extends MepError {}
/** 409 `memory-id-taken`. */
export class MemoryIdTaken extends MepError {}
/**
 * 409 `stale-fence`: a fencing token lower than the highest one seen was presented; someone
 * else holds the memory now. `presentedToken`/`currentToken` are set when the problem names them.
 */
export class StaleFence extends MepError {
  /** The token that was refused (extension `presented_token`). */
  readonly presentedToken: bigint | undefined;
  /** The highest token seen (extension `current_token`). */
  readonly currentToken: bigint | undefined;
  constructor(init: MepErrorInit) {
    super(init);
    this.presentedToken = toBigIntOrUndefined(init.extensions?.["presented_token"]);
    this.currentToken = toBigIntOrUndefined(init.extensions?.["current_token"]);
  }
}
/** 409 `idempotency-request-in-flight`. */
export class IdempotencyRequestInFlight extends MepError {}
/** 410 `lease-expired`: the lease is gone (expired, or already marked lost by the daemon). */
export class LeaseExpired extends MepError {}
/** 413 `payload-too-large`. */
export class PayloadTooLarge extends MepError {}
/** 415 `unsupported-media-type`. */
export class UnsupportedMediaType extends MepError {}
/**
 * 422 `invalid-name`: the agent name is not acceptable. `reason` says why (e.g.
 * `"mixed-script"`, `"disallowed-character"`); `codepoint` and `index` point at the culprit.
 */
export class InvalidName extends MepError {
  /** Why the name was refused (extension `reason`), e.g. `"mixed-script"`. */
  readonly reason: string | undefined;
  /** The offending code point as `"U+XXXX"` (extension `codepoint`), when one is to blame. */
  readonly codepoint: string | undefined;
  /** Its index in the name (extension `index`), when one is to blame. */
  readonly index: number | undefined;
  constructor(init: MepErrorInit) {
    super(init);
    const ext = init.extensions ?? {};
    this.reason = typeof ext["reason"] === "string" ? ext["reason"] : undefined;
    this.codepoint = typeof ext["codepoint"] === "string" ? ext["codepoint"] : undefined;
    this.index = typeof ext["index"] === "number" ? ext["index"] : undefined;
  }
}
/** 422 `invalid-ttl`: ttl outside 5..300 seconds. */
export class InvalidTtl extends MepError {}
/** 422 `idempotency-key-reused`. */
export class IdempotencyKeyReused extends MepError {}
/**
 * Who holds a name or a memory, as a refused claim (423: {@link NameHeld},
 * {@link NameConfusable}, {@link MemoryAttached}) tells a requester of the holder's tenant
 * (the problem's `holder` member): never the lease's id, owner or token.
 */
export interface HolderView {
  /** The holder's agent name as it was given ("Builder 7"). */
  readonly displayName: string;
  /** The holder's host, or null when not known (a mepd run with `--anonymous-holder`). */
  readonly host: string | null;
  /** Since when it holds the lease (its first grant). */
  readonly since: Date;
  /** When the lease expires unless renewed (the control plane's clock). */
  readonly expiresAt: Date;
}

/** The problem's `holder` member as a {@link HolderView}, or null when absent or not one. */
function parseHolderView(v: unknown): HolderView | null {
  if (v === null || typeof v !== "object" || Array.isArray(v)) return null;
  const o = v as Record<string, unknown>;
  const time = (k: string): Date | undefined => {
    const t = typeof o[k] === "string" ? Date.parse(o[k] as string) : Number.NaN;
    return Number.isNaN(t) ? undefined : new Date(t);
  };
  const since = time("since");
  const expiresAt = time("expires_at");
  if (typeof o["display_name"] !== "string" || since === undefined || expiresAt === undefined) return null;
  const host = typeof o["host"] === "string" && o["host"] !== "" ? (o["host"] as string) : null;
  return Object.freeze({ displayName: o["display_name"] as string, host, since, expiresAt });
}

/**
 * The base of the three 423 problems ({@link NameHeld}, {@link NameConfusable},
 * {@link MemoryAttached}): the name, a name that looks the same or the memory is held by a
 * live lease. `retryAfter` says in how many seconds that lease expires; {@link holder} who
 * holds it, when the control plane tells.
 */
export class Held extends MepError {
  /**
   * Who holds it (display name, host, since, expiry): told to a requester of the holder's
   * tenant only; null for another tenant's lease or from an older daemon.
   */
  readonly holder: HolderView | null;
  constructor(init: MepErrorInit) {
    super(init);
    this.holder = parseHolderView(init.extensions?.["holder"]);
  }
}
/** 423 `name-held`: another owner holds the name. `retryAfter` says when to try again; `holder` who holds it. */
export class NameHeld extends Held {}
/** 423 `name-confusable`: a held name looks the same (same UTS #39 skeleton, e.g. "paypa1" vs "paypal"); `holder` who holds it. */
export class NameConfusable extends Held {}
/** 423 `memory-attached`: the memory file is attached to another lease; `holder` who holds it. */
export class MemoryAttached extends Held {}
/** 429 `rate-limited`. */
export class RateLimited extends MepError {}
/** 500 `internal`. */
export class Internal extends MepError {}
/** 501 `store-not-configured`: mepd was started without `--store`, so sync/fetch are off. */
export class StoreNotConfigured extends MepError {}
/** 503 `transaction-conflict`. */
export class TransactionConflict extends MepError {}
/** 503 `unavailable`: the daemon or the control plane cannot serve now. */
export class Unavailable extends MepError {}
/**
 * 503 `control-plane-unreachable`: mepd could not reach its control plane (`mep server`), or
 * its embedded one did not answer in time; what was asked may have been done. A kind of
 * {@link Unavailable}, as it was before it had a code of its own.
 */
export class ControlPlaneUnreachable extends Unavailable {}
/** 503 `migration-in-progress`. */
export class MigrationInProgress extends MepError {}
/** 503 `store-unavailable`: the data plane (`mep store`) cannot be reached. */
export class StoreUnavailable extends MepError {}
/** 507 `insufficient-storage`: the data plane is full; nothing was written. */
export class InsufficientStorage extends MepError {}

/**
 * The daemon's socket cannot be reached (no such socket, connection refused): mepd is not
 * running, or the socket path is wrong. A kind of {@link Unavailable} (code `unavailable`, status 0).
 */
export class DaemonNotRunning extends Unavailable {
  /** The socket path that was tried. */
  readonly socketPath: string;
  constructor(socketPath: string, cause?: unknown) {
    const why = (cause as ErrnoLike | undefined)?.code ?? String(cause ?? "unreachable");
    super({
      code: "unavailable",
      status: 0,
      title: "mepd is not running",
      detail: `cannot reach mepd at ${socketPath} (${why}): start it with 'mepd' or 'systemctl --user start mepd.socket'`,
      cause,
    });
    this.socketPath = socketPath;
  }
}

/**
 * The mep config file cannot be used: `$MEP_CONFIG` names a file that does not exist, the
 * file is not a regular file or cannot be read, is not TOML, or has a top-level value that is
 * not a string, an integer or a boolean — the files the `mep` CLI refuses too (it exits 2).
 * Code `config-error` (this library's own), status 0.
 */
export class ConfigError extends MepError {
  /** The config file. */
  readonly file: string;
  constructor(file: string, detail: string) {
    super({ code: "config-error", status: 0, title: "Configuration error", detail });
    this.file = file;
  }
}

/** Why a lease was lost (see {@link LeaseLost.reason}). */
export type LeaseLostReason =
  /** This library's local monotonic deadline passed with no renewal heard. */
  | "deadline"
  /** Released in the daemon while this process held it (`mep release`, another client). */
  | "released"
  /** Released by this process ({@link Lease.release}): not a loss, but the token is no longer usable. */
  | "released-by-holder"
  /** After a reconnect, the daemon no longer knows the lease. */
  | "not-found"
  /** The daemon reports another token for the name. */
  | "token-changed"
  /** The lease reached its `maxHold`: the control plane refused the renewal that would have carried it past (a daemon `lost` event). */
  | "max-hold"
  /** An operator revoked the lease (`mep lease revoke`); learnt at the daemon's next renewal (a daemon `lost` event). */
  | "revoked"
  /** Another daemon `lost` event's reason (e.g. `"deadline"`, `"stale-fence"`, `"lease-expired"`), or a refusal from verify/sync. */
  | (string & {});

/** What {@link LeaseLost} is built from. */
export interface LeaseLostInit {
  /** The lease's canonical name. */
  canonicalName: string;
  /** The token that is no longer valid. */
  fencingToken: bigint;
  /** Why. */
  reason: LeaseLostReason;
  /** A message for people (a default is made from the reason). */
  detail?: string;
  /** The refusal or event that decided it, if any. */
  cause?: unknown;
}

/**
 * The lease is gone: its fencing token must not be used any more. Thrown by
 * {@link Lease.check}, {@link Lease.verify} and {@link Lease.sync} after a loss, and the
 * `reason` of {@link Lease.signal}. Code `lease-lost` (this library's own, not a daemon
 * problem code), status 0.
 */
export class LeaseLost extends MepError {
  /** Why: see {@link LeaseLostReason}. */
  readonly reason: LeaseLostReason;
  /** The lease's canonical name. */
  readonly canonicalName: string;
  /** The fencing token that is no longer valid. */
  readonly fencingToken: bigint;
  constructor(init: LeaseLostInit) {
    super({
      code: "lease-lost",
      status: 0,
      title: "Lease lost",
      detail:
        init.detail ??
        (init.reason === "released-by-holder"
          ? `the lease on "${init.canonicalName}" was released by this process`
          : `the lease on "${init.canonicalName}" (token ${init.fencingToken}) was lost: ${init.reason}`),
      extensions: { reason: init.reason },
      cause: init.cause,
    });
    this.reason = init.reason;
    this.canonicalName = init.canonicalName;
    this.fencingToken = init.fencingToken;
  }
}

interface ErrnoLike {
  code?: string;
}

type ErrorClass = new (init: MepErrorInit) => MepError;

/** The class for each problem code. */
export const ERROR_CLASSES: Readonly<Record<ProblemCode, ErrorClass>> = Object.freeze({
  "invalid-request": InvalidRequest,
  "idempotency-key-missing": IdempotencyKeyMissing,
  "idempotency-key-invalid": IdempotencyKeyInvalid,
  unauthenticated: Unauthenticated,
  forbidden: Forbidden,
  "not-found": NotFound,
  "memory-not-found": MemoryNotFound,
  "lease-not-found": LeaseNotFound,
  "method-not-allowed": MethodNotAllowed,
  "memory-id-taken": MemoryIdTaken,
  "stale-fence": StaleFence,
  "idempotency-request-in-flight": IdempotencyRequestInFlight,
  "lease-expired": LeaseExpired,
  "payload-too-large": PayloadTooLarge,
  "unsupported-media-type": UnsupportedMediaType,
  "invalid-name": InvalidName,
  "invalid-ttl": InvalidTtl,
  "idempotency-key-reused": IdempotencyKeyReused,
  "name-held": NameHeld,
  "name-confusable": NameConfusable,
  "memory-attached": MemoryAttached,
  "rate-limited": RateLimited,
  internal: Internal,
  "store-not-configured": StoreNotConfigured,
  "transaction-conflict": TransactionConflict,
  unavailable: Unavailable,
  "migration-in-progress": MigrationInProgress,
  "store-unavailable": StoreUnavailable,
  "insufficient-storage": InsufficientStorage,
  "control-plane-unreachable": ControlPlaneUnreachable,
});

const STANDARD_MEMBERS = new Set(["type", "title", "status", "detail", "instance", "code"]);

/**
 * Builds the typed error for a problem answer: the class of its `code` (base
 * {@link MepError} for a code this version does not know, keeping the code as sent).
 *
 * @param status the HTTP status of the answer
 * @param body the parsed problem body (or anything else the daemon sent)
 * @param retryAfterHeader the raw `Retry-After` header, if any
 */
export function problemToError(status: number, body: unknown, retryAfterHeader?: string | null): MepError {
  const b: ProblemBody = body !== null && typeof body === "object" && !Array.isArray(body) ? (body as ProblemBody) : {};
  const code = typeof b.code === "string" && b.code ? b.code : codeForStatus(status);
  const extensions: Record<string, unknown> = {};
  for (const [k, v] of Object.entries(b)) if (!STANDARD_MEMBERS.has(k)) extensions[k] = v;
  const init: MepErrorInit = {
    code,
    status: typeof b.status === "number" ? b.status : status,
    title: typeof b.title === "string" ? b.title : undefined,
    detail: typeof b.detail === "string" ? b.detail : typeof body === "string" && body ? body : `mepd answered ${status}`,
    instance: typeof b.instance === "string" ? b.instance : undefined,
    type: typeof b.type === "string" ? b.type : undefined,
    retryAfter: parseRetryAfter(retryAfterHeader),
    extensions,
  };
  const cls = Object.prototype.hasOwnProperty.call(ERROR_CLASSES, code) ? ERROR_CLASSES[code as ProblemCode] : MepError;
  return new cls(init);
}

function codeForStatus(status: number): string {
  if (status === 404) return "not-found";
  if (status === 503) return "unavailable";
  if (status >= 400 && status < 500) return "invalid-request";
  return "internal";
}

/** Seconds from a `Retry-After` header (delta-seconds or an HTTP date), or undefined. */
export function parseRetryAfter(v: string | null | undefined): number | undefined {
  if (v === undefined || v === null) return undefined;
  const s = v.trim();
  if (/^\d+$/.test(s)) return Number(s);
  const t = Date.parse(s);
  if (Number.isNaN(t)) return undefined;
  return Math.max(0, Math.ceil((t - Date.now()) / 1000));
}

function toBigIntOrUndefined(v: unknown): bigint | undefined {
  if (typeof v === "bigint") return v;
  if (typeof v === "number" && Number.isInteger(v)) return BigInt(v);
  if (typeof v === "string" && /^-?\d+$/.test(v)) return BigInt(v);
  return undefined;
}
