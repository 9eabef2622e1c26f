// The config file is read as the `mep` CLI reads it: the same files are refused, with the same
// precedence over $MEP_SOCKET, and the same `socket` is found in the rest. The reader alone,
// then against the CLI itself ($MEP_BIN: `mep --json config`, `mep status`).
import { test } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { tmpdir } from "node:os";
import * as mep from "@mep/client";
import { MEP_BIN, binSkip } from "./harness.js";

/**
 * Config files (each character one byte) and what the CLI makes of them: the socket it finds
 * in the file (null: no socket key), or "error" (it exits 2). The same list as the Python
 * SDK's tests/test_config.py; checked below against the CLI itself.
 */
const CASES: [string, string | null][] = [
  ["socket = \"/a.sock\"\n", "/a.sock"],
  ["socket = \"/a.sock\"\n[table]\nsocket = \"no\"\n", "error"],
  ["socket = \"\"\n", ""],
  ["socket = true\n", "true"],
  ["socket = 1.5\n", "error"],
  ["socket = [1]\n", "error"],
  ["x = {a=1}\n", "error"],
  ["a.b = 1\n", "error"],
  ["x = 1979-05-27\n", "error"],
  ["x = 1979-05-27 07:32:00\n", "error"],
  ["x = 07:32:00\n", "error"],
  ["socket = inf\n", "error"],
  ["socket = \"\"\"/m\nl.sock\"\"\"\n", "/m\nl.sock"],
  ["socket = \"\"\"\n/first-nl.sock\"\"\"\n", "/first-nl.sock"],
  ["socket = '''\r\n/lit.sock'''\n", "/lit.sock"],
  ["socket = \"\"\"a\\\n    b\"\"\"\n", "ab"],
  ["socket = \"\"\"a\\ b\"\"\"\n", "error"],
  ["socket = \"\"\"a\"\"\"\"\"\n", "a\"\""],
  ["socket = \"\"\"a\"\"\"\"\"\"\n", "error"],
  ["socket = \"/a.sock\"\nsocket = \"/b.sock\"\n", "error"],
  ["\"socket\" = \"/q.sock\"\n", "/q.sock"],
  ["'socket' = '/q2.sock'\n", "/q2.sock"],
  ["socket = 0x1F\n", "31"],
  ["socket = 0b101\n", "5"],
  ["socket = +1_000\n", "1000"],
  ["socket = 1__0\n", "error"],
  ["socket = 01\n", "error"],
  ["socket = +0x1\n", "error"],
  ["socket = 9223372036854775807\n", "9223372036854775807"],
  ["socket = 9223372036854775808\n", "error"],
  ["socket = -9223372036854775808\n", "-9223372036854775808"],
  ["# comment \xc3\xa9\nsocket = \"/\xc3\xa9.sock\"\n", "/\u00e9.sock"],
  ["# \xff is no UTF-8, in a comment\nsocket = \"/c.sock\"\n", "/c.sock"],
  ["socket = \"\xff\"\n", "error"],
  ["socket = \"\xed\xa0\x80\"\n", "error"],
  ["\xc3\xa9 = 1\n", "error"],
  ["\xef\xbb\xbfsocket = \"/bom.sock\"\n", "/bom.sock"],
  ["socket = \"/a.sock\" junk\n", "error"],
  ["socket = \"\\e\"\n", "error"],
  ["socket = \"a\\u00e9\\U0001F600\\t\"\n", "a\u00e9\ud83d\ude00\t"],
  ["socket = \"\\uD800\"\n", "error"],
  ["socket = \"a\x01b\"\n", "error"],
  ["# \x7f\n", "error"],
  ["socket = \"/crlf.sock\"\r\n", "/crlf.sock"],
  ["socket = \"/cr.sock\"\r", "error"],
  ["  socket=\"/ws.sock\"\t# tab\n", "/ws.sock"],
  ["socket =\n", "error"],
  ["= 1\n", "error"],
  ["[[arr]]\n", "error"],
  ["[t\n", "error"],
  ["log_level = \"debug\"\nsocket = \"/two.sock\"\nstore = 42\n", "/two.sock"],
  ["socket = 'a\\b'\n", "a\\b"],
  ["socket = True\n", "error"],
  ["", null],
  ["\n# only a comment\n", null],
];

const bytes = (s: string) => Buffer.from(s, "latin1");

test("the config reader: the files the CLI accepts and refuses", () => {
  for (const [data, expected] of CASES) {
    if (expected === "error") assert.throws(() => mep.parseConfig(bytes(data), "c.toml"), mep.ConfigError, JSON.stringify(data));
    else assert.equal(mep.parseConfig(bytes(data), "c.toml")["socket"], expected ?? undefined, JSON.stringify(data));
  }
  assert.deepEqual(mep.parseConfig('a = true\nb = 0x10\nc = "x"\n'), { a: "true", b: "16", c: "x" });
});

