// Holder metadata and the longest hold: `labels` and `maxHold` checked before anything is sent
// and carried to the control plane (read back from a real `mep server`), the holder a refused
// claim names (`Held.holder`), and the losses with reasons "max-hold" and "revoked".
import { test } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdtempSync, readlinkSync, rmSync } from "node:fs";
import { hostname, tmpdir } from "node:os";
import { basename, join } from "node:path";
import * as mep from "@mep/client";
import { MEP_BIN, Sandbox, binSkip, newMemory, serverLease, waitFor } from "./harness.js";

// What these tests use of node:os and node:fs beyond types/node.d.ts.
declare module "node:os" {
  export function hostname(): string;
}
declare module "node:fs" {
  export function readlinkSync(path: string): string;
}

const opts = { skip: binSkip ?? false, timeout: 60000 };
const LABELS = { job: "ci-42", team: "infra", note: "caf\u00e9 \u2615" };

/** The rejection of `p` (fails the test if it resolves). */
async function refusal(p: Promise<unknown>): Promise<unknown> {
  return p.then(
    (v) => assert.fail(`expected a refusal, got ${String(v)}`),
    (e: unknown) => e,
  );
}

test("a held error's holder: display name, host, since and expiry, or null", () => {
  const view = { display_name: "builder-7", host: "host-a", since: "2026-12-06T14:02:07.123Z", expires_at: "2026-12-06T14:03:07.5Z" };
  for (const [code, cls] of [
    ["name-held", mep.NameHeld],
    ["name-confusable", mep.NameConfusable],
    ["memory-attached", mep.MemoryAttached],
  ] as const) {
    const e = mep.problemToError(423, { code, status: 423, detail: "held", holder: view }, "5");
    assert.ok(e instanceof cls && e instanceof mep.Held && e instanceof mep.MepError, String(e));
    assert.equal(e.retryAfter, 5);
    const h: mep.HolderView | null = e.holder;
    assert.deepEqual(h, { displayName: "builder-7", host: "host-a", since: new Date(Date.UTC(2026, 11, 6, 14, 2, 7, 123)), expiresAt: new Date(Date.UTC(2026, 11, 6, 14, 3, 7, 500)) });
    assert.ok(Object.isFrozen(h));
  }
  // No host (an anonymous holder); no holder (another tenant's lease, an older daemon); one
  // that cannot be read: null, never an exception.
  const { host: _host, ...noHost } = view;
  const anon = mep.problemToError(423, { code: "name-held", holder: noHost }) as mep.Held;
  assert.equal(anon.holder?.displayName, "builder-7");
  assert.equal(anon.holder?.host, null);
  assert.equal((mep.problemToError(423, { code: "name-held" }) as mep.Held).holder, null);
  for (const bad of ["x", null, { display_name: "a" }, { ...view, since: "yesterday" }, { ...view, display_name: 7 }])
    assert.equal((mep.problemToError(423, { code: "memory-attached", holder: bad }) as mep.Held).holder, null, JSON.stringify(bad));
});

