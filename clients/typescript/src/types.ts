// The shapes mepd answers with, in camelCase, with tokens as bigint and times as Date.
import type { JsonValue } from "./json.js";
import { toToken, toTokenOpt } from "./json.js";

/** A lease's state in the daemon. */
export type DaemonLeaseState = "held" | "degraded" | "lost" | (string & {});

/** One lease as mepd reports it (`POST /v1/attach`, `GET /v1/leases[/{name}]`). */
export interface LeaseInfo {
  /** The lease's id. */
  leaseId: string;
  /** The canonical form of the name ("My Agent" → "myagent"). */
  canonicalName: string;
  /** The name as it was given. */
  displayName: string;
  /** The memory's identity (a UUID). */
  memoryInstanceId: string;
  /** The fencing token; `undefined` once the lease is lost. */
  fencingToken: bigint | undefined;
  /** When the control plane lets the lease expire unless renewed (its wall clock). */
  expiresAt: Date | undefined;
  /** The lease's TTL in seconds. */
  ttlSeconds: number;
  /** The memory file's absolute path. */
  path: string;
  /** `held`, `degraded` (renewals failing) or `lost`. */
  state: DaemonLeaseState;
  /** The process the lease is bound to (`bind: "pid"`), or null. */
  bindPid: number | null;
  /** Why the lease was lost, when it was. */
  lostReason: string | undefined;
  /** The object as the daemon sent it. */
  raw: Readonly<Record<string, JsonValue>>;
}

/** A memory file's identity (`GET /v1/identify`, `POST /v1/init`). */
export interface MemoryIdentity {
  /** The memory's id. */
  memoryInstanceId: string;
  /** The file's absolute path. */
  path: string;
  /** The memory it was branched from, or null. */
  parentMemoryInstanceId: string | null;
  /** The parent's fencing token at the branch, or null. */
  branchedAtToken: bigint | null;
}

/** The answer of {@link Client.branch}. */
export interface BranchResult {
  /** The new memory's id. */
  memoryInstanceId: string;
  /** The source memory's id. */
  parentMemoryInstanceId: string;
  /** The source's fencing token when the branch was made. */
  branchedAtToken: bigint;
  /** The new file's absolute path. */
  path: string;
}

/** One memory in a lineage. */
export interface MemoryRecord {
  /** The memory's id. */
  memoryInstanceId: string;
  /** The memory it was branched from, or null for a root. */
  parentMemoryInstanceId: string | null;
  /** The parent's fencing token at the branch, or null. */
  branchedAtToken: bigint | null;
  /** When it was registered. */
  createdAt: Date | undefined;
  /** The highest fencing token the control plane has handed out for it. */
  fencingTokenHighWater: bigint | undefined;
}

/** A memory's ancestry (`GET /v1/lineage`). */
export interface Lineage {
  /** The memory asked about. */
  memoryInstanceId: string;
  /** Its own record. */
  memory: MemoryRecord;
  /** Parent first, then its parent, and so on. */
  ancestors: MemoryRecord[];
  /** Memories branched from it. */
  children: MemoryRecord[];
}

/** `GET /healthz`. */
export interface Health {
  /** `"ok"` when the daemon serves. */
  status: string;
  /** The daemon's id (stable per state directory). */
  daemonId: string;
  /** e.g. `"embedded (sqlite:…)"` or the control plane's URL. */
  controlPlane: string;
  /** How many leases the daemon keeps. */
  leases: number;
}

/** {@link Client.status}: the daemon's health and every lease it keeps. */
export interface DaemonStatus extends Health {
  /** Every lease the daemon keeps (`GET /v1/leases`). */
  leaseList: LeaseInfo[];
}

/** An event kind of `GET /v1/events`. */
export type DaemonEventKind = "granted" | "renewed" | "degraded" | "lost" | "released" | (string & {});

