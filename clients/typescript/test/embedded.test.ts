// Against a real embedded-mode mepd (no server): acquire, release, conflicts, errors,
// await using, withLease, AsyncLocalStorage, SIGKILL of the holder, daemon restart.
import { test } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import { existsSync } from "node:fs";
import * as mep from "@mep/client";
import { Sandbox, binSkip, newMemory, sleep, waitFor } from "./harness.js";

const opts = { skip: binSkip ?? false, timeout: 60000 };

test("acquire and release (embedded)", opts, async () => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const file = await newMemory(sb, d.client, "a");
  const lease = await d.client.lease("My Agent", file, { ttl: 30 });
  assert.equal(lease.canonicalName, "myagent");
  assert.equal(lease.displayName, "My Agent");
  assert.equal(typeof lease.token, "bigint");
  assert.ok(lease.token >= 1n);
  assert.deepEqual(lease.fencingHeaders(), { "Fencing-Token": lease.token.toString() });
  assert.equal(lease.path, file);
  assert.equal(lease.bindPid, process.pid, "bound to this process by default");
  assert.equal(lease.state, "held");
  assert.equal(lease.atRisk, false);
  assert.equal(lease.signal.aborted, false);
  assert.ok(lease.expiresAt.getTime() > Date.now());
  lease.check();
  const id = await d.client.identify(file);
  assert.equal(lease.memoryInstanceId, id.memoryInstanceId);
  const listed = await d.client.leases();
  assert.deepEqual(
    listed.map((l) => [l.canonicalName, l.state, l.fencingToken]),
    [["myagent", "held", lease.token]],
  );
  let released = 0;
  lease.on("released", () => released++);
  await lease.release();
  await lease.release(); // twice is harmless
  assert.equal(released, 1);
  assert.equal(lease.state, "released");
  assert.equal(lease.signal.aborted, true);
  assert.ok(lease.signal.reason instanceof mep.LeaseLost);
  assert.equal(lease.signal.reason.reason, "released-by-holder");
  assert.equal(lease.lostReason, undefined, "a release is not a loss");
  assert.throws(() => lease.check(), mep.LeaseLost);
  assert.throws(() => lease.fencingHeaders(), mep.LeaseLost);
  assert.deepEqual(await d.client.leases(), []);
  // The memory can be claimed again, with a higher token.
  const again = await d.client.lease("My Agent", file);
  assert.ok(again.token > lease.token);
  await again.release();
});

test("detach by lease id never takes a lease granted under the name after it", opts, async () => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const file = await newMemory(sb, d.client, "s");
  const first = await d.client.attach("successor test", file, { ttl: 30 });
  await d.client.detach("successor test", first.leaseId);
  const second = await d.client.attach("successor test", file, { ttl: 30 });
  assert.notEqual(first.leaseId, second.leaseId);
  await assert.rejects(d.client.detach("successor test", first.leaseId), mep.LeaseNotFound);
  assert.deepEqual((await d.client.leases()).map((l) => l.leaseId), [second.leaseId]);
  await d.client.detach("successor test", second.leaseId);
  assert.deepEqual(await d.client.leases(), []);
});

test("the module-level API finds the socket like the CLI ($MEP_SOCKET)", opts, async () => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const saved = process.env["MEP_SOCKET"];
  process.env["MEP_SOCKET"] = d.socket;
  try {
    const file = sb.path("m.uai");
    const ident = await mep.init(file);
    assert.match(ident.memoryInstanceId, /^[0-9a-f-]{36}$/);
    await assert.rejects(mep.init(file), mep.InvalidRequest); // exists already
    const st = await mep.status();
    assert.match(st.controlPlane, /^embedded/);
    assert.equal(st.leases, 0);
    const evs = mep.events();
    await evs.ready;
    {
      await using lease = await mep.lease("module-api", file);
      assert.equal((await mep.status()).leaseList[0]?.canonicalName, "module-api");
      const b = await mep.branch(file, sb.path("m2.uai"));
      assert.equal(b.parentMemoryInstanceId, ident.memoryInstanceId);
      assert.equal(b.branchedAtToken, lease.token);
      const ib = await mep.identify(b.path);
      assert.equal(ib.parentMemoryInstanceId, ident.memoryInstanceId);
      const lin = await mep.lineage(b.path);
      assert.deepEqual(
        lin.ancestors.map((a) => a.memoryInstanceId),
        [ident.memoryInstanceId],
      );
      const byId = await mep.lineage(ident.memoryInstanceId);
      assert.deepEqual(
        byId.children.map((c) => c.memoryInstanceId),
        [b.memoryInstanceId],
      );
    }
    const seen: string[] = [];
    for await (const ev of evs) {
      if (ev.canonicalName !== "module-api") continue;
      seen.push(ev.event);
      if (ev.event === "released") break;
    }
    assert.deepEqual(seen, ["granted", "released"]);
    await assert.rejects(mep.lineage("01a2333b-0000-7000-8000-000000000000"), mep.MemoryNotFound);
  } finally {
    if (saved === undefined) delete process.env["MEP_SOCKET"];
    else process.env["MEP_SOCKET"] = saved;
  }
});