test("a config file is read and checked even when $MEP_SOCKET is set, as the CLI does", () => {
  const dir = mkdtempSync(join(tmpdir(), "mep-ts-config-"));
  try {
    const env = { HOME: dir, MEP_SOCKET: "/env.sock" };
    assert.throws(() => mep.resolveSocketPath(undefined, { ...env, MEP_CONFIG: "/nonexistent.toml" }), mep.ConfigError);
    writeFileSync(join(dir, "bad.toml"), "socket = \n");
    assert.throws(() => mep.resolveSocketPath(undefined, { ...env, MEP_CONFIG: join(dir, "bad.toml") }), mep.ConfigError);
    assert.throws(() => new mep.Client({ env: { ...env, MEP_CONFIG: join(dir, "bad.toml") } }), mep.ConfigError);
    assert.throws(() => mep.resolveSocketPath(undefined, { ...env, MEP_CONFIG: dir }), /not a regular file/);
    mkdirSync(join(dir, ".config", "mep"), { recursive: true });
    writeFileSync(join(dir, ".config", "mep", "config.toml"), "[table]\n");
    assert.throws(() => mep.resolveSocketPath(undefined, env), mep.ConfigError); // the default file, when present
    writeFileSync(join(dir, ".config", "mep", "config.toml"), "socket = '/file.sock'\n");
    assert.deepEqual(mep.resolveSocketPath(undefined, env), { path: "/env.sock", source: "env MEP_SOCKET" });
    // An explicit socket path reads no config file.
    assert.deepEqual(mep.resolveSocketPath("/o.sock", { ...env, MEP_CONFIG: "/nonexistent.toml" }), { path: "/o.sock", source: "option" });
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("the module-level API rejects with ConfigError on a config file the CLI refuses", async () => {
  const saved = { MEP_SOCKET: process.env["MEP_SOCKET"], MEP_CONFIG: process.env["MEP_CONFIG"] };
  process.env["MEP_SOCKET"] = "/nonexistent/mepd.sock";
  process.env["MEP_CONFIG"] = "/nonexistent.toml";
  try {
    await assert.rejects(mep.status(), mep.ConfigError);
    await assert.rejects(mep.lease("agent", "/tmp/m.uai"), mep.ConfigError);
  } finally {
    for (const [k, v] of Object.entries(saved)) {
      if (v === undefined) delete process.env[k];
      else process.env[k] = v;
    }
  }
});

test("the same files refused and the same socket found as the CLI (mep --json config)", { skip: binSkip ?? false, timeout: 120000 }, () => {
  const dir = mkdtempSync(join(tmpdir(), "mep-ts-config-"));
  try {
    const base: Record<string, string> = { HOME: join(dir, "home"), XDG_RUNTIME_DIR: join(dir, "run"), PATH: process.env["PATH"] ?? "/usr/bin:/bin" };
    CASES.forEach(([data, expected], i) => {
      const file = join(dir, `c${i}.toml`);
      writeFileSync(file, bytes(data));
      const env = { ...base, MEP_CONFIG: file };
      const r = spawnSync(MEP_BIN, ["--json", "config"], { env, encoding: "utf8", timeout: 20000 });
      let cli: [number | null, string | null];
      if (r.status === 0) {
        const s = (JSON.parse(r.stdout) as { socket: { value: string; source: string } }).socket;
        cli = [0, s.source.startsWith("file") ? s.value : null];
      } else cli = [r.status, null];
      assert.deepEqual(cli, expected === "error" ? [2, null] : [0, expected], `the CLI's verdict on ${JSON.stringify(data)} changed: update CASES`);
      if (expected === "error") assert.throws(() => mep.resolveSocketPath(undefined, env), mep.ConfigError, JSON.stringify(data));
      else {
        const s = mep.resolveSocketPath(undefined, env);
        assert.equal(s.source.startsWith("file") ? s.path : null, expected, JSON.stringify(data));
      }
    });
    // $MEP_SOCKET set: a missing $MEP_CONFIG or an unparsable file is exit 2 for `mep status`, ConfigError here.
    writeFileSync(join(dir, "bad.toml"), "socket = \n");
    for (const [cfg, status] of [["/nonexistent.toml", 2], [join(dir, "bad.toml"), 2], [join(dir, "c0.toml"), 5]] as const) {
      const env = { ...base, MEP_SOCKET: join(dir, "nobody.sock"), MEP_CONFIG: cfg };
      assert.equal(spawnSync(MEP_BIN, ["status"], { env, timeout: 20000 }).status, status, cfg);
      if (status === 2) assert.throws(() => mep.resolveSocketPath(undefined, env), mep.ConfigError);
      else assert.equal(mep.resolveSocketPath(undefined, env).path, join(dir, "nobody.sock"));
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