/** One event of the daemon's stream (`GET /v1/events`). */
export interface DaemonEvent {
  /** `granted`, `renewed`, `degraded`, `lost` or `released`. */
  event: DaemonEventKind;
  /** The lease's canonical name: filter on it (the stream carries every lease of the daemon). */
  canonicalName: string;
  /** The lease's memory. */
  memoryInstanceId: string;
  /** The lease's id ({@link LeaseInfo.leaseId}): tells successive holders of a name apart. */
  leaseId: string | undefined;
  /** The lease's state after the event. */
  state: string;
  /** When the daemon emitted it (its wall clock). */
  at: Date | undefined;
  /** The lease's token (absent on `lost` and `released`). */
  fencingToken: bigint | undefined;
  /** The control plane's expiry (on `granted`, `renewed`, `degraded`). */
  expiresAt: Date | undefined;
  /** For `degraded` and `lost`: why. */
  reason: string | undefined;
  /** The event as the daemon sent it. */
  raw: Readonly<Record<string, JsonValue>>;
}

/** `POST /v1/verify`: the control plane confirmed the token is current. */
export interface VerifyResult {
  /** The lease's canonical name. */
  canonicalName: string;
  /** The lease's memory. */
  memoryInstanceId: string;
  /** The token the control plane confirmed as current. */
  fencingToken: bigint;
  /** The control plane's expiry. */
  expiresAt: Date | undefined;
}

/** `POST /v1/sync`: the file's bytes are in the data plane under the lease's token. */
export interface SyncResult {
  /** The lease's canonical name. */
  canonicalName: string;
  /** The memory uploaded. */
  memoryInstanceId: string;
  /** The token the upload was made with. */
  fencingToken: bigint;
  /** The stored object's ETag. */
  etag: string;
  /** Bytes uploaded. */
  size: number;
}

/** `POST /v1/fetch`: the latest object was written to a new file bound to the memory. */
export interface FetchResult {
  /** The memory fetched. */
  memoryInstanceId: string;
  /** The new file's absolute path. */
  path: string;
  /** The token the object was written with. */
  fencingToken: bigint | undefined;
  /** The object's ETag. */
  etag: string;
  /** Bytes written. */
  size: number;
}

// ---- parsing -------------------------------------------------------------------------------

type Obj = Record<string, JsonValue>;

function obj(v: JsonValue | undefined, what: string): Obj {
  if (v === null || v === undefined || typeof v !== "object" || Array.isArray(v)) throw new TypeError(`mepd sent no ${what} object`);
  return v as Obj;
}
const s = (o: Obj, k: string): string => (typeof o[k] === "string" ? (o[k] as string) : "");
const so = (o: Obj, k: string): string | undefined => (typeof o[k] === "string" ? (o[k] as string) : undefined);
const sn = (o: Obj, k: string): string | null => (typeof o[k] === "string" ? (o[k] as string) : null);
const n = (o: Obj, k: string): number => (typeof o[k] === "number" ? (o[k] as number) : typeof o[k] === "bigint" ? Number(o[k]) : 0);
const d = (o: Obj, k: string): Date | undefined => {
  const v = o[k];
  if (typeof v !== "string") return undefined;
  const t = Date.parse(v);
  return Number.isNaN(t) ? undefined : new Date(t);
};
const tn = (o: Obj, k: string): bigint | null => {
  const v = toTokenOpt(o[k]);
  return v === undefined ? null : v;
};

/** @internal */
export function parseLeaseInfo(v: JsonValue | undefined): LeaseInfo {
  const o = obj(v, "lease");
  return {
    leaseId: s(o, "lease_id"),
    canonicalName: s(o, "canonical_name"),
    displayName: s(o, "display_name"),
    memoryInstanceId: s(o, "memory_instance_id"),
    fencingToken: toTokenOpt(o["fencing_token"]),
    expiresAt: d(o, "expires_at"),
    ttlSeconds: n(o, "ttl_seconds"),
    path: s(o, "path"),
    state: s(o, "state"),
    bindPid: typeof o["bind_pid"] === "number" ? (o["bind_pid"] as number) : null,
    lostReason: so(o, "lost_reason"),
    raw: Object.freeze({ ...o }),
  };
}

