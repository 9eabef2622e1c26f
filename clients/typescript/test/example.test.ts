// The example agent (examples/typescript_agent.ts), compiled with the tests, run as a user
// would: against an embedded mepd, and against a remote control plane that is stopped.
import { test } from "node:test";
import assert from "node:assert/strict";
import { spawn, type ChildProcess } from "node:child_process";
import { existsSync, readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { Sandbox, binSkip, waitFor } from "./harness.js";

const opts = { skip: binSkip ?? false, timeout: 60000 };
const example = fileURLToPath(new URL("../../../examples/typescript_agent.js", import.meta.url));

function run(sb: Sandbox, socket: string, args: string[]) {
  const child: ChildProcess = spawn(process.execPath, [example, ...args], {
    env: { ...sb.env, MEP_SOCKET: socket },
    cwd: sb.dir,
    stdio: ["ignore", "pipe", "pipe"],
  });
  const out = { stdout: "", stderr: "", code: undefined as number | null | undefined };
  child.stdout!.setEncoding("utf8");
  child.stderr!.setEncoding("utf8");
  child.stdout!.on("data", (c: string) => (out.stdout += c));
  child.stderr!.on("data", (c: string) => (out.stderr += c));
  const exited = new Promise<number | null>((r) =>
    child.once("exit", (code: number | null) => {
      out.code = code;
      r(code);
    }),
  );
  return { child, out, exited };
}

test("the example agent works and releases (embedded mepd)", opts, async () => {
  assert.ok(existsSync(example), example);
  await using sb = Sandbox.create();
  const d = await sb.startMepd();
  const r = run(sb, d.socket, ["Example Agent", "example.uai", "3"]);
  try {
    const code = await Promise.race([r.exited, new Promise((res) => setTimeout(() => res("timeout"), 20000))]);
    assert.equal(code, 0, `exit ${String(code)}\n${r.out.stdout}\n${r.out.stderr}`);
    assert.match(r.out.stdout, /holding "exampleagent"/);
    assert.match(r.out.stdout, /done/);
    assert.equal(readFileSync(sb.path("example.uai"), "utf8").split("\n").filter((l) => l.startsWith("step ")).length, 3);
    assert.deepEqual(await d.client.leases(), []);
  } finally {
    r.child.kill("SIGKILL");
  }
});

test("the example agent stops on loss when the control plane is stopped", opts, async () => {
  await using sb = Sandbox.create();
  const server = await sb.startServer();
  const d = await sb.startMepd({ controlPlane: server.url, tokenFile: sb.tokenFile(server, "t") });
  const r = run(sb, d.socket, ["stoppable", "stoppable.uai"]);
  try {
    await waitFor(() => r.out.stdout.includes("holding"), 15000, "the example to hold its lease");
    server.proc.signal("SIGSTOP");
    const code = await Promise.race([r.exited, new Promise((res) => setTimeout(() => res("timeout"), 20000))]);
    assert.equal(code, 4, `exit ${String(code)}\n${r.out.stdout}\n${r.out.stderr}`);
    assert.match(r.out.stderr, /lease at risk/);
    assert.match(r.out.stderr, /lease lost \(.+\): stopped/);
  } finally {
    server.proc.signal("SIGCONT");
    r.child.kill("SIGKILL");
  }
});
