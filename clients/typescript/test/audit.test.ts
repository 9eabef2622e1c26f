// Regression tests for the defects an audit of the SDK found: verify/sync of a lease whose
// name passed to another memory with an equal token, a grant after a queue wait taken for a
// loss, the client's timeoutMs when opening the event stream, an aborted request, abort
// listeners left on a signal, the lease id in daemon events, and an empty socketPath.
import { test } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { getEventListeners } from "node:events";
import { createServer, type Socket } from "node:net";
import * as mep from "@mep/client";
import { MEP_BIN, Sandbox, binSkip, newMemory, sleep, storeSkip, waitFor } from "./harness.js";

// What these tests use of node:events and node:net beyond types/node.d.ts.
declare module "node:events" {
  export function getEventListeners(emitter: AbortSignal | EventEmitter, name: string): Function[];
}
declare module "node:net" {
  interface Server {
    listen(path: string, cb?: () => void): this;
  }
}

const opts = { skip: binSkip ?? false, timeout: 60000 };
const storeOpts = { skip: storeSkip ?? false, timeout: 90000 };
// No process needed: a Unix socket served by this process.
const localOpts = { timeout: 60000 };

/**
 * Runs `mep --socket SOCKET ARGS…` to completion. Synchronous on purpose: this process's
 * event loop is blocked meanwhile, so a lease's event stream hears of it only afterwards.
 */
function mepSync(sb: Sandbox, socket: string, ...args: string[]): void {
  const r = spawnSync(MEP_BIN, ["--socket", socket, ...args], { env: sb.env, encoding: "utf8", timeout: 20000 });
  assert.equal(r.status, 0, `mep ${args.join(" ")} exited ${r.status}: ${r.stdout}${r.stderr}`);
}

/** A Unix socket server that accepts connections and never answers; closed (its connections destroyed) at disposal. */
async function silentServer(path: string): Promise<{ path: string; [Symbol.asyncDispose](): Promise<void> }> {
  const conns = new Set<Socket>();
  const srv = createServer((s) => {
    conns.add(s);
    s.on("error", () => {});
    s.on("close", () => conns.delete(s));
  });
  await new Promise<void>((resolve, reject) => {
    srv.once("error", reject);
    srv.listen(path, () => resolve());
  });
  return {
    path,
    async [Symbol.asyncDispose]() {
      for (const s of conns) s.destroy();
      await new Promise<void>((r) => srv.close(() => r()));
    },
  };
}

/** Reads `it` to its end (without return(): the stream must finish by itself). */
async function drain(it: mep.DaemonEventStream): Promise<void> {
  for (;;) {
    const r = await it.next().catch(() => ({ done: true as const, value: undefined }));
    if (r.done) return;
  }
}

const lostOrNotFound = (e: unknown) => e instanceof mep.LeaseLost || e instanceof mep.LeaseNotFound;

test("verify() rejects once the name passed to another memory under an equal token", opts, async () => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const f1 = await newMemory(sb, d.client, "f1");
  const f2 = await newMemory(sb, d.client, "f2");
  const lease = await d.client.lease("audit-verify", f1, { bind: "none" });
  // Released and claimed again on f2 while this event loop is blocked: the lease is still
  // "held" here when verify() starts, and only the daemon's answer can tell.
  mepSync(sb, d.socket, "release", "audit-verify");
  mepSync(sb, d.socket, "claim", "audit-verify", f2);
  const verified = lease.verify();
  await assert.rejects(verified, lostOrNotFound);
  assert.equal(lease.state, "lost");
  assert.equal(lease.signal.aborted, true);
  // The premise: the other lease has the same token value (tokens count per memory).
  const other = await d.client.getLease("audit-verify");
  assert.notEqual(other.leaseId, lease.leaseId);
  assert.notEqual(other.memoryInstanceId, lease.memoryInstanceId);
  assert.equal(other.fencingToken, lease.token);
  await lease.release();
  assert.equal((await d.client.getLease("audit-verify")).leaseId, other.leaseId, "the other agent's lease is left alone");
  await d.client.detach("audit-verify");
});

test("sync() rejects once the name passed to another memory under an equal token", storeOpts, async () => {
  await using sb = Sandbox.create();
  const store = await sb.startStore();
  const d = await sb.startMepd({ store });
  const f1 = await newMemory(sb, d.client, "f1");
  const f2 = await newMemory(sb, d.client, "f2");
  const lease = await d.client.lease("audit-sync", f1, { bind: "none" });
  mepSync(sb, d.socket, "release", "audit-sync");
  mepSync(sb, d.socket, "claim", "audit-sync", f2);
  const synced = lease.sync({ timeoutMs: 30000 });
  await assert.rejects(synced, lostOrNotFound);
  assert.equal(lease.state, "lost");
  const other = await d.client.getLease("audit-sync");
  assert.notEqual(other.memoryInstanceId, lease.memoryInstanceId);
  assert.equal(other.fencingToken, lease.token);
  await d.client.detach("audit-sync");
});