test("conflicts: NameHeld, NameConfusable, MemoryAttached (423 with Retry-After)", opts, async () => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const a = await newMemory(sb, d.client, "a");
  const b = await newMemory(sb, d.client, "b");
  await using held = await d.client.lease("paypal", a, { ttl: 20 });

  const e1 = await d.client.lease("PayPal", b).catch((e: unknown) => e);
  assert.ok(e1 instanceof mep.NameHeld, String(e1));
  assert.equal(e1.code, "name-held");
  assert.equal(e1.status, 423);
  assert.equal(typeof e1.retryAfter, "number");
  assert.ok(e1.instance);

  // "paypa1" has the skeleton of "paypal": confusable with the held name.
  const e2 = await d.client.lease("paypa1", b).catch((e: unknown) => e);
  assert.ok(e2 instanceof mep.NameConfusable, String(e2));
  assert.equal(e2.status, 423);

  const e3 = await d.client.lease("someone-else", a).catch((e: unknown) => e);
  assert.ok(e3 instanceof mep.MemoryAttached, String(e3));
  assert.equal(e3.status, 423);
  assert.equal(typeof e3.retryAfter, "number");
  assert.ok(e3 instanceof mep.MepError);

  // Nothing of the refused attaches is left behind.
  assert.deepEqual(
    (await d.client.leases()).map((l) => l.canonicalName),
    ["paypal"],
  );
  held.check();
});

test("invalid names carry their reason; invalid TTL; missing file", opts, async () => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const a = await newMemory(sb, d.client, "a");
  await using _held = await d.client.lease("paypal", a);
  const b = await newMemory(sb, d.client, "b");

  // "pаypal" with a Cyrillic а (U+0430): the daemon refuses it as mixed-script (422), before
  // any confusable check against the held "paypal".
  const e1 = await d.client.lease("p\u0430ypal", b).catch((e: unknown) => e);
  assert.ok(e1 instanceof mep.InvalidName, String(e1));
  assert.equal(e1.status, 422);
  assert.equal(e1.reason, "mixed-script");

  const e2 = await d.client.lease("bad\u0007name", b).catch((e: unknown) => e);
  assert.ok(e2 instanceof mep.InvalidName, String(e2));
  assert.equal(e2.reason, "disallowed-character");
  assert.equal(e2.codepoint, "U+0007");
  assert.equal(e2.index, 3);
  assert.equal(e2.extensions["reason"], "disallowed-character");

  const e3 = await d.client.lease("ttl-agent", b, { ttl: 3 }).catch((e: unknown) => e);
  assert.ok(e3 instanceof mep.InvalidTtl, String(e3));
  assert.equal(e3.status, 422);

  const e4 = await d.client.lease("nofile", sb.path("missing.uai")).catch((e: unknown) => e);
  assert.ok(e4 instanceof mep.InvalidRequest, String(e4));

  const e5 = await d.client.detach("nobody").catch((e: unknown) => e);
  assert.ok(e5 instanceof mep.LeaseNotFound, String(e5));
});

test("DaemonNotRunning when there is no socket", opts, async () => {
  await using sb = Sandbox.create();
  const c = new mep.Client({ socketPath: sb.path("nothing.sock") });
  const e = await c.lease("x", sb.path("x.uai")).catch((x: unknown) => x);
  assert.ok(e instanceof mep.DaemonNotRunning, String(e));
  assert.ok(e instanceof mep.Unavailable);
  assert.equal(e.code, "unavailable");
  assert.match(e.message, /cannot reach mepd/);
  const it = c.events();
  await assert.rejects(it.next(), mep.DaemonNotRunning);
});

