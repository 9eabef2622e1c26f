// The SDK held to mepd's socket API as recorded: tests/contract/daemon_api.json holds one
// request per route with the answer mepd's real request handler gave it (recorded by the C++
// suite, tests/unit/daemon/daemon_api_contract_test.cpp, which fails when the handler answers
// otherwise) and the event lines its keeper writes. Here a socket replays those answers to
// the public Client: each call must reach a route mepd serves, and what it returns must carry
// every member of the answer with its value (camelCase), and nothing the answer lacks.
import { test } from "node:test";
import assert from "node:assert/strict";
import { createServer, type IncomingMessage, type ServerResponse } from "node:http";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { join } from "node:path";
import { tmpdir } from "node:os";
import * as mep from "@mep/client";

interface Exchange {
  name: string;
  route: string;
  target: string;
  request: Record<string, unknown> | null;
  status: number;
  response: Record<string, unknown> | null;
}

// Members the daemon sends that a type does not carry, and where the SDK reads them instead.
const READ_ELSEWHERE = new Set(["granted_after_ms"]); // Client.lease: the local deadline after a wait, from .raw

const camel = (k: string) => k.replace(/_([a-z])/g, (_, c: string) => c.toUpperCase());
const snake = (k: string) => k.replace(/[A-Z]/g, (c) => "_" + c.toLowerCase());

// An SDK value as the JSON value it came from: bigint tokens as numbers, Dates as RFC 3339.
function plain(v: unknown): unknown {
  if (typeof v === "bigint") return Number(v);
  if (v instanceof Date) return v.toISOString();
  if (Array.isArray(v)) return v.map(plain);
  if (v !== null && typeof v === "object") return Object.fromEntries(Object.entries(v).filter(([k]) => k !== "raw").map(([k, x]) => [snake(k), plain(x)]));
  return v;
}

function assertCarries(what: string, got: unknown, answer: Record<string, unknown>) {
  const g = got as Record<string, unknown>;
  for (const [key, value] of Object.entries(answer)) {
    if (READ_ELSEWHERE.has(key)) continue;
    assert.ok(camel(key) in g, `${what}: mepd sends ${key}, which the SDK's type does not carry`);
    assert.deepEqual(plain(g[camel(key)]), value, `${what}.${camel(key)}`);
  }
  for (const [key, value] of Object.entries(g)) {
    if (key === "raw" || snake(key) in answer) continue;
    assert.ok(value === undefined || value === null, `${what}.${key} is ${String(value)} but mepd does not send ${snake(key)}`);
  }
}

test("the SDK decodes mepd's recorded answers, on the routes mepd serves", async (t) => {
  const root = process.env.MEP_SOURCE_DIR;
  if (!root) {
    t.skip("MEP_SOURCE_DIR is not set (ctest sets it to the checkout holding tests/contract)");
    return;
  }
  const file = join(root, "tests", "contract", "daemon_api.json");
  assert.ok(existsSync(file), `${file} is missing`);
  const contract = JSON.parse(readFileSync(file, "utf8")) as { exchanges: Exchange[]; events: Record<string, unknown>[] };
  const byRoute = new Map(contract.exchanges.map((e) => [e.route, e]));
  const called = new Set<string>();

  const dir = mkdtempSync(join(tmpdir(), "mep-contract-"));
  const socketPath = join(dir, "mepd.sock");
  const server = createServer((req: IncomingMessage, res: ServerResponse) => {
    const path = (req.url ?? "").split("?")[0] ?? "";
    if (req.method === "GET" && path === "/v1/events") {
      called.add("GET /v1/events");
      res.writeHead(200, { "Content-Type": "application/x-ndjson" });
      res.end(contract.events.map((e) => JSON.stringify(e) + "\n").join(""));
      return;
    }
    const route = `${req.method} ${path.startsWith("/v1/leases/") ? "/v1/leases/{name}" : path}`;
    called.add(route);
    const ex = byRoute.get(route);
    req.resume();
    req.on("end", () => {
      if (!ex) {
        res.writeHead(404, { "Content-Type": "application/problem+json" });
        res.end(JSON.stringify({ code: "not-found", status: 404, title: "Not Found", detail: `no route ${route}` }));
        return;
      }
      if (ex.response === null) {
        res.writeHead(ex.status);
        res.end();
        return;
      }
      res.writeHead(ex.status, { "Content-Type": "application/json" });
      res.end(JSON.stringify(ex.response));
    });
  });
  await new Promise<void>((resolve) => server.listen(socketPath, resolve));
  try {
    const c = new mep.Client({ socketPath, timeoutMs: 5000 });
    const answer = (name: string) => byRoute.get(contract.exchanges.find((e) => e.name === name)!.route)!.response!;
    assertCarries("attach", await c.attach("contractagent", "/srv/agents/agent.uai", { ttl: 30 }), answer("attach"));
    assert.equal(await c.detach("contractagent"), undefined);
    const leases = await c.leases();
    const listed = answer("leases").leases as Record<string, unknown>[];
    assert.equal(leases.length, listed.length);
    leases.forEach((l, i) => assertCarries(`leases[${i}]`, l, listed[i]!));
    assertCarries("getLease", await c.getLease("contractagent"), answer("lease"));
    assertCarries("branch", await c.branch("/srv/agents/agent.uai", "/srv/agents/child.uai"), answer("branch"));
    assertCarries("init", await c.init("/srv/agents/new.uai"), answer("init"));
    assertCarries("lineage", await c.lineage({ path: "/srv/agents/agent.uai" }), answer("lineage"));
    assertCarries("identify", await c.identify("/srv/agents/agent.uai"), answer("identify"));
    assertCarries("verify", await c.verify("contractagent"), answer("verify"));
    assertCarries("sync", await c.sync("contractagent"), answer("sync"));
    const fetched = answer("fetch");
    assertCarries("fetch", await c.fetch(String(fetched.memory_instance_id), "/srv/agents/fetched.uai"), fetched);

    const events: unknown[] = [];
    for await (const e of c.events()) events.push(e);
    assert.equal(events.length, contract.events.length);
    events.forEach((e, i) => assertCarries(`event ${String(contract.events[i]!.event)}`, e, contract.events[i]!));

    // Every recorded route was called, and nothing else but the event stream.
    assert.deepEqual([...called].sort(), [...byRoute.keys(), "GET /v1/events"].sort());
  } finally {
    await new Promise<void>((resolve) => server.close(() => resolve()));
    rmSync(dir, { recursive: true, force: true });
  }
});
