// The data plane (`mep store`): sync under the fence, fetch to a second daemon, and a write
// with a stale token refused. Skipped (with the reason printed) until this mep has a store.
import { test } from "node:test";
import assert from "node:assert/strict";
import { request } from "node:http";
import { readFileSync, writeFileSync } from "node:fs";
import * as mep from "@mep/client";
import { Sandbox, binSkip, newMemory, storeSkip } from "./harness.js";

const opts = { skip: storeSkip ?? false, timeout: 90000 };

/** A raw PUT of `body` to the store, with `headers`; resolves with status and parsed body. */
function put(url: string, headers: Record<string, string>, body: string): Promise<{ status: number; json: unknown }> {
  const u = new URL(url);
  const host = u.hostname;
  const port = Number(u.port || "80");
  return new Promise((resolve, reject) => {
    const req = request(
      { host, port, method: "PUT", path: u.pathname, headers: { ...headers, "Content-Type": "application/octet-stream", "Content-Length": Buffer.byteLength(body) }, agent: false },
      (res) => {
        const chunks: Uint8Array[] = [];
        res.on("data", (c: Uint8Array) => chunks.push(c));
        res.on("end", () => {
          const text = Buffer.concat(chunks).toString("utf8");
          let json: unknown;
          try {
            json = text ? JSON.parse(text) : undefined;
          } catch {
            json = text;
          }
          resolve({ status: res.statusCode ?? 0, json });
        });
      },
    );
    req.setTimeout(20000, () => req.destroy(new Error("the store did not answer")));
    req.on("error", reject);
    req.end(body);
  });
}

test("sync, fetch to a second daemon, and a stale-token write refused (409)", opts, async () => {
  await using sb = Sandbox.create();
  const server = await sb.startServer();
  const store = await sb.startStore();
  const dA = await sb.startMepd({ tag: "hostA", controlPlane: server.url, tokenFile: sb.tokenFile(server, "t"), store });
  const dB = await sb.startMepd({ tag: "hostB", controlPlane: server.url, tokenFile: sb.tokenFile(server, "t"), store });
  const a = await newMemory(sb, dA.client, "a");
  const bytes = "memory of agent mover, version 1\n";
  writeFileSync(a, bytes);

  const leaseA = await dA.client.lease("mover", a);
  const staleHeaders = leaseA.fencingHeaders(); // kept past the release on purpose
  const s = await leaseA.sync();
  assert.equal(s.fencingToken, leaseA.token);
  assert.equal(s.memoryInstanceId, leaseA.memoryInstanceId);
  assert.equal(s.size, Buffer.byteLength(bytes));
  assert.ok(s.etag);
  const id = leaseA.memoryInstanceId;
  await leaseA.release();
  await assert.rejects(leaseA.sync(), mep.LeaseLost); // refused locally after the release

  // The memory moves to host B.
  const moved = sb.path("moved.uai");
  const f = await dB.client.fetch(id, moved);
  assert.equal(f.memoryInstanceId, id);
  assert.equal(readFileSync(moved, "utf8"), bytes);
  assert.equal((await dB.client.identify(moved)).memoryInstanceId, id);
  await assert.rejects(dB.client.fetch(id, moved), mep.InvalidRequest); // the file must be new

  const leaseB = await dB.client.lease("mover", moved);
  assert.equal(leaseB.memoryInstanceId, id);
  assert.ok(leaseB.token > leaseA.token);

  // A zombie writing with the old token is refused by the store; the new holder is not.
  const auth = { Authorization: `Bearer ${store.token}` };
  const stale = await put(`${store.url}/v1/objects/${id}`, { ...auth, ...staleHeaders }, "zombie write");
  assert.equal(stale.status, 409, JSON.stringify(stale.json));
  assert.equal((stale.json as { code?: string }).code, "stale-fence");
  const fresh = await put(`${store.url}/v1/objects/${id}`, { ...auth, ...leaseB.fencingHeaders() }, "new holder's write");
  assert.ok(fresh.status >= 200 && fresh.status < 300, `${fresh.status} ${JSON.stringify(fresh.json)}`);
  writeFileSync(moved, "version 2\n");
  const s2 = await leaseB.sync();
  assert.equal(s2.fencingToken, leaseB.token);
  await leaseB.release();

  // A memory with no stored object.
  const lonely = await newMemory(sb, dA.client, "lonely");
  const lonelyId = (await dA.client.identify(lonely)).memoryInstanceId;
  await assert.rejects(dB.client.fetch(lonelyId, sb.path("nothing.uai")), mep.MemoryNotFound);
});