test("await using releases at the end of the scope", opts, async () => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const a = await newMemory(sb, d.client, "a");
  let kept: mep.Lease | undefined;
  {
    await using lease = await d.client.lease("scoped", a);
    kept = lease;
    assert.equal((await d.client.leases()).length, 1);
  }
  assert.equal(kept.state, "released");
  assert.deepEqual(await d.client.leases(), []);
  // also when the scope throws
  await assert.rejects(async () => {
    await using lease = await d.client.lease("scoped", a);
    kept = lease;
    throw new Error("boom");
  }, /boom/);
  assert.equal(kept.state, "released");
  assert.deepEqual(await d.client.leases(), []);
});

test("withLease releases when the callback throws, and never masks its error", opts, async () => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const a = await newMemory(sb, d.client, "a");
  let inside: mep.Lease | undefined;
  class Oops extends Error {}
  await assert.rejects(
    d.client.withLease("thrower", a, async (lease) => {
      inside = lease;
      assert.equal((await d.client.leases()).length, 1);
      throw new Oops("the callback's own error");
    }),
    (e: unknown) => e instanceof Oops && e.message === "the callback's own error",
  );
  assert.equal(inside?.state, "released");
  assert.deepEqual(await d.client.leases(), []);

  // A release that fails after the callback threw still surfaces the callback's error: stop
  // the daemon inside the callback so the release cannot reach it.
  await assert.rejects(
    d.client.withLease("thrower", a, async () => {
      await d.proc.stop();
      throw new Oops("still mine");
    }),
    (e: unknown) => e instanceof Oops && e.message === "still mine",
  );

  // The result comes back when it succeeds. (The restarted daemon re-adopted the lease
  // that could not be released while it was down: release it first.)
  await d.restart();
  await d.client.detach("thrower");
  const r = await d.client.withLease("thrower", a, async (lease) => lease.canonicalName + "!");
  assert.equal(r, "thrower!");
});

test("a release that fails while mepd is down rejects, and release() again releases once it is back", opts, async () => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const a = await newMemory(sb, d.client, "a");
  const lease = await d.client.lease("stuck", a, { ttl: 10 });
  let released = 0;
  lease.on("released", () => released++);
  await d.proc.stop(); // SIGTERM: the daemon keeps the lease and re-adopts it when restarted
  await assert.rejects(lease.release(), mep.DaemonNotRunning);
  assert.equal(released, 0);
  assert.equal(lease.state, "released"); // given up: the token must not be used any more
  assert.throws(() => lease.check(), mep.LeaseLost);
  assert.throws(() => lease.fencingHeaders(), mep.LeaseLost);
  await assert.rejects(lease.release(), mep.DaemonNotRunning); // still down: tried again, fails again
  await d.restart();
  assert.deepEqual(
    (await d.client.leases()).map((l) => [l.leaseId, l.state]),
    [[lease.leaseId, "held"]],
    "the restarted daemon re-adopted the lease",
  );
  await lease.release();
  assert.equal(released, 1);
  assert.deepEqual(await d.client.leases(), []);
  const again = await d.client.lease("stuck", a); // another agent gets the name at once
  assert.ok(again.token > lease.token);
  await again.release();
  await lease.release(); // idempotent once released
  assert.equal(released, 1);

  // The same when `await using` releases at the end of the scope: the error comes out of the
  // scope, and a reference kept to the lease releases it later.
  let kept: mep.Lease | undefined;
  await assert.rejects(async () => {
    await using scoped = await d.client.lease("stuck", a, { ttl: 10 });
    kept = scoped;
    await d.proc.stop();
  }, mep.DaemonNotRunning);
  await d.restart();
  await kept!.release();
  assert.deepEqual(await d.client.leases(), []);
});

test("the current lease through AsyncLocalStorage", opts, async () => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const a = await newMemory(sb, d.client, "a");
  const b = await newMemory(sb, d.client, "b");
  assert.equal(mep.currentLease(), undefined);
  const deep = async () => {
    await sleep(5);
    return mep.currentLease();
  };
  await d.client.withLease("outer", a, async (outer) => {
    assert.equal(mep.currentLease(), outer);
    assert.equal(await deep(), outer);
    await d.client.withLease("inner", b, async (inner) => {
      assert.equal(await deep(), inner);
      const viaTimer = await new Promise((r) => setTimeout(() => r(mep.currentLease()), 1));
      assert.equal(viaTimer, inner);
    });
    assert.equal(mep.currentLease(), outer);
  });
  assert.equal(mep.currentLease(), undefined);
});