test("a lease granted after a queue wait is not lost to an earlier waiter's grant and release of an equal token", opts, async () => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const fA = await newMemory(sb, d.client, "fA");
  const fB = await newMemory(sb, d.client, "fB");
  const fC = await newMemory(sb, d.client, "fC");
  const seen: mep.DaemonEvent[] = [];
  const observer = d.client.events();
  await observer.ready;
  const observed = (async () => {
    for await (const ev of observer) seen.push(ev);
  })().catch(() => {});

  mepSync(sb, d.socket, "claim", "audit-queue", fB); // B holds the name
  const clientC = new mep.Client({ socketPath: d.socket });
  let leaseC: mep.Lease | undefined;
  const doneC = (async () => {
    leaseC = await clientC.lease("audit-queue", fC, { wait: 20 });
    await sleep(300);
    await leaseC.release();
  })();
  // The socket API shows no queue position, so the order is set by time: generous steps
  // (C's attach opens its event stream, then queues; a loaded machine took over 500 ms).
  await sleep(1500); // C queues first
  const ours = d.client.lease("audit-queue", fA, { wait: 20 });
  await sleep(1500); // then we do
  mepSync(sb, d.socket, "release", "audit-queue");
  await doneC;
  const lease = await ours;
  // Every event up to our grant has reached this process (and, on its own stream, the lease).
  await waitFor(() => seen.some((e) => e.event === "granted" && e.memoryInstanceId === lease.memoryInstanceId), 10000, "our grant on the event stream");
  await sleep(300);
  assert.equal(lease.token, leaseC!.token, "the premise: C's token value equals ours (tokens count per memory)");
  assert.notEqual(lease.memoryInstanceId, leaseC!.memoryInstanceId);
  assert.equal(lease.state, "held");
  assert.equal(lease.signal.aborted, false);
  assert.equal(lease.lostReason, undefined);
  lease.check();
  assert.equal((await d.client.getLease("audit-queue")).leaseId, lease.leaseId);
  await lease.release();
  observer.close();
  await observed;
});

test("lease() and events() give up opening the event stream after the client's timeoutMs", localOpts, async () => {
  await using sb = Sandbox.create();
  await using srv = await silentServer(sb.path("silent.sock"));
  const c = new mep.Client({ socketPath: srv.path, timeoutMs: 1000 });

  const e1 = await c.lease("silent", sb.path("x.uai")).catch((e: unknown) => e);
  assert.ok(e1 instanceof mep.Unavailable, String(e1));
  assert.ok(!(e1 instanceof mep.DaemonNotRunning), String(e1));
  assert.match(e1.message, /\/v1\/events within 1000 ms/); // "within 10000 ms" does not match

  const it = c.events();
  const e2 = await it.next().catch((e: unknown) => e);
  assert.ok(e2 instanceof mep.Unavailable, String(e2));
  assert.match(e2.message, /\/v1\/events within 1000 ms/);
});

test("an aborted request rejects with the signal's reason (AbortError), not Unavailable", localOpts, async () => {
  await using sb = Sandbox.create();
  await using srv = await silentServer(sb.path("silent.sock"));
  const c = new mep.Client({ socketPath: srv.path });
  const ac = new AbortController();
  const t = setTimeout(() => ac.abort(), 200);
  const e = await c.request("GET", "/healthz", undefined, { signal: ac.signal }).catch((x: unknown) => x);
  clearTimeout(t);
  assert.ok(!(e instanceof mep.Unavailable), `not Unavailable: ${String(e)}`);
  assert.equal((e as Error).name, "AbortError", String(e));
  assert.equal(e, ac.signal.reason);
});

test("events({signal}) streams that end by themselves take their abort listener off the signal", opts, async () => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const ac = new AbortController();
  const streams: mep.DaemonEventStream[] = [];
  for (let i = 0; i < 5; i++) {
    const it = d.client.events({ signal: ac.signal });
    await it.ready;
    streams.push(it);
  }
  assert.equal(getEventListeners(ac.signal, "abort").length, 5);
  // Two closed by close(), three ended by the daemon stopping.
  streams[0]!.close();
  streams[1]!.close();
  await d.proc.stop();
  for (const it of streams) await drain(it);
  assert.equal(getEventListeners(ac.signal, "abort").length, 0);
  assert.equal(ac.signal.aborted, false);
});

test("daemon events carry the lease id", opts, async () => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const f = await newMemory(sb, d.client, "f");
  const evs = d.client.events();
  await evs.ready;
  const lease = await d.client.lease("audit-events", f);
  let granted: mep.DaemonEvent | undefined;
  for await (const ev of evs) {
    if (ev.canonicalName === "audit-events" && ev.event === "granted") {
      granted = ev;
      break;
    }
  }
  assert.ok(granted);
  assert.equal(granted.memoryInstanceId, lease.memoryInstanceId);
  assert.equal(granted.leaseId, lease.leaseId);
  await lease.release();
});

test("an empty socketPath is a TypeError, not $MEP_SOCKET or the config file's", () => {
  assert.throws(() => new mep.Client({ socketPath: "", env: { MEP_SOCKET: "/nonexistent/elsewhere.sock" } }), TypeError);
  assert.throws(() => new mep.Client({ socketPath: "" }), TypeError);
});
