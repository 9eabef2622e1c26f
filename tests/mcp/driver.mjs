// A test's MCP client: the official TypeScript SDK's Client over its stdio transport,
// driven by the Python tests (tests/integration/test_mcp.py) one JSON command per line on
// standard input, one JSON answer per line on standard output:
//   {"id": 1, "op": "listTools"} -> {"id": 1, "ok": {...}} or {"id": 1, "error": {"code", "message"}}
// Started as `node driver.mjs '{"command": ..., "args": [...], "env": {...}, "cwd": ...}'`;
// it connects first (initialize) and says {"ready": true, "pid": <server pid>, ...}.
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StdioClientTransport } from '@modelcontextprotocol/sdk/client/stdio.js';
import {
  LoggingMessageNotificationSchema,
  ResourceListChangedNotificationSchema,
  ResourceUpdatedNotificationSchema,
} from '@modelcontextprotocol/sdk/types.js';
import readline from 'node:readline';

const spec = JSON.parse(process.argv[2]);
const out = (o) => process.stdout.write(JSON.stringify(o) + '\n');
const notifications = [];
const clientErrors = [];

const transport = new StdioClientTransport({
  command: spec.command,
  args: spec.args ?? [],
  env: spec.env ?? {},
  cwd: spec.cwd,
  stderr: 'pipe',
});
transport.stderr?.on('data', (d) => process.stderr.write(`[${spec.label ?? 'server'}] ${d}`));
let closed = false;
transport.onclose = () => { closed = true; };
const client = new Client({ name: spec.label ?? 'mep-test', version: '0.0.1' });
client.onerror = (e) => clientErrors.push(String(e?.message ?? e));
client.setNotificationHandler(LoggingMessageNotificationSchema, (n) => { notifications.push({ method: n.method, params: n.params }); });
client.setNotificationHandler(ResourceUpdatedNotificationSchema, (n) => { notifications.push({ method: n.method, params: n.params }); });
client.setNotificationHandler(ResourceListChangedNotificationSchema, (n) => { notifications.push({ method: n.method }); });

try {
  await client.connect(transport);
} catch (e) {
  out({ ready: false, error: String(e?.message ?? e) });
  process.exit(1);
}
out({
  ready: true,
  pid: transport.pid,
  serverVersion: client.getServerVersion(),
  capabilities: client.getServerCapabilities(),
  instructions: client.getInstructions() ?? null,
});

const timeout = spec.timeoutMs ?? 20000;
const ops = {
  listTools: () => client.listTools(undefined, { timeout }),
  callTool: (c) => client.callTool({ name: c.name, arguments: c.arguments ?? {} }, undefined, { timeout }),
  listResources: () => client.listResources(undefined, { timeout }),
  listResourceTemplates: () => client.listResourceTemplates(undefined, { timeout }),
  readResource: (c) => client.readResource({ uri: c.uri }, { timeout }),
  subscribe: (c) => client.subscribeResource({ uri: c.uri }, { timeout }),
  unsubscribe: (c) => client.unsubscribeResource({ uri: c.uri }, { timeout }),
  setLevel: (c) => client.setLoggingLevel(c.level, { timeout }),
  ping: () => client.ping({ timeout }),
  notifications: async () => ({ notifications: notifications.splice(0), errors: clientErrors.splice(0), closed }),
  close: async () => { await client.close(); return {}; },
};

const rl = readline.createInterface({ input: process.stdin });
for await (const line of rl) {
  let cmd;
  try {
    cmd = JSON.parse(line);
  } catch {
    continue;
  }
  const op = ops[cmd.op];
  if (!op) {
    out({ id: cmd.id, error: { code: 'driver', message: `unknown op ${cmd.op}` } });
    continue;
  }
  try {
    out({ id: cmd.id, ok: (await op(cmd)) ?? {} });
  } catch (e) {
    out({ id: cmd.id, error: { code: e?.code ?? null, message: String(e?.message ?? e) } });
  }
  if (cmd.op === 'close') break;
}
process.exit(0);