test("a SIGKILLed agent's lease is released by the daemon at once, not at its expiry", opts, async () => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const a = await newMemory(sb, d.client, "a");
  const holder = fileURLToPath(new URL("./fixtures/holder.js", import.meta.url));
  assert.ok(existsSync(holder), holder);
  const env = { ...sb.env, MEP_SOCKET: d.socket };
  const child = spawn(process.execPath, [holder, "killed-agent", a], { env, stdio: ["ignore", "pipe", "inherit"] });
  try {
    const line = await new Promise<string>((resolve, reject) => {
      let buf = "";
      const t = setTimeout(() => reject(new Error("the child did not report its lease within 15 s")), 15000);
      child.stdout!.setEncoding("utf8");
      child.stdout!.on("data", (c: string) => {
        buf += c;
        if (buf.includes("\n")) {
          clearTimeout(t);
          resolve(buf.split("\n")[0]!);
        }
      });
      child.once("exit", (code: number | null) => reject(new Error(`the child exited with ${code}`)));
    });
    const info = JSON.parse(line) as { pid: number; canonicalName: string };
    const before = await d.client.getLease(info.canonicalName);
    assert.equal(before.bindPid, info.pid);
    assert.equal(before.state, "held");
    const killedAt = performance.now();
    child.kill("SIGKILL");
    // Released when the pid goes, long before its TTL runs out; the bound is far from both
    // (no assertion on this machine's speed).
    await waitFor(async () => (await d.client.leases()).length === 0, 10000, "the daemon to release the killed agent's lease");
    const took = performance.now() - killedAt;
    assert.ok(took < 10000, `released after ${took.toFixed(0)} ms`);
  } finally {
    if (child.exitCode === null && child.signalCode === null) child.kill("SIGKILL");
  }
});

test("a daemon restart: at risk while disconnected, then renewed again after the reconnect", opts, async () => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const a = await newMemory(sb, d.client, "a");
  await using lease = await d.client.lease("restarted", a, { ttl: 15 });
  const seen: string[] = [];
  lease.on("atRisk", (i) => seen.push("atRisk:" + i.reason));
  lease.on("renewed", (i) => seen.push("renewed:" + i.recovered));
  lease.on("lost", (e) => seen.push("lost:" + e.reason));
  await d.proc.stop();
  await waitFor(() => lease.atRisk, 3000, "atRisk after the daemon stopped");
  await d.restart();
  // The restarted daemon re-adopts the lease; the next renewal (≤ ttl/3) is heard on the new stream.
  await waitFor(() => seen.includes("renewed:true"), 12000, "a renewal after the restart");
  assert.equal(lease.state, "held");
  assert.equal(lease.atRisk, false);
  assert.deepEqual(seen.filter((s) => s.startsWith("lost")), []);
  assert.equal(seen[0], "atRisk:daemon-disconnected");
  assert.equal((await d.client.getLease("restarted")).state, "held");
});

test("wait: a waiting attach gets the name when the holder releases", opts, async () => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const a = await newMemory(sb, d.client, "a");
  const b = await newMemory(sb, d.client, "b");
  const first = await d.client.lease("queued", a);
  setTimeout(() => void first.release(), 1000);
  const started = performance.now();
  await using second = await d.client.lease("queued", a, { wait: 10 });
  assert.ok(performance.now() - started >= 800);
  assert.ok(second.token > first.token);
  // A wait that runs out is the usual 423.
  const e = await d.client.lease("queued", b, { wait: 1 }).catch((x: unknown) => x);
  assert.ok(e instanceof mep.NameHeld, String(e));
});

test("verify() on a held lease (when the daemon has POST /v1/verify)", opts, async (t) => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const a = await newMemory(sb, d.client, "a");
  const probe = await d.client.verify("nobody").catch((e: unknown) => e);
  if (probe instanceof mep.NotFound) {
    t.skip("this mepd has no POST /v1/verify yet (404 not-found)");
    return;
  }
  assert.ok(probe instanceof mep.LeaseNotFound, String(probe));
  await using lease = await d.client.lease("verified", a);
  const v = await lease.verify();
  assert.equal(v.fencingToken, lease.token);
  assert.equal(v.canonicalName, "verified");
  assert.equal(lease.state, "held");
});
