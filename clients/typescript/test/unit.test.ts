// Pure functions: problem → typed error, 64-bit-safe JSON, socket path resolution. These
// need no processes.
import { test } from "node:test";
import assert from "node:assert/strict";
import { existsSync, mkdtempSync, mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { tmpdir } from "node:os";
import * as mep from "@mep/client";

test("every problem code maps to its own class, with its status", () => {
  const seen = new Set<unknown>();
  for (const [code, status] of Object.entries(mep.PROBLEM_CODES)) {
    const e = mep.problemToError(status, { type: "https://memoryendpoints.com/problems/" + code, title: "T", status, detail: "D", instance: "I", code });
    assert.ok(e instanceof mep.MepError);
    assert.equal(e.code, code);
    assert.equal(e.status, status);
    assert.equal(e.title, "T");
    assert.equal(e.detail, "D");
    assert.equal(e.message, "D");
    assert.equal(e.instance, "I");
    const cls = mep.ERROR_CLASSES[code as mep.ProblemCode];
    assert.ok(e instanceof cls);
    assert.notEqual(cls, mep.MepError);
    assert.ok(!seen.has(cls), `one class per code (${code})`);
    seen.add(cls);
  }
  const names: Record<string, unknown> = {
    "name-held": mep.NameHeld,
    "name-confusable": mep.NameConfusable,
    "memory-attached": mep.MemoryAttached,
    "invalid-name": mep.InvalidName,
    "invalid-ttl": mep.InvalidTtl,
    unavailable: mep.Unavailable,
    "stale-fence": mep.StaleFence,
    "lease-expired": mep.LeaseExpired,
    "lease-not-found": mep.LeaseNotFound,
    "memory-not-found": mep.MemoryNotFound,
    "store-unavailable": mep.StoreUnavailable,
    "store-not-configured": mep.StoreNotConfigured,
    "insufficient-storage": mep.InsufficientStorage,
    "rate-limited": mep.RateLimited,
    "control-plane-unreachable": mep.ControlPlaneUnreachable,
  };
  for (const [code, cls] of Object.entries(names)) assert.equal(mep.ERROR_CLASSES[code as mep.ProblemCode], cls);
  // It was "unavailable" before it had a code of its own: code catching Unavailable still does.
  assert.ok(mep.problemToError(503, { code: "control-plane-unreachable", status: 503 }) instanceof mep.Unavailable);
});

test("the code table is the CLI's (common/problem.cpp)", (t) => {
  const root = process.env.MEP_SOURCE_DIR;
  if (!root) {
    t.skip("MEP_SOURCE_DIR is not set (ctest sets it to the checkout holding common/problem.cpp)");
    return;
  }
  const table = join(root, "common", "problem.cpp");
  assert.ok(existsSync(table), `${table} is missing`);
  const rows = [...readFileSync(table, "utf8").matchAll(/CodeInfo\{Code::\w+,\s*"([a-z-]+)",\s*(\d+),/g)].map((m) => [m[1], Number(m[2])] as const);
  assert.ok(rows.length >= Object.keys(mep.PROBLEM_CODES).length, `${rows.length} rows read`);
  // The data plane's own answer to a conditional write (If-Match): mepd sends none.
  const expected = Object.fromEntries(rows.filter(([code]) => code !== "precondition-failed"));
  assert.deepEqual({ ...mep.PROBLEM_CODES }, expected);
});

test("extensions, Retry-After, InvalidName and StaleFence fields", () => {
  const e = mep.problemToError(422, { code: "invalid-name", status: 422, detail: "x", reason: "disallowed-character", codepoint: "U+0007", index: 3 });
  assert.ok(e instanceof mep.InvalidName);
  assert.equal(e.reason, "disallowed-character");
  assert.equal(e.codepoint, "U+0007");
  assert.equal(e.index, 3);
  assert.deepEqual({ ...e.extensions }, { reason: "disallowed-character", codepoint: "U+0007", index: 3 });
  assert.equal(e.name, "InvalidName");

  const h = mep.problemToError(423, { code: "name-held", status: 423 }, "7");
  assert.equal(h.retryAfter, 7);
  assert.equal(mep.parseRetryAfter(new Date(Date.now() + 10000).toUTCString())! >= 9, true);
  assert.equal(mep.parseRetryAfter("soon"), undefined);

  const big = 2n ** 63n + 5n;
  const s = mep.problemToError(409, { code: "stale-fence", presented_token: 3, current_token: big });
  assert.ok(s instanceof mep.StaleFence);
  assert.equal(s.presentedToken, 3n);
  assert.equal(s.currentToken, big);
});

test("unknown codes and bodies that are not problems", () => {
  const u = mep.problemToError(418, { code: "teapot", detail: "short and stout" });
  assert.equal(u.constructor, mep.MepError);
  assert.equal(u.code, "teapot");
  const n = mep.problemToError(503, "Service Unavailable");
  assert.ok(n instanceof mep.Unavailable);
  assert.equal(n.detail, "Service Unavailable");
  const x = mep.problemToError(500, undefined);
  assert.ok(x instanceof mep.Internal);
});

test("DaemonNotRunning is an Unavailable; LeaseLost is a MepError", () => {
  const d = new mep.DaemonNotRunning("/x.sock", Object.assign(new Error("nope"), { code: "ENOENT" }));
  assert.ok(d instanceof mep.Unavailable && d instanceof mep.MepError);
  assert.equal(d.code, "unavailable");
  assert.equal(d.socketPath, "/x.sock");
  assert.match(d.message, /ENOENT/);
  const l = new mep.LeaseLost({ canonicalName: "a", fencingToken: 9n, reason: "deadline" });
  assert.ok(l instanceof mep.MepError);
  assert.equal(l.code, "lease-lost");
  assert.equal(l.reason, "deadline");
  assert.equal(l.fencingToken, 9n);
});

test("socket path: option, $MEP_SOCKET, config file ($MEP_CONFIG / XDG), XDG_RUNTIME_DIR, /run", () => {
  const dir = mkdtempSync(join(tmpdir(), "mep-ts-unit-"));
  try {
    assert.deepEqual(mep.resolveSocketPath("/o.sock", { MEP_SOCKET: "/e.sock" }), { path: "/o.sock", source: "option" });
    assert.equal(mep.resolveSocketPath(undefined, { MEP_SOCKET: "/e.sock", XDG_RUNTIME_DIR: "/r" }).path, "/e.sock");
    mkdirSync(join(dir, "cfg", "mep"), { recursive: true });
    writeFileSync(join(dir, "cfg", "mep", "config.toml"), '# mep\nlog_level = "info"\nsocket = "/from/\\u0078dg.sock" # here\n');
    const r = mep.resolveSocketPath(undefined, { XDG_CONFIG_HOME: join(dir, "cfg"), XDG_RUNTIME_DIR: "/r", HOME: dir });
    assert.equal(r.path, "/from/xdg.sock");
    assert.match(r.source, /^file /);
    mkdirSync(join(dir, ".config", "mep"), { recursive: true });
    writeFileSync(join(dir, ".config", "mep", "config.toml"), "socket = '/from/home.sock'\n");
    assert.equal(mep.resolveSocketPath(undefined, { HOME: dir }).path, "/from/home.sock");
    writeFileSync(join(dir, "explicit.toml"), 'socket="/from/explicit.sock"\n');
    assert.equal(mep.resolveSocketPath(undefined, { HOME: dir, MEP_CONFIG: join(dir, "explicit.toml") }).path, "/from/explicit.sock");
    assert.throws(() => mep.resolveSocketPath(undefined, { HOME: dir, MEP_CONFIG: join(dir, "missing.toml") }), mep.ConfigError);
    assert.throws(() => mep.resolveSocketPath(undefined, { HOME: dir, MEP_CONFIG: join(dir, "missing.toml") }), /does not exist/);
    const empty = join(dir, "empty");
    mkdirSync(empty);
    assert.deepEqual(mep.resolveSocketPath(undefined, { HOME: empty, XDG_RUNTIME_DIR: "/run/user/7" }), {
      path: "/run/user/7/mep/mepd.sock",
      source: "env XDG_RUNTIME_DIR",
    });
    assert.deepEqual(mep.resolveSocketPath(undefined, { HOME: empty }), { path: "/run/mep/mepd.sock", source: "default" });
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("JSON keeps 64-bit integers exact", () => {
  const v = mep.parseJson('{"fencing_token":18446744073709551615,"small":7,"f":1.5,"e":1e3,"neg":-9007199254740993,"s":"a\\"b\\u00e9","n":null,"a":[true,false]}') as Record<string, unknown>;
  assert.equal(v["fencing_token"], 18446744073709551615n);
  assert.equal(v["small"], 7);
  assert.equal(v["f"], 1.5);
  assert.equal(v["e"], 1000);
  assert.equal(v["neg"], -9007199254740993n);
  assert.equal(v["s"], 'a"bé');
  assert.equal(v["n"], null);
  assert.deepEqual(v["a"], [true, false]);
  assert.throws(() => mep.parseJson("{"), SyntaxError);
  assert.throws(() => mep.parseJson('{"a":1} x'), SyntaxError);
  const o = mep.parseJson('{"__proto__":{"x":1}}') as Record<string, unknown>;
  assert.equal(({} as Record<string, unknown>)["x"], undefined);
  assert.deepEqual(Object.keys(o), ["__proto__"]);
});

test("wrong arguments are a TypeError or RangeError naming them, before anything is sent", async () => {
  const dir = mkdtempSync(join(tmpdir(), "mep-ts-unit-"));
  try {
    // No daemon at this socket: anything sent would be DaemonNotRunning.
    const c = new mep.Client({ socketPath: join(dir, "no.sock") });
    const file = join(dir, "m.uai");
    const js = c as unknown as Record<string, (...a: unknown[]) => Promise<unknown>>;
    const rejects = async (p: Promise<unknown>, cls: new (...a: never[]) => Error, arg: RegExp) => {
      const e = await p.then(
        () => undefined,
        (x: unknown) => x,
      );
      assert.ok(e instanceof cls, `expected a ${cls.name}, got ${String(e)}`);
      assert.match((e as Error).message, arg);
    };
    await rejects(c.lease("a\udc80", file), TypeError, /name .*lone surrogate U\+DC80 at index 1/);
    await rejects(js["lease"]!(null, file), TypeError, /name must be a string, not null/);
    await rejects(js["lease"]!(42, file), TypeError, /name must be a string/);
    await rejects(js["lease"]!("agent", Buffer.from(file)), TypeError, /path must be a string/);
    await rejects(c.lease("agent", join(dir, "a\udc80.uai")), TypeError, /path .*lone surrogate/);
    await rejects(c.lease("agent", "a\u0000b"), TypeError, /path contains a NUL/);
    await rejects(c.lease("agent", ""), TypeError, /path must not be empty/);
    await rejects(js["lease"]!("agent", file, { wait: "x" }), TypeError, /wait must be a number/);
    await rejects(c.lease("agent", file, { wait: -1 }), RangeError, /wait must be between/);
    await rejects(c.lease("agent", file, { wait: Number.NaN }), RangeError, /wait/);
    await rejects(c.lease("agent", file, { wait: Infinity }), RangeError, /wait/);
    await rejects(js["lease"]!("agent", file, { ttl: "30" }), TypeError, /ttl must be a whole number/);
    await rejects(c.lease("agent", file, { ttl: 30.5 }), RangeError, /ttl/);
    await rejects(js["lease"]!("agent", file, { bind: "thread" }), TypeError, /bind must be "pid" or "none"/);
    await rejects(js["lease"]!("agent", file, null), TypeError, /options must be an object/);
    await rejects(js["withLease"]!("agent", file, "not a function"), TypeError, /fn must be a function/);
    await rejects(js["attach"]!("a\ud800b", file), TypeError, /name/);
    await rejects(js["detach"]!(7), TypeError, /name must be a string/);
    await rejects(js["detach"]!("agent", 7), TypeError, /leaseId must be a string/);
    await rejects(c.getLease("a\udc80"), TypeError, /canonicalName/);
    await rejects(js["verify"]!(undefined), TypeError, /name must be a string/);
    await rejects(c.sync("a\udc80"), TypeError, /name/);
    await rejects(js["sync"]!("agent", { timeoutMs: "1" }), TypeError, /timeoutMs/);
    await rejects(c.sync("agent", { timeoutMs: -1 }), RangeError, /timeoutMs/);
    await rejects(js["fetch"]!(null, file), TypeError, /memoryInstanceId must be a string/);
    await rejects(js["init"]!(undefined), TypeError, /path must be a string/);
    await rejects(js["branch"]!(file, 5), TypeError, /newPath must be a string/);
    await rejects(c.identify("/tmp/a\udc80"), TypeError, /path/);
    await rejects(js["lineage"]!(null), TypeError, /query/);
    await rejects(js["lineage"]!({ id: 5 }), TypeError, /query\.id must be a string/);
    assert.throws(() => new mep.Client({ socketPath: join(dir, "no.sock"), timeoutMs: -5 }), RangeError);
    assert.throws(() => new (mep.Client as unknown as new (o: unknown) => unknown)({ socketPath: 5 }), /socketPath must be a string/);
    // Good arguments get as far as the (missing) daemon.
    await assert.rejects(c.lease("agent", file, { ttl: 30, wait: 1.5, bind: "pid" }), mep.DaemonNotRunning);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