/** @internal */
export function parseIdentity(v: JsonValue | undefined): MemoryIdentity {
  const o = obj(v, "identity");
  return {
    memoryInstanceId: s(o, "memory_instance_id"),
    path: s(o, "path"),
    parentMemoryInstanceId: sn(o, "parent_memory_instance_id"),
    branchedAtToken: tn(o, "branched_at_token"),
  };
}

/** @internal */
export function parseBranch(v: JsonValue | undefined): BranchResult {
  const o = obj(v, "branch");
  return {
    memoryInstanceId: s(o, "memory_instance_id"),
    parentMemoryInstanceId: s(o, "parent_memory_instance_id"),
    branchedAtToken: toToken(o["branched_at_token"], "branched_at_token"),
    path: s(o, "path"),
  };
}

function parseRecord(v: JsonValue | undefined): MemoryRecord {
  const o = obj(v, "memory");
  return {
    memoryInstanceId: s(o, "memory_instance_id"),
    parentMemoryInstanceId: sn(o, "parent_memory_instance_id"),
    branchedAtToken: tn(o, "branched_at_token"),
    createdAt: d(o, "created_at"),
    fencingTokenHighWater: toTokenOpt(o["fencing_token_high_water"]),
  };
}

/** @internal */
export function parseLineage(v: JsonValue | undefined): Lineage {
  const o = obj(v, "lineage");
  const arr = (k: string) => (Array.isArray(o[k]) ? (o[k] as JsonValue[]).map(parseRecord) : []);
  return { memoryInstanceId: s(o, "memory_instance_id"), memory: parseRecord(o["memory"]), ancestors: arr("ancestors"), children: arr("children") };
}

/** @internal */
export function parseHealth(v: JsonValue | undefined): Health {
  const o = obj(v, "health");
  return { status: s(o, "status"), daemonId: s(o, "daemon_id"), controlPlane: s(o, "control_plane"), leases: n(o, "leases") };
}

/** @internal */
export function parseEvent(v: JsonValue): DaemonEvent | undefined {
  if (v === null || typeof v !== "object" || Array.isArray(v)) return undefined;
  const o = v as Obj;
  let token: bigint | undefined;
  try {
    token = toTokenOpt(o["fencing_token"]);
  } catch {
    token = undefined;
  }
  return {
    event: s(o, "event"),
    canonicalName: s(o, "canonical_name"),
    memoryInstanceId: s(o, "memory_instance_id"),
    leaseId: so(o, "lease_id"),
    state: s(o, "state"),
    at: d(o, "at"),
    fencingToken: token,
    expiresAt: d(o, "expires_at"),
    reason: so(o, "reason"),
    raw: Object.freeze({ ...o }),
  };
}

/** @internal */
export function parseVerify(v: JsonValue | undefined): VerifyResult {
  const o = obj(v, "verify");
  return {
    canonicalName: s(o, "canonical_name"),
    memoryInstanceId: s(o, "memory_instance_id"),
    fencingToken: toToken(o["fencing_token"]),
    expiresAt: d(o, "expires_at"),
  };
}

/** @internal */
export function parseSync(v: JsonValue | undefined): SyncResult {
  const o = obj(v, "sync");
  return {
    canonicalName: s(o, "canonical_name"),
    memoryInstanceId: s(o, "memory_instance_id"),
    fencingToken: toToken(o["fencing_token"]),
    etag: s(o, "etag"),
    size: n(o, "size"),
  };
}

/** @internal */
export function parseFetch(v: JsonValue | undefined): FetchResult {
  const o = obj(v, "fetch");
  return {
    memoryInstanceId: s(o, "memory_instance_id"),
    path: s(o, "path"),
    fencingToken: toTokenOpt(o["fencing_token"]),
    etag: s(o, "etag"),
    size: n(o, "size"),
  };
}
