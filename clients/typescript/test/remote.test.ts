// Against a real `mep server` and a mepd that uses it as its control plane: acquire and
// release, and loss when the control plane stops answering (SIGSTOP).
import { test } from "node:test";
import assert from "node:assert/strict";
import * as mep from "@mep/client";
import { Sandbox, binSkip, newMemory, waitFor } from "./harness.js";

const opts = { skip: binSkip ?? false, timeout: 60000 };

test("acquire and release through a remote mep server", opts, async () => {
  await using sb = Sandbox.create();
  const server = await sb.startServer();
  const d = await sb.startMepd({ controlPlane: server.url, tokenFile: sb.tokenFile(server, "t") });
  assert.equal((await d.client.health()).controlPlane, server.url);
  const a = await newMemory(sb, d.client, "a");
  {
    await using lease = await d.client.lease("Remote Agent", a, { ttl: 10 });
    assert.equal(lease.canonicalName, "remoteagent");
    assert.equal(lease.bindPid, process.pid);
    assert.deepEqual(
      (await d.client.leases()).map((l) => [l.canonicalName, l.state]),
      [["remoteagent", "held"]],
    );
    // A second daemon of the same tenant (another host, in effect) cannot take the name.
    const d2 = await sb.startMepd({ controlPlane: server.url, tokenFile: sb.tokenFile(server, "t") });
    const b = await newMemory(sb, d2.client, "b");
    const e = await d2.client.lease("remote agent", b).catch((x: unknown) => x);
    assert.ok(e instanceof mep.NameHeld, String(e));
  }
  assert.deepEqual(await d.client.leases(), []);
});

test("loss when the control plane stops: atRisk first, then lost; signal, callbacks, check() and verify()", opts, async () => {
  await using sb = Sandbox.create();
  const server = await sb.startServer();
  const d = await sb.startMepd({ controlPlane: server.url, tokenFile: sb.tokenFile(server, "t") });
  const a = await newMemory(sb, d.client, "a");
  const lease = await d.client.lease("fragile", a, { ttl: 5 });
  const order: string[] = [];
  let lostError: mep.LeaseLost | undefined;
  let abortReason: unknown;
  lease.on("atRisk", (i) => order.push("atRisk:" + i.reason));
  lease.on("lost", (e) => {
    order.push("lost:" + e.reason);
    lostError = e;
  });
  lease.signal.addEventListener("abort", () => {
    order.push("abort");
    abortReason = lease.signal.reason;
  });
  try {
    // Let one renewal through first.
    await new Promise<void>((r) => lease.once("renewed", () => r()));
    server.proc.signal("SIGSTOP");
    const stoppedAt = performance.now();
    await waitFor(() => lostError, 15000, "the lease to be lost");
    const took = performance.now() - stoppedAt;
    assert.ok(took < 6000, `lost ${took.toFixed(0)} ms after the control plane stopped (ttl 5)`);
    assert.ok(order[0]?.startsWith("atRisk:"), `atRisk first: ${order.join(", ")}`);
    const lostAt = order.findIndex((s) => s.startsWith("lost:"));
    assert.ok(lostAt > 0, `lost after atRisk: ${order.join(", ")}`);
    assert.ok(order.includes("abort"));
    assert.ok(abortReason instanceof mep.LeaseLost);
    assert.equal(abortReason, lostError);
    assert.equal(lease.state, "lost");
    assert.equal(lease.isLost, true);
    assert.equal(lease.atRisk, false);
    assert.ok(lease.lostReason, "has a lost reason");
    assert.equal(lease.lostReason, lostError!.reason);
    assert.equal(lostError!.fencingToken, lease.token);
    assert.throws(() => lease.check(), mep.LeaseLost);
    assert.throws(() => lease.fencingHeaders(), mep.LeaseLost);
    await assert.rejects(lease.verify(), mep.LeaseLost);
    await assert.rejects(lease.sync(), mep.LeaseLost);
    // The daemon reaches the same conclusion by its own deadline.
    await waitFor(async () => (await d.client.getLease("fragile")).state === "lost", 5000, "the daemon to mark it lost");
  } finally {
    server.proc.signal("SIGCONT");
  }
  // Releasing a lost lease is harmless and cleans the daemon's record of it.
  await lease.release();
  await lease.release();
  await waitFor(async () => (await d.client.leases()).length === 0, 3000, "the lost record to be cleaned up");
  // The name can be claimed again once the control plane answers (and its lease there has
  // expired), with a higher token.
  const again = await waitFor(
    () =>
      d.client.lease("fragile", a, { ttl: 5 }).catch((e: unknown) => {
        if (e instanceof mep.NameHeld || e instanceof mep.MemoryAttached) return undefined;
        throw e;
      }),
    10000,
    "the name to be free again",
  );
  assert.ok(again!.token > lease.token);
  await again!.release();
});

test("a release the control plane did not confirm: released here, its problem returned, kept and given to 'released'", opts, async () => {
  await using sb = Sandbox.create();
  const server = await sb.startServer();
  const d = await sb.startMepd({ controlPlane: server.url, tokenFile: sb.tokenFile(server, "t") });
  const confirmed = await d.client.lease("confirmed", await newMemory(sb, d.client, "a"), { ttl: 10 });
  assert.equal(await confirmed.release(), undefined);
  assert.equal(confirmed.releaseProblem, undefined);
  const lease = await d.client.lease("unconfirmed", await newMemory(sb, d.client, "b"), { ttl: 10 });
  await d.client.attach("bare", await newMemory(sb, d.client, "c"), { ttl: 10 });
  const heard: (mep.MepError | undefined)[] = [];
  lease.on("released", (p) => heard.push(p));
  await server.proc.stop();
  const problem = await lease.release();
  assert.ok(problem instanceof mep.Unavailable, String(problem));
  assert.equal(lease.releaseProblem, problem);
  assert.equal(lease.state, "released");
  assert.deepEqual(heard, [problem]);
  assert.equal(await lease.release(), problem, "a second call answers the same");
  // The bare client call says the same; the daemon keeps nothing either way.
  assert.ok((await d.client.detach("bare")) instanceof mep.Unavailable);
  assert.deepEqual(await d.client.leases(), []);
});