test("labels and maxHold: a wrong one is a TypeError or RangeError naming it, before anything is sent", async () => {
  const dir = mkdtempSync(join(tmpdir(), "mep-ts-holder-"));
  try {
    // No daemon at this socket: anything sent would be DaemonNotRunning.
    const c = new mep.Client({ socketPath: join(dir, "no.sock") });
    const file = join(dir, "m.uai");
    const seventeen: Record<string, string> = {};
    for (let i = 0; i < 17; i++) seventeen[`k${i}`] = "v";
    const badLabels: [new (...a: never[]) => Error, RegExp, unknown][] = [
      [RangeError, /labels holds at most 16 labels, not 17/, seventeen],
      [TypeError, /labels: the key "a b" must be 1-63 characters of A-Z a-z 0-9 _ \. -/, { "a b": "x" }],
      [TypeError, /the key "" must be 1-63/, { "": "x" }],
      [TypeError, /must be 1-63/, { ["k".repeat(64)]: "x" }],
      [TypeError, /must be 1-63/, { "caf\u00e9": "x" }],
      [TypeError, /labels\["n"\] must be a string, not number 1/, { n: 1 }],
      [TypeError, /labels\["n"\] must be a string, not null/, { n: null }],
      [RangeError, /labels\["long"\] must be at most 255 bytes of UTF-8, not 256/, { long: "x".repeat(256) }],
      [RangeError, /not 256/, { long: "\u00e9".repeat(128) }], // 128 characters, 256 bytes
      [TypeError, /labels\["bell"\] contains the control character U\+0007 at index 1/, { bell: "a\u0007" }],
      [TypeError, /control character U\+0085/, { nel: "\u0085" }],
      [TypeError, /lone surrogate U\+DC80/, { s: "a\udc80" }],
      [TypeError, /labels must be an object of string values, not the string/, "a=b"],
      [TypeError, /labels must be an object of string values, not an array/, [["a", "b"]]],
      [TypeError, /labels must be an object of string values, not null/, null],
      [TypeError, /labels must be an object of string values, not a Map/, new Map([["a", "b"]])],
    ];
    const badHolds: [new (...a: never[]) => Error, RegExp, unknown][] = [
      [RangeError, /maxHold must be between 5 and 31622400 seconds/, 4],
      [RangeError, /maxHold must be between 5 and 31622400/, 31622401],
      [RangeError, /between 5 and/, -10],
      [TypeError, /maxHold must be a whole number of seconds, not the string "10"/, "10"],
      [TypeError, /maxHold must be a whole number of seconds, not boolean true/, true],
      [RangeError, /maxHold must be a whole number of seconds, not 10\.5/, 10.5],
      [RangeError, /maxHold/, Number.NaN],
      [RangeError, /maxHold/, Infinity],
    ];
    const js = c as unknown as Record<string, (...a: unknown[]) => Promise<unknown>>;
    const calls: ((o: unknown) => Promise<unknown>)[] = [
      (o) => js["lease"]!("agent", file, o),
      (o) => js["attach"]!("agent", file, o),
      (o) => js["withLease"]!("agent", file, () => assert.fail("must not run"), o),
    ];
    for (const [cls, re, value] of badLabels)
      for (const call of calls) {
        const e = await refusal(call({ labels: value }));
        assert.ok(e instanceof cls, `labels ${String(value)}: expected a ${cls.name}, got ${String(e)}`);
        assert.match((e as Error).message, re);
      }
    for (const [cls, re, value] of badHolds)
      for (const call of calls) {
        const e = await refusal(call({ ttl: 30, maxHold: value }));
        assert.ok(e instanceof cls, `maxHold ${String(value)}: expected a ${cls.name}, got ${String(e)}`);
        assert.match((e as Error).message, re);
      }
    // The edges are good arguments, and get as far as the (missing) daemon.
    const edge: Record<string, string> = {};
    for (let i = 0; i < 16; i++) edge[`k${String(i).padStart(2, "0")}-._${"K".repeat(57)}`] = "\u00e9".repeat(127) + "x";
    assert.deepEqual([...new Set(Object.keys(edge).map((k) => k.length))], [63]);
    for (const maxHold of [5, 31622400])
      await assert.rejects(c.lease("agent", file, { labels: edge, maxHold }), mep.DaemonNotRunning);
    await assert.rejects(c.lease("agent", file, { labels: {}, maxHold: undefined }), mep.DaemonNotRunning);
    // A key that is an Object.prototype name is a label like any other.
    await assert.rejects(c.attach("agent", file, { labels: JSON.parse('{"__proto__":"x","constructor":"y"}') as Record<string, string> }), mep.DaemonNotRunning);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("embedded: labels and maxHold are taken; a refused claim names the holder", opts, async () => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const a = await newMemory(sb, d.client, "a");
  const b = await newMemory(sb, d.client, "b");
  const before = Date.now();
  {
    await using lease = await d.client.lease("Builder 7", a, { ttl: 10, labels: LABELS, maxHold: 600 });
    assert.deepEqual((await d.client.leases()).map((l) => l.leaseId), [lease.leaseId]);
    // A second client of the same tenant.
    const other = new mep.Client({ socketPath: d.socket });
    const e = await refusal(other.lease("builder 7", b, { labels: { job: "ci-43" } }));
    assert.ok(e instanceof mep.NameHeld, String(e));
    const now = Date.now();
    const h = e.holder;
    assert.ok(h, "a requester of the same tenant is told who holds it");
    assert.equal(h.displayName, "Builder 7");
    assert.equal(h.host, hostname());
    assert.ok(h.since.getTime() <= now, `since ${h.since.toISOString()} is not in the future`);
    assert.ok(h.since.getTime() >= before - 1000, `since ${h.since.toISOString()} is this lease's grant`);
    assert.ok(h.expiresAt.getTime() > h.since.getTime());
    assert.ok(h.expiresAt.getTime() > now - 1000, "the live lease's expiry");
    assert.deepEqual(Object.keys(e.extensions["holder"] as object).sort(), ["display_name", "expires_at", "host", "since"], "no lease id, owner or token");
    // The memory says the same of its holder.
    const m = await refusal(other.lease("someone else", a, { maxHold: 60 }));
    assert.ok(m instanceof mep.MemoryAttached, String(m));
    assert.equal(m.holder?.displayName, "Builder 7");
    assert.equal(m.holder?.since.getTime(), h.since.getTime());
  }
  {
    // And a name that looks the same ("paypa1" has the skeleton of "paypal").
    await using _held = await d.client.lease("paypal", a);
    const c = await refusal(d.client.lease("paypa1", b, { labels: { x: "y" } }));
    assert.ok(c instanceof mep.NameConfusable, String(c));
    assert.equal(c.holder?.displayName, "paypal");
  }
  // The bare attach takes them too.
  const info = await d.client.attach("bare", b, { ttl: 10, bind: "none", labels: { k: "v" }, maxHold: 30 });
  assert.equal(info.state, "held");
  assert.equal(await d.client.detach("bare", info.leaseId), undefined);
  assert.deepEqual(await d.client.leases(), []);
});

test("embedded: a lease that reaches its maxHold is lost with reason max-hold", opts, async () => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const a = await newMemory(sb, d.client, "a");
  await using lease = await d.client.lease("short hold", a, { ttl: 5, maxHold: 6 });
  const heard: mep.LeaseLost[] = [];
  lease.on("lost", (e) => heard.push(e));
  await waitFor(() => lease.signal.aborted, 15000, "the lease to be lost");
  // Told by the daemon (its first renewal is refused), not found by the local deadline: the
  // reason says which (no stopwatch: a loaded machine hears it late, never early).
  assert.equal(lease.lostReason, "max-hold");
  assert.ok(lease.signal.reason instanceof mep.LeaseLost);
  assert.equal(lease.signal.reason.reason, "max-hold");
  assert.deepEqual(heard.map((e) => e.reason), ["max-hold"]);
  assert.equal(lease.state, "lost");
  assert.throws(() => lease.check(), (e: unknown) => e instanceof mep.LeaseLost && e.reason === "max-hold");
  const info = await d.client.getLease("short hold");
  assert.deepEqual([info.state, info.lostReason], ["lost", "max-hold"]);
  await lease.release();
  assert.deepEqual(await d.client.leases(), []);
});

test("remote: labels and maxHold reach the control plane; another daemon is told who holds the name", opts, async () => {
  await using sb = Sandbox.create();
  const server = await sb.startServer();
  const token = sb.tokenFile(server, "t");
  const d = await sb.startMepd({ controlPlane: server.url, tokenFile: token });
  const a = await newMemory(sb, d.client, "a");
  {
    await using lease = await d.client.lease("Builder 7", a, { ttl: 10, labels: LABELS, maxHold: 600 });
    const doc = await serverLease(server, "builder7", token);
    assert.equal(doc["lease_id"], lease.leaseId);
    const holder = doc["holder"] as Record<string, unknown>;
    assert.deepEqual(holder["labels"], LABELS);
    assert.equal(holder["pid"], process.pid);
    assert.equal(holder["host"], hostname());
    assert.equal(holder["exe"], basename(readlinkSync("/proc/self/exe")));
    const grantedAt = Date.parse(doc["granted_at"] as string);
    assert.equal(Date.parse(doc["hold_until"] as string) - grantedAt, 600000);
    // Another daemon of the tenant (another host, as far as the server knows).
    const d2 = await sb.startMepd({ controlPlane: server.url, tokenFile: sb.tokenFile(server, "t") });
    const e = await refusal(d2.client.lease("builder 7", await newMemory(sb, d2.client, "b")));
    assert.ok(e instanceof mep.NameHeld, String(e));
    assert.equal(e.holder?.displayName, "Builder 7");
    assert.equal(e.holder?.host, hostname());
    assert.equal(e.holder?.since.getTime(), grantedAt);
    assert.ok(e.holder!.since.getTime() <= Date.now());
  }
  // No labels and no maxHold: none sent, none kept.
  const info = await d.client.attach("plain", a, { ttl: 10, bind: "none" });
  const doc = await serverLease(server, "plain", token);
  assert.equal((doc["holder"] as Record<string, unknown> | null)?.["labels"], undefined);
  assert.equal(doc["hold_until"], null);
  assert.equal(await d.client.detach("plain", info.leaseId), undefined);
});

test("remote: a mepd with --anonymous-holder sends nothing of its holders", opts, async () => {
  await using sb = Sandbox.create();
  const server = await sb.startServer();
  const token = sb.tokenFile(server, "t");
  const d = await sb.startMepd({ controlPlane: server.url, tokenFile: token, extraArgs: ["--anonymous-holder"] });
  await using _lease = await d.client.lease("Quiet Agent", await newMemory(sb, d.client, "a"), { ttl: 10, labels: LABELS, maxHold: 300 });
  const doc = await serverLease(server, "quietagent", token);
  assert.ok(!doc["holder"] || Object.keys(doc["holder"] as object).length === 0, JSON.stringify(doc["holder"]));
  assert.ok(doc["hold_until"], "the max hold still applies");
  const d2 = await sb.startMepd({ controlPlane: server.url, tokenFile: sb.tokenFile(server, "t") });
  const e = await refusal(d2.client.lease("quiet agent", await newMemory(sb, d2.client, "b")));
  assert.ok(e instanceof mep.NameHeld, String(e));
  assert.deepEqual([e.holder?.displayName, e.holder?.host], ["Quiet Agent", null]);
});

test("remote: an operator's revocation makes the lease lost with reason revoked", opts, async () => {
  await using sb = Sandbox.create();
  const server = await sb.startServer();
  const d = await sb.startMepd({ controlPlane: server.url, tokenFile: sb.tokenFile(server, "t") });
  const admin = sb.tokenFile(server, "t", "admin");
  await using lease = await d.client.lease("Revoked Agent", await newMemory(sb, d.client, "a"), { ttl: 6 });
  const r = spawnSync(MEP_BIN, ["lease", "revoke", "Revoked Agent", "--server", server.url, "--token-file", admin, "--reason", "test"], {
    encoding: "utf8",
    env: sb.env,
    timeout: 20000,
  });
  assert.equal(r.status, 0, `mep lease revoke exited ${r.status}: ${r.stdout}${r.stderr}`);
  // Learnt at the daemon's next renewal (every ttl/3): the reason says so.
  await waitFor(() => lease.signal.aborted, 10000, "the lease to be lost");
  assert.equal(lease.lostReason, "revoked");
  assert.throws(() => lease.check(), (e: unknown) => e instanceof mep.LeaseLost && e.reason === "revoked");
  await lease.release();
  assert.deepEqual(await d.client.leases(), []);
});
