/**
 * `@mep/client`: the TypeScript/Node client of mep's host daemon `mepd`. Claim a globally
 * unique agent name and exclusive use of a memory file (`.uai`) through a fenced lease,
 * bound to this process, watched for loss, and carried into writes by its fencing token.
 *
 * ```ts
 * import * as mep from "@mep/client";
 * await using lease = await mep.lease("My Agent", "agent.uai", { ttl: 30 });
 * while (!lease.signal.aborted) { await work(lease.signal); await lease.sync(); }
 * ```
 *
 * The module-level functions use a {@link Client} on the socket the `mep` CLI would use
 * (`$MEP_SOCKET`, the config file, `$XDG_RUNTIME_DIR/mep/mepd.sock`, `/run/mep/mepd.sock`),
 * found anew on each call (a config file the CLI refuses makes them reject with
 * {@link ConfigError}; wrong arguments with a TypeError or RangeError naming them).
 *
 * @packageDocumentation
 */
import "./polyfill.js";
import { Client, type DaemonEventStream, type EventsOptions, type LineageQuery, type SyncOptions, type TransferOptions } from "./client.js";
import type { Lease, LeaseOptions } from "./lease.js";
import type { BranchResult, DaemonStatus, FetchResult, Lineage, MemoryIdentity } from "./types.js";

export { Client, type ClientOptions, type DaemonEventStream, type EventsOptions, type LineageQuery, type SyncOptions, type TransferOptions } from "./client.js";
export {
  Lease,
  currentLease,
  type AtRiskInfo,
  type LeaseEventMap,
  type LeaseOptions,
  type LeaseState,
  type RenewedInfo,
} from "./lease.js";
export { loadConfig, parseConfig, resolveSocketPath, type ConfigFile, type SocketResolution } from "./socket.js";
export { parseJson, type JsonValue } from "./json.js";
export type {
  BranchResult,
  DaemonEvent,
  DaemonEventKind,
  DaemonLeaseState,
  DaemonStatus,
  FetchResult,
  Health,
  LeaseInfo,
  Lineage,
  MemoryIdentity,
  MemoryRecord,
  SyncResult,
  VerifyResult,
} from "./types.js";
export * from "./errors.js";

/**
 * Claims `name` for the memory file `path` through the local mepd, bound to this process.
 * Use `await using lease = await lease(...)`, or call `lease.release()`.
 * See {@link Client.lease}.
 */
export async function lease(name: string, path: string, options?: LeaseOptions): Promise<Lease> {
  return new Client().lease(name, path, options);
}

/**
 * Runs `fn` under a lease on `name`/`path` and releases it afterwards, also when `fn` throws
 * (that error is rethrown, never masked). {@link currentLease} is the lease inside `fn`.
 * See {@link Client.withLease}.
 */
export async function withLease<R>(name: string, path: string, fn: (lease: Lease) => R | Promise<R>, options?: LeaseOptions): Promise<R> {
  return new Client().withLease(name, path, fn, options);
}

/** Creates a new, empty memory file with a fresh identity. See {@link Client.init}. */
export async function init(path: string): Promise<MemoryIdentity> {
  return new Client().init(path);
}

/** Copies a held memory to `newPath` as a new identity with lineage. See {@link Client.branch}. */
export async function branch(path: string, newPath: string): Promise<BranchResult> {
  return new Client().branch(path, newPath);
}

/** The identity of a memory file. See {@link Client.identify}. */
export async function identify(path: string): Promise<MemoryIdentity> {
  return new Client().identify(path);
}

/** A memory's ancestors and children, by path or id. See {@link Client.lineage}. */
export async function lineage(pathOrId: LineageQuery): Promise<Lineage> {
  return new Client().lineage(pathOrId);
}

/** The daemon's health and its leases. See {@link Client.status}. */
export async function status(): Promise<DaemonStatus> {
  return new Client().status();
}

/** The daemon's event stream as an async iterator. See {@link Client.events}. */
export function events(options?: EventsOptions): DaemonEventStream {
  return new Client().events(options);
}

/**
 * Downloads the latest stored object of a memory into the new file `path`, bound to its
 * identity (a memory moving to this host). No time limit unless `options.timeoutMs`.
 * See {@link Client.fetch}.
 */
export async function fetch(memoryInstanceId: string, path: string, options?: TransferOptions): Promise<FetchResult> {
  return new Client().fetch(memoryInstanceId, path, options);
}

/** The same as {@link fetch}, under a name that does not shadow the global `fetch`. */
export const fetchMemory = fetch;