test("sync and fetch are not cut by the client's request timeout (the store paused for 3 s)", opts, async (t) => {
  // mepd answers a sync or a fetch only once the transfer is done, so the socket stays silent
  // as long as a large file takes: the client's timeoutMs (1 s here) must not cut it.
  await using sb = Sandbox.create();
  const server = await sb.startServer();
  const store = await sb.startStore();
  const d = await sb.startMepd({ controlPlane: server.url, tokenFile: sb.tokenFile(server, "t"), store });
  const a = await newMemory(sb, d.client, "a");
  writeFileSync(a, "a large memory ".repeat(10000));
  const lease = await d.client.lease("slow store", a, { ttl: 30 });
  const quick = new mep.Client({ socketPath: d.socket, timeoutMs: 1000 });
  const paused = async <T>(fn: () => Promise<T>): Promise<{ result: T; took: number }> => {
    store.proc.signal("SIGSTOP");
    const timer = setTimeout(() => store.proc.signal("SIGCONT"), 3000);
    const t0 = performance.now();
    try {
      return { result: await fn(), took: performance.now() - t0 };
    } finally {
      clearTimeout(timer);
      store.proc.signal("SIGCONT");
    }
  };
  try {
    const probe = await d.client.sync("nobody").catch((e: unknown) => e);
    if (probe instanceof mep.NotFound) {
      t.skip("this mepd has no POST /v1/sync yet (404 not-found)");
      return;
    }
    // Through the quick client, the same lease (the daemon's lease on the name).
    const s = await paused(() => quick.sync(lease.canonicalName));
    assert.ok(s.took > 2500, `took ${s.took} ms`);
    assert.equal(s.result.fencingToken, lease.token);
    // Lease.sync() through a client with the same 1 s timeout.
    const mine = await quick.lease("slow store 2", await newMemory(sb, d.client, "b"), { ttl: 30 });
    const s2 = await paused(() => mine.sync());
    assert.ok(s2.took > 2500, `took ${s2.took} ms`);
    assert.equal(s2.result.fencingToken, mine.token);
    // An explicit timeout still bounds it.
    await assert.rejects(paused(() => mine.sync({ timeoutMs: 500 })), mep.Unavailable);
    await mine.release();
    const f = await paused(() => quick.fetch(lease.memoryInstanceId, sb.path("copy.uai")));
    assert.ok(f.took > 2500, `took ${f.took} ms`);
    assert.equal(f.result.size, Buffer.byteLength("a large memory ".repeat(10000)));
  } finally {
    await lease.release();
  }
});

test("sync on a daemon without --store: StoreNotConfigured (501)", { skip: binSkip ?? false, timeout: 30000 }, async (t) => {
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const probe = await d.client.sync("nobody").catch((e: unknown) => e);
  if (probe instanceof mep.NotFound) {
    t.skip("this mepd has no POST /v1/sync yet (404 not-found)");
    return;
  }
  const a = await newMemory(sb, d.client, "a");
  await using lease = await d.client.lease("unsynced", a);
  const e = await lease.sync().catch((x: unknown) => x);
  assert.ok(e instanceof mep.StoreNotConfigured, String(e));
  assert.equal(e.status, 501);
  assert.equal(lease.state, "held", "a daemon without a store does not make the lease lost");
  await assert.rejects(d.client.fetch(lease.memoryInstanceId, sb.path("f.uai")), mep.StoreNotConfigured);
});
